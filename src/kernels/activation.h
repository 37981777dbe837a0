/* The gated activations of feed-forward blocks, over plain float rows. The AVX2
 * version (on AVX2 and AVX-512 CPUs) uses the kernels' e^x (online_softmax.h). */
#ifndef KVQ_KERNELS_ACTIVATION_H
#define KVQ_KERNELS_ACTIVATION_H

#include <stdint.h>

/* out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + e^-gate[i]) * up[i]. */
void kern_silu_mul(const float *gate, const float *up, float *out, int64_t n);
/* out[i] = gelu(gate[i]) * up[i], GELU's tanh approximation (scalar only). */
void kern_gelu_mul(const float *gate, const float *up, float *out, int64_t n);

/* out[i] = e^((x[i] - shift) * scale) for x[i] <= shift, scale > 0 (a softmax's weights:
 * the sampler's over a vocabulary); beneath e^-87 they may be 0. */
void kern_exp_shifted(const float *x, float shift, float scale, float *out, int64_t n);

/* Per level (tests compare them): n a multiple of 8 for AVX2. */
void kern_silu_mul_scalar(const float *gate, const float *up, float *out, int64_t n);
void kern_silu_mul_avx2(const float *gate, const float *up, float *out, int64_t n);
void kern_exp_shifted_scalar(const float *x, float shift, float scale, float *out, int64_t n);
void kern_exp_shifted_avx2(const float *x, float shift, float scale, float *out, int64_t n);

#endif
