/* AVX-512 (F, BW, VL, DQ, VNNI) matrix kernels. Register tiles of up to 4 weight
 * rows x 4 tokens: each weight block is loaded and unpacked once per tile and
 * multiplied with every token's activations (vpdpbusd / vpmaddubsw+vpdpwssd for
 * quantized types, vcvtph2ps + FMA for float types). */
#include "core/dtype.h"
#include "kernels/asan.h"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_tiles.h"

#include <immintrin.h>
#include <string.h>

#include "kernels/simd_avx512.h"

INLINE void store_tile(float *y, int64_t ys, int R, int T, __m512 acc[4][4]) {
    if (R == 4) {
        UNROLL
        for (int t = 0; t < T; t++) _mm_storeu_ps(y + t * ys, reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]));
    } else {
        UNROLL
        for (int t = 0; t < T; t++)
            UNROLL
            for (int r = 0; r < R; r++) y[t * ys + r] = _mm512_reduce_add_ps(acc[r][t]);
    }
}

/* ---- Q8_0 / Q4_0 weights x pair-format activations ----------------------- */

/* Software prefetch for matvec (few tokens): weights stream from L3/DRAM once per
 * token and the hardware prefetcher alone leaves the loads latency-bound. Each row
 * of a tile prefetches the same offset PF_TILES tiles ahead (rows are contiguous). */
#ifndef PF_TILES
#define PF_TILES 4
#endif

INLINE void tile_pairs(const int q4, const struct kern_tile *tl, const int R, const int T) {
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t wrb = tl->wrb, xrb = tl->xrb, pfd = tl->pfd;
    const int64_t nb = tl->k / 32, np = (nb + 1) / 2;
    const size_t bbytes = q4 ? 18 : 34;
    /* Lane maps: which block (0/1) each int32 lane of the vpdpbusd result belongs to. */
    const __m512i sidx = q4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i cidx = q4 ? _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask16 cmask = q4 ? 0x0011 : 0x0101;
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    const __m256i m4 = _mm256_set1_epi8(0x0F);

    __m512 acc[4][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();

    for (int64_t p = 0; p < np; p++) {
        const int full = 2 * p + 1 < nb;
        __m512i wv[4];
        __m512 ws[4];
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
            uint32_t dd = kern_rd16(b0);
            if (q4) {
                __m128i lo = _mm_loadu_si128((const __m128i *)(b0 + 2));
                __m128i hi = full ? _mm_loadu_si128((const __m128i *)(b0 + 20)) : _mm_setzero_si128();
                __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
                __m256i vl = _mm256_and_si256(v, m4);
                __m256i vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                wv[r] = _mm512_inserti64x4(_mm512_castsi256_si512(vl), vh, 1);
                if (full) dd |= (uint32_t)kern_rd16(b0 + 18) << 16;
            } else {
                __m256i lo = _mm256_loadu_si256((const __m256i *)(b0 + 2));
                __m256i hi = full ? _mm256_loadu_si256((const __m256i *)(b0 + 36)) : _mm256_setzero_si256();
                wv[r] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), x80);
                if (full) dd |= (uint32_t)kern_rd16(b0 + 34) << 16;
            }
            __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));
            ws[r] = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(d2));
        }
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *xp = xa + (size_t)t * xrb + (size_t)p * KERN_PAIR_BYTES;
            __m512i xv = _mm512_loadu_si512((const void *)xp);
            __m512i c = _mm512_maskz_permutexvar_epi32(
                cmask, cidx, _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i *)(xp + 64))));
            __m512 xs = _mm512_permutexvar_ps(
                sidx, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(xp + 72)))));
            UNROLL
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpbusd_epi32(c, wv[r], xv);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], xs), acc[r][t]);
            }
        }
    }
    store_tile(tl->y, tl->ys, R, T, acc);
}

/* ---- Q4_K / Q6_K weights x Q8_K-format activations ------------------------ */

INLINE void tile_q4k(const struct kern_tile *tl, const int R, const int T) {
    (void)R; /* one row */
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t xrb = tl->xrb, pfd = tl->pfd;
    const int64_t nsb = tl->k / 256, ys = tl->ys;
    float *y = tl->y;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m512 acc[4];
    __m256 macc[4];
    UNROLL
    for (int t = 0; t < T; t++) {
        acc[t] = _mm512_setzero_ps();
        macc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; b++, w += 144) {
        if (pfd) {
            _mm_prefetch((const char *)w + pfd, _MM_HINT_T0);
            _mm_prefetch((const char *)w + pfd + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)w + pfd + 128, _MM_HINT_T0);
        }
        /* 6-bit scales/mins of the 8 sub-blocks (see kern_q4k_scale_min), unpacked
         * in general registers: bytes 0-3 scales 0-3 (+ top bits of 4-7), 4-7 mins
         * 0-3 (+ top bits), 8-11 low nibbles: scales 4-7, high nibbles: mins 4-7 */
        uint32_t u0, u1, u2;
        memcpy(&u0, w + 4, 4);
        memcpy(&u1, w + 8, 4);
        memcpy(&u2, w + 12, 4);
        const uint64_t sc8 = (uint64_t)(u0 & 0x3f3f3f3fu) |
                             (uint64_t)((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
        const uint64_t mn8 = (uint64_t)(u1 & 0x3f3f3f3fu) |
                             (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
        __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
        __m256i mn16 = _mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
        mn16 = _mm256_permutexvar_epi16(_mm256_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), mn16);
        __m512i wv[4], sv[4];
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
            __m256i vl = _mm256_and_si256(v, m4);
            __m256i vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            wv[c] = _mm512_inserti64x4(_mm512_castsi256_si512(vl), vh, 1);
            __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(2 * c))),
                                             _mm256_set1_epi16((short)(2 * c + 1)), 1);
            sv[c] = _mm512_permutexvar_epi16(idx, sc16);
        }
        const float d = _cvtsh_ss(kern_rd16(w)), dmin = _cvtsh_ss(kern_rd16(w + 2));
        UNROLL
        for (int t = 0; t < T; t++) {
            const struct kern_q8k *xb = (const struct kern_q8k *)(xa + (size_t)t * xrb) + b;
            __m512i ia = _mm512_setzero_si512();
            UNROLL
            for (int c = 0; c < 4; c++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xb->q + 64 * c));
                ia = _mm512_dpwssd_epi32(ia, _mm512_maddubs_epi16(wv[c], xv), sv[c]);
            }
            __m256i mm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), mn16);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(d * xb->d), acc[t]);
            macc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(-dmin * xb->d), macc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++)
        y[t * ys] = _mm512_reduce_add_ps(acc[t]) + _mm512_reduce_add_ps(_mm512_zextps256_ps512(macc[t]));
}

INLINE void tile_q6k(const struct kern_tile *tl, const int R, const int T) {
    (void)R; /* one row */
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t xrb = tl->xrb, pfd = tl->pfd;
    const int64_t nsb = tl->k / 256, ys = tl->ys;
    float *y = tl->y;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    __m512 acc[4];
    __m256 cacc[4];
    UNROLL
    for (int t = 0; t < T; t++) {
        acc[t] = _mm512_setzero_ps();
        cacc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nsb; b++, w += 210) {
        if (pfd) {
            _mm_prefetch((const char *)w + pfd, _MM_HINT_T0);
            _mm_prefetch((const char *)w + pfd + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)w + pfd + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)w + pfd + 192, _MM_HINT_T0);
        }
        __m256i sc16y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        __m512i sc16 = _mm512_castsi256_si512(sc16y);
        __m512i wv[4], sv[4];
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m512i ql = _mm512_loadu_si512((const void *)(w + 64 * h));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            __m512i H = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_slli_epi16(H, 4), m30));
            wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_and_si512(H, m30));
        }
        UNROLL
        for (int g = 0; g < 4; g++) {
            /* int16 lane i of group g covers values 64g+2i, +1: sub-block 4g + i/8 */
            __m512i idx = _mm512_add_epi16(
                _mm512_set1_epi16((short)(4 * g)),
                _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0,
                                 0, 0, 0, 0));
            sv[g] = _mm512_permutexvar_epi16(idx, sc16);
        }
        const float d = _cvtsh_ss(kern_rd16(w + 208));
        UNROLL
        for (int t = 0; t < T; t++) {
            const struct kern_q8k *xb = (const struct kern_q8k *)(xa + (size_t)t * xrb) + b;
            __m512i ia = _mm512_setzero_si512();
            UNROLL
            for (int g = 0; g < 4; g++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xb->q + 64 * g));
                ia = _mm512_dpwssd_epi32(ia, _mm512_maddubs_epi16(wv[g], xv), sv[g]);
            }
            __m256i cm = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), sc16y);
            const float dd = d * xb->d;
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_set1_ps(dd), acc[t]);
            cacc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cm), _mm256_set1_ps(-32.0f * dd), cacc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++)
        y[t * ys] = _mm512_reduce_add_ps(acc[t]) + _mm512_reduce_add_ps(_mm512_zextps256_ps512(cacc[t]));
}

/* ---- F32 / F16 / BF16 weights x f32 activations --------------------------- */

INLINE __m512 load_w16(uint32_t wtype, const uint8_t *p, __mmask16 m) {
    switch (wtype) {
    case KVQ_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    case KVQ_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    default: return _mm512_maskz_loadu_ps(m, p);
    }
}

INLINE void tile_float(const uint32_t wtype, const struct kern_tile *tl, const int R, const int T) {
    const uint8_t *w = tl->w, *xa = tl->xa;
    const size_t wrb = tl->wrb, xrb = tl->xrb, pfd = tl->pfd;
    const int64_t k = tl->k;
    const size_t es = wtype == KVQ_F32 ? 4 : 2;
    __m512 acc[4][4];
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        if (pfd && (i * (int64_t)es) % 64 == 0) {
            UNROLL
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)w + (size_t)r * wrb + (size_t)i * es + pfd, _MM_HINT_T0);
        }
        __m512 wv[4];
        UNROLL
        for (int r = 0; r < R; r++) wv[r] = load_w16(wtype, w + (size_t)r * wrb + (size_t)i * es, 0xFFFF);
        UNROLL
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_loadu_ps((const float *)(xa + (size_t)t * xrb) + i);
            UNROLL
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    if (i < k) {
        __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
        __m512 wv[4];
        UNROLL
        for (int r = 0; r < R; r++) wv[r] = load_w16(wtype, w + (size_t)r * wrb + (size_t)i * es, m);
        UNROLL
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, (const float *)(xa + (size_t)t * xrb) + i);
            UNROLL
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    store_tile(tl->y, tl->ys, R, T, acc);
}

/* ---- activation preparation ------------------------------------------------ */

/* 16 values -> int8 (round to nearest even, as the scalar code); returns their sum.
 * NaN lanes become 0 and the rest is clamped to +-127 like the scalar q8_code: an
 * unclamped NaN or inf converts to INT_MIN and overflows the sum. */
INLINE int32_t quant16(__m512 x, __m512 id, int8_t *dst) {
    __m512 v = _mm512_mul_ps(x, id);
    v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    __m512i q = _mm512_cvtps_epi32(v);
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(q));
    return _mm512_reduce_add_epi32(q);
}

int kern_act_prepare_avx512(uint32_t wtype, const float *x, void *dst, int64_t k) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    if (wtype == KVQ_Q8_0 || wtype == KVQ_Q4_0) {
        const int q4 = wtype == KVQ_Q4_0;
        const int64_t nb = k / 32, np = (nb + 1) / 2;
        struct kern_pair *o = dst;
        for (int64_t p = 0; p < np; p++, o++) {
            if (2 * p + 1 >= nb) memset(o, 0, sizeof *o);
            for (int h = 0; h < 2 && 2 * p + h < nb; h++) {
                const float *xb = x + (2 * p + h) * 32;
                __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
                float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, absmask), _mm512_and_ps(b, absmask)));
                float id = amax > 0.0f ? 127.0f / amax : 0.0f;
                __m512 idv = _mm512_set1_ps(id);
                int8_t *q0 = q4 ? o->q + 16 * h : o->q + 32 * h;
                int8_t *q1 = q4 ? o->q + 32 + 16 * h : o->q + 32 * h + 16;
                int32_t sum = quant16(a, idv, q0) + quant16(b, idv, q1);
                o->d[h] = amax / 127.0f;
                o->c[h] = (q4 ? -8 : -128) * sum;
            }
        }
        return 1;
    }
    if (wtype == KVQ_Q4_K || wtype == KVQ_Q6_K) {
        struct kern_q8k *o = dst;
        for (int64_t b = 0; b < k / 256; b++, o++) {
            const float *xb = x + b * 256;
            __m512 m = _mm512_setzero_ps();
            for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_and_ps(_mm512_loadu_ps(xb + i), absmask));
            float amax = _mm512_reduce_max_ps(m);
            __m512 idv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            o->d = amax / 127.0f;
            for (int g = 0; g < 16; g++) o->bsums[g] = (int16_t)quant16(_mm512_loadu_ps(xb + 16 * g), idv, o->q + 16 * g);
            o->pad = 0;
        }
        return 1;
    }
    return 0;
}

/* ---- Q8_0 / Q4_0 weights in 16-row form (matmul.h) ------------------------ */

/* Tokens per pass over a tile's blocks: one accumulator of 16 rows each. */
#define ROWS16_TOKENS 8

/* One token group of a tile (matmul_tiles.h); the next tile is prefetched a block
 * at a time: weights come from DRAM when attention's KV rows have pushed them out
 * of L3. */
INLINE void rows16_tokens(const int q4, const struct kern_rows16_tile *tl, const int T) {
    const size_t cb = kern_rows16_code_bytes(q4), xrb = tl->xrb;
    const int64_t nb = tl->nb;
    const uint8_t *const tile = tl->tile, *const xa = tl->xa, *const pf = tl->pf, *const sc = tile + (size_t)nb * cb;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS16_TOKENS];
    UNROLL
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = tile + (size_t)b * cb;
        if (pf) { /* the next tile's block b */
            for (size_t o = 0; o < cb; o += 64) _mm_prefetch((const char *)pf + (size_t)b * cb + o, _MM_HINT_T0);
            _mm_prefetch((const char *)pf + (size_t)nb * cb + 32 * (size_t)b, _MM_HINT_T0);
        }
        __m512i w[8];
        if (q4) {
            UNROLL
            for (int j = 0; j < 4; j++) {
                const __m512i z = _mm512_load_si512((const void *)(wb + 64 * j));
                w[j] = _mm512_and_si512(z, m4);
                w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            }
        } else {
            UNROLL
            for (int j = 0; j < 8; j++) w[j] = _mm512_load_si512((const void *)(wb + 64 * j));
        }
        const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32 * b)));
        const size_t h = (size_t)(b & 1);
        const uint8_t *xb = xa + (size_t)(b / 2) * KERN_PAIR_BYTES;
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *xp = xb + (size_t)t * xrb;
            /* two chains for latency; integer sums are exact in any order */
            __m512i s0 = _mm512_set1_epi32(kern_rd32(xp + 64 + 4 * h)), s1 = _mm512_setzero_si512();
            UNROLL
            for (int j = 0; j < 8; j++) {
                /* the pair layout: Q8_0 block h at 32h; Q4_0 values 0-15 at 16h, 16-31 at 32 + 16h */
                const size_t off = q4 ? (j < 4 ? 16 * h + 4 * (size_t)j : 32 + 16 * h + 4 * (size_t)(j - 4))
                                      : 32 * h + 4 * (size_t)j;
                const __m512i xv = _mm512_set1_epi32(kern_rd32(xp + off));
                if (j & 1) s1 = _mm512_dpbusd_epi32(s1, w[j], xv);
                else s0 = _mm512_dpbusd_epi32(s0, w[j], xv);
            }
            float dx;
            memcpy(&dx, xp + 72 + 4 * h, 4);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(ws, _mm512_set1_ps(dx)),
                                     acc[t]);
        }
    }
    float *const y = tl->y;
    const int64_t ys = tl->ys;
    const __mmask16 m = (__mmask16)((0xFFFFu >> (16 - tl->hi)) & (0xFFFFu << tl->lo));
    UNROLL
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(y + t * ys, m, acc[t]);
}

/* A group of n tokens of a tile (kern_rows16_loop). */
#define ROWS16_CASES(q4)                                                       \
    switch (n) {                                                               \
    case 1: rows16_tokens(q4, t, 1); break;                                    \
    case 2: rows16_tokens(q4, t, 2); break;                                    \
    case 3: rows16_tokens(q4, t, 3); break;                                    \
    case 4: rows16_tokens(q4, t, 4); break;                                    \
    case 5: rows16_tokens(q4, t, 5); break;                                    \
    case 6: rows16_tokens(q4, t, 6); break;                                    \
    case 7: rows16_tokens(q4, t, 7); break;                                    \
    default: rows16_tokens(q4, t, 8); break;                                   \
    }
KERN_UNCHECKED static void rows16_q8_0(const struct kern_rows16_tile *t, int n) { ROWS16_CASES(0) }
KERN_UNCHECKED static void rows16_q4_0(const struct kern_rows16_tile *t, int n) { ROWS16_CASES(1) }
#undef ROWS16_CASES

/* ---- micro-kernels per weight type, and the driver ---------------------------- */

INLINE void tile_q8_0(const struct kern_tile *t, const int R, const int T) { tile_pairs(0, t, R, T); }
INLINE void tile_q4_0(const struct kern_tile *t, const int R, const int T) { tile_pairs(1, t, R, T); }
INLINE void tile_f32(const struct kern_tile *t, const int R, const int T) { tile_float(KVQ_F32, t, R, T); }
INLINE void tile_f16(const struct kern_tile *t, const int R, const int T) { tile_float(KVQ_F16, t, R, T); }
INLINE void tile_bf16(const struct kern_tile *t, const int R, const int T) { tile_float(KVQ_BF16, t, R, T); }

/* 32 zmm registers: 4 rows x 4 tokens of accumulators. Matvec prefetches PF_TILES
 * 4-row tiles ahead (the K-quant kernels, one row per tile, the same distance). */
static const struct kern_tiling pairs_tiling = {.rows_1 = 4, .rows_n = 4, .chunk_bytes = 32768, .chunk_align = 4,
                                                .pf_tiles = PF_TILES};
static const struct kern_tiling kquant_tiling = {.rows_1 = 1, .rows_n = 1, .chunk_bytes = 32768, .chunk_align = 1,
                                                 .pf_tiles = PF_TILES};
static const struct kern_tiling float_tiling = {.rows_1 = 4, .rows_n = 4, .chunk_bytes = 65536, .chunk_align = 4,
                                                .pf_tiles = PF_TILES};

KERN_UNCHECKED void kern_matmul_avx512(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
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
