/* AVX2 activations. */
#include "kernels/activation.h"
#include "kernels/online_softmax.h"

void kern_exp_shifted_avx2(const float *x, float shift, float scale, float *out, int64_t n) {
    const __m256 s = _mm256_set1_ps(shift), k = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), s), k)));
}

void kern_silu_mul_avx2(const float *gate, const float *up, float *out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        /* e^-g with -g <= 88 (e^88 is still finite): beneath, silu is -0 either way */
        const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
}
