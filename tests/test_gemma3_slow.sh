#!/usr/bin/env bash
# tinygemma3 (release build only: long runs): passkey finds a needle outside the
# 512-token sliding window with 4-bit KV (only the global layer sees it), and
# perplexity on one chunk matches the transformers run's first chunk.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinygemma3-f16.gguf
text=$shared/data/wikitext2-test.txt
need_asset "$model" "$text"

out=$("$kvq" passkey -m "$model" -f "$text" --lengths 1024 --trials 4 -t 2 --kv-bits 4)
correct=$(echo "$out" | awk -F'|' '$2 ~ /^ *1024 *$/ { gsub(/ /, "", $4); print $4 }')
if [ -n "$correct" ] && [ "$correct" -ge 3 ]; then ok "passkey $correct/4 at 1024 tokens, 4-bit KV"
else bad "passkey '$correct'/4 at 1024 tokens"; echo "$out"; fi

# transformers' first chunk (refs/tinygemma3: running estimate after chunk 1) is 162.14
ppl=$("$kvq" perplexity -m "$model" -f "$text" -c 1024 --chunks 1 -t 2 2>/dev/null | sed -n 's/.*PPL = \([0-9.]*\).*/\1/p')
if [ -n "$ppl" ] && awk -v p="$ppl" 'BEGIN { exit !(p > 160.5 && p < 163.8) }'; then ok "perplexity of chunk 1: $ppl"
else bad "perplexity of chunk 1: '$ppl'"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
