/* AVX2 + FMA + F16C matrix kernels: vpmaddubsw/vpmaddwd for the quantized types (or
 * AVX-VNNI's vpdpbusd, built a second time as matmul_avx2vnni.c), vcvtph2ps + FMA for
 * float types. Register tiles of up to 4 rows x 1 token (decode) or 2 rows x 4 tokens
 * (prefill); Q8_0 and Q4_0 in the 16-row form 16 rows x up to 4 tokens. */
#include "core/dtype.h"
#include "kernels/asan.h"
#include "kernels/f16.h"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_tiles.h"

#include <immintrin.h>
#include <string.h>

#include "kernels/simd_avx2.h"

/* ---- Q8_0 / Q4_0 ------------------------------------------------------------ */

INLINE void tile_pairs(const int q4, const struct kern_tile *tl, const int R, const int T) {
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t wrb = tl->wrb, xrb = tl->xrb, pfd = tl->pfd;
    const int64_t nb = tl->k / 32, np = (nb + 1) / 2, ys = tl->ys;
    float *y = tl->y;
    const size_t bbytes = q4 ? 18 : 34;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const int full = 2 * p + 1 < nb;
        __m256i wa[4], wb[4];
        float d0[4], d1[4];
        if (pfd) {
            UNROLL
            for (int r = 0; r < R; r++) {
                const char *pf = (const char *)w + (size_t)r * wrb + (size_t)(2 * p) * bbytes + pfd;
                _mm_prefetch(pf, _MM_HINT_T0);
                _mm_prefetch(pf + 64, _MM_HINT_T0);
            }
        }
        UNROLL
        for (int r = 0; r < R; r++) {
            const uint8_t *b0 = w + (size_t)r * wrb + (size_t)(2 * p) * bbytes;
            d0[r] = _cvtsh_ss(kern_rd16(b0));
            d1[r] = full ? _cvtsh_ss(kern_rd16(b0 + bbytes)) : 0.0f;
            if (q4) {
                __m128i lo = _mm_loadu_si128((const __m128i *)(b0 + 2));
                __m128i hi = full ? _mm_loadu_si128((const __m128i *)(b0 + 20)) : _mm_setzero_si128();
                __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
                wa[r] = _mm256_and_si256(v, m4);
                wb[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            } else {
                wa[r] = _mm256_loadu_si256((const __m256i *)(b0 + 2));
                wb[r] = full ? _mm256_loadu_si256((const __m256i *)(b0 + 36)) : _mm256_setzero_si256();
            }
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            const struct kern_pair *xp = (const struct kern_pair *)(xa + (size_t)t * xrb) + p;
            __m256i xa0 = _mm256_loadu_si256((const __m256i *)xp->q);
            __m256i xb0 = _mm256_loadu_si256((const __m256i *)(xp->q + 32));
            if (q4) {
                __m256i c = _mm256_set_epi32(0, 0, 0, xp->c[1], 0, 0, 0, xp->c[0]);
                __m256 xs = _mm256_set_m128(_mm_set1_ps(xp->d[1]), _mm_set1_ps(xp->d[0]));
                UNROLL
                for (int r = 0; r < R; r++) {
                    const __m256i s = dot4_u8s8(dot4_u8s8(c, wa[r], xa0), wb[r], xb0);
                    __m256 ws = _mm256_set_m128(_mm_set1_ps(d1[r]), _mm_set1_ps(d0[r]));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(ws, xs), acc[r][t]);
                }
            } else {
                /* |w| times x with w's sign: two products of at most 128 * 127 a word */
                const __m256i zero = _mm256_setzero_si256();
                UNROLL
                for (int r = 0; r < R; r++) {
                    const __m256i i0 = dot4_u8s8(zero, _mm256_abs_epi8(wa[r]), _mm256_sign_epi8(xa0, wa[r]));
                    const __m256i i1 = dot4_u8s8(zero, _mm256_abs_epi8(wb[r]), _mm256_sign_epi8(xb0, wb[r]));
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(d0[r] * xp->d[0]), acc[r][t]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(d1[r] * xp->d[1]), acc[r][t]);
                }
            }
        }
    }
    UNROLL
    for (int t = 0; t < T; t++)
        UNROLL
        for (int r = 0; r < R; r++) y[t * ys + r] = hsum256(acc[r][t]);
}

/* ---- Q4_K / Q6_K ---------------------------------------------------------- */

INLINE void tile_q4k(const struct kern_tile *tl, const int R, const int T) {
    (void)R; /* one row */
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t xrb = tl->xrb, pfd = tl->pfd;
    const int64_t nsb = tl->k / 256, ys = tl->ys;
    float *y = tl->y;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[4], macc[4];
    UNROLL
    for (int t = 0; t < T; t++) acc[t] = macc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 144) {
        if (pfd)
            for (int o = 0; o < 192; o += 64) _mm_prefetch((const char *)w + pfd + o, _MM_HINT_T0);
        /* 6-bit scales and mins of the 8 sub-blocks (kern_q4k_scale_min) in general
         * registers, as the AVX-512 kernel does */
        uint32_t u0, u1, u2;
        memcpy(&u0, w + 4, 4);
        memcpy(&u1, w + 8, 4);
        memcpy(&u2, w + 12, 4);
        const uint64_t sc8 = (uint64_t)(u0 & 0x3f3f3f3fu) |
                             (uint64_t)((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
        const uint64_t mn8 = (uint64_t)(u1 & 0x3f3f3f3fu) |
                             (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
        /* scale j as a word in every lane of sv[j]; each min twice, against the bsums of its
         * two 16s */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
        const __m128i mv = _mm_cvtsi64_si128((long long)mn8);
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
        __m256i wv[8], sv[8];
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
            wv[2 * c] = _mm256_and_si256(v, m4);
            wv[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        UNROLL
        for (int j = 0; j < 8; j++) /* bytes 2j, 2j + 1 in every word */
            sv[j] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 * (2 * j + 1) + 2 * j)));
        const float d = _cvtsh_ss(kern_rd16(w)), dmin = _cvtsh_ss(kern_rd16(w + 2));
        UNROLL
        for (int t = 0; t < T; t++) {
            const struct kern_q8k *xb = (const struct kern_q8k *)(xa + (size_t)t * xrb) + b;
            __m256i ia = _mm256_setzero_si256();
            UNROLL
            for (int j = 0; j < 8; j++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * j));
                ia = _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j], x), sv[j]));
            }
            const __m256i mm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), mn16);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(d * xb->d), acc[t]);
            macc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(-dmin * xb->d), macc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) y[t * ys] = hsum256(acc[t]) + hsum256(macc[t]);
}

INLINE void tile_q6k(const struct kern_tile *tl, const int R, const int T) {
    (void)R; /* one row */
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t xrb = tl->xrb, pfd = tl->pfd;
    const int64_t nsb = tl->k / 256, ys = tl->ys;
    float *y = tl->y;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    __m256 acc[4], cacc[4];
    UNROLL
    for (int t = 0; t < T; t++) acc[t] = cacc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++, w += 210) {
        if (pfd)
            for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)w + pfd + o, _MM_HINT_T0);
        const int8_t *sc = (const int8_t *)(w + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i wq[8], sv[8];
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            wq[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
            wq[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
            wq[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
            wq[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        }
        UNROLL
        for (int g = 0; g < 8; g++)
            sv[g] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * g + 1]), _mm_set1_epi16(sc[2 * g]));
        const float d = _cvtsh_ss(kern_rd16(w + 208));
        UNROLL
        for (int t = 0; t < T; t++) {
            const struct kern_q8k *xb = (const struct kern_q8k *)(xa + (size_t)t * xrb) + b;
            __m256i ia = _mm256_setzero_si256();
            UNROLL
            for (int g = 0; g < 8; g++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * g));
                ia = _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(wq[g], xv), sv[g]));
            }
            /* the codes' offset 32: sum_j scale_j * bsum_j */
            const __m256i cm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), sc16);
            const float dd = d * xb->d;
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(dd), acc[t]);
            cacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cm), _mm256_set1_ps(-32.0f * dd), cacc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) y[t * ys] = hsum256(acc[t]) + hsum256(cacc[t]);
}

/* ---- float types ------------------------------------------------------------ */

INLINE __m256 load_w8(uint32_t wtype, const uint8_t *p) {
    switch (wtype) {
    case KVQ_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case KVQ_BF16:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    default: return _mm256_loadu_ps((const float *)p);
    }
}

INLINE float wval(uint32_t wtype, const uint8_t *p) {
    if (wtype == KVQ_F16) return kvq_f16_to_f32(kern_rd16(p));
    if (wtype == KVQ_BF16) return kvq_bf16_to_f32(kern_rd16(p));
    float v;
    memcpy(&v, p, 4);
    return v;
}

INLINE void tile_float(const uint32_t wtype, const struct kern_tile *tl, const int R, const int T) {
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t wrb = tl->wrb, xrb = tl->xrb, pfd = tl->pfd;
    const int64_t k = tl->k, ys = tl->ys;
    float *y = tl->y;
    const size_t es = wtype == KVQ_F32 ? 4 : 2;
    __m256 acc[4][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        if (pfd && (i * (int64_t)es) % 64 == 0) {
            UNROLL
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)w + (size_t)r * wrb + (size_t)i * es + pfd, _MM_HINT_T0);
        }
        __m256 wv[4];
        UNROLL
        for (int r = 0; r < R; r++) wv[r] = load_w8(wtype, w + (size_t)r * wrb + (size_t)i * es);
        UNROLL
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps((const float *)(xa + (size_t)t * xrb) + i);
            UNROLL
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) {
        const float *x = (const float *)(xa + (size_t)t * xrb);
        UNROLL
        for (int r = 0; r < R; r++) {
            float s = hsum256(acc[r][t]);
            for (int64_t j = i; j < k; j++) s += wval(wtype, w + (size_t)r * wrb + (size_t)j * es) * x[j];
            y[t * ys + r] = s;
        }
    }
}

/* ---- activation preparation (once: not in the AVX-VNNI build) --------------- */
#if !KVQ_AVXVNNI

/* 8 values -> int32 codes of x * id, as the scalar q8_code: NaN lanes 0, the rest clamped
 * to +-127 (an unclamped NaN or inf converts to INT_MIN and overflows the sums), rounded
 * to nearest even. */
INLINE __m256i quant8(const float *x, __m256 id) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x), id);
    v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    return _mm256_cvtps_epi32(v);
}

/* 32 values of x at scale id: their codes in order into lo (values 0-15) and hi (16-31),
 * the sums of each 16 into s0, s1. */
INLINE void quant32(const float *x, __m256 id, __m128i *lo, __m128i *hi, int32_t *s0, int32_t *s1) {
    const __m256i a = quant8(x, id), b = quant8(x + 8, id), c = quant8(x + 16, id), d = quant8(x + 24, id);
    const __m256i w0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    const __m256i w1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c, d), 0xD8);
    const __m256i q = _mm256_permute4x64_epi64(_mm256_packs_epi16(w0, w1), 0xD8);
    *lo = _mm256_castsi256_si128(q);
    *hi = _mm256_extracti128_si256(q, 1);
    const __m128i t = _mm_hadd_epi32(_mm256_castsi256_si128(_mm256_add_epi32(a, b)),
                                     _mm256_extracti128_si256(_mm256_add_epi32(a, b), 1));
    const __m128i u = _mm_hadd_epi32(_mm256_castsi256_si128(_mm256_add_epi32(c, d)),
                                     _mm256_extracti128_si256(_mm256_add_epi32(c, d), 1));
    const __m128i tu = _mm_hadd_epi32(t, u); /* [a+b: 2 partial sums, c+d: 2] */
    *s0 = _mm_extract_epi32(tu, 0) + _mm_extract_epi32(tu, 1);
    *s1 = _mm_extract_epi32(tu, 2) + _mm_extract_epi32(tu, 3);
}

INLINE float amax8n(const float *x, int n) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), absm));
    return hmax256(m);
}

int kern_act_prepare_avx2(uint32_t wtype, const float *x, void *dst, int64_t k) {
    if (wtype == KVQ_Q8_0 || wtype == KVQ_Q4_0) {
        const int q4 = wtype == KVQ_Q4_0;
        const int64_t nb = k / 32, np = (nb + 1) / 2;
        struct kern_pair *o = dst;
        for (int64_t p = 0; p < np; p++, o++) {
            if (2 * p + 1 >= nb) memset(o, 0, sizeof *o);
            for (int h = 0; h < 2 && 2 * p + h < nb; h++) {
                const float *xb = x + (2 * p + h) * 32;
                const float amax = amax8n(xb, 32);
                __m128i lo, hi;
                int32_t s0, s1;
                quant32(xb, _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), &lo, &hi, &s0, &s1);
                _mm_storeu_si128((__m128i *)(q4 ? o->q + 16 * h : o->q + 32 * h), lo);
                _mm_storeu_si128((__m128i *)(q4 ? o->q + 32 + 16 * h : o->q + 32 * h + 16), hi);
                o->d[h] = amax / 127.0f;
                o->c[h] = (q4 ? -8 : -128) * (s0 + s1);
            }
        }
        return 1;
    }
    if (wtype == KVQ_Q4_K || wtype == KVQ_Q6_K) {
        struct kern_q8k *o = dst;
        for (int64_t b = 0; b < k / 256; b++, o++) {
            const float *xb = x + b * 256;
            const float amax = amax8n(xb, 256);
            const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            o->d = amax / 127.0f;
            for (int g = 0; g < 16; g += 2) {
                __m128i lo, hi;
                int32_t s0, s1;
                quant32(xb + 16 * g, id, &lo, &hi, &s0, &s1);
                _mm_storeu_si128((__m128i *)(o->q + 16 * g), lo);
                _mm_storeu_si128((__m128i *)(o->q + 16 * g + 16), hi);
                o->bsums[g] = (int16_t)s0;
                o->bsums[g + 1] = (int16_t)s1;
            }
            o->pad = 0;
        }
        return 1;
    }
    return 0;
}
#endif

/* ---- Q4_0 weights in 16-row form (matmul.h) --------------------------------
 * A 64-byte vector of a block holds 4 nibble bytes of each of 16 rows: rows 0-7 in
 * its low 32 bytes, rows 8-15 in its high ones. Per half and token, the low and high
 * nibbles (values 4j.. and 16 + 4j.. of the block) go through vpmaddubsw against the
 * broadcast activation words (unsigned nibbles times int8: no saturation), then
 * vpmaddwd sums them into the 8 rows' int32 block sums, exactly; one FMA per block
 * and half then serves 8 rows, in block order whatever the number of tokens. */

/* Tokens per pass over a tile's blocks: two accumulators (halves) each. */
#define ROWS16_TOKENS 4

/* Rows [lo, hi) of the tile for T tokens: lanes lo..hi-1 of the two halves. */
INLINE void rows16_store(const struct kern_rows16_tile *tl, const int T, __m256 acc[][2]) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(tl->lo - 1)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(tl->hi), idx));
    const __m256i m1 = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(tl->lo - 9)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(tl->hi - 8), idx));
    UNROLL
    for (int t = 0; t < T; t++) {
        _mm256_maskstore_ps(tl->y + t * tl->ys, m0, acc[t][0]);
        _mm256_maskstore_ps(tl->y + t * tl->ys + 8, m1, acc[t][1]);
    }
}

/* The next tile's block b: its codes (cb bytes) and its 16 rows' f16 scales. */
INLINE void rows16_prefetch(const uint8_t *pf, int64_t b, int64_t nb, size_t cb) {
    for (size_t o = 0; o < cb; o += 64) _mm_prefetch((const char *)pf + (size_t)b * cb + o, _MM_HINT_T0);
    _mm_prefetch((const char *)pf + (size_t)nb * cb + 32 * (size_t)b, _MM_HINT_T0);
}

/* acc[t] += s[t] * the 16 rows' scales of block b * token t's block scale (at dx, rows
 * xrb bytes apart). */
INLINE void rows16_scale(const uint8_t *sc, int64_t b, const uint8_t *dx, size_t xrb, const int T,
                         __m256i s[][2], __m256 acc[][2]) {
    const __m256 ws0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 * b))),
                 ws1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 * b + 16)));
    UNROLL
    for (int t = 0; t < T; t++) {
        float x;
        memcpy(&x, dx + (size_t)t * xrb, 4);
        const __m256 d = _mm256_set1_ps(x);
        acc[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][0]), _mm256_mul_ps(ws0, d), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][1]), _mm256_mul_ps(ws1, d), acc[t][1]);
    }
}

/* One token group of a tile (matmul_tiles.h), the next tile prefetched a block at a
 * time. */
INLINE void rows16_q4_0_tokens(const struct kern_rows16_tile *tl, const int T) {
    const size_t cb = kern_rows16_code_bytes(1), xrb = tl->xrb;
    const int64_t nb = tl->nb;
    const uint8_t *tile = tl->tile, *xa = tl->xa, *pf = tl->pf, *sc = tile + (size_t)nb * cb;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[ROWS16_TOKENS][2];
    UNROLL
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = tile + (size_t)b * cb;
        if (pf) rows16_prefetch(pf, b, nb, cb);
        const size_t h = (size_t)(b & 1);
        const uint8_t *xb = xa + (size_t)(b / 2) * KERN_PAIR_BYTES;
        __m256i s[ROWS16_TOKENS][2];
        UNROLL
        for (int t = 0; t < T; t++) /* Q4_0's -8 per code: the pair's correction */
            s[t][0] = s[t][1] = _mm256_set1_epi32(kern_rd32(xb + (size_t)t * xrb + 64 + 4 * h));
        UNROLL
        for (int j = 0; j < 4; j++) {
            __m256i wl[2], wh[2]; /* rows 0-7, 8-15: low and high nibbles */
            UNROLL
            for (int half = 0; half < 2; half++) {
                const __m256i z = _mm256_load_si256((const __m256i *)(wb + 64 * j + 32 * half));
                wl[half] = _mm256_and_si256(z, m4);
                wh[half] = _mm256_and_si256(_mm256_srli_epi16(z, 4), m4);
            }
            UNROLL
            for (int t = 0; t < T; t++) {
                /* the pair layout: values 0-15 of block h at 16h, 16-31 at 32 + 16h */
                const uint8_t *xp = xb + (size_t)t * xrb;
                const __m256i xl = _mm256_set1_epi32(kern_rd32(xp + 16 * h + 4 * (size_t)j)),
                              xh = _mm256_set1_epi32(kern_rd32(xp + 32 + 16 * h + 4 * (size_t)j));
                UNROLL
                for (int half = 0; half < 2; half++) s[t][half] = dot4_u4s8_2(s[t][half], wl[half], xl, wh[half], xh);
            }
        }
        rows16_scale(sc, b, xb + 72 + 4 * h, xrb, T, s, acc);
    }
    rows16_store(tl, T, acc);
}

/* Q8_0 in the same form: its codes are stored + 128, as vpdpbusd takes them (AVX-VNNI:
 * the pair's c = -128 sum(x) takes the 128 back), but against int8 activations they
 * would saturate vpmaddubsw: without VNNI flipped back to int8, |w| times x with w's
 * sign (vpsignb) sums two products of at most 128 * 127 per word, exactly. */
INLINE void rows16_q8_0_tokens(const struct kern_rows16_tile *tl, const int T) {
    const size_t cb = kern_rows16_code_bytes(0), xrb = tl->xrb;
    const int64_t nb = tl->nb;
    const uint8_t *tile = tl->tile, *xa = tl->xa, *pf = tl->pf, *sc = tile + (size_t)nb * cb;
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    __m256 acc[ROWS16_TOKENS][2];
    UNROLL
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = tile + (size_t)b * cb;
        if (pf) rows16_prefetch(pf, b, nb, cb);
        const size_t h = (size_t)(b & 1);
        const uint8_t *xb = xa + (size_t)(b / 2) * KERN_PAIR_BYTES;
        __m256i s[ROWS16_TOKENS][2];
        UNROLL
        for (int t = 0; t < T; t++)
            s[t][0] = s[t][1] = KVQ_AVXVNNI ? _mm256_set1_epi32(kern_rd32(xb + (size_t)t * xrb + 64 + 4 * h))
                                            : _mm256_setzero_si256();
        UNROLL
        for (int j = 0; j < 8; j++) {
            __m256i w[2], aw[2]; /* rows 0-7, 8-15 */
            UNROLL
            for (int half = 0; half < 2; half++) {
                w[half] = _mm256_load_si256((const __m256i *)(wb + 64 * j + 32 * half));
                if (!KVQ_AVXVNNI) w[half] = _mm256_xor_si256(w[half], x80), aw[half] = _mm256_abs_epi8(w[half]);
            }
            UNROLL
            for (int t = 0; t < T; t++) {
                /* the pair layout: Q8_0 block h at 32h */
                const __m256i xv = _mm256_set1_epi32(kern_rd32(xb + (size_t)t * xrb + 32 * h + 4 * (size_t)j));
                UNROLL
                for (int half = 0; half < 2; half++)
                    s[t][half] = KVQ_AVXVNNI ? dot4_u8s8(s[t][half], w[half], xv)
                                             : dot4_u8s8(s[t][half], aw[half], _mm256_sign_epi8(xv, w[half]));
            }
        }
        rows16_scale(sc, b, xb + 72 + 4 * h, xrb, T, s, acc);
    }
    rows16_store(tl, T, acc);
}

/* A group of n tokens of a tile (kern_rows16_loop). */
KERN_UNCHECKED static void rows16_q4_0(const struct kern_rows16_tile *t, int n) {
    switch (n) {
    case 1: rows16_q4_0_tokens(t, 1); break;
    case 2: rows16_q4_0_tokens(t, 2); break;
    case 3: rows16_q4_0_tokens(t, 3); break;
    default: rows16_q4_0_tokens(t, 4); break;
    }
}

KERN_UNCHECKED static void rows16_q8_0(const struct kern_rows16_tile *t, int n) {
    switch (n) {
    case 1: rows16_q8_0_tokens(t, 1); break;
    case 2: rows16_q8_0_tokens(t, 2); break;
    case 3: rows16_q8_0_tokens(t, 3); break;
    default: rows16_q8_0_tokens(t, 4); break;
    }
}

/* ---- micro-kernels per weight type, and the driver ---------------------------- */

INLINE void tile_q8_0(const struct kern_tile *t, const int R, const int T) { tile_pairs(0, t, R, T); }
INLINE void tile_q4_0(const struct kern_tile *t, const int R, const int T) { tile_pairs(1, t, R, T); }
INLINE void tile_f32(const struct kern_tile *t, const int R, const int T) { tile_float(KVQ_F32, t, R, T); }
INLINE void tile_f16(const struct kern_tile *t, const int R, const int T) { tile_float(KVQ_F16, t, R, T); }
INLINE void tile_bf16(const struct kern_tile *t, const int R, const int T) { tile_float(KVQ_BF16, t, R, T); }

/* Software prefetch for matvec, as the AVX-512 kernels do (see there): this many 4-row
 * tiles ahead. */
#ifndef PF_TILES
#define PF_TILES 4
#endif

/* 16 ymm registers: 4 rows x 1 token or 2 rows x up to 4 tokens of accumulators. */
static const struct kern_tiling pairs_tiling = {.rows_1 = 4, .rows_n = 2, .chunk_bytes = 32768, .chunk_align = 4,
                                                .pf_tiles = PF_TILES};
static const struct kern_tiling kquant_tiling = {.rows_1 = 1, .rows_n = 1, .chunk_bytes = 32768, .chunk_align = 4,
                                                 .pf_tiles = PF_TILES};
static const struct kern_tiling float_tiling = {.rows_1 = 4, .rows_n = 2, .chunk_bytes = 65536, .chunk_align = 4,
                                                .pf_tiles = PF_TILES};

KERN_UNCHECKED void AVX2_FN(kern_matmul_avx2)(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    switch (a->wtype) {
    case KVQ_Q8_0:
        if (a->w16) kern_rows16_loop(a, r0, r1, ROWS16_TOKENS, rows16_q8_0);
        else kern_tile_loop(a, r0, r1, pairs_tiling, tile_q8_0);
        break;
    case KVQ_Q4_0:
        if (a->w16) kern_rows16_loop(a, r0, r1, ROWS16_TOKENS, rows16_q4_0);
        else kern_tile_loop(a, r0, r1, pairs_tiling, tile_q4_0);
        break;
    case KVQ_Q4_K: kern_tile_loop(a, r0, r1, kquant_tiling, tile_q4k); break;
    case KVQ_Q6_K: kern_tile_loop(a, r0, r1, kquant_tiling, tile_q6k); break;
    case KVQ_F32: kern_tile_loop(a, r0, r1, float_tiling, tile_f32); break;
    case KVQ_F16: kern_tile_loop(a, r0, r1, float_tiling, tile_f16); break;
    case KVQ_BF16: kern_tile_loop(a, r0, r1, float_tiling, tile_bf16); break;
    default: kern_matmul_scalar(a, r0, r1); break;
    }
}
