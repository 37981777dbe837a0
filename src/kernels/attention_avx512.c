/* AVX-512 online-softmax attention over f16 or f32 K/V rows (head size a multiple of
 * 16; attention.c sends the others to the AVX2 or scalar kernel). */
#include "kernels/matmul_impl.h"
#include "kernels/asan.h"

#include <immintrin.h>

#include "kernels/online_softmax.h"
#include "kernels/simd_avx512.h"

#define VL 16
#define VF __m512
#define VZERO _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA _mm512_fmadd_ps
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VROW(base, off, f16)                                                                                  \
    ((f16) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(base) + (off))))         \
           : _mm512_loadu_ps((const float *)(base) + (off)))
#define VSUM4 reduce4
#define VACC_CG 8 /* 2 heads x 8 vectors + 8 row vectors of 32 registers */
#define SOFTMAX_STEP kern_softmax_step_avx512
#define FN(x) x##_avx512
#include "kernels/attention_simd.inc"
