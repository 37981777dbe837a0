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

/* Codes to level bytes: a 16-entry byte shuffle (two and a select for 5 bits). */
void kern_kvq_nf_map_avx2(uint8_t *c, int n, int bits) {
    const uint8_t *u = kern_kvq_nf_levels(bits);
    uint8_t lo[16] = {0}, hi[16] = {0};
    const int nl = 1 << bits;
    for (int k = 0; k < nl && k < 16; k++) lo[k] = u[k];
    for (int k = 16; k < nl; k++) hi[k - 16] = u[k];
    const __m256i tl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lo));
    const __m256i th = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hi));
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(c + i));
        __m256i y = _mm256_shuffle_epi8(tl, x); /* codes < 16: bit 7 clear, low nibble indexes */
        if (bits == 5) {
            const __m256i big = _mm256_cmpgt_epi8(x, _mm256_set1_epi8(15));
            y = _mm256_blendv_epi8(y, _mm256_shuffle_epi8(th, _mm256_and_si256(x, _mm256_set1_epi8(15))), big);
        }
        _mm256_storeu_si256((__m256i *)(c + i), y);
    }
    for (; i < n; i++) c[i] = u[c[i]];
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

/* floor((x - bias) * inv + 0.5) clamped to [0, top] for 8 values, as the scalar encoder */
static __m256i codes8(const float *x, __m256 bias, __m256 inv, __m256 top) {
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), bias), inv), _mm256_set1_ps(0.5f));
    return _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_floor_ps(t), _mm256_setzero_ps()), top));
}

/* 16 codes of x (scalar encoder's rounding) stored at out: bytes, or 4-bit pairs */
static void codes16_avx2(const float *x, __m256 bias, __m256 inv, __m256 top, int bits, uint8_t *out) {
    /* 32-bit to 16-bit (lanes interleave the halves; the permute puts them back), then
     * to 8-bit */
    const __m256i w =
        _mm256_permute4x64_epi64(_mm256_packus_epi32(codes8(x, bias, inv, top), codes8(x + 8, bias, inv, top)), 0xD8);
    const __m256i b = _mm256_packus_epi16(w, w);
    const __m128i c = _mm_unpacklo_epi64(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (bits == 8)
        _mm_storeu_si128((__m128i *)out, c);
    else /* code 2k low nibble, 2k + 1 high: c_2k + 16 c_2k+1 */
        _mm_storel_epi64((__m128i *)out, _mm_packus_epi16(_mm_maddubs_epi16(c, _mm_set1_epi16(0x1001)), _mm_setzero_si128()));
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
#define VMIN _mm256_min_ps
#define VMAX _mm256_max_ps
#define VHMIN(x) hmin256(x)
#define VHMAX(x) hmax256(x)
#define CODES16 codes16_avx2
#define SOFTMAX_STEP kern_softmax_step_avx2
#define FN(x) x##_avx2
#define UNPACK kern_kvq_unpack_avx2
#define NFMAP kern_kvq_nf_map_avx2
#include "kernels/kv_quant_simd.inc"
