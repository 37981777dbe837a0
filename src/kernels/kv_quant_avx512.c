/* AVX-512 attention over packed KV rows and fast code unpacking. Compiled a second time
 * with VBMI (kv_quant_avx512vbmi.c, KVQ_VBMI 1) for the fast path alone. */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>

#include "core/cpu.h"
#include "kernels/asan.h"
#include "kernels/inline.h"
#include "kernels/kv_quant_impl.h"
#include "kernels/online_softmax.h"

#ifndef KVQ_VBMI
#define KVQ_VBMI 0
#endif

/* vpermb and vpmultishiftqb tables that put value pi[i] of 64 codes of `bits` bits at
 * byte i (in its low bits): each qword gathers the bytes of its values' runs of
 * consecutive ones (at most 8 bytes: runs of 4 or 8 values here). halves: values 32..63
 * stored from byte 32. */
static void vbmi_tables(int bits, const uint8_t pi[64], int halves, uint8_t gather[64], uint8_t shift[64]) {
    for (int q = 0; q < 8; q++) {
        int slot = 0;
        for (int i = 8 * q, e; i < 8 * q + 8; i = e) {
            for (e = i + 1; e < 8 * q + 8 && pi[e] == pi[e - 1] + 1 && (!halves || pi[e] % 32); e++) {
            }
            const int bit0 = halves ? pi[i] / 32 * 256 + pi[i] % 32 * bits : pi[i] * bits;
            const int b0 = bit0 / 8, nb = (bit0 + (e - i) * bits + 7) / 8 - b0;
            for (int k = 0; k < nb && slot + k < 8; k++) gather[8 * q + slot + k] = (uint8_t)(b0 + k);
            for (int p = i; p < e; p++) shift[p] = (uint8_t)(8 * slot + bit0 - 8 * b0 + (p - i) * bits);
            slot += nb;
        }
        for (; slot < 8; slot++) gather[8 * q + slot] = 0;
    }
}

/* The constants of the unpacker of one code width (2 to 5 bits, 64 codes at a time) and
 * of the map of its codes to normal-float level bytes. */
struct unpack512 {
    int bits;
    __m512i lo, hi, sh, tl, th; /* 3/5 bits: kvq_unpack_lut; the level bytes of codes 0-15, 16-31 */
    /* VBMI: the level bytes repeated every 2^bits (the bits above a code index the
     * repeats); vbmi_tables of 32 codes in each 256-bit half in order (gather, shift),
     * and of 64 codes ordered for v_pair (pgather, pshift); v_pair's words of two rows'
     * 32 bytes in one vector (pair2) */
    __m512i lv64, gather, shift, pgather, pshift, pair2[2];
    /* tile_cols16_nfp (2 and 3 bits): 8 codes a dword (two rows of 64 codes), the bit
     * offsets of codes 0-3 and 4-7 of the dwords of a qword */
    __m512i kspread, kshift[2];
};
static inline void unpack512_init(struct unpack512 *u, int bits) {
    struct kvq_unpack_lut t;
    kvq_unpack_lut(bits, &t);
    uint8_t lv[64] = {0}, pi[64], g[64], sh[64], pg[64], psh[64], p2[2][64] = {{0}};
    if (kern_kvq_nf_bits(bits))
        for (int i = 0; i < 64; i++) lv[i] = kern_kvq_nf_levels(bits)[i % (1 << bits)];
    for (int i = 0; i < 64; i++) pi[i] = (uint8_t)i;
    vbmi_tables(bits, pi, 1, g, sh);
    /* v_pair: byte 16 l + m of 128-bit lane l goes to dword 4 l + m % 4 of vector m / 4
     * (two unpacks of bytes: of two rows, then with zeros), which holds value 32 (t / 2)
     * + 8 (L / 4) + L % 4 + 4 (t % 2) of 8-bit codes (vector t, dword L); pair2: dword L
     * of vector t, value 8 (L / 4) + L % 4 + 4 t of row a (bytes 0-31) and b (32-63) */
    for (int i = 0; i < 64; i++) pi[i] = (uint8_t)(i % 16 < 8 ? i / 16 * 8 + i % 16 : 32 + i / 16 * 8 + i % 16 - 8);
    vbmi_tables(bits, pi, 0, pg, psh);
    for (int tv = 0; tv < 2; tv++)
        for (int L = 0; L < 16; L++) {
            const int v = 8 * (L / 4) + L % 4 + 4 * tv;
            p2[tv][4 * L] = (uint8_t)v, p2[tv][4 * L + 2] = (uint8_t)(32 + v);
        }
    uint8_t ks[64], kh[2][64];
    for (int i = 0; i < 64; i++) {
        const int b = i % 4; /* byte b of dword i / 4 % 8 of half i / 32 */
        ks[i] = (uint8_t)(b < bits ? i / 32 * 32 + i / 4 % 8 * bits + b : 0);
        kh[0][i] = (uint8_t)(i % 8 / 4 * 32 + i % 4 * bits);
        kh[1][i] = (uint8_t)(i % 8 / 4 * 32 + (4 + i % 4) * bits);
    }
    u->kspread = _mm512_loadu_si512(ks);
    u->kshift[0] = _mm512_loadu_si512(kh[0]);
    u->kshift[1] = _mm512_loadu_si512(kh[1]);
    u->lv64 = _mm512_loadu_si512(lv);
    u->gather = _mm512_loadu_si512(g);
    u->shift = _mm512_loadu_si512(sh);
    u->pgather = _mm512_loadu_si512(pg);
    u->pshift = _mm512_loadu_si512(psh);
    for (int i = 0; i < 2; i++) u->pair2[i] = _mm512_loadu_si512(p2[i]);
    u->bits = bits;
    u->lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t.lo));
    u->hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t.hi));
    u->sh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t.sh));
    u->tl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)lv));
    u->th = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(lv + 16)));
}

/* The unpackers of 2 to 5 bits, set up once. */
static struct unpack512 unpackers[6];
static pthread_once_t unpackers_once = PTHREAD_ONCE_INIT;
static void unpackers_init(void) {
    for (int b = 2; b <= 5; b++) unpack512_init(&unpackers[b], b);
}
static const struct unpack512 *unpacker(int bits) {
    pthread_once(&unpackers_once, unpackers_init);
    return bits >= 2 && bits <= 5 ? &unpackers[bits] : NULL;
}

/* 64 codes at p (64 * bits / 8 bytes) as bytes. */
INLINE __m512i unpack64(const struct unpack512 *u, const uint8_t *p) {
    const int bits = u->bits;
    if (bits == 4) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
        return _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi16(x, 4)), _mm512_set1_epi16(0x0f0f));
    }
    if (bits == 2) {
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const __m512i y = _mm512_or_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 6)),
                                          _mm512_or_si512(_mm512_slli_epi32(x, 12), _mm512_slli_epi32(x, 18)));
        return _mm512_and_si512(y, _mm512_set1_epi32(0x03030303));
    }
    /* 3 or 5 bits: 16 codes (2 * bits bytes) a 128-bit lane, each code's two bytes as a
     * word, shifted right by its bit offset, masked, the words packed back to bytes */
    const __mmask16 lane = (__mmask16)((1u << 2 * bits) - 1);
    const __m512i mask = _mm512_set1_epi16((short)((1 << bits) - 1));
    __m512i x = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(lane, p));
    x = _mm512_inserti32x4(x, _mm_maskz_loadu_epi8(lane, p + 2 * bits), 1);
    x = _mm512_inserti32x4(x, _mm_maskz_loadu_epi8(lane, p + 4 * bits), 2);
    x = _mm512_inserti32x4(x, _mm_maskz_loadu_epi8(lane, p + 6 * bits), 3);
    const __m512i a = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(x, u->lo), u->sh), mask);
    const __m512i b = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(x, u->hi), u->sh), mask);
    return _mm512_packus_epi16(a, b);
}

/* 64 codes to their level bytes: a 16-entry byte shuffle (two and a select for 5 bits). */
INLINE __m512i nf_map64(const struct unpack512 *u, __m512i x) {
    const __m512i y = _mm512_shuffle_epi8(u->tl, x); /* codes < 16: bit 7 clear, the low nibble indexes */
    if (u->bits < 5) return y;
    const __mmask64 big = _mm512_cmpgt_epu8_mask(x, _mm512_set1_epi8(15));
    return _mm512_mask_shuffle_epi8(y, big, u->th, _mm512_and_si512(x, _mm512_set1_epi8(15)));
}

#if KVQ_VBMI
/* 32 codes at pa and 32 at pb as their level bytes in the low and high 256 bits: each
 * qword takes the bytes of 8 codes (vpermb), vpmultishiftqb puts code i at byte i, and
 * vpermb of the level bytes maps it. */
INLINE __m512i nf_bytes_vbmi(const struct unpack512 *u, const uint8_t *pa, const uint8_t *pb) {
    const __mmask32 m = (__mmask32)((1u << 4 * u->bits) - 1);
    const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(m, pa)),
                                         _mm256_maskz_loadu_epi8(m, pb), 1);
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(u->shift, _mm512_permutexvar_epi8(u->gather, x)),
                                   u->lv64);
}
/* 64 codes at p as level bytes in v_pair's order (pgather, pshift). */
INLINE __m512i nf_pair_bytes_vbmi(const struct unpack512 *u, const uint8_t *p) {
    const __m512i x = _mm512_maskz_loadu_epi8((__mmask64)((1ull << 8 * u->bits) - 1), p);
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(u->pshift, _mm512_permutexvar_epi8(u->pgather, x)),
                                   u->lv64);
}
#else
void kern_kvq_unpack_avx512(const uint8_t *src, int n, int bits, uint8_t *out) {
    int i = 0;
    if (bits == 8) {
        memcpy(out, src, (size_t)n);
        return;
    }
    const struct unpack512 *u = unpacker(bits);
    if (u)
        for (; i + 64 <= n; i += 64) _mm512_storeu_si512(out + i, unpack64(u, src + (size_t)i * bits / 8));
    if (i < n) kern_kvq_unpack_scalar(src + (size_t)i * bits / 8, n - i, bits, out + i);
}

float kern_kvq_nf_fit_avx512(const float *x, int n, const float *lv, int nl, float s, uint8_t *c) {
    /* the code: how many of the ascending midpoints thr lie below x, by binary search
     * (thr[nl - 1] and above: +inf, never below) */
    float thr[32];
    kvq_nf_midpoints(lv, nl, s, thr);
    const __m512 t0 = _mm512_loadu_ps(thr), t1 = _mm512_loadu_ps(thr + 16);
    const __m512 l0 = _mm512_loadu_ps(lv), l1 = nl > 16 ? _mm512_loadu_ps(lv + 16) : l0, vs = _mm512_set1_ps(s);
    __m512 e = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        __m512i k = _mm512_setzero_si512();
        for (int step = nl / 2; step > 0; step /= 2) {
            const __m512i p = _mm512_add_epi32(k, _mm512_set1_epi32(step));
            const __m512 t = _mm512_permutex2var_ps(t0, _mm512_sub_epi32(p, _mm512_set1_epi32(1)), t1);
            k = _mm512_mask_mov_epi32(k, _mm512_cmp_ps_mask(xv, t, _CMP_GT_OQ), p);
        }
        const __m512 d = _mm512_sub_ps(xv, _mm512_mul_ps(vs, _mm512_permutex2var_ps(l0, k, l1)));
        e = _mm512_fmadd_ps(d, d, e);
        if (c) _mm_storeu_si128((__m128i *)(c + i), _mm512_cvtepi32_epi8(k));
    }
    return _mm512_reduce_add_ps(e);
}

void kern_kvq_nf_map_avx512(uint8_t *c, int n, int bits) {
    const uint8_t *lv = kern_kvq_nf_levels(bits);
    const struct unpack512 *u = unpacker(bits);
    int i = 0;
    for (; i + 64 <= n; i += 64) _mm512_storeu_si512(c + i, nf_map64(u, _mm512_loadu_si512(c + i)));
    for (; i < n; i++) c[i] = lv[c[i]];
}

void kern_kvq_to_f16_avx512(const float *x, int d, uint8_t *dst) {
    int i = 0;
    for (; i + 16 <= d; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + 2 * i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    if (i < d) {
        const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        _mm256_mask_storeu_epi16(dst + 2 * i, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT));
    }
}

void kern_kvq_from_f16_avx512(const uint8_t *src, int d, float *x) {
    int i = 0;
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(x + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * i))));
    if (i < d) {
        const __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        _mm512_mask_storeu_ps(x + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + 2 * i)));
    }
}

/* 16 codes of x (scalar encoder's rounding) stored at out: bytes, or 4-bit pairs */
static void codes16_avx512(const float *x, __m512 bias, __m512 inv, __m512 top, int bits, uint8_t *out) {
    __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x), bias), inv), _mm512_set1_ps(0.5f));
    t = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), _mm512_setzero_ps()),
                      top);
    const __m512i c = _mm512_cvttps_epi32(t);
    if (bits == 8) {
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(c));
    } else { /* code 2k low nibble, 2k + 1 high: dword pairs as qwords */
        const __m512i p = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));
        _mm_storel_epi64((__m128i *)out, _mm512_cvtepi64_epi8(p));
    }
}

/* The butterflies of stages 1, 2, 4, 8 inside a vector: lane i meets lane i ^ m; the
 * lower of the two takes a + c, the upper a - c (a the lower's value, c the upper's). */
static inline __m512 fwht16(__m512 v) {
    static const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int s = 0; s < 4; s++) {
        const __m512 p = _mm512_permutexvar_ps(_mm512_xor_si512(iota, _mm512_set1_epi32(1 << s)), v);
        v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper[s], p, v);
    }
    return v;
}

void kern_kvq_fwht_avx512(float *x, int n) {
    for (int o = 0; o < n; o += 16) _mm512_storeu_ps(x + o, fwht16(_mm512_loadu_ps(x + o)));
    for (int len = 16; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j += 16) {
                const __m512 a = _mm512_loadu_ps(x + j), c = _mm512_loadu_ps(x + j + len);
                _mm512_storeu_ps(x + j, _mm512_add_ps(a, c));
                _mm512_storeu_ps(x + j + len, _mm512_sub_ps(a, c));
            }
}

void kern_kvq_hadamard_avx512(float *x, int d, int b, const float *signs, float norm, bool inverse) {
    const __m512 vn = _mm512_set1_ps(norm);
    /* a block of up to 16 vectors in registers: the scalar code's products, butterflies
     * and scaling, in its order */
    for (int o = 0; o < d; o += b) {
        __m512 v[16];
        const int nv = b / 16;
        for (int i = 0; i < nv; i++) {
            const __m512 y = _mm512_loadu_ps(x + o + 16 * i);
            v[i] = fwht16(inverse ? y : _mm512_mul_ps(y, _mm512_loadu_ps(signs + o + 16 * i)));
        }
        for (int len = 1; len < nv; len <<= 1)
            for (int i = 0; i < nv; i += 2 * len)
                for (int j = i; j < i + len; j++) {
                    const __m512 a = v[j], c = v[j + len];
                    v[j] = _mm512_add_ps(a, c);
                    v[j + len] = _mm512_sub_ps(a, c);
                }
        for (int i = 0; i < nv; i++) {
            const __m512 f = inverse ? _mm512_mul_ps(vn, _mm512_loadu_ps(signs + o + 16 * i)) : vn;
            _mm512_storeu_ps(x + o + 16 * i, _mm512_mul_ps(v[i], f));
        }
    }
}

#define VL 16
#define VF __m512
#define VZERO _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VADD _mm512_add_ps
#define VFMA _mm512_fmadd_ps
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VU8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VSUM(x) _mm512_reduce_add_ps(x)
#define VMIN _mm512_min_ps
#define VMAX _mm512_max_ps
#define VHMIN(x) _mm512_reduce_min_ps(x)
#define VHMAX(x) _mm512_reduce_max_ps(x)
#define CODES16 codes16_avx512
#define SOFTMAX_STEP kern_softmax_step_avx512
#define FN(x) x##_avx512g /* generic body; the fast path below dispatches to it */
#define UNPACK kern_kvq_unpack_avx512
#define NFMAP kern_kvq_nf_map_avx512
#include "kernels/kv_quant_simd.inc"

void kern_kvq_attn_avx512g(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                           const struct kern_kv_rows *v, int n);
#endif

/* ---- Fast path: K and V 4- or 8-bit in groups % 32 == 0, or normal-float, d % 64 == 0 ----
 * One pass over the rows for a GQA group of up to 8 query heads, in blocks of up to 64
 * rows (a paged cache's block; one online-softmax step each) and tiles of 16 rows.
 *
 * Scores: q is rounded once per call to int8 with one scale per head (sq = max|q| /
 * 127), so a score is sq * sum_g scale_g * (q8 . codes)_g + sum_g bias_g * qsum_g (the
 * bias term from the float q). 8-bit keys with 8-bit values add a second int8 digit, q8
 * + r / 128 (with one digit the rounding of q was K8V8's largest error: mean KLD 4e-5
 * instead of 7e-6 on tinydoc; a 4-bit side outweighs it). A tile's key codes are
 * transposed to one vector per 4-byte column (lane r: row r), so vpdpbusd of a column
 * against the broadcast q bytes of that column adds straight into the rows' int32 sums:
 * nothing to reduce across lanes, and a group's scale and bias cost one FMA each per 16
 * rows and head. 4-bit codes: the low nibbles against the even values of q, the high
 * nibbles (masked in place, so 16x) against the odd ones. Error: each q value moves by
 * at most sq/2 (sq/256 with two digits); tests/test_kv_quant.c checks against attention
 * with the rounded query.
 *
 * Softmax: kern_softmax_step_avx512 for the heads side by side, their maxima, rescale
 * factors and sums in vectors (one exp for all heads' e^(m - m') per block).
 *
 * Values: per block, head and V group the weights w_j = p_j * scale_j are rounded to 16
 * bits in steps of max_j p_j * max_j scale_j / 65535, stored less 32768 as int16, and
 * vpdpwssd adds two rows' codes (interleaved as 16-bit words) times their weights into
 * int32 lanes, plus 32768 times the codes' column sums; the sums go to the float
 * accumulator once per block. Rounding moves the result by sum_j e_j * code_j (|e_j| <=
 * step/2); its mean part mid * sum_j e_j (mid: the codes' midpoint) is taken back
 * exactly, leaving sum_j e_j * (code_j - mid): ~1e-5 of the values' range, up to 2.2e-4
 * on tests/test_kv_quant.c's inputs (checked against exact attention, a dominant row
 * too). The bias terms p_j * bias_j (and the mid terms) are float sums in 16 lanes per
 * head and group kept after the accumulator, rescaled with it, added once per call.
 * The accumulator keeps each 32 or 64 values in the order the V codes unpack to
 * (v_value).
 *
 * Normal-float rows are one group of scale s and bias -127.5 s over their level bytes
 * (the scales of 16 rows computed from their bytes in a vector). 4-bit keys take the
 * 4-bit path with the nibbles mapped to level bytes by a byte shuffle; other keys and all
 * values take the 8-bit paths: with VBMI (kv_quant_avx512vbmi.c) unpacked in registers
 * by vpermb + vpmultishiftqb + vpermb (values straight into v_pair's order), without it
 * copied as level bytes a tile of keys and a block of values at a time. */

#define FMAXH 8       /* heads per fast-path pass: a GQA group of up to 8 reads the rows once */
#define FB 64         /* rows per softmax block */
#define FMAXG (KERN_KVQ_MAX_DIM / 32) /* groups per row at most */
#define F_PF_ROWS 48  /* prefetch distance: K and V rows this far ahead */
#define WMAX 65535.0f /* the largest V weight, in steps (stored less 32768, as int16) */

#if !KVQ_VBMI
/* The AVX-512 level includes VNNI (core/cpu.c checks it); tests may turn the fast path off. */
static int fast_wanted = 1;
void kern_kvq_use_fast_avx512(int on) { fast_wanted = on; }
/* Normal-float rows take the VBMI build where the CPU has VBMI (tests may turn it off). */
static int vbmi_wanted = 1;
void kern_kvq_use_vbmi_avx512(int on) { vbmi_wanted = on; }
#endif

/* Where the V pass keeps a head's values: position p of the accumulator holds value
 * v_value(VB, CV, p), a permutation within each 16 * CV values (see v_pair). */
static inline int v_value(int VB, int CV, int p) {
    const int n = 16 * CV, t = p % n / 16, l = p % 16; /* vector, lane */
    int b;                                               /* the byte of the unpacked ones */
    if (CV == 2 && VB == 4) b = (l / 4 % 2) * 8 + (l / 8) * 4 + l % 4;
    else b = 8 * (l / 4) + l % 4 + 4 * (VB == 4 ? t / 2 : t % 2);
    return p - p % n + (VB == 4 ? 2 * b + t % 2 : 32 * (t / 2) + b);
}

/* 16 rows at b + r * s, addressed from two bases and odd multiples of s, all in
 * registers (an array of row pointers on the stack measured up to 2x slower: its stores
 * alias the row loads in the store-to-load check). */
struct rows16 {
    const uint8_t *b0, *b8;
    size_t s, s3, s5, s7;
};
static inline struct rows16 rows16_at(const uint8_t *b, size_t s) {
    return (struct rows16){b, b + 8 * s, s, 3 * s, 5 * s, 7 * s};
}
INLINE const uint8_t *row16(const struct rows16 *t, int r) {
    const uint8_t *b = r < 8 ? t->b0 : t->b8;
    switch (r % 8) {
    case 0: return b;
    case 1: return b + t->s;
    case 2: return b + 2 * t->s;
    case 3: return b + t->s3;
    case 4: return b + 4 * t->s;
    case 5: return b + t->s5;
    case 6: return b + 2 * t->s3;
    default: return b + t->s7;
    }
}

#if !KVQ_VBMI
/* Rows 0..n-1 (n <= 16) of a tile, d values each (d % 64 == 0), as their level bytes at
 * out, d apart: without VBMI, normal-float rows are scored from such copies. */
static void nf_tile_bytes(const struct unpack512 *u, const struct rows16 *rows, int n, int d, uint8_t *out) {
    for (int r = 0; r < n; r++) {
        const uint8_t *src = row16(rows, r);
        for (int i = 0; i < d; i += 64)
            _mm512_storeu_si512(out + (size_t)r * d + i, nf_map64(u, unpack64(u, src + (size_t)i * u->bits / 8)));
    }
}
#endif

/* Dwords k..k+7 (bytes off..off+31) of 16 rows, transposed: lane r of t[i] holds
 * dword k+i of row r. Two rows per vector (z), then the 8x8 dword transposes of both
 * halves (unpacks of dwords, of qwords, then 128-bit lanes picked into row order). Out of
 * line: inlined, its 24 live vectors next to the heads' accumulators spill (measured up
 * to 35% slower with 7 heads, and less steady from build to build with 2). */
INLINE void cols8_transpose(const __m512i z[8], __m512i t[8]) {
    __m512i a[8], b[8];
    UNROLL
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    UNROLL
    for (int i = 0; i < 8; i += 4)
        UNROLL
        for (int j = 0; j < 2; j++) {
            b[i + j] = _mm512_unpacklo_epi64(a[i + j], a[i + j + 2]);
            b[i + j + 2] = _mm512_unpackhi_epi64(a[i + j], a[i + j + 2]);
        }
    /* b[m] (rows 0-7) and b[4 + m] (8-15), 128-bit lane l: dword 4 (l % 2) + e of four rows */
    UNROLL
    for (int m = 0; m < 4; m++) {
        const int e = m == 1 ? 2 : m == 2 ? 1 : m;
        t[e] = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xDD);
    }
}
static __attribute__((noinline)) void tile_cols8(const struct rows16 *rows, size_t off, __m512i t[8]) {
    __m512i z[8];
    UNROLL
    for (int i = 0; i < 8; i++) { /* rows i | i+4 for i < 4, rows i+4 | i+8 above */
        const int r = i < 4 ? i : i + 4;
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row16(rows, r) + off))),
                                  _mm256_loadu_si256((const __m256i *)(row16(rows, r + 4) + off)), 1);
    }
    cols8_transpose(z, t);
}
#if KVQ_VBMI
/* The same of normal-float rows: their values off..off+31 as level bytes. */
static __attribute__((noinline)) void tile_cols8_nf(const struct rows16 *rows, size_t off, const struct unpack512 *u,
                                                    __m512i t[8]) {
    __m512i z[8];
    const size_t o = off * (size_t)u->bits / 8;
    UNROLL
    for (int i = 0; i < 8; i++) {
        const int r = i < 4 ? i : i + 4;
        z[i] = nf_bytes_vbmi(u, row16(rows, r) + o, row16(rows, r + 4) + o);
    }
    cols8_transpose(z, t);
}
/* Values off..off+63 of 16 normal-float rows of 2 or 3 bits, as the 16 columns of level
 * bytes tile_cols8 gives for 8-bit codes: each 8 codes of a row spread to a dword, those
 * transposed (a quarter of the bytes tile_cols8_nf moves), then each dword's codes 0-3
 * and 4-7 to bytes by vpmultishiftqb and mapped. */
static __attribute__((noinline)) void tile_cols16_nfp(const struct rows16 *rows, size_t off, const struct unpack512 *u,
                                                      __m512i t[16]) {
    __m512i z[8], c[8];
    const size_t o = off * (size_t)u->bits / 8;
    const __mmask32 m = (__mmask32)((1u << 8 * u->bits) - 1);
    UNROLL
    for (int i = 0; i < 8; i++) {
        const int r = i < 4 ? i : i + 4;
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(m, row16(rows, r) + o)),
                                             _mm256_maskz_loadu_epi8(m, row16(rows, r + 4) + o), 1);
        z[i] = _mm512_permutexvar_epi8(u->kspread, x);
    }
    cols8_transpose(z, c);
    UNROLL
    for (int j = 0; j < 8; j++) {
        t[2 * j] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(u->kshift[0], c[j]), u->lv64);
        t[2 * j + 1] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(u->kshift[1], c[j]), u->lv64);
    }
}
#endif

/* The `bytes` (1 or 4) at off of 16 rows as 16 dwords, built in registers (small
 * stores read back as a vector stall store forwarding). */
INLINE __m512i tile_dwords(const struct rows16 *rows, size_t off, const int bytes) {
    int32_t x[16];
    UNROLL
    for (int r = 0; r < 16; r++) {
        if (bytes == 1) x[r] = row16(rows, r)[off];
        else memcpy(&x[r], row16(rows, r) + off, 4);
    }
    return _mm512_set_epi32(x[15], x[14], x[13], x[12], x[11], x[10], x[9], x[8], x[7], x[6], x[5], x[4], x[3], x[2],
                            x[1], x[0]);
}
/* The [scale, bias] f16 pair at off of 16 rows. */
INLINE __m512i tile_sb(const struct rows16 *rows, size_t off) { return tile_dwords(rows, off, 4); }
/* The scales of 16 normal-float rows from their bytes e at off: 2^a * p12[b] for e - 216
 * = 12 a + b (a gather from kern_kvq_nf_scales cost more), p12[b] = kvq_nf_scale(216 + b). */
INLINE __m512 tile_nf_scales(const struct rows16 *rows, size_t off, __m512 p12) {
    const __m512i e = tile_dwords(rows, off, 1);
    const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(216)));
    const __m512 a = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _mm512_set1_ps(1.0f / 12)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i b = _mm512_cvtps_epi32(_mm512_fnmadd_ps(a, _mm512_set1_ps(12.0f), t));
    return _mm512_maskz_scalef_ps(_mm512_test_epi32_mask(e, e), _mm512_permutexvar_ps(b, p12), a);
}
static inline __m512 sb_scale(__m512i sb) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(sb)); }
static inline __m512 sb_bias(__m512i sb) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(sb, 16))); }

/* The [scale, bias] pairs of group g of 16 rows (sb: the groups' offset in a row);
 * with a multiple of 8 groups transposed 8 groups at a time, kept in c. */
INLINE __m512i tile_group_sb(const struct rows16 *rows, size_t sb, int ng, int g, __m512i c[8]) {
    if (ng % 8) return tile_sb(rows, sb + 4 * (size_t)g);
    if (g % 8 == 0) tile_cols8(rows, sb + 4 * (size_t)g, c);
    return c[g % 8];
}

/* The int8 query of NH heads for KB-bit keys, once per call. */
struct fast_q {
    /* 4 int8 values per dword, lined up with a key row's w dwords, head h's at q + 2 * h * w:
     * 8-bit, values 4k..4k+3 in dword k (then, at + w, the second digit); 4-bit, the even
     * values of 8k..8k+7, then (at + w) the odd ones. Packed densely: arrays 4 KB apart
     * share L1 sets and alias in the store-to-load check. */
    int32_t q[FMAXH * 2 * KERN_KVQ_MAX_DIM / 4] __attribute__((aligned(64)));
    int w;
    float sq[FMAXH];
    float qs[FMAXH][FMAXG]; /* per K group: sum of q / sq */
};

static void fast_q_prepare(struct fast_q *f, const int KB, const int NH, const float *q, int d, int G) {
    const __m512 r128 = _mm512_set1_ps(128.0f);
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    f->w = d * KB / 32;
    for (int h = 0; h < NH; h++) {
        const float *qh = q + (size_t)h * d;
        __m512 mx = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qh + i)));
        const float amax = _mm512_reduce_max_ps(mx), sq = amax > 0 ? amax / 127.0f : 1.0f;
        /* q / sq rounded to nearest even, like lrintf in the tests' reference */
        const __m512 vsq = _mm512_set1_ps(sq);
        int8_t *e = (int8_t *)(f->q + (size_t)2 * h * f->w), *o = e + 4 * f->w;
        for (int i = 0; i < d; i += 32) {
            const __m512 y0 = _mm512_div_ps(_mm512_loadu_ps(qh + i), vsq);
            const __m512 y1 = _mm512_div_ps(_mm512_loadu_ps(qh + i + 16), vsq);
            const __m512i x0 = _mm512_cvtps_epi32(y0), x1 = _mm512_cvtps_epi32(y1);
            if (KB == 8) {
                /* and the second digit, (q / sq - q8) * 128 rounded (|.| <= 64; the
                 * subtraction is exact) */
                const __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(y0, _mm512_cvtepi32_ps(x0)), r128));
                const __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(y1, _mm512_cvtepi32_ps(x1)), r128));
                _mm_storeu_si128((__m128i *)(e + i), _mm512_cvtepi32_epi8(x0));
                _mm_storeu_si128((__m128i *)(e + i + 16), _mm512_cvtepi32_epi8(x1));
                _mm_storeu_si128((__m128i *)(o + i), _mm512_cvtepi32_epi8(r0));
                _mm_storeu_si128((__m128i *)(o + i + 16), _mm512_cvtepi32_epi8(r1));
            } else {
                _mm_storeu_si128((__m128i *)(e + i / 2), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(x0, ev, x1)));
                _mm_storeu_si128((__m128i *)(o + i / 2), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(x0, od, x1)));
            }
        }
        f->sq[h] = sq;
        for (int g = 0; g < d / G; g++) {
            __m512 t = _mm512_setzero_ps();
            for (int i = g * G; i < (g + 1) * G; i += 16) t = _mm512_add_ps(t, _mm512_loadu_ps(qh + i));
            f->qs[h][g] = _mm512_reduce_add_ps(t) / sq;
        }
    }
}

/* Scores of the 16 rows of a tile for NH heads into sc[h * FB + j ..]; mx[h]: their
 * running max, lane by lane. NF: normal-float rows (G = d) of scales nfs, 4-bit codes
 * mapped to their level bytes here, other widths' level bytes given as 8-bit rows, or
 * unpacked from nfu's codes (VBMI; NF 2: 2- and 3-bit codes transposed packed). */
INLINE void tile_scores(const int KB, const int NH, const int Q2, const int NF, const struct fast_q *f,
                        const struct rows16 *rows, const struct unpack512 *nfu, int d, int G, __m512 nfs, float *sc,
                        int j, __m512 *mx) {
    const int wg = G * KB / 32, w = d * KB / 32; /* dwords per group, per row */
    const __m512i m_lo = _mm512_set1_epi8(0x0F), m_hi = _mm512_set1_epi8((char)0xF0);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kern_kvq_nf_levels(4)));
    __m512 acc[FMAXH];
    /* two int32 sums per head, up to 4 heads (more: one, the registers run out): 4-bit,
     * low and (16x) high nibbles; 8-bit, even and odd columns; Q2, the two digits of q */
    const int TWO = NH <= 4 || Q2;
    __m512i ia[FMAXH], ib[FMAXH], sbc[8];
    UNROLL
    for (int h = 0; h < NH; h++) {
        acc[h] = _mm512_setzero_ps();
        ia[h] = ib[h] = _mm512_setzero_si512();
    }
    const int NC = NF == 2 ? 16 : 8; /* columns a step */
    for (int k = 0; k < w; k += NC) {
        __m512i t[16];
#if KVQ_VBMI
        if (NF == 2) tile_cols16_nfp(rows, 4 * (size_t)k, nfu, t);
        else if (nfu) tile_cols8_nf(rows, 4 * (size_t)k, nfu, t);
        else
#else
        (void)nfu;
#endif
            tile_cols8(rows, 4 * (size_t)k, t);
        UNROLL
        for (int i = 0; i < NC; i++) {
            __m512i lo = t[i], hi = t[i]; /* NF 4-bit: the level bytes of the low and high nibbles */
            if (KB == 4 && NF) {
                lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(t[i], m_lo));
                hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m_lo));
            }
            UNROLL
            for (int h = 0; h < NH; h++) {
                const int32_t *qh = f->q + (size_t)2 * h * f->w + k + i;
                if (KB == 4 && NF) {
                    ia[h] = _mm512_dpbusd_epi32(ia[h], lo, _mm512_set1_epi32(qh[0]));
                    if (TWO) ib[h] = _mm512_dpbusd_epi32(ib[h], hi, _mm512_set1_epi32(qh[f->w]));
                    else ia[h] = _mm512_dpbusd_epi32(ia[h], hi, _mm512_set1_epi32(qh[f->w]));
                } else if (KB == 4 && TWO) {
                    ia[h] = _mm512_dpbusd_epi32(ia[h], _mm512_and_si512(t[i], m_lo), _mm512_set1_epi32(qh[0]));
                    ib[h] = _mm512_dpbusd_epi32(ib[h], _mm512_and_si512(t[i], m_hi), _mm512_set1_epi32(qh[f->w]));
                } else if (KB == 4) {
                    ia[h] = _mm512_dpbusd_epi32(ia[h], _mm512_and_si512(t[i], m_lo), _mm512_set1_epi32(qh[0]));
                    ia[h] = _mm512_dpbusd_epi32(ia[h], _mm512_and_si512(_mm512_srli_epi16(t[i], 4), m_lo),
                                                _mm512_set1_epi32(qh[f->w]));
                } else if (Q2) {
                    ia[h] = _mm512_dpbusd_epi32(ia[h], t[i], _mm512_set1_epi32(qh[0]));
                    ib[h] = _mm512_dpbusd_epi32(ib[h], t[i], _mm512_set1_epi32(qh[f->w]));
                } else if (i % 2 && TWO) {
                    ib[h] = _mm512_dpbusd_epi32(ib[h], t[i], _mm512_set1_epi32(qh[0]));
                } else {
                    ia[h] = _mm512_dpbusd_epi32(ia[h], t[i], _mm512_set1_epi32(qh[0]));
                }
            }
            if (i % 4 < 3 || (k + i + 1) % wg) continue;
            /* a group ends (every 4 dwords at least): its scale and bias */
            const int g = (k + i) / wg;
            __m512 sv = nfs, bv = _mm512_mul_ps(nfs, _mm512_set1_ps(-127.5f));
            if (!NF) {
                const __m512i sb = tile_group_sb(rows, (size_t)d * KB / 8, d / G, g, sbc);
                sv = sb_scale(sb), bv = sb_bias(sb);
            }
            UNROLL
            for (int h = 0; h < NH; h++) {
                const __m512i y = _mm512_add_epi32(ia[h], KB == 4 && !NF ? _mm512_srai_epi32(ib[h], 4) : ib[h]);
                const __m512 r = _mm512_set1_ps(1.0f / 128);
                const __m512 x = Q2 ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib[h]), r, _mm512_cvtepi32_ps(ia[h]))
                                    : _mm512_cvtepi32_ps(y);
                acc[h] = _mm512_fmadd_ps(x, sv, acc[h]);
                acc[h] = _mm512_fmadd_ps(bv, _mm512_set1_ps(f->qs[h][g]), acc[h]);
                ia[h] = ib[h] = _mm512_setzero_si512();
            }
        }
    }
    UNROLL
    for (int h = 0; h < NH; h++) {
        const __m512 x = _mm512_mul_ps(acc[h], _mm512_set1_ps(f->sq[h]));
        _mm512_store_ps(sc + h * FB + j, x);
        mx[h] = _mm512_max_ps(mx[h], x);
    }
}

/* Lane h < 8 of the result: the max (the sum, when add) of the 16 lanes of x[h]. */
INLINE __m512 fold8(const __m512 x[8], const int add) {
#define FOLD(a, b) (add ? _mm512_add_ps(a, b) : _mm512_max_ps(a, b))
    __m512 t[4], u[2];
    UNROLL
    for (int i = 0; i < 4; i++) /* per 128-bit lane [a, b, a, b] of x[2i], x[2i+1] */
        t[i] = FOLD(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    UNROLL
    for (int i = 0; i < 2; i++) /* [a, b, c, d] of x[4i..4i+3] */
        u[i] = FOLD(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w = FOLD(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    return FOLD(_mm512_shuffle_f32x4(w, w, 0x88), _mm512_shuffle_f32x4(w, w, 0xDD));
#undef FOLD
}

/* 16 * CV values (from value c0) of V rows a and b as 16-bit pairs (a's code low, b's
 * high) in CV vectors, the bytes widened to words and interleaved 4 words at a time:
 * CV = 4 takes 32 bytes of each row and lane 4i + j of vector t holds byte 8i + j + 4(t %
 * 2) of them (8-bit: of the t/2-th 32 bytes; 4-bit: low nibble for even t, high for odd
 * t, with 4(t / 2) for 4(t % 2)), so with 4-bit codes lanes 0-7 hold values of the first
 * 32, lanes 8-15 of the second 32; CV = 2 takes 32 values, 4-bit: the 16 bytes in the
 * lane order 0-3, 8-11, 4-7, 12-15 (low nibbles in vector 0, high in 1), 8-bit: as CV = 4. */
INLINE void v_pair(const int VB, const int CV, const struct unpack512 *nfu, const uint8_t *a, const uint8_t *b, int c0,
                   __m512i *u) {
#if KVQ_VBMI
    if (nfu) { /* normal-float rows (VB 8): their level bytes, in the layout of 8-bit codes */
        const size_t o = (size_t)c0 * nfu->bits / 8;
        if (CV == 2) {
            const __mmask64 lo = 0x5555555555555555ull; /* the words' low bytes */
            const __m512i x = nf_bytes_vbmi(nfu, a + o, b + o);
            u[0] = _mm512_maskz_permutexvar_epi8(lo, nfu->pair2[0], x);
            u[1] = _mm512_maskz_permutexvar_epi8(lo, nfu->pair2[1], x);
        } else { /* the rows' bytes interleaved, then with zeros: the 8-bit codes' words */
            const __m512i xa = nf_pair_bytes_vbmi(nfu, a + o), xb = nf_pair_bytes_vbmi(nfu, b + o), z = _mm512_setzero_si512();
            const __m512i lo = _mm512_unpacklo_epi8(xa, xb), hi = _mm512_unpackhi_epi8(xa, xb);
            u[0] = _mm512_unpacklo_epi8(lo, z);
            u[1] = _mm512_unpackhi_epi8(lo, z);
            u[2] = _mm512_unpacklo_epi8(hi, z);
            u[3] = _mm512_unpackhi_epi8(hi, z);
        }
        return;
    }
#else
    (void)nfu;
#endif
    if (VB == 4 && CV == 2) {
        const __m256i za = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(a + c0 / 2)));
        const __m256i zb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + c0 / 2)));
        const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(za, zb)),
                                             _mm256_unpackhi_epi16(za, zb), 1);
        u[0] = _mm512_and_si512(x, _mm512_set1_epi16(15));
        u[1] = _mm512_srli_epi16(x, 4);
    } else if (VB == 4) {
        const __m512i za = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(a + c0 / 2)));
        const __m512i zb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + c0 / 2)));
        const __m512i x0 = _mm512_unpacklo_epi16(za, zb), x1 = _mm512_unpackhi_epi16(za, zb);
        const __m512i m = _mm512_set1_epi16(15);
        u[0] = _mm512_and_si512(x0, m);
        u[1] = _mm512_srli_epi16(x0, 4);
        u[2] = _mm512_and_si512(x1, m);
        u[3] = _mm512_srli_epi16(x1, 4);
    } else {
        UNROLL
        for (int i = 0; i < CV / 2; i++) {
            const __m512i za = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(a + c0 + 32 * i)));
            const __m512i zb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + c0 + 32 * i)));
            u[2 * i] = _mm512_unpacklo_epi16(za, zb);
            u[2 * i + 1] = _mm512_unpackhi_epi16(za, zb);
        }
    }
}

/* acc[h * da + ..16 * CV) += the block's pairs of V rows from v0 (nj rows; an odd last
 * one paired with itself, its weight 0), 16 * CV values from c0, times the weights of
 * NH heads: wa points at head 0's int16 pairs of the first 32 values' group, wb of the
 * second 32's (CV = 4), one head every FB / 2 dwords; sa, sb: the heads' steps for
 * them, FMAXG apart. SPLIT: 4-bit codes whose two 32s are in different groups (lanes
 * 8-15 take wb). Up to 4 heads take 64 values per pass, more 32 (the accumulators stay
 * in registers): one pass over the rows unpacks each pair once, where it is used (a
 * block's unpacked rows stored for several passes alias the rows being read in the
 * store-to-load check: measured up to 30% slower, depending on where buffers land). */
INLINE void v_heads(const int VB, const int NH, const int CV, const int SPLIT, const struct unpack512 *nfu,
                    const uint8_t *v0, size_t vs, int nj,
                    int c0, const int32_t *wa, const int32_t *wb, const float *sa, const float *sb, float *acc,
                    int da) {
    __m512i a[FMAXH][4], cs[4]; /* cs: the codes' column sums, 16-bit per row of a pair */
    UNROLL
    for (int t = 0; t < CV; t++) {
        cs[t] = _mm512_setzero_si512();
        UNROLL
        for (int h = 0; h < NH; h++) a[h][t] = _mm512_setzero_si512();
    }
    for (int p = 0; p < (nj + 1) / 2; p++) {
        const uint8_t *r = v0 + (size_t)(2 * p) * vs;
        __m512i x[4];
        v_pair(VB, CV, nfu, r, 2 * p + 1 < nj ? r + vs : r, c0, x);
        UNROLL
        for (int t = 0; t < CV; t++) cs[t] = _mm512_add_epi16(cs[t], x[t]);
        UNROLL
        for (int h = 0; h < NH; h++) {
            const int32_t *w = wa + h * (FB / 2) + p;
            const __m512i w0 = SPLIT ? _mm512_mask_set1_epi32(_mm512_set1_epi32(*w), 0xFF00, wb[h * (FB / 2) + p])
                                     : _mm512_set1_epi32(*w);
            const __m512i w1 = VB == 8 && CV == 4 ? _mm512_set1_epi32(wb[h * (FB / 2) + p]) : w0;
            UNROLL
            for (int t = 0; t < CV; t++) a[h][t] = _mm512_dpwssd_epi32(a[h][t], x[t], t < 2 ? w0 : w1);
        }
    }
    /* the weights were stored less 32768: add 32768 * the codes' column sums back */
    UNROLL
    for (int t = 0; t < CV; t++) cs[t] = _mm512_slli_epi32(_mm512_madd_epi16(cs[t], _mm512_set1_epi16(1)), 15);
    UNROLL
    for (int h = 0; h < NH; h++) {
        const __m512 s0 = _mm512_set1_ps(sa[h * FMAXG]), s1 = _mm512_set1_ps(sb[h * FMAXG]);
        const __m512 st = SPLIT ? _mm512_mask_mov_ps(s0, 0xFF00, s1) : s0;
        UNROLL
        for (int t = 0; t < CV; t++) {
            float *y = acc + (size_t)h * da + 16 * t;
            const __m512 x = _mm512_cvtepi32_ps(_mm512_add_epi32(a[h][t], cs[t]));
            _mm512_store_ps(y, _mm512_fmadd_ps(x, VB == 8 && t >= 2 ? s1 : st, _mm512_load_ps(y)));
        }
    }
}

/* The block's values for NH heads, 16 * CV at a time. */
INLINE void v_block(const int VB, const int NH, const int SPLIT, const struct unpack512 *nfu, const uint8_t *v0,
                    size_t vs, int nj, int d, int G,
                    const int32_t *wq, float step[][FMAXG], float *accp, int da) {
    const int CV = NH > 4 ? 2 : 4;
    for (int c0 = 0; c0 < d; c0 += 16 * CV) {
        const int ga = c0 / G, gb = (c0 + 32) / G;
        v_heads(VB, NH, CV, SPLIT, nfu, v0, vs, nj, c0, wq + (size_t)ga * NH * (FB / 2), wq + (size_t)gb * NH * (FB / 2),
                &step[0][ga], &step[0][gb], accp + c0, da);
    }
}

/* Rows stream from L3/DRAM, so they are fetched well ahead, one prefetch per 64 bytes
 * and 16 rows per tile scored: into L1 the rows F_PF_ROWS ahead, into L2 those 64 rows
 * further. These helpers must be INLINE (always inlined): GCC takes a function that only
 * prefetches for one without side effects and deletes the calls to it where it does not
 * inline it, as it once did here (the fast path ran with no prefetch at all). */
#define F_PF_L2_ROWS (F_PF_ROWS + 64)
INLINE void pf_line(const uint8_t *p, const int hint) { /* clang wants the hint a literal */
    if (hint == _MM_HINT_T0) _mm_prefetch((const char *)p, _MM_HINT_T0);
    else _mm_prefetch((const char *)p, _MM_HINT_T1);
}
INLINE void pf_range(const uint8_t *p, size_t bytes, const int hint) {
    for (size_t b = 0; b < bytes; b += 64) pf_line(p + b, hint);
    pf_line(p + bytes - 1, hint);
}

/* The K and V rows [j, j + 16) counted from the start of runs[ri] (in a later run past
 * its end; nothing past the last). */
INLINE void pf_tile(const struct kern_kv_run *runs, int n_runs, int ri, int j, size_t ks, size_t vs, size_t krb,
                    size_t vrb, const int hint) {
    while (ri < n_runs && j >= runs[ri].n) j -= runs[ri++].n;
    if (ri >= n_runs) return;
    const struct kern_kv_run *run = &runs[ri];
    const int e = j + 16 < run->n ? j + 16 : run->n;
    pf_range(run->k + (size_t)j * ks, (size_t)(e - j - 1) * ks + krb, hint);
    pf_range(run->v + (size_t)j * vs, (size_t)(e - j - 1) * vs + vrb, hint);
}

INLINE void fast_attn(const int KB, const int NH, struct kern_attn_state *s, int h0, const float *q,
                      const struct kern_kv_rows *k, const struct kern_kv_rows *v, const struct kern_kv_run *runs,
                      int n_runs) {
    /* normal-float rows are scored as their level bytes (8-bit codes: VB 8, and KB 8 for
     * keys of other widths than 4), unpacked in registers with VBMI, else copied a tile
     * of keys and a block of values at a time */
    const bool knf = k->group == KERN_KVQ_NF, vnf = v->group == KERN_KVQ_NF;
    const int d = s->d, KG = kvq_gsize(k->group, d), VG = kvq_gsize(v->group, d), VB = vnf ? 8 : v->bits, vng = d / VG;
    const size_t ks = k->stride, vs = v->stride, kcb = (size_t)d * k->bits / 8, vcb = (size_t)d * v->bits / 8;
    const size_t krb = kern_kvq_row_bytes(k->bits, k->group, d), vrb = kern_kvq_row_bytes(v->bits, v->group, d);
    const size_t vpb = vrb - vcb; /* a V row's scale bytes */
    const int q2 = KB == 8 && k->bits == 8 && v->bits == 8;
    const __m512 p12 = _mm512_maskz_loadu_ps(0xFFF, kern_kvq_nf_scales() + 216);
    const struct unpack512 *ku = unpacker(k->bits), *vu = unpacker(v->bits);
    const struct unpack512 *knfu = KVQ_VBMI && knf && KB == 8 ? ku : NULL;
    const int da = d + 16 * vng;               /* accumulator floats per head: values, 16 bias lanes per V group */
    const float mid = VB == 4 ? 7.5f : 127.5f; /* the V codes' midpoint */
    float accp[FMAXH * (KERN_KVQ_MAX_DIM + 16 * FMAXG)] __attribute__((aligned(64)));
    float sc[FMAXH * FB] __attribute__((aligned(64)));
    /* per V group: the rows' scales, then their biases + mid * scale */
    float vsb[FMAXG * 2 * FB] __attribute__((aligned(64)));
    /* per V group, head and pair of rows (densely, see fast_q): the two int16 weights */
    int32_t wq[FMAXH * FMAXG * FB / 2] __attribute__((aligned(64)));
    float step[FMAXH][FMAXG];
    /* a last partial tile's K rows and V scales and biases */
    uint8_t kpart[16 * (KERN_KVQ_MAX_DIM + 4 * FMAXG)], vpart[16 * 4 * FMAXG];
#if !KVQ_VBMI
    /* normal-float rows' level bytes: a tile's keys, a block's values */
    uint8_t kst[16 * KERN_KVQ_MAX_DIM] __attribute__((aligned(64)));
    uint8_t vst[FB * KERN_KVQ_MAX_DIM] __attribute__((aligned(64)));
#endif
    /* the heads' running max and sum (lane h), in registers for the whole call */
    const __mmask16 hm = (__mmask16)((1u << NH) - 1);
    __m512 mrun = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), hm, s->m + h0);
    __m512 lrun = _mm512_maskz_loadu_ps(hm, s->l + h0);
    struct fast_q f;
    fast_q_prepare(&f, KB, NH, q + (size_t)h0 * d, d, KG);
    UNROLL
    for (int h = 0; h < NH; h++) {
        const float *ah = s->acc + (size_t)(h0 + h) * d;
        float *a = accp + (size_t)h * da;
        for (int i = 0; i < d; i++) a[i] = ah[v_value(VB, NH > 4 ? 2 : 4, i)];
        memset(a + d, 0, sizeof(float) * 16 * (size_t)vng);
    }
    for (int ri = 0; ri < n_runs; ri++) {
    const struct kern_kv_run *run = &runs[ri];
    if (ri == 0) { /* the first rows, which no tile before them fetched */
        for (int j = 0; j < F_PF_ROWS; j += 16) pf_tile(runs, n_runs, 0, j, ks, vs, krb, vrb, _MM_HINT_T0);
        for (int j = F_PF_ROWS; j < F_PF_L2_ROWS; j += 16) pf_tile(runs, n_runs, 0, j, ks, vs, krb, vrb, _MM_HINT_T1);
    }
    for (int j0 = 0; j0 < run->n; j0 += FB) {
        const int nj = run->n - j0 < FB ? run->n - j0 : FB;
        /* scores, and the V rows' scales and biases, 16 rows at a time */
        __m512 smax[FMAXG], mxv[8];
        for (int g = 0; g < vng; g++) smax[g] = _mm512_setzero_ps();
        UNROLL
        for (int h = 0; h < 8; h++) mxv[h] = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < nj; j += 16) {
            pf_tile(runs, n_runs, ri, j0 + j + F_PF_ROWS, ks, vs, krb, vrb, _MM_HINT_T0);
            pf_tile(runs, n_runs, ri, j0 + j + F_PF_L2_ROWS, ks, vs, krb, vrb, _MM_HINT_T1);
            struct rows16 kr = rows16_at(run->k + (size_t)(j0 + j) * ks, ks);
            struct rows16 vr = rows16_at(run->v + (size_t)(j0 + j) * vs + vcb, vs);
            if (nj - j < 16) { /* a last partial tile: its rows, then repeats of the last one */
                for (int r = 0; r < 16; r++) {
                    const int jr = j0 + (j + r < nj ? j + r : nj - 1);
                    memcpy(kpart + r * krb, run->k + (size_t)jr * ks, krb);
                    memcpy(vpart + r * vpb, run->v + (size_t)jr * vs + vcb, vpb);
                }
                kr = rows16_at(kpart, krb);
                vr = rows16_at(vpart, vpb);
            }
            __m512 nfs = _mm512_setzero_ps();
            if (knf) nfs = tile_nf_scales(&kr, kcb, p12);
#if !KVQ_VBMI
            if (knf && KB == 8) {
                nf_tile_bytes(ku, &kr, 16, d, kst);
                kr = rows16_at(kst, (size_t)d);
            }
#endif
            if (q2) tile_scores(8, NH, 1, 0, &f, &kr, NULL, d, KG, nfs, sc, j, mxv);
            else if (KVQ_VBMI && knf && KB == 8 && k->bits <= 3) tile_scores(8, NH, 0, 2, &f, &kr, knfu, d, KG, nfs, sc, j, mxv);
            else if (knf) tile_scores(KB, NH, 0, 1, &f, &kr, knfu, d, KG, nfs, sc, j, mxv);
            else tile_scores(KB, NH, 0, 0, &f, &kr, NULL, d, KG, nfs, sc, j, mxv);
            if (vnf) { /* one group, bias + mid * scale = 0 */
                const __m512 sv = tile_nf_scales(&vr, 0, p12);
                _mm512_store_ps(vsb + j, sv);
                _mm512_store_ps(vsb + FB + j, _mm512_setzero_ps());
                smax[0] = _mm512_max_ps(smax[0], sv);
#if !KVQ_VBMI
                const struct rows16 vrows = rows16_at(run->v + (size_t)(j0 + j) * vs, vs);
                nf_tile_bytes(vu, &vrows, nj - j < 16 ? nj - j : 16, d, vst + (size_t)j * d);
#endif
                continue;
            }
            __m512i sbc[8];
            for (int g = 0; g < vng; g++) {
                const __m512i sb = tile_group_sb(&vr, 0, vng, g, sbc);
                const __m512 sv = sb_scale(sb);
                _mm512_store_ps(vsb + 2 * g * FB + j, sv);
                _mm512_store_ps(vsb + (2 * g + 1) * FB + j, _mm512_fmadd_ps(sv, _mm512_set1_ps(mid), sb_bias(sb)));
                smax[g] = _mm512_max_ps(smax[g], sv);
            }
        }
        /* The online-softmax step (kern_softmax_step_avx512) of the NH heads side by side:
         * their maxima, rescale factors and sums in vectors, one exp for e^(m - m') (lanes
         * 0-7; 0 where m was -inf) and each block's largest weight e^(max - m') (8-15). */
        const __m512 mx = fold8(mxv, 0), mn = _mm512_max_ps(mrun, mx);
        const __m512 e = exp512(_mm512_shuffle_f32x4(_mm512_sub_ps(mrun, mn), _mm512_sub_ps(mx, mn), 0x44));
        const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mrun, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
        const __mmask16 grow = _mm512_mask_cmp_ps_mask(hm, mx, mrun, _CMP_GT_OQ);
        float pmax[FMAXH], pinv[FMAXH];
        __m512 psum[8];
        UNROLL
        for (int h = 0; h < 8; h++) {
            psum[h] = _mm512_setzero_ps();
            if (h >= NH) continue;
            float *a = accp + (size_t)h * da, *p = sc + h * FB;
            if (grow >> h & 1) {
                const __m512 va = _mm512_permutexvar_ps(_mm512_set1_epi32(h), alpha);
                for (int i = 0; i < da; i += 16) _mm512_store_ps(a + i, _mm512_mul_ps(_mm512_load_ps(a + i), va));
            }
            const __m512 mh = _mm512_permutexvar_ps(_mm512_set1_epi32(h), mn);
            for (int j = 0; j < nj; j += 16) { /* past the block's end the weights are 0 */
                const __m512 x = _mm512_maskz_mov_ps(kern_softmax_mask16(nj - j),
                                                     kern_softmax_w512(_mm512_sub_ps(_mm512_load_ps(p + j), mh)));
                _mm512_store_ps(p + j, x);
                psum[h] = _mm512_add_ps(psum[h], x);
            }
            const float pm = _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(8 + h), e));
            pmax[h] = pm > FLT_MIN ? pm : FLT_MIN;
            pinv[h] = 1.0f / pmax[h];
        }
        lrun = _mm512_fmadd_ps(lrun, alpha, fold8(psum, 1));
        mrun = mn;
        /* int16 weights per head and V group; bias sums */
        for (int g = 0; g < vng; g++) {
            float sm = _mm512_reduce_max_ps(smax[g]);
            sm = sm > FLT_MIN ? sm : FLT_MIN;
            const __m512 kg = _mm512_set1_ps(WMAX / sm);
            __m512 bs[FMAXH];
            __m512i wsum[FMAXH];
            UNROLL
            for (int h = 0; h < NH; h++) {
                step[h][g] = pmax[h] * sm / WMAX;
                bs[h] = _mm512_load_ps(accp + (size_t)h * da + d + 16 * g);
                wsum[h] = _mm512_setzero_si512();
            }
            for (int j = 0; j < nj; j += 16) {
                const __m512 sv = _mm512_mul_ps(_mm512_load_ps(vsb + 2 * g * FB + j), kg);
                const __m512 bv = _mm512_load_ps(vsb + (2 * g + 1) * FB + j);
                UNROLL
                for (int h = 0; h < NH; h++) {
                    const __m512 p = _mm512_load_ps(sc + h * FB + j);
                    const __m512i w = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(p, _mm512_set1_ps(pinv[h])), sv));
                    _mm256_store_si256((__m256i *)(wq + (g * NH + h) * (FB / 2) + j / 2),
                                       _mm512_cvtsepi32_epi16(_mm512_sub_epi32(w, _mm512_set1_epi32(32768))));
                    wsum[h] = _mm512_add_epi32(wsum[h], w);
                    bs[h] = _mm512_fmadd_ps(p, bv, bs[h]);
                }
            }
            /* the mean part of the rounding: mid * (sum w - step * sum W) */
            UNROLL
            for (int h = 0; h < NH; h++)
                _mm512_store_ps(accp + (size_t)h * da + d + 16 * g,
                                _mm512_fnmadd_ps(_mm512_cvtepi32_ps(wsum[h]), _mm512_set1_ps(mid * step[h][g]), bs[h]));
        }
        const uint8_t *v0 = run->v + (size_t)j0 * vs;
#if KVQ_VBMI
        if (vnf) v_block(8, NH, 0, vu, v0, vs, nj, d, VG, wq, step, accp, da);
#else
        if (vnf) v_block(8, NH, 0, NULL, vst, (size_t)d, nj, d, VG, wq, step, accp, da);
#endif
        else if (VB == 8) v_block(8, NH, 0, NULL, v0, vs, nj, d, VG, wq, step, accp, da);
        else if (VG % 64 && NH <= 4) v_block(4, NH, 1, NULL, v0, vs, nj, d, VG, wq, step, accp, da);
        else v_block(4, NH, 0, NULL, v0, vs, nj, d, VG, wq, step, accp, da);
    }
    }
    _mm512_mask_storeu_ps(s->m + h0, hm, mrun);
    _mm512_mask_storeu_ps(s->l + h0, hm, lrun);
    UNROLL
    for (int h = 0; h < NH; h++) {
        const float *a = accp + (size_t)h * da;
        float *ah = s->acc + (size_t)(h0 + h) * d;
        for (int i = 0; i < d; i++) ah[v_value(VB, NH > 4 ? 2 : 4, i)] = a[i];
        for (int g = 0; g < vng; g++) {
            const __m512 b = _mm512_set1_ps(_mm512_reduce_add_ps(_mm512_load_ps(a + d + 16 * g)));
            for (int i = g * VG; i < (g + 1) * VG; i += 16)
                _mm512_storeu_ps(ah + i, _mm512_add_ps(_mm512_loadu_ps(ah + i), b));
        }
    }
}

#define FAST_NH(KB)                                                                                                    \
    KERN_UNCHECKED static void fast_##KB(int nh, struct kern_attn_state *s, int h0, const float *q,                    \
                                         const struct kern_kv_rows *k, const struct kern_kv_rows *v,                   \
                                         const struct kern_kv_run *runs, int n_runs) {                                 \
        switch (nh) {                                                                                                  \
        case 8: fast_attn(KB, 8, s, h0, q, k, v, runs, n_runs); break;                                                 \
        case 7: fast_attn(KB, 7, s, h0, q, k, v, runs, n_runs); break;                                                 \
        case 6: fast_attn(KB, 6, s, h0, q, k, v, runs, n_runs); break;                                                 \
        case 5: fast_attn(KB, 5, s, h0, q, k, v, runs, n_runs); break;                                                 \
        case 4: fast_attn(KB, 4, s, h0, q, k, v, runs, n_runs); break;                                                 \
        case 3: fast_attn(KB, 3, s, h0, q, k, v, runs, n_runs); break;                                                 \
        case 2: fast_attn(KB, 2, s, h0, q, k, v, runs, n_runs); break;                                                 \
        default: fast_attn(KB, 1, s, h0, q, k, v, runs, n_runs); break;                                                \
        }                                                                                                              \
    }
FAST_NH(4)
FAST_NH(8)

/* Up to FMAXH heads per pass: each pass reads the rows once. */
KERN_UNCHECKED static void fast_heads(struct kern_attn_state *s, int h0, int nh, const float *q,
                                      const struct kern_kv_rows *k, const struct kern_kv_rows *v,
                                      const struct kern_kv_run *runs, int n_runs) {
    while (nh > 0) {
        const int c = nh > FMAXH ? FMAXH : nh;
        if (k->bits == 4) fast_4(c, s, h0, q, k, v, runs, n_runs);
        else fast_8(c, s, h0, q, k, v, runs, n_runs);
        h0 += c;
        nh -= c;
    }
}

#if KVQ_VBMI
KERN_UNCHECKED void kern_kvq_attn_avx512vbmi_runs(struct kern_attn_state *s, int h0, int nh, const float *q,
                                   const struct kern_kv_rows *k, const struct kern_kv_rows *v,
                                   const struct kern_kv_run *runs, int n_runs) {
    fast_heads(s, h0, nh, q, k, v, runs, n_runs);
}
#else
KERN_UNCHECKED bool kern_kvq_attn_avx512_runs(struct kern_attn_state *s, int h0, int nh, const float *q,
                                              const struct kern_kv_rows *k, const struct kern_kv_rows *v,
                                              const struct kern_kv_run *runs, int n_runs) {
    if (!fast_wanted || !kvq_fast_formats(s->d, k, v)) return false;
    if ((k->group == KERN_KVQ_NF || v->group == KERN_KVQ_NF) && vbmi_wanted && kvq_cpu_avx512_vbmi())
        kern_kvq_attn_avx512vbmi_runs(s, h0, nh, q, k, v, runs, n_runs);
    else
        fast_heads(s, h0, nh, q, k, v, runs, n_runs);
    return true;
}

void kern_kvq_attn_avx512(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                          const struct kern_kv_rows *v, int n) {
    const struct kern_kv_run run = {k->data, v->data, n};
    if (!kern_kvq_attn_avx512_runs(s, h0, nh, q, k, v, &run, 1)) kern_kvq_attn_avx512g(s, h0, nh, q, k, v, n);
}
#endif
