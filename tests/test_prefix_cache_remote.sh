#!/usr/bin/env bash
# kvq serve --prefix-cache-remote: two replicas and one redis-server on loopback.
# A prompt prefilled on replica A is a hit on replica B with the same greedy text as
# a cold run (f16 entries), or as a local hit on A (--kv-bits 8,4, where a hit, local
# or remote, quantizes the f16 window's rows earlier than a cold run); prompt_cache_key
# namespaces stay apart; corrupt, crafted and foreign values under the servers' keys are refused,
# counted and never served; the store killed and restarted, or hung, never fails a
# request, and hits resume; bad URLs and auth files are one clear error.
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
check "B reuses A's prefix (cached $hit tokens)" [ "$hit" -ge 320 ]
check "B: greedy text identical to the cold run" [ "$(answer_text)" = "$cold" ]
check "B counts one remote hit" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = 1 ]
check "B read the entry's bytes" [ "$(metric "$B_port" prefix_cache_remote_bytes_read_total)" -gt 100000 ]

# ---- namespaces ---------------------------------------------------------------------------
complete "$B_port" t2 p1
check "another prompt_cache_key: no hit" [ "$(answer_cached)" = 0 ]
complete "$B_port" "" p1
check "no prompt_cache_key: no hit" [ "$(answer_cached)" = 0 ]
check "B still counts one remote hit" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = 1 ]

# ---- --kv-bits 8,4: a remote hit is what a local hit would be -------------------------------
a_space=$(redis-cli -p "$rport" --scan --pattern 'kvq:*:e:*' | head -1 | cut -d: -f2)
q=(-t 1 -c 1024 --kv-bits 8,4 --max-num-seqs 4 "${remote[@]}")
start_replica F "${q[@]}"
start_replica G "${q[@]}"
complete "$F_port" t1 p2
check "F publishes its entry" wait_metric "$F_port" prefix_cache_remote_tokens_written_total 64
complete "$F_port" t1 p2
local_hit=$(answer_text)
complete "$G_port" t1 p2
check "G reuses F's 8,4 entry (cached $(answer_cached))" [ "$(answer_cached)" -ge 320 ]
check "G: greedy text identical to F's local hit" [ "$(answer_text)" = "$local_hit" ]
kill -TERM "$F_pid" "$G_pid"

# ---- crafted, corrupt and foreign values (F's entry under B's keys) ---------------------
jq -Rs '{content: ., add_special: true}' "$tmp/p2.txt" |
  curl -s -m 60 "http://127.0.0.1:$A_port/tokenize" -d @- | jq -c .tokens >"$tmp/p2.tok"
check "the prompt's tokens start with BOS" [ "$(jq '.[0]' "$tmp/p2.tok")" = 1 ]
python3 - "$resp_py" "$rport" "$a_space" "$tmp/p2.tok" >"$tmp/planted" <<'PY'
import json, os, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import resp
r, space = resp.Redis(int(sys.argv[2])), sys.argv[3]  # A's and B's
toks = json.load(open(sys.argv[4]))[:-1]  # a request looks up all but its last token
good = r.cmd("GET", r.keys("kvq:%s:*:e:*" % space)[0])
foreign = r.cmd("GET", next(k for k in r.keys("kvq:*:e:*") if k.split(b":")[1].decode() != space))
crafted = resp.crafted_values(good, 24)
planted = [resp.plant(r, space, "evil%d" % (i // 3), toks, crafted[i:i + 3]) for i in range(0, 24, 3)]
planted.append(resp.plant(r, space, "foreign", toks, [foreign]))
for keys in planted:
    for k in keys:
        print(k.decode())
PY
check "planted 25 crafted and foreign values" [ "$(wc -l <"$tmp/planted")" = 25 ]
complete "$B_port" cold2 p2
cold2=$(answer_text)
for key in evil0 evil1 evil2 evil3 evil4 evil5 evil6 evil7 foreign; do
  complete "$B_port" "$key" p2
  if [ "$(answer_cached)" != 0 ] || [ "$(answer_text)" != "$cold2" ]; then bad "crafted values of $key served"; fi
done
check "every crafted value refused and counted" [ "$(metric "$B_port" prefix_cache_remote_rejected_total)" -ge 25 ]
check "no crafted value served: B's remote hits unchanged" [ "$(metric "$B_port" prefix_cache_remote_hits_total)" = 1 ]
left=0
while read -r k; do left=$((left + $(redis-cli -p "$rport" exists "$k"))); done <"$tmp/planted"
check "refused values are deleted from the store ($left left)" [ "$left" = 0 ]
kill -0 "$B_pid" && ok "B still serves" || bad "B died"

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
complete "$A_port" t1 p4
check "store back: A publishes again" wait_metric "$A_port" prefix_cache_remote_tokens_written_total 1 5
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
