#!/bin/bash
# kvq perplexity (fast): 4 chunks of 256 tokens of wikitext-2 on tinydoc-f16 with
# llama-perplexity's conventions; KL divergence of a run against its own base is 0
# with 100% same top token; a base file refuses a different chunk size, text or model
# and a corrupt file; usage errors are one clear line.
#
# The exact value is checked against llama-perplexity's 84.19 by the 40 x 1024 run in
# test_perplexity_slow.sh; here only its plausibility (no reference exists for 4 x 256).
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
MODEL=$shared/models/tinydoc-f16.gguf
TEXT=$shared/data/wikitext2-test.txt
need_asset "$MODEL" "$TEXT"
fail=0
check() { # check DESCRIPTION COMMAND...
    local what=$1; shift
    if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi
}

# 1. PPL, 4 chunks of 256.
"$kvq" perplexity -m "$MODEL" -f "$TEXT" -c 256 --chunks 4 -t 2 >"$tmp/ppl.out" 2>"$tmp/ppl.err"
rc=$?
cat "$tmp/ppl.out"
check "perplexity exits 0" [ $rc -eq 0 ]
ppl=$(sed -n 's/^Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\)$/\1 \2/p' "$tmp/ppl.out")
check "Final estimate line present ($ppl)" [ -n "$ppl" ]
check "PPL plausible for tinydoc on wikitext (30..150)" awk -v v="$ppl" 'BEGIN { split(v, a, " "); exit !(a[1] > 30 && a[1] < 150 && a[2] > 0) }'

# 2. KLD of a run against itself: base (2 chunks of 256), then compare.
"$kvq" perplexity -m "$MODEL" -f "$TEXT" -c 256 --chunks 2 -t 2 --kl-divergence-base "$tmp/base.kld" >"$tmp/base.out" 2>&1
check "base file written" [ -s "$tmp/base.kld" ]
"$kvq" perplexity -m "$MODEL" -t 2 --kl-divergence-base "$tmp/base.kld" --kl-divergence >"$tmp/kld.out" 2>"$tmp/kld.err"
rc=$?
cat "$tmp/kld.out" "$tmp/kld.err"
check "kl-divergence exits 0" [ $rc -eq 0 ]
kld=$(sed -n 's/^Mean    KLD: *\([-0-9.e]*\) .*/\1/p' "$tmp/kld.out")
top=$(sed -n 's/^Same top p: *\([0-9.]*\) .*/\1/p' "$tmp/kld.out")
maxk=$(sed -n 's/^Maximum KLD: *\([-0-9.e]*\).*/\1/p' "$tmp/kld.out")
check "self KLD mean ~ 0 ($kld)" awk -v k="$kld" 'BEGIN { exit !(k != "" && k > -1e-4 && k < 1e-4) }'
check "self KLD max small ($maxk)" awk -v k="$maxk" 'BEGIN { exit !(k != "" && k < 1e-3) }'
check "same top p 100% ($top)" [ "$top" = "100.000" ]
for label in "Mean PPL(Q)" "Mean PPL(base)" "Mean PPL(Q)/PPL(base)" "Median  KLD" "99.0%   KLD" "99.9%   KLD" \
             "Maximum KLD" "Mean    Δp" "RMS Δp" "Same top p"; do
    check "label '$label'" grep -qF "$label" "$tmp/kld.out"
done

# 3. A base file refuses what does not match it.
expect_error() { # expect_error DESCRIPTION PATTERN COMMAND...
    local what=$1 pat=$2; shift 2
    local out; out=$("$@" 2>&1 >/dev/null); local rc=$?
    if [ $rc -eq 1 ] && echo "$out" | grep -q "^kvq: .*$pat"; then echo "ok: $what"; else echo "FAIL: $what (rc $rc: $out)"; fail=1; fi
}
expect_error "other chunk size refused" "written with -c 256" \
    "$kvq" perplexity -m "$MODEL" -c 512 --kl-divergence-base "$tmp/base.kld" --kl-divergence
printf 'Some other text entirely. %.0s' $(seq 1 400) >"$tmp/other.txt"
expect_error "other text refused" "does not tokenize to the tokens" \
    "$kvq" perplexity -m "$MODEL" -f "$tmp/other.txt" --kl-divergence-base "$tmp/base.kld" --kl-divergence
expect_error "more chunks than stored refused" "holds 2 chunks" \
    "$kvq" perplexity -m "$MODEL" --chunks 3 --kl-divergence-base "$tmp/base.kld" --kl-divergence
head -c 100000 "$tmp/base.kld" >"$tmp/trunc.kld"
expect_error "truncated base refused" "truncated or corrupt" \
    "$kvq" perplexity -m "$MODEL" --kl-divergence-base "$tmp/trunc.kld" --kl-divergence
echo "not a base file at all" >"$tmp/junk.kld"
expect_error "foreign file refused" "not a kvq KL-divergence base file" \
    "$kvq" perplexity -m "$MODEL" --kl-divergence-base "$tmp/junk.kld" --kl-divergence
STORIES=$shared/models/stories260K.gguf
if [ -r "$STORIES" ]; then
    expect_error "other model refused" "vocabulary of 8192 tokens" \
        "$kvq" perplexity -m "$STORIES" --kl-divergence-base "$tmp/base.kld" --kl-divergence
fi
expect_error "missing text" "needs a text" "$kvq" perplexity -m "$MODEL"
expect_error "kl without base" "needs the base file" "$kvq" perplexity -m "$MODEL" --kl-divergence
expect_error "bad -c" "invalid value 'x' for -c" "$kvq" perplexity -m "$MODEL" -f "$TEXT" -c x
exit $fail
