# Helpers shared by the command-line tests (sourced; needs $tmp, a scratch folder).
passed=0 failed=0

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
