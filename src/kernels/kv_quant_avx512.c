/* AVX-512 attention over packed KV rows and fast code unpacking. */
#include <immintrin.h>
#include <math.h>

#include "kernels/kv_quant_impl.h"
#include "kernels/online_softmax.h"

void kern_kvq_unpack_avx512(const uint8_t *src, int n, int bits, uint8_t *out) {
    int i = 0;
    if (bits == 8) {
        memcpy(out, src, (size_t)n);
        return;
    }
    if (bits == 4) {
        for (; i + 64 <= n; i += 64) {
            __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + i / 2)));
            x = _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi16(x, 4)), _mm512_set1_epi16(0x0f0f));
            _mm512_storeu_si512(out + i, x);
        }
    } else if (bits == 2) {
        for (; i + 64 <= n; i += 64) {
            __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i / 4)));
            x = _mm512_or_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 6)),
                                _mm512_or_si512(_mm512_slli_epi32(x, 12), _mm512_slli_epi32(x, 18)));
            _mm512_storeu_si512(out + i, _mm512_and_si512(x, _mm512_set1_epi32(0x03030303)));
        }
    }
    if (i < n) kern_kvq_unpack_scalar(src + (size_t)i * bits / 8, n - i, bits, out + i);
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

void kern_kvq_fwht_avx512(float *x, int n) {
    /* stages 1, 2, 4, 8 inside each vector: lane i meets lane i ^ m; the lower of the
     * two takes a + c, the upper a - c (a the lower's value, c the upper's) */
    static const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int o = 0; o < n; o += 16) {
        __m512 v = _mm512_loadu_ps(x + o);
        for (int s = 0; s < 4; s++) {
            const __m512 p = _mm512_permutexvar_ps(_mm512_xor_si512(iota, _mm512_set1_epi32(1 << s)), v);
            v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper[s], p, v);
        }
        _mm512_storeu_ps(x + o, v);
    }
    for (int len = 16; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j += 16) {
                const __m512 a = _mm512_loadu_ps(x + j), c = _mm512_loadu_ps(x + j + len);
                _mm512_storeu_ps(x + j, _mm512_add_ps(a, c));
                _mm512_storeu_ps(x + j + len, _mm512_sub_ps(a, c));
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
#define SOFTMAX_STEP kern_softmax_step_avx512
#define FN(x) x##_avx512g /* generic body; the fast path below dispatches to it */
#define UNPACK kern_kvq_unpack_avx512
#include "kernels/kv_quant_simd.inc"

void kern_kvq_attn_avx512g(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                           const struct kern_kv_rows *v, int n);

/* ---- Fast path: K 4- or 8-bit, V 4-bit, groups % 32 == 0, d % 64 == 0 ----
 * The generic body is compute-bound (one row at a time, scalar f16 scales, a horizontal
 * sum per row). Here 4 rows are scored at once with independent accumulators, scales
 * and biases are converted 8 groups per vcvtph2ps, the bias term rides in the same
 * accumulator (sbv * [0,qsum_g,...]) and 16 rows share one transposed reduction.
 *
 * 4-bit codes: a 16-byte load zero-extended to 16 dwords gives the even values (low
 * nibbles) and the odd values (high nibbles) of 32 consecutive values. Rather than
 * interleave per row, q and the V accumulator are kept in that "code order" per 32
 * values for the whole call (groups are multiples of 32, so a group stays a group). */

/* -O2 keeps the small fixed loops below rolled, which puts the accumulator arrays in
 * memory: unroll them explicitly. */
#define UNR _Pragma("GCC unroll 16")
#define FMAXH 8 /* heads per fast-path pass: a GQA group of up to 8 reads the rows once */
/* Rows scored together: 4, or 2 above 4 heads (the accumulators fit the registers). */
#define FQ_OF(NH) ((NH) > 4 ? 2 : 4)

static void to_code_order(const float *x, float *y, int d) {
    for (int c = 0; c < d; c += 32)
        for (int i = 0; i < 16; i++) {
            y[c + i] = x[c + 2 * i];
            y[c + 16 + i] = x[c + 2 * i + 1];
        }
}
static void from_code_order(const float *y, float *x, int d) {
    for (int c = 0; c < d; c += 32)
        for (int i = 0; i < 16; i++) {
            x[c + 2 * i] = y[c + i];
            x[c + 2 * i + 1] = y[c + 16 + i];
        }
}

/* 2 row accumulators -> every 128-bit lane holds [a,b,a,b] partials. */
static inline __m512 pair2(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
/* 2 pair2 results -> every 128-bit lane holds [a,b,c,d] partials. */
static inline __m512 join2(__m512 ab, __m512 cd) {
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}
/* 4 row accumulators -> one vector whose every 128-bit lane holds [a,b,c,d] partials. */
static inline __m512 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) { return join2(pair2(a, b), pair2(c, d)); }
/* FQ (2 or 4) row accumulators of a head -> pair2 / reduce4 form. */
#define REDUCE_FQ(FQ, acc, h)                                                                                          \
    ((FQ) == 4 ? reduce4(acc[0][h], acc[1][h], acc[2][h], acc[3][h]) : pair2(acc[0][h], acc[1][h]))
/* 4 reduce4 results (16 rows) -> the 16 row sums in order. */
static inline __m512 reduce16(__m512 x0, __m512 x1, __m512 x2, __m512 x3) {
    __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x44), _mm512_shuffle_f32x4(x0, x1, 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_f32x4(x2, x3, 0x44), _mm512_shuffle_f32x4(x2, x3, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y, z, 0x88), _mm512_shuffle_f32x4(y, z, 0xDD));
}

static inline __m512i zx16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512 lo4(__m512i z) { return _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(15))); }
static inline __m512 hi4(__m512i z) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4)); }
/* scales/biases of groups g0..g0+7 (fewer past the end): lanes [s0,b0,s1,b1,...] */
static inline __m512 sb8(const uint8_t *sb, int g0, int ng) {
    const int c = ng - g0 < 8 ? ng - g0 : 8;
    const uint8_t *p = sb + 4 * g0;
    /* exact-size loads: a masked load whose masked-off tail crosses a page is very slow */
    switch (c) {
    case 8: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case 4: return _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p)));
    case 2: return _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i *)p)));
    case 1: {
        int32_t t;
        memcpy(&t, p, 4);
        return _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_cvtsi32_si128(t)));
    }
    default: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << (2 * c)) - 1), p));
    }
}

/* The [s, b] f16 pairs of nr consecutive rows (wf = 2 or 4 halves each, 16 / wf rows
 * at most) side by side; zeros past them. From registers: small stores read back as
 * a vector stall store forwarding. */
static inline __m256i sb_rows(const uint8_t *p, size_t stride, int wf, int nr) {
    if (wf == 4) {
        long long x[4] = {0, 0, 0, 0};
        for (int r = 0; r < nr; r++) memcpy(&x[r], p + (size_t)r * stride, 8);
        return _mm256_set_epi64x(x[3], x[2], x[1], x[0]);
    }
    int y[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < nr; r++) memcpy(&y[r], p + (size_t)r * stride, 4);
    return _mm256_set_epi32(y[7], y[6], y[5], y[4], y[3], y[2], y[1], y[0]);
}

static inline void pf_row(const uint8_t *p, size_t bytes) {
    for (size_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
    _mm_prefetch((const char *)p + bytes - 1, _MM_HINT_T0);
}

/* Partial scores of FQ rows for NH heads: out[h] as REDUCE_FQ leaves them.
 * qp: [NH][d] q in the K code order; qb: [NH][ng8][16] = [0,qsum_g,...] per 8 groups. */
INLINE void fq_scores(const int KB, const int NH, const int FQ, const float *qp, const __m512 *qb, int d, int G,
                      const uint8_t *const *rows, __m512 *out) {
    const int ng = d / G, ng8 = (ng + 7) / 8;
    const size_t cbytes = (size_t)d * KB / 8;
    __m512 acc[4][FMAXH];
    UNR
    for (int r = 0; r < FQ; r++)
        UNR
        for (int h = 0; h < NH; h++) acc[r][h] = _mm512_setzero_ps();
    for (int gc = 0; gc < ng; gc += 8) {
        __m512 sbv[4];
        UNR
        for (int r = 0; r < FQ; r++) {
            sbv[r] = sb8(rows[r] + cbytes, gc, ng);
            UNR
            for (int h = 0; h < NH; h++) acc[r][h] = _mm512_fmadd_ps(sbv[r], qb[h * ng8 + gc / 8], acc[r][h]);
        }
        const int ge = gc + 8 < ng ? gc + 8 : ng;
        for (int g = gc; g < ge; g++) {
            const __m512i bi = _mm512_set1_epi32(2 * (g - gc));
            __m512 sc[4];
            UNR
            for (int r = 0; r < FQ; r++) sc[r] = _mm512_permutexvar_ps(bi, sbv[r]);
            for (int c = g * G; c < (g + 1) * G; c += 32) {
                __m512 q0[FMAXH], q1[FMAXH];
                UNR
                for (int h = 0; h < NH; h++) {
                    q0[h] = _mm512_loadu_ps(qp + (size_t)h * d + c);
                    q1[h] = _mm512_loadu_ps(qp + (size_t)h * d + c + 16);
                }
                UNR
                for (int r = 0; r < FQ; r++) {
                    __m512 x0, x1;
                    if (KB == 4) {
                        const __m512i z = zx16(rows[r] + c / 2);
                        x0 = _mm512_mul_ps(lo4(z), sc[r]);
                        x1 = _mm512_mul_ps(hi4(z), sc[r]);
                    } else {
                        x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(zx16(rows[r] + c)), sc[r]);
                        x1 = _mm512_mul_ps(_mm512_cvtepi32_ps(zx16(rows[r] + c + 16)), sc[r]);
                    }
                    UNR
                    for (int h = 0; h < NH; h++) {
                        acc[r][h] = _mm512_fmadd_ps(x0, q0[h], acc[r][h]);
                        acc[r][h] = _mm512_fmadd_ps(x1, q1[h], acc[r][h]);
                    }
                }
            }
        }
    }
    UNR
    for (int h = 0; h < NH; h++) out[h] = REDUCE_FQ(FQ, acc, h);
}

/* ---- VNNI scoring: the query as int8, the key codes as unsigned bytes ----
 * q is rounded once per call to int8 with one scale per head (sq = max|q| / 127), so
 * a score is sq * sum_g scale_g * (q8 . codes)_g + sum_g bias_g * qsum_g (the bias
 * term from the float q). vpdpbusd sums 4 byte products per int32 lane: a 64-byte
 * chunk of codes is 16 lanes of 4 (8-bit) or 8 (4-bit: low nibbles against the even
 * values of q, high nibbles against the odd ones) consecutive values. A lane never
 * straddles a group (groups are multiples of 32 values), so each lane takes its
 * group's scale, permuted out of the same 8-group [s, b] vector the bias term uses.
 * Error: each q value moves by at most sq/2 (tests/test_kv_quant.c checks against
 * attention with the rounded query). */
#define VNNI_MAX_CHUNKS (KERN_KVQ_MAX_DIM * 8 / 512)

/* The AVX-512 level includes VNNI (core/cpu.c checks it); tests may turn it off. */
static int vnni_wanted = 1;
void kern_kvq_use_vnni(int on) { vnni_wanted = on; }
static int has_vnni(void) { return vnni_wanted; }

struct vnni_q {
    int8_t q[FMAXH][KERN_KVQ_MAX_DIM] __attribute__((aligned(64))); /* per chunk: natural (8-bit) or evens|odds (4-bit) */
    float sq[FMAXH];
    __m512i lane_idx[VNNI_MAX_CHUNKS]; /* per chunk: the [s, b] lane of each int32 lane's group */
    int win[VNNI_MAX_CHUNKS];          /* per chunk: its 8-group window */
};

/* Rounds q of NH heads to int8 and lays it out for KB-bit codes. */
static void vnni_prepare(struct vnni_q *v, const int KB, const int NH, const float *q, int d, int G) {
    const int vpc = 512 / KB; /* values per 64-byte chunk */
    for (int h = 0; h < NH; h++) {
        const float *qh = q + (size_t)h * d;
        float amax = 0;
        for (int i = 0; i < d; i++) amax = fabsf(qh[i]) > amax ? fabsf(qh[i]) : amax;
        const float sq = amax > 0 ? amax / 127.0f : 1.0f;
        v->sq[h] = sq;
        for (int c = 0; c < d; c += vpc)
            for (int i = 0; i < vpc; i++) {
                const int8_t x = (int8_t)lrintf(qh[c + i] / sq);
                if (KB == 8) v->q[h][c + i] = x;
                else v->q[h][c + (i & 1) * 64 + i / 2] = x; /* evens then odds */
            }
    }
    for (int t = 0; t < d / vpc; t++) {
        int32_t idx[16];
        v->win[t] = (t * vpc / G) / 8;
        for (int j = 0; j < 16; j++) idx[j] = 2 * ((t * vpc + j * vpc / 16) / G - 8 * v->win[t]);
        v->lane_idx[t] = _mm512_loadu_si512(idx);
    }
}

/* The same partial scores as fq_scores, from int8 q: out[h] as REDUCE_FQ leaves them.
 * qbs: fq_scores's bias vectors divided by the head's sq (everything is scaled by sq
 * at the end). */
INLINE void fq_scores_vnni(const int KB, const int NH, const int FQ, const struct vnni_q *v, const __m512 *qbs, int d,
                           int G, const uint8_t *const *rows, __m512 *out) {
    const int ng = d / G, ng8 = (ng + 7) / 8, n_chunk = d * KB / 512;
    const size_t cbytes = (size_t)d * KB / 8;
    __m512 acc[4][FMAXH], sbv[4];
    UNR
    for (int r = 0; r < FQ; r++) {
        sbv[r] = _mm512_setzero_ps(); /* set at chunk 0 (window 0) */
        UNR
        for (int h = 0; h < NH; h++) acc[r][h] = _mm512_setzero_ps();
    }
    int w = -1;
    for (int t = 0; t < n_chunk; t++) {
        if (v->win[t] != w) { /* the next 8 groups' scales and biases; their bias term */
            w = v->win[t];
            UNR
            for (int r = 0; r < FQ; r++) {
                sbv[r] = sb8(rows[r] + cbytes, 8 * w, ng);
                UNR
                for (int h = 0; h < NH; h++) acc[r][h] = _mm512_fmadd_ps(sbv[r], qbs[h * ng8 + w], acc[r][h]);
            }
        }
        UNR
        for (int r = 0; r < FQ; r++) {
            const __m512 ls = _mm512_permutexvar_ps(v->lane_idx[t], sbv[r]);
            const __m512i x = _mm512_loadu_si512(rows[r] + 64 * t);
            if (KB == 4) {
                const __m512i m = _mm512_set1_epi8(15);
                const __m512i lo = _mm512_and_si512(x, m), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m);
                UNR
                for (int h = 0; h < NH; h++) {
                    __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                     _mm512_load_si512(v->q[h] + 128 * t));
                    ia = _mm512_dpbusd_epi32(ia, hi, _mm512_load_si512(v->q[h] + 128 * t + 64));
                    acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), ls, acc[r][h]);
                }
            } else {
                UNR
                for (int h = 0; h < NH; h++) {
                    const __m512i ia = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, _mm512_load_si512(v->q[h] + 64 * t));
                    acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), ls, acc[r][h]);
                }
            }
        }
    }
    UNR
    for (int h = 0; h < NH; h++)
        out[h] = _mm512_mul_ps(REDUCE_FQ(FQ, acc, h), _mm512_set1_ps(v->sq[h]));
}

/* ---- VNNI scoring of keys of 64 values, 16 rows at a time ----
 * vpdpbusd leaves int32 lanes of partial dot products: per 4-bit row (32 code bytes,
 * half a vector, so two rows per vector: low nibbles against the even values of q,
 * high nibbles against the odd ones) 8 lanes of 8 values, per 8-bit row 16 lanes of
 * 4 values. The lanes of 16 rows are added in integers down to one per (row, half:
 * values 0-31 A, 32-63 B) before any float work, then scaled per half: far fewer
 * vector operations per row and head than a float accumulator per row (fq_scores_vnni,
 * whose arithmetic this is). */
struct pair_q {
    int8_t e[FMAXH][64] __attribute__((aligned(64))); /* 4-bit: q8 of the even values, twice; 8-bit: q8 */
    int8_t o[FMAXH][64] __attribute__((aligned(64))); /* 4-bit: q8 of the odd values, twice */
    float sq[FMAXH], qa[FMAXH], qb[FMAXH];            /* q scale; sum of q over halves A, B */
};

static void pair_prepare(struct pair_q *v, const int KB, const int NH, const float *q, int G) {
    for (int h = 0; h < NH; h++) {
        const float *qh = q + (size_t)h * 64;
        float amax = 0, sa = 0, sb = 0;
        for (int i = 0; i < 64; i++) {
            amax = fabsf(qh[i]) > amax ? fabsf(qh[i]) : amax;
            if (i < 32) sa += qh[i];
            else sb += qh[i];
        }
        const float sq = amax > 0 ? amax / 127.0f : 1.0f;
        for (int i = 0; i < 64; i++) {
            const int8_t x = (int8_t)lrintf(qh[i] / sq);
            int8_t *dst = i & 1 ? v->o[h] : v->e[h];
            if (KB == 8) v->e[h][i] = x;
            else dst[i / 2] = dst[32 + i / 2] = x;
        }
        v->sq[h] = sq;
        /* one group of 64: its bias takes the sum of all of q, half B's none */
        v->qa[h] = G == 64 ? sa + sb : sa;
        v->qb[h] = G == 64 ? 0.0f : sb;
    }
}

/* Sums of the lanes of 16 rows (four per 128-bit lane) for 4-bit keys: p[i] holds
 * rows 2i, 2i+1, each as [half A: 4 lanes, half B: 4 lanes]. Returns rows 0-7 in *e
 * and 8-15 in *f, 128-bit lane 0 rows 0,2,4,6 half A, lane 1 the same rows half B,
 * lanes 2, 3 rows 1,3,5,7 (+8 in *f). */
INLINE void sum_lanes4(const __m512i p[8], __m512i *e, __m512i *f) {
    __m512i c[4];
    UNR
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    *e = _mm512_add_epi32(_mm512_unpacklo_epi64(c[0], c[1]), _mm512_unpackhi_epi64(c[0], c[1]));
    *f = _mm512_add_epi32(_mm512_unpacklo_epi64(c[2], c[3]), _mm512_unpackhi_epi64(c[2], c[3]));
}

/* The same for 8-bit keys: p[r] holds row r, lanes 0-7 half A, 8-15 half B. Returns
 * 128-bit lanes [A rows 0-3, B rows 0-3, A rows 4-7, B rows 4-7] (+8 in *f). */
INLINE void sum_lanes8(const __m512i p[16], __m512i *e, __m512i *f) {
    __m512i t[8], u[4];
    UNR
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    UNR
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    *e = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    *f = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of 16 rows (rows[i], the last ones may repeat) for NH heads into sc[h][j16..]. */
INLINE void pair_scores16(const int KB, const int NH, const struct pair_q *v, int G, const uint8_t *const rows[16],
                          float sc[][KVQ_ATTN_BLOCK], int j16, int nv) {
    /* per row [scale A, bias A, scale B, bias B] (one group of 64: [s, b, s, 0]), built
     * in registers (small stores read back as a vector stall store forwarding) */
    long long raw[16];
    UNR
    for (int r = 0; r < 16; r++) {
        if (G == 64) {
            uint32_t x;
            memcpy(&x, rows[r] + 8 * KB, 4);
            raw[r] = (long long)((uint64_t)x | (uint64_t)(x & 0xFFFF) << 32);
        } else {
            memcpy(&raw[r], rows[r] + 8 * KB, 8);
        }
    }
    __m512 c[4]; /* rows 4i..4i+3 */
    UNR
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_cvtph_ps(_mm256_set_epi64x(raw[4 * i + 3], raw[4 * i + 2], raw[4 * i + 1], raw[4 * i]));
    /* the scales in the layout the integer sums end in (c[i] lane 4 * (row % 4) + field) */
    const __m512i sidx = KB == 4 ? _mm512_set_epi32(30, 22, 14, 6, 28, 20, 12, 4, 26, 18, 10, 2, 24, 16, 8, 0)
                                 : _mm512_set_epi32(30, 26, 22, 18, 28, 24, 20, 16, 14, 10, 6, 2, 12, 8, 4, 0);
    const __m512 se = _mm512_permutex2var_ps(c[0], sidx, c[1]), sf = _mm512_permutex2var_ps(c[2], sidx, c[3]);
    /* biases in row order */
    const __m512i bidx = _mm512_set_epi32(29, 25, 21, 17, 13, 9, 5, 1, 29, 25, 21, 17, 13, 9, 5, 1);
    const __mmask16 hi8 = 0xFF00;
    const __m512 ba = _mm512_mask_blend_ps(hi8, _mm512_permutex2var_ps(c[0], bidx, c[1]), _mm512_permutex2var_ps(c[2], bidx, c[3]));
    const __m512i bidx2 = _mm512_add_epi32(bidx, _mm512_set1_epi32(2));
    const __m512 bb = _mm512_mask_blend_ps(hi8, _mm512_permutex2var_ps(c[0], bidx2, c[1]), _mm512_permutex2var_ps(c[2], bidx2, c[3]));
    /* 4-bit: where row r's sum lands, (r / 8) * 8 + (r % 2) * 4 + (r % 8) / 2 */
    const __m512i ridx = _mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i x[16], y[8]; /* 4-bit: low and high nibbles of rows 2i, 2i+1; 8-bit: row i */
    UNR
    for (int i = 0; i < 8; i++) {
        if (KB == 4) {
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)rows[2 * i])),
                                                 _mm256_loadu_si256((const __m256i *)rows[2 * i + 1]), 1);
            x[i] = _mm512_and_si512(z, m4);
            y[i] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
        } else {
            x[2 * i] = _mm512_loadu_si512(rows[2 * i]);
            x[2 * i + 1] = _mm512_loadu_si512(rows[2 * i + 1]);
        }
    }
    UNR
    for (int h = 0; h < NH; h++) {
        const __m512i qe = _mm512_load_si512(v->e[h]);
        __m512i p[16], e, f;
        if (KB == 4) {
            const __m512i qo = _mm512_load_si512(v->o[h]);
            UNR
            for (int i = 0; i < 8; i++) p[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x[i], qe), y[i], qo);
            sum_lanes4(p, &e, &f);
        } else {
            UNR
            for (int i = 0; i < 16; i++) p[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x[i], qe);
            sum_lanes8(p, &e, &f);
        }
        const __m512 te = _mm512_mul_ps(_mm512_cvtepi32_ps(e), se), tf = _mm512_mul_ps(_mm512_cvtepi32_ps(f), sf);
        /* add the halves: 4-bit gives rows in ridx order, 8-bit in row order */
        __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(te, tf, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(te, tf, _MM_SHUFFLE(3, 1, 3, 1)));
        if (KB == 4) t = _mm512_permutexvar_ps(ridx, t);
        const __m512 bias = _mm512_fmadd_ps(bb, _mm512_set1_ps(v->qb[h]), _mm512_mul_ps(ba, _mm512_set1_ps(v->qa[h])));
        const __m512 r16 = _mm512_fmadd_ps(t, _mm512_set1_ps(v->sq[h]), bias);
        if (nv >= 16) _mm512_store_ps(&sc[h][j16], r16);
        else _mm512_mask_storeu_ps(&sc[h][j16], (__mmask16)((1u << nv) - 1), r16);
    }
}

#define FB KVQ_ATTN_BLOCK /* rows per softmax step (a multiple of 16) */
#define F_PF_ROWS 48      /* prefetch distance: K and V rows this far ahead */

/* Rows stream from L3/DRAM: fetch the K and V rows F_PF_ROWS past row j of the run
 * well ahead (past its end: the next run's first rows). */
static inline void pf_ahead(const struct kern_kv_run *run, const struct kern_kv_run *next, int j, size_t ks, size_t vs,
                            size_t krb, size_t vrb) {
    const int pj = j + F_PF_ROWS;
    if (pj < run->n) {
        pf_row(run->k + (size_t)pj * ks, krb);
        pf_row(run->v + (size_t)pj * vs, vrb);
    } else if (pj - run->n < next->n && next != run) {
        pf_row(next->k + (size_t)(pj - run->n) * ks, krb);
        pf_row(next->v + (size_t)(pj - run->n) * vs, vrb);
    }
}

INLINE void fast_attn(const int KB, const int VB, const int NH, struct kern_attn_state *s, int h0, const float *q,
                      const struct kern_kv_rows *kf, const struct kern_kv_rows *vf, const struct kern_kv_run *runs,
                      int n_runs) {
    const struct kern_kv_rows *k = kf, *v = vf;
    const int d = s->d, KG = k->group, VG = v->group;
    const int kng = d / KG, kng8 = (kng + 7) / 8, vng = d / VG, vng8 = (vng + 7) / 8;
    const size_t kcb = (size_t)d * KB / 8, vcb = (size_t)d * VB / 8;
    const size_t krb = kcb + 4 * (size_t)kng, vrb = vcb + 4 * (size_t)vng;
    float qp[FMAXH * KERN_KVQ_MAX_DIM] __attribute__((aligned(64)));
    float accp[FMAXH * KERN_KVQ_MAX_DIM] __attribute__((aligned(64)));
    __m512 qb[FMAXH * KERN_KVQ_MAX_DIM / 256];
    float sc[FMAXH][FB] __attribute__((aligned(64)));
    /* per row and head: p * [s0,b0,s1,b1,...] of V, 8 groups per vector */
    /* packed densely, (j * NH + h) * vng8 + c: a padded [FB][FMAXH][..] layout puts the
     * rows 1 KB apart, all in a few L1 sets, and evicts the prefetched V rows */
    __m512 w[FB * FMAXH * (KERN_KVQ_MAX_DIM / 256)];
    UNR
    for (int h = 0; h < NH; h++) {
        const float *qh = q + (size_t)(h0 + h) * d;
        float *ah = s->acc + (size_t)(h0 + h) * d;
        if (KB == 4) to_code_order(qh, qp + (size_t)h * d, d);
        else memcpy(qp + (size_t)h * d, qh, sizeof(float) * (size_t)d);
        if (VB == 4) to_code_order(ah, accp + (size_t)h * d, d);
        else memcpy(accp + (size_t)h * d, ah, sizeof(float) * (size_t)d);
        /* sum of q per K group, once per call: the bias term is bias_g * qsum_g */
        float lanes[16 * (KERN_KVQ_MAX_DIM / 256)] __attribute__((aligned(64)));
        memset(lanes, 0, sizeof(float) * 16 * (size_t)kng8);
        for (int g = 0; g < kng; g++) {
            float t = 0;
            for (int i = g * KG; i < (g + 1) * KG; i++) t += qh[i];
            lanes[16 * (g / 8) + 2 * (g % 8) + 1] = t;
        }
        for (int c = 0; c < kng8; c++) qb[h * kng8 + c] = _mm512_load_ps(lanes + 16 * c);
    }
    /* integer scoring where the CPU has VNNI and the codes fill whole 64-byte chunks */
    const bool vnni = has_vnni() && (d * KB) % 512 == 0;
    /* V weights packed several rows per vector: 1 or 2 groups per row (wvf floats; with
     * more, measured no faster than a vector per row) */
    const bool wpack = vng == 1 || vng == 2;
    const int wvf = 2 * vng, rpv = 16 / wvf;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pexp = _mm512_srlv_epi32(lane, _mm512_set1_epi32(vng == 1 ? 1 : 2)); /* lane / wvf */
    /* where row j's weights of head 0 start in w (floats), and the step per head */
    int woff[FB];
    const int wh = wpack ? 16 : 16 * vng8;
    for (int j = 0; j < FB; j++) woff[j] = wpack ? (j / rpv) * NH * 16 + (j % rpv) * wvf : j * NH * 16 * vng8;
    const bool pair = has_vnni() && d == 64;
    struct pair_q pq;
    if (pair) pair_prepare(&pq, KB, NH, q + (size_t)h0 * d, KG);
    struct vnni_q vq;
    __m512 qbs[FMAXH * KERN_KVQ_MAX_DIM / 256];
    if (vnni) {
        vnni_prepare(&vq, KB, NH, q + (size_t)h0 * d, d, KG);
        UNR
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < kng8; c++) qbs[h * kng8 + c] = _mm512_div_ps(qb[h * kng8 + c], _mm512_set1_ps(vq.sq[h]));
    }
    for (int ri = 0; ri < n_runs; ri++) {
    /* the rows of this run; prefetches past its end fetch the next run's first rows */
    const struct kern_kv_run *run = &runs[ri], *next = ri + 1 < n_runs ? &runs[ri + 1] : run;
    const int n = run->n;
    for (int j0 = 0; j0 < n; j0 += FB) {
        const int nj = n - j0 < FB ? n - j0 : FB;
        /* scores: FQ rows at a time, 16 rows per transposed reduction */
        for (int j16 = 0; j16 < nj; j16 += 16) {
            if (pair) {
                const uint8_t *rows[16];
                for (int r = 0; r < 16; r++) {
                    const int j = j16 + r < nj ? j16 + r : nj - 1;
                    rows[r] = run->k + (size_t)(j0 + j) * k->stride;
                    pf_ahead(run, next, j0 + j, k->stride, v->stride, krb, vrb);
                }
                pair_scores16(KB, NH, &pq, KG, rows, sc, j16, nj - j16);
                continue;
            }
            __m512 part[4][FMAXH];
            UNR
            for (int qd = 0; qd < 4; qd++) {
                const uint8_t *rows[4];
                UNR
                for (int r = 0; r < 4; r++) {
                    int j = j16 + 4 * qd + r;
                    j = j < nj ? j : nj - 1; /* past the end: repeat the last row, score unused */
                    rows[r] = run->k + (size_t)(j0 + j) * k->stride;
                    pf_ahead(run, next, j0 + j, k->stride, v->stride, krb, vrb);
                }
                if (FQ_OF(NH) == 4) {
                    if (vnni) fq_scores_vnni(KB, NH, 4, &vq, qbs, d, KG, rows, part[qd]);
                    else fq_scores(KB, NH, 4, qp, qb, d, KG, rows, part[qd]);
                } else {
                    __m512 p01[FMAXH], p23[FMAXH];
                    if (vnni) {
                        fq_scores_vnni(KB, NH, 2, &vq, qbs, d, KG, rows, p01);
                        fq_scores_vnni(KB, NH, 2, &vq, qbs, d, KG, rows + 2, p23);
                    } else {
                        fq_scores(KB, NH, 2, qp, qb, d, KG, rows, p01);
                        fq_scores(KB, NH, 2, qp, qb, d, KG, rows + 2, p23);
                    }
                    UNR
                    for (int h = 0; h < NH; h++) part[qd][h] = join2(p01[h], p23[h]);
                }
            }
            UNR
            for (int h = 0; h < NH; h++) {
                const __m512 r16 = reduce16(part[0][h], part[1][h], part[2][h], part[3][h]);
                if (nj - j16 >= 16) _mm512_store_ps(&sc[h][j16], r16);
                else _mm512_mask_storeu_ps(&sc[h][j16], (__mmask16)((1u << (nj - j16)) - 1), r16);
            }
        }
        /* online softmax over the block */
        UNR
        for (int h = 0; h < NH; h++)
            kern_softmax_step_avx512(sc[h], nj, &s->m[h0 + h], &s->l[h0 + h], accp + (size_t)h * d, d);
        /* V: acc += sum_j (p_j*scale_g) * code + sum_j p_j*bias_g, the bias once per group */
        __m512 bsum[FMAXH][KERN_KVQ_MAX_DIM / 256];
        if (wpack) {
            /* few groups: one vector holds the [s, b] of rpv rows, one multiply per head
             * weights them all (each row's lanes times its p) */
            __m512 bs[FMAXH];
            UNR
            for (int h = 0; h < NH; h++) bs[h] = _mm512_setzero_ps();
            for (int j = 0; j < nj; j += rpv) {
                const int nr = nj - j < rpv ? nj - j : rpv;
                const __mmask16 live = (__mmask16)(nr == rpv ? 0xFFFF : (1u << (nr * wvf)) - 1);
                const __m512 sbv = _mm512_cvtph_ps(sb_rows(run->v + (size_t)(j0 + j) * v->stride + vcb, v->stride, wvf, nr));
                const __m512i pi = _mm512_add_epi32(pexp, _mm512_set1_epi32(j % 16));
                UNR
                for (int h = 0; h < NH; h++) {
                    const __m512 t = _mm512_maskz_mul_ps(live, sbv, _mm512_permutexvar_ps(pi, _mm512_load_ps(&sc[h][j & ~15])));
                    w[(size_t)(j / rpv) * NH + h] = t;
                    bs[h] = _mm512_add_ps(bs[h], t);
                }
            }
            /* fold the rows' lanes: lanes [0, wvf) end with the [s, b] sums */
            UNR
            for (int h = 0; h < NH; h++) {
                for (int half = 8; half >= wvf; half /= 2)
                    bs[h] = _mm512_add_ps(bs[h], _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(half)), bs[h]));
                bsum[h][0] = bs[h];
            }
        }
        for (int c = 0; c < vng8 && !wpack; c++) {
            /* chunk outer, rows inner: the bias sums stay in registers */
            __m512 bs[FMAXH];
            UNR
            for (int h = 0; h < NH; h++) bs[h] = _mm512_setzero_ps();
            for (int j = 0; j < nj; j++) {
                const __m512 sbv = sb8(run->v + (size_t)(j0 + j) * v->stride + vcb, 8 * c, vng);
                UNR
                for (int h = 0; h < NH; h++) {
                    const __m512 t = _mm512_mul_ps(sbv, _mm512_set1_ps(sc[h][j]));
                    w[((size_t)j * NH + h) * vng8 + c] = t;
                    bs[h] = _mm512_add_ps(bs[h], t);
                }
            }
            UNR
            for (int h = 0; h < NH; h++) bsum[h][c] = bs[h];
        }
        /* CG 16-value vectors per pass over the rows: NH * CG accumulators in registers */
        const int CG = NH > 4 ? 2 : 4;
        for (int c0 = 0; c0 < d; c0 += 16 * CG) {
            /* weight lane of each 16-value vector: (group / 8, 2 * (group % 8)) */
            int wc[4], wl[4];
            UNR
            for (int t = 0; t < CG; t++) {
                const int g = (c0 + 16 * t) / VG;
                wc[t] = g / 8;
                wl[t] = 2 * (g % 8);
            }
            __m512 a[FMAXH][4];
            UNR
            for (int h = 0; h < NH; h++)
                UNR
                for (int t = 0; t < CG; t++) a[h][t] = _mm512_load_ps(accp + (size_t)h * d + c0 + 16 * t);
            for (int j = 0; j < nj; j++) {
                const uint8_t *r = run->v + (size_t)(j0 + j) * v->stride;
                __m512 x[4];
                if (VB == 4) {
                    UNR
                    for (int t = 0; t < CG; t += 2) {
                        const __m512i z = zx16(r + c0 / 2 + 8 * t);
                        x[t] = lo4(z);
                        x[t + 1] = hi4(z);
                    }
                } else {
                    UNR
                    for (int t = 0; t < CG; t++) x[t] = _mm512_cvtepi32_ps(zx16(r + c0 + 16 * t));
                }
                UNR
                for (int h = 0; h < NH; h++) {
                    const float *wj = (const float *)w + woff[j] + h * wh;
                    UNR
                    for (int t = 0; t < CG; t++)
                        a[h][t] = _mm512_fmadd_ps(x[t], _mm512_set1_ps(wj[16 * wc[t] + wl[t]]), a[h][t]);
                }
            }
            UNR
            for (int h = 0; h < NH; h++)
                UNR
                for (int t = 0; t < CG; t++) _mm512_store_ps(accp + (size_t)h * d + c0 + 16 * t, a[h][t]);
        }
        UNR
        for (int h = 0; h < NH; h++) {
            const float *bs = (const float *)&bsum[h][0];
            float *a = accp + (size_t)h * d;
            for (int g = 0; g < vng; g++) {
                const __m512 b = _mm512_set1_ps(bs[16 * (g / 8) + 2 * (g % 8) + 1]);
                for (int i = g * VG; i < (g + 1) * VG; i += 16) _mm512_store_ps(a + i, _mm512_add_ps(_mm512_load_ps(a + i), b));
            }
        }
    }
    }
    UNR
    for (int h = 0; h < NH; h++) {
        float *ah = s->acc + (size_t)(h0 + h) * d;
        if (VB == 4) from_code_order(accp + (size_t)h * d, ah, d);
        else memcpy(ah, accp + (size_t)h * d, sizeof(float) * (size_t)d);
    }
}

#define FAST_NH(KB, VB)                                                                                                \
    static void fast_##KB##_##VB(int nh, struct kern_attn_state *s, int h0, const float *q,                           \
                                 const struct kern_kv_rows *k, const struct kern_kv_rows *v,                          \
                                 const struct kern_kv_run *runs, int n_runs) {                                        \
        switch (nh) {                                                                                                  \
        case 8: fast_attn(KB, VB, 8, s, h0, q, k, v, runs, n_runs); break;                                             \
        case 7: fast_attn(KB, VB, 7, s, h0, q, k, v, runs, n_runs); break;                                             \
        case 6: fast_attn(KB, VB, 6, s, h0, q, k, v, runs, n_runs); break;                                             \
        case 5: fast_attn(KB, VB, 5, s, h0, q, k, v, runs, n_runs); break;                                             \
        case 4: fast_attn(KB, VB, 4, s, h0, q, k, v, runs, n_runs); break;                                             \
        case 3: fast_attn(KB, VB, 3, s, h0, q, k, v, runs, n_runs); break;                                             \
        case 2: fast_attn(KB, VB, 2, s, h0, q, k, v, runs, n_runs); break;                                             \
        default: fast_attn(KB, VB, 1, s, h0, q, k, v, runs, n_runs); break;                                            \
        }                                                                                                              \
    }
FAST_NH(4, 4)
FAST_NH(8, 4)
/* 8-bit V rows stay on the generic body for now: this V pass measured bimodal on them
 * (about 70 or 170-190 us/call at depth 4096 depending on where the buffers land, against
 * 120-140 generic), cause not found yet. The VB == 8 code below is kept for that work. */

/* The fast path takes this format pair (K 4/8-bit, V 4-bit, groups of 32k). */
static bool fast_ok(int d, const struct kern_kv_rows *k, const struct kern_kv_rows *v) {
    return d % 64 == 0 && d <= KERN_KVQ_MAX_DIM && (k->bits == 4 || k->bits == 8) && v->bits == 4 &&
           k->group % 32 == 0 && v->group % 32 == 0 && d % k->group == 0 && d % v->group == 0;
}

/* Up to FMAXH heads per pass: each pass reads the rows once. */
static void fast_heads(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                       const struct kern_kv_rows *v, const struct kern_kv_run *runs, int n_runs) {
    while (nh > 0) {
        const int c = nh > FMAXH ? FMAXH : nh;
        if (k->bits == 4) fast_4_4(c, s, h0, q, k, v, runs, n_runs);
        else fast_8_4(c, s, h0, q, k, v, runs, n_runs);
        h0 += c;
        nh -= c;
    }
}

void kern_kvq_attn_avx512(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                          const struct kern_kv_rows *v, int n) {
    if (!fast_ok(s->d, k, v)) {
        kern_kvq_attn_avx512g(s, h0, nh, q, k, v, n);
        return;
    }
    const struct kern_kv_run run = {k->data, v->data, n};
    fast_heads(s, h0, nh, q, k, v, &run, 1);
}

bool kern_kvq_attn_avx512_runs(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                               const struct kern_kv_rows *v, const struct kern_kv_run *runs, int n_runs) {
    if (!fast_ok(s->d, k, v)) return false;
    fast_heads(s, h0, nh, q, k, v, runs, n_runs);
    return true;
}
