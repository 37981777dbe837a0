#!/bin/bash
# kvq bench: a tiny run on tinydoc (2 configs x 2 depths x 2 batches) gives JSON with
# every field, a Markdown table, and a well-formed SVG plot; bad --kv specs fail clearly.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
MODEL=$shared/models/tinydoc-f16.gguf
need_asset "$MODEL"
fail=0
"$kvq" bench -m "$MODEL" -p 8 -n 2 -d 0,8 -b 1,2 --kv f16 --kv f32 -r 1 -t 2 --json --plot "$tmp/p.svg" >"$tmp/b.json" 2>"$tmp/err"
rc=$?
cat "$tmp/b.json" "$tmp/err"
[ $rc -eq 0 ] || { echo "FAIL: bench exited $rc"; exit 1; }
for f in '"model"' '"threads"' '"reps"' '"results"' '"kv": "f16"' '"kv": "f32"' '"depth": 8' '"batch": 2' \
         '"prefill_tok_s"' '"decode_tok_s"' '"kv_bytes"' '"kv_bytes_per_token"' '"rss_bytes"' '"peak_rss_bytes"' '"cpu"' '"simd"'; do
    grep -qF "$f" "$tmp/b.json" || { echo "FAIL: JSON lacks $f"; fail=1; }
done
n=$(grep -c '"decode_tok_s":' "$tmp/b.json")
[ "$n" -eq 8 ] || { echo "FAIL: $n results, expected 8"; fail=1; }
if command -v python3 >/dev/null; then
    python3 -c "
import json, sys, xml.dom.minidom
d = json.load(open('$tmp/b.json'))
for r in d['results']:
    assert r['prefill_tok_s'] > 0 and r['decode_tok_s'] > 0 and r['kv_bytes'] > 0, r
    assert r['kv_bytes_per_token'] == (12288 if r['kv'] == 'f32' else 6144), r
xml.dom.minidom.parse('$tmp/p.svg')
" || { echo "FAIL: JSON/SVG content"; fail=1; }
fi
grep -q "<polyline" "$tmp/p.svg" || { echo "FAIL: SVG has no lines"; fail=1; }
# the SIMD level the kernels ran with, in the header: KVQ_SIMD=scalar caps it on any CPU
KVQ_SIMD=scalar "$kvq" bench -m "$MODEL" -p 4 -n 1 -r 1 -t 2 >"$tmp/t.md" 2>/dev/null || { echo "FAIL: Markdown run"; fail=1; }
grep -q "^| kv | depth | batch | prefill tok/s | decode tok/s |" "$tmp/t.md" || { echo "FAIL: no Markdown table"; fail=1; }
grep -q "^2 threads, cpu .*, simd scalar$" "$tmp/t.md" || { echo "FAIL: header lacks the cpu and simd scalar"; fail=1; }
# a one-token prompt at depth with a quantized cache (the untimed warm-up must not
# inherit a context smaller than the cache's residual window)
"$kvq" bench -m "$MODEL" -p 1 -n 2 -d 64 --kv 8,4 -r 1 -t 2 >"$tmp/q.md" 2>"$tmp/qerr" || { echo "FAIL: -p 1 --kv 8,4: $(cat "$tmp/qerr")"; fail=1; }
grep -q "^| 8,4 | 64 | 1 |" "$tmp/q.md" || { echo "FAIL: -p 1 --kv 8,4 gave no row"; fail=1; }
for spec in 7 8:x f8 "8,4:g0"; do
    err=$("$kvq" bench -m "$MODEL" --kv "$spec" 2>&1 >/dev/null)
    echo "$err" | grep -q "^kvq: invalid" || { echo "FAIL: --kv $spec: '$err'"; fail=1; }
done
# gen-model usage errors (the full gen-model test is test_gen_model).
err=$("$kvq" gen-model --shape llama9 --type f16 -o "$tmp/x.gguf" 2>&1); [ $? -eq 1 ] && echo "$err" | grep -q "unknown shape" || { echo "FAIL: gen-model shape error: $err"; fail=1; }
err=$("$kvq" gen-model --shape qwen2.5-0.5b --type q3_k -o "$tmp/x.gguf" 2>&1); [ $? -eq 1 ] && echo "$err" | grep -q "unknown type" || { echo "FAIL: gen-model type error: $err"; fail=1; }
[ $fail -eq 0 ] && echo "ok: bench JSON, table, plot and errors"
exit $fail
