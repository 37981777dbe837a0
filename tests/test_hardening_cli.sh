#!/usr/bin/env bash
# Issue 8 at the command line: failed writes never remove what kvq did not create
# (a char device as output path), lost stdout is an error, flags are bounded by
# what they can mean, messages are right, and silent surprises are refused.
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/stories260K.gguf
need_asset "$model"
printf 'Once upon a time there was a little girl who liked to play in the park with her dog. %.0s' 1 2 3 4 5 6 \
  >"$tmp/text.txt"

# ---- class 1: a failed write removes nothing it did not create ----
if [ "$(id -u)" -eq 0 ] && mknod "$tmp/full" c 1 7 2>/dev/null; then
  "$kvq" gen-model --shape qwen2.5-0.5b --type q8_0 --layers 1 -t 2 -o "$tmp/full" >/dev/null 2>"$tmp/err"
  rc=$?
  check "gen-model to a full device fails (exit $rc)" [ "$rc" -eq 1 ]
  check "gen-model says why" grep -q "cannot write.*No space left" "$tmp/err"
  check "gen-model leaves the device node" [ -c "$tmp/full" ]
  "$kvq" perplexity -m "$model" -f "$tmp/text.txt" -c 32 --chunks 1 -t 1 --kl-divergence-base "$tmp/full" \
    >/dev/null 2>"$tmp/err"
  rc=$?
  check "kl base to a full device fails (exit $rc)" [ "$rc" -eq 1 ]
  check "kl base says why" grep -q "cannot write.*No space left" "$tmp/err"
  check "perplexity leaves the device node" [ -c "$tmp/full" ]
  check "no temporary files left" [ "$(find "$tmp" -name '*.tmp*' | wc -l)" -eq 0 ]
else
  echo "SKIP (char device part): not root or mknod refused; the device-node case is not exercised"
fi
# an existing regular file survives a failed run unchanged (the new one goes to a temporary)
echo "precious" >"$tmp/base.kld"
"$kvq" perplexity -m "$model" -f "$tmp/none.txt" --kl-divergence-base "$tmp/base.kld" >/dev/null 2>&1
check "a failed run leaves an existing base file as it was" grep -qx precious "$tmp/base.kld"
expect_ok "kl base written" -- "$kvq" perplexity -m "$model" -f "$tmp/text.txt" -c 32 --chunks 1 -t 1 \
  --kl-divergence-base "$tmp/base.kld"
check "kl base replaced on success" [ "$(head -c 8 "$tmp/base.kld" | wc -c)" -eq 8 ] && ! grep -qx precious "$tmp/base.kld"
cp "$tmp/text.txt" "$tmp/text2.txt"
expect_error "kl base is the text" "is the text file itself" -- "$kvq" perplexity -m "$model" -f "$tmp/text2.txt" \
  --kl-divergence-base "$tmp/text2.txt"
check "the text is untouched" cmp -s "$tmp/text.txt" "$tmp/text2.txt"

# ---- class 5: lost output is an error ----
# shellcheck disable=SC2016
expect_error "tokenize >/dev/full" "cannot write the output: No space left" -- sh -c '"$0" tokenize -m "$1" -p hi >/dev/full' \
  "$kvq" "$model"
"$kvq" generate -m "$model" -p "Once" -n 4 --temp 0 -t 1 >&- 2>"$tmp/err"
rc=$?
check "generate with stdout closed exits 1 (exit $rc)" [ "$rc" -eq 1 ]
check "generate says so once" [ "$(grep -c 'cannot write' "$tmp/err")" -eq 1 ]
"$kvq" perplexity -m "$model" -f "$tmp/text.txt" -c 32 --chunks 1 -t 1 >/dev/full 2>"$tmp/err"
check "perplexity >/dev/full exits 1" [ $? -eq 1 ]
"$kvq" bench -m "$model" -p 8 -n 2 -d 0 -b 1 -r 1 -t 1 --kv f16 --json >/dev/full 2>"$tmp/err"
check "bench --json >/dev/full exits 1" [ $? -eq 1 ]
check "bench says why" grep -q "cannot write the output" "$tmp/err"

# ---- class 3: flags bounded by the context ----
expect_error "huge --keep" "must not exceed the context" -- "$kvq" generate -m "$model" -p hi --keep 2147483647 --kv-bits 4
expect_error "huge --kv-residual" "must not exceed the context" -- "$kvq" generate -m "$model" -p hi \
  --kv-residual 1048576 --kv-bits 4

# ---- class 4: messages ----
mkdir "$tmp/dir"
expect_error "directory as prompt cache" "is not a regular file" -- "$kvq" generate -m "$model" --prompt-cache "$tmp/dir"
for cmd in generate tokenize cache-prompt perplexity passkey bench gen-model bench-kv-cache; do
  expect_error "$cmd: unknown last option" "unknown option '--x' for $cmd" -- "$kvq" "$cmd" --x
done
expect_error "--seed with a sign" "invalid value ' -1' for --seed" -- "$kvq" generate -m "$model" -p hi --seed " -1"
expect_error "--seed negative" "invalid value '-1' for --seed" -- "$kvq" generate -m "$model" -p hi --seed -1

# ---- class 6: silent surprises ----
expect_error "empty prompt" "the prompt is empty" -- "$kvq" generate -m "$model" -p ""
: >"$tmp/empty.txt"
expect_error "empty prompt file" "the prompt is empty" -- "$kvq" generate -m "$model" -f "$tmp/empty.txt"
expect_ok "cache-prompt" -- "$kvq" cache-prompt -m "$model" -p "Once upon a time there was" -t 1 -o "$tmp/c.kvq"
check "cache-prompt leaves no temporary" [ "$(find "$tmp" -name 'c.kvq.tmp*' | wc -l)" -eq 0 ]
expect_error "--kv-bits next to --prompt-cache" "saved with KV cache f16, not" -- "$kvq" generate -m "$model" \
  --prompt-cache "$tmp/c.kvq" --kv-bits 4
expect_ok "--kv-bits equal to the cache's" -- "$kvq" generate -m "$model" --prompt-cache "$tmp/c.kvq" --kv-bits 16 -n 2
n_cached=$("$kvq" tokenize -m "$model" -p "Once upon a time there was" | tr -cd , | wc -c)
expect_error "cached tokens count against the context" "holds $((n_cached + 1)) tokens" -- "$kvq" generate -m "$model" \
  --prompt-cache "$tmp/c.kvq" -c $((n_cached + 2)) -p " a"
# error paths free what they took (LeakSanitizer in the sanitizer build: a report would add lines)
expect_error "bench-kv-cache bad bits" "invalid bits '7'" -- "$kvq" bench-kv-cache --bits 16,7 --layers 1 --seq-len 8 \
  --heads 1 --head-dim 64 --repeat 1
expect_error "bench-kv-cache group > head_dim" "does not divide" -- "$kvq" bench-kv-cache --bits 4 --layers 1 \
  --seq-len 8 --heads 1 --head-dim 64 --group-size 128 --repeat 1

# ---- issue 72 ----
# --help to a full stdout is an error, as every other output is
for cmd in generate perplexity passkey bench serve tokenize; do
  # shellcheck disable=SC2016
  expect_error "$cmd --help >/dev/full" "cannot write the output: No space left" -- sh -c '"$0" "$1" --help >/dev/full' \
    "$kvq" "$cmd"
done
# unbounded reads: a text input has a size limit
expect_error "generate -f /dev/zero" "cannot read '/dev/zero': larger than the limit for text inputs" -- \
  "$kvq" generate -m "$model" -f /dev/zero -n 1
expect_error "tokenize -f /dev/zero" "larger than the limit" -- "$kvq" tokenize -m "$model" -f /dev/zero
# --prefix-cache-dir: a file, or under a file, is refused; a missing folder is made
: >"$tmp/afile"
expect_error "--prefix-cache-dir naming a file" "is not a folder" -- timeout 20 "$kvq" serve -m "$model" --port 0 \
  --prefix-cache-dir "$tmp/afile"
expect_error "--prefix-cache-dir under a file" "cannot create" -- timeout 20 "$kvq" serve -m "$model" --port 0 \
  --prefix-cache-dir "$tmp/afile/sub"
expect_error "--prefix-cache-host-mb without the prefix cache" "needs the prefix cache" -- timeout 20 "$kvq" serve \
  -m "$model" --port 0 --prefix-cache-mb 0 --prefix-cache-host-mb 64
"$kvq" serve -m "$model" --host 127.0.0.1 --port 0 --prefix-cache-dir "$tmp/new/cache" >/dev/null 2>"$tmp/serve.err" &
pid=$!
for _ in $(seq 100); do grep -q "listening on" "$tmp/serve.err" && break; sleep 0.1; done
check "a missing --prefix-cache-dir is made" [ -d "$tmp/new/cache" ]
kill -TERM $pid; wait $pid
check "...and the server started and stopped cleanly" [ $? -eq 0 ]

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
