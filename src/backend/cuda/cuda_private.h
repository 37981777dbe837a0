/* The CUDA backend's private header: its state and the functions its files share
 * (cuda_backend.c: the table and lifecycle; cuda_staging.c: staging, records and
 * copies; cuda_kv.c: the device KV store; cuda_products.c and cuda_attend.c: the
 * operations; cuda_weights.c: the uploaded model; cuda_profile.c: profiles). */
#ifndef KVQ_BACKEND_CUDA_PRIVATE_H
#define KVQ_BACKEND_CUDA_PRIVATE_H

#include <assert.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"
#include "backend/weight.h"

#define ARENA_CHUNK ((size_t)256 << 20) /* KV block memory is taken in chunks of this */
#define MIRROR_CHUNK ((size_t)32 << 20) /* and caches' tables, windows and offsets in these */
#define DEQ_BYTES ((size_t)128 << 20)   /* a band of dequantized rows for one GEMM */
#define MAX_FORMATS 4                   /* row formats in one attention batch */

/* A weight or vector the model uploaded, found by its host address. */
struct dev_entry {
    const uint8_t *host; /* a struct weight's address, or a vector's data */
    size_t bytes;
    uint8_t *dev;
    struct cuk_weight w; /* weights only */
    void *f16;           /* quantized weights: all rows in f16 (dev_weight_f16), or NULL */
    bool f16_none;       /* no room for that copy */
};

/* Memory that lives as long as the backend: KV blocks on the host (pinned) and on
 * the device. */
/* Where an arena's memory lives: device memory, pinned host memory, or host memory
 * mapped but not taken until written (a single GPU's KV blocks: their host copies
 * take pages only for the rows the host reads or writes, kv_pool.h). */
enum arena_mem { ARENA_DEVICE, ARENA_PINNED, ARENA_MAPPED };

struct arena {
    uint8_t *base;
    size_t used, cap;
    enum arena_mem mem;
    struct arena *next;
};

/* The device copy of one cache's block table, f16 windows and offsets. */
struct cuda_mirror {
    uint64_t *table_d; /* device addresses of the blocks, on the device */
    /* the blocks whose addresses table_d holds (or will, once the step's copies are
     * placed): a block keeps its device copy while its pool lives, so an entry whose
     * block is the same needs no look at it */
    const struct kv_block **table_blk;
    int32_t table_cap, table_n;
    bool valid;
    uint32_t epoch;
    int32_t synced; /* window rows of positions < synced are on the device */
    int32_t win_span; /* the window rows before a pass that the ring keeps (kv_view) */
    int32_t ring_cap, sink_cap, n_kv, head_dim;
    size_t win_row;
    uint8_t *win;  /* the ring: [2][n_kv][ring_cap][win_row] (ring_cap_for) */
    uint8_t *sink; /* [2][n_kv][sink_cap][win_row] */
    bool long_ring, long_used; /* listed in long_rings; a pass of this step needed it long */
    float *mu;    /* [2][n_kv][head_dim], then [2][n_kv][head_dim] scratch (cuk_kv_offsets) */
    bool has_mu;
    bool mu_chosen; /* the device chose them in this step: the host's cache has them at its end */
};

#define ROW_COPIES 64 /* early row copies a step (the rest wait for its end) */

#define RESULT_SLICES 4 /* a product whose results the host reads, in this many launches, */

#define RESULT_SPLIT_BYTES ((size_t)4 << 20) /* when they are this many bytes or more */

/* One sequence's rows of one layer, encoded on the device, waiting for the host's copy. */
struct pending_append {
    struct kv_cache *cache;
    int32_t p0;
    int n;
    int32_t w0;          /* window rows read back for positions w0.. (kv_cache_window_rows_from) */
    size_t k, v, wk, wv; /* offsets in the read-back buffer */
    bool windows;
    int parts; /* of the offsets' re-encoding that end left (kv_cache_append_end) */
    int32_t offs_T; /* > 0: the device chose the offsets at T (kv_cache_append_begin_claim) */
};

/* A copy to host memory, after the step's recorded work. */
struct post_copy {
    void *dst;
    const void *src;
    size_t bytes;
};

/* Tuning and measurement aids, read once from the environment at the backend's start:
 *   KVQ_CUDA_PROFILE=1       time per operation, each waited for (so launched one by one)
 *   KVQ_CUDA_PROFILE=steps   the host's time per operation, and how steps' wall time splits
 *   KVQ_CUDA_GRAPHS=0        decode steps launched one by one, not as CUDA graphs
 *   KVQ_CUDA_RESULT_SPLIT=B  results the host reads of B bytes or more come in slices
 *   KVQ_CUDA_LEAVE_OUT=a,b   launches of kernels whose names hold a or b are dropped
 *                            (outputs wrong: what a step takes without them; "list" names them)
 *   KVQ_MV_STREAM_GRID=N     the streamed matrix-vector kernel takes at most N blocks */
struct cuda_tuning {
    bool prof, steps, graphs;
    size_t result_split;
    char leave_out[256];
    struct cuk_tuning kernels;
};

struct cuda_backend {
    struct backend base;
    struct cuda_tuning tune;
    bool f16_weights, f16_short; /* f16 copies of quantized weights kept; one did not fit */
    struct cuk_queue q;
    cudaStream_t stream; /* q.stream */
    bool in_step;        /* work was queued since the last sync */
    int segments;        /* segments of this recorded step issued */
    bool one_token;      /* this step is one token's (segment_ends) */
    struct post_copy *post;
    int n_post, cap_post;
    void **dead;         /* device memory to free at the next sync (recorded work may read it) */
    int n_dead, cap_dead;
    /* device memory of freed caches' windows, offsets and block tables (mirror_arena's),
     * kept for the next caches: a cudaMalloc per new cache and layer, and a cudaFree
     * (which waits for the device) per finished one, held up prompts and whole steps */
    struct spares { size_t bytes; void **p; int n, cap; } *spare; /* one stack per size (a few sizes) */
    int n_spare;
    /* rings prompt chunks made long, made short at the end of a step that needed them
     * short, and the rings they replaced, spare once the step's work is done (ring_cap_for) */
    struct cuda_mirror **long_rings;
    int n_long, cap_long;
    struct spare_later { void *p; size_t bytes; } *later;
    int n_later, cap_later;
    cublasHandle_t blas;
    /* a GEMM product's other jobs (K and V beside Q, up beside gate) on streams of
     * their own (cuda_matmul) */
    cudaStream_t side[CUK_MATVEC_JOBS - 1];
    cublasHandle_t side_blas[CUK_MATVEC_JOBS - 1];
    cudaEvent_t fork_ev, join_ev[CUK_MATVEC_JOBS - 1];
    int n_sm, max_tokens;
    bool failed;
    char failure[256];
    struct dev_entry *ents;
    int n_ents, cap_ents;
    void *deq;            /* DEQ_BYTES */
    void *x16;            /* f16 GEMM inputs: max_tokens rows of the widest input */
    struct cuk_xq xq; /* int8 inputs of the repacked types' matrix-vector kernels */
    struct cuk_mv_scratch mv;          /* their partial sums and tile counters */
    size_t mv_floats, mv_counters;
    int64_t xq_cols;  /* xq holds up to CUK_MATVEC_MAX rows of this many */
    float *wide_part; /* the wide products' partial sums (split columns) */
    size_t wide_floats;
    /* a wide product's partial sums left for the next operation to add up as it reads
     * them (the GLU, add_norm) or, for any other, settle_sums first: a launch less */
    struct cuk_wide_pending sums;
    /* what cuda_draw leaves for the host, for top_rows rows: [rows] log-normalizers and
     * weights' totals, [rows][CUK_TOP_MAX] largest values, [rows] drawn tokens' logits,
     * [rows][BE_CUT_MAX] candidates' values, as many indices of each, [rows] drawn tokens
     * and candidates' counts; and the segments' lists */
    void *top_d;
    void *top_scratch;
    int top_rows;
    /* what xq holds: the rounding of xq_n rows of xq_k floats at xq_of (written by the
     * norm or GLU that made them, so the product after it needs no rounding launch) */
    const float *xq_of;
    int xq_n;
    int64_t xq_k;
    /* and what x16 holds: x16_n rows of x16_k floats at x16_of in f16, in the wide
     * kernels' order where x16_wide (by the operation that wrote them, or a product) */
    const float *x16_of;
    int x16_n;
    int64_t x16_k;
    bool x16_wide;
    int64_t x16_cols;   /* x16 holds max_tokens rows of this many */
    struct cuk_xq into; /* product_input's f16 form for the operation before a product */
    bool any_repacked; /* a weight of a repacked type was uploaded */
    bool float_matrix; /* a weight of a float type was uploaded (its products read f32) */
    const float *x32_unread; /* a buffer whose floats product_f32 left out, until rewritten */
    bool wide;         /* the device runs the packed wide products (cuk_wide_available) */
    float *part;
    size_t part_floats;
    /* the queries prepared for attention (cuk_attn_args.qprep), and whose: the batch's
     * n queries at qprep_of with scale qprep_scale, made by the KV append of this
     * layer (NULL: none; a product writing the queries, or a sync, clears it) */
    float *qprep;
    size_t qprep_floats;
    const float *qprep_of;
    int qprep_n;
    float qprep_scale;
    /* rows the step's encodes leave for cuk_kv_pack (cuk_enc_args.defer): defer_used of
     * defer_floats taken this step */
    float *defer;
    size_t defer_floats, defer_used;
    float *signs; /* Hadamard signs of head size signs_dim */
    int signs_dim;
    uint8_t *stage_h, *stage_d;
    size_t stage_cap, stage_used, stage_up; /* stage_up: bytes uploaded this step */
    struct cuk_copy *copies;
    int n_copies, cap_copies;
    /* rows the device encoded this step, for the host's copy at the next sync */
    struct pending_append *pending;
    int n_pending, cap_pending;
    uint8_t *rb_d, *rb_h;
    size_t rb_used, rb_cap, rb_h_cap;
    /* rows read back early, on their own stream: a copy after each issued segment (each
     * KV append of a step not recorded), so the host files them while the GPU runs on;
     * row_ev[i]: copy i done, work_ev: the work so far (a copy waits on it as it was
     * when the copy was queued); row_end[i]: the pending appends copy i covers;
     * [rows_from, rows_to): the appends rows_task files, rows_next the next of them */
    cudaStream_t copy_stream;
    cudaEvent_t row_ev[ROW_COPIES], work_ev;
    cudaEvent_t result_ev[RESULT_SLICES]; /* the slices' copies (matvec_in_slices) */
    bool uva; /* unified addressing: host_alloc's pinned memory has the same address on the device */
    /* The packing of a one-token step's new rows after a short attention chain
     * (cuk_kv_pack), held from the KV append until the O product is queued, then
     * launched beside the norm and the gate/up product after it. Launched at once,
     * beside the attention, it shares multiprocessors with the attention's blocks,
     * whose warps are the step's chain: a step at 512 rows took 20-60 us longer
     * (llama3-8b Q4_0, H100; K4V4 the more, as its attention blocks leave registers
     * for a packing block beside them). After a long chain (cuk_long_attn_rows) it
     * still goes beside the attention: held, a step at 4096 rows took 1-3% longer
     * (docs/cuda-performance.md). */
    struct cuk_enc_args held_pack[MAX_FORMATS];
    int n_held_pack;
    int row_end[ROW_COPIES], n_row_copies, rows_copied, rows_from, rows_to;
    atomic_int rows_next;
    size_t rb_copied;
    /* a KV append's sequences: their format's index, the offsets' point they claimed (0: none) */
    struct seq_enc {
        int fmt;
        int32_t offs_T;
    } *seq_enc;
    int cap_seq_enc;
    struct arena *host_arena, *dev_arena, *mirror_arena;
    /* per attention call */
    struct kv_cache **uc;
    struct cuda_mirror **uc_mirror;
    int *uc_chunk;
    int cap_uc;
    /* host threads (made at first need): the offsets' re-encoding of caches that
     * reach their offsets point, spread over them (kv_cache_offsets_part) */
    struct kvq_threads *pool;
    int n_threads;
    double prof_s[16];
    long prof_n[16];
    struct step_prof *steps; /* KVQ_CUDA_PROFILE=steps, else NULL */
    /* tensor parallelism: the device, and this backend's rank among tp->n (tp: NULL alone) */
    int device, rank;
    struct tp_shared *tp;
    uint8_t *fetch_h; /* pinned: KV blocks' device rows on their way to the host's copies (fetch_blocks) */
    size_t fetch_cap;
    float *offs_h; /* pinned: the offsets the device chose in a step, on their way to the host's caches */
    size_t offs_h_floats;
};

static inline struct cuda_backend *cuda(struct backend *b) { return (struct cuda_backend *)b; }

/* Tensor parallelism (tp_backend.c) runs one cuda_backend a GPU, all driven by one
 * host thread, op by op, rank 0 first. The host's KV cache holds every head; rank r's
 * device holds KV heads [r H/n, (r+1) H/n) of each block, which (a block being
 * head-major) is the r-th n-th of its bytes, in an arena laid out as rank 0's. Host
 * changes happen once: rank 0 begins the appends and takes the pool's dirty rows for
 * all ranks; the last rank ends the appends, after every rank filed its heads' rows. */
#define TP_MAX 8

struct tp_shared {
    struct cuda_backend *rank[TP_MAX];
    int n;
    /* the dirty rows rank 0 took in this op, for the other ranks to copy their parts */
    struct tp_dirty { struct kv_block *b; int32_t lo, hi; } *dirty;
    int n_dirty, cap_dirty;
    struct cuk_group group; /* the ranks' queues, which meet at the all-reduces */
    int reduces;            /* all-reduces recorded in this step (tp_backend.c cuts segments) */
};

/* The device address of a block's part on this rank. */
void *block_dev(const struct cuda_backend *cb, const struct kv_block *b);
/* The KV heads of a layer of H this rank holds: [*h0, *h0 + return). */
static inline int rank_heads(const struct cuda_backend *cb, int H, int *h0) {
    const int n = cb->tp ? cb->tp->n : 1, r = cb->tp ? cb->rank : 0;
    *h0 = r * (H / n);
    return H / n;
}
/* A cuda_backend on one device (backend_cuda_new's, or a rank's). */
struct cuda_backend *cuda_backend_on(int device, int n_threads, bool f16_weights);
/* The pool of a tensor-parallel backend: host rows on rank 0, each rank's part of a
 * block in its own arena. */
struct kv_pool *tp_kv_pool_new(struct tp_shared *tp, size_t budget);
/* backend_cuda_new's tensor-parallel backend (tp_backend.c). */
struct backend *backend_cuda_tp_new(int n, const int *devices, int n_threads, bool f16_weights);

/* KVQ_CUDA_PROFILE=1: each operation waits for the GPU before and after itself and
 * its time is added up per kind, printed when the backend is freed (a measurement
 * aid: the waits serialize what normally overlaps). */
enum prof_op { P_MATVEC, P_WIDE, P_GEMM, P_NORM, P_GLU, P_EMBED, P_KV_ENCODE, P_KV_FINISH, P_ATTN_HOST, P_ATTN_GPU, P_ISSUE,
               P_N };

struct step_prof;

/* cuda_backend.c */
bool ck(struct cuda_backend *cb, cudaError_t e, const char *what);
bool ck_blas(struct cuda_backend *cb, cublasStatus_t st, const char *what);
void wait_streams(struct cuda_backend *cb);
bool grow_floats(struct cuda_backend *cb, float **buf, size_t *have, size_t need, const char *what);
int cuda_sync(struct backend *b);

/* cuda_profile.c */
double now_s(void);
double prof_begin(struct cuda_backend *cb);
void prof_end(struct cuda_backend *cb, enum prof_op op, double t0);
void steps_free(struct step_prof *sp);
struct step_prof *steps_new(void);
void steps_begin(struct step_prof *sp, int n_tokens);
void steps_first_issue(struct step_prof *sp, cudaStream_t s);
void steps_mark(struct step_prof *sp, cudaStream_t s, bool results);
void steps_waited(struct step_prof *sp);
void steps_done(struct step_prof *sp, bool failed);
void prof_print(const struct cuda_backend *cb);

/* cuda_weights.c */
bool drop_f16_copies(struct cuda_backend *cb);
const float *dev_vec(struct cuda_backend *cb, const float *host);
const struct cuk_weight *dev_weight(struct cuda_backend *cb, const struct weight *w);
const void *dev_weight_f16(struct cuda_backend *cb, const struct weight *w);
int cuda_upload_weight(struct backend *b, const struct weight *w);
int cuda_upload_vector(struct backend *b, const float *v, int64_t n);

/* cuda_staging.c */
bool stage_grow(struct cuda_backend *cb, size_t cap);
size_t stage_alloc(struct cuda_backend *cb, size_t bytes);
const void *stage_array(struct cuda_backend *cb, const void *data, size_t bytes);
void copies_follow_work(struct cuda_backend *cb);
void copy_new_rows(struct cuda_backend *cb);
void launch_held_packs(struct cuda_backend *cb);
void issue_record(struct cuda_backend *cb);
void step_op(struct cuda_backend *cb, int n, bool glu);
void record_stop(struct cuda_backend *cb);
void cut_segment(struct cuda_backend *cb);
void issue_records_together(struct tp_shared *tp);
void free_after_step(struct cuda_backend *cb, void *p);
void *copy_space(struct cuda_backend *cb, const void *dst, size_t bytes);
bool copy_to(struct cuda_backend *cb, const void *dst, const void *data, size_t bytes);
void flush_copies(struct cuda_backend *cb);
void post_copy(struct cuda_backend *cb, void *dst, const void *src, size_t bytes);

/* cuda_kv.c */
void drop_pending(struct cuda_backend *cb);
void arena_free(struct arena *a);
struct kv_pool *cuda_kv_pool_new(struct backend *b, size_t budget);
struct cuda_mirror *mirror_of(struct cuda_backend *cb, struct kv_cache *c);
bool sync_table(struct cuda_backend *cb, struct cuda_mirror *m, const struct kv_view *v);
struct cuda_mirror *sync_windows(struct cuda_backend *cb, struct kv_cache *c, const struct kv_view *v, int32_t limit,
                                 int n);
void rings_step_end(struct cuda_backend *cb, bool shorten);
int sync_blocks(struct cuda_backend *cb, struct kv_pool *pool, const struct kv_view *v, int n_kv, bool rows);
bool same_format(const struct kv_view *a, const struct kv_view *b);
int ensure_signs(struct cuda_backend *cb, int D, const float *host);
bool rb_host_make(struct cuda_backend *cb, size_t bytes);
int cuda_reserve_kv(struct backend *b, size_t bytes);
bool ensure_qprep(struct cuda_backend *cb, int n, int n_head, int D);
int plan_rows(const struct kv_query_plan *pl, int32_t q);
int cuda_kv_append(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k, const float *v,
                   const struct be_rope *r);
void file_rows(struct cuda_backend *cb, int to, bool last);
void cuda_run_on_host_threads(struct backend *b, kvq_task_fn fn, void *arg);
int finish_appends(struct cuda_backend *cb);

/* cuda_products.c */
void settle_sums(struct cuda_backend *cb);
const struct cuk_xq *product_input(struct cuda_backend *cb, const float *out, int n, int64_t k);
float *product_f32(struct cuda_backend *cb, float *out, int n);
void cuda_matmul(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs, const struct be_matmul *jobs);
void cuda_embed(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x);
void cuda_rmsnorm(struct backend *b, const float *x, const int32_t *rows, const float *w, int n, int dim, float eps,
                  float *out);
void cuda_add_norm(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                   float eps, float *out);
void cuda_rope_table(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear, int half,
                     float *cos, float *sin);
void cuda_glu(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff, float *out);
void cuda_draw(struct backend *b, float *x, int n, int cols, const struct be_draw *d, const struct be_draw_op *ops,
               int n_ops, const struct be_draw_out *out);
void cuda_read(struct backend *b, void *dst, const void *src, size_t bytes);

/* cuda_attend.c */
void cuda_attention(struct backend *b, const struct be_attention *a, int n);

#endif
