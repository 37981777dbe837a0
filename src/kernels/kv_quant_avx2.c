/* AVX2 attention over packed KV rows and fast code unpacking. */
#include <immintrin.h>
#include <math.h>

#include "kernels/kv_quant_impl.h"
#include "kernels/online_softmax.h"
#include "kernels/simd_avx2.h"

void kern_kvq_unpack_avx2(const uint8_t *src, int n, int bits, uint8_t *out) {
    int i = 0;
    if (bits == 8) {
        memcpy(out, src, (size_t)n);
        return;
    }
    if (bits == 4) {
        for (; i + 32 <= n; i += 32) {
            __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i / 2)));
            x = _mm256_and_si256(_mm256_or_si256(x, _mm256_slli_epi16(x, 4)), _mm256_set1_epi16(0x0f0f));
            _mm256_storeu_si256((__m256i *)(out + i), x);
        }
    } else if (bits == 2) {
        for (; i + 32 <= n; i += 32) {
            __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i / 4)));
            x = _mm256_or_si256(_mm256_or_si256(x, _mm256_slli_epi32(x, 6)),
                                _mm256_or_si256(_mm256_slli_epi32(x, 12), _mm256_slli_epi32(x, 18)));
            _mm256_storeu_si256((__m256i *)(out + i), _mm256_and_si256(x, _mm256_set1_epi32(0x03030303)));
        }
    }
    if (i < n) kern_kvq_unpack_scalar(src + (size_t)i * bits / 8, n - i, bits, out + i);
}

void kern_kvq_to_f16_avx2(const float *x, int d, uint8_t *dst) {
    int i = 0;
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++) {
        const uint16_t h = kvq_f32_to_f16(x[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
}

#define VL 8
#define VF __m256
#define VZERO _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VADD _mm256_add_ps
#define VFMA _mm256_fmadd_ps
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VU8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VSUM(x) hsum256(x)
#define SOFTMAX_STEP kern_softmax_step_avx2
#define FN(x) x##_avx2
#define UNPACK kern_kvq_unpack_avx2
#include "kernels/kv_quant_simd.inc"
