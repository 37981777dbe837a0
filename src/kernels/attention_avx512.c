/* AVX-512 online-softmax attention over f16 (F16C) or f32 K/V rows. Rows are
 * processed in blocks of KERN_ATTN_BLOCK: scores for all heads of the group
 * (each key row read once), one max/rescale per block, then each value row is
 * read once and accumulated into every head. */
#include "kernels/matmul_impl.h"

#include <immintrin.h>
#include <math.h>

#include "kernels/simd_avx512.h"
#include "kernels/online_softmax.h"

INLINE __m512 load_row(const void *base, size_t off, int f16, __mmask16 m) {
    if (f16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + off));
    return _mm512_maskz_loadu_ps(m, (const float *)base + off);
}

/* Scores of NH heads x RJ rows (NH * RJ == 4) into sc[h][j]. */
INLINE void scores4(const int NH, const int RJ, const float *q, int d, const void *k, size_t k_stride, int f16,
                    int j0, int j, int h, float sc[][KERN_ATTN_BLOCK]) {
    __m512 a[4];
    UNROLL
    for (int i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
        __mmask16 m = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
        UNROLL
        for (int jj = 0; jj < RJ; jj++) {
            __m512 kv = load_row(k, (size_t)(j0 + j + jj) * k_stride + (size_t)c, f16, m);
            UNROLL
            for (int hh = 0; hh < NH; hh++)
                a[jj * NH + hh] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + (size_t)(h + hh) * d + c), kv,
                                                  a[jj * NH + hh]);
        }
    }
    float r[4];
    _mm_storeu_ps(r, reduce4(a[0], a[1], a[2], a[3]));
    UNROLL
    for (int jj = 0; jj < RJ; jj++)
        UNROLL
        for (int hh = 0; hh < NH; hh++) sc[h + hh][j + jj] = r[jj * NH + hh];
}

INLINE void score1(const float *q, int d, const void *k, size_t k_stride, int f16, int j0, int j, int h,
                   float sc[][KERN_ATTN_BLOCK]) {
    __m512 a = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
        __mmask16 m = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + (size_t)h * d + c),
                            load_row(k, (size_t)(j0 + j) * k_stride + (size_t)c, f16, m), a);
    }
    sc[h][j] = _mm512_reduce_add_ps(a);
}

/* acc[h][c..c+16) += sum_j p[h][j] * v[j][c..c+16) for NH heads. */
INLINE void vacc(const int NH, float *acc, int d, const void *v, size_t v_stride, int f16, int j0, int nj, int h,
                 float sc[][KERN_ATTN_BLOCK]) {
    for (int c = 0; c < d; c += 16) {
        __mmask16 m = d - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - c)) - 1);
        __m512 a[8];
        UNROLL
        for (int hh = 0; hh < NH; hh++) a[hh] = _mm512_maskz_loadu_ps(m, acc + (size_t)(h + hh) * d + c);
        for (int j = 0; j < nj; j++) {
            __m512 vv = load_row(v, (size_t)(j0 + j) * v_stride + (size_t)c, f16, m);
            UNROLL
            for (int hh = 0; hh < NH; hh++) a[hh] = _mm512_fmadd_ps(_mm512_set1_ps(sc[h + hh][j]), vv, a[hh]);
        }
        UNROLL
        for (int hh = 0; hh < NH; hh++) _mm512_mask_storeu_ps(acc + (size_t)(h + hh) * d + c, m, a[hh]);
    }
}

/* ---- fast path: head_dim a multiple of 16 (full-width loads), up to 256 ---- */

/* Rows ahead for the K prefetch: a few KB, enough to cover DRAM latency. */
#define PF_ROWS 16

INLINE void prefetch_row(const void *base, size_t off_elems, int es, int d) {
    const char *p = (const char *)base + off_elems * (size_t)es;
    for (int b = 0; b < d * es; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

INLINE __m512 load16(const void *base, size_t off, int f16) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    return _mm512_loadu_ps((const float *)base + off);
}

/* Scores of NH heads x RJ rows (NH * RJ == 4 or 8), independent accumulators.
 * Prefetches K rows PF_ROWS ahead and this block's V rows (read right after). */
INLINE void scores_full(const int NH, const int RJ, const float *q, int d, const void *k, size_t k_stride,
                        const void *v, size_t v_stride, int f16, int j0, int j, int h, float sc[][KERN_ATTN_BLOCK]) {
    const int es = f16 ? 2 : 4;
    UNROLL
    for (int jj = 0; jj < RJ; jj++) {
        prefetch_row(k, (size_t)(j0 + j + jj + PF_ROWS) * k_stride, es, d);
        if (h == 0) prefetch_row(v, (size_t)(j0 + j + jj) * v_stride, es, d);
    }
    __m512 a[8];
    UNROLL
    for (int i = 0; i < NH * RJ; i++) a[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
        __m512 qv[4];
        UNROLL
        for (int hh = 0; hh < NH; hh++) qv[hh] = _mm512_loadu_ps(q + (size_t)(h + hh) * d + c);
        UNROLL
        for (int jj = 0; jj < RJ; jj++) {
            __m512 kv = load16(k, (size_t)(j0 + j + jj) * k_stride + (size_t)c, f16);
            UNROLL
            for (int hh = 0; hh < NH; hh++) a[jj * NH + hh] = _mm512_fmadd_ps(qv[hh], kv, a[jj * NH + hh]);
        }
    }
    UNROLL
    for (int g = 0; g < NH * RJ; g += 4) {
        float r[4];
        _mm_storeu_ps(r, reduce4(a[g], a[g + 1], a[g + 2], a[g + 3]));
        UNROLL
        for (int i = 0; i < 4; i++) sc[h + (g + i) % NH][j + (g + i) / NH] = r[i];
    }
}

/* acc[h][c0 .. c0+16*CG) += sum_j p[h][j] * v[j][...] for NH heads: rows are read
 * in order with all CG*NH accumulators in registers. */
INLINE void vacc_full(const int NH, const int CG, float *acc, int d, int c0, const void *v, size_t v_stride,
                      int f16, int j0, int nj, int h, float sc[][KERN_ATTN_BLOCK]) {
    __m512 a[16];
    UNROLL
    for (int hh = 0; hh < NH; hh++)
        UNROLL
        for (int cc = 0; cc < CG; cc++) a[hh * CG + cc] = _mm512_loadu_ps(acc + (size_t)(h + hh) * d + c0 + 16 * cc);
    for (int j = 0; j < nj; j++) {
        __m512 vv[8];
        UNROLL
        for (int cc = 0; cc < CG; cc++) vv[cc] = load16(v, (size_t)(j0 + j) * v_stride + (size_t)(c0 + 16 * cc), f16);
        UNROLL
        for (int hh = 0; hh < NH; hh++) {
            const __m512 p = _mm512_set1_ps(sc[h + hh][j]);
            UNROLL
            for (int cc = 0; cc < CG; cc++) a[hh * CG + cc] = _mm512_fmadd_ps(p, vv[cc], a[hh * CG + cc]);
        }
    }
    UNROLL
    for (int hh = 0; hh < NH; hh++)
        UNROLL
        for (int cc = 0; cc < CG; cc++) _mm512_storeu_ps(acc + (size_t)(h + hh) * d + c0 + 16 * cc, a[hh * CG + cc]);
}

/* All heads of the group over d, in passes of at most 16 accumulators. */
static void vacc_all(float *acc, int d, int nh, const void *v, size_t v_stride, int f16, int j0, int nj,
                     float sc[][KERN_ATTN_BLOCK]) {
    int h = 0;
    for (; h + 2 <= nh; h += 2) {
        int c = 0;
        for (; c + 128 <= d; c += 128) vacc_full(2, 8, acc, d, c, v, v_stride, f16, j0, nj, h, sc);
        for (; c < d; c += 16) vacc_full(2, 1, acc, d, c, v, v_stride, f16, j0, nj, h, sc);
    }
    if (h < nh) {
        int c = 0;
        for (; c + 128 <= d; c += 128) vacc_full(1, 8, acc, d, c, v, v_stride, f16, j0, nj, h, sc);
        for (; c < d; c += 16) vacc_full(1, 1, acc, d, c, v, v_stride, f16, j0, nj, h, sc);
    }
}

static void scores_all(const float *q, int d, int nh, const void *k, size_t k_stride, const void *v,
                       size_t v_stride, int f16, int j0, int nj, float sc[][KERN_ATTN_BLOCK]) {
    int h = 0;
    for (; h + 4 <= nh; h += 4) {
        int j = 0;
        for (; j + 2 <= nj; j += 2) scores_full(4, 2, q, d, k, k_stride, v, v_stride, f16, j0, j, h, sc);
        for (; j < nj; j++) scores_full(4, 1, q, d, k, k_stride, v, v_stride, f16, j0, j, h, sc);
    }
    if (h + 2 <= nh) {
        int j = 0;
        for (; j + 4 <= nj; j += 4) scores_full(2, 4, q, d, k, k_stride, v, v_stride, f16, j0, j, h, sc);
        for (; j + 2 <= nj; j += 2) scores_full(2, 2, q, d, k, k_stride, v, v_stride, f16, j0, j, h, sc);
        for (; j < nj; j++) {
            score1(q, d, k, k_stride, f16, j0, j, h, sc);
            score1(q, d, k, k_stride, f16, j0, j, h + 1, sc);
        }
        h += 2;
    }
    if (h < nh) {
        int j = 0;
        for (; j + 8 <= nj; j += 8) scores_full(1, 8, q, d, k, k_stride, v, v_stride, f16, j0, j, h, sc);
        for (; j + 4 <= nj; j += 4) scores_full(1, 4, q, d, k, k_stride, v, v_stride, f16, j0, j, h, sc);
        for (; j < nj; j++) score1(q, d, k, k_stride, f16, j0, j, h, sc);
    }
}

void kern_attn_accumulate_avx512(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                                 const void *v, size_t v_stride, int elem_bits, int n) {
    const int d = s->d, f16 = elem_bits == 16;
    float sc[KERN_ATTN_MAX_GROUP][KERN_ATTN_BLOCK];
    for (int g0 = 0; g0 < s->n_q; g0 += KERN_ATTN_MAX_GROUP) {
        const int nh = s->n_q - g0 < KERN_ATTN_MAX_GROUP ? s->n_q - g0 : KERN_ATTN_MAX_GROUP;
        const float *qg = q + (size_t)g0 * d;
        float *accg = s->acc + (size_t)g0 * d;
        for (int j0 = 0; j0 < n; j0 += KERN_ATTN_BLOCK) {
            const int nj = n - j0 < KERN_ATTN_BLOCK ? n - j0 : KERN_ATTN_BLOCK;
            const int full = d % 16 == 0;
            /* scores */
            int h = 0;
            if (full) {
                scores_all(qg, d, nh, k, k_stride, v, v_stride, f16, j0, nj, sc);
                h = nh;
            }
            for (; h + 4 <= nh; h += 4)
                for (int j = 0; j < nj; j++) scores4(4, 1, qg, d, k, k_stride, f16, j0, j, h, sc);
            if (h + 2 <= nh) {
                int j = 0;
                for (; j + 2 <= nj; j += 2) scores4(2, 2, qg, d, k, k_stride, f16, j0, j, h, sc);
                for (; j < nj; j++) {
                    score1(qg, d, k, k_stride, f16, j0, j, h, sc);
                    score1(qg, d, k, k_stride, f16, j0, j, h + 1, sc);
                }
                h += 2;
            }
            if (h < nh) {
                int j = 0;
                for (; j + 4 <= nj; j += 4) scores4(1, 4, qg, d, k, k_stride, f16, j0, j, h, sc);
                for (; j < nj; j++) score1(qg, d, k, k_stride, f16, j0, j, h, sc);
            }
            for (h = 0; h < nh; h++)
                kern_softmax_step_avx512(sc[h], nj, &s->m[g0 + h], &s->l[g0 + h], accg + (size_t)h * d, d);
            /* values */
            if (full) {
                vacc_all(accg, d, nh, v, v_stride, f16, j0, nj, sc);
                continue;
            }
            h = 0;
            for (; h + 8 <= nh; h += 8) vacc(8, accg, d, v, v_stride, f16, j0, nj, h, sc);
            switch (nh - h) {
            case 7: vacc(7, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            case 6: vacc(6, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            case 5: vacc(5, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            case 4: vacc(4, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            case 3: vacc(3, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            case 2: vacc(2, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            case 1: vacc(1, accg, d, v, v_stride, f16, j0, nj, h, sc); break;
            default: break;
            }
        }
    }
}
