/* Matrix kernels over plain buffers: weight rows in any supported GGUF type times
 * f32 activations, f32 accumulation. The fastest variant for the CPU (AVX-512,
 * AVX2, scalar) is chosen once at run time. These functions never spawn threads:
 * callers split the output rows among threads.
 *
 * Use:
 *   1. kern_act_prepare() converts each activation row to the form the weight type
 *      multiplies with fastest (e.g. Q8_0 blocks for Q8_0/Q4_0 weights, Q8_K for
 *      K-quants, f32 for float weights); kern_act_row_bytes() gives its size.
 *   2. kern_matmul() computes y[t][r] = dot(W[r], x[t]) for a range of rows r and
 *      all n_tok activation rows; it reuses each weight block across tokens
 *      (prefill) and streams rows for a single token (decode). */
#ifndef KVQ_KERNELS_MATMUL_H
#define KVQ_KERNELS_MATMUL_H

#include <stddef.h>
#include <stdint.h>

/* Bytes of one prepared activation row of k values for weights of type wtype. */
size_t kern_act_row_bytes(uint32_t wtype, int64_t k);
/* Prepares one activation row (k values; k a multiple of the weight block size). */
void kern_act_prepare(uint32_t wtype, const float *x, void *dst, int64_t k);

struct kern_matmul_args {
    uint32_t wtype;      /* enum kvq_dtype of the weight */
    const void *w;       /* weight rows, each w_row_bytes long */
    size_t w_row_bytes;
    int64_t k;           /* values per row */
    const void *xa;      /* prepared activations: n_tok rows, each xa_row_bytes long */
    size_t xa_row_bytes;
    int n_tok;
    float *y;            /* output: y[t * y_stride + r] */
    int64_t y_stride;
};
/* Computes output rows [r0, r1) for all tokens. */
void kern_matmul(const struct kern_matmul_args *a, int64_t r0, int64_t r1);

/* Dequantizes one row of n values of any supported type to f32. */
void kern_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n);

/* Which implementation kern_matmul uses: "avx512", "avx2" or "scalar". Setting the
 * environment variable KVQ_SIMD to one of these before the first call forces it
 * (tests compare variants this way). */
const char *kern_simd_level(void);

#endif
