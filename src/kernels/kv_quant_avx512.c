/* AVX-512 attention over packed KV rows and fast code unpacking. */
#include <immintrin.h>
#include <math.h>

#include "kernels/kv_quant_impl.h"

/* e^x for x <= 0 (x < -87 gives 0): 2^n * p(r), r = x - n ln2, |r| <= ln2/2. */
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

void kern_kvq_unpack_avx512(const uint8_t *src, int n, int bits, uint8_t *out) {
    int i = 0;
    if (bits == 8) {
        memcpy(out, src, (size_t)n);
        return;
    }
    if (bits == 4) {
        for (; i + 64 <= n; i += 64) {
            __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + i / 2)));
            x = _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi16(x, 4)), _mm512_set1_epi16(0x0f0f));
            _mm512_storeu_si512(out + i, x);
        }
    } else if (bits == 2) {
        for (; i + 64 <= n; i += 64) {
            __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + i / 4)));
            x = _mm512_or_si512(_mm512_or_si512(x, _mm512_slli_epi32(x, 6)),
                                _mm512_or_si512(_mm512_slli_epi32(x, 12), _mm512_slli_epi32(x, 18)));
            _mm512_storeu_si512(out + i, _mm512_and_si512(x, _mm512_set1_epi32(0x03030303)));
        }
    }
    if (i < n) kern_kvq_unpack_scalar(src + (size_t)i * bits / 8, n - i, bits, out + i);
}

#define VL 16
#define VF __m512
#define VZERO _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
#define VFMA _mm512_fmadd_ps
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VU8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VSUM(x) _mm512_reduce_add_ps(x)
#define VEXP exp512
#define FN(x) x##_avx512
#define UNPACK kern_kvq_unpack_avx512
#include "kernels/kv_quant_simd.inc"
