#!/usr/bin/env bash
# Bad input gets one clear line on stderr and a non-zero exit, never a crash.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinydoc-q8_0.gguf
need_asset "$model"

head -c 100000 "$model" >"$tmp/truncated.gguf"
printf 'this is not a model' >"$tmp/text.gguf"
python3 - "$tmp/long.txt" <<'PY' 2>/dev/null || yes "word" | head -n 6000 | tr '\n' ' ' >"$tmp/long.txt"
import sys; open(sys.argv[1], "w").write("word " * 6000)
PY

expect_error "no command" "no command given" -- "$kvq"
expect_error "unknown command" "unknown command 'frobnicate'" -- "$kvq" frobnicate
expect_error "missing model file" "cannot open" -- "$kvq" generate -m "$tmp/none.gguf" -p hi
expect_error "truncated model" "past the end" -- "$kvq" generate -m "$tmp/truncated.gguf" -p hi
expect_error "not a GGUF file" "not a GGUF file" -- "$kvq" generate -m "$tmp/text.gguf" -p hi
expect_error "missing -m" "needs a model" -- "$kvq" generate -p hi
expect_error "missing prompt" "needs a prompt" -- "$kvq" generate -m "$model"
expect_error "bad -n" "invalid value 'x' for -n" -- "$kvq" generate -m "$model" -p hi -n x
expect_error "bad --temp" "invalid value '-1' for --temp" -- "$kvq" generate -m "$model" -p hi --temp -1
expect_error "bad -t" "invalid value '0' for -t" -- "$kvq" generate -m "$model" -p hi -t 0
expect_error "bad --kv-bits" "bits must be" -- "$kvq" generate -m "$model" -p hi --kv-bits 7
expect_error "flag without value" "needs a value" -- "$kvq" generate -m "$model" -p
expect_error "unknown flag" "unknown option '--frob'" -- "$kvq" generate -m "$model" -p hi --frob
expect_error "missing prompt file" "cannot open" -- "$kvq" generate -m "$model" -f "$tmp/none.txt"
expect_error "prompt longer than context" "more than the context" -- "$kvq" generate -m "$model" -f "$tmp/long.txt" -c 256
expect_error "tokenize without text" "needs a text" -- "$kvq" tokenize -m "$model"
# tensor parallelism: refused clearly off the GPU and for bad counts, on every command
expect_error "--tp on the CPU" "runs on GPUs: add --device cuda" -- "$kvq" generate -m "$model" -p hi --tp 2
expect_error "--tp too many" "invalid value '9' for --tp" -- "$kvq" generate -m "$model" -p hi --tp 9
expect_error "-tp in perplexity" "runs on GPUs" -- "$kvq" perplexity -m "$model" -f "$tmp/long.txt" -tp 2
expect_error "bad --devices" "invalid value 'x' for --devices" -- "$kvq" generate -m "$model" -p hi --devices 0,x
expect_error "bench --tp on the CPU" "runs on GPUs" -- "$kvq" bench -m "$model" -p 8 -n 2 -r 1 --tensor-parallel-size 2
expect_error "--tp over 2 KV heads" "must divide the model's 2 KV heads" -- "$kvq" generate -m "$model" -p hi --device cuda --tp 4
expect_error "--devices without --tp" "set CUDA_VISIBLE_DEVICES" -- "$kvq" generate -m "$model" -p hi --device cuda --devices 1
expect_error "--devices short of --tp" "--devices names 1 GPU for --tp 2" -- "$kvq" generate -m "$model" -p hi --device cuda --tp 2 --devices 1
# per-layer KV bits and their calibration
expect_error "--kv-layer-bits past the layers" "the model has layers 0..5" -- "$kvq" generate -m "$model" -p hi --kv-bits 4,4:nf --kv-layer-bits 6=5,4
expect_error "--kv-layer-bits too wide for nf" "normal-float row" -- "$kvq" generate -m "$model" -p hi --kv-bits 4,4:nf --kv-layer-bits 3=6,4
expect_error "--kv-layer-bits 8 bits under --kv-bits 3 (normal-float)" "write --kv-bits K,V:uniform" -- "$kvq" generate -m "$model" -p hi --kv-bits 3 --kv-layer-bits 0=8,8
expect_error "--kv-layer-bits on an f16 cache" "change only quantized sides" -- "$kvq" generate -m "$model" -p hi --kv-layer-bits 3=5,4
expect_error "--kv-layer-bits backwards" "run backwards" -- "$kvq" generate -m "$model" -p hi --kv-bits 4 --kv-layer-bits 3-1=5
expect_error "--kv-layer-bits without =" "expected LAYERS=BITS" -- "$kvq" generate -m "$model" -p hi --kv-bits 4 --kv-layer-bits 3
expect_error "--kv-layer-bits bad bits" "bits must be 2, 3, 4, 5, 6 or 8" -- "$kvq" generate -m "$model" -p hi --kv-bits 4 --kv-layer-bits 3=7
expect_error "--kv-layer-bits: equal bytes, another split, on a GPU" "cannot tell apart" -- "$kvq" generate -m "$model" -p hi --device cuda --kv-bits 4,4:nf --kv-layer-bits 3=5,3
expect_error "calibrate-kv on f16" "give --kv-bits" -- "$kvq" calibrate-kv -m "$model" -f "$tmp/long.txt"
expect_error "calibrate-kv --to lower" "must raise" -- "$kvq" calibrate-kv -m "$model" -f "$tmp/long.txt" --kv-bits 4,4:nf --to 3,4
expect_error "calibrate-kv uniform rows" "give --budget-bits" -- "$kvq" calibrate-kv -m "$model" -f "$tmp/long.txt" --kv-bits 4 -c 256 --chunks 1
expect_error "calibrate-kv keys at the top" "give --to" -- "$kvq" calibrate-kv -m "$model" -f "$tmp/long.txt" --kv-bits 5,4:nf
expect_ok "generate --help" -- "$kvq" generate --help
expect_ok "tokenize --help" -- "$kvq" tokenize --help
expect_ok "--help" -- "$kvq" --help

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
