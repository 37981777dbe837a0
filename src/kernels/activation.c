/* Dispatch of the activations, and the scalar versions. */
#include <math.h>

#include "core/cpu.h"
#include "kernels/activation.h"

void kern_silu_mul_scalar(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void kern_silu_mul(const float *gate, const float *up, float *out, int64_t n) {
    const int64_t n8 = kvq_simd_level() >= KVQ_SIMD_AVX2 ? n / 8 * 8 : 0;
    if (n8) kern_silu_mul_avx2(gate, up, out, n8);
    kern_silu_mul_scalar(gate + n8, up + n8, out + n8, n - n8);
}

void kern_exp_shifted_scalar(const float *x, float shift, float scale, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = expf((x[i] - shift) * scale);
}

void kern_exp_shifted(const float *x, float shift, float scale, float *out, int64_t n) {
    const int64_t n8 = kvq_simd_level() >= KVQ_SIMD_AVX2 ? n / 8 * 8 : 0;
    if (n8) kern_exp_shifted_avx2(x, shift, scale, out, n8);
    kern_exp_shifted_scalar(x + n8, shift, scale, out + n8, n - n8);
}

void kern_gelu_mul(const float *gate, const float *up, float *out, int64_t n) {
    const float c = 0.7978845608f; /* sqrt(2/pi) */
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * up[i];
    }
}
