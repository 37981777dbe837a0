#!/usr/bin/env bash
# The commands on tinygemma3 (5 sliding layers of window 512, 1 global): a prompt
# cache past the window resumes exactly as a direct run with quantized-rotating
# sliding layers (and with --swa-full's full ones); generate reports the KV bytes
# of each layer kind. (test_gemma3_slow.sh: passkey and perplexity.)
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinygemma3-f16.gguf
text=$shared/data/wikitext2-test.txt
need_asset "$model" "$text"

head -c 3000 "$text" >"$tmp/prompt.txt" # ~650 tokens: past the window
"$kvq" generate -m "$model" -f "$tmp/prompt.txt" -n 24 --temp 0 --ignore-eos -t 2 --kv-bits 4 >"$tmp/direct.txt" 2>"$tmp/gen.err"
"$kvq" cache-prompt -m "$model" -f "$tmp/prompt.txt" -o "$tmp/state.kvq" -t 2 --kv-bits 4 2>/dev/null
"$kvq" generate -m "$model" --prompt-cache "$tmp/state.kvq" -n 24 --temp 0 --ignore-eos -t 2 >"$tmp/resumed.txt" 2>"$tmp/err"
if [ -s "$tmp/direct.txt" ] && cmp -s "$tmp/direct.txt" "$tmp/resumed.txt"; then ok "resume equals direct run"
else bad "resume differs"; cat "$tmp/err"; fi
if grep -q "5 sliding (window 512) layers, quantized-rotating cache of at most 512 tokens" "$tmp/gen.err" &&
  grep -q "1 global layer, quantized cache of every token" "$tmp/gen.err"; then ok "KV bytes per layer kind"
else bad "no per-layer-kind KV report"; cat "$tmp/gen.err"; fi
# --swa-full: sliding layers keep every token (an all-global cache); same text, and
# the saved file records it
"$kvq" cache-prompt -m "$model" -f "$tmp/prompt.txt" -o "$tmp/full.kvq" -t 2 --kv-bits 4 --swa-full 2>/dev/null
"$kvq" generate -m "$model" --prompt-cache "$tmp/full.kvq" -n 24 --temp 0 --ignore-eos -t 2 >"$tmp/full.txt" 2>"$tmp/err"
if cmp -s "$tmp/direct.txt" "$tmp/full.txt" && grep -q "5 sliding (window 512) layers, quantized cache of every token" "$tmp/err"
then ok "--swa-full: same text, full sliding layers"
else bad "--swa-full resume"; cat "$tmp/err"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
