/* AVX2 online-softmax attention over f16 or f32 K/V rows (head size a multiple of
 * 8; attention.c sends the others to the scalar kernel). */
#include "kernels/matmul_impl.h"
#include "kernels/asan.h"

#include <immintrin.h>

#include "kernels/online_softmax.h"
#include "kernels/simd_avx2.h"

#define VL 8
#define VF __m256
#define VZERO _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA _mm256_fmadd_ps
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VROW(base, off, f16)                                                                                  \
    ((f16) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(base) + (off))))            \
           : _mm256_loadu_ps((const float *)(base) + (off)))
#define VSUM4 reduce4_256
#define VACC_CG 4 /* 2 heads x 4 vectors + 4 row vectors of 16 registers */
#define SOFTMAX_STEP kern_softmax_step_avx2
#define FN(x) x##_avx2
#include "kernels/attention_simd.inc"
