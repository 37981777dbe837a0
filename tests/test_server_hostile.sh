#!/usr/bin/env bash
# kvq serve under hostile and careless clients (issue 72), raw sockets on loopback
# (tests/server/hostile.py): 2,000 idle connections while normal clients are served,
# the idle timeout, the per-address cap, 401 and 413 from the headers before any body
# (every POST endpoint), a half-close after a complete request, a graceful drain on
# SIGTERM (streams of one choice or several), rebinding a port in TIME-WAIT, a NUL in
# the API key header or the path.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
model=$shared/models/tinydoc-q8_0.gguf
need_asset "$model"
command -v python3 >/dev/null || { echo "SKIP: python3 is not installed"; exit 77; }
srv_pid=""
trap '[ -n "$srv_pid" ] && kill -KILL $srv_pid 2>/dev/null; rm -rf "$tmp"' EXIT

start_server() { # NAME ARGS...: kvq serve on a free port (or --port); sets port, srv_pid
  serve_start "$1" -m "$model" -t 2 -c 1024 --prefix-cache-mb 0 "${@:2}" && echo $srv_pid >"$tmp/pid"
}
stop_server() { # waits at most 30 s
  kill -TERM $srv_pid
  for _ in $(seq 300); do kill -0 $srv_pid 2>/dev/null || break; sleep 0.1; done
  if wait $srv_pid; then ok "server stops cleanly"; else bad "server exit status $?"; fi
  srv_pid=""
}
asan=0
sanitized && asan=1 # RSS is not checked under AddressSanitizer
client() { # MODE ARGS...: the Python client, its ok/FAIL lines counted (2 minutes at most)
  KVQ_ASAN=$asan timeout 120 python3 "$here/server/hostile.py" "$1" "$port" "${@:2}" >"$tmp/client.out" 2>&1
  local rc=$?
  cat "$tmp/client.out"
  passed=$((passed + $(grep -c '^ok:' "$tmp/client.out")))
  failed=$((failed + $(grep -c '^FAIL:' "$tmp/client.out")))
  [ $rc -eq 0 ] || [ "$(grep -c '^FAIL:' "$tmp/client.out")" -gt 0 ] || bad "client $1 exited with $rc"
}

# ---- 1: slowloris. 2,000 idle connections (from four addresses, under the per-address
# share of the default cap) while normal clients from another are served.
ulimit -n 8192 2>/dev/null || true
if [ "$(ulimit -n)" -ge 4200 ]; then
  start_server slow && { client slowloris 2000; stop_server; }
  grep -q FD_SETSIZE "$tmp/slow.log" && bad "FD_SETSIZE in the log: $(grep FD_SETSIZE "$tmp/slow.log" | head -1)"
else
  echo "SKIP (2,000 connections): the open-file limit is $(ulimit -n)"
fi
start_server timeout --timeout 1 && { client idle-timeout; stop_server; }
start_server perip --max-connections-per-ip 20 && { client per-ip 20; stop_server; }

# ---- 2, 3, small: answers from the headers; NUL bytes ----
start_server early --api-key sekrit --max-body-mb 8 && { client early sekrit "$tmp/pid"; stop_server; }

# ---- 4: half-close ----
start_server half && {
  client half-close
  for _ in $(seq 100); do [ "$(grep -c "client went away" "$tmp/half.log")" -ge 2 ] && break; sleep 0.1; done
  gone=$(grep -c "client went away" "$tmp/half.log")
  [ "$gone" -eq 2 ] && ok "clients gone entirely have their sequences freed, half-closed ones not" ||
    bad "$gone 'client went away' lines for 2 clients gone (and 3 half-closed)"
  stop_server
}

# ---- 5: graceful shutdown ----
start_server drain --shutdown-timeout 20 && {
  client signal "$tmp/pid" 40 finish
  wait $srv_pid; check "drained server exits 0" [ $? -eq 0 ]; srv_pid=""
}
# (4000 tokens: more than an idle machine decodes in the second the drain waits)
start_server cut --shutdown-timeout 1 -c 4096 && {
  client signal "$tmp/pid" 4000 cut
  wait $srv_pid; check "cut server exits 0" [ $? -eq 0 ]; srv_pid=""
  check "the log says what was cut" grep -q "1 requests cut short" "$tmp/cut.log"
}
# a stream of several choices (two prompts, n = 2 each) is cut the same way
start_server cutn --shutdown-timeout 1 -c 4096 && {
  client signal "$tmp/pid" 4000 cut 2
  wait $srv_pid; check "cut server exits 0" [ $? -eq 0 ]; srv_pid=""
  check "the log says what was cut" grep -q "1 requests cut short" "$tmp/cutn.log"
}

# ---- 11: the port of a server that just left (its side in TIME-WAIT) binds again ----
start_server first && {
  first_port=$port
  curl -s -H 'Connection: close' "http://127.0.0.1:$port/health" >/dev/null
  stop_server
  check "the first server's connection is in TIME-WAIT" sh -c "ss -tan state time-wait | grep -q ':$first_port '"
  start_server again --port "$first_port" && { ok "rebinds port $first_port"; stop_server; }
}

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
