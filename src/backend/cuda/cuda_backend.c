/* The CUDA backend: the model's weights in device memory in their GGUF types,
 * activations in device memory, and a device copy of the KV cache that attention
 * reads.
 *
 * The KV policy (positions, windows, block tables, conversion, save/load) stays on
 * the host, on the host rows of a mirrored pool (kv_pool.h). kv_append makes the
 * host's changes of an append (kv_cache_append_begin), and the device encodes the new
 * rows into its blocks and windows (kv_encode.cu); the rows come back to the host
 * once per step, at sync (kv_cache_append_end). What the host changed otherwise
 * (rows of forks, trims, loads, conversions; windows after an epoch change) goes to
 * the device in one staging upload and one scatter launch before the kernels that
 * read it. Products of Q4_0/Q8_0 weights read inputs rounded to int8 (xq); the norm,
 * GLU or attention that writes an input rounds it too, so no launch does that alone.
 *
 * Host data for a step goes through one pinned staging buffer, uploaded in order on
 * the backend's one stream; it is reused only after the stream has been waited for
 * (kv_append and sync do). Errors of operations that return nothing are kept and
 * reported by sync. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"
#include "model/model.h"

#define ARENA_CHUNK ((size_t)256 << 20) /* KV block memory is taken in chunks of this */
#define DEQ_FLOATS ((size_t)32 << 20)   /* a band of dequantized rows for one GEMM */
#define MAX_FORMATS 4                   /* row formats in one attention batch */

/* A weight or vector the model uploaded, found by its host address. */
struct dev_entry {
    const uint8_t *host; /* a struct weight's address, or a vector's data */
    size_t bytes;
    uint8_t *dev;
    struct cuk_weight w; /* weights only */
};

/* Memory that lives as long as the backend: KV blocks on the host (pinned) and on
 * the device. */
struct arena {
    uint8_t *base;
    size_t used, cap;
    bool pinned;
    struct arena *next;
};

/* The device copy of one cache's f16 windows and offsets. */
struct cuda_mirror {
    bool valid;
    uint32_t epoch;
    int32_t synced; /* window rows of positions < synced are on the device */
    int32_t ring_cap, sink_cap, n_kv, head_dim;
    size_t win_row;
    uint8_t *win; /* ring [2][n_kv][ring_cap][win_row], then sinks [2][n_kv][sink_cap][win_row] */
    float *mu;    /* [2][n_kv][head_dim] */
    bool has_mu;
};

/* One sequence's rows of one layer, encoded on the device, waiting for the host's copy. */
struct pending_append {
    struct kv_cache *cache;
    int32_t p0;
    int n;
    size_t k, v, wk, wv; /* offsets in the read-back buffer */
    bool windows;
};

struct cuda_backend {
    struct backend base;
    cudaStream_t stream;
    cublasHandle_t blas;
    int n_sm, max_tokens;
    bool failed;
    char failure[256];
    struct dev_entry *ents;
    int n_ents, cap_ents;
    float *deq;
    struct cuk_xq xq; /* int8 inputs of the repacked types' matrix-vector kernels */
    int64_t xq_cols;  /* xq holds up to CUK_MATVEC_MAX rows of this many */
    /* what xq holds: the rounding of xq_n rows of xq_k floats at xq_of (written by the
     * norm or GLU that made them, so the product after it needs no rounding launch) */
    const float *xq_of;
    int xq_n;
    int64_t xq_k;
    bool any_repacked; /* a weight of a repacked type was uploaded */
    float *part;
    size_t part_floats;
    float *signs; /* Hadamard signs of head size signs_dim */
    int signs_dim;
    uint8_t *stage_h, *stage_d;
    size_t stage_cap, stage_used;
    struct cuk_copy *copies;
    int n_copies, cap_copies;
    /* rows the device encoded this step, for the host's copy at the next sync */
    struct pending_append *pending;
    int n_pending, cap_pending;
    uint8_t *rb_d, *rb_h;
    size_t rb_used, rb_cap, rb_h_cap;
    int *seq_fmt, cap_seq_fmt;
    struct arena *host_arena, *dev_arena;
    /* per attention call */
    struct kv_cache **uc;
    uint32_t *uc_table;
    struct cuda_mirror **uc_mirror;
    int cap_uc;
    bool prof;
    double prof_s[16];
    long prof_n[16];
};

static struct cuda_backend *cuda(struct backend *b) { return (struct cuda_backend *)b; }

/* KVQ_CUDA_PROFILE=1: each operation waits for the GPU before and after itself and
 * its time is added up per kind, printed when the backend is freed (a measurement
 * aid: the waits serialize what normally overlaps). */
enum prof_op { P_MATVEC, P_GEMM, P_NORM, P_ROPE, P_GLU, P_EMBED, P_KV_ENCODE, P_KV_FINISH, P_ATTN_HOST, P_ATTN_GPU, P_N };
static const char *const prof_names[P_N] = {"matvec", "gemm (dequantize + TF32)", "norms", "rope", "glu", "embed",
                                            "kv_append: host plan + device encode", "sync: host copy of new KV rows",
                                            "attention: host plan + uploads", "attention: kernels"};
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static double prof_begin(struct cuda_backend *cb) {
    if (!cb->prof) return 0;
    cudaStreamSynchronize(cb->stream);
    return now_s();
}
static void prof_end(struct cuda_backend *cb, enum prof_op op, double t0) {
    if (!cb->prof) return;
    cudaStreamSynchronize(cb->stream);
    cb->prof_s[op] += now_s() - t0;
    cb->prof_n[op]++;
}

/* Records the first failure; sync reports it. */
static bool ck(struct cuda_backend *cb, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "CUDA: %s: %s", what, cudaGetErrorString(e));
    }
    return false;
}

static bool ck_blas(struct cuda_backend *cb, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "cuBLAS: %s failed (status %d)", what, (int)st);
    }
    return false;
}

/* ---- uploaded model ------------------------------------------------------ */

static int ent_cmp(const void *a, const void *b) {
    const struct dev_entry *x = a, *y = b;
    return x->host < y->host ? -1 : x->host > y->host;
}

/* The entry whose host range holds p (entries sorted by host address). */
static const struct dev_entry *find(const struct cuda_backend *cb, const void *p) {
    const uint8_t *q = p;
    int lo = 0, hi = cb->n_ents - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        const struct dev_entry *e = &cb->ents[mid];
        if (q < e->host) hi = mid - 1;
        else if (q >= e->host + e->bytes) lo = mid + 1;
        else return e;
    }
    return NULL;
}

static const float *dev_vec(struct cuda_backend *cb, const float *host) {
    if (!host) return NULL;
    const struct dev_entry *e = find(cb, host);
    if (!e) {
        ck(cb, cudaErrorInvalidValue, "a vector the model did not upload");
        return NULL;
    }
    return (const float *)(e->dev + ((const uint8_t *)host - e->host));
}

static const struct cuk_weight *dev_weight(struct cuda_backend *cb, const struct weight *w) {
    const struct dev_entry *e = find(cb, w);
    if (!e || !e->w.data) {
        ck(cb, cudaErrorInvalidValue, "a weight the model did not upload");
        return NULL;
    }
    return &e->w;
}

static int add_entry(struct cuda_backend *cb, const void *host, size_t bytes, const void *data, size_t data_bytes,
                     struct dev_entry **out) {
    if (find(cb, host)) { /* uploaded already (a tied output matrix, say) */
        *out = NULL;
        return 0;
    }
    if (cb->n_ents == cb->cap_ents) {
        int cap = cb->cap_ents ? 2 * cb->cap_ents : 256;
        struct dev_entry *e = realloc(cb->ents, sizeof *e * (size_t)cap);
        if (!e) return kvq_error("out of memory");
        cb->ents = e;
        cb->cap_ents = cap;
    }
    struct dev_entry *e = &cb->ents[cb->n_ents];
    memset(e, 0, sizeof *e);
    e->host = host;
    e->bytes = bytes;
    cudaError_t st = cudaMalloc((void **)&e->dev, data_bytes ? data_bytes : 1);
    if (st != cudaSuccess) return kvq_error("CUDA: no device memory for %zu bytes of weights (%s)", data_bytes, cudaGetErrorString(st));
    st = cudaMemcpy(e->dev, data, data_bytes, cudaMemcpyHostToDevice);
    if (st != cudaSuccess) {
        cudaFree(e->dev);
        return kvq_error("CUDA: copying weights: %s", cudaGetErrorString(st));
    }
    cb->n_ents++;
    qsort(cb->ents, (size_t)cb->n_ents, sizeof *cb->ents, ent_cmp);
    *out = (struct dev_entry *)find(cb, host);
    return 0;
}

static int cuda_upload_weight(struct backend *b, const struct weight *w) {
    struct cuda_backend *cb = cuda(b);
    if (!cuk_type_supported(w->type) || w->cols % 8 != 0)
        return kvq_error("the CUDA backend cannot multiply %s weights of %lld columns", kvq_dtype_name(w->type),
                         (long long)w->cols);
    struct dev_entry *e;
    if (!cuk_repacked(w->type)) {
        if (add_entry(cb, w, sizeof *w, w->data, w->row_bytes * (size_t)w->rows, &e) != 0) return -1;
        if (e) e->w = (struct cuk_weight){w->type, e->dev, w->rows, w->cols, w->row_bytes, NULL};
        return 0;
    }
    /* codes, then the scales, in one device allocation */
    const size_t rb = cuk_repacked_row_bytes(w->type, w->cols), codes = rb * (size_t)w->rows;
    const size_t bytes = codes + sizeof(uint16_t) * (size_t)w->rows * (size_t)(w->cols / 32);
    uint8_t *host = malloc(bytes);
    if (!host) return kvq_error("out of memory repacking a weight of %zu bytes", bytes);
    cuk_repack(w->type, w->data, w->rows, w->cols, host, (uint16_t *)(host + codes));
    int rc = add_entry(cb, w, sizeof *w, host, bytes, &e);
    free(host);
    if (rc != 0) return -1;
    if (e) e->w = (struct cuk_weight){w->type, e->dev, w->rows, w->cols, rb, (const uint16_t *)(e->dev + codes)};
    cb->any_repacked = true;
    return 0;
}

static int cuda_upload_vector(struct backend *b, const float *v, int64_t n) {
    struct dev_entry *e;
    return add_entry(cuda(b), v, sizeof(float) * (size_t)n, v, sizeof(float) * (size_t)n, &e);
}

/* ---- staging: host data for the device, in stream order ---------------- */

/* Room for `bytes` more at an aligned offset; the offset, or (size_t)-1. Growing
 * waits for the stream first (earlier uploads may still read the old buffer). */
static size_t stage_alloc(struct cuda_backend *cb, size_t bytes) {
    size_t off = (cb->stage_used + 15) & ~(size_t)15;
    if (off + bytes > cb->stage_cap) {
        size_t cap = cb->stage_cap ? cb->stage_cap : (size_t)1 << 20;
        while (cap < off + bytes) cap *= 2;
        uint8_t *h = NULL, *d = NULL;
        if (!ck(cb, cudaStreamSynchronize(cb->stream), "waiting for the stream") ||
            !ck(cb, cudaMallocHost((void **)&h, cap), "pinned staging memory") ||
            !ck(cb, cudaMalloc((void **)&d, cap), "device staging memory")) {
            if (h) cudaFreeHost(h);
            return (size_t)-1;
        }
        if (cb->stage_used) memcpy(h, cb->stage_h, cb->stage_used);
        cudaFreeHost(cb->stage_h);
        cudaFree(cb->stage_d);
        cb->stage_h = h;
        cb->stage_d = d;
        cb->stage_cap = cap;
    }
    cb->stage_used = off + bytes;
    return off;
}

static size_t stage_put(struct cuda_backend *cb, const void *data, size_t bytes) {
    size_t off = stage_alloc(cb, bytes);
    if (off != (size_t)-1 && bytes) memcpy(cb->stage_h + off, data, bytes);
    return off;
}

/* Uploads the staging bytes from `from` on. */
static void stage_flush(struct cuda_backend *cb, size_t from) {
    if (cb->stage_used > from)
        ck(cb, cudaMemcpyAsync(cb->stage_d + from, cb->stage_h + from, cb->stage_used - from, cudaMemcpyHostToDevice,
                               cb->stream),
           "uploading step data");
}

/* A host array as device memory for the next launch (NULL on failure). */
static const void *stage_array(struct cuda_backend *cb, const void *data, size_t bytes) {
    size_t from = cb->stage_used, off = stage_put(cb, data, bytes);
    if (off == (size_t)-1) return NULL;
    stage_flush(cb, from);
    return cb->stage_d + off;
}

/* Queues a copy of bytes at data to the device address dst (done by flush_copies). */
static bool copy_to(struct cuda_backend *cb, const void *dst, const void *data, size_t bytes) {
    size_t off = stage_put(cb, data, bytes);
    if (off == (size_t)-1) return false;
    if (cb->n_copies == cb->cap_copies) {
        int cap = cb->cap_copies ? 2 * cb->cap_copies : 1024;
        struct cuk_copy *c = realloc(cb->copies, sizeof *c * (size_t)cap);
        if (!c) return ck(cb, cudaErrorMemoryAllocation, "host memory for copies");
        cb->copies = c;
        cb->cap_copies = cap;
    }
    cb->copies[cb->n_copies++] = (struct cuk_copy){(uint64_t)(uintptr_t)dst, (uint32_t)off, (uint32_t)bytes};
    return true;
}

/* Uploads everything staged since `from`, then places the queued copies. */
static void flush_copies(struct cuda_backend *cb, size_t from) {
    size_t list = cb->n_copies ? stage_put(cb, cb->copies, sizeof *cb->copies * (size_t)cb->n_copies) : 0;
    stage_flush(cb, from);
    if (cb->n_copies && list != (size_t)-1)
        cuk_scatter(cb->stream, (const struct cuk_copy *)(cb->stage_d + list), cb->n_copies, cb->stage_d);
    cb->n_copies = 0;
}

/* ---- memory ------------------------------------------------------------- */

static void *arena_alloc(struct cuda_backend *cb, struct arena **list, bool pinned, size_t bytes) {
    bytes = (bytes + 255) & ~(size_t)255;
    struct arena *a = *list;
    if (!a || a->used + bytes > a->cap) {
        size_t cap = bytes > ARENA_CHUNK ? bytes : ARENA_CHUNK;
        struct arena *n = calloc(1, sizeof *n);
        if (!n) return NULL;
        cudaError_t st = pinned ? cudaMallocHost((void **)&n->base, cap) : cudaMalloc((void **)&n->base, cap);
        if (st != cudaSuccess) {
            free(n);
            kvq_error("CUDA: no %s memory for the KV cache (%s)", pinned ? "pinned host" : "device", cudaGetErrorString(st));
            return NULL;
        }
        n->cap = cap;
        n->pinned = pinned;
        n->next = a;
        *list = a = n;
    }
    void *p = a->base + a->used;
    a->used += bytes;
    (void)cb;
    return p;
}

static void arena_free(struct arena *a) {
    while (a) {
        struct arena *n = a->next;
        if (a->pinned) cudaFreeHost(a->base);
        else cudaFree(a->base);
        free(a);
        a = n;
    }
}

static void *host_block(void *ctx, size_t bytes) {
    struct cuda_backend *cb = ctx;
    return arena_alloc(cb, &cb->host_arena, true, bytes);
}
static void *dev_block(void *ctx, size_t bytes) {
    struct cuda_backend *cb = ctx;
    return arena_alloc(cb, &cb->dev_arena, false, bytes);
}
static void mirror_free(void *ctx, void *mirror) {
    (void)ctx;
    struct cuda_mirror *m = mirror;
    if (!m) return;
    cudaFree(m->win);
    cudaFree(m->mu);
    free(m);
}

static struct kv_pool *cuda_kv_pool_new(struct backend *b, size_t budget) {
    struct kv_pool_mirror m = {cuda(b), host_block, dev_block, mirror_free};
    return kv_pool_new_mirrored(budget, &m);
}

static void *cuda_alloc(struct backend *b, size_t bytes) {
    void *p = NULL;
    cudaError_t st = cudaMalloc(&p, bytes ? bytes : 1);
    if (st != cudaSuccess) {
        kvq_error("CUDA: no device memory for %zu bytes (%s)", bytes, cudaGetErrorString(st));
        (void)b;
        return NULL;
    }
    return p;
}
static void cuda_release(struct backend *b, void *p) {
    (void)b;
    cudaFree(p);
}

static void cuda_download(struct backend *b, void *dst, const void *src, size_t bytes) {
    struct cuda_backend *cb = cuda(b);
    ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "reading results");
}

static int cuda_reserve(struct backend *b, int max_tokens, int64_t widest) {
    struct cuda_backend *cb = cuda(b);
    (void)widest;
    cb->max_tokens = max_tokens;
    if (max_tokens > CUK_MATVEC_MAX && !cb->deq && !(cb->deq = cuda_alloc(b, sizeof(float) * DEQ_FLOATS))) return -1;
    const size_t n = (size_t)(max_tokens < CUK_MATVEC_MAX ? max_tokens : CUK_MATVEC_MAX);
    cudaFree(cb->xq.q);
    cudaFree(cb->xq.dsum);
    cb->xq.q = cuda_alloc(b, n * (size_t)widest);
    cb->xq.dsum = cuda_alloc(b, sizeof(float2) * n * (size_t)(widest / 32 + 1));
    cb->xq_cols = widest;
    cb->xq_of = NULL;
    return cb->xq.q && cb->xq.dsum ? 0 : -1;
}

/* ---- dense operations ----------------------------------------------------- */

/* xq for an operation writing n rows of k floats at out, which it rounds into xq as
 * well when a product of a repacked type may read them; NULL when it need not. */
static const struct cuk_xq *round_into_xq(struct cuda_backend *cb, const float *out, int n, int64_t k) {
    cb->xq_of = NULL;
    if (!out || !cb->any_repacked || n > CUK_MATVEC_MAX || k % 32 != 0 || k > cb->xq_cols) return NULL;
    cb->xq_of = out;
    cb->xq_n = n;
    cb->xq_k = k;
    return &cb->xq;
}

static void cuda_matmul(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs,
                        const struct be_matmul *jobs) {
    struct cuda_backend *cb = cuda(b);
    double t0 = prof_begin(cb);
    if (n <= CUK_MATVEC_MAX) {
        struct cuk_matvec_job mj[CUK_MATVEC_JOBS];
        bool repacked = false;
        for (int j = 0; j < n_jobs && j < CUK_MATVEC_JOBS; j++) {
            mj[j] = (struct cuk_matvec_job){dev_weight(cb, jobs[j].w), jobs[j].y, dev_vec(cb, jobs[j].bias)};
            if (!mj[j].w) return;
            repacked |= cuk_repacked(mj[j].w->type) != 0;
        }
        const int64_t k = mj[0].w->cols;
        if (repacked && !(cb->xq_of == x && cb->xq_n == n && cb->xq_k == k && x_stride == k)) {
            cuk_quantize_x(cb->stream, x, x_stride, n, k, &cb->xq); /* the jobs share x: rounded once */
            cb->xq_of = x_stride == k ? x : NULL;
            cb->xq_n = n;
            cb->xq_k = k;
        }
        cuk_matvec(cb->stream, mj, n_jobs < CUK_MATVEC_JOBS ? n_jobs : CUK_MATVEC_JOBS, x, x_stride, &cb->xq, n);
        prof_end(cb, P_MATVEC, t0);
        return;
    }
    cb->xq_of = NULL;
    for (int j = 0; j < n_jobs; j++) {
        const struct cuk_weight *w = dev_weight(cb, jobs[j].w);
        const float *bias = dev_vec(cb, jobs[j].bias);
        if (!w) return;
        /* wide batches: bands of rows dequantized for a TF32 GEMM (y^T = W x^T, column-major) */
        const float one = 1.0f, zero = 0.0f;
        int64_t band = (int64_t)(DEQ_FLOATS / (size_t)w->cols);
        if (band > w->rows) band = w->rows;
        for (int64_t r0 = 0; r0 < w->rows; r0 += band) {
            int64_t r1 = r0 + band < w->rows ? r0 + band : w->rows;
            cuk_dequantize(cb->stream, w, r0, r1, cb->deq);
            if (!ck_blas(cb,
                         cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)(r1 - r0), n, (int)w->cols, &one, cb->deq,
                                      CUDA_R_32F, (int)w->cols, x, CUDA_R_32F, (int)x_stride, &zero, jobs[j].y + r0,
                                      CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT),
                         "GEMM"))
                return;
        }
        if (bias) cuk_add_bias(cb->stream, jobs[j].y, bias, n, w->rows);
    }
    prof_end(cb, P_GEMM, t0);
}

static void cuda_embed(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x) {
    struct cuda_backend *cb = cuda(b);
    const struct cuk_weight *w = dev_weight(cb, e);
    double t0 = prof_begin(cb);
    const int32_t *t = stage_array(cb, tokens, sizeof(int32_t) * (size_t)n);
    cb->xq_of = NULL;
    if (w && t) cuk_embed(cb->stream, w, t, n, scale, x);
    prof_end(cb, P_EMBED, t0);
}

/* The norm kernels hold a row in registers: rows up to CUK_NORM_MAX values. */
static bool norm_dim_ok(struct cuda_backend *cb, int dim) {
    if (dim <= CUK_NORM_MAX) return true;
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "the CUDA norms take rows of up to %d values, not %d", CUK_NORM_MAX,
                 dim);
    }
    return false;
}

static void cuda_rmsnorm(struct backend *b, const float *x, const int32_t *rows, const float *w, int n, int dim,
                         float eps, float *out) {
    struct cuda_backend *cb = cuda(b);
    if (!norm_dim_ok(cb, dim)) return;
    const int32_t *r = rows ? stage_array(cb, rows, sizeof(int32_t) * (size_t)n) : NULL;
    const float *wd = dev_vec(cb, w);
    if ((rows && !r) || !wd) return;
    double t0 = prof_begin(cb);
    cuk_rmsnorm(cb->stream, x, r, wd, n, dim, eps, out, round_into_xq(cb, out, n, dim));
    prof_end(cb, P_NORM, t0);
}

static void cuda_add_norm(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                          float eps, float *out) {
    struct cuda_backend *cb = cuda(b);
    if (!norm_dim_ok(cb, dim)) return;
    double t0 = prof_begin(cb);
    const struct cuk_xq *xq = round_into_xq(cb, w ? out : NULL, w ? n : 0, dim);
    cuk_add_norm(cb->stream, x, add, dev_vec(cb, post), dev_vec(cb, w), n, dim, eps, out, xq);
    prof_end(cb, P_NORM, t0);
}

static void cuda_rope_table(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear,
                            int half, float *cos, float *sin) {
    struct cuda_backend *cb = cuda(b);
    const int32_t *p = stage_array(cb, pos, sizeof(int32_t) * (size_t)n);
    const float *f = dev_vec(cb, inv_freq);
    if (p && f) cuk_rope_table(cb->stream, p, n, f, linear, half, cos, sin);
}

static void cuda_qk_rope(struct backend *b, const struct be_rope *r, int n) {
    struct cuda_backend *cb = cuda(b);
    double t0 = prof_begin(cb);
    cb->xq_of = NULL;
    cuk_qk_rope(cb->stream, r->q, r->k, n, r->n_head, r->n_kv, r->head_dim, dev_vec(cb, r->q_norm),
                dev_vec(cb, r->k_norm), r->eps, r->cos, r->sin, r->half, r->pairing);
    prof_end(cb, P_ROPE, t0);
}

static void cuda_glu(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff,
                     float *out) {
    struct cuda_backend *cb = cuda(b);
    double t0 = prof_begin(cb);
    cuk_glu(cb->stream, act == BE_GLU_GELU_TANH, gate, up, n, n_ff, out, round_into_xq(cb, out, n, n_ff));
    prof_end(cb, P_GLU, t0);
}

/* ---- KV cache ----------------------------------------------------------- */

/* Waits for the stream; staged data may then be overwritten. */
static int wait_stream(struct cuda_backend *cb) {
    ck(cb, cudaStreamSynchronize(cb->stream), "running the step");
    ck(cb, cudaGetLastError(), "a kernel launch");
    cb->stage_used = 0;
    if (cb->failed) return kvq_error("%s", cb->failure);
    return 0;
}

/* The device copy of a cache's windows, made current up to position `limit` (the
 * rows from there on are being encoded on the device): rows appended since the last
 * sync, or all of them after a change that was not an append (kv_cache_epoch). */
static struct cuda_mirror *sync_windows(struct cuda_backend *cb, struct kv_cache *c, const struct kv_view *v,
                                        int32_t limit) {
    struct cuda_mirror **mp = (struct cuda_mirror **)kv_cache_mirror(c), *m = *mp;
    const struct kv_shape *sh = kv_cache_get_shape(c);
    const int H = sh->n_kv_heads, D = sh->head_dim;
    if (!m) {
        m = calloc(1, sizeof *m);
        if (!m) {
            ck(cb, cudaErrorMemoryAllocation, "host memory");
            return NULL;
        }
        m->ring_cap = v->win_span + cb->max_tokens;
        m->sink_cap = v->sinks > 0 ? v->sinks : 1;
        m->n_kv = H;
        m->head_dim = D;
        m->win_row = v->win_row;
        size_t bytes = 2 * (size_t)H * (size_t)(m->ring_cap + m->sink_cap) * v->win_row;
        if (!ck(cb, cudaMalloc((void **)&m->win, bytes), "device memory for KV windows") ||
            !ck(cb, cudaMalloc((void **)&m->mu, sizeof(float) * 2 * (size_t)H * D), "device memory for KV offsets")) {
            mirror_free(cb, m);
            return NULL;
        }
        *mp = m;
    }
    const int32_t np = kv_cache_n_past(c) < limit ? kv_cache_n_past(c) : limit;
    const bool full = !m->valid || m->epoch != kv_cache_epoch(c);
    int32_t lo = full ? 0 : m->synced;
    if (lo < np - m->ring_cap) lo = np - m->ring_cap;
    uint8_t *sink = m->win + 2 * (size_t)H * m->ring_cap * m->win_row;
    for (int side = 0; side < 2; side++)
        for (int h = 0; h < H; h++) {
            const size_t hs = (size_t)side * H + h;
            for (int32_t p = full ? 0 : lo; p < np && p < v->sinks; p++) {
                const uint8_t *row = kv_cache_window_row(c, side, h, p);
                if (row) copy_to(cb, sink + (hs * m->sink_cap + p) * m->win_row, row, m->win_row);
            }
            for (int32_t p = lo; p < np; p++) {
                const uint8_t *row = kv_cache_window_row(c, side, h, p);
                if (row) copy_to(cb, m->win + (hs * m->ring_cap + p % m->ring_cap) * m->win_row, row, m->win_row);
            }
        }
    if (full) {
        m->has_mu = v->mu != NULL;
        if (v->mu) copy_to(cb, m->mu, v->mu, sizeof(float) * 2 * (size_t)H * D);
    }
    m->valid = true;
    m->epoch = kv_cache_epoch(c);
    m->synced = kv_cache_n_past(c);
    return m;
}

/* Queues the rows written into blocks since the last step. */
static int sync_blocks(struct cuda_backend *cb, struct kv_pool *pool, const struct kv_view *v, int n_kv, bool rows) {
    struct kv_block **blocks;
    int n = kv_pool_take_dirty(pool, &blocks);
    if (n < 0) return -1;
    for (int i = 0; i < n; i++) {
        struct kv_block *b = blocks[i];
        const int32_t lo = b->dirty_lo, hi = b->dirty_hi;
        b->dirty_lo = b->dirty_hi = 0;
        if (b->refs <= 0 || lo >= hi) continue;
        const size_t bytes = kv_block_bytes(pool, b);
        if (!rows || 2 * (hi - lo) >= KV_BLOCK_TOKENS || bytes != (size_t)n_kv * v->head_bytes) {
            /* most of the block (or a block of another layout): all of it, straight from pinned memory */
            ck(cb, cudaMemcpyAsync(b->dev, b->data, bytes, cudaMemcpyHostToDevice, cb->stream), "copying KV blocks");
            continue;
        }
        for (int h = 0; h < n_kv; h++) {
            size_t kh = (size_t)h * v->head_bytes, vh = kh + KV_BLOCK_TOKENS * v->k_row;
            copy_to(cb, (uint8_t *)b->dev + kh + lo * v->k_row, b->data + kh + lo * v->k_row, (hi - lo) * v->k_row);
            copy_to(cb, (uint8_t *)b->dev + vh + lo * v->v_row, b->data + vh + lo * v->v_row, (hi - lo) * v->v_row);
        }
    }
    return 0;
}

static bool same_format(const struct kv_view *a, const struct kv_view *b) {
    return a->k_bits == b->k_bits && a->v_bits == b->v_bits && a->k_group == b->k_group &&
           a->v_group == b->v_group && a->k_rot == b->k_rot && a->v_rot == b->v_rot;
}

/* The Hadamard signs on the device: the same for every cache of a head size (a fixed seed). */
static int ensure_signs(struct cuda_backend *cb, int D, const float *host) {
    if (cb->signs_dim == D) return 0;
    cudaFree(cb->signs);
    cb->signs = NULL;
    cb->signs_dim = 0;
    if (!ck(cb, cudaMalloc((void **)&cb->signs, sizeof(float) * (size_t)D), "device memory") ||
        !ck(cb, cudaMemcpy(cb->signs, host, sizeof(float) * (size_t)D, cudaMemcpyHostToDevice), "signs"))
        return -1;
    cb->signs_dim = D;
    return 0;
}

/* Room for `bytes` more of read-back rows this step (device; kept across a resize). */
static size_t readback_alloc(struct cuda_backend *cb, size_t bytes) {
    size_t off = (cb->rb_used + 15) & ~(size_t)15;
    if (off + bytes > cb->rb_cap) {
        size_t cap = cb->rb_cap ? 2 * cb->rb_cap : (size_t)16 << 20;
        while (cap < off + bytes) cap *= 2;
        uint8_t *d = NULL;
        if (!ck(cb, cudaMalloc((void **)&d, cap), "device memory for new KV rows")) return (size_t)-1;
        if (cb->rb_used) ck(cb, cudaMemcpyAsync(d, cb->rb_d, cb->rb_used, cudaMemcpyDeviceToDevice, cb->stream), "KV rows");
        ck(cb, cudaStreamSynchronize(cb->stream), "waiting for the stream");
        cudaFree(cb->rb_d);
        cb->rb_d = d;
        cb->rb_cap = cap;
    }
    cb->rb_used = off + bytes;
    return off;
}

/* The layer's new keys and values, encoded into the device cache; the host's copy of
 * the rows follows at the next sync (kv_cache_append_begin / _end). */
static int cuda_kv_append(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k,
                          const float *v) {
    struct cuda_backend *cb = cuda(b);
    if (n_seqs <= 0 || cb->failed) return cb->failed ? kvq_error("%s", cb->failure) : 0;
    double t0 = prof_begin(cb);
    const struct kv_shape *sh = kv_cache_get_shape(seqs[0].cache);
    const int H = sh->n_kv_heads, D = sh->head_dim;
    if (!cuk_attention_head_dim_supported(D))
        return kvq_error("the CUDA backend takes head sizes 64, 128 and 256, not %d", D);
    if (cb->n_pending + n_seqs > cb->cap_pending) {
        int cap = 2 * (cb->n_pending + n_seqs);
        struct pending_append *pa = realloc(cb->pending, sizeof *pa * (size_t)cap);
        if (!pa) return kvq_error("out of memory");
        cb->pending = pa;
        cb->cap_pending = cap;
    }
    for (int s = 0; s < n_seqs; s++) {
        if (kv_cache_append_begin(seqs[s].cache, seqs[s].n) != 0) {
            cb->n_pending = 0; /* the forward pass drops this batch's rows */
            return -1;
        }
    }
    const size_t from = cb->stage_used;
    size_t toks_off = stage_alloc(cb, sizeof(struct cuk_enc_tok) * (size_t)(seqs[n_seqs - 1].first + seqs[n_seqs - 1].n));
    if (toks_off == (size_t)-1) return kvq_error("%s", cb->failure);
    struct kv_view views[MAX_FORMATS];
    int n_fmt = 0, k_tok = 0;
    int first[MAX_FORMATS + 1] = {0};
    if (n_seqs > cb->cap_seq_fmt) {
        free(cb->seq_fmt);
        cb->seq_fmt = malloc(sizeof(int) * (size_t)n_seqs);
        cb->cap_seq_fmt = cb->seq_fmt ? n_seqs : 0;
        if (!cb->seq_fmt) return kvq_error("out of memory");
    }
    /* windows of each cache up to this batch, then its encode descriptors, grouped by format */
    for (int pass = 0; pass < 2; pass++) {
        for (int f = 0; f < (pass ? n_fmt : 1); f++) {
            if (pass) first[f] = k_tok;
            for (int s = 0; s < n_seqs; s++) {
                struct kv_cache *c = seqs[s].cache;
                struct kv_view v;
                kv_cache_view(c, &v);
                const int32_t p0 = kv_cache_n_past(c) - seqs[s].n;
                if (!pass) {
                    int g = 0;
                    while (g < n_fmt && !same_format(&views[g], &v)) g++;
                    if (g == n_fmt) {
                        if (n_fmt == MAX_FORMATS) return kvq_error("more than 4 KV formats in one batch");
                        views[n_fmt++] = v;
                    }
                    cb->seq_fmt[s] = g;
                    continue;
                }
                if (cb->seq_fmt[s] != f) continue;
                struct cuda_mirror *m = v.windows ? sync_windows(cb, c, &v, p0) : NULL;
                if (v.windows && !m) return kvq_error("%s", cb->failure);
                const size_t n = (size_t)seqs[s].n, kb = n * H * v.k_row, vb = n * H * v.v_row,
                             wb = v.windows ? n * H * v.win_row : 0;
                size_t rb = readback_alloc(cb, kb + vb + 2 * wb);
                if (rb == (size_t)-1) return kvq_error("%s", cb->failure);
                cb->pending[cb->n_pending++] = (struct pending_append){c, p0, seqs[s].n, rb, rb + kb, rb + kb + vb,
                                                                       rb + kb + vb + wb, v.windows};
                for (int i = 0; i < seqs[s].n; i++, k_tok++) {
                    const int32_t p = p0 + i, L = p / KV_BLOCK_TOKENS, e = L < v.nkb ? L : L - v.base;
                    struct cuk_enc_tok *tk = (struct cuk_enc_tok *)(cb->stage_h + toks_off) + k_tok;
                    *tk = (struct cuk_enc_tok){
                        .t = seqs[s].first + i, .p = p, .block = (uint64_t)(uintptr_t)v.blk[e]->dev,
                        .ring = m ? (uint64_t)(uintptr_t)m->win : 0,
                        .sink = m ? (uint64_t)(uintptr_t)(m->win + 2 * (size_t)H * m->ring_cap * m->win_row) : 0,
                        .ring_cap = m ? m->ring_cap : 1, .sink_cap = m ? m->sink_cap : 1, .sinks = v.sinks,
                        .mu = m && m->has_mu ? (uint64_t)(uintptr_t)m->mu : 0,
                        .rb_k = (uint32_t)(rb + (size_t)i * H * v.k_row),
                        .rb_v = (uint32_t)(rb + kb + (size_t)i * H * v.v_row),
                        .rb_wk = (uint32_t)(rb + kb + vb + (size_t)i * H * v.win_row),
                        .rb_wv = (uint32_t)(rb + kb + vb + wb + (size_t)i * H * v.win_row),
                    };
                }
            }
        }
    }
    first[n_fmt] = k_tok;
    /* blocks made or copied by the appends (and anything else changed on the host) first:
     * the encode below writes over their new rows */
    if (sync_blocks(cb, kv_cache_pool(seqs[0].cache), &views[0], H, n_fmt == 1) != 0) return -1;
    flush_copies(cb, from);
    if (ensure_signs(cb, D, views[0].signs) != 0) return kvq_error("%s", cb->failure);
    for (int f = 0; f < n_fmt; f++) {
        const struct kv_view *vw = &views[f];
        struct cuk_enc_args args = {
            .k_bits = vw->k_bits, .k_group = vw->k_group, .v_bits = vw->v_bits, .v_group = vw->v_group,
            .k_rot = vw->k_rot, .v_rot = vw->v_rot, .windows = vw->windows, .k_row = vw->k_row, .v_row = vw->v_row,
            .head_bytes = vw->head_bytes, .win_row = vw->win_row, .n_kv = H, .head_dim = D, .k = k, .v = v,
            .signs = cb->signs, .toks = (const struct cuk_enc_tok *)(cb->stage_d + toks_off) + first[f],
            .n = first[f + 1] - first[f], .readback = cb->rb_d,
        };
        cuk_kv_encode(cb->stream, &args);
    }
    prof_end(cb, P_KV_ENCODE, t0);
    return cb->failed ? kvq_error("%s", cb->failure) : 0;
}

/* After the step: the host's copy of the rows the device encoded. */
static int finish_appends(struct cuda_backend *cb) {
    int rc = 0;
    double t0 = prof_begin(cb);
    for (int i = 0; i < cb->n_pending && rc == 0; i++) {
        const struct pending_append *pa = &cb->pending[i];
        const uint8_t *h = cb->rb_h;
        rc = kv_cache_append_end(pa->cache, pa->p0, pa->n, h + pa->k, h + pa->v, pa->windows ? h + pa->wk : NULL,
                                 pa->windows ? h + pa->wv : NULL);
    }
    cb->n_pending = 0;
    cb->rb_used = 0;
    prof_end(cb, P_KV_FINISH, t0);
    return rc;
}

static void cuda_attention(struct backend *b, const struct be_attention *a, int n) {
    struct cuda_backend *cb = cuda(b);
    cb->xq_of = NULL;
    if (n <= 0 || cb->failed) return;
    const int D = a->head_dim;
    double t0 = prof_begin(cb);
    if (!cuk_attention_head_dim_supported(D)) {
        snprintf(cb->failure, sizeof cb->failure, "the CUDA attention kernels take head sizes 64, 128 and 256, not %d", D);
        cb->failed = true;
        return;
    }
    const size_t from = cb->stage_used;
    if (cb->cap_uc < n) {
        free(cb->uc);
        free(cb->uc_table);
        free(cb->uc_mirror);
        cb->uc = malloc(sizeof *cb->uc * (size_t)n);
        cb->uc_table = malloc(sizeof *cb->uc_table * (size_t)n);
        cb->uc_mirror = malloc(sizeof *cb->uc_mirror * (size_t)n);
        cb->cap_uc = cb->uc && cb->uc_table && cb->uc_mirror ? n : 0;
        if (!cb->cap_uc) {
            ck(cb, cudaErrorMemoryAllocation, "host memory");
            return;
        }
    }
    size_t need = cuk_attention_scratch_floats(cb->max_tokens > n ? cb->max_tokens : n, a->n_head, D, cb->n_sm);
    if (need > cb->part_floats) {
        cudaFree(cb->part);
        cb->part = NULL;
        cb->part_floats = 0;
        if (!ck(cb, cudaMalloc((void **)&cb->part, sizeof(float) * need), "device memory for attention")) return;
        cb->part_floats = need;
    }
    /* each sequence's cache once: its windows, its block table */
    int nu = 0;
    struct kv_view views[MAX_FORMATS];
    int n_fmt = 0;
    for (int t = 0; t < n; t++) {
        if (nu > 0 && cb->uc[nu - 1] == a->caches[t]) continue;
        struct kv_cache *c = a->caches[t];
        struct kv_view v;
        kv_cache_view(c, &v);
        cb->uc[nu] = c;
        cb->uc_mirror[nu] = v.windows ? sync_windows(cb, c, &v, kv_cache_n_past(c)) : NULL;
        uint64_t *table = NULL;
        size_t off = stage_alloc(cb, sizeof(uint64_t) * (size_t)(v.n_blk > 0 ? v.n_blk : 1));
        if (off == (size_t)-1 || (v.windows && !cb->uc_mirror[nu])) return;
        table = (uint64_t *)(cb->stage_h + off);
        for (int32_t i = 0; i < v.n_blk; i++) table[i] = v.blk[i] ? (uint64_t)(uintptr_t)v.blk[i]->dev : 0;
        cb->uc_table[nu++] = (uint32_t)off;
        int f = 0;
        while (f < n_fmt && !same_format(&views[f], &v)) f++;
        if (f == n_fmt) {
            if (n_fmt == MAX_FORMATS) {
                ck(cb, cudaErrorNotSupported, "more than 4 KV formats in one batch");
                return;
            }
            views[n_fmt++] = v;
        }
    }
    /* row by row only when every block of the batch has the one layout */
    if (sync_blocks(cb, kv_cache_pool(a->caches[0]), &views[0], a->n_kv, n_fmt == 1) != 0) {
        ck(cb, cudaErrorMemoryAllocation, kvq_last_error());
        return;
    }
    /* the tokens' plans, grouped by row format */
    size_t toks_off = stage_alloc(cb, sizeof(struct cuk_attn_tok) * (size_t)n);
    size_t idx_off = stage_alloc(cb, sizeof(int32_t) * (size_t)n);
    if (toks_off == (size_t)-1 || idx_off == (size_t)-1) return;
    int first[MAX_FORMATS + 1] = {0}, max_rows[MAX_FORMATS] = {0}, k = 0;
    for (int f = 0; f < n_fmt; f++) {
        first[f] = k;
        int u = -1;
        for (int t = 0; t < n; t++) {
            if (u < 0 || cb->uc[u] != a->caches[t]) u++;
            struct kv_cache *c = a->caches[t];
            struct kv_view v;
            kv_cache_view(c, &v);
            if (!same_format(&views[f], &v)) continue;
            struct kv_query_plan pl;
            kv_cache_query_plan(c, a->pos[t], &pl);
            const struct kv_cache_config *cfg = kv_cache_get_config(c);
            const struct kv_shape *sh = kv_cache_get_shape(c);
            const struct cuda_mirror *m = cb->uc_mirror[u];
            struct cuk_attn_tok *tk = (struct cuk_attn_tok *)(cb->stage_h + toks_off) + k;
            *tk = (struct cuk_attn_tok){
                .q_pos = a->pos[t], .a1 = pl.a1, .b1 = pl.b1, .a2 = pl.a2, .b2 = pl.b2, .sinks = pl.sinks, .ws = pl.ws,
                .max_size = cfg->max_size, .keep = cfg->keep, .window = sh->window,
                .nkb = v.nkb, .base = v.base, .table = cb->uc_table[u],
                .ring_cap = m ? m->ring_cap : 1, .sink_cap = m ? m->sink_cap : 1,
                .ring = m ? (uint64_t)(uintptr_t)m->win : 0,
                .sink = m ? (uint64_t)(uintptr_t)(m->win + 2 * (size_t)m->n_kv * m->ring_cap * m->win_row) : 0,
                .mu = m && m->has_mu ? (uint64_t)(uintptr_t)m->mu : 0,
            };
            ((int32_t *)(cb->stage_h + idx_off))[k] = t;
            int rows = (pl.b1 >= pl.a1 ? pl.b1 - pl.a1 + 1 : 0) + (pl.b2 >= pl.a2 ? pl.b2 - pl.a2 + 1 : 0) + pl.sinks +
                       (a->pos[t] >= pl.ws ? a->pos[t] - pl.ws + 1 : 0);
            if (rows > max_rows[f]) max_rows[f] = rows;
            k++;
        }
    }
    first[n_fmt] = k;
    flush_copies(cb, from);
    if (ensure_signs(cb, D, views[0].signs) != 0) return;
    const float *signs = cb->signs;
    const struct cuk_xq *xq = round_into_xq(cb, a->out, n, (int64_t)a->n_head * D);
    prof_end(cb, P_ATTN_HOST, t0);
    t0 = prof_begin(cb);
    for (int f = 0; f < n_fmt && !cb->failed; f++) {
        const struct kv_view *v = &views[f];
        struct cuk_attn_args args = {
            .k_bits = v->k_bits, .k_group = v->k_group, .v_bits = v->v_bits, .v_group = v->v_group,
            .k_rot = v->k_rot, .v_rot = v->v_rot, .k_row = v->k_row, .v_row = v->v_row,
            .head_bytes = v->head_bytes, .win_row = v->win_row,
            .n_head = a->n_head, .n_kv = a->n_kv, .head_dim = D, .scale = a->scale,
            .signs = signs, .q = a->q, .out = a->out, .staging = cb->stage_d,
            .toks = (const struct cuk_attn_tok *)(cb->stage_d + toks_off) + first[f],
            .tok_index = (const int32_t *)(cb->stage_d + idx_off) + first[f],
            .n = first[f + 1] - first[f], .max_rows = max_rows[f], .partial = cb->part, .n_sm = cb->n_sm,
            .xq = xq ? *xq : (struct cuk_xq){NULL, NULL},
        };
        cuk_attention(cb->stream, &args);
    }
    prof_end(cb, P_ATTN_GPU, t0);
}

static int cuda_sync(struct backend *b) {
    struct cuda_backend *cb = cuda(b);
    if (cb->n_pending && cb->rb_used > cb->rb_h_cap) {
        ck(cb, cudaStreamSynchronize(cb->stream), "waiting for the stream");
        cudaFreeHost(cb->rb_h);
        cb->rb_h = NULL;
        cb->rb_h_cap = 0;
        if (ck(cb, cudaMallocHost((void **)&cb->rb_h, cb->rb_cap), "pinned memory for new KV rows")) cb->rb_h_cap = cb->rb_cap;
    }
    if (cb->n_pending && cb->rb_h)
        ck(cb, cudaMemcpyAsync(cb->rb_h, cb->rb_d, cb->rb_used, cudaMemcpyDeviceToHost, cb->stream), "reading new KV rows");
    if (wait_stream(cb) != 0) {
        cb->n_pending = 0;
        cb->rb_used = 0;
        return -1;
    }
    return finish_appends(cb);
}

static void cuda_free(struct backend *b) {
    struct cuda_backend *cb = cuda(b);
    if (!cb) return;
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    if (cb->prof) {
        double total = 0;
        for (int i = 0; i < P_N; i++) total += cb->prof_s[i];
        fprintf(stderr, "kvq cuda profile (%.3f s in operations):\n", total);
        for (int i = 0; i < P_N; i++)
            if (cb->prof_n[i])
                fprintf(stderr, "  %-40s %9.3f ms %5.1f%% %8ld calls %8.1f us/call\n", prof_names[i], 1e3 * cb->prof_s[i],
                        100 * cb->prof_s[i] / total, cb->prof_n[i], 1e6 * cb->prof_s[i] / (double)cb->prof_n[i]);
    }
    for (int i = 0; i < cb->n_ents; i++) cudaFree(cb->ents[i].dev);
    free(cb->ents);
    cudaFree(cb->deq);
    cudaFree(cb->xq.q);
    cudaFree(cb->xq.dsum);
    cudaFree(cb->part);
    cudaFree(cb->signs);
    cudaFreeHost(cb->stage_h);
    cudaFree(cb->stage_d);
    cudaFree(cb->rb_d);
    cudaFreeHost(cb->rb_h);
    free(cb->pending);
    free(cb->seq_fmt);
    free(cb->copies);
    free(cb->uc);
    free(cb->uc_table);
    free(cb->uc_mirror);
    arena_free(cb->host_arena);
    arena_free(cb->dev_arena);
    if (cb->blas) cublasDestroy(cb->blas);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    free(cb);
}

static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .host_memory = false,
    .free = cuda_free,
    .reserve = cuda_reserve,
    .alloc = cuda_alloc,
    .release = cuda_release,
    .upload_weight = cuda_upload_weight,
    .upload_vector = cuda_upload_vector,
    .download = cuda_download,
    .kv_pool_new = cuda_kv_pool_new,
    .matmul = cuda_matmul,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .add_norm = cuda_add_norm,
    .rope_table = cuda_rope_table,
    .qk_rope = cuda_qk_rope,
    .glu = cuda_glu,
    .kv_append = cuda_kv_append,
    .attention = cuda_attention,
    .sync = cuda_sync,
};

struct backend *backend_cuda_new(void) {
    int n = 0;
    cudaError_t st = cudaGetDeviceCount(&n);
    if (st != cudaSuccess || n == 0) {
        kvq_error("no CUDA device: %s", st != cudaSuccess ? cudaGetErrorString(st) : "none found");
        return NULL;
    }
    struct cuda_backend *cb = calloc(1, sizeof *cb);
    if (!cb) {
        kvq_error("out of memory");
        return NULL;
    }
    cb->base.ops = &cuda_ops;
    const char *prof = getenv("KVQ_CUDA_PROFILE");
    cb->prof = prof && *prof && strcmp(prof, "0") != 0;
    struct cudaDeviceProp prop;
    if ((st = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess || (st = cudaSetDevice(0)) != cudaSuccess ||
        (st = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        kvq_error("CUDA: cannot start on the device: %s", cudaGetErrorString(st));
        cuda_free(&cb->base);
        return NULL;
    }
    cb->n_sm = prop.multiProcessorCount;
    if (cublasCreate(&cb->blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(cb->blas, cb->stream) != CUBLAS_STATUS_SUCCESS) {
        kvq_error("cuBLAS: cannot start");
        cuda_free(&cb->base);
        return NULL;
    }
    return &cb->base;
}
