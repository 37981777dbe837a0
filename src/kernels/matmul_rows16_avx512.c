/* AVX-512 VNNI product of Q8_0 / Q4_0 weights with several tokens, 16 weight rows
 * at a time. The row-major tiles (matmul_avx512.c) spend four vector operations per
 * 64 products of one row and token: vpdpbusd, then converting its lanes, the scale
 * product and the accumulation, all per row. Here the 16 rows' codes of a block are
 * transposed once so that one vector holds 4 consecutive codes of each row: a token's
 * block is then 8 vpdpbusd against its broadcast activations, giving the 16 rows' block
 * sums in one vector, and one conversion, multiply and FMA for all 16 rows. The
 * transposition is paid once per block for every token. Same arithmetic as the
 * row-major kernels (exact int32 block sums, then scale). */
#include "core/dtype.h"
#include "kernels/matmul_impl.h"

#include <immintrin.h>

#include "kernels/inline.h"

#define SLICE 16 /* blocks transposed at a time (9 KB: stays in L1 while the tokens use it) */
#define TG 8     /* tokens per pass over a slice: 8 int32 and 8 float accumulators */
#define PF_BLOCKS 16 /* software prefetch distance in blocks (16 rows stream at once) */

/* Blocks [b0, b0 + nb) of 16 rows at w: pw[b][k] = bytes 4k..4k+3 of each row's block b
 * (unsigned: Q8_0 codes + 128, Q4_0 codes as they are), ps[b] = the rows' scales.
 * Prefetches PF_BLOCKS ahead in the rows' nbt blocks, then into the next 16 rows (wnext,
 * NULL when none): from L3/DRAM the 16 streams are latency-bound otherwise. */
INLINE void pack16(const int q4, const uint8_t *w, const uint8_t *wnext, size_t wrb, int64_t nbt, int64_t b0, int nb,
                   __m512i pw[][8], __m512 *ps) {
    const size_t bb = q4 ? 18 : 34;
    const __m512i offs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)wrb));
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = w + (size_t)(b0 + b) * bb;
        const int64_t pb = b0 + b + PF_BLOCKS;
        const uint8_t *pf = pb < nbt ? w + (size_t)pb * bb : wnext ? wnext + (size_t)(pb - nbt) * bb : NULL;
        if (pf)
            for (int r = 0; r < 16; r++) _mm_prefetch((const char *)pf + (size_t)r * wrb, _MM_HINT_T0);
        /* the f16 scale is the low half of the dword at the block's start */
        const __m512i dd = _mm512_i32gather_epi32(offs, (const void *)p, 1);
        ps[b] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
        __m512i *o = pw[b];
        if (q4) {
            /* z[i]: rows i, i+4, i+8, i+12 (16 code bytes each, one per 128-bit lane) */
            __m512i lo[4], hi[4];
            UNROLL
            for (int i = 0; i < 4; i++) {
                __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + (size_t)i * wrb + 2)));
                z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p + (size_t)(i + 4) * wrb + 2)), 1);
                z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p + (size_t)(i + 8) * wrb + 2)), 2);
                z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(p + (size_t)(i + 12) * wrb + 2)), 3);
                lo[i] = _mm512_and_si512(z, _mm512_set1_epi8(15));
                hi[i] = _mm512_and_si512(_mm512_srli_epi16(z, 4), _mm512_set1_epi8(15));
            }
            /* 4x4 dword transposes in every 128-bit lane: lane L ends with rows 4L..4L+3 */
            UNROLL
            for (int h = 0; h < 2; h++) {
                const __m512i *s = h ? hi : lo;
                const __m512i a0 = _mm512_unpacklo_epi32(s[0], s[1]), a1 = _mm512_unpackhi_epi32(s[0], s[1]);
                const __m512i a2 = _mm512_unpacklo_epi32(s[2], s[3]), a3 = _mm512_unpackhi_epi32(s[2], s[3]);
                o[4 * h + 0] = _mm512_unpacklo_epi64(a0, a2);
                o[4 * h + 1] = _mm512_unpackhi_epi64(a0, a2);
                o[4 * h + 2] = _mm512_unpacklo_epi64(a1, a3);
                o[4 * h + 3] = _mm512_unpackhi_epi64(a1, a3);
            }
        } else {
            /* z[i]: rows i (low half) and i+8 (high half), 32 codes each */
            __m512i z[8], t[8], u[8];
            UNROLL
            for (int i = 0; i < 8; i++)
                z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + (size_t)i * wrb + 2))),
                                          _mm256_loadu_si256((const __m256i *)(p + (size_t)(i + 8) * wrb + 2)), 1);
            UNROLL
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
                t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
            }
            /* u[4g + j]: dwords j (lanes 0, 2) and j + 4 (lanes 1, 3) of rows 4g..4g+3 (+8) */
            UNROLL
            for (int g = 0; g < 2; g++) {
                u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
                u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
                u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
                u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
            }
            const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
            const __m512i x80 = _mm512_set1_epi8((char)0x80);
            UNROLL
            for (int j = 0; j < 4; j++) {
                o[j] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[j], lo, u[4 + j]), x80);
                o[j + 4] = _mm512_xor_si512(_mm512_permutex2var_epi64(u[j], hi, u[4 + j]), x80);
            }
        }
    }
}

/* y[t][16 rows] (+)= the slice's products for T tokens from xa. */
INLINE void tokens16(const int q4, const int T, __m512i pw[][8], const __m512 *ps, int64_t b0, int nb,
                     const uint8_t *xa, size_t xrb, float *y, int64_t ys, int first) {
    __m512 acc[TG];
    UNROLL
    for (int t = 0; t < T; t++) acc[t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + t * ys);
    for (int b = 0; b < nb; b++) {
        const int64_t bi = b0 + b;
        const size_t xo = (size_t)(bi / 2) * KERN_PAIR_BYTES, h = (size_t)(bi % 2);
        __m512i w[8];
        UNROLL
        for (int k = 0; k < 8; k++) w[k] = pw[b][k];
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *xp = xa + (size_t)t * xrb + xo;
            int32_t c;
            float dx;
            memcpy(&c, xp + 64 + 4 * h, 4);
            memcpy(&dx, xp + 72 + 4 * h, 4);
            __m512i s = _mm512_set1_epi32(c);
            UNROLL
            for (int k = 0; k < 8; k++) {
                /* the pair layout: Q8_0 block h at 32h; Q4_0 values 0-15 at 16h, 16-31 at 32 + 16h */
                const size_t off = q4 ? (k < 4 ? 16 * h + 4 * (size_t)k : 32 + 16 * h + 4 * (size_t)(k - 4)) : 32 * h + 4 * (size_t)k;
                int32_t xq;
                memcpy(&xq, xp + off, 4);
                s = _mm512_dpbusd_epi32(s, w[k], _mm512_set1_epi32(xq));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ps[b], _mm512_set1_ps(dx)), acc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + t * ys, acc[t]);
}

static void rows16(const int q4, const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    const int64_t nb = a->k / 32;
    const size_t wrb = a->w_row_bytes, xrb = a->xa_row_bytes;
    __m512i pw[SLICE][8];
    __m512 ps[SLICE];
    for (int64_t r = r0; r + 16 <= r1; r += 16) {
        const uint8_t *w = (const uint8_t *)a->w + (size_t)r * wrb;
        for (int64_t b0 = 0; b0 < nb; b0 += SLICE) {
            const int n = nb - b0 < SLICE ? (int)(nb - b0) : SLICE;
            pack16(q4, w, r + 32 <= r1 ? w + 16 * wrb : NULL, wrb, nb, b0, n, pw, ps);
            for (int t0 = 0; t0 < a->n_tok; t0 += TG) {
                const uint8_t *xa = (const uint8_t *)a->xa + (size_t)t0 * xrb;
                float *y = a->y + t0 * a->y_stride + r;
                switch (a->n_tok - t0 < TG ? a->n_tok - t0 : TG) {
                case 1: tokens16(q4, 1, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                case 2: tokens16(q4, 2, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                case 3: tokens16(q4, 3, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                case 4: tokens16(q4, 4, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                case 5: tokens16(q4, 5, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                case 6: tokens16(q4, 6, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                case 7: tokens16(q4, 7, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                default: tokens16(q4, 8, pw, ps, b0, n, xa, xrb, y, a->y_stride, b0 == 0); break;
                }
            }
        }
    }
}

int64_t kern_matmul_rows16_avx512(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    const int64_t re = r0 + (r1 - r0) / 16 * 16;
    if (re > r0) rows16(a->wtype == KVQ_Q4_0, a, r0, re);
    return re;
}
