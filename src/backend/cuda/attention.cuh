/* What the attention kernels share (attention.cu, attention_tile.cu): the launch
 * tokens' plans, the scratch layout, and the visibility rule of window rows.
 *
 * Scratch (cuk_attn_args.partial): first the launch tokens' query heads as
 * attn_prep_q leaves them, [n][n_head][1 + D] (q.mu, then q scaled and rotated as
 * the keys are); then each split's partial result, [n][n_head][n_splits][D + 4]: the
 * running max M, the softmax sum L, the packed rows' share of it LP, the number of
 * splits that had rows (in split 0 only), then the D unnormalized outputs. */
#ifndef KVQ_BACKEND_CUDA_ATTENTION_CUH
#define KVQ_BACKEND_CUDA_ATTENTION_CUH

#include <cuda_fp16.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"

#define ATTN_BT 64        /* tokens per KV block (kv_pool.h) */
#define ATTN_MAX_SPLITS 128

static __host__ __device__ inline size_t attn_prep_floats(int n, int n_head, int D) {
    return ((size_t)n * n_head * (D + 1) + 3) & ~(size_t)3; /* the partials 16-byte aligned */
}

/* Split `split` of (launch token ti, query head h). */
static __device__ inline float *attn_part(const cuk_attn_args &a, int ti, int h, int n_splits, int split) {
    const int D = a.head_dim;
    return a.partial + attn_prep_floats(a.n, a.n_head, D) + ((size_t)(ti * a.n_head + h) * n_splits + split) * (D + 4);
}

static __device__ __forceinline__ bool attn_visible(int32_t p, int32_t q, const cuk_attn_tok &t) {
    return p <= q && (t.max_size == 0 || p < t.keep || p > q - (t.max_size - t.keep)) &&
           (t.window <= 0 || p > q - t.window);
}

/* Whether the tensor-core kernel (attention_tile.cu) takes this launch's formats and
 * shape; and its launch (after attn_prep_q), which returns its number of splits. */
bool attn_tile_takes(const cuk_attn_args *a);
/* Whether its queries go through attn_prep_q (rotated or packed keys) or are read as
 * they are. */
bool attn_tile_prepped(const cuk_attn_args *a);
int attn_tile_launch(cuk_queue *qu, const cuk_attn_args *a);

#endif
