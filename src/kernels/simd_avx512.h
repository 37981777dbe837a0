/* Helpers shared by the AVX-512 kernel files (include only from *_avx512.c, which
 * are compiled with the AVX-512 flags). */
#ifndef KVQ_KERNELS_SIMD_AVX512_H
#define KVQ_KERNELS_SIMD_AVX512_H

#include <immintrin.h>

#include "kernels/inline.h"

/* Horizontal sums of 4 vectors: returns [sum(a), sum(b), sum(c), sum(d)]. */
INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#endif
