/* The compute backend the forward pass runs on: a small table of operations over
 * activation buffers, weights and KV caches. forward.c says what a layer computes;
 * a backend says how and where.
 *
 * The CPU backend (cpu/cpu_backend.c) is the first implementation: buffers are host
 * memory, weights stay in the mapped GGUF file, work is split over a thread pool.
 * A CUDA backend plugs in as a second table: alloc returns device memory (the forward
 * pass never touches activations itself, it only passes them between operations),
 * upload_weight copies each tensor to the device in its GGUF type, kv_pool_alloc
 * places the KV blocks of the context's pool in device memory, and attention reads
 * the caches' block tables there; sync is where the host waits for the device. */
#ifndef KVQ_BACKEND_H
#define KVQ_BACKEND_H

#include <stddef.h>
#include <stdint.h>

struct weight;
struct kv_cache;
struct kv_pool;

/* y[n][w->rows] = x[n][k] W^T (+ bias[w->rows]). */
struct be_matmul {
    const struct weight *w;
    float *y;
    const float *bias;
};

/* Per-head RMSNorm (optional) and RoPE of the queries and keys of n tokens. */
struct be_rope {
    float *q, *k;                 /* [n][n_head][D], [n][n_kv][D] */
    int n_head, n_kv, head_dim;
    const float *q_norm, *k_norm; /* [D] or NULL */
    float eps;
    const float *cos, *sin;       /* [n][half]: the tables of the tokens' positions */
    int half;
    int pairing;                  /* enum rope_pairing */
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

struct backend;

struct backend_ops {
    const char *name;
    void (*free)(struct backend *b);
    /* Sizes internal scratch for batches of up to max_tokens tokens whose widest
     * matmul input has `widest` values (so no step allocates). 0 or -1. */
    int (*reserve)(struct backend *b, int max_tokens, int64_t widest);
    /* Activation memory (freed with release). */
    void *(*alloc)(struct backend *b, size_t bytes);
    void (*release)(struct backend *b, void *p);
    /* Makes a weight usable by the backend (CPU: the mapped file as it is). */
    int (*upload_weight)(struct backend *b, struct weight *w);
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
    void (*qk_rope)(struct backend *b, const struct be_rope *r, int n);
    /* out[t] = act(gate[t]) * up[t], n_ff values per token. */
    void (*glu)(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff, float *out);
    /* Appends n tokens' keys and values [n][n_kv * D] to one sequence's cache of a layer. */
    int (*kv_append)(struct backend *b, struct kv_cache *c, int n, const float *k, const float *v);
    void (*attention)(struct backend *b, const struct be_attention *a, int n);
    /* Waits until every operation issued has finished. */
    void (*sync)(struct backend *b);
};

struct backend {
    const struct backend_ops *ops;
};

/* The CPU backend with n_threads workers (<= 0: one per CPU). NULL with an error. */
struct backend *backend_cpu_new(int n_threads);

#endif
