#!/usr/bin/env bash
# kvq cache-prompt then kvq generate --prompt-cache continues exactly as an
# uninterrupted run (same greedy text) for f16 and quantized caches; corrupt or
# mismatched cache files are refused with one clear line.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinydoc-q8_0.gguf
other=$shared/models/stories260K.gguf
need_asset "$model" "$other"

prompt="PostgreSQL supports several index types, including B-tree, hash, GiST and GIN. To create an index, use"
for kv in "16" "8,4" "4 --kv-residual 0" "8 --max-kv-size 64"; do
  # shellcheck disable=SC2086
  "$kvq" generate -m "$model" -p "$prompt" -n 40 --temp 0 --ignore-eos -t 2 --kv-bits $kv >"$tmp/direct.txt" 2>/dev/null
  # shellcheck disable=SC2086
  "$kvq" cache-prompt -m "$model" -p "$prompt" -o "$tmp/state.kvq" -t 2 --kv-bits $kv 2>/dev/null
  "$kvq" generate -m "$model" --prompt-cache "$tmp/state.kvq" -n 40 --temp 0 --ignore-eos -t 2 >"$tmp/resumed.txt" 2>"$tmp/err"
  if [ -s "$tmp/direct.txt" ] && cmp -s "$tmp/direct.txt" "$tmp/resumed.txt"; then ok "resume equals direct run (--kv-bits $kv)"
  else bad "resume differs (--kv-bits $kv)"; diff "$tmp/direct.txt" "$tmp/resumed.txt" | head -5; cat "$tmp/err"; fi
done

expect_error() { # DESCRIPTION PATTERN COMMAND...
  local what=$1 pattern=$2; shift 2
  "$@" >/dev/null 2>"$tmp/err"; local rc=$?
  if [ $rc -ge 1 ] && [ $rc -lt 126 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -q -- "$pattern" "$tmp/err"; then ok "$what"
  else bad "$what (exit $rc)"; cat "$tmp/err"; fi
}
"$kvq" cache-prompt -m "$model" -p "$prompt" -o "$tmp/state.kvq" -t 2 2>/dev/null
head -c 5000 "$tmp/state.kvq" >"$tmp/truncated.kvq"
cp "$tmp/state.kvq" "$tmp/flipped.kvq"
printf '\x55' | dd of="$tmp/flipped.kvq" bs=1 seek=20000 conv=notrunc 2>/dev/null
expect_error "truncated cache file" "kvq:" "$kvq" generate -m "$model" --prompt-cache "$tmp/truncated.kvq" -n 4
expect_error "corrupt cache file" "kvq:" "$kvq" generate -m "$model" --prompt-cache "$tmp/flipped.kvq" -n 4
expect_error "cache of another model" "kvq:" "$kvq" generate -m "$other" --prompt-cache "$tmp/state.kvq" -n 4
expect_error "missing cache file" "kvq:" "$kvq" generate -m "$model" --prompt-cache "$tmp/none.kvq" -n 4
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
