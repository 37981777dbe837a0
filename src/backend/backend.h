/* The compute backend the forward pass runs on: a small table of operations over
 * activation buffers, weights and KV caches. forward.c says what a layer computes;
 * a backend says how and where.
 *
 * The CPU backend (cpu/cpu_backend.c): buffers are host memory, weights stay in the
 * mapped GGUF file (Q8_0/Q4_0 products read the backend's own 16-row copy where the
 * CPU kernels have that path: cpu/cpu_weights.h), work is split over a thread pool.
 * The CUDA backend (cuda/cuda_backend.c): alloc returns device memory (the forward
 * pass never touches activations itself, it only passes them between operations),
 * upload_weight and upload_vector copy the model to the device (ops then name a weight
 * by its host descriptor), kv_pool_new mirrors the KV blocks in device memory, and
 * attention reads the caches' block tables there; sync is where the host waits.
 * Host arrays (tokens, positions, rows, caches) are passed as host pointers. */
#ifndef KVQ_BACKEND_H
#define KVQ_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/weight.h"
#include "core/threadpool.h"

struct kv_cache;
struct kv_pool;

/* y[n][w->rows] = x[n][k] W^T (+ bias[w->rows]); with host_y (a backend whose
 * activations are not host memory), y is wanted there instead, in host_alloc memory:
 * the backend may write it there directly, or copy parts of it while it computes the
 * rest. */
struct be_matmul {
    const struct weight *w;
    float *y;
    const float *bias;
    float *host_y;
    bool logits; /* the pass's output product: the layers, and their KV appends, are queued */
};

/* Per-head RMSNorm (optional) and RoPE of a batch's queries and keys, and the scale
 * of the attention that reads them (a backend may prepare the queries for it). */
struct be_rope {
    float *q, *k;                 /* [n][n_head][D], [n][n_kv][D] */
    int n_head, n_kv, head_dim;
    const float *q_norm, *k_norm; /* [D] or NULL */
    float eps;
    const float *cos, *sin;       /* [n][half]: the tables of the tokens' positions */
    int half;
    int pairing;                  /* enum rope_pairing */
    float attn_scale;
};

/* Attention of n query tokens, token t over caches[t] at position pos[t]. */
struct be_attention {
    const float *q; /* [n][n_head][D] */
    float *out;     /* [n][n_head][D] */
    struct kv_cache *const *caches;
    const int32_t *pos;
    int n_head, n_kv, head_dim;
    float scale;
};

enum be_glu { BE_GLU_SILU, BE_GLU_GELU_TANH };

/* One sequence's share of a batch's new keys and values: tokens [first, first + n). */
struct be_kv_append {
    struct kv_cache *cache;
    int first, n;
};

struct backend;

#define BE_TOP_MAX 8

/* How a row of a pass's logits is settled where the logits are (backend_ops.draw). */
enum be_row {
    BE_ROW_LOGITS, /* the row goes to the host */
    BE_ROW_TOP,    /* only its BE_TOP_MAX largest logits, after its adjustments */
    BE_ROW_DRAW,   /* a draw over the whole row after its adjustments, as sampler.c makes it */
    BE_ROW_CUT,    /* what a top-k, top-p or min-p cut of the row after its adjustments can reach */
};

/* An adjustment of one logit, applied in a row's order (sampler.c's adjust). */
enum be_adjust { BE_ADD, BE_REPEAT, BE_SUB, BE_BAN };
struct be_draw_op {
    int32_t id;
    int32_t kind; /* enum be_adjust: l + a; l > 0 ? l / a : l * a; l - a; -inf */
    float a;
};

/* The largest vocabulary a BE_ROW_DRAW or BE_ROW_CUT row may have (its blocks' sums in
 * shared memory). */
#define BE_DRAW_MAX_COLS (4096 * 64)
/* The most candidates a BE_ROW_CUT row returns; be_draw_out.n_cand has BE_CUT_ALL set
 * where they hold every token the min-p cut keeps. */
#define BE_CUT_MAX 1024
#define BE_CUT_ALL (1 << 30)

/* Where backend_ops.draw leaves its results (host_alloc memory), by row of the n. */
struct be_draw_out {
    float *vals;        /* [n][BE_TOP_MAX] the largest, best first, of equal values the lower index */
    int32_t *ids;       /* [n][BE_TOP_MAX] their indices */
    int32_t *drawn;     /* [n] a BE_ROW_DRAW row's token */
    float *drawn_logit; /* [n] its logit */
    double *log_z;      /* [n] a logprobs row's log of the sum of e^logit */
    float *logits;      /* [n][cols] a BE_ROW_LOGITS row's logits */
    /* A BE_ROW_CUT row's total of weights (as a BE_ROW_DRAW row's) and its candidates,
     * in no order: the tokens down to a point the cut lies above (with top_k: at least
     * its top_k largest), -1 where more than BE_CUT_MAX (the host reads the row) */
    double *sum;       /* [n] */
    int32_t *n_cand;   /* [n] */
    float *cand_vals;  /* [n][BE_CUT_MAX] */
    int32_t *cand_ids; /* [n][BE_CUT_MAX] */
};

/* Row r's candidates in out (0 where it had too many). */
static inline int be_cut_count(const struct be_draw_out *out, int r) {
    return out->n_cand[r] < 0 ? 0 : out->n_cand[r] & ~BE_CUT_ALL;
}

struct be_draw {
    int32_t row;        /* enum be_row */
    int32_t op0, n_ops; /* its adjustments: ops[op0, op0 + n_ops) */
    /* Bans alone (fewer than BE_TOP_MAX): the ops are the bans, left out of the logits;
     * a BE_ROW_DRAW draw starts from the best allowed logit and drops the banned
     * tokens' weights from the sums (sampler.c's bans_only), a greedy one is the best
     * allowed of the largest */
    int32_t bans_aside;
    int32_t logprobs; /* the row's logits are left as they are: its log-normalizer is wanted */
    float scale;        /* BE_ROW_DRAW, BE_ROW_CUT: 1 / temperature */
    float top_p, min_p; /* BE_ROW_CUT: the cuts (1, 0: none) */
    int32_t top_k;      /* BE_ROW_CUT: the largest it keeps first, up to BE_CUT_MAX (0: all) */
    double u;           /* BE_ROW_DRAW: in [0, 1), where the draw falls in the weights' total */
};

struct backend_ops {
    const char *name;
    /* What the backend can do, for the engine to ask instead of naming devices. */
    bool host_memory; /* activations are host memory (else results come by be_matmul.host_y) */
    bool encodes_kv;  /* kv_append encodes the rows itself (on the device): a pass must end
                       * where a cache chooses its value offsets (kv_cache_offsets_point),
                       * unless chooses_offsets: kv_append then chooses them in the pass */
    bool chooses_offsets; /* (kv_cache_append_begin_claim) */
    bool attends_nf;  /* attention reads normal-float KV rows (KVQ_KV_NF) */
    void (*free)(struct backend *b);
    /* Sizes internal scratch for batches of up to max_tokens tokens whose widest
     * matmul input has `widest` values (so no step allocates). 0 or -1. */
    int (*reserve)(struct backend *b, int max_tokens, int64_t widest);
    /* Sizes what the backend keeps of the KV rows a forward pass appends, up to
     * `bytes` in all (CUDA: the device and pinned host buffers they are read back
     * through, which take long to make), so that no pass allocates. NULL where
     * nothing is kept. 0 or -1. */
    int (*reserve_kv)(struct backend *b, size_t bytes);
    /* Activation memory (freed with release). */
    void *(*alloc)(struct backend *b, size_t bytes);
    void (*release)(struct backend *b, void *p);
    /* Makes a weight, or a vector of n floats (norms, biases, RoPE frequencies),
     * usable by the backend, in whatever form it computes with (CPU: the host memory
     * as it is, or its own 16-row copy). Ops then name a weight by the descriptor
     * uploaded, which must outlive the backend. 0 or -1. */
    int (*upload_weight)(struct backend *b, const struct weight *w);
    int (*upload_vector)(struct backend *b, const float *v, int64_t n);
    /* Host memory that results (be_matmul.host_y) land in fastest (CUDA: pinned),
     * freed with host_free. NULL with an error. */
    void *(*host_alloc)(struct backend *b, size_t bytes);
    void (*host_free)(struct backend *b, void *p);
    /* Where the KV pool's blocks live: NULL for host memory. */
    struct kv_pool *(*kv_pool_new)(struct backend *b, size_t budget);
    /* Up to 3 products sharing the input x [n][x_stride]. */
    void (*matmul)(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs, const struct be_matmul *jobs);
    /* x[t] = scale * row tokens[t] of the embedding table. */
    void (*embed)(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x);
    /* out[i] = RMSNorm(x[rows ? rows[i] : i]) * w, rows of dim values. */
    void (*rmsnorm)(struct backend *b, const float *x, const int32_t *rows, const float *w, int n, int dim, float eps,
                    float *out);
    /* x[t] += RMSNorm(add[t]) * post (add as is when post is NULL); then, when w is
     * given, out[t] = RMSNorm(x[t]) * w. The residual stream of a layer. */
    void (*add_norm)(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                     float eps, float *out);
    /* cos/sin tables [n][half] of positions pos / linear at frequencies inv_freq[half]. */
    void (*rope_table)(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear, int half,
                       float *cos, float *sin);
    /* out[t] = act(gate[t]) * up[t], n_ff values per token. */
    void (*glu)(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff, float *out);
    /* Appends each sequence's keys and values (k, v: [batch tokens][n_kv * D]) to its
     * cache of one layer; when r is given (r->k == k), first norms and rotates the
     * batch's queries and keys in place, as one step (the CUDA backend does all of it
     * in one launch). 0, or -1 with an error (a cache full). */
    int (*kv_append)(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k, const float *v,
                     const struct be_rope *r);
    void (*attention)(struct backend *b, const struct be_attention *a, int n);
    /* Waits until every operation issued has finished. 0, or -1 with the error of
     * an operation since the last sync. */
    int (*sync)(struct backend *b);
    /* Settles n rows of `cols` logits at x (the output product's, in the backend's
     * memory) as d[n] says: applies each row's adjustments (ops[n_ops]) in place, finds
     * every row's BE_TOP_MAX largest and draws, as be_draw_out says; there after sync.
     * NULL where results are host memory anyway (the engine settles them). */
    void (*draw)(struct backend *b, float *x, int n, int cols, const struct be_draw *d, const struct be_draw_op *ops,
                 int n_ops, const struct be_draw_out *out);
    /* Copies `bytes` of backend memory at src to host_alloc memory at dst, there after
     * sync (between passes: a row of logits draw left where it was). */
    void (*read)(struct backend *b, void *dst, const void *src, size_t bytes);
    /* Runs fn over the backend's host threads, the caller's as ith 0 (between passes:
     * the engine's callers share them rather than start threads of their own). */
    void (*run_on_host_threads)(struct backend *b, kvq_task_fn fn, void *arg);
};

struct backend {
    const struct backend_ops *ops;
};

/* The CPU backend with n_threads workers (<= 0: one per CPU). NULL with an error. */
struct backend *backend_cpu_new(int n_threads);
/* The CUDA backend on the first GPU, with up to n_threads host threads for the host's
 * share of the work (<= 0: one per CPU); with tp > 1, tensor parallel over the GPUs
 * devices[0..tp) (NULL: 0..tp-1), tp <= 8 (cuda/tp_backend.c). NULL with an error
 * (none, or built without CUDA). */
struct backend *backend_cuda_new(int n_threads, bool f16_weights, int tp, const int *devices);

#endif
