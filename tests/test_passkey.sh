#!/bin/bash
# kvq passkey: tinydoc-f16 with full-precision KV finds the pass key in >= 90% of
# 10 trials at 512 tokens (Hugging Face reference: 100% of 20).
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
MODEL=$shared/models/tinydoc-f16.gguf
TEXT=$shared/data/wikitext2-test.txt
need_asset "$MODEL" "$TEXT"
out=$("$kvq" passkey -m "$MODEL" -f "$TEXT" --lengths 512 --trials 10 -t 2) || { echo "FAIL: passkey exited $?"; exit 1; }
echo "$out"
correct=$(echo "$out" | awk -F'|' '$2 ~ /^ *512 *$/ { gsub(/ /, "", $4); print $4 }')
if [ -n "$correct" ] && [ "$correct" -ge 9 ]; then
    echo "ok: $correct/10 at 512 tokens"
else
    echo "FAIL: '$correct'/10 at 512 tokens, expected >= 9"
    exit 1
fi
err=$("$kvq" passkey -m "$MODEL" -f "$TEXT" --lengths 1000000 --trials 1 2>&1 >/dev/null)
rc=$?
if [ $rc -eq 1 ] && echo "$err" | grep -q "^kvq: length 1000000 does not fit"; then
    echo "ok: clear error for a length longer than the filler"
else
    echo "FAIL: rc $rc, no clear error for an oversized length: $err"; exit 1
fi
