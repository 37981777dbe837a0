#!/usr/bin/env bash
# kvq tokenize works on vocabulary-only GGUF files (llama.cpp's ggml-vocab-*.gguf:
# tokenizer metadata, no tensors) and matches llama.cpp's expected ids; a command
# that needs weights refuses such a file with one clear line.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
vocab=$shared/tokenizer-tests/ggml-vocab-llama-spm.gguf
need_asset "$vocab"

# first case of ggml-vocab-llama-spm.gguf.inp/.out (llama.cpp's test vectors, no BOS)
got=$("$kvq" tokenize -m "$vocab" --no-bos -p "ied 4 ½ months" 2>&1)
if [ "$got" = "[474, 287, 29871, 29946, 29871, 30226, 7378]" ]; then ok "vocab-only tokenize"
else bad "vocab-only tokenize: $got"; fi
got=$("$kvq" tokenize -m "$vocab" -p "Hello world" 2>&1)
if [ "$got" = "[1, 15043, 3186]" ]; then ok "vocab-only tokenize adds BOS"
else bad "vocab-only tokenize with BOS: $got"; fi

err=$("$kvq" generate -m "$vocab" -p "Hello" -n 1 2>&1 >/dev/null)
if [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && printf '%s' "$err" | grep -q "holds no weights"; then
  ok "generate refuses a vocabulary-only file: $err"
else bad "generate on a vocabulary-only file: $err"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
