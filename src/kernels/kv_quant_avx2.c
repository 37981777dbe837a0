/* AVX2 attention over packed KV rows and fast code unpacking. */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>

#include "kernels/kv_quant_impl.h"
#include "kernels/asan.h"
#include "kernels/online_softmax.h"
#include "kernels/simd_avx2.h"

/* The constants of the unpacker of one code width (2 to 5 bits, 32 codes at a time) and
 * of the map of its codes to normal-float level bytes. */
struct unpack256 {
    int bits;
    __m256i lo, hi, mul, tl, th; /* 3/5 bits: see unpack32; the level bytes of codes 0-15, 16-31 */
};
static inline void unpack256_init(struct unpack256 *u, int bits) {
    struct kvq_unpack_lut t;
    kvq_unpack_lut(bits, &t);
    uint8_t lo[32], hi[32], lv[32] = {0};
    int16_t mul[16];
    for (int k = 0; k < 16; k++) {
        lo[k] = t.lo[k], lo[16 + k] = (uint8_t)(t.lo[k] + 2 * bits - 4);
        hi[k] = t.hi[k], hi[16 + k] = (uint8_t)(t.hi[k] + 2 * bits - 4);
        mul[k] = (int16_t)(1 << (8 - t.sh[k % 8]));
    }
    if (kern_kvq_nf_bits(bits)) memcpy(lv, kern_kvq_nf_levels(bits), (size_t)1 << bits);
    u->bits = bits;
    u->lo = _mm256_loadu_si256((const __m256i *)lo);
    u->hi = _mm256_loadu_si256((const __m256i *)hi);
    u->mul = _mm256_loadu_si256((const __m256i *)mul);
    u->tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lv));
    u->th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(lv + 16)));
}

/* The unpackers of 2 to 5 bits, set up once. */
static struct unpack256 unpackers[6];
static pthread_once_t unpackers_once = PTHREAD_ONCE_INIT;
static void unpackers_init(void) {
    for (int b = 2; b <= 5; b++) unpack256_init(&unpackers[b], b);
}
static const struct unpack256 *unpacker(int bits) {
    pthread_once(&unpackers_once, unpackers_init);
    return bits >= 2 && bits <= 5 ? &unpackers[bits] : NULL;
}

/* 32 4-bit codes at p (16 bytes) as bytes. */
INLINE __m256i unpack32_4(const uint8_t *p) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_or_si256(x, _mm256_slli_epi16(x, 4)), _mm256_set1_epi16(0x0f0f));
}

/* 32 codes at p (4 * bits bytes) as bytes. */
INLINE __m256i unpack32(const struct unpack256 *u, const uint8_t *p) {
    const int bits = u->bits;
    if (bits == 4) return unpack32_4(p);
    if (bits == 2) {
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        const __m256i y = _mm256_or_si256(_mm256_or_si256(x, _mm256_slli_epi32(x, 6)),
                                          _mm256_or_si256(_mm256_slli_epi32(x, 12), _mm256_slli_epi32(x, 18)));
        return _mm256_and_si256(y, _mm256_set1_epi32(0x03030303));
    }
    /* 3 or 5 bits: 16 codes (2 * bits bytes) a 128-bit lane, as the AVX-512 unpacker; the
     * second lane loads from byte 4 (no read past the 4 * bits bytes), and the shift
     * right is a multiply (no vpsrlvw): code << (8 - offset), then >> 8 */
    const __m256i x = bits == 3 ? _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)p)),
                                                          _mm_loadl_epi64((const __m128i *)(p + 4)), 1)
                                : _mm256_loadu2_m128i((const __m128i *)(p + 4), (const __m128i *)p);
    const __m256i mask = _mm256_set1_epi16((short)((1 << bits) - 1));
    const __m256i a = _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(x, u->lo), u->mul), 8), mask);
    const __m256i b = _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(x, u->hi), u->mul), 8), mask);
    return _mm256_packus_epi16(a, b);
}

/* 32 codes to their level bytes: a 16-entry byte shuffle (two and a select for 5 bits). */
INLINE __m256i nf_map32(const struct unpack256 *u, __m256i x) {
    const __m256i y = _mm256_shuffle_epi8(u->tl, x); /* codes < 16: bit 7 clear, the low nibble indexes */
    if (u->bits < 5) return y;
    const __m256i big = _mm256_cmpgt_epi8(x, _mm256_set1_epi8(15));
    return _mm256_blendv_epi8(y, _mm256_shuffle_epi8(u->th, _mm256_and_si256(x, _mm256_set1_epi8(15))), big);
}

/* A row's d codes (d % 32 == 0) as bytes, normal-float ones (nf) as their level bytes. */
INLINE void row_bytes(const struct unpack256 *u, const int nf, const uint8_t *src, int d, uint8_t *out) {
    for (int i = 0; i < d; i += 32) {
        const __m256i x = unpack32(u, src + (size_t)i * u->bits / 8);
        _mm256_storeu_si256((__m256i *)(out + i), nf ? nf_map32(u, x) : x);
    }
}

void kern_kvq_unpack_avx2(const uint8_t *src, int n, int bits, uint8_t *out) {
    int i = 0;
    if (bits == 8) {
        memcpy(out, src, (size_t)n);
        return;
    }
    const struct unpack256 *u = unpacker(bits);
    if (u)
        for (; i + 32 <= n; i += 32) _mm256_storeu_si256((__m256i *)(out + i), unpack32(u, src + (size_t)i * bits / 8));
    if (i < n) kern_kvq_unpack_scalar(src + (size_t)i * bits / 8, n - i, bits, out + i);
}

void kern_kvq_nf_map_avx2(uint8_t *c, int n, int bits) {
    const uint8_t *lv = kern_kvq_nf_levels(bits);
    const struct unpack256 *u = unpacker(bits);
    int i = 0;
    for (; i + 32 <= n; i += 32)
        _mm256_storeu_si256((__m256i *)(c + i), nf_map32(u, _mm256_loadu_si256((const __m256i *)(c + i))));
    for (; i < n; i++) c[i] = lv[c[i]];
}

/* t[idx] of a table of n floats (4 to 32) in registers of 8, idx 0 .. n - 1. */
INLINE __m256 lut32_ps(const __m256 t[4], __m256i idx, int n) {
    __m256 r = _mm256_permutevar8x32_ps(t[0], idx); /* the low 3 bits index */
    if (n <= 8) return r;
    const __m256 past7 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
    r = _mm256_blendv_ps(r, _mm256_permutevar8x32_ps(t[1], idx), past7);
    if (n <= 16) return r;
    const __m256 past15 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(15)));
    const __m256 past23 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(23)));
    const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[2], idx), _mm256_permutevar8x32_ps(t[3], idx), past23);
    return _mm256_blendv_ps(r, hi, past15);
}

float kern_kvq_nf_fit_avx2(const float *x, int n, const float *lv, int nl, float s, uint8_t *c) {
    /* the code: how many of the ascending midpoints thr lie below x, by binary search
     * (the scalar encoder's count: x > thr, false for a NaN) */
    float thr[32];
    kvq_nf_midpoints(lv, nl, s, thr);
    __m256 tt[4], tl[4];
    for (int r = 0; r < 4; r++) tt[r] = _mm256_loadu_ps(thr + 8 * r), tl[r] = _mm256_loadu_ps(lv + 8 * r);
    const __m256 vs = _mm256_set1_ps(s);
    __m256 e = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        __m256i k = _mm256_setzero_si256();
        for (int step = nl / 2; step > 0; step /= 2) {
            const __m256i p = _mm256_add_epi32(k, _mm256_set1_epi32(step));
            const __m256 t = lut32_ps(tt, _mm256_sub_epi32(p, _mm256_set1_epi32(1)), nl);
            k = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(k), _mm256_castsi256_ps(p), _mm256_cmp_ps(xv, t, _CMP_GT_OQ)));
        }
        const __m256 d = _mm256_sub_ps(xv, _mm256_mul_ps(vs, lut32_ps(tl, k, nl)));
        e = _mm256_fmadd_ps(d, d, e);
        if (c) {
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
            _mm_storel_epi64((__m128i *)(c + i), _mm_packus_epi16(w, w));
        }
    }
    return hsum256(e);
}

void kern_kvq_to_f16_avx2(const float *x, int d, uint8_t *dst) {
    int i = 0;
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++) {
        const uint16_t h = kvq_f32_to_f16(x[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}

void kern_kvq_from_f16_avx2(const uint8_t *src, int d, float *x) {
    int i = 0;
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    for (; i < d; i++) x[i] = kvq_load_f16(src + 2 * i);
}

/* The butterflies of stages 1, 2, 4 inside a vector: lane i meets lane i ^ m; the lower
 * of the two takes a + c, the upper a - c (a the lower's value, c the upper's). */
static inline __m256 fwht8(__m256 v) {
    __m256 p = _mm256_permute_ps(v, 0xB1); /* i ^ 1 */
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
    p = _mm256_permute_ps(v, 0x4E); /* i ^ 2 */
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
    p = _mm256_permute2f128_ps(v, v, 1); /* i ^ 4 */
    return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
}

void kern_kvq_hadamard_avx2(float *x, int d, int b, const float *signs, float norm, bool inverse) {
    const __m256 vn = _mm256_set1_ps(norm);
    for (int o = 0; o < d; o += b) {
        float *xb = x + o;
        for (int i = 0; i < b; i += 8) {
            const __m256 y = _mm256_loadu_ps(xb + i);
            _mm256_storeu_ps(xb + i, fwht8(inverse ? y : _mm256_mul_ps(y, _mm256_loadu_ps(signs + o + i))));
        }
        for (int len = 8; len < b; len <<= 1)
            for (int i = 0; i < b; i += 2 * len)
                for (int j = i; j < i + len; j += 8) {
                    const __m256 a = _mm256_loadu_ps(xb + j), c = _mm256_loadu_ps(xb + j + len);
                    _mm256_storeu_ps(xb + j, _mm256_add_ps(a, c));
                    _mm256_storeu_ps(xb + j + len, _mm256_sub_ps(a, c));
                }
        for (int i = 0; i < b; i += 8) {
            const __m256 f = inverse ? _mm256_mul_ps(vn, _mm256_loadu_ps(signs + o + i)) : vn;
            _mm256_storeu_ps(xb + i, _mm256_mul_ps(_mm256_loadu_ps(xb + i), f));
        }
    }
}

/* floor((x - bias) * inv + 0.5) clamped to [0, top] for 8 values, as the scalar encoder */
static __m256i codes8(const float *x, __m256 bias, __m256 inv, __m256 top) {
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), bias), inv), _mm256_set1_ps(0.5f));
    return _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_floor_ps(t), _mm256_setzero_ps()), top));
}

/* 16 codes of x (scalar encoder's rounding) stored at out: bytes, or 4-bit pairs */
static void codes16_avx2(const float *x, __m256 bias, __m256 inv, __m256 top, int bits, uint8_t *out) {
    /* 32-bit to 16-bit (lanes interleave the halves; the permute puts them back), then
     * to 8-bit */
    const __m256i w =
        _mm256_permute4x64_epi64(_mm256_packus_epi32(codes8(x, bias, inv, top), codes8(x + 8, bias, inv, top)), 0xD8);
    const __m256i b = _mm256_packus_epi16(w, w);
    const __m128i c = _mm_unpacklo_epi64(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (bits == 8)
        _mm_storeu_si128((__m128i *)out, c);
    else /* code 2k low nibble, 2k + 1 high: c_2k + 16 c_2k+1 */
        _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(_mm_maddubs_epi16(c, _mm_set1_epi16(0x1001)), _mm_setzero_si128()));
}

#define VL 8
#define VF __m256
#define VZERO _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VADD _mm256_add_ps
#define VFMA _mm256_fmadd_ps
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VU8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VSUM(x) hsum256(x)
#define VMIN _mm256_min_ps
#define VMAX _mm256_max_ps
#define VHMIN(x) hmin256(x)
#define VHMAX(x) hmax256(x)
#define CODES16 codes16_avx2
#define SOFTMAX_STEP kern_softmax_step_avx2
#define FN(x) x##_avx2g /* generic body; the fast path below dispatches to it */
#define UNPACK kern_kvq_unpack_avx2
#define NFMAP kern_kvq_nf_map_avx2
#include "kernels/kv_quant_simd.inc"

void kern_kvq_attn_avx2g(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                         const struct kern_kv_rows *v, int n);

/* ---- Fast path: K and V 4- or 8-bit in groups of a multiple of 32, or normal-float
 * rows, d % 64 == 0 ----
 * Scores in integers, one row at a time: 4-bit keys against q rounded to int8 with one
 * scale per head (sq = max|q| / 127, as the AVX-512 path), vpmaddubsw of the low nibbles
 * against q's even values plus the high nibbles against the odd ones (|sum| <= 4 * 15 *
 * 127: no saturation), vpmaddwd to int32; 8-bit keys by vpmaddwd of the zero-extended
 * codes (vpmaddubsw would saturate: codes reach 255) against q as int16 words 128 q8 + r:
 * the int8 digit, and with 8-bit values the AVX-512 path's second digit r (|128 q8 + r|
 * <= 16320), so that both levels compute the same rounded query. A chunk's int32 lanes
 * are multiplied by their groups' scales (a permute of the row's [scale, bias] pairs,
 * converted once per row), and the bias terms sum_g bias_g * sum_g(q) are one FMA per row
 * and head against [0, sum_g(q) / sq] pairs.
 * Values: per block of rows, the weight p_j * scale_jg of every row, head and group;
 * each code is widened to float once and multiplied into every head; sum_j p_j * bias_jg
 * is added once per block, head and group.
 * Normal-float rows are unpacked to their level bytes a row at a time and take the
 * 8-bit paths (4-bit keys too: level bytes against int8 q would saturate vpmaddubsw),
 * as one group of scale s and bias -127.5 s. */

#define FX_B 64 /* rows per online-softmax block */
#define FX_MAXG (KERN_KVQ_MAX_DIM / 32)
#define FX_PF_ROWS 16

static int fast_wanted = 1;
void kern_kvq_use_fast_avx2(int on) { fast_wanted = on; }

static inline int32_t rd32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The query of NH heads for KB-bit keys, once per call. */
struct fx_q {
    /* head h at h * d: 4-bit keys, q's even values then its odd ones; 8-bit, q in order */
    union __attribute__((aligned(32))) {
        int8_t q8[KVQ_ATTN_MAXH * KERN_KVQ_MAX_DIM];
        int16_t q16[KVQ_ATTN_MAXH * KERN_KVQ_MAX_DIM];
    };
    float sq[KVQ_ATTN_MAXH];
    /* per head, [0, sum_g(q) / sq] for each group g, zero-padded to a multiple of 4 groups */
    float qb[KVQ_ATTN_MAXH][2 * FX_MAXG] __attribute__((aligned(32)));
    /* per chunk of the row's codes (64 values of 4-bit keys, 32 of 8-bit): which 4 groups'
     * pairs its scales come from, the lanes' scale positions among them, and (8-bit)
     * whether it ends its group */
    int ck[FX_MAXG];
    bool gend[FX_MAXG];
    __m256i cidx[FX_MAXG];
    const float *nfs; /* kern_kvq_nf_scales */
    struct unpack256 ku, vu;
    __m256i nfh, nfl; /* 4-bit normal-float keys: the level bytes' high and low nibbles */
};

KERN_UNCHECKED static void fx_prepare(struct fx_q *f, const int KB, const int NH, const float *q, int d, int G,
                                      int two, int kbits, int vbits) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const int ng = d / G, cv = KB == 4 ? 64 : 32; /* values per chunk */
    for (int h = 0; h < NH; h++) {
        const float *qh = q + (size_t)h * d;
        __m256 mx = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(qh + i), absm));
        const float amax = hmax256(mx), sq = amax > 0 ? amax / 127.0f : 1.0f;
        const __m256 vsq = _mm256_set1_ps(sq), r128 = _mm256_set1_ps(two ? 128.0f : 0.0f);
        /* q / sq rounded to nearest even, like lrintf in the tests' reference */
        for (int i = 0; i < d; i += 16) {
            const __m256 y0 = _mm256_div_ps(_mm256_loadu_ps(qh + i), vsq);
            const __m256 y1 = _mm256_div_ps(_mm256_loadu_ps(qh + i + 8), vsq);
            __m256i x0 = _mm256_cvtps_epi32(y0), x1 = _mm256_cvtps_epi32(y1);
            if (KB == 8) { /* 128 q8 + r, r = (q / sq - q8) * 128 rounded (0 with one digit) */
                const __m256i r0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(y0, _mm256_cvtepi32_ps(x0)), r128));
                const __m256i r1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(y1, _mm256_cvtepi32_ps(x1)), r128));
                x0 = _mm256_add_epi32(_mm256_slli_epi32(x0, 7), r0);
                x1 = _mm256_add_epi32(_mm256_slli_epi32(x1, 7), r1);
            }
            const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(x0, x1), 0xD8); /* 16 int16 in order */
            if (KB == 8) {
                _mm256_store_si256((__m256i *)(f->q16 + (size_t)h * d + i), w);
            } else { /* even values to bytes [0, 8), odd to [8, 16) of each 128-bit lane */
                const __m256i b = _mm256_shuffle_epi8(
                    _mm256_packs_epi16(w, w), _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2,
                                                               4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
                /* lane 0: values 0-7 of w (evens 0-3, odds 4-7, then values 0-7 again as
                 * packs repeats); lane 1: values 8-15 likewise */
                int8_t t[32];
                _mm256_storeu_si256((__m256i *)t, b);
                int8_t *e = f->q8 + (size_t)h * d + i / 2, *o = e + d / 2;
                memcpy(e, t, 4);
                memcpy(e + 4, t + 16, 4);
                memcpy(o, t + 4, 4);
                memcpy(o + 4, t + 20, 4);
            }
        }
        f->sq[h] = KB == 8 ? sq / 128 : sq;
        memset(f->qb[h], 0, sizeof f->qb[h]);
        for (int g = 0; g < ng; g++) {
            __m256 t = _mm256_setzero_ps();
            for (int i = g * G; i < (g + 1) * G; i += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(qh + i));
            f->qb[h][2 * g + 1] = hsum256(t) / f->sq[h];
        }
    }
    f->nfs = kern_kvq_nf_scales();
    const struct unpack256 *ku = unpacker(kbits), *vu = unpacker(vbits);
    if (ku) {
        f->ku = *ku;
        f->nfh = _mm256_and_si256(_mm256_srli_epi16(ku->tl, 4), _mm256_set1_epi8(0x0F));
        f->nfl = _mm256_and_si256(ku->tl, _mm256_set1_epi8(0x0F));
    }
    if (vu) f->vu = *vu;
    for (int c = 0; c < d / cv; c++) {
        /* lane m of 4-bit chunk c sums values 64c + 8m .. + 7; of 8-bit chunk c, four of
         * the values 32c .. 32c + 31 (one group) */
        int idx[8];
        const int g0 = c * cv / G;
        f->ck[c] = g0 / 4;
        for (int m = 0; m < 8; m++) idx[m] = 2 * ((KB == 4 ? (c * cv + 8 * m) / G : g0) - 4 * (g0 / 4));
        f->cidx[c] = _mm256_loadu_si256((const __m256i *)idx);
        f->gend[c] = (c + 1) * cv % G == 0;
    }
}

/* The [scale, bias] pairs of 4 groups (k-th four of ng) as 8 floats; zeros past ng. */
INLINE __m256 fx_sb4(const uint8_t *sb, int ng, int k) {
    const uint8_t *p = sb + 16 * (size_t)k;
    const int left = ng - 4 * k;
    __m128i x;
    if (left >= 4) x = _mm_loadu_si128((const __m128i *)p);
    else if (left == 1) x = _mm_cvtsi32_si128(rd32(p));
    else {
        x = _mm_loadl_epi64((const __m128i *)p);
        if (left == 3) x = _mm_insert_epi32(x, rd32(p + 8), 2);
    }
    return _mm256_cvtph_ps(x);
}

/* A normal-float row's one group as fx_sb4's pairs: [scale, bias] of its byte e. */
INLINE __m256 fx_nf_sb(const struct fx_q *f, uint8_t e) {
    const float s = f->nfs[e];
    return _mm256_setr_ps(s, -127.5f * s, 0, 0, 0, 0, 0, 0);
}

/* Scores of NH heads for rows [j0, j0 + nj) into sc[h][j] (unscaled by the softmax: q
 * already is). NF: normal-float keys, scored as their level bytes u: 4-bit ones as 16 *
 * (u >> 4) + (u & 15), the nibbles looked up from the codes' (u against int8 q would
 * saturate vpmaddubsw), other widths (KB 8) unpacked and widened in registers. */
INLINE void fx_scores(const int KB, const int NF, const int NH, const struct fx_q *f, const struct kern_kv_rows *k,
                      const struct kern_kv_rows *v, int d, int ng, int j0, int nj, float sc[][FX_B]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
    const int nk = (ng + 3) / 4, cv = KB == 4 ? 64 : 32;
    __m256 tv[KVQ_ATTN_MAXH][FX_B]; /* the rows' lanes, summed 4 at a time */
    for (int j = 0; j < nj; j++) {
        const uint8_t *r = k->data + (size_t)(j0 + j) * k->stride, *sb = r + (size_t)d * k->bits / 8;
        FN(prefetch_rows)(r + FX_PF_ROWS * k->stride, k->stride);
        FN(prefetch_rows)(v->data + (size_t)(j0 + j) * v->stride, v->stride);
        __m256 acc[KVQ_ATTN_MAXH], sbv[FX_MAXG / 4];
        __m256i gs[KVQ_ATTN_MAXH];
        UNROLL
        for (int h = 0; h < NH; h++) acc[h] = _mm256_setzero_ps(), gs[h] = _mm256_setzero_si256();
        if (NF) sbv[0] = fx_nf_sb(f, *sb);
        else
            for (int i = 0; i < nk; i++) sbv[i] = fx_sb4(sb, ng, i);
        for (int c = 0; c < d / cv; c++) {
            const __m256 sv = _mm256_permutevar8x32_ps(sbv[f->ck[c]], f->cidx[c]);
            if (KB == 4) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(r + 32 * (size_t)c));
                const __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
                __m256i lh = lo, ll = lo, hh = hi, hl = hi;
                if (NF) {
                    lh = _mm256_shuffle_epi8(f->nfh, lo), ll = _mm256_shuffle_epi8(f->nfl, lo);
                    hh = _mm256_shuffle_epi8(f->nfh, hi), hl = _mm256_shuffle_epi8(f->nfl, hi);
                }
                UNROLL
                for (int h = 0; h < NH; h++) {
                    const int8_t *qe = f->q8 + (size_t)h * d + 32 * (size_t)c, *qo = qe + d / 2;
                    const __m256i e = _mm256_load_si256((const __m256i *)qe), o = _mm256_load_si256((const __m256i *)qo);
                    __m256i s32 = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(ll, e), _mm256_maddubs_epi16(hl, o)), ones);
                    if (NF)
                        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lh, e),
                                                                                       _mm256_maddubs_epi16(hh, o)),
                                                                      sixteen));
                    acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), sv, acc[h]);
                }
            } else {
                __m256i a, b;
                if (NF) {
                    const __m256i x = nf_map32(&f->ku, unpack32(&f->ku, r + (size_t)c * 4 * k->bits));
                    a = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(x));
                    b = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(x, 1));
                } else {
                    a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r + 32 * (size_t)c)));
                    b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(r + 32 * (size_t)c + 16)));
                }
                /* a group's chunks (one scale: G / 32 of them) summed as integers, then
                 * scaled once (at most 8 x 8.4e6 a lane); past 4 heads the sums would not
                 * fit the registers */
                const bool last = NH > 4 || f->gend[c];
                UNROLL
                for (int h = 0; h < NH; h++) {
                    const int16_t *qh = f->q16 + (size_t)h * d + 32 * (size_t)c;
                    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_load_si256((const __m256i *)qh)),
                                                       _mm256_madd_epi16(b, _mm256_load_si256((const __m256i *)(qh + 16))));
                    gs[h] = _mm256_add_epi32(gs[h], s);
                    if (last) {
                        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gs[h]), sv, acc[h]);
                        gs[h] = _mm256_setzero_si256();
                    }
                }
            }
        }
        UNROLL
        for (int h = 0; h < NH; h++) {
            for (int i = 0; i < nk; i++) acc[h] = _mm256_fmadd_ps(sbv[i], _mm256_load_ps(f->qb[h] + 8 * i), acc[h]);
            tv[h][j] = acc[h];
        }
    }
    UNROLL
    for (int h = 0; h < NH; h++) {
        const __m128 s = _mm_set1_ps(f->sq[h]);
        int j = 0;
        for (; j + 4 <= nj; j += 4)
            _mm_storeu_ps(sc[h] + j, _mm_mul_ps(s, reduce4_256(tv[h][j], tv[h][j + 1], tv[h][j + 2], tv[h][j + 3])));
        for (; j < nj; j++) sc[h][j] = f->sq[h] * hsum256(tv[h][j]);
    }
}

/* acc[h][c0 .. c0 + 8 CG) += sum_j w_hj * codes_j for NH heads, then + bsum[h]; w_hj at
 * w[(h * FX_B + j) * 8]. */
INLINE void fx_vcols(const int NH, const int CG, float *acc, int d, int c0, const uint8_t *const *cd, int nj,
                     const float *w, const float *bsum) {
    __m256 a[KVQ_ATTN_MAXH][4];
    UNROLL
    for (int h = 0; h < NH; h++)
        UNROLL
        for (int cc = 0; cc < CG; cc++) a[h][cc] = _mm256_loadu_ps(acc + (size_t)h * d + c0 + 8 * cc);
    for (int j = 0; j < nj; j++) {
        __m256 x[4];
        UNROLL
        for (int cc = 0; cc < CG; cc++)
            x[cc] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(cd[j] + c0 + 8 * cc))));
        UNROLL
        for (int h = 0; h < NH; h++) {
            const __m256 wv = _mm256_broadcast_ss(w + ((size_t)h * FX_B + j) * 8);
            UNROLL
            for (int cc = 0; cc < CG; cc++) a[h][cc] = _mm256_fmadd_ps(x[cc], wv, a[h][cc]);
        }
    }
    UNROLL
    for (int h = 0; h < NH; h++) {
        const __m256 b = _mm256_broadcast_ss(bsum + 8 * h);
        UNROLL
        for (int cc = 0; cc < CG; cc++) _mm256_storeu_ps(acc + (size_t)h * d + c0 + 8 * cc, _mm256_add_ps(a[h][cc], b));
    }
}

/* The block's values: p[h][j] the softmax weights. */
INLINE void fx_values(const int NH, const struct fx_q *f, float *acc, int d, const struct kern_kv_rows *v, int j0,
                      int nj, float p[][FX_B], uint8_t *codes) {
    const int G = kvq_gsize(v->group, d), ng = d / G, nk = (ng + 3) / 4, VB = v->bits;
    const bool nf = v->group == KERN_KVQ_NF;
    const uint8_t *cd[FX_B];
    /* per 4 groups k, head h and row j at ((k * NH + h) * FX_B + j) * 8: p_hj times the
     * row's [scale, bias] pairs, the scales the rows' weights; bs: per head the bias
     * sums sum_j p_hj bias_jg (odd lanes) */
    float w[FX_MAXG / 4 * KVQ_ATTN_MAXH * FX_B * 8] __attribute__((aligned(32)));
    __m256 bs[FX_MAXG / 4][KVQ_ATTN_MAXH];
    for (int k = 0; k < nk; k++)
        UNROLL
        for (int h = 0; h < NH; h++) bs[k][h] = _mm256_setzero_ps();
    for (int j = 0; j < nj; j++) {
        const uint8_t *r = v->data + (size_t)(j0 + j) * v->stride, *sb = r + (size_t)d * VB / 8;
        if (VB == 8) {
            cd[j] = r;
        } else if (VB == 4 && !nf) { /* the common case, without unpack32's choice of width */
            cd[j] = codes + (size_t)j * d;
            for (int i = 0; i < d; i += 32)
                _mm256_storeu_si256((__m256i *)(codes + (size_t)j * d + i), unpack32_4(r + i / 2));
        } else { /* codes (or level bytes) to bytes, in value order */
            row_bytes(&f->vu, nf, r, d, codes + (size_t)j * d);
            cd[j] = codes + (size_t)j * d;
        }
        for (int k = 0; k < nk; k++) {
            const __m256 sv = nf ? fx_nf_sb(f, *sb) : fx_sb4(sb, ng, k);
            UNROLL
            for (int h = 0; h < NH; h++) {
                const __m256 ph = _mm256_broadcast_ss(&p[h][j]);
                _mm256_store_ps(w + (((size_t)k * NH + h) * FX_B + j) * 8, _mm256_mul_ps(ph, sv));
                bs[k][h] = _mm256_fmadd_ps(ph, sv, bs[k][h]);
            }
        }
    }
    float bsum[FX_MAXG / 4][KVQ_ATTN_MAXH * 8] __attribute__((aligned(32)));
    for (int k = 0; k < nk; k++)
        UNROLL
        for (int h = 0; h < NH; h++) _mm256_store_ps(bsum[k] + 8 * h, bs[k][h]);
    /* heads in passes of up to 4: NH x CG accumulators stay in registers, and each
     * weight broadcast serves CG vectors */
    UNROLL
    for (int hg = 0; hg < NH; hg += 4) {
        const int nh = NH - hg < 4 ? NH - hg : 4, CG = nh <= 2 ? 4 : 2;
        for (int c0 = 0; c0 < d; c0 += 8 * CG) {
            const int g = c0 / G, k = g / 4, o = 2 * (g % 4); /* g's scale at o, its bias at o + 1 */
            fx_vcols(nh, CG, acc + (size_t)hg * d, d, c0, cd, nj, w + ((size_t)k * NH + hg) * FX_B * 8 + o,
                     bsum[k] + 8 * hg + o + 1);
        }
    }
}

INLINE void fx_attn(const int KB, const int NH, struct kern_attn_state *s, int h0, const float *q,
                    const struct kern_kv_rows *kf, const struct kern_kv_rows *vf, const struct kern_kv_run *runs,
                    int n_runs) {
    const int d = s->d, G = kvq_gsize(kf->group, d), ng = d / G;
    /* on the stack (about 230 KB at the largest head size, in the pool's threads), not
     * thread-local: static TLS is carved out of every thread's stack, small ones too */
    uint8_t codes[FX_B * KERN_KVQ_MAX_DIM] __attribute__((aligned(32)));
    struct fx_q f;
    float sc[KVQ_ATTN_MAXH][FX_B] __attribute__((aligned(32)));
    float *acc = s->acc + (size_t)h0 * d;
    fx_prepare(&f, KB, NH, q + (size_t)h0 * d, d, G, kf->bits == 8 && vf->bits == 8, kf->bits, vf->bits);
    for (int ri = 0; ri < n_runs; ri++) {
        if (ri + 1 < n_runs) kvq_prefetch_run_l2(&runs[ri + 1], kf->stride, vf->stride);
        const struct kern_kv_rows k = {runs[ri].k, kf->stride, kf->bits, kf->group};
        const struct kern_kv_rows v = {runs[ri].v, vf->stride, vf->bits, vf->group};
        for (int j0 = 0; j0 < runs[ri].n; j0 += FX_B) {
            const int nj = runs[ri].n - j0 < FX_B ? runs[ri].n - j0 : FX_B;
            if (k.group == KERN_KVQ_NF) fx_scores(KB, 1, NH, &f, &k, &v, d, ng, j0, nj, sc);
            else fx_scores(KB, 0, NH, &f, &k, &v, d, ng, j0, nj, sc);
            UNROLL
            for (int h = 0; h < NH; h++)
                kern_softmax_step_avx2(sc[h], nj, &s->m[h0 + h], &s->l[h0 + h], acc + (size_t)h * d, d);
            fx_values(NH, &f, acc, d, &v, j0, nj, sc, codes);
        }
    }
}

#define FX_NH(KB)                                                                                                      \
    KERN_UNCHECKED static void fx_##KB(int nh, struct kern_attn_state *s, int h0, const float *q,                      \
                                       const struct kern_kv_rows *k, const struct kern_kv_rows *v,                     \
                                       const struct kern_kv_run *runs, int n_runs) {                                   \
        switch (nh) {                                                                                                  \
        case 1: fx_attn(KB, 1, s, h0, q, k, v, runs, n_runs); break;                                                   \
        case 2: fx_attn(KB, 2, s, h0, q, k, v, runs, n_runs); break;                                                   \
        case 3: fx_attn(KB, 3, s, h0, q, k, v, runs, n_runs); break;                                                   \
        case 4: fx_attn(KB, 4, s, h0, q, k, v, runs, n_runs); break;                                                   \
        case 5: fx_attn(KB, 5, s, h0, q, k, v, runs, n_runs); break;                                                   \
        case 6: fx_attn(KB, 6, s, h0, q, k, v, runs, n_runs); break;                                                   \
        case 7: fx_attn(KB, 7, s, h0, q, k, v, runs, n_runs); break;                                                   \
        default: fx_attn(KB, 8, s, h0, q, k, v, runs, n_runs); break;                                                  \
        }                                                                                                              \
    }
FX_NH(4)
FX_NH(8)

KERN_UNCHECKED bool kern_kvq_attn_avx2_runs(struct kern_attn_state *s, int h0, int nh, const float *q,
                                            const struct kern_kv_rows *k, const struct kern_kv_rows *v,
                                            const struct kern_kv_run *runs, int n_runs) {
    if (!fast_wanted || !kvq_fast_formats(s->d, k, v)) return false;
    if (k->bits == 4) fx_4(nh, s, h0, q, k, v, runs, n_runs);
    else fx_8(nh, s, h0, q, k, v, runs, n_runs);
    return true;
}

void kern_kvq_attn_avx2(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                        const struct kern_kv_rows *v, int n) {
    const struct kern_kv_run run = {k->data, v->data, n};
    if (!kern_kvq_attn_avx2_runs(s, h0, nh, q, k, v, &run, 1)) kern_kvq_attn_avx2g(s, h0, nh, q, k, v, n);
}
