#!/usr/bin/env bash
# kvq bench-serve against kvq serve on loopback (tinydoc): 8 streamed requests at
# concurrency 4 all succeed, with prompts of exactly the size asked for and output
# tokens equal to what the server counted (its /metrics counters before and after);
# a shared prefix is the same tokens in every prompt and the rest differs (the
# server's prefix cache hits exactly that many); a closed port and a server that
# accepts but never answers give counted errors and exit status 2 instead of a hang;
# bad flags get one clear error; a wrong --api-key gives counted 401s; a fake server
# (python3) that answers garbage, a 500, a cut or unfinished stream, bad JSON or an error
# event gives each its error kind, and one sending several tokens a chunk is counted
# from usage.
#
# bench-serve's default ignore_eos + min_tokens (completions and chat): every answer runs
# to --output-tokens, as the server counts it. The other runs send max_tokens alone
# (--no-ignore-eos), the form for servers that refuse those fields.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinydoc-q8_0.gguf
need_asset "$model"
for tool in curl jq; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is not installed"; exit 77; }
done
srv_pid="" fake_pid=""
trap '[ -n "$fake_pid" ] && kill $fake_pid 2>/dev/null
  [ -n "$srv_pid" ] && kill -CONT $srv_pid 2>/dev/null && kill -TERM $srv_pid 2>/dev/null; wait; rm -rf "$tmp"' EXIT

serve_start server -m "$model" -t 2 -c 1024 --api-key sekrit || exit 1
url=http://127.0.0.1:$port
export KVQ_API_KEY=sekrit # bench-serve's default key, as the server's
counter() { curl -s -H "Authorization: Bearer sekrit" "$url/metrics" | sed -n "s/^kvq_$1 //p"; }
bench() { # OUT ARGS...: bench-serve --json into $tmp/OUT.json; its exit status in $rc
  local out=$1; shift
  timeout 60 "$kvq" bench-serve -m "$model" --json "$@" >"$tmp/$out.json" 2>"$tmp/$out.err"
  rc=$?
}
field() { jq -r "$2" "$tmp/$1.json"; }

# ---- 8 requests at concurrency 4 ----
gen0=$(counter generated_tokens_total) prompt0=$(counter prompt_tokens_total)
bench run --url "$url" --concurrency 4 --requests 8 --prompt-tokens 32 --output-tokens 8 --no-ignore-eos --seed 3
gen1=$(counter generated_tokens_total) prompt1=$(counter prompt_tokens_total)
check "bench-serve exits 0 (got $rc)" [ "$rc" -eq 0 ]
[ "$rc" -eq 0 ] || cat "$tmp/run.err" "$tmp/run.json"
check "8 successful requests" [ "$(field run .successful_requests)" = 8 ]
check "no failed requests" [ "$(field run .failed_requests)" = 0 ]
check "no errors" [ "$(field run '.errors | length')" = 0 ]
out=$(field run .total_output_tokens)
check "output tokens ($out) = the server's generated_tokens_total delta ($gen1 - $gen0)" \
  [ "$out" -gt 0 -a "$out" = $((${gen1%.*} - ${gen0%.*})) ]
check "at most 8 output tokens a request" [ "$out" -le 64 ]
check "prompts of exactly 32 tokens as the server counts them" [ "$(field run .total_prompt_tokens)" = 256 ]
check "the server's prompt_tokens_total agrees" [ $((${prompt1%.*} - ${prompt0%.*})) = 256 ]
chunks=$(field run .output_chunks)
check "every request sent text, no chunk without a token ($chunks chunks)" [ "$chunks" -ge 8 -a "$chunks" -le "$out" ]
check "TTFT, ITL and TPOT measured" jq -e '.ttft_ms.p50 > 0 and .ttft_ms.p99 >= .ttft_ms.p50 and
  .itl_ms.p50 > 0 and .tpot_ms.p90 > 0 and .e2e_ms.p99 >= .ttft_ms.p99' "$tmp/run.json"
check "peak KV bytes in use seen on /metrics" jq -e '.peak_kv_bytes_in_use > 0' "$tmp/run.json"
check "no progress text on a non-terminal stderr" [ ! -s "$tmp/run.err" ]

# the table: same run, human form, the key given as a flag
KVQ_API_KEY='' timeout 60 "$kvq" bench-serve --api-key sekrit -m "$model" --port "$port" --concurrency 2 --requests 2 --prompt-tokens 16 \
  --output-tokens 4 --no-ignore-eos >"$tmp/table.txt" 2>&1
check "the table reports 2 of 2" grep -q "successful requests *2 of 2" "$tmp/table.txt"
check "the table reports no errors" grep -q "^errors *none" "$tmp/table.txt"
check "the table has TTFT" grep -q "^TTFT " "$tmp/table.txt"

# ---- the default ignore_eos and min_tokens: every answer is --output-tokens long ----
for kind in completion chat; do
  flag=""; [ $kind = chat ] && flag=--chat
  gen0=$(counter generated_tokens_total)
  bench "eos-$kind" --url "$url" $flag --concurrency 2 --requests 4 --prompt-tokens 16 --output-tokens 40 --seed 5
  gen1=$(counter generated_tokens_total)
  check "ignore_eos ($kind): exit 0 (got $rc), 4 answers of exactly 40 tokens" jq -e '.ignore_eos and
    .successful_requests == 4 and .total_output_tokens == 160 and .short_outputs == 0' "$tmp/eos-$kind.json"
  [ "$rc" -eq 0 ] || cat "$tmp/eos-$kind.err" "$tmp/eos-$kind.json"
  check "ignore_eos ($kind): the server generated 160 tokens (${gen1%.*} - ${gen0%.*})" \
    [ $((${gen1%.*} - ${gen0%.*})) = 160 ]
done

# ---- sampled answers: --temperature sends it with a seed a request ----
bench temp --url "$url" --concurrency 2 --requests 4 --prompt-tokens 16 --output-tokens 40 --temperature 1 --seed 5 \
  --top-p 0.9 --top-k 40
check "temperature 1, top_p 0.9, top_k 40: exit 0 (got $rc), 4 answers of 40 tokens" jq -e '.temperature == 1 and
  (.top_p - 0.9 | fabs) < 1e-6 and .top_k == 40 and .successful_requests == 4 and .total_output_tokens == 160' \
  "$tmp/temp.json"

# ---- a wrong key: every request a 401 ----
bench badkey --url "$url" --api-key wrong --concurrency 2 --requests 3 --prompt-tokens 16 --output-tokens 4 --no-ignore-eos
check "wrong key: exit status 2 (got $rc)" [ "$rc" -eq 2 ]
check "wrong key: 3 http_4xx errors with the server's message" jq -e '.errors == {"http_4xx": 3} and
  (.error_messages.http_4xx | test("^HTTP 401: Incorrect API key"))' "$tmp/badkey.json"

# ---- a shared prefix: one at a time, so requests 2 and 3 find request 1 in the prefix cache ----
bench prefix --url "$url" --concurrency 1 --requests 3 --prompt-tokens 320 --shared-prefix-tokens 300 \
  --output-tokens 2 --no-ignore-eos --seed 11
cached=$(field prefix .cached_prompt_tokens)
check "shared prefix: 3 requests succeed" [ "$(field prefix .successful_requests)" = 3 ]
check "shared prefix: requests 2 and 3 reuse the 300 shared tokens and not more (cached $cached)" \
  [ "$cached" -ge 600 -a "$cached" -le 603 ]
bench unique --url "$url" --concurrency 1 --requests 3 --prompt-tokens 320 --output-tokens 2 --no-ignore-eos --seed 12
cached=$(field unique .cached_prompt_tokens)
check "without a shared prefix only BOS is in common (cached $cached)" [ "$cached" -le 3 ]

# ---- chat ----
bench chat --url "$url" --chat --concurrency 2 --requests 2 --prompt-tokens 24 --output-tokens 4 --no-ignore-eos
check "chat: 2 successful requests, prompts grown by the template" \
  jq -e '.successful_requests == 2 and .total_prompt_tokens > 48' "$tmp/chat.json"

# ---- a server that accepts connections but never answers (stopped) ----
kill -STOP $srv_pid
bench silent --url "$url" --concurrency 2 --requests 2 --prompt-tokens 16 --output-tokens 4 --no-ignore-eos \
  --timeout 1 --connect-timeout 1
kill -CONT $srv_pid
check "silent server: exit status 2, no hang (got $rc)" [ "$rc" -eq 2 ]
check "silent server: 2 timeouts counted" [ "$(field silent .errors.timeout)" = 2 ]
check "silent server: the report says so" grep -q "2 of 2 requests failed" "$tmp/silent.err"

# ---- a closed port ----
kill -TERM $srv_pid
wait $srv_pid
srv_pid=""
bench closed --url "$url" --concurrency 4 --requests 8 --prompt-tokens 32 --output-tokens 8
check "closed port: exit status 2, no hang (got $rc)" [ "$rc" -eq 2 ]
check "closed port: 8 connection errors" \
  jq -e '.errors == {"connect": 8} and .failed_requests == 8 and .successful_requests == 0' "$tmp/closed.json"
check "closed port: the reason is given" jq -e '.error_messages.connect | test("refused")' "$tmp/closed.json"

# ---- a misbehaving server (python3): each failure mode by its kind ----
if command -v python3 >/dev/null; then
  cat >"$tmp/fake.py" <<'PY'
import json, socket, socketserver, sys
def chunk(obj):
    return ("data: " + json.dumps(obj) + "\n\n").encode()
def text(t):
    return chunk({"choices": [{"index": 0, "text": t, "finish_reason": None}]})
USAGE = chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}})
class H(socketserver.StreamRequestHandler):
    def handle(self):
        head = b""
        while b"\r\n\r\n" not in head:
            b = self.request.recv(65536)
            if not b: return
            head += b
        head, body = head.split(b"\r\n\r\n", 1)
        n = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"): n = int(line.split(b":")[1])
        while len(body) < n: body += self.request.recv(65536)
        if not head.startswith(b"POST"):
            self.request.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"); return
        mode = json.loads(body)["model"]
        w = self.request.sendall
        sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        if mode == "garbage": w(b"hello there\r\n\r\n")
        elif mode == "http500":
            e = json.dumps({"error": {"message": "engine on fire"}}).encode()
            w(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % len(e) + e)
        elif mode == "cut":  # chunked, closed inside the stream
            c = text("one")
            w(sse + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(c) + c + b"\r\n")
        elif mode == "nodone":  # read until close, never [DONE]
            w(sse + b"\r\n" + text("a") + USAGE)
        elif mode == "badjson": w(sse + b"\r\n" + b"data: {oops\n\n")
        elif mode == "streamerr": w(sse + b"\r\n" + text("a") + chunk({"error": {"message": "boom"}}))
        elif mode == "multi":  # sized body, 6 tokens in 2 chunks, a ping comment, CRLF lines
            b = b": ping\r\n\r\n" + text("abc").replace(b"\n", b"\r\n") + text("def") + USAGE + b"data: [DONE]\n\n"
            w(sse + b"Content-Length: %d\r\n\r\n" % len(b) + b)
class S(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
s = S(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
PY
  python3 "$tmp/fake.py" >"$tmp/fake.port" 2>"$tmp/fake.err" &
  fake_pid=$!
  for _ in $(seq 50); do [ -s "$tmp/fake.port" ] && break; sleep 0.1; done
  furl=http://127.0.0.1:$(cat "$tmp/fake.port")
  fake() { # MODE KIND: 2 requests, both failing as KIND
    bench "fake-$1" --url "$furl" --model-name "$1" --concurrency 2 --requests 2 --prompt-tokens 8 --output-tokens 6 --timeout 5
    check "fake server '$1': exit 2 (got $rc) and 2 '$2' errors" [ "$rc" -eq 2 -a "$(field "fake-$1" ".errors.$2")" = 2 ]
  }
  fake garbage protocol
  fake http500 http_5xx
  fake cut closed
  fake nodone incomplete
  fake badjson protocol
  fake streamerr stream_error
  check "the server's error message is reported" jq -e '.error_messages.http_5xx == "HTTP 500: engine on fire"' \
    "$tmp/fake-http500.json"
  bench multi --url "$furl" --model-name multi --concurrency 2 --requests 4 --prompt-tokens 8 --output-tokens 6
  check "several tokens a chunk: 4 successes, tokens from usage (24), 3 a chunk, no /metrics" jq -e '
    .successful_requests == 4 and .total_output_tokens == 24 and .output_chunks == 8 and .tokens_per_chunk == 3
    and .itl_ms.p50 >= 0 and .peak_kv_bytes_in_use == null and .short_outputs == 0' "$tmp/multi.json"
  kill $fake_pid
  wait $fake_pid 2>/dev/null
  fake_pid=""
else
  echo "SKIP (misbehaving server part): python3 is not installed"
fi

# ---- bad flags ----
expect_error "no model" "needs the served model" -- "$kvq" bench-serve --url "$url"
expect_error "unknown flag" "unknown option '--clients'" -- "$kvq" bench-serve -m "$model" --clients 4
expect_error "concurrency 0" "invalid value '0' for --concurrency" -- "$kvq" bench-serve -m "$model" --concurrency 0
expect_error "shared prefix too long" "must be smaller than --prompt-tokens" -- \
  "$kvq" bench-serve -m "$model" --prompt-tokens 32 --shared-prefix-tokens 32
expect_error "https" "https is not supported" -- "$kvq" bench-serve -m "$model" --url https://127.0.0.1:1
expect_error "url and port" "either --url or --host/--port" -- "$kvq" bench-serve -m "$model" --url "$url" --port 80
expect_error "a missing value" "needs a value" -- "$kvq" bench-serve -m "$model" --requests
expect_error "a bad URL port" "port must be a number" -- "$kvq" bench-serve -m "$model" --url http://127.0.0.1:99999

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
