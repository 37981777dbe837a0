/* What the attention kernels share (attention.cu, attention_tile.cu): the launch
 * tokens' plans, the scratch layout, and the visibility rule of window rows.
 *
 * Scratch (cuk_attn_args.partial): each split's partial result,
 * [n][n_head][n_splits][D + 4]: the running max M, the softmax sum L, the packed
 * rows' share of it LP, the number of splits that had rows (in split 0 only), then
 * the D unnormalized outputs. Prepared queries (qprep) are indexed by batch token. */
#ifndef KVQ_BACKEND_CUDA_ATTENTION_CUH
#define KVQ_BACKEND_CUDA_ATTENTION_CUH

#include <cuda_fp16.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"

#define ATTN_BT 64        /* tokens per KV block (kv_pool.h) */
#define ATTN_MAX_SPLITS 128

/* Split `split` of (launch token ti, query head h). */
static __device__ inline float *attn_part(const cuk_attn_args &a, int ti, int h, int n_splits, int split) {
    return a.partial + ((size_t)(ti * a.n_head + h) * n_splits + split) * (a.head_dim + 4);
}

/* Query head h of launch token ti as prepared (qk_prep.cuh's prep_head). */
static __device__ inline const float *attn_qprep(const cuk_attn_args &a, int ti, int h) {
    return a.qprep + ((size_t)a.tok_index[ti] * a.n_head + h) * (a.head_dim + 1);
}

static __device__ __forceinline__ bool attn_visible(int32_t p, int32_t q, const cuk_attn_tok &t) {
    return p <= q && (t.max_size == 0 || p < t.keep || p > q - (t.max_size - t.keep)) &&
           (t.window <= 0 || p > q - t.window);
}

/* Whether the tensor-core kernel (attention_tile.cu) takes this launch's formats and
 * shape; and its launch (after the queries' preparation), which returns its number of
 * splits. */
bool attn_tile_takes(const cuk_attn_args *a);
/* Whether its queries are read prepared (rotated or packed keys) or as they are. */
bool attn_tile_prepped(const cuk_attn_args *a);
int attn_tile_launch(cuk_queue *qu, const cuk_attn_args *a);

#endif
