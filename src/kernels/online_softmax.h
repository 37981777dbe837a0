/* The online-softmax step and e^x, one of each per ISA, shared by every attention
 * kernel of that ISA: the float-row kernels (attention.c, attention_avx512.c) and
 * the packed-row ones (kv_quant.c, kv_quant_simd.inc; the AVX-512 fast path in
 * kv_quant_avx512.c does the same step for several heads side by side, with exp512).
 *
 * e^x for x <= 0: 2^n * p(r), r = x - n ln2, |r| <= ln2/2, p of degree 7 (x < -87
 * gives e^-87). The scalar step uses expf. Every step gives weight 0 below x =
 * KERN_SOFTMAX_CUT: the running maximum's weight is 1, so beneath e^-64 a term no
 * longer changes a float sum, and the packed kernels' products of a weight and a
 * row's scale (an f16, at least 6e-8) stay normal numbers: denormal ones are slow
 * (microcode assists), and a peaked softmax makes many.
 *
 * kern_softmax_step_ISA(p, n, m, l, acc, d) is one block of the online softmax of
 * one query head: p[0..n) holds the block's scores (n >= 1) and gets their weights
 * e^(p - m'), where m' = max(m, max p); when the max grows, the running sum l and
 * the accumulator acc[0..d) are first rescaled by e^(m - m') (0 when m was -inf).
 * acc may hold its d values in any order (the rescale is elementwise).
 *
 * The ISA versions are defined only where the including file is compiled for the
 * ISA (the AVX-512 and AVX2 kernel files); the scalar one everywhere. */
#ifndef KVQ_KERNELS_ONLINE_SOFTMAX_H
#define KVQ_KERNELS_ONLINE_SOFTMAX_H

#include <math.h>

#include "kernels/inline.h"

#define KERN_SOFTMAX_CUT (-64.0f)

INLINE void kern_softmax_step_scalar(float *p, int n, float *m, float *l, float *acc, int d) {
    float mx = p[0];
    for (int j = 1; j < n; j++) mx = p[j] > mx ? p[j] : mx;
    if (mx > *m) {
        const float alpha = expf(*m - mx);
        *l *= alpha;
        for (int i = 0; i < d; i++) acc[i] *= alpha;
        *m = mx;
    }
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        const float x = p[j] - *m;
        p[j] = x >= KERN_SOFTMAX_CUT ? expf(x) : 0.0f;
        sum += p[j];
    }
    *l += sum;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "kernels/simd_avx2.h"

static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.442695041f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* A softmax weight: e^x, 0 below KERN_SOFTMAX_CUT. */
static inline __m256 kern_softmax_w256(__m256 x) {
    return _mm256_and_ps(exp256(x), _mm256_cmp_ps(x, _mm256_set1_ps(KERN_SOFTMAX_CUT), _CMP_GE_OQ));
}

/* Lanes [0, k) set, k <= 8. */
INLINE __m256i kern_softmax_mask256(int k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* d a multiple of 8 (the AVX2 kernels require it). */
INLINE void kern_softmax_step_avx2(float *p, int n, float *m, float *l, float *acc, int d) {
    __m256 mxv = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) mxv = _mm256_max_ps(mxv, _mm256_loadu_ps(p + j));
    if (j < n) {
        const __m256i mk = kern_softmax_mask256(n - j);
        mxv = _mm256_max_ps(mxv, _mm256_blendv_ps(mxv, _mm256_maskload_ps(p + j, mk), _mm256_castsi256_ps(mk)));
    }
    const float mx = hmax256(mxv);
    if (mx > *m) {
        const float alpha = expf(*m - mx);
        *l *= alpha;
        const __m256 va = _mm256_set1_ps(alpha);
        for (int i = 0; i < d; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(_mm256_loadu_ps(acc + i), va));
        *m = mx;
    }
    const __m256 mv = _mm256_set1_ps(*m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = kern_softmax_w256(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
        _mm256_storeu_ps(p + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
        const __m256i mk = kern_softmax_mask256(n - j);
        const __m256 e =
            _mm256_and_ps(kern_softmax_w256(_mm256_sub_ps(_mm256_maskload_ps(p + j, mk), mv)), _mm256_castsi256_ps(mk));
        _mm256_maskstore_ps(p + j, mk, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    *l += _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695041f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* A softmax weight: e^x, 0 below KERN_SOFTMAX_CUT. */
static inline __m512 kern_softmax_w512(__m512 x) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(KERN_SOFTMAX_CUT), _CMP_GE_OQ), exp512(x));
}

INLINE __mmask16 kern_softmax_mask16(int k) { return k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << k) - 1); }

/* Any d (the tail of acc is masked). */
INLINE void kern_softmax_step_avx512(float *p, int n, float *m, float *l, float *acc, int d) {
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mk = kern_softmax_mask16(n - j);
        mxv = _mm512_mask_max_ps(mxv, mk, mxv, _mm512_maskz_loadu_ps(mk, p + j));
    }
    const float mx = _mm512_reduce_max_ps(mxv);
    if (mx > *m) {
        const float alpha = expf(*m - mx);
        *l *= alpha;
        const __m512 va = _mm512_set1_ps(alpha);
        int i = 0;
        for (; i + 16 <= d; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(_mm512_loadu_ps(acc + i), va));
        if (i < d) {
            const __mmask16 mk = kern_softmax_mask16(d - i);
            _mm512_mask_storeu_ps(acc + i, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, acc + i), va));
        }
        *m = mx;
    }
    const __m512 mv = _mm512_set1_ps(*m);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mk = kern_softmax_mask16(n - j);
        const __m512 e = _mm512_maskz_mov_ps(mk, kern_softmax_w512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, p + j), mv)));
        _mm512_mask_storeu_ps(p + j, mk, e);
        sum = _mm512_add_ps(sum, e);
    }
    *l += _mm512_reduce_add_ps(sum);
}
#endif

#endif
