/* The CUDA kernels behind the CUDA backend: C entry points that queue work
 * (queue.h: launched at once, or recorded for a CUDA graph). Every pointer is device memory unless it says host; nothing here waits
 * for the GPU or allocates. Launch errors surface at the backend's next check. */
#ifndef KVQ_BACKEND_CUDA_KERNELS_H
#define KVQ_BACKEND_CUDA_KERNELS_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/cuda/queue.h"
#include "core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A weight matrix in device memory, rows of `cols` values in its GGUF type. Q4_0,
 * Q8_0, Q4_K and Q6_K are repacked at upload (cuk_repack) into tiles for tensor-core
 * and dp4a products (below); `data` then holds the codes and `scales` the scales. */
struct cuk_weight {
    uint32_t type;
    const uint8_t *data;
    int64_t rows, cols;
    size_t row_bytes; /* of `data` (not repacked types) */
    const uint16_t *scales;
};

/* The repacked layout. Rows go in tiles of 16 (the last padded), columns in chunks of
 * CUK_CHUNK_BLOCKS(type) blocks of 32 values (4 for Q4_0 and Q4_K, 2 for Q8_0 and
 * Q6_K: 128 or 64 columns; the last padded with zero blocks). A tile's chunk is 1024
 * bytes of codes: 16 bytes at h * 512 + lane * 16 for each lane (g = lane / 4, t =
 * lane % 4) and half h, holding row 16 tile + g + 8 h's values 8t .. 8t+7 of each
 * block j of the chunk: Q8_0 and Q6_K their 8 int8 codes at j * 8; Q4_0 and Q4_K 4
 * bytes at j * 4, byte i = code(8t + i) | code(8t + 4 + i) << 4 (codes 0..15). So a
 * warp's 16-byte loads are contiguous and each lane holds its mma.m16n8k32 fragments:
 * the product runs over the block's values in the order 8t .. 8t+7 of lane t, and the
 * inputs are read in that order too. Scales: [tile][chunk][16 rows][CUK_SCALE_ENTRIES]
 * uint16: Q4_0 and Q8_0 each block's f16 scale (value = (code - 8) * scale, Q8_0 code
 * * scale); Q4_K each block's 6-bit scale s | 6-bit min m << 8, then the super-block's
 * f16 d and dmin (value = d s code - dmin m, as ggml's Q4_K); Q6_K each block's two
 * int8 scales (of its values 0-15 and 16-31: lanes t < 2 and t >= 2), then the
 * super-block's f16 d and a zero (value = d scale code, the code being ggml's 6-bit
 * one less 32). */
#define CUK_CHUNK_BLOCKS(type) ((type) == KVQ_Q8_0 || (type) == KVQ_Q6_K ? 2 : 4)
#define CUK_SCALE_ENTRIES(type) (CUK_CHUNK_BLOCKS(type) + ((type) == KVQ_Q4_K || (type) == KVQ_Q6_K ? 2 : 0))
int cuk_repacked(uint32_t type);
/* Bytes of the repacked codes, and of the codes and scales together. */
size_t cuk_repacked_code_bytes(uint32_t type, int64_t rows, int64_t cols);
size_t cuk_repacked_bytes(uint32_t type, int64_t rows, int64_t cols);
/* Repacks rows in the GGUF layout into codes and scales of the sizes above, padding
 * included: all device memory, on the queue (the host's copy of the rows is
 * uploaded as it is, so loading a model costs no host work per value). */
void cuk_repack(struct cuk_queue *qu, uint32_t type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *codes,
                uint16_t *scales);

/* Inputs of the products as the operation before them writes them too (k a multiple
 * of 32): for the repacked types' matrix-vector kernels, x rounded to int8 in blocks
 * of 32, with each block's scale and the sum of its codes (as the CPU's q8
 * activations); for the wide kernels and cuBLAS, x in f16, as cuk_to_half_wide or
 * cuk_to_half makes it. At most one of q, h and h_wide is set. */
struct cuk_xq {
    int8_t *q;        /* [n][k] */
    float2 *dsum;     /* [n][k / 32]: scale, sum of codes */
    uint16_t *h;      /* [n][k] f16 */
    uint16_t *h_wide; /* [n][k] f16, each block of 32 in the wide kernels' order */
};
void cuk_quantize_x(struct cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, const struct cuk_xq *xq);

/* Types with device kernels: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K. */
int cuk_type_supported(uint32_t type);

/* Tokens at most the matrix-vector kernels take; wider inputs go through
 * cuk_dequantize + a GEMM (f16 operands for quantized weights; TF32 for float ones). */
#define CUK_MATVEC_MAX 16
/* Products one launch takes (consecutive jobs of one weight type share a launch). */
#define CUK_MATVEC_JOBS 3
struct cuk_matvec_job {
    const struct cuk_weight *w; /* host struct, device data */
    float *y;
    const float *bias; /* or NULL */
    int64_t y_stride;  /* floats from a token's outputs to the next's: 0 for w->rows (other values: repacked types) */
};
/* Products of repacked weights from their packed codes on Hopper's warpgroup tensor
 * cores: each job's y[t] = x[t] W^T (+ bias) for t < n, from xp (x as
 * cuk_to_half_wide writes it); the jobs (at most CUK_MATVEC_JOBS) share one type and
 * width; scratch holds cuk_matmul_wide_scratch floats. Steps of CUK_WIDE_MIN to
 * CUK_WIDE_MAX tokens take them (faster than the matrix-vector kernels and than
 * cuBLAS on f16 copies; past 256 tokens cuBLAS's wide GEMMs are); cuk_wide_available() says
 * whether this build runs them on the current device (an sm_90a kernel image). */
#define CUK_WIDE_MIN 9
#define CUK_WIDE_MAX 256
int cuk_wide_available(void);
void cuk_to_half_wide(struct cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, void *out);
/* A wide product whose chunks were split, its partial sums not yet added up: job j's
 * output at token t and row r is the sum over z < splits, in order of z, of
 * part[j][(z n + t) rows[j] + r], plus bias[j][r] (0.0f without a bias). With pend,
 * cuk_matmul_wide leaves them so (pend->splits > 1) for a kernel that reads its input
 * that way (cuk_sum_in) or for cuk_wide_settle to write y; else it writes y itself. */
struct cuk_wide_pending {
    int n_jobs, n, splits;
    float *y[CUK_MATVEC_JOBS];
    const float *part[CUK_MATVEC_JOBS], *bias[CUK_MATVEC_JOBS];
    int64_t rows[CUK_MATVEC_JOBS], y_stride[CUK_MATVEC_JOBS];
};
void cuk_matmul_wide(struct cuk_queue *qu, const struct cuk_matvec_job *jobs, int n_jobs, const void *xp, int n,
                     float *scratch, int n_sm, struct cuk_wide_pending *pend);
void cuk_wide_settle(struct cuk_queue *qu, const struct cuk_wide_pending *p);
/* An operation's input read from a pending product's job (rows its row width): the
 * sum of its splits' partial sums, plus the bias; splits 0: the input as it is. */
struct cuk_sum_in {
    const float *part, *bias;
    int splits, rows;
    int64_t zs; /* floats from one split's sums to the next's: n rows */
};
size_t cuk_matmul_wide_scratch(const struct cuk_matvec_job *jobs, int n_jobs, int n, int n_sm);
/* Rows [r0, r1) of a repacked weight, r0 a multiple of 16, as a weight of their own
 * (its data in place). */
struct cuk_weight cuk_weight_rows(const struct cuk_weight *w, int64_t r0, int64_t r1);
/* Scratch of the repacked types' products: partial sums when a tile of rows is split
 * over several blocks, and a counter per tile (zero, and left zero). */
struct cuk_mv_scratch {
    float *partial;
    unsigned *counters;
};
/* The floats of partial sums and the counters cuk_matvec needs for these jobs. */
void cuk_matvec_scratch(const struct cuk_matvec_job *jobs, int n_jobs, int n, size_t *floats, size_t *counters);
/* y[t][rows] = x[t][cols] W^T (+ bias) for t < n <= CUK_MATVEC_MAX (token t's outputs
 * at y + t * y_stride), for each job (all with the same cols); x rows x_stride apart.
 * Repacked types read xq (x rounded by cuk_quantize_x or a kernel that writes xq)
 * instead of x. */
void cuk_matvec(struct cuk_queue *qu, const struct cuk_matvec_job *jobs, int n_jobs, const float *x, int64_t x_stride,
                const struct cuk_xq *xq, int n, const struct cuk_mv_scratch *scratch);
/* The rows a token's attention reads from which the step's attention chain counts as
 * long (cuk_queue.attn_rows): the launches around it choose their shapes by it. */
int cuk_long_attn_rows(void);

/* The kernels' share of the backend's tuning, read once at its start. */
struct cuk_tuning {
    int stream_grid; /* matvec_stream's blocks at most (0: as many as fit) */
    int warp_items;  /* per-item launches take a warp an item from this many items (0: CUK_WARP_ITEMS_MIN) */
};
void cuk_set_tuning(const struct cuk_tuning *t);
/* Rows [r0, r1) of w into out[r1 - r0][cols]: f32, or f16 (saturated) when f16. */
void cuk_dequantize(struct cuk_queue *qu, const struct cuk_weight *w, int64_t r0, int64_t r1, void *out, int f16);
/* x[n][k] (rows x_stride apart) as f16, saturated, into out[n][k]. */
void cuk_to_half(struct cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, void *out);
/* y[t][rows] += bias[rows] for t < n. */
void cuk_add_bias(struct cuk_queue *qu, float *y, const float *bias, int n, int64_t rows);

/* x[t] = scale * row tokens[t] of e. */
void cuk_embed(struct cuk_queue *qu, const struct cuk_weight *e, const int32_t *tokens, int n, float scale, float *x);
/* The norms and the GLU below also write their output rounded to int8 into xq (as
 * cuk_quantize_x would, bit for bit) when xq is not NULL; dim (n_ff) then a multiple
 * of 32. Their out may then be NULL: xq's form only. Norms take dim <= CUK_NORM_MAX. */
#define CUK_NORM_MAX 16384
/* out[i] = RMSNorm(x[rows ? rows[i] : i]) * w. */
void cuk_rmsnorm(struct cuk_queue *qu, const float *x, const int32_t *rows, const float *w, int n, int dim, float eps,
                 float *out, const struct cuk_xq *xq);
/* x[t] += post ? RMSNorm(add[t]) * post : add[t]; then out[t] = RMSNorm(x[t]) * w when w.
 * add_sum: add as a pending product's sums (NULL or no splits: add itself). */
void cuk_add_norm(struct cuk_queue *qu, float *x, float *add, const struct cuk_sum_in *add_sum, const float *post,
                  const float *w, int n, int dim, float eps, float *out, const struct cuk_xq *xq);
void cuk_rope_table(struct cuk_queue *qu, const int32_t *pos, int n, const float *inv_freq, float linear, int half,
                    float *cos, float *sin);
/* out = act(gate) * up; act 0 SiLU, 1 GELU (tanh); sums (NULL, or [2] for gate and
 * up): they as a pending product's sums. */
void cuk_glu(struct cuk_queue *qu, int act, const float *gate, const float *up, const struct cuk_sum_in *sums, int n,
             int n_ff, float *out, const struct cuk_xq *xq);

/* The k <= CUK_TOP_MAX largest values of each of n rows of `cols` floats at x, best
 * first, of equal values the lower index first, into out_v/out_i [n][k]; scratch:
 * cuk_top_scratch_bytes(n). */
#define CUK_TOP_MAX 8
#define CUK_TOP_SEGMENTS 32 /* blocks a row at most */
size_t cuk_top_scratch_bytes(int n);
void cuk_top(struct cuk_queue *qu, const float *x, int n, int cols, int k, float *out_v, int32_t *out_i, void *scratch,
             int n_sm);

/* A pass's rows of logits settled as the host's sampler would (backend.h's be_draw):
 * cuk_adjust applies each row's adjustments in place; cuk_draw, after cuk_top found
 * every row's CUK_TOP_MAX largest (top_v, top_i), writes each BE_ROW_DRAW row's token
 * and its logit to drawn[n] and drawn_logit[n], and each logprobs row's log of the sum
 * of e^logit to log_z[n]. */
struct be_draw;
struct be_draw_op;
void cuk_adjust(struct cuk_queue *qu, float *x, int n, int cols, const struct be_draw *d, const struct be_draw_op *ops);
void cuk_draw(struct cuk_queue *qu, const float *x, int n, int cols, const struct be_draw *d,
              const struct be_draw_op *ops, const float *top_v, const int32_t *top_i, int32_t *drawn,
              float *drawn_logit, double *log_z);
/* Each BE_ROW_CUT row's weights' total into sum[n] and its candidates into n_cand[n],
 * cand_v and cand_i [n][BE_CUT_MAX] (backend.h's be_draw_out). */
void cuk_cut(struct cuk_queue *qu, const float *x, int n, int cols, const struct be_draw *d, const float *top_v,
             double *sum, int32_t *n_cand, float *cand_v, int32_t *cand_i);

/* Copies `bytes` from staging + src to dst, for each of n copies. */
struct cuk_copy {
    uint64_t dst;
    uint32_t src, bytes;
};
void cuk_scatter(struct cuk_queue *qu, const struct cuk_copy *copies, int n, const uint8_t *staging);

/* ---- attention over a paged, possibly quantized KV cache ----
 * One query token of one sequence. It reads, in order: packed block rows of
 * positions [a1, b1] and [a2, b2], f16 sink rows [0, sinks), f16 window rows
 * [ws, q_pos]; window rows only where visible (rotating window, sliding window).
 * Rows at positions from `fresh` on are the step's own (cuk_kv_encode writes them);
 * older ones may be read before the kernels ahead of the attention are done. So may
 * table entries, except those cuk_kv_encode writes (a block the step begins: so a
 * decode step that begins a block issues the same launches as the others, and
 * replays their graph). */
struct cuk_attn_tok {
    int32_t q_pos, a1, b1, a2, b2, sinks, ws, fresh;
    int32_t max_size, keep, window; /* visibility of window rows (kv_visible) */
    int32_t nkb, base;              /* block of position p: table[L < nkb ? L : L - base], L = p / 64 */
    uint64_t table;                 /* the block table: device addresses of the blocks */
    uint64_t fresh_block;           /* the block of position `fresh` (its entry may be the encode's) */
    int32_t ring_cap, sink_cap;     /* window rows: ring[side][h][p % ring_cap], sink[side][h][p] */
    uint64_t ring, sink;            /* f16 rows of win_row bytes */
    uint64_t mu;                    /* key and value offsets [2][n_kv][D] f32, or 0 */
};

/* Launch tokens [t0, t0 + nt) that attention takes together: consecutive positions
 * of one sequence (a prefill chunk), or a single token. */
struct cuk_attn_group {
    int32_t t0, nt;
};

/* What all tokens of one launch share: the row formats and the model's shape. */
struct cuk_attn_args { /* no padding (cuk_qk_rope) */
    int k_bits, k_group, v_bits, v_group, k_rot, v_rot;
    int n_head, n_kv, head_dim;
    float scale;
    int n;                           /* tokens of this launch */
    int n_groups;
    int max_group;                   /* the most tokens in a group */
    int n_sm;
    int q_prepped;                   /* qprep made by cuk_kv_encode (below) */
    int32_t unused;
    size_t k_row, v_row, head_bytes, win_row;
    const float *signs; /* [head_dim] Hadamard signs */
    const float *q;     /* [n][n_head][D] */
    float *out;         /* [n][n_head][D], or NULL: xq's form only */
    const struct cuk_attn_tok *toks;
    const int32_t *tok_index;        /* the batch token of each launch token */
    const struct cuk_attn_group *groups; /* all groups of one size class: each of 1 token, or chunks */
    float *partial;                  /* scratch: cuk_attention_scratch_floats() */
    struct cuk_xq xq;                /* out rounded into it too when xq.q (n_head D a multiple of 32) */
    /* the queries prepared for rotated or packed keys, [batch tokens][n_head][1 + D]:
     * q.mu (the key offset that packed keys lack), then q scaled and rotated as the
     * keys are; made here unless q_prepped */
    float *qprep;
};
/* Rows of the m16 tiles a token takes in the tensor-core attention kernel
 * (attention_tile.cuh): its query heads of one KV head, the model's group (n_head /
 * n_kv) where that is 1, 2, 4 or 8; 8 for 3, 5, 6 and 7 (Llama 3.2 3B, Qwen2.5), the
 * rows past the group idle; 0 past 8 (attention.cu's kernel takes those). */
static inline int cuk_attn_tile_rows(int group) {
    return group < 1 || group > 8 ? 0 : group == 1 || group == 2 || group == 4 ? group : 8;
}
/* Prefill tokens that kernel attends together (a chunk): 8 rows a warp, and 8 warps
 * of their own rows (4 where the query heads fill one row: 32 tokens at most), but for
 * head size 256, whose 4 warps split the dimensions of the same rows; 1 where it does
 * not take the group (attention_tile.cuh's tile_threads). */
static inline int cuk_attn_tile_chunk(int group, int head_dim) {
    const int rows = cuk_attn_tile_rows(group);
    return rows ? (head_dim > 128 ? 1 : rows > 1 ? 8 : 4) * (8 / rows) : 1;
}
/* Floats of cuk_attn_args.qprep for n batch tokens. */
size_t cuk_qprep_floats(int n, int n_head, int head_dim);
/* ---- appending to the cache on the device ----
 * Each new token's key and value rows, encoded as kv_cache.c does on the host (offsets
 * removed, Hadamard rotation, kv_quant.h's packing; bit for bit), written into its KV
 * block, into the f16 windows, and into a read-back buffer for the host's copy.
 * With rope.q, the same launch first applies the layer's per-head RMSNorm (when
 * q_norm / k_norm) and RoPE (pairing as enum rope_pairing) to the keys it encodes and
 * to every query head, in place, and prepares the queries for the attention kernels
 * into rope.qprep when given (cuk_attn_args.qprep; one launch instead of three). */
struct cuk_qk_rope { /* no padding: a recorded step's arguments are compared byte for byte */
    float *q;                     /* [batch tokens][n_head][D], or NULL: keys as they are */
    float *k;                     /* where the rotated keys go: cuk_enc_args.k, [batch tokens][n_kv][D] */
    const float *q_norm, *k_norm; /* [D] or NULL */
    const float *cos, *sin;       /* [batch tokens][half] */
    float *qprep;                 /* or NULL */
    int n_head, half, pairing;
    float eps;
    float scale;                  /* the attention's score scale */
    int32_t unused;
};
struct cuk_enc_tok {
    int32_t t, p;                   /* the batch token and its position */
    uint64_t block;                 /* device address of the block holding p */
    uint64_t table_at;              /* its block-table entry, to write `block` into (0: the host does) */
    uint64_t ring, sink;            /* f16 windows as in cuk_attn_tok (0: none) */
    int32_t ring_cap, sink_cap, sinks; /* p < sinks: a sink row too */
    int32_t repack;                 /* the pass's offsets pack the row (cuk_kv_offsets): windows only */
    uint64_t mu;                    /* offsets [2][n_kv][D], or 0 */
    uint32_t rb_k, rb_v, rb_wk, rb_wv; /* byte offsets of its rows [n_kv][row] in the read-back buffer */
};                                     /* (rb_wk, rb_wv CUK_NO_ROW: its window rows are not read back) */
#define CUK_NO_ROW 0xffffffffu
struct cuk_enc_args { /* no padding (cuk_qk_rope) */
    int k_bits, k_group, v_bits, v_group, k_rot, v_rot, windows;
    int n_kv, head_dim;
    int n; /* toks */
    size_t k_row, v_row, head_bytes, win_row;
    const float *k, *v; /* [batch tokens][n_kv][D] (k rotated in place with rope.q) */
    const float *signs;
    const struct cuk_enc_tok *toks;
    uint8_t *readback;
    struct cuk_qk_rope rope;
    /* NULL, or [n][2][n_kv][D]: the encode leaves the packed sides' rows here, offset
     * and rotated, for cuk_kv_pack; for steps whose attention reads none of its own
     * packed rows (each sequence's one new row is read from its f16 window) */
    float *defer;
};
void cuk_kv_encode(struct cuk_queue *qu, const struct cuk_enc_args *a);
/* Packs the rows cuk_kv_encode left in a->defer (the same arguments), byte for byte
 * as it would have, beside the stream (cuk_queue_launch_side_next): off the chain of
 * the step's dependent launches. */
void cuk_kv_pack(struct cuk_queue *qu, const struct cuk_enc_args *a);
/* The offsets a cache chooses at T tokens, from its f16 window rows (the ring) as
 * the host chooses them (kv_cache_offsets_part), in a pass that reaches T: an item a
 * cache. */
struct cuk_offs_item {
    uint64_t ring;       /* the cache's f16 ring of window rows, as cuk_enc_tok's */
    uint64_t mu;         /* its device offsets [2][n_kv][D], as the attention reads them,
                          * then room for them rotated */
    int32_t ring_cap, T; /* the mean of positions 1..T-1 */
    int32_t first;       /* its first row in the arguments' toks */
};
/* The items' offsets, then their packed rows encoded again with them: a->toks holds
 * a row each (t, p, block or 0, rb_k, rb_v), positions [0, end of the pass) of each
 * item in turn, a->n in all (a->k, a->v: the pass's keys, RoPE'd, and values); a->rope and
 * a->defer unused. */
void cuk_kv_offsets(struct cuk_queue *qu, const struct cuk_enc_args *a, const struct cuk_offs_item *items, int n_items);
/* Window rows of positions [lo, hi) from a ring of src_cap rows a plane into one of
 * dst_cap (rows of row_bytes, a multiple of 16; planes: heads times keys and values). */
void cuk_ring_move(struct cuk_queue *qu, void *dst, int dst_cap, const void *src, int src_cap, int planes,
                   size_t row_bytes, int lo, int hi);
/* An empty kernel beside the stream (cuda_backend.c says why). */
void cuk_idle_beside(struct cuk_queue *qu);
/* bytes (a multiple of 16, 16-byte aligned) from pinned host memory to dst, read by a kernel */
void cuk_stage_fetch(struct cuk_queue *qu, void *dst, const void *src, size_t bytes);

/* Floats of scratch cuk_attention needs for n tokens on n_sm multiprocessors. */
size_t cuk_attention_scratch_floats(int n, int n_head, int head_dim, int n_sm);
/* Head dims the attention kernels take (64, 128, 256). */
int cuk_attention_head_dim_supported(int head_dim);
void cuk_attention(struct cuk_queue *qu, const struct cuk_attn_args *a);

#ifdef __cplusplus
}
#endif

#endif
