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

# ok / bad DESCRIPTION: count a result decided by the caller.
ok() { passed=$((passed + 1)); echo "ok: $1"; }
bad() { failed=$((failed + 1)); echo "FAIL: $1"; }
