#!/usr/bin/env bash
# kvq serve --prefix-cache-remote: two replicas and one redis-server on loopback.
# A prompt prefilled on replica A is a hit on replica B with the same greedy text as
# a cold run (f16 entries), or as a local hit on A (--kv-bits 8,4, where a hit, local
# or remote, quantizes the f16 window's rows earlier than a cold run); a hit that extends
# B's own cached prefix reads only the blocks past it; prompt_cache_key namespaces stay
# apart; corrupt, crafted and foreign values under the servers' keys are refused,
# counted, deleted and never served, and a corrupt block cuts a chain there; a replica
# kept busy publishes its entries (the default config, converted on the writer thread);
# the store killed and restarted, or hung, never fails a request, and hits resume; bad
# URLs and auth files are one clear error.
set -u
kvq=${KVQ_BIN:?KVQ_BIN must point to the kvq binary}
shared=${KVQ_SHARED_DIR:-$(dirname "$0")/../../shared}
model=$shared/models/tinydoc-q8_0.gguf
if [ ! -f "$model" ] || [ ! -f "$shared/data/wikitext2-test.txt" ]; then
  echo "SKIP: tinydoc-q8_0.gguf or wikitext2-test.txt missing under $shared"
  exit 77
fi
for tool in redis-server redis-cli curl jq python3; do
  command -v $tool >/dev/null || { echo "SKIP: $tool is not installed (scripts/install-deps.sh installs it)"; exit 77; }
done
tmp=$(mktemp -d)
# shellcheck source=tests/remote_lib.sh
. "$(dirname "$0")/remote_lib.sh"
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok: $1"; }
bad() { failed=$((failed + 1)); echo "FAIL: $1"; }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }

# ---- bad flags: one line, exit 1, before the model loads -----------------------------
expect_error() { # DESCRIPTION PATTERN ARGS...
  local what=$1 pattern=$2; shift 2
  "$kvq" serve -m "$model" --port 0 "$@" >/dev/null 2>"$tmp/err"; local rc=$?
  if [ $rc -eq 1 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -q -- "$pattern" "$tmp/err"; then ok "$what"
  else bad "$what (exit $rc)"; cat "$tmp/err"; fi
}
expect_error "not a redis URL" "expected redis://" --prefix-cache-remote http://x
expect_error "a password in the URL" "no password in the URL" --prefix-cache-remote redis://u:p@127.0.0.1:1
expect_error "TLS without hiredis TLS" "TLS" --prefix-cache-remote rediss://127.0.0.1:1
expect_error "a bad port" "bad port" --prefix-cache-remote redis://127.0.0.1:99999
expect_error "a user without a password" "needs a password" --prefix-cache-remote redis://u@127.0.0.1:1
expect_error "a missing auth file" "prefix-cache-remote-auth" --prefix-cache-remote redis://127.0.0.1:1 \
  --prefix-cache-remote-auth "$tmp/none"
expect_error "no prefix cache" "needs the prefix cache" --prefix-cache-remote redis://127.0.0.1:1 --prefix-cache-mb 0
if [ -f "$shared/models/tinygemma3-f16.gguf" ]; then # blocks need every layer's rows of their positions
  "$kvq" serve -m "$shared/models/tinygemma3-f16.gguf" --port 0 --prefix-cache-remote redis://127.0.0.1:1 \
    >/dev/null 2>"$tmp/err"
  rc=$?
  if [ $rc -eq 1 ] && grep -q "needs every position kept.*--swa-full" "$tmp/err"; then ok "sliding-window layers refused"
  else bad "sliding-window layers refused (exit $rc)"; cat "$tmp/err"; fi
fi

# ---- a store with a password, reached through a unix socket --------------------------
printf 'sekrit-pass\n' >"$tmp/auth"
redis-server --port 0 --unixsocket "$tmp/r.sock" --requirepass sekrit-pass --save '' --appendonly no \
  --dir "$tmp" >"$tmp/redis-unix.log" 2>&1 &
pids+=("$!")
for _ in $(seq 100); do [ -S "$tmp/r.sock" ] && break; sleep 0.05; done
common=(-t 1 -c 1024 --kv-bits 16 --prefix-cache-bits 16 --max-num-seqs 4)
start_replica U "${common[@]}" --prefix-cache-remote "unix://$tmp/r.sock" --prefix-cache-remote-auth "$tmp/auth"
check "unix socket and AUTH: the store is reachable" [ "$(metric "$U_port" prefix_cache_remote_up)" = 1 ]
start_replica W "${common[@]}" --prefix-cache-remote "unix://$tmp/r.sock"
check "no password: the store counts as unreachable" [ "$(metric "$W_port" prefix_cache_remote_up)" = 0 ]
check "...logged once" [ "$(grep -c 'unreachable' "$tmp/W.log")" -eq 1 ]

# ---- hits across replicas ------------------------------------------------------------
start_redis
remote=(--prefix-cache-remote "redis://127.0.0.1:$rport/0")
start_replica A "${common[@]}" "${remote[@]}"
start_replica B "${common[@]}" "${remote[@]}"
prompt_file p1 5000 1800
prompt_file p2 20000 1800

complete "$B_port" cold p1
cold=$(answer_text)
check "cold run on B: nothing cached" [ "$(answer_cached)" = 0 ]
complete "$A_port" t1 p1
check "A: the same text as B's cold run" [ "$(answer_text)" = "$cold" ]
check "A publishes its entry" wait_metric "$A_port" prefix_cache_remote_tokens_written_total 64
complete "$B_port" t1 p1
hit=$(answer_cached)
hit1=$hit
check "B reuses A's prefix (cached $hit tokens)" [ "$hit" -ge 320 ]
check "B: greedy text identical to the cold run" [ "$(answer_text)" = "$cold" ]
check "B counts one remote hit" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = 1 ]
read1=$(metric "$B_port" prefix_cache_remote_bytes_read_total)
check "B read the blocks' bytes ($read1)" [ "$read1" -gt 100000 ]

# ---- namespaces ---------------------------------------------------------------------------
complete "$B_port" t2 p1
check "another prompt_cache_key: no hit" [ "$(answer_cached)" = 0 ]
complete "$B_port" "" p1
check "no prompt_cache_key: no hit" [ "$(answer_cached)" = 0 ]
check "B still counts one remote hit" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = 1 ]

# ---- a hit that extends B's own cached prefix: only the blocks past it are read -------------
prompt_file p6s 100000 900
prompt_file p6 100000 2400
complete "$B_port" cold6 p6
cold6=$(answer_text)
complete "$B_port" t3 p6s # B holds the prompt's first part
n6s=$(jq -rs '.[0].usage.prompt_tokens' "$tmp/answer.json")
complete "$A_port" t3 p6
check "A publishes the whole prompt" wait_metric "$A_port" prefix_cache_remote_tokens_written_total 1024
hits=$(metric "$B_port" prefix_cache_remote_hits_total)
read0=$(metric "$B_port" prefix_cache_remote_bytes_read_total)
complete "$B_port" t3 p6
check "B reuses its own prefix and A's rest (cached $(answer_cached))" [ "$(answer_cached)" -ge 448 ]
check "...with greedy text identical to a cold run" [ "$(answer_text)" = "$cold6" ]
check "...counted as one remote hit" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = $((hits + 1)) ]
hit_line=$(grep 'cache_remote_hit' "$tmp/B.log" | tail -1)
read -r tokens6 local6b blocks6 < <(sed 's/.*tokens=\([0-9]*\) local=\([0-9]*\) blocks=\([0-9]*\).*/\1 \2 \3/' <<<"$hit_line")
check "...the local part whole blocks of B's own entry (${local6b:-?} of $n6s tokens)" \
  [ "${local6b:-0}" -ge 128 -a "${local6b:-0}" -le "$n6s" ]
check "...the blocks fetched are the rest ($blocks6 blocks, $tokens6 tokens)" [ $((local6b + 64 * blocks6)) = "$tokens6" ]
read6=$(($(metric "$B_port" prefix_cache_remote_bytes_read_total) - read0))
check "...and only their bytes are read ($read6 = $blocks6 blocks of $((read1 / (hit1 / 64))))" \
  [ $((read6 * (hit1 / 64))) = $((blocks6 * read1)) ]

# ---- --kv-bits 8,4: a remote hit is what a local hit would be -------------------------------
# Live-format blocks are taken as they are: a prompt sharing F's first 9 blocks exactly
# gets the same state, and the same greedy text, from F's own entry and from G's blocks.
a_space=$(redis-cli -p "$rport" --scan --pattern 'kvq:*:k:*' | head -1 | cut -d: -f2)
tokens_of() { # PORT PROMPT: its token ids (BOS first), as a JSON list in $tmp/PROMPT.tok
  jq -Rs '{content: ., add_special: true}' "$tmp/$2.txt" | curl -s -m 60 "http://127.0.0.1:$1/tokenize" -d @- |
    jq -c .tokens >"$tmp/$2.tok"
}
complete_tokens() { # PORT KEY TOKENS_JSON: a greedy completion of those token ids
  jq -n --arg k "$2" --argjson p "$(cat "$3")" '{prompt: $p, max_tokens: 16, temperature: 0, prompt_cache_key: $k}' |
    curl -s -m 120 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' -d @- >"$tmp/answer.json"
}
q=(-t 1 -c 1024 --kv-bits 8,4 --max-num-seqs 4 "${remote[@]}")
start_replica F "${q[@]}"
start_replica G "${q[@]}"
complete "$F_port" t1 p2
check "F publishes its entry" wait_metric "$F_port" prefix_cache_remote_tokens_written_total 576
tokens_of "$F_port" p1
tokens_of "$F_port" p2
jq -c --slurpfile o "$tmp/p1.tok" '.[:576] + $o[0][200:240]' "$tmp/p2.tok" >"$tmp/x.tok"
complete_tokens "$F_port" t1 "$tmp/x.tok"
local_hit=$(answer_text)
check "F: a local hit of 576 tokens (cached $(answer_cached))" [ "$(answer_cached)" = 576 ]
complete_tokens "$G_port" t1 "$tmp/x.tok"
check "G takes F's 8,4 blocks (cached $(answer_cached))" [ "$(answer_cached)" = 576 ]
check "G: greedy text identical to F's local hit" [ "$(answer_text)" = "$local_hit" ]
kill -TERM "$F_pid" "$G_pid"

# ---- crafted, corrupt and foreign values (F's blocks under B's keys) ---------------------
check "the prompt's tokens start with BOS" [ "$(jq '.[0]' "$tmp/p1.tok")" = 1 ]
python3 - "$resp_py" "$rport" "$a_space" "$tmp/p1.tok" >"$tmp/planted" <<'PY'
import hashlib, json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import resp
r, space = resp.Redis(int(sys.argv[2])), sys.argv[3]  # A's and B's
def planted(tag, key, value):  # a tag, the key and a digest of the value planted under it
    print(tag, key.decode(), hashlib.sha1(value).hexdigest())
toks = json.load(open(sys.argv[4]))[:-1]  # a request looks up all but its last token
keys, chains = resp.block_keys(space, "t1", toks)
good = [r.cmd("GET", k) for k in keys]
foreign = r.cmd("GET", next(k for k in r.keys("kvq:*:k:*") if k.split(b":")[1].decode() != space))
foreign = foreign[resp.header_len(foreign):]  # its block, filed under B's key by plant
for i, (v, mode) in enumerate(resp.crafted_values(good[0], 22)):
    planted("crafted", *resp.plant(r, space, "evil%d" % i, toks, v, mode))
planted("crafted", *resp.plant(r, space, "foreign", toks, foreign, "rewrap"))
# a chain of good blocks (A's, under another namespace's keys) with its third corrupt
mid, mchains = resp.block_keys(space, "mid", toks)
for i, k in enumerate(mid):
    v = bytearray(resp.rewrap(good[i], "mid", mchains[i]))
    if i == 2:
        v[-100] ^= 1
    r.cmd("SET", k, bytes(v))
    planted("mid%d" % i, k, bytes(v))
PY
# still_planted TAG: how many values planted with that tag the store still holds
still_planted() {
  awk -v t="$1" '$1 == t { print $2, $3 }' "$tmp/planted" | python3 -c '
import hashlib, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import resp
r = resp.Redis(int(sys.argv[2]))
held = [l.split() for l in sys.stdin]
print(sum(1 for k, d in held if (v := r.cmd("GET", k)) is not None and hashlib.sha1(v).hexdigest() == d))
' "$resp_py" "$rport"
}
check "planted 23 crafted and foreign values" [ "$(grep -c '^crafted' "$tmp/planted")" = 23 ]
for i in $(seq 0 21) foreign; do
  key=$([ "$i" = foreign ] && echo foreign || echo "evil$i")
  complete "$B_port" "$key" p1
  if [ "$(answer_cached)" != 0 ] || [ "$(answer_text)" != "$cold" ]; then bad "crafted value of $key served"; fi
done
check "every crafted value refused and counted" [ "$(metric "$B_port" prefix_cache_remote_rejected_total)" -ge 23 ]
check "no crafted value served: B's remote hits unchanged" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = $((hits + 1)) ]
left=$(still_planted crafted)
check "refused values are deleted from the store ($left left; B's own blocks may take their keys)" [ "$left" = 0 ]
rejected=$(metric "$B_port" prefix_cache_remote_rejected_total)
complete "$B_port" mid p1
check "a corrupt third block: the two before it are used (cached $(answer_cached))" [ "$(answer_cached)" = 128 ]
check "...with greedy text identical to a cold run" [ "$(answer_text)" = "$cold" ]
check "...the block refused and counted" [ "$(metric "$B_port" prefix_cache_remote_rejected_total)" = $((rejected + 1)) ]
held="$(still_planted mid0) $(still_planted mid1) $(still_planted mid2)"
check "...and deleted, the two before it kept ($held)" [ "$held" = "1 1 0" ]
kill -0 "$B_pid" && ok "B still serves" || bad "B died"

# ---- publishing under load: the default config (f16 live, 8-bit blocks) --------------------
# A finished entry waits for the replica to be idle before it is converted for its own
# cache, but its blocks are published at once (converted on the writer thread).
start_replica P -t 1 -c 4096 --max-num-seqs 4 "${remote[@]}"
start_replica Q -t 1 -c 4096 --max-num-seqs 4 "${remote[@]}"
prompt_file p7 120000 1800
prompt_file p8 140000 600
jq -Rs '{prompt: ., max_tokens: 3000, ignore_eos: true, temperature: 0}' "$tmp/p8.txt" |
  curl -s -m 300 "http://127.0.0.1:$P_port/v1/completions" -H 'Content-Type: application/json' -d @- >/dev/null &
busy=$!
sleep 0.5
complete "$P_port" t1 p7
check "P under load publishes its entry" wait_metric "$P_port" prefix_cache_remote_tokens_written_total 320 20
check "...while its other request still runs" kill -0 "$busy"
check "...before its conversion for P's own cache" grep -q 'cache_store .*(to convert)' "$tmp/P.log"
complete "$Q_port" t1 p7
check "Q reuses P's published prefix (cached $(answer_cached))" [ "$(answer_cached)" -ge 320 ]
kill "$busy" 2>/dev/null
wait "$busy" 2>/dev/null
kill -TERM "$P_pid" "$Q_pid"

# ---- the store goes away, and comes back -----------------------------------------------
stop_redis
prompt_file p3 40000 1200
complete "$A_port" t1 p3
check "store down: A answers" [ "$(answer_text)" != "(no text)" ]
complete "$B_port" t1 p3
check "store down: B answers (cold)" [ "$(answer_cached)" -lt 64 ]
check "store down: A's /metrics says unreachable" [ "$(metric "$A_port" prefix_cache_remote_up)" = 0 ]
check "store down: logged once by A" [ "$(grep -c 'unreachable' "$tmp/A.log")" -eq 1 ]
start_redis "$rport"
sleep 1.5 # the longest backoff
prompt_file p4 60000 1200
written=$(metric "$A_port" prefix_cache_remote_tokens_written_total)
complete "$A_port" t1 p4
check "store back: A publishes again" wait_metric "$A_port" prefix_cache_remote_tokens_written_total $((written + 256)) 20
complete "$B_port" t1 p4
check "store back: B hits again (cached $(answer_cached))" [ "$(answer_cached)" -ge 256 ]
check "store back: logged by B" [ "$(grep -c 'reachable$' "$tmp/B.log")" -ge 2 ]
lines="$(grep -c unreachable "$tmp/A.log") $(grep -c unreachable "$tmp/B.log")"
check "one outage, one log line each (A and B: $lines)" [ "$lines" = "1 1" ]

# ---- a hung store (stopped, its socket still open): the lookup times out ------------------
kill -STOP "$redis_pid"
errs=$(metric "$B_port" prefix_cache_remote_errors_total)
prompt_file p5 80000 1200
complete "$B_port" t1 p5
check "hung store: B answers" [ "$(answer_text)" != "(no text)" ]
check "hung store: B counts the timeout" [ "$(metric "$B_port" prefix_cache_remote_errors_total)" -gt "$errs" ]
kill -CONT "$redis_pid"

for n in A B U W; do
  pid_var=${n}_pid
  kill -TERM "${!pid_var}"
  wait "${!pid_var}" && ok "$n stops cleanly" || bad "$n exit status on SIGTERM"
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
