#!/bin/bash
# Normal-float KV rows on tinydoc-f16 (fast settings: -c 1024, 4 chunks of WikiText-2),
# KL divergence against the f16 run: 4,3:nf (K4V3 normal-float, 3.56 bits a value)
# stays under 0.0055 and well under the uniform 3,3 rows (~0.012 here); 3,2:nf
# (K3V2, 2.56 bits) under 0.03 and well under uniform 2,2 (~0.085); --kv-bits 3 and 3,3
# are 4,3:nf, 2 and 2,2 are 3,2:nf (the same loss to the digit); 4,4:nf with the
# layers calibrate-kv picks at 5-bit keys under 0.0015 within uniform 4,4's bits; the
# effective bits printed count the scale bytes. Then the pass key at 4000 tokens with
# --kv-bits 3 on tinygemma3 (100% of 20 with full-precision KV in the reference; tinydoc
# finds it in only 10% at that length).
set -u
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
model=$shared/models/tinydoc-f16.gguf
text=$shared/data/wikitext2-test.txt
need_asset "$model" "$text"
"$kvq" perplexity -m "$model" -f "$text" -c 1024 --chunks 4 -t 2 --kl-divergence-base "$tmp/base.kld" >/dev/null 2>"$tmp/err" ||
    { cat "$tmp/err"; echo "FAIL: base run"; exit 1; }
kld() { # KV bits [more flags] -> mean KLD; the bits line to $tmp/bits
    "$kvq" perplexity -m "$model" -t 2 --kv-bits "$@" --kl-divergence-base "$tmp/base.kld" --kl-divergence >"$tmp/out" 2>"$tmp/err" ||
        { cat "$tmp/err" >&2; echo "FAIL: --kv-bits $1 run" >&2; return 1; }
    grep "^KV bits per value" "$tmp/out" >"$tmp/bits"
    sed -n 's/^Mean    KLD: *\([-0-9.e]*\) .*/\1/p' "$tmp/out"
}
kld_check() { # name, KLD, uniform rows' KLD, awk condition over k and u
    if awk -v k="$2" -v u="$3" "BEGIN { exit !($4) }"; then ok "$1: KLD $2 (uniform rows: $3)"
    else bad "$1: KLD '$2' (uniform rows: '$3'), expected $4"; fi
}
bits_check() { # name, bits text expected in the printed line
    if grep -q "at 1024 tokens: $2 in the packed rows" "$tmp/bits"; then ok "$1: $2 bits a value"
    else bad "$1 bits: $(cat "$tmp/bits")"; fi
}
same() { # name, KLD, the format's KLD it must equal
    if [ -n "$2" ] && [ "$2" = "$3" ]; then ok "$1 is the same cache: KLD $2"
    else bad "$1: KLD '$2', expected the same as '$3'"; fi
}
k3=$(kld 4,3:nf) || exit 1
bits_check 4,3:nf 3.5625
u3=$(kld 3,3:uniform) || exit 1
bits_check 3,3:uniform 3.5000
kld_check 4,3:nf "$k3" "$u3" 'k > 0 && k < 0.0055 && k < 0.6 * u'
d3=$(kld 3) || exit 1
bits_check 3 3.5625
same "--kv-bits 3" "$d3" "$k3"
d3=$(kld 3,3) || exit 1
same "--kv-bits 3,3" "$d3" "$k3"
k2=$(kld 3,2:nf) || exit 1
bits_check 3,2:nf 2.5625
u2=$(kld 2,2:uniform) || exit 1
kld_check 3,2:nf "$k2" "$u2" 'k > 0 && k < 0.03 && k < 0.5 * u'
d2=$(kld 2,2) || exit 1
bits_check 2,2 2.5625
same "--kv-bits 2,2" "$d2" "$k2"
# 4-bit rows at uniform 4,4's bytes: calibrate-kv gives the layers that gain most 5-bit
# keys (normal-float rows spend no bytes on offsets, so there is room)
"$kvq" calibrate-kv -m "$model" -f "$text" -t 2 --kv-bits 4,4:nf >"$tmp/cal" 2>"$tmp/err" ||
    { cat "$tmp/err"; bad "calibrate-kv exited $?"; }
layers=$(sed -n 's/^with --kv-bits as given: --kv-layer-bits //p' "$tmp/cal")
if [ -n "$layers" ]; then
    ok "calibrate-kv: --kv-layer-bits $layers"
    k4=$(kld 4,4:nf --kv-layer-bits "$layers") || exit 1
    rows=$(sed -n 's/.*at 1024 tokens: \([0-9.]*\) in the packed rows.*/\1/p' "$tmp/bits")
    u4=$(kld 4,4) || exit 1
    bits_check 4,4 4.5000
    kld_check "4,4:nf + $layers ($rows bits)" "$k4" "$u4" 'k > 0 && k < 0.0015 && k < 0.6 * u'
    awk -v r="$rows" 'BEGIN { exit !(r > 4 && r <= 4.5) }' && ok "4,4:nf + $layers: $rows bits <= 4.5" ||
        bad "4,4:nf + $layers: '$rows' bits a value, expected at most uniform 4,4's 4.5"
else
    cat "$tmp/cal"; bad "calibrate-kv printed no --kv-layer-bits"
fi
gemma=$shared/models/tinygemma3-f16.gguf
if [ -r "$gemma" ]; then
    out=$("$kvq" passkey -m "$gemma" -f "$text" --lengths 4000 --trials 4 -t 2 --kv-bits 3) || { echo "FAIL: passkey exited $?"; exit 1; }
    echo "$out"
    correct=$(echo "$out" | awk -F'|' '$2 ~ /^ *4000 *$/ { gsub(/ /, "", $4); print $4 }')
    if [ -n "$correct" ] && [ "$correct" -ge 4 ]; then ok "--kv-bits 3: pass key $correct/4 at 4000 tokens"
    else bad "--kv-bits 3: pass key '$correct'/4 at 4000 tokens, expected 4"; fi
else
    echo "SKIP: $gemma missing (pass key)"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
