#!/bin/bash
# Normal-float KV rows on tinydoc-f16 (fast settings: -c 1024, 4 chunks of WikiText-2),
# KL divergence against the f16 run: 4,3:nf (K4V3 normal-float, 3.56 bits a value)
# stays under 0.0055 and well under the uniform 3,3 rows (~0.012 here); 3,2:nf
# (K3V2, 2.56 bits) under 0.03 and well under uniform 2,2 (~0.085); the effective bits
# printed count the scale bytes. Then the pass key at 4000 tokens with 4,3:nf on
# tinygemma3 (100% of 20 with full-precision KV in the reference; tinydoc finds it in only
# 10% at that length).
set -u
BIN=${KVQ_BIN:?KVQ_BIN must name the kvq binary}
SHARED=${KVQ_SHARED_DIR:-$(dirname "$0")/../../shared}
MODEL=$SHARED/models/tinydoc-f16.gguf
TEXT=$SHARED/data/wikitext2-test.txt
if [ ! -r "$MODEL" ] || [ ! -r "$TEXT" ]; then
    echo "SKIP: tinydoc-f16.gguf or wikitext2-test.txt missing under $SHARED"
    exit 77
fi
TMP=$(mktemp -d /tmp/kvq_kvfmt_XXXXXX)
trap 'rm -rf "$TMP"' EXIT
"$BIN" perplexity -m "$MODEL" -f "$TEXT" -c 1024 --chunks 4 -t 2 --kl-divergence-base "$TMP/base.kld" >/dev/null 2>"$TMP/err" ||
    { cat "$TMP/err"; echo "FAIL: base run"; exit 1; }
kld() { # KV bits -> mean KLD; the bits line to $TMP/bits
    "$BIN" perplexity -m "$MODEL" -t 2 --kv-bits "$1" --kl-divergence-base "$TMP/base.kld" --kl-divergence >"$TMP/out" 2>"$TMP/err" ||
        { cat "$TMP/err" >&2; echo "FAIL: --kv-bits $1 run" >&2; return 1; }
    grep "^KV bits per value" "$TMP/out" >"$TMP/bits"
    sed -n 's/^Mean    KLD: *\([-0-9.e]*\) .*/\1/p' "$TMP/out"
}
fail=0
check() { # name, awk condition over k (and u)
    if awk -v k="$2" -v u="$3" "BEGIN { exit !($4) }"; then echo "ok: $1: KLD $2 (uniform rows: $3)"; else echo "FAIL: $1: KLD '$2' (uniform rows: '$3'), expected $4"; fail=1; fi
}
k3=$(kld 4,3:nf) || exit 1
grep -q "at 1024 tokens: 3.5625 in the packed rows" "$TMP/bits" || { echo "FAIL: 4,3:nf bits: $(cat "$TMP/bits")"; fail=1; }
u3=$(kld 3,3) || exit 1
grep -q "at 1024 tokens: 3.5000 in the packed rows" "$TMP/bits" || { echo "FAIL: 3,3 bits: $(cat "$TMP/bits")"; fail=1; }
check "4,3:nf" "$k3" "$u3" 'k > 0 && k < 0.0055 && k < 0.6 * u'
k2=$(kld 3,2:nf) || exit 1
grep -q "at 1024 tokens: 2.5625 in the packed rows" "$TMP/bits" || { echo "FAIL: 3,2:nf bits: $(cat "$TMP/bits")"; fail=1; }
u2=$(kld 2,2) || exit 1
check "3,2:nf" "$k2" "$u2" 'k > 0 && k < 0.03 && k < 0.5 * u'
GEMMA=$SHARED/models/tinygemma3-f16.gguf
[ -r "$GEMMA" ] || { echo "SKIP: tinygemma3-f16.gguf missing under $SHARED (pass key)"; exit $fail; }
out=$("$BIN" passkey -m "$GEMMA" -f "$TEXT" --lengths 4000 --trials 4 -t 2 --kv-bits 4,3:nf) || { echo "FAIL: passkey exited $?"; exit 1; }
echo "$out"
correct=$(echo "$out" | awk -F'|' '$2 ~ /^ *4000 *$/ { gsub(/ /, "", $4); print $4 }')
if [ -n "$correct" ] && [ "$correct" -ge 4 ]; then echo "ok: 4,3:nf: pass key $correct/4 at 4000 tokens"
else echo "FAIL: 4,3:nf: pass key '$correct'/4 at 4000 tokens, expected 4"; fail=1; fi
exit $fail
