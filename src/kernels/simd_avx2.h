/* Helpers shared by the AVX2 kernel files (include only from *_avx2.c, which are
 * compiled with the AVX2/FMA/F16C flags). */
#ifndef KVQ_KERNELS_SIMD_AVX2_H
#define KVQ_KERNELS_SIMD_AVX2_H

#include <immintrin.h>

#include "kernels/inline.h"

/* KVQ_AVXVNNI 1: the file is built a second time with AVX-VNNI (matmul_avx2vnni.c),
 * its entry points named with a "vnni" suffix (AVX2_FN) and chosen where
 * kvq_cpu_avx_vnni() says so. */
#ifndef KVQ_AVXVNNI
#define KVQ_AVXVNNI 0
#endif
#if KVQ_AVXVNNI
#define AVX2_FN(name) name##vnni
#else
#define AVX2_FN(name) name
#endif

/* acc + the int32 sums of u8 x s8 products four at a time: vpdpbusd with AVX-VNNI, else
 * vpmaddubsw and vpmaddwd, the same sums where no two products leave int16 (true of
 * every caller: codes of 4 bits, or |int8|, times int8). */
INLINE __m256i dot4_u8s8(__m256i acc, __m256i u, __m256i s) {
#if KVQ_AVXVNNI
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* The same for two pairs (u, s) and (v, t) of 4-bit codes u, v: without VNNI their word
 * sums are added before vpmaddwd (at most 4 * 15 * 128 each). */
INLINE __m256i dot4_u4s8_2(__m256i acc, __m256i u, __m256i s, __m256i v, __m256i t) {
#if KVQ_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, u, s), v, t);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u, s), _mm256_maddubs_epi16(v, t));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* The horizontal sum of v. */
INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The horizontal minimum and maximum of v. */
INLINE float hmin256(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}

INLINE float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* Horizontal sums of 4 vectors: returns [sum(a), sum(b), sum(c), sum(d)]. */
INLINE __m128 reduce4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

#endif
