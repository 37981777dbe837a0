#!/usr/bin/env bash
# kvq serve end to end, on loopback: the official openai npm client (chat,
# completions, streaming, usage); curl for bad requests (each a 4xx in OpenAI's
# error shape while the server keeps serving); 8 concurrent greedy requests with
# --kv-bits 8,4 equal to the same requests one at a time; a prefix-cache hit
# (cached_tokens > 0, same text as with the cache off), a hit from disk after a
# restart and one from host memory after an eviction; 256 streams at once (mixed lengths, an eighth dropped; K8V4, and f16 with
# prefix-cache hits) each equal to its request alone; 32 streams of which a third
# disconnect, with KV blocks back to zero and RSS back near its baseline.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
model=$shared/models/tinydoc-q8_0.gguf
text=$shared/data/wikitext2-test.txt
need_asset "$model" "$text"
for tool in curl node npm; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is not installed"; exit 77; }
done
# The official client, installed once into tests/server/node_modules (ignored by git).
if [ ! -d "$here/server/node_modules/openai" ]; then
  if ! timeout 180 npm install --prefix "$here/server" --no-audit --no-fund --no-package-lock --silent >/dev/null 2>&1; then
    echo "SKIP: cannot install the openai npm package (no registry?)"
    exit 77
  fi
fi

srv_pid=""
trap '[ -n "$srv_pid" ] && kill -TERM $srv_pid 2>/dev/null; wait; rm -rf "$tmp"' EXIT

start_server() { # NAME ARGS...: starts kvq serve on a free port, sets port and srv_pid
  serve_start "$1" -m "$model" -t 2 "${@:2}" || exit 1
}
stop_server() {
  kill -TERM $srv_pid
  if wait $srv_pid; then ok "server stops cleanly on SIGTERM"; else bad "server exit status $? on SIGTERM"; fi
  srv_pid=""
}
client() { # MODE ARGS...: runs the node client, counting its ok/FAIL lines
  node "$here/server/client.mjs" "$1" "$port" "${@:2}" >"$tmp/client.out" 2>&1
  cat "$tmp/client.out"
  passed=$((passed + $(grep -c '^ok:' "$tmp/client.out")))
  failed=$((failed + $(grep -c '^FAIL:' "$tmp/client.out")))
}

# ---- the official client (with response_format and tools), and bad requests ------
start_server main --api-key sekrit -c 1024 --max-body-mb 1
client official sekrit
client structured sekrit
expect() { # DESCRIPTION STATUS CURL-ARGS...: an OpenAI error object with that status
  local what=$1 want=$2; shift 2
  local got
  got=$(curl -s -o "$tmp/body" -w '%{http_code}' "$@")
  if [ "$got" = "$want" ] && jq -e '.error.message | type == "string"' "$tmp/body" >/dev/null 2>&1 &&
     jq -e '.error | has("type") and has("param") and has("code")' "$tmp/body" >/dev/null; then ok "$what"
  else bad "$what (HTTP $got)"; cat "$tmp/body"; echo; fi
}
url=http://127.0.0.1:$port
auth=(-H "Authorization: Bearer sekrit" -H "Content-Type: application/json")
expect "malformed JSON is a 400" 400 "${auth[@]}" -d '{"prompt": "a",' "$url/v1/completions"
expect "a body that is not an object is a 400" 400 "${auth[@]}" -d '"hello"' "$url/v1/completions"
expect "max_tokens as a string is a 400" 400 "${auth[@]}" -d '{"prompt":"a","max_tokens":"5"}' "$url/v1/completions"
expect "messages as a string is a 400" 400 "${auth[@]}" -d '{"messages":"hi"}' "$url/v1/chat/completions"
expect "n above 128 is a 400" 400 "${auth[@]}" -d '{"prompt":"a","n":129}' "$url/v1/completions"
expect "a malformed extension field is a 400" 400 "${auth[@]}" -d '{"prompt":"a","ignore_eos":"yes"}' "$url/v1/completions"
expect "invalid UTF-8 is a 400" 400 "${auth[@]}" --data-binary $'{"prompt":"\xff\xfe"}' "$url/v1/completions"
head -c 3000000 "$text" | tr -d '"\\\n' | tr -c '[:print:]' ' ' >"$tmp/long.txt"
printf '{"prompt":"%s"}' "$(head -c 20000 "$tmp/long.txt")" >"$tmp/long.json"
expect "a prompt longer than the context is a 400" 400 "${auth[@]}" --data-binary @"$tmp/long.json" "$url/v1/completions"
grep -q context_length_exceeded "$tmp/body" && ok "...with code context_length_exceeded" || bad "no context_length_exceeded code"
printf '{"prompt":"%s"}' "$(head -c 1500000 "$tmp/long.txt")" >"$tmp/huge.json"
expect "a body over --max-body-mb is a 413" 413 "${auth[@]}" --data-binary @"$tmp/huge.json" "$url/v1/completions"
expect "a wrong API key is a 401" 401 -H "Authorization: Bearer nope" "$url/v1/models"
expect "a missing API key is a 401" 401 -d '{"prompt":"a"}' "$url/v1/completions"
expect "an unknown path is a 404" 404 "${auth[@]}" "$url/v1/engines"
expect "GET on completions is a 405" 405 "${auth[@]}" "$url/v1/completions"
expect "an unknown response_format type is a 400" 400 "${auth[@]}" -d '{"prompt":"a","response_format":{"type":"xml"}}' "$url/v1/completions"
expect "a schema that is not JSON Schema is a 400" 400 "${auth[@]}" -d '{"prompt":"a","response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"frob"}}}}' "$url/v1/completions"
expect "tools on completions is a 400" 400 "${auth[@]}" -d '{"prompt":"a","tools":[{"type":"function","function":{"name":"f"}}]}' "$url/v1/completions"
expect "tool_choice required without tools is a 400" 400 "${auth[@]}" -d '{"messages":[{"role":"user","content":"a"}],"tool_choice":"required"}' "$url/v1/chat/completions"
expect "a tool without a name is a 400" 400 "${auth[@]}" -d '{"messages":[{"role":"user","content":"a"}],"tools":[{"type":"function","function":{}}]}' "$url/v1/chat/completions"
code=$(curl -s -o "$tmp/body" -w '%{http_code}' "${auth[@]}" "http://127.0.0.1:$port//v1//models/")
[ "$code" = 200 ] && grep -q tinydoc "$tmp/body" && ok "//v1//models routes" || bad "//v1//models: $code"
code=$(curl -s -o /dev/null -w '%{http_code}' "$url/health")
[ "$code" = 200 ] && ok "/health needs no key" || bad "/health: $code"
curl -s "${auth[@]}" "$url/metrics" >"$tmp/metrics"
for m in requests_total prompt_tokens_total generated_tokens_total queue_length requests_waiting_for_memory running_sequences kv_bytes_in_use \
         kv_budget_bytes prefix_cache_hits_total prefix_cache_misses_total prefix_cache_tokens_total prefix_cache_bytes; do
  grep -q "^kvq_$m " "$tmp/metrics" || bad "/metrics lacks kvq_$m"
done
ok "/metrics has the kvq_ series"
code=$(curl -s -o "$tmp/body" -w '%{http_code}' "${auth[@]}" -d '{"prompt":"The kernel","max_tokens":4}' "$url/v1/completions")
[ "$code" = 200 ] && ok "still serving after the bad requests" || bad "after bad requests: $code"
stop_server

# ---- the fields and endpoints beyond plain completions (tinydoc-f16 against the refs) --
refs=$shared/refs/tinydoc
model_f16=$shared/models/tinydoc-f16.gguf
if [ -f "$refs/refs.json" ] && [ -f "$model_f16" ]; then
  model_q8=$model; model=$model_f16
  start_server ext --embeddings -c 1024
  client extensions "$refs"
  url=http://127.0.0.1:$port
  for _ in 1 2; do
    code=$(curl -s -o "$tmp/body" -w '%{http_code}' -d '{"prompt":"a","max_tokens":1,"frobnicate":1}' "$url/v1/completions")
    [ "$code" = 200 ] && ok "an unknown field is accepted" || bad "unknown field: $code $(cat "$tmp/body")"
  done
  n=$(grep -c "ignoring the request field 'frobnicate' (unknown" "$tmp/ext.log")
  [ "$n" = 1 ] && ok "...and logged once" || bad "logged $n times"
  expect "GET on /tokenize is a 405" 405 "$url/tokenize"
  expect "/tokenize without content is a 400" 400 -d '{"text":"a"}' "$url/tokenize"
  expect "embeddings of an empty list is a 400" 400 -d '{"input":[]}' "$url/v1/embeddings"
  stop_server
  start_server strict --strict-api -c 1024
  url=http://127.0.0.1:$port
  expect "--strict-api: an unknown field is a 400" 400 -d '{"prompt":"a","frobnicate":1}' "$url/v1/completions"
  expect "--strict-api: ignore_eos is a 400" 400 -d '{"prompt":"a","ignore_eos":true}' "$url/v1/completions"
  expect "without --embeddings, /v1/embeddings is a 501" 501 -d '{"input":"a"}' "$url/v1/embeddings"
  code=$(curl -s -o "$tmp/body" -w '%{http_code}' -d '{"prompt":"a","max_tokens":2,"n":2,"top_k":5}' "$url/v1/completions")
  [ "$code" = 200 ] && ok "--strict-api still takes n and top_k" || bad "--strict-api: $code $(cat "$tmp/body")"
  code=$(curl -s -o "$tmp/body" -w '%{http_code}' -d '{"messages":[{"role":"user","content":"a"}],"max_tokens":40,"n":2,"response_format":{"type":"json_schema","json_schema":{"name":"b","schema":{"type":"boolean"}}}}' "$url/v1/chat/completions")
  [ "$code" = 200 ] && node -e 'const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
    process.exit(r.choices.length === 2 && r.choices.every((c) => typeof JSON.parse(c.message.content) === "boolean") ? 0 : 1)' "$tmp/body" \
    && ok "--strict-api takes response_format (n=2, each choice a boolean)" || bad "--strict-api response_format: $code $(cat "$tmp/body")"
  stop_server
  model=$model_q8
else
  echo "SKIP (part): tinydoc-f16.gguf or refs/tinydoc missing under $shared"
fi

# ---- continuous batching with a quantized cache ---------------------------------
start_server batch --kv-bits 8,4 --max-num-seqs 8 --prefix-cache-mb 0 -c 2048
client concurrent "$text"
# n = 3 choices fork one quantized sequence: greedy, all three equal the n = 1 answer
printf '{"prompt":"%s","max_tokens":40,"temperature":0}' "$(head -c 3000 "$tmp/long.txt")" >"$tmp/n1.json"
sed 's/}$/,"n":3}/' "$tmp/n1.json" >"$tmp/n3.json"
one=$(curl -s --data-binary @"$tmp/n1.json" "http://127.0.0.1:$port/v1/completions" | jq -c '[.choices[].text]')
three=$(curl -s --data-binary @"$tmp/n3.json" "http://127.0.0.1:$port/v1/completions" | jq -c '[.choices[].text]')
[ "$(jq -c 'unique' <<<"$three")" = "$one" ] && [ "$(jq length <<<"$three")" = 3 ] && ok "n=3 on K8V4: three copies of the n=1 text" ||
  bad "n=3 on K8V4: $three vs $one"
# clients that leave n=4 streams and a list of n=3 choices early: every forked sequence is freed
sed 's/}$/,"n":4,"stream":true,"max_tokens":300,"ignore_eos":true}/; s/"max_tokens":40,//' "$tmp/n1.json" >"$tmp/n4s.json"
pids=""
for _ in 1 2 3; do curl -sN --max-time 1.5 --data-binary @"$tmp/n4s.json" "http://127.0.0.1:$port/v1/completions" >/dev/null 2>&1 & pids="$pids $!"; done
curl -s --max-time 0.3 -d '{"prompt":["The kernel","The module"],"n":3,"max_tokens":300,"ignore_eos":true}' \
  "http://127.0.0.1:$port/v1/completions" >/dev/null 2>&1 & pids="$pids $!"
wait $pids
for _ in $(seq 100); do
  blocks=$(curl -s "http://127.0.0.1:$port/metrics" | awk '$1 == "kvq_kv_blocks_in_use" {print $2}')
  [ "$blocks" = 0 ] && break
  sleep 0.1
done
[ "$blocks" = 0 ] && ok "choices of clients that left are freed (no KV blocks in use)" || bad "$blocks KV blocks left"
stop_server

# ---- 256 streams at once: mixed lengths, disconnects, prefix-cache hits ----------
# Exact equality holds where a hit restores the very rows a prefill writes: f16 rows in
# live entries. (With a quantized cache's residual window, a prefix cut back from a
# longer entry holds packed rows where a fresh prefill's window holds f16 ones; with
# 8-bit entries, the rows went through 8 bits: both are close, not bit for bit.)
start_server many --kv-bits 8,4 --max-num-seqs 256 --prefix-cache-mb 0 -c 1024
client many "$text"
stop_server
start_server many_hits --max-num-seqs 256 --prefix-cache-mb 64 --prefix-cache-bits 16 -c 1024
client many "$text" hits
stop_server

# ---- back-pressure: a small KV budget makes requests wait, never corrupts them ------
start_server budget --kv-budget-mb 8 --max-num-seqs 8 --prefix-cache-mb 0 -c 2048
client concurrent "$text"
url=http://127.0.0.1:$port
grep -q "wait for KV memory: [0-9]* sequences run" "$tmp/budget.log" && ok "the log says when requests wait for KV memory" ||
  bad "no 'wait for KV memory' line"
curl -s "$url/metrics" | grep -q "^kvq_requests_waiting_for_memory 0$" && ok "...and the gauge is back at 0" ||
  bad "requests_waiting_for_memory: $(curl -s "$url/metrics" | grep waiting_for_memory)"
printf '{"prompt":"%s","max_tokens":4}' "$(head -c 4000 "$tmp/long.txt")" >"$tmp/big.json"
expect "a prompt that can never fit the KV budget is a 400" 400 --data-binary @"$tmp/big.json" "$url/v1/completions"
grep -q "budget" "$tmp/body" && ok "...saying why" || bad "no reason given: $(cat "$tmp/body")"
stop_server

# ---- a full queue is a 503; a waiting stream gets ': ping' --------------------------
# The first request must outlast the 1 s ping interval on any machine: an 8800-token
# prompt (about 5 s of prefill here; its answer may end at once).
start_server limits --max-num-seqs 1 --max-queue 1 --ping-interval 1 --prefix-cache-mb 0 -c 12288
url=http://127.0.0.1:$port
metric() { curl -s "http://127.0.0.1:$port/metrics" | awk -v m="kvq_$1" '$1 == m {print $2}'; }
wait_metric() { # NAME VALUE: up to 30 s
  for _ in $(seq 300); do [ "$(metric "$1")" = "$2" ] && return 0; sleep 0.1; done
  return 1
}
printf '{"prompt":"%s","max_tokens":400,"temperature":0,"stream":true}' "$(head -c 24000 "$tmp/long.txt")" >"$tmp/a.json"
curl -sN "$url/v1/completions" --data-binary @"$tmp/a.json" >"$tmp/a.out" & a_pid=$!
wait_metric running_sequences 1 || bad "the first request never ran"
curl -sN "$url/v1/completions" -d '{"prompt":"The kernel","max_tokens":8,"stream":true}' >"$tmp/b.out" & b_pid=$!
wait_metric queue_length 1 || bad "the second request never queued"
expect "a request beyond --max-queue is a 503" 503 -d '{"prompt":"x","max_tokens":1}' "$url/v1/completions"
for _ in $(seq 100); do grep -q '^: ping' "$tmp/b.out" && break; sleep 0.1; done
grep -q '^: ping' "$tmp/b.out" && ok "a waiting stream gets ': ping' comments" || bad "no ping on a waiting stream"
kill $a_pid; wait $a_pid 2>/dev/null # the client leaves: its sequence is freed, the waiting one runs
wait $b_pid
grep -q '^data: \[DONE\]' "$tmp/b.out" && ok "the waiting stream then completes" || bad "waiting stream: $(cat "$tmp/b.out")"
wait_metric running_sequences 0 && wait_metric kv_blocks_in_use 0 && ok "idle again with no KV blocks in use" ||
  bad "blocks left: $(metric kv_blocks_in_use)"
grep -q "client went away" "$tmp/limits.log" && ok "the dropped client's sequence was freed" || bad "no 'client went away' line"
stop_server

# ---- prefix cache: hit in memory, same text as without, hit from disk -------------
head -c 4000 "$text" | tr -s ' \n' ' ' >"$tmp/prefix.txt" # about 1500 tokens
start_server nocache --prefix-cache-mb 0
client prefix "$tmp/prefix.txt" "Who is Robert Boulter?"; cp "$tmp/client.out" "$tmp/ref.json"
stop_server
# (--prefix-cache-bits 16: entries in the live format, so the text must be exactly the same)
start_server cache --prefix-cache-dir "$tmp/pc" --prefix-cache-bits 16
client prefix "$tmp/prefix.txt" "Which play did he star in?" >/dev/null
bytes16=$(metric prefix_cache_bytes)
client prefix "$tmp/prefix.txt" "Who is Robert Boulter?"; cp "$tmp/client.out" "$tmp/hit.json"
stop_server
cached=$(jq .cached "$tmp/hit.json")
prompt_n=$(jq .prompt "$tmp/hit.json")
[ "$cached" -gt 1000 ] 2>/dev/null && ok "second request hits the prefix cache ($cached of $prompt_n tokens)" || bad "no hit: $(cat "$tmp/hit.json")"
grep -q "cache_fetch HIT cached=$cached new=$((prompt_n - cached))" "$tmp/cache.log" && ok "cache_fetch HIT log line" || bad "no cache_fetch HIT line"
grep -q "cache_store tokens=" "$tmp/cache.log" && ok "cache_store log line" || bad "no cache_store line"
[ "$(jq .text "$tmp/hit.json")" = "$(jq .text "$tmp/ref.json")" ] && ok "same greedy text with and without the cache" ||
  bad "cache changed the text: $(jq .text "$tmp/hit.json") vs $(jq .text "$tmp/ref.json")"
ls "$tmp"/pc/*.kvq >/dev/null 2>&1 && ok "entries persisted" || bad "no files in --prefix-cache-dir"
echo garbage >"$tmp/pc/0000000000000000-0123456789abcdef.kvq" # a corrupt entry is skipped, not loaded
start_server disk --prefix-cache-dir "$tmp/pc" --prefix-cache-bits 16
client prefix "$tmp/prefix.txt" "Who is Robert Boulter?"; cp "$tmp/client.out" "$tmp/disk.json"
stop_server
[ "$(jq .cached "$tmp/disk.json")" -gt 1000 ] 2>/dev/null && ok "hit from disk after a restart" || bad "no hit from disk: $(cat "$tmp/disk.json")"
[ "$(jq .text "$tmp/disk.json")" = "$(jq .text "$tmp/ref.json")" ] && ok "same text from the disk entry" || bad "disk entry changed the text"
grep -q "skipping .*0123456789abcdef.kvq" "$tmp/disk.log" && ok "corrupt entry skipped with a log line" || bad "corrupt entry not reported"
grep -q "cache_write tokens=" "$tmp/cache.log" && ok "entries written by the writer thread" || bad "no cache_write line"

# The default --prefix-cache-bits 8: a long entry is re-encoded to 8 bits (lossy, so
# the text is not compared: test_prefix_cache checks the logits), takes about half the
# bytes, hits (and then turns live: the second request shares its blocks and is kept
# live too), and reloads from disk in the 8-bit format.
start_server q8 --prefix-cache-dir "$tmp/pc8"
client prefix "$tmp/prefix.txt" "Which play did he star in?" >/dev/null
for _ in $(seq 100); do # the entry is stored (converted) after the answer went out
  grep -q "format=K8/V8" "$tmp/q8.log" && break
  sleep 0.1
done
bytes8=$(metric prefix_cache_bytes)
client prefix "$tmp/prefix.txt" "Who is Robert Boulter?"; cp "$tmp/client.out" "$tmp/q8.json"
stop_server
[ "$(jq .cached "$tmp/q8.json")" -gt 1000 ] 2>/dev/null && [ "$(jq '.text | length' "$tmp/q8.json")" -gt 0 ] &&
  ok "hit on an 8-bit entry" || bad "no 8-bit hit: $(cat "$tmp/q8.json")"
grep -q "cache_store tokens=[0-9]* bytes=[0-9]* format=K8/V8 convert_ms=" "$tmp/q8.log" && ok "entries stored as 8 bits" ||
  bad "no 8-bit cache_store line"
grep -q "cache_convert fetch tokens=" "$tmp/q8.log" && ok "converted back on attach" || bad "no cache_convert fetch line"
awk -v a="$bytes8" -v b="$bytes16" 'BEGIN { exit !(a > 0 && a < 0.6 * b) }' &&
  ok "8-bit entries take $bytes8 bytes, f16 ones $bytes16" || bad "8-bit entries $bytes8 bytes vs f16 $bytes16"
start_server q8disk --prefix-cache-dir "$tmp/pc8"
client prefix "$tmp/prefix.txt" "Who is Robert Boulter?"; cp "$tmp/client.out" "$tmp/q8disk.json"
stop_server
[ "$(jq .cached "$tmp/q8disk.json")" -gt 1000 ] 2>/dev/null && ok "8-bit entry hits from disk after a restart" ||
  bad "no 8-bit hit from disk: $(cat "$tmp/q8disk.json")"

# ---- prefix cache: entries evicted to host memory come back from there on a hit ----
# A budget for one entry of the live format: a second prefix evicts the first to host
# memory (--prefix-cache-host-mb), and asking for the first again attaches it from
# there, with the text the cache-less server gave.
tail -c 4000 "$text" | tr -s ' \n' ' ' >"$tmp/prefix2.txt"
mb=$(awk -v b="$bytes16" 'BEGIN { printf "%d", b * 1.5 / 1048576 + 1 }')
start_server host --prefix-cache-mb "$mb" --prefix-cache-host-mb 64 --prefix-cache-bits 16
client prefix "$tmp/prefix.txt" "Which play did he star in?" >/dev/null
client prefix "$tmp/prefix2.txt" "Who is Robert Boulter?" >/dev/null
for _ in $(seq 50); do # the second entry is stored (evicting the first) after its answer went out
  host_bytes=$(metric prefix_cache_host_bytes)
  [ "${host_bytes:-0}" -gt 0 ] 2>/dev/null && break
  sleep 0.1
done
client prefix "$tmp/prefix.txt" "Who is Robert Boulter?"; cp "$tmp/client.out" "$tmp/host.json"
stop_server
[ "${host_bytes:-0}" -gt 0 ] 2>/dev/null && ok "/metrics: $host_bytes bytes of entries in host memory" ||
  bad "prefix_cache_host_bytes is '$host_bytes' after an eviction"
grep -q "cache_host_store tokens=" "$tmp/host.log" && ok "an evicted entry moved to host memory" ||
  bad "no cache_host_store line ($mb MiB budget)"
grep -q "cache_host_hit tokens=" "$tmp/host.log" && [ "$(jq .cached "$tmp/host.json")" -gt 1000 ] 2>/dev/null &&
  ok "hit from host memory ($(jq .cached "$tmp/host.json") tokens)" || bad "no hit from host memory: $(cat "$tmp/host.json")"
[ "$(jq .text "$tmp/host.json")" = "$(jq .text "$tmp/ref.json")" ] && ok "same text from the host-memory entry" ||
  bad "host-memory entry changed the text: $(jq .text "$tmp/host.json") vs $(jq .text "$tmp/ref.json")"

# ---- disconnects, and memory after them -------------------------------------------
# RSS (VmRSS, KiB) is read after a warm-up request, after a first burst of 32 streams
# (a third dropped), and after a second identical burst. The first burst may raise it
# by what the engine keeps for reuse: logits and activations sized for a full
# 520-token step (~17 MiB on tinydoc) and the KV pool's free lists (at most 256
# blocks of 64 KiB per block size): 40 MiB in all. After that the process must come
# back to the same RSS within 6 MiB (the free lists may end a burst with up to 96
# blocks more than the last: 8 sequences x 6 layers x 2 blocks), so anything near
# 200 KiB leaked per request shows. (Small leaks are the ASan build's job; under
# AddressSanitizer, with its quarantine and shadow memory, RSS is not checked.)
start_server drop --prefix-cache-mb 0 --max-num-seqs 8 -c 2048
rss() { awk '/^VmRSS/ {print $2}' "/proc/$srv_pid/status"; }
curl -s "http://127.0.0.1:$port/v1/completions" -d '{"prompt":"The kernel","max_tokens":40,"stream":true}' >/dev/null
rss0=$(rss)
client disconnect "$text"
sleep 0.3
rss1=$(rss)
if sanitized; then
  echo "note: AddressSanitizer build, RSS not checked"
else
  client disconnect "$text"
  sleep 0.3
  rss2=$(rss)
  [ $((rss1 - rss0)) -le 40960 ] && ok "RSS after the first burst: +$(((rss1 - rss0) / 1024)) MiB (reused buffers)" ||
    bad "RSS grew by $(((rss1 - rss0) / 1024)) MiB in the first burst"
  [ $((rss2 - rss1)) -le 6144 ] && ok "RSS back to its level after a second burst: $((rss2 - rss1)) KiB" ||
    bad "RSS grew by $((rss2 - rss1)) KiB in a second identical burst"
fi
stop_server

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
