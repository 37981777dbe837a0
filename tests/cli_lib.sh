# Helpers shared by the command-line tests (sourced): $kvq, $shared, a scratch
# folder $tmp removed at exit, and assertions counted in $passed / $failed.
kvq=${KVQ_BIN:?KVQ_BIN must point to the kvq binary}
shared=${KVQ_SHARED_DIR:-$(dirname "$0")/../../shared}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

# need_asset FILE...: skips the test (exit 77) with a message when one is missing.
need_asset() {
  local f
  for f in "$@"; do
    if [ ! -f "$f" ]; then
      echo "SKIP: $f is missing (set KVQ_SHARED_DIR to the shared folder)"
      exit 77
    fi
  done
}

# expect_error DESCRIPTION PATTERN -- command...: exit code 1..125 (not a signal),
# exactly one stderr line, matching PATTERN.
expect_error() {
  local what=$1 pattern=$2
  shift 3
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ge 1 ] && [ "$rc" -lt 126 ] && [ "$lines" -eq 1 ] && grep -q -- "$pattern" "$tmp/err"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL: $what (exit $rc, $lines stderr lines):"; cat "$tmp/err"
  fi
}

expect_ok() {
  local what=$1
  shift 2
  if "$@" >"$tmp/out" 2>"$tmp/err"; then passed=$((passed + 1)); else
    failed=$((failed + 1)); echo "FAIL: $what"; cat "$tmp/err"; fi
}

# check DESCRIPTION condition...: a plain assertion.
check() {
  local what=$1
  shift
  if "$@"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: $what"; fi
}

# serve_start NAME ARGS...: kvq serve ARGS on a free loopback port (a later --port
# wins), its output in $tmp/NAME.log; sets srv_pid and port. Non-zero, counted as a
# failure with the log shown, when it does not start.
serve_start() {
  local name=$1
  shift
  "$kvq" serve --host 127.0.0.1 --port 0 "$@" >"$tmp/$name.log" 2>&1 &
  srv_pid=$!
  port=""
  for _ in $(seq 300); do
    port=$(grep -so 'listening on http://[0-9.]*:[0-9]*' "$tmp/$name.log" | sed 's/.*://')
    [ -n "$port" ] && return 0
    kill -0 $srv_pid 2>/dev/null || break
    sleep 0.1
  done
  bad "server $name did not start"; cat "$tmp/$name.log"
  srv_pid=""
  return 1
}

# sanitized: true when $kvq is the AddressSanitizer build, where RSS is not a measure
# of leaks (its quarantine and shadow memory).
sanitized() { nm "$kvq" 2>/dev/null | grep -q __asan_init; }

# ok / bad DESCRIPTION: count a result decided by the caller.
ok() { passed=$((passed + 1)); echo "ok: $1"; }
bad() { failed=$((failed + 1)); echo "FAIL: $1"; }
