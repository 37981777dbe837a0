#!/bin/bash
# kvq perplexity, full reference run: tinydoc-f16 on wikitext-2, -c 1024 --chunks 40,
# full-precision KV: 84.2 +/- 0.5 (llama-perplexity: 84.19). ~41k tokens of evaluation
# (~20 s in a release build), so it is labelled slow and skipped under the sanitizers.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
MODEL=$shared/models/tinydoc-f16.gguf
TEXT=$shared/data/wikitext2-test.txt
need_asset "$MODEL" "$TEXT"
out=$("$kvq" perplexity -m "$MODEL" -f "$TEXT" -c 1024 --chunks 40) || { echo "FAIL: perplexity exited $?"; exit 1; }
echo "$out"
ppl=$(echo "$out" | sed -n 's/^Final estimate: PPL = \([0-9.]*\) .*/\1/p')
if awk -v p="$ppl" 'BEGIN { exit !(p != "" && p > 83.7 && p < 84.7) }'; then
    echo "ok: PPL $ppl within 84.2 +/- 0.5"
else
    echo "FAIL: PPL '$ppl', expected 84.2 +/- 0.5 (llama-perplexity 84.19)"
    exit 1
fi
