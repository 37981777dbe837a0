/* The CUDA backend: the model's weights in device memory in their GGUF types,
 * activations in device memory, and a device copy of the KV cache that attention
 * reads.
 *
 * The KV policy (positions, windows, block tables, conversion, save/load) stays on
 * the host, on the host rows of a mirrored pool (kv_pool.h). kv_append makes the
 * host's changes of an append (kv_cache_append_begin), and the device encodes the new
 * rows into its blocks and windows (kv_encode.cu); the rows come back to the host
 * once per step, at sync (kv_cache_append_rows on the host threads, then
 * kv_cache_append_end). What the host changed otherwise (rows of forks, trims, loads,
 * conversions; windows after an epoch change) goes to the device in one staging upload
 * and one scatter launch before the kernels that read it; new blocks' rows need not
 * (the device writes them). Products of repacked weights read inputs rounded to int8 (xq); the norm,
 * GLU or attention that writes an input rounds it too, so no launch does that alone.
 *
 * Host data for a step goes through one pinned staging buffer, uploaded in order on
 * the backend's one stream; it is reused only after the stream has been waited for
 * (sync does). Errors of operations that return nothing are kept and reported by sync.
 *
 * Decode steps (up to CUK_MATVEC_MAX tokens) are recorded rather than launched
 * (queue.h): the staging buffer goes up in one copy at sync, then the step's launches
 * go as a CUDA graph when an identical step came before. For that, nothing that
 * changes from step to step is a launch argument: positions, block addresses and
 * window rows are staged data, each cache's block table lives on the device (its
 * mirror), and attention splits its rows on the device. */
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
#include "core/threadpool.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"

#define ARENA_CHUNK ((size_t)256 << 20) /* KV block memory is taken in chunks of this */
#define DEQ_BYTES ((size_t)128 << 20)   /* a band of dequantized rows for one GEMM */
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
    int32_t ring_cap, sink_cap, n_kv, head_dim;
    size_t win_row;
    uint8_t *win; /* ring [2][n_kv][ring_cap][win_row], then sinks [2][n_kv][sink_cap][win_row] */
    float *mu;    /* [2][n_kv][head_dim] */
    bool has_mu;
};

#define ROW_COPIES 64 /* early row copies a step (the rest wait for its end) */
#define RESULT_SLICES 4 /* a product whose results the host reads, in this many launches, */
#define RESULT_SPLIT_BYTES ((size_t)4 << 20) /* when they are this many bytes or more */

/* One sequence's rows of one layer, encoded on the device, waiting for the host's copy. */
struct pending_append {
    struct kv_cache *cache;
    int32_t p0;
    int n;
    size_t k, v, wk, wv; /* offsets in the read-back buffer */
    bool windows;
    int parts; /* of the offsets' re-encoding that end left (kv_cache_append_end) */
};

/* A copy to host memory, after the step's recorded work. */
struct post_copy {
    void *dst;
    const void *src;
    size_t bytes;
};

struct cuda_backend {
    struct backend base;
    struct cuk_queue q;
    cudaStream_t stream; /* q.stream */
    bool in_step;        /* work was queued since the last sync */
    int segments;        /* segments of this recorded step issued */
    bool stage_fetch;    /* one-token steps' staged data fetched by a kernel (fetch_staged) */
    bool one_token;      /* this step is one token's (segment_ends) */
    struct post_copy *post;
    int n_post, cap_post;
    void **dead;         /* device memory to free at the next sync (recorded work may read it) */
    int n_dead, cap_dead;
    cublasHandle_t blas;
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
    /* what xq holds: the rounding of xq_n rows of xq_k floats at xq_of (written by the
     * norm or GLU that made them, so the product after it needs no rounding launch) */
    const float *xq_of;
    int xq_n;
    int64_t xq_k;
    bool any_repacked; /* a weight of a repacked type was uploaded */
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
     * [rows_from, rows_to): the appends rows_task files */
    cudaStream_t copy_stream;
    cudaEvent_t row_ev[ROW_COPIES], work_ev;
    cudaEvent_t result_ev[RESULT_SLICES]; /* the slices' copies (matvec_in_slices) */
    size_t result_split;                  /* RESULT_SPLIT_BYTES, or KVQ_CUDA_RESULT_SPLIT */
    bool uva; /* unified addressing: host_alloc's pinned memory has the same address on the device */
    /* A one-token step's layer that packs nothing beside the stream (f16 caches;
     * cuk_kv_pack) launches an empty kernel there instead, so that its graph has the
     * branches a packed cache's has. Measured, not understood: with them a step of
     * llama3-8b Q4_0 with f16 KV took 2.5% less GPU time at 512 rows and 1.6% less at
     * 4096 on an H100, the level f16 steps also reached in a process that had run a
     * packed cache's graphs; Qwen2.5-7B's took 1.5% less at 512, Gemma 3 4B's 0.4-0.7%
     * more (docs/cuda-performance.md). KVQ_CUDA_IDLE_BESIDE=0 turns it off (a
     * measurement aid). */
    bool idle_beside;
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
    size_t rb_copied;
    int *seq_fmt, cap_seq_fmt;
    struct arena *host_arena, *dev_arena;
    /* per attention call */
    struct kv_cache **uc;
    struct cuda_mirror **uc_mirror;
    int *uc_chunk;
    int cap_uc;
    /* host threads (made at first need): the offsets' re-encoding of caches that
     * reach their offsets point, spread over them (kv_cache_offsets_part) */
    struct kvq_threads *pool;
    int n_threads;
    bool prof;
    double prof_s[16];
    long prof_n[16];
    struct step_prof *steps; /* KVQ_CUDA_PROFILE=steps, else NULL */
};

static struct cuda_backend *cuda(struct backend *b) { return (struct cuda_backend *)b; }

/* KVQ_CUDA_PROFILE=1: each operation waits for the GPU before and after itself and
 * its time is added up per kind, printed when the backend is freed (a measurement
 * aid: the waits serialize what normally overlaps). */
enum prof_op { P_MATVEC, P_WIDE, P_GEMM, P_NORM, P_GLU, P_EMBED, P_KV_ENCODE, P_KV_FINISH, P_ATTN_HOST, P_ATTN_GPU, P_ISSUE,
               P_N };
static const char *const prof_names[P_N] = {"matvec", "wide products (packed)", "gemm (dequantize + f16/TF32)", "norms", "glu", "embed",
                                            "kv_append: plan, RoPE + device encode",
                                            "sync: host copy of new KV rows",
                                            "attention: host plan + uploads", "attention: kernels",
                                            "issuing recorded work (graphs)"};
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static double prof_begin(struct cuda_backend *cb) {
    if (cb->prof) cudaStreamSynchronize(cb->stream);
    return cb->prof || cb->steps ? now_s() : 0;
}
static void prof_end(struct cuda_backend *cb, enum prof_op op, double t0) {
    if (!cb->prof && !cb->steps) return;
    if (cb->prof) cudaStreamSynchronize(cb->stream);
    cb->prof_s[op] += now_s() - t0;
    cb->prof_n[op]++;
}

/* KVQ_CUDA_PROFILE=steps: where the time of recorded (decode) steps goes, as medians
 * over the steps: the wall time from one wait's end to the next; the GPU's, from the
 * first issued segment to the end of the step's work; the host's from the last wait's
 * end to the step's first operation (the engine's work and its caller's), then to that
 * first issue; the results' copy; the host's work after the wait. The GPU idles for the
 * difference of the first two. Events time the GPU, so nothing waits that would not. */
enum step_stat { S_WALL, S_GPU, S_HOST_PRE, S_HOST_FIRST, S_RESULTS, S_HOST_AFTER, S_N };
#define STEP_SAMPLES 8192
struct step_prof {
    cudaEvent_t first, end, results;
    bool armed;            /* this step's first segment was issued: its events are set */
    double begin, waited;  /* host times: the step's first operation, the last wait's end */
    float v[STEP_SAMPLES][S_N];
    long n;
};

static void steps_free(struct step_prof *sp) {
    if (!sp) return;
    cudaEvent_t *ev[] = {&sp->first, &sp->end, &sp->results};
    for (int i = 0; i < 3; i++)
        if (*ev[i]) cudaEventDestroy(*ev[i]);
    free(sp);
}

/* NULL when memory or an event is short (the profile is then off). */
static struct step_prof *steps_new(void) {
    struct step_prof *sp = calloc(1, sizeof *sp);
    if (sp && (cudaEventCreate(&sp->first) != cudaSuccess || cudaEventCreate(&sp->end) != cudaSuccess ||
               cudaEventCreate(&sp->results) != cudaSuccess)) {
        steps_free(sp);
        return NULL;
    }
    return sp;
}

static float elapsed_us(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    return cudaEventElapsedTime(&ms, a, b) == cudaSuccess ? 1e3f * ms : 0;
}

/* At a recorded step's first segment. */
static void steps_first_issue(struct step_prof *sp, cudaStream_t s) {
    if (!sp || sp->armed) return;
    cudaEventRecord(sp->first, s);
    sp->armed = true;
    if (sp->n < STEP_SAMPLES) {
        sp->v[sp->n][S_HOST_PRE] = sp->waited > 0 ? (float)(1e6 * (sp->begin - sp->waited)) : 0;
        sp->v[sp->n][S_HOST_FIRST] = (float)(1e6 * (now_s() - sp->begin));
    }
}

/* At sync: after the step's work (results: false), then after the results' copies. */
static void steps_mark(struct step_prof *sp, cudaStream_t s, bool results) {
    if (sp && sp->armed) cudaEventRecord(results ? sp->results : sp->end, s);
}

/* When the wait at sync ends. */
static void steps_waited(struct step_prof *sp) {
    if (!sp) return;
    const double t = now_s();
    if (sp->armed && sp->n < STEP_SAMPLES && sp->waited > 0) {
        float *v = sp->v[sp->n];
        v[S_WALL] = (float)(1e6 * (t - sp->waited));
        v[S_GPU] = elapsed_us(sp->first, sp->end);
        v[S_RESULTS] = elapsed_us(sp->end, sp->results);
    } else {
        sp->armed = false; /* no sample of this step */
    }
    sp->waited = t;
}

/* When sync returns (failed: the step's numbers are dropped). */
static void steps_done(struct step_prof *sp, bool failed) {
    if (!sp) return;
    if (!failed && sp->armed) sp->v[sp->n++][S_HOST_AFTER] = (float)(1e6 * (now_s() - sp->waited));
    sp->armed = false;
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void steps_print(const struct step_prof *sp) {
    static const char *const names[S_N] = {"wall", "GPU", "host before the step's first operation",
                                           "host before the first issue", "results' copy",
                                           "host after the wait"};
    float *col = sp->n > 0 ? malloc(sizeof(float) * (size_t)sp->n) : NULL;
    if (!col) return;
    fprintf(stderr, "kvq cuda steps, medians of %ld recorded steps (us):", sp->n);
    float med[S_N];
    for (int k = 0; k < S_N; k++) {
        for (long i = 0; i < sp->n; i++) col[i] = sp->v[i][k];
        qsort(col, (size_t)sp->n, sizeof(float), cmp_float);
        med[k] = col[sp->n / 2];
        fprintf(stderr, "%s %s %.1f", k ? "," : "", names[k], med[k]);
    }
    /* the mean wall time is what a run's tokens/s sees: slow steps (a context's first,
     * which record its graphs; those that make a new kind of step) lift it. The part of
     * their excess within the GPU's span is not the host's before the first issue or
     * after the wait (the span includes the GPU's waits for later segments, though) */
    const double median = med[S_WALL];
    double sum = 0, excess = 0, gpu_excess = 0;
    int slow = 0;
    for (long i = 0; i < sp->n; i++) {
        const double w = sp->v[i][S_WALL];
        sum += w;
        if (w > 1.2 * median) slow++, excess += w - median, gpu_excess += sp->v[i][S_GPU] - med[S_GPU];
    }
    fprintf(stderr,
            "; mean wall %.1f; %d steps over 1.2x the median, %.0f us beyond it, %.0f of them in the GPU's span "
            "(steps",
            sum / (double)sp->n, slow, excess, gpu_excess);
    for (long i = 0, k = 0; i < sp->n && k < 8; i++)
        if (sp->v[i][S_WALL] > 1.2 * median) fprintf(stderr, " %ld", i), k++;
    fprintf(stderr, ")\n");
    free(col);
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
    if (data) st = cudaMemcpy(e->dev, data, data_bytes, cudaMemcpyHostToDevice);
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
    /* codes, then the scales, in one device allocation, repacked there from the rows
     * as they are (a temporary copy) */
    const size_t codes = cuk_repacked_code_bytes(w->type, w->rows, w->cols),
                 bytes = cuk_repacked_bytes(w->type, w->rows, w->cols), raw_bytes = w->row_bytes * (size_t)w->rows;
    if (add_entry(cb, w, sizeof *w, NULL, bytes, &e) != 0) return -1;
    if (!e) return 0;
    e->w = (struct cuk_weight){w->type, e->dev, w->rows, w->cols, 0, (const uint16_t *)(e->dev + codes)};
    cb->any_repacked = true;
    uint8_t *raw = NULL;
    cudaError_t st = cudaMalloc((void **)&raw, raw_bytes);
    if (st == cudaSuccess) st = cudaMemcpyAsync(raw, w->data, raw_bytes, cudaMemcpyHostToDevice, cb->stream);
    if (st == cudaSuccess) {
        cuk_repack(&cb->q, w->type, raw, w->rows, w->cols, e->dev, (uint16_t *)(e->dev + codes));
        st = cuk_queue_error(&cb->q);
    }
    if (st == cudaSuccess) st = cudaStreamSynchronize(cb->stream);
    cudaFree(raw);
    if (st != cudaSuccess) return kvq_error("CUDA: repacking a weight of %zu bytes: %s", raw_bytes, cudaGetErrorString(st));
    return 0;
}

static int cuda_upload_vector(struct backend *b, const float *v, int64_t n) {
    struct dev_entry *e;
    return add_entry(cuda(b), v, sizeof(float) * (size_t)n, v, sizeof(float) * (size_t)n, &e);
}

/* ---- staging: host data for the device, in stream order ---------------- */

/* Room for `bytes` more at an aligned offset; the offset, or (size_t)-1. Growing
 * waits for the stream first (earlier uploads may still read the old buffer). */
static void record_stop(struct cuda_backend *cb);

/* The staging buffers at cap bytes (rounded up to STAGE_ROUND, fetch_staged's unit),
 * what they hold kept; false with the failure recorded. */
#define STAGE_ROUND 4096
static bool stage_grow(struct cuda_backend *cb, size_t cap) {
    uint8_t *h = NULL, *d = NULL;
    cap = (cap + STAGE_ROUND - 1) / STAGE_ROUND * STAGE_ROUND;
    if (!ck(cb, cudaStreamSynchronize(cb->stream), "waiting for the stream") ||
        !ck(cb, cudaMallocHost((void **)&h, cap), "pinned staging memory") ||
        !ck(cb, cudaMalloc((void **)&d, cap), "device staging memory")) {
        if (h) cudaFreeHost(h);
        return false;
    }
    if (cb->stage_used) memcpy(h, cb->stage_h, cb->stage_used);
    cudaFreeHost(cb->stage_h);
    cudaFree(cb->stage_d);
    cb->stage_h = h;
    cb->stage_d = d;
    cb->stage_cap = cap;
    cb->stage_up = 0; /* the new device buffer holds nothing yet */
    return true;
}

static size_t stage_alloc(struct cuda_backend *cb, size_t bytes) {
    size_t off = (cb->stage_used + 15) & ~(size_t)15;
    if (off + bytes > cb->stage_cap) {
        record_stop(cb); /* what it recorded reads the old buffer */
        size_t cap = cb->stage_cap ? cb->stage_cap : (size_t)1 << 20;
        while (cap < off + bytes) cap *= 2;
        if (!stage_grow(cb, cap)) return (size_t)-1;
    }
    cb->stage_used = off + bytes;
    return off;
}

static size_t stage_put(struct cuda_backend *cb, const void *data, size_t bytes) {
    size_t off = stage_alloc(cb, bytes);
    if (off != (size_t)-1 && bytes) memcpy(cb->stage_h + off, data, bytes);
    return off;
}

/* Uploads what was staged since the last upload. */
static void stage_upload(struct cuda_backend *cb) {
    if (cb->stage_used > cb->stage_up)
        ck(cb, cudaMemcpyAsync(cb->stage_d + cb->stage_up, cb->stage_h + cb->stage_up, cb->stage_used - cb->stage_up,
                               cudaMemcpyHostToDevice, cb->stream),
           "uploading step data");
    cb->stage_up = cb->stage_used;
}

/* Before a launch that reads what was staged: uploads it now, or, while a step is
 * recorded, when the record is issued. */
static void stage_flush(struct cuda_backend *cb) {
    if (!cb->q.recording) stage_upload(cb);
}

/* A host array as device memory for the next launch (NULL on failure). */
static const void *stage_array(struct cuda_backend *cb, const void *data, size_t bytes) {
    size_t off = stage_put(cb, data, bytes);
    if (off == (size_t)-1) return NULL;
    stage_flush(cb);
    return cb->stage_d + off;
}

/* No pending appends (their early copies, if any, are left unread). */
static void drop_pending(struct cuda_backend *cb) {
    cb->n_pending = cb->rows_copied = cb->rows_from = cb->n_row_copies = 0;
    cb->rb_copied = 0;
    cb->n_held_pack = 0;
}

/* The copy stream's next copies wait for the work queued on the compute stream so far
 * (copies there would hold up the kernels behind them). */
static void copies_follow_work(struct cuda_backend *cb) {
    ck(cb, cudaEventRecord(cb->work_ev, cb->stream), "an event");
    ck(cb, cudaStreamWaitEvent(cb->copy_stream, cb->work_ev, 0), "an event");
}

/* After an issued segment (or a KV append not recorded): the rows encoded since the
 * last copy, read back on the copy stream once the work so far is done, with an event
 * behind them (cuda_sync files them while the GPU runs on; in the compute stream the
 * copies held up the kernels behind them, 0.18 ms of a 16-token step). Skipped (left
 * for the step's end) when the pinned buffer is short; it grows at sync. */
static void copy_new_rows(struct cuda_backend *cb) {
    if (cb->n_pending == cb->rows_copied || !cb->rb_h || cb->rb_used > cb->rb_h_cap || cb->n_row_copies == ROW_COPIES ||
        cb->failed)
        return;
    const int i = cb->n_row_copies;
    copies_follow_work(cb);
    ck(cb, cudaMemcpyAsync(cb->rb_h + cb->rb_copied, cb->rb_d + cb->rb_copied, cb->rb_used - cb->rb_copied,
                           cudaMemcpyDeviceToHost, cb->copy_stream),
       "reading new KV rows");
    ck(cb, cudaEventRecord(cb->row_ev[i], cb->copy_stream), "an event");
    cb->row_end[cb->n_row_copies++] = cb->rows_copied = cb->n_pending;
    cb->rb_copied = cb->rb_used;
}

/* The packings held back (held_pack), beside the stream from here. */
static void launch_held_packs(struct cuda_backend *cb) {
    for (int i = 0; i < cb->n_held_pack; i++) cuk_kv_pack(&cb->q, &cb->held_pack[i]);
    cb->n_held_pack = 0;
}

/* A one-token step's staged data read by a kernel at the head of its record, from the
 * pinned host buffer (mapped), instead of copied before the record is issued: that
 * small cudaMemcpyAsync took the host 3.5-11 us (H100 machine), and the GPU waits for
 * the first segment's issue. The range ends at a STAGE_ROUND boundary (within the
 * buffer, stage_grow), so that the record (and its graph) is the same from step to
 * step; what the fetch reads past the staged bytes is overwritten by the next one
 * before any launch reads it. False where it does not apply (the caller uploads). */
static bool fetch_staged(struct cuda_backend *cb) {
    if (!cb->stage_fetch || !cb->uva || !cb->q.recording || !cb->one_token || cb->stage_used <= cb->stage_up)
        return false;
    const size_t from = cb->stage_up & ~(size_t)15;
    const size_t to = (cb->stage_used + STAGE_ROUND - 1) / STAGE_ROUND * STAGE_ROUND;
    cuk_stage_fetch(&cb->q, cb->stage_d + from, cb->stage_h + from, to - from);
    cuk_queue_last_to_front(&cb->q);
    cb->stage_up = cb->stage_used;
    return true;
}

/* Uploads the staged data and issues the record (with the packings held back, so
 * that the rows read back after it are whole). */
static void issue_record(struct cuda_backend *cb) {
    launch_held_packs(cb);
    double t0 = prof_begin(cb);
    steps_first_issue(cb->steps, cb->stream);
    if (!fetch_staged(cb)) stage_upload(cb);
    cuk_queue_issue(&cb->q);
    copy_new_rows(cb);
    prof_end(cb, P_ISSUE, t0);
}

/* Every operation that queues work starts here. The first one of a step decides
 * whether the step is recorded: decode-sized steps are, when graphs are on. A
 * recorded step is issued in segments, so that the GPU starts on the first layers
 * while the host records the next ones; but kernels in different graphs do not
 * overlap as those launched with PDL within one do (about 2 us of GPU time a
 * boundary, more where it keeps the next kernel from loading weights early).
 * - Several tokens: a short first segment (the GPU idles until it is issued), then
 *   segments of SEGMENT_LAUNCHES, so that the host, whose work grows with the
 *   tokens, stays ahead (longer ones left the GPU waiting for 16 sequences).
 * - One token: four segments, and the output product's (cuda_matmul). Each ends
 *   before a GLU (the down product's blocks load their weights while it runs): the
 *   first at the first GLU (layer 0's), so that the GPU starts after about 10
 *   launches are recorded rather than 30; the next ones SEGMENT_ONE[1], then
 *   SEGMENT_ONE[2] launches later (layers 4 and 12 in a 7-8B model), short enough
 *   that the host records each while the GPU runs the one before. Against a first
 *   segment of 30 launches the host's median time beyond the GPU's fell from 34-37
 *   to 20-25 us a step, for 0-17 us more GPU time (H100, llama3-8b Q4_0;
 *   docs/cuda-performance.md). */
#define SEGMENT_FIRST 12
#define SEGMENT_LAUNCHES 96
static const int SEGMENT_ONE[] = {5, 40, 90};
static bool segment_ends(const struct cuda_backend *cb, bool glu) {
    const int n_one = (int)(sizeof SEGMENT_ONE / sizeof *SEGMENT_ONE);
    if (cb->one_token) return glu && cb->segments < n_one && cb->q.n_ent >= SEGMENT_ONE[cb->segments];
    return cb->q.n_ent >= (cb->segments ? SEGMENT_LAUNCHES : SEGMENT_FIRST);
}

/* glu: the operation is a GLU (segment_ends) */
static void step_op(struct cuda_backend *cb, int n, bool glu) {
    if (!cb->in_step) {
        cb->in_step = true;
        if (cb->steps) cb->steps->begin = now_s();
        cb->q.recording = cb->q.graphs && n <= CUK_MATVEC_MAX;
        cb->segments = 0;
        cb->one_token = n == 1;
    } else if (cb->q.recording && segment_ends(cb, glu)) {
        issue_record(cb);
        cb->segments++;
    }
}

/* Issues what the step recorded so far and queues the rest of it at once: before
 * anything that waits for the stream or cannot be recorded. */
static void record_stop(struct cuda_backend *cb) {
    if (!cb->q.recording) return;
    issue_record(cb);
    cb->q.recording = false;
}

/* Frees device memory after the step (its recorded work may still read it). */
static void free_after_step(struct cuda_backend *cb, void *p) {
    if (!p) return;
    if (cb->n_dead == cb->cap_dead) {
        int cap = cb->cap_dead ? 2 * cb->cap_dead : 16;
        void **d = realloc(cb->dead, sizeof *d * (size_t)cap);
        if (!d) {
            record_stop(cb);
            cudaStreamSynchronize(cb->stream);
            cudaFree(p);
            return;
        }
        cb->dead = d;
        cb->cap_dead = cap;
    }
    cb->dead[cb->n_dead++] = p;
}

/* Queues a copy of `bytes` staged bytes to the device address dst (done by
 * flush_copies): where the caller writes them, or NULL. */
static void *copy_space(struct cuda_backend *cb, const void *dst, size_t bytes) {
    size_t off = stage_alloc(cb, bytes);
    if (off == (size_t)-1) return NULL;
    if (cb->n_copies == cb->cap_copies) {
        int cap = cb->cap_copies ? 2 * cb->cap_copies : 1024;
        struct cuk_copy *c = realloc(cb->copies, sizeof *c * (size_t)cap);
        if (!c) {
            ck(cb, cudaErrorMemoryAllocation, "host memory for copies");
            return NULL;
        }
        cb->copies = c;
        cb->cap_copies = cap;
    }
    cb->copies[cb->n_copies++] = (struct cuk_copy){(uint64_t)(uintptr_t)dst, (uint32_t)off, (uint32_t)bytes};
    return cb->stage_h + off;
}

/* Queues a copy of bytes at data to the device address dst. */
static bool copy_to(struct cuda_backend *cb, const void *dst, const void *data, size_t bytes) {
    void *h = copy_space(cb, dst, bytes);
    if (h && bytes) memcpy(h, data, bytes);
    return h != NULL;
}

/* Uploads what was staged, then places the queued copies. */
static void flush_copies(struct cuda_backend *cb) {
    size_t list = cb->n_copies ? stage_put(cb, cb->copies, sizeof *cb->copies * (size_t)cb->n_copies) : 0;
    stage_flush(cb);
    if (cb->n_copies && list != (size_t)-1)
        cuk_scatter(&cb->q, (const struct cuk_copy *)(cb->stage_d + list), cb->n_copies, cb->stage_d);
    cb->n_copies = 0;
}

/* ---- memory ------------------------------------------------------------- */

/* A new chunk of cap bytes at the head of the list; false with an error. */
static bool arena_grow(struct arena **list, bool pinned, size_t cap) {
    struct arena *n = calloc(1, sizeof *n);
    if (!n) return false;
    cudaError_t st = pinned ? cudaMallocHost((void **)&n->base, cap) : cudaMalloc((void **)&n->base, cap);
    if (st != cudaSuccess) {
        free(n);
        cudaGetLastError();
        kvq_error("CUDA: no %s memory for the KV cache (%s)", pinned ? "pinned host" : "device", cudaGetErrorString(st));
        return false;
    }
    n->cap = cap;
    n->pinned = pinned;
    n->next = *list;
    *list = n;
    return true;
}

static void *arena_alloc(struct arena **list, bool pinned, size_t bytes) {
    bytes = (bytes + 255) & ~(size_t)255;
    if ((!*list || (*list)->used + bytes > (*list)->cap) && !arena_grow(list, pinned, bytes > ARENA_CHUNK ? bytes : ARENA_CHUNK))
        return NULL;
    struct arena *a = *list;
    void *p = a->base + a->used;
    a->used += bytes;
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
    return arena_alloc(&cb->host_arena, true, bytes);
}
static void *dev_block(void *ctx, size_t bytes) {
    struct cuda_backend *cb = ctx;
    return arena_alloc(&cb->dev_arena, false, bytes);
}
static void mirror_free(void *ctx, void *mirror) {
    (void)ctx;
    struct cuda_mirror *m = mirror;
    if (!m) return;
    cudaFree(m->table_d);
    free(m->table_blk);
    cudaFree(m->win);
    cudaFree(m->mu);
    free(m);
}

static struct kv_pool *cuda_kv_pool_new(struct backend *b, size_t budget) {
    struct cuda_backend *cb = cuda(b);
    struct kv_pool_mirror m = {cb, host_block, dev_block, mirror_free};
    /* memory for the whole budget now, when it can be had: taken during decoding, a
     * chunk (pinned host memory above all) stalls a step for tens of milliseconds */
    const size_t have = cb->dev_arena ? cb->dev_arena->cap - cb->dev_arena->used : 0;
    if (budget > have && budget <= ((size_t)1 << 40) && arena_grow(&cb->dev_arena, false, budget))
        arena_grow(&cb->host_arena, true, budget); /* else grown on demand */
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

/* Pinned: a copy to it runs at the link's speed and needs no staging copy
 * (16 tokens' logits of a 128K vocabulary: 0.15 ms instead of 0.7 on the H100). */
static void *cuda_host_alloc(struct backend *b, size_t bytes) {
    (void)b;
    void *p = NULL;
    const cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        kvq_error("CUDA: %zu bytes of pinned host memory: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}
static void cuda_host_free(struct backend *b, void *p) {
    (void)b;
    if (p) cudaFreeHost(p);
}

/* Copies device memory to the host once the work queued so far is done: recorded
 * work's results after it, at sync. */
static void post_copy(struct cuda_backend *cb, void *dst, const void *src, size_t bytes) {
    if (!cb->q.recording) {
        ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "reading results");
        return;
    }
    if (cb->n_post == cb->cap_post) { /* after the recorded work, at sync */
        int cap = cb->cap_post ? 2 * cb->cap_post : 8;
        struct post_copy *p = realloc(cb->post, sizeof *p * (size_t)cap);
        if (!p) {
            record_stop(cb);
            ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "reading results");
            return;
        }
        cb->post = p;
        cb->cap_post = cap;
    }
    cb->post[cb->n_post++] = (struct post_copy){dst, src, bytes};
}

/* Staging a pass may take this much a token (a 384-token pass of llama3-8b with K8V4
 * staged 4-8 MB: plans, block tables, window rows): made at the start, since growing
 * waits for the GPU and pins memory (slow) in the middle of a pass. */
#define STAGE_BYTES_PER_TOKEN ((size_t)16 << 10)

static int cuda_reserve(struct backend *b, int max_tokens, int64_t widest) {
    struct cuda_backend *cb = cuda(b);
    cb->max_tokens = max_tokens;
    const size_t stage = STAGE_BYTES_PER_TOKEN * (size_t)max_tokens;
    if (stage > cb->stage_cap && !stage_grow(cb, stage)) return kvq_error("%s", cb->failure);
    if (max_tokens > CUK_MATVEC_MAX) {
        cudaFree(cb->x16);
        if ((!cb->deq && !(cb->deq = cuda_alloc(b, DEQ_BYTES))) ||
            !(cb->x16 = cuda_alloc(b, sizeof(uint16_t) * (size_t)max_tokens * (size_t)widest)))
            return -1;
    }
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

/* A product whose results the host reads (the logits: 8 MB for 16 tokens of a
 * 128K vocabulary, 0.16 ms over PCIe on an H100 machine) in slices of rows, each
 * copied to the host on the copy stream while the next is computed. */
static void matvec_in_slices(struct cuda_backend *cb, const struct cuk_matvec_job *job, float *host_y, const float *x,
                             int64_t x_stride, int n) {
    const int64_t rows = job->w->rows;
    for (int i = 0; i < RESULT_SLICES && !cb->failed; i++) {
        const int64_t r0 = rows * i / RESULT_SLICES / 16 * 16;
        const int64_t r1 = i + 1 == RESULT_SLICES ? rows : rows * (i + 1) / RESULT_SLICES / 16 * 16;
        const struct cuk_weight w = cuk_weight_rows(job->w, r0, r1);
        const struct cuk_matvec_job slice = {&w, job->y + r0, job->bias ? job->bias + r0 : NULL, rows};
        cuk_matvec(&cb->q, &slice, 1, x, x_stride, &cb->xq, n, &cb->mv);
        if (cb->q.recording) issue_record(cb); /* the slice is on the stream */
        copies_follow_work(cb);
        ck(cb, cudaMemcpy2DAsync(host_y + r0, sizeof(float) * (size_t)rows, job->y + r0, sizeof(float) * (size_t)rows,
                                 sizeof(float) * (size_t)(r1 - r0), (size_t)n, cudaMemcpyDeviceToHost, cb->copy_stream),
           "reading results");
        ck(cb, cudaEventRecord(cb->result_ev[i], cb->copy_stream), "an event");
    }
}

/* Products of n <= CUK_WIDE_MAX tokens with repacked weights, from their codes (false:
 * a weight of another type, left to the GEMM path). The jobs share x: made f16 once. */
static bool wide_products(struct cuda_backend *cb, const float *x, int64_t x_stride, int n, int n_jobs,
                          const struct be_matmul *jobs) {
    const struct cuk_weight *w[8];
    if (n_jobs < 1 || n_jobs > 8) return false;
    size_t floats = 0;
    for (int j = 0; j < n_jobs; j++) {
        w[j] = dev_weight(cb, jobs[j].w);
        if (!w[j]) return true; /* failed: the backend says why */
        if (!cuk_repacked(w[j]->type)) return false;
        const size_t f = cuk_matmul_wide_scratch(w[j], n, cb->n_sm);
        if (f > floats) floats = f;
    }
    if (floats > cb->wide_floats) {
        free_after_step(cb, cb->wide_part);
        cb->wide_floats = floats;
        if (!ck(cb, cudaMalloc((void **)&cb->wide_part, sizeof(float) * floats), "device memory for products")) {
            cb->wide_part = NULL;
            cb->wide_floats = 0;
            return true;
        }
    }
    cuk_to_half(&cb->q, x, x_stride, n, w[0]->cols, cb->x16);
    for (int j = 0; j < n_jobs; j++) {
        cuk_matmul_wide(&cb->q, w[j], cb->x16, n, jobs[j].y, w[j]->rows, dev_vec(cb, jobs[j].bias), cb->wide_part,
                        cb->n_sm);
        if (jobs[j].host_y) post_copy(cb, jobs[j].host_y, jobs[j].y, sizeof(float) * (size_t)n * (size_t)w[j]->rows);
    }
    return true;
}

static void cuda_matmul(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs,
                        const struct be_matmul *jobs) {
    struct cuda_backend *cb = cuda(b);
    step_op(cb, n, false);
    cb->qprep_of = NULL; /* the products may write the queries */
    double t0 = prof_begin(cb);
    /* results for the host end the step (the output product): the work before them goes
     * out as a segment of its own, so that the rows it encoded are read back and filed
     * while this product runs, not after the step */
    if (cb->q.recording && cb->n_pending > cb->rows_copied && n_jobs > 0 && jobs[0].host_y) {
        issue_record(cb);
        cb->segments++;
    }
    if (n <= CUK_MATVEC_MAX) {
        struct cuk_matvec_job mj[CUK_MATVEC_JOBS];
        bool repacked = false;
        for (int j = 0; j < n_jobs && j < CUK_MATVEC_JOBS; j++) {
            mj[j] = (struct cuk_matvec_job){dev_weight(cb, jobs[j].w), jobs[j].y, dev_vec(cb, jobs[j].bias), 0};
            if (!mj[j].w) return;
            repacked |= cuk_repacked(mj[j].w->type) != 0;
        }
        const int n_mj = n_jobs < CUK_MATVEC_JOBS ? n_jobs : CUK_MATVEC_JOBS;
        size_t floats, counters;
        cuk_matvec_scratch(mj, n_mj, n, &floats, &counters);
        if (floats > cb->mv_floats || counters > cb->mv_counters) { /* grown, the counters zeroed */
            free_after_step(cb, cb->mv.partial);
            free_after_step(cb, cb->mv.counters);
            cb->mv.partial = NULL;
            cb->mv.counters = NULL;
            cb->mv_floats = floats > cb->mv_floats ? floats : cb->mv_floats;
            cb->mv_counters = counters > cb->mv_counters ? counters : cb->mv_counters;
            if (!ck(cb, cudaMalloc((void **)&cb->mv.partial, sizeof(float) * (cb->mv_floats ? cb->mv_floats : 1)),
                    "device memory for products") ||
                !ck(cb, cudaMalloc((void **)&cb->mv.counters, sizeof(unsigned) * (cb->mv_counters ? cb->mv_counters : 1)),
                    "device memory for products") ||
                !ck(cb, cudaMemsetAsync(cb->mv.counters, 0, sizeof(unsigned) * (cb->mv_counters ? cb->mv_counters : 1), cb->stream),
                    "zeroing counters")) {
                cb->mv_floats = cb->mv_counters = 0;
                return;
            }
        }
        const int64_t k = mj[0].w->cols;
        if (repacked && !(cb->xq_of == x && cb->xq_n == n && cb->xq_k == k && x_stride == k)) {
            cuk_quantize_x(&cb->q, x, x_stride, n, k, &cb->xq); /* the jobs share x: rounded once */
            cb->xq_of = x_stride == k ? x : NULL;
            cb->xq_n = n;
            cb->xq_k = k;
        }
        if (n_mj == 1 && jobs[0].host_y && cuk_repacked(mj[0].w->type) && mj[0].w->rows >= 16 * RESULT_SLICES &&
            sizeof(float) * (size_t)n * (size_t)mj[0].w->rows >= cb->result_split) {
            matvec_in_slices(cb, &mj[0], jobs[0].host_y, x, x_stride, n);
        } else {
            /* results the host wants, under the slices' size, the product writes there itself
             * (host_alloc's pinned memory): no copy after the step (16 us of a one-token step
             * on the H100, its 0.5 MB of logits) */
            for (int j = 0; j < n_mj; j++)
                if (jobs[j].host_y && cb->uva && sizeof(float) * (size_t)n * (size_t)mj[j].w->rows < cb->result_split)
                    mj[j].y = jobs[j].host_y;
            cuk_matvec(&cb->q, mj, n_mj, x, x_stride, &cb->xq, n, &cb->mv);
            for (int j = 0; j < n_mj; j++)
                if (jobs[j].host_y && mj[j].y != jobs[j].host_y)
                    post_copy(cb, jobs[j].host_y, jobs[j].y, sizeof(float) * (size_t)n * (size_t)mj[j].w->rows);
        }
        prof_end(cb, P_MATVEC, t0);
        return;
    }
    if (n <= CUK_WIDE_MAX && wide_products(cb, x, x_stride, n, n_jobs, jobs)) {
        prof_end(cb, P_WIDE, t0);
        return;
    }
    record_stop(cb); /* cuBLAS launches directly */
    cb->xq_of = NULL;
    cb->q.after_attn = false;
    bool x16_made = false; /* the jobs share x: converted to f16 once */
    for (int j = 0; j < n_jobs; j++) {
        const struct cuk_weight *w = dev_weight(cb, jobs[j].w);
        const float *bias = dev_vec(cb, jobs[j].bias);
        if (!w) return;
        /* wide batches: bands of rows dequantized for a GEMM (y^T = W x^T, column-major) on
         * tensor cores: quantized weights with f16 operands and f32 sums (their inputs
         * lose less in f16 than the CPU's int8 rounding); float weights in TF32, as
         * f16 would lose small activations, and bf16 weights' range */
        const bool f16 = w->type != KVQ_F32 && w->type != KVQ_BF16 && w->type != KVQ_F16;
        if (f16 && !x16_made) {
            cuk_to_half(&cb->q, x, x_stride, n, w->cols, cb->x16);
            x16_made = true;
        }
        const float one = 1.0f, zero = 0.0f;
        int64_t band = (int64_t)(DEQ_BYTES / (f16 ? 2 : 4) / (size_t)w->cols);
        if (band > w->rows) band = w->rows;
        for (int64_t r0 = 0; r0 < w->rows; r0 += band) {
            int64_t r1 = r0 + band < w->rows ? r0 + band : w->rows;
            cuk_dequantize(&cb->q, w, r0, r1, cb->deq, f16);
            cublasStatus_t st =
                f16 ? cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)(r1 - r0), n, (int)w->cols, &one, cb->deq,
                                   CUDA_R_16F, (int)w->cols, cb->x16, CUDA_R_16F, (int)w->cols, &zero, jobs[j].y + r0,
                                   CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
                    : cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)(r1 - r0), n, (int)w->cols, &one, cb->deq,
                                   CUDA_R_32F, (int)w->cols, x, CUDA_R_32F, (int)x_stride, &zero, jobs[j].y + r0,
                                   CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
            if (!ck_blas(cb, st, "GEMM")) return;
        }
        if (bias) cuk_add_bias(&cb->q, jobs[j].y, bias, n, w->rows);
        if (jobs[j].host_y) post_copy(cb, jobs[j].host_y, jobs[j].y, sizeof(float) * (size_t)n * (size_t)w->rows);
    }
    prof_end(cb, P_GEMM, t0);
}

static void cuda_embed(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x) {
    struct cuda_backend *cb = cuda(b);
    const struct cuk_weight *w = dev_weight(cb, e);
    step_op(cb, n, false);
    double t0 = prof_begin(cb);
    const int32_t *t = stage_array(cb, tokens, sizeof(int32_t) * (size_t)n);
    cb->xq_of = NULL;
    if (w && t) cuk_embed(&cb->q, w, t, n, scale, x);
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
    step_op(cb, n, false);
    const int32_t *r = rows ? stage_array(cb, rows, sizeof(int32_t) * (size_t)n) : NULL;
    const float *wd = dev_vec(cb, w);
    if ((rows && !r) || !wd) return;
    double t0 = prof_begin(cb);
    cuk_rmsnorm(&cb->q, x, r, wd, n, dim, eps, out, round_into_xq(cb, out, n, dim));
    prof_end(cb, P_NORM, t0);
}

static void cuda_add_norm(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                          float eps, float *out) {
    struct cuda_backend *cb = cuda(b);
    if (!norm_dim_ok(cb, dim)) return;
    step_op(cb, n, false);
    launch_held_packs(cb); /* the O product is queued (held_pack) */
    double t0 = prof_begin(cb);
    const struct cuk_xq *xq = round_into_xq(cb, w ? out : NULL, w ? n : 0, dim);
    cuk_add_norm(&cb->q, x, add, dev_vec(cb, post), dev_vec(cb, w), n, dim, eps, out, xq);
    prof_end(cb, P_NORM, t0);
}

static void cuda_rope_table(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear,
                            int half, float *cos, float *sin) {
    struct cuda_backend *cb = cuda(b);
    step_op(cb, n, false);
    const int32_t *p = stage_array(cb, pos, sizeof(int32_t) * (size_t)n);
    const float *f = dev_vec(cb, inv_freq);
    if (p && f) cuk_rope_table(&cb->q, p, n, f, linear, half, cos, sin);
}

static void cuda_glu(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff,
                     float *out) {
    struct cuda_backend *cb = cuda(b);
    step_op(cb, n, true);
    double t0 = prof_begin(cb);
    cuk_glu(&cb->q, act == BE_GLU_GELU_TANH, gate, up, n, n_ff, out, round_into_xq(cb, out, n, n_ff));
    prof_end(cb, P_GLU, t0);
}

/* ---- KV cache ----------------------------------------------------------- */

/* Waits for the work and the row copies behind it. */
static void wait_streams(struct cuda_backend *cb) {
    ck(cb, cudaStreamSynchronize(cb->stream), "running the step");
    ck(cb, cudaStreamSynchronize(cb->copy_stream), "reading new KV rows");
}

/* The step's end: waits for the streams; staged data may then be overwritten. */
static int end_step(struct cuda_backend *cb) {
    wait_streams(cb);
    ck(cb, cuk_queue_error(&cb->q), "a kernel launch");
    ck(cb, cudaGetLastError(), "a kernel launch");
    cb->stage_used = cb->stage_up = cb->defer_used = 0;
    cb->in_step = false;
    cb->qprep_of = NULL;
    for (int i = 0; i < cb->n_dead; i++) cudaFree(cb->dead[i]);
    cb->n_dead = 0;
    if (cb->failed) return kvq_error("%s", cb->failure);
    return 0;
}

/* The backend's state of a cache (made at first use; the pool frees it with the cache). */
static struct cuda_mirror *mirror_of(struct cuda_backend *cb, struct kv_cache *c) {
    struct cuda_mirror **mp = (struct cuda_mirror **)kv_cache_mirror(c);
    if (!*mp && !(*mp = calloc(1, sizeof **mp))) ck(cb, cudaErrorMemoryAllocation, "host memory");
    return *mp;
}

/* Where the encode writes the table entry e of a block that position p begins (0:
 * nowhere, sync_table uploads it): the entry past the uploaded ones, or one of them,
 * on a table with room. The mirror takes the block, so sync_table finds the entry
 * current; a decode step that begins a block then issues no scatter, the same
 * launches as other steps. */
static uint64_t table_entry_by_encode(struct cuda_mirror *m, int32_t p, int32_t e, const struct kv_block *block) {
    if (!m || p % KV_BLOCK_TOKENS != 0 || e >= m->table_cap || e > m->table_n) return 0;
    m->table_blk[e] = block;
    if (e == m->table_n) m->table_n = e + 1;
    return (uint64_t)(uintptr_t)(m->table_d + e);
}

/* The cache's block table on the device, made current: the entries that changed.
 * Entries are compared by block: reading every block's address to compare it
 * cost a step the host time of 32 tables of 512 blocks at 32K rows (about 20 ns an
 * entry with the blocks out of cache), before its first issue (docs). */
static bool sync_table(struct cuda_backend *cb, struct cuda_mirror *m, const struct kv_view *v) {
    if (v->n_blk > m->table_cap) {
        int32_t cap = m->table_cap ? m->table_cap : 64;
        while (cap < v->n_blk) cap *= 2;
        uint64_t *d = NULL;
        const struct kv_block **hb = malloc(sizeof *hb * (size_t)cap);
        if (!hb || !ck(cb, cudaMalloc((void **)&d, sizeof *d * (size_t)cap), "device memory for a block table")) {
            free(hb);
            return ck(cb, cudaErrorMemoryAllocation, "host memory");
        }
        free_after_step(cb, m->table_d);
        free(m->table_blk);
        m->table_d = d;
        m->table_blk = hb;
        m->table_cap = cap;
        m->table_n = 0;
    }
    for (int32_t i = 0; i < v->n_blk;) {
        int32_t j = i;
        while (j < v->n_blk && !(j < m->table_n && m->table_blk[j] == v->blk[j])) j++; /* a run of changed entries */
        if (j > i) { /* their addresses, staged for the device */
            uint64_t *a = copy_space(cb, m->table_d + i, sizeof *a * (size_t)(j - i));
            if (!a) return false;
            for (int32_t k = i; k < j; k++) {
                m->table_blk[k] = v->blk[k];
                a[k - i] = v->blk[k] ? (uint64_t)(uintptr_t)v->blk[k]->dev : 0;
            }
        }
        i = j > i ? j : i + 1;
    }
    m->table_n = v->n_blk;
    return true;
}

/* The device copy of a cache's windows, made current up to position `limit` (the
 * rows from there on are being encoded on the device): rows appended since the last
 * sync, or all of them after a change that was not an append (kv_cache_epoch). */
static struct cuda_mirror *sync_windows(struct cuda_backend *cb, struct kv_cache *c, const struct kv_view *v,
                                        int32_t limit) {
    struct cuda_mirror *m = mirror_of(cb, c);
    const struct kv_shape *sh = kv_cache_get_shape(c);
    const int H = sh->n_kv_heads, D = sh->head_dim;
    if (!m) return NULL;
    if (!m->win) {
        m->ring_cap = v->win_span + cb->max_tokens;
        m->sink_cap = v->sinks > 0 ? v->sinks : 1;
        m->n_kv = H;
        m->head_dim = D;
        m->win_row = v->win_row;
        size_t bytes = 2 * (size_t)H * (size_t)(m->ring_cap + m->sink_cap) * v->win_row;
        if (!ck(cb, cudaMalloc((void **)&m->win, bytes), "device memory for KV windows") ||
            !ck(cb, cudaMalloc((void **)&m->mu, sizeof(float) * 2 * (size_t)H * D), "device memory for KV offsets")) {
            cudaFree(m->win);
            m->win = NULL;
            return NULL;
        }
        m->valid = false;
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
            cuk_queue_copy(&cb->q, b->dev, b->data, bytes);
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
        record_stop(cb); /* what it recorded writes the old buffer */
        if (!ck(cb, cudaMalloc((void **)&d, cap), "device memory for new KV rows")) return (size_t)-1;
        if (cb->rb_used) ck(cb, cudaMemcpyAsync(d, cb->rb_d, cb->rb_used, cudaMemcpyDeviceToDevice, cb->stream), "KV rows");
        wait_streams(cb); /* the copies read the old buffer */
        cudaFree(cb->rb_d);
        cb->rb_d = d;
        cb->rb_cap = cap;
    }
    cb->rb_used = off + bytes;
    return off;
}

/* The pinned read-back buffer at `bytes` (what it held is dropped); false with the
 * failure recorded. */
static bool rb_host_make(struct cuda_backend *cb, size_t bytes) {
    cudaFreeHost(cb->rb_h);
    cb->rb_h = NULL;
    cb->rb_h_cap = 0;
    if (!ck(cb, cudaMallocHost((void **)&cb->rb_h, bytes), "pinned memory for new KV rows")) return false;
    cb->rb_h_cap = bytes;
    return true;
}

/* The read-back buffers, device and pinned host, for a pass's rows: made here once
 * (pinning 100 MB took 50-75 ms on an H100 machine's host, which growing them at a
 * prompt's first passes added to its time), grown by readback_alloc and cuda_sync
 * only where a pass appends more than the engine foresaw. */
static int cuda_reserve_kv(struct backend *b, size_t bytes) {
    struct cuda_backend *cb = cuda(b);
    if (bytes > cb->rb_cap) {
        cudaFree(cb->rb_d);
        cb->rb_d = NULL;
        cb->rb_cap = 0;
        if (!ck(cb, cudaMalloc((void **)&cb->rb_d, bytes), "device memory for new KV rows")) return kvq_error("%s", cb->failure);
        cb->rb_cap = bytes;
    }
    if (bytes > cb->rb_h_cap && !rb_host_make(cb, bytes)) return kvq_error("%s", cb->failure);
    return 0;
}

/* A device buffer of at least need floats at *buf (*have of them now): a new one when
 * short, the old freed after the step (its recorded work may still read it). false
 * with the failure recorded. */
static bool grow_floats(struct cuda_backend *cb, float **buf, size_t *have, size_t need, const char *what) {
    if (need <= *have) return true;
    free_after_step(cb, *buf);
    *buf = NULL;
    *have = 0;
    if (!ck(cb, cudaMalloc((void **)buf, sizeof(float) * need), what)) return false;
    *have = need;
    return true;
}

/* Room for the prepared queries of n tokens. */
static bool ensure_qprep(struct cuda_backend *cb, int n, int n_head, int D) {
    const size_t need = cuk_qprep_floats(n > cb->max_tokens ? n : cb->max_tokens, n_head, D);
    return grow_floats(cb, &cb->qprep, &cb->qprep_floats, need, "device memory for attention");
}

/* The rows a token at position q reads by its plan: packed ranges, sinks and window. */
static int plan_rows(const struct kv_query_plan *pl, int32_t q) {
    return (pl->b1 >= pl->a1 ? pl->b1 - pl->a1 + 1 : 0) + (pl->b2 >= pl->a2 ? pl->b2 - pl->a2 + 1 : 0) + pl->sinks +
           (pl->ws <= q ? q - pl->ws + 1 : 0);
}

/* Room for the rows of n tokens that an encode leaves for cuk_kv_pack, this step's
 * first free ones; NULL with the failure recorded. */
static float *defer_rows(struct cuda_backend *cb, int n, int H, int D) {
    const size_t need = (size_t)n * 2 * H * D;
    if (cb->defer_used + need > cb->defer_floats) {
        size_t cap = cb->defer_floats ? 2 * cb->defer_floats : 64 * need;
        while (cap < cb->defer_used + need) cap *= 2;
        if (!grow_floats(cb, &cb->defer, &cb->defer_floats, cap, "device memory for KV rows")) return NULL;
    }
    float *at = cb->defer + cb->defer_used;
    cb->defer_used += need;
    return at;
}

/* The layer's new keys and values, encoded into the device cache; the host's copy of
 * the rows is filed during the next sync (kv_cache_append_begin / _end). With r, the same
 * launch first norms and rotates the queries and keys, and prepares the queries for
 * the attention that follows (cuda_attention then skips that launch). */
static int cuda_kv_append(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k,
                          const float *v, const struct be_rope *r) {
    struct cuda_backend *cb = cuda(b);
    if (n_seqs <= 0 || cb->failed) return cb->failed ? kvq_error("%s", cb->failure) : 0;
    const int n_tok = seqs[n_seqs - 1].first + seqs[n_seqs - 1].n;
    step_op(cb, n_tok, false);
    cb->qprep_of = NULL;
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
        if (kv_cache_append_begin(seqs[s].cache, seqs[s].n, kv_cache_n_past(seqs[s].cache)) != 0) {
            drop_pending(cb); /* the forward pass drops this batch's rows */
            return -1;
        }
    }
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
                if ((v.k_bits < 16 && v.k_group <= 0) || (v.v_bits < 16 && v.v_group <= 0))
                    return kvq_error("the CUDA backend has no attention for normal-float KV rows");
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
                struct cuda_mirror *tm = m ? m : mirror_of(cb, c);
                const size_t n = (size_t)seqs[s].n, kb = n * H * v.k_row, vb = n * H * v.v_row,
                             wb = v.windows ? n * H * v.win_row : 0;
                size_t rb = readback_alloc(cb, kb + vb + 2 * wb);
                if (rb == (size_t)-1) return kvq_error("%s", cb->failure);
                cb->pending[cb->n_pending++] = (struct pending_append){c, p0, seqs[s].n, rb, rb + kb, rb + kb + vb,
                                                                       rb + kb + vb + wb, v.windows, 0};
                for (int i = 0; i < seqs[s].n; i++, k_tok++) {
                    const int32_t p = p0 + i, e = kv_view_entry(&v, p);
                    const uint64_t block = (uint64_t)(uintptr_t)v.blk[e]->dev;
                    struct cuk_enc_tok *tk = (struct cuk_enc_tok *)(cb->stage_h + toks_off) + k_tok;
                    *tk = (struct cuk_enc_tok){
                        .t = seqs[s].first + i, .p = p, .block = block,
                        .table_at = table_entry_by_encode(tm, p, e, v.blk[e]),
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
    flush_copies(cb);
    if (ensure_signs(cb, D, views[0].signs) != 0) return kvq_error("%s", cb->failure);
    struct cuk_qk_rope rope = {0};
    if (r) {
        if (!ensure_qprep(cb, n_tok, r->n_head, D)) return kvq_error("%s", cb->failure);
        rope = (struct cuk_qk_rope){.q = r->q, .k = r->k, .n_head = r->n_head, .q_norm = dev_vec(cb, r->q_norm),
                                    .k_norm = dev_vec(cb, r->k_norm), .eps = r->eps, .cos = r->cos, .sin = r->sin,
                                    .half = r->half, .pairing = r->pairing, .scale = r->attn_scale};
    }
    /* a recorded step whose sequences append a row each reads those rows from f16
     * windows where the cache keeps its newest rows there (win_span): their packing can
     * go beside the step's attention, or the products after it (held_pack), off the
     * chain of launches it waits for */
    bool one_row_each = cb->q.recording;
    for (int s = 0; s < n_seqs; s++) one_row_each = one_row_each && seqs[s].n == 1;
    /* a one-token step's packing waits for the next norm after a short attention */
    bool hold = false;
    if (one_row_each && cb->one_token) {
        const int32_t q = kv_cache_n_past(seqs[0].cache) - 1;
        struct kv_query_plan pl;
        kv_cache_query_plan(seqs[0].cache, q, &pl);
        hold = plan_rows(&pl, q) < cuk_long_attn_rows();
    }
    for (int f = 0; f < n_fmt; f++) {
        const struct kv_view *vw = &views[f];
        struct cuk_enc_args args = {
            .k_bits = vw->k_bits, .k_group = vw->k_group, .v_bits = vw->v_bits, .v_group = vw->v_group,
            .k_rot = vw->k_rot, .v_rot = vw->v_rot, .windows = vw->windows, .k_row = vw->k_row, .v_row = vw->v_row,
            .head_bytes = vw->head_bytes, .win_row = vw->win_row, .n_kv = H, .head_dim = D, .k = k, .v = v,
            .signs = cb->signs, .toks = (const struct cuk_enc_tok *)(cb->stage_d + toks_off) + first[f],
            .n = first[f + 1] - first[f], .readback = cb->rb_d, .rope = rope,
        };
        /* prepared as the attention kernels read rotated or packed keys */
        if (r && (vw->k_rot || vw->k_bits < 16)) args.rope.qprep = cb->qprep;
        if (one_row_each && vw->windows && vw->win_span > 0 && (vw->k_bits < 16 || vw->v_bits < 16) &&
            !(args.defer = defer_rows(cb, args.n, H, D)))
            return kvq_error("%s", cb->failure);
        cuk_kv_encode(&cb->q, &args);
        if (args.defer && hold) {
            if (cb->n_held_pack == MAX_FORMATS) launch_held_packs(cb); /* no norm since the last append */
            cb->held_pack[cb->n_held_pack++] = args;
        } else {
            cuk_kv_pack(&cb->q, &args);
        }
        if (!args.defer && cb->one_token && cb->q.recording && cb->idle_beside) cuk_idle_beside(&cb->q);
    }
    prof_end(cb, P_KV_ENCODE, t0);
    if (!cb->q.recording) copy_new_rows(cb); /* recorded: after the segment is issued */
    if (cb->failed) return kvq_error("%s", cb->failure);
    if (r) {
        cb->qprep_of = r->q;
        cb->qprep_n = n_tok;
        cb->qprep_scale = r->attn_scale;
    }
    return 0;
}

/* The parts the appends' ends left (caches that reached their offsets point), as one
 * list over the threads. */
static void offsets_task(void *arg, int ith, int nth) {
    const struct cuda_backend *cb = arg;
    long total = 0, begin, end;
    for (int i = 0; i < cb->n_pending; i++) total += cb->pending[i].parts;
    kvq_split(total, ith, nth, &begin, &end);
    for (int i = 0, first = 0; i < cb->n_pending; first += cb->pending[i++].parts)
        for (long p = begin > first ? begin : first; p < end && p < first + cb->pending[i].parts; p++)
            kv_cache_offsets_part(cb->pending[i].cache, (int)(p - first));
}

/* The pending appends' rows into the host's copy, a share of the appends each. */
static void rows_task(void *arg, int ith, int nth) {
    const struct cuda_backend *cb = arg;
    long begin, end;
    kvq_split(cb->rows_to - cb->rows_from, ith, nth, &begin, &end);
    for (long i = cb->rows_from + begin; i < cb->rows_from + end; i++) {
        const struct pending_append *pa = &cb->pending[i];
        const uint8_t *h = cb->rb_h;
        kv_cache_append_rows(pa->cache, pa->p0, pa->n, h + pa->k, h + pa->v, pa->windows ? h + pa->wk : NULL,
                             pa->windows ? h + pa->wv : NULL);
    }
}

/* Runs task over the host threads (the pool made at first need), or inline. */
static void on_host_threads(struct cuda_backend *cb, void (*task)(void *, int, int)) {
    if (!cb->pool && cb->n_threads != 1) cb->pool = kvq_threads_new(cb->n_threads);
    if (cb->pool) kvq_threads_run(cb->pool, task, cb);
    else task(cb, 0, 1);
}

/* The rows of the pending appends up to `to` (read back) into the host's copy: on
 * the host threads when they are many (a prompt's), else on this thread. A decode
 * step's 32 one-token appends are a few KB: waking 15 threads for them each step
 * made a 64-token run on a 16-core host decode up to a third slower now and then
 * (a thread late to run holds the step), and never with 4 threads or 1. */
#define ROWS_FOR_THREADS 256
static void file_rows(struct cuda_backend *cb, int to) {
    if (to <= cb->rows_from) return;
    cb->rows_to = to;
    long rows = 0;
    for (int i = cb->rows_from; i < to && rows < ROWS_FOR_THREADS; i++) rows += cb->pending[i].n;
    if (rows < ROWS_FOR_THREADS) rows_task(cb, 0, 1);
    else on_host_threads(cb, rows_task);
    cb->rows_from = to;
}

/* After the step: the host's copy of the rows the device encoded that no early copy
 * took (a 4096-token prompt brings 0.5 GB of f16 rows: one host thread copied them at
 * about 6 GB/s), then the offsets' re-encoding where a cache reached its point (32
 * layers of 8 KV heads re-encode 2 x 8 x 128 rows each, about 70 ms on one thread). */
static int finish_appends(struct cuda_backend *cb) {
    int rc = 0, parts = 0;
    double t0 = prof_begin(cb);
    file_rows(cb, cb->n_pending);
    for (int i = 0; i < cb->n_pending; i++) {
        struct pending_append *pa = &cb->pending[i];
        pa->parts = rc == 0 ? kv_cache_append_end(pa->cache, pa->p0, pa->n) : 0;
        if (pa->parts < 0) rc = -1, pa->parts = 0;
        parts += pa->parts;
    }
    if (parts > 0) on_host_threads(cb, offsets_task);
    drop_pending(cb);
    cb->rb_used = 0;
    prof_end(cb, P_KV_FINISH, t0);
    return rc;
}

static void cuda_attention(struct backend *b, const struct be_attention *a, int n) {
    struct cuda_backend *cb = cuda(b);
    cb->xq_of = NULL;
    if (n <= 0 || cb->failed) return;
    step_op(cb, n, false);
    const int D = a->head_dim;
    double t0 = prof_begin(cb);
    if (!cuk_attention_head_dim_supported(D)) {
        snprintf(cb->failure, sizeof cb->failure, "the CUDA attention kernels take head sizes 64, 128 and 256, not %d", D);
        cb->failed = true;
        return;
    }
    if (cb->cap_uc < n) {
        free(cb->uc);
        free(cb->uc_mirror);
        free(cb->uc_chunk);
        cb->uc = malloc(sizeof *cb->uc * (size_t)n);
        cb->uc_mirror = malloc(sizeof *cb->uc_mirror * (size_t)n);
        cb->uc_chunk = malloc(sizeof *cb->uc_chunk * (size_t)n);
        cb->cap_uc = cb->uc && cb->uc_mirror && cb->uc_chunk ? n : 0;
        if (!cb->cap_uc) {
            ck(cb, cudaErrorMemoryAllocation, "host memory");
            return;
        }
    }
    size_t need = cuk_attention_scratch_floats(cb->max_tokens > n ? cb->max_tokens : n, a->n_head, D, cb->n_sm);
    if (!grow_floats(cb, &cb->part, &cb->part_floats, need, "device memory for attention")) return;
    /* each sequence's cache once: its block table, its windows */
    int nu = 0;
    struct kv_view views[MAX_FORMATS];
    int n_fmt = 0;
    for (int t = 0; t < n; t++) {
        if (nu > 0 && cb->uc[nu - 1] == a->caches[t]) continue;
        struct kv_cache *c = a->caches[t];
        struct kv_view v;
        kv_cache_view(c, &v);
        struct cuda_mirror *m = v.windows ? sync_windows(cb, c, &v, kv_cache_n_past(c)) : mirror_of(cb, c);
        if (!m || !sync_table(cb, m, &v)) return;
        cb->uc[nu] = c;
        cb->uc_mirror[nu++] = m;
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
    /* chunks: runs of consecutive positions of one sequence (a prefill), up to
     * chunk_max tokens, which the tensor-core kernel attends together (the union of
     * their rows, each token masked to its own: sliding and rotating windows too);
     * uc_chunk[t] is the length of the chunk starting at t, else 0 */
    const int chunk_max = cuk_attn_tile_chunk(a->n_head / a->n_kv, D);
    for (int t = 0; t < n;) {
        const struct kv_cache *c = a->caches[t];
        int len = 1;
        while (len < chunk_max && t + len < n && a->caches[t + len] == c && a->pos[t + len] == a->pos[t] + len)
            len++;
        cb->uc_chunk[t] = len;
        for (int i = 1; i < len; i++) cb->uc_chunk[t + i] = 0;
        t += len;
    }
    /* the tokens' plans by row format, and in each first the single tokens, then the
     * chunks: a launch each */
    size_t toks_off = stage_alloc(cb, sizeof(struct cuk_attn_tok) * (size_t)n);
    size_t idx_off = stage_alloc(cb, sizeof(int32_t) * (size_t)n);
    size_t grp_off = stage_alloc(cb, sizeof(struct cuk_attn_group) * (size_t)n);
    if (toks_off == (size_t)-1 || idx_off == (size_t)-1 || grp_off == (size_t)-1) return;
    struct {
        int fmt, tok0, n_tok, grp0, n_grp, max_group;
    } sets[2 * MAX_FORMATS];
    int n_sets = 0, k = 0, ng = 0, attn_rows = 0;
    for (int f = 0; f < n_fmt; f++)
        for (int chunks = 0; chunks < 2; chunks++) {
            sets[n_sets].fmt = f;
            sets[n_sets].tok0 = k;
            sets[n_sets].grp0 = ng;
            sets[n_sets].max_group = 1;
            int u = -1, run0 = 0; /* a sequence's tokens are consecutive: run0 its first */
            for (int t = 0; t < n; t++) {
                if (u < 0 || cb->uc[u] != a->caches[t]) u++, run0 = t;
                const int len = cb->uc_chunk[t];
                if (len == 0 || (len > 1) != (chunks == 1)) continue;
                struct kv_view v;
                kv_cache_view(a->caches[t], &v);
                if (!same_format(&views[f], &v)) continue;
                ((struct cuk_attn_group *)(cb->stage_h + grp_off))[ng++] =
                    (struct cuk_attn_group){k - sets[n_sets].tok0, len};
                if (len > sets[n_sets].max_group) sets[n_sets].max_group = len;
                for (int i = t; i < t + len; i++, k++) {
                    struct kv_cache *c = a->caches[i];
                    struct kv_query_plan pl;
                    kv_cache_query_plan(c, a->pos[i], &pl);
                    const int rows = plan_rows(&pl, a->pos[i]);
                    if (rows > attn_rows) attn_rows = rows;
                    const int32_t fe = kv_view_entry(&v, a->pos[run0]);
                    const struct kv_cache_config *cfg = kv_cache_get_config(c);
                    const struct kv_shape *sh = kv_cache_get_shape(c);
                    const struct cuda_mirror *m = cb->uc_mirror[u], *w = m->win ? m : NULL;
                    struct cuk_attn_tok *tk = (struct cuk_attn_tok *)(cb->stage_h + toks_off) + k;
                    *tk = (struct cuk_attn_tok){
                        .q_pos = a->pos[i], .a1 = pl.a1, .b1 = pl.b1, .a2 = pl.a2, .b2 = pl.b2, .sinks = pl.sinks,
                        .ws = pl.ws, .fresh = a->pos[run0], .max_size = cfg->max_size, .keep = cfg->keep,
                        .window = sh->window,
                        .nkb = v.nkb, .base = v.base, .table = (uint64_t)(uintptr_t)m->table_d,
                        .fresh_block = fe >= 0 && fe < v.n_blk && v.blk[fe] ? (uint64_t)(uintptr_t)v.blk[fe]->dev : 0,
                        .ring_cap = w ? w->ring_cap : 1, .sink_cap = w ? w->sink_cap : 1,
                        .ring = w ? (uint64_t)(uintptr_t)w->win : 0,
                        .sink = w ? (uint64_t)(uintptr_t)(w->win + 2 * (size_t)w->n_kv * w->ring_cap * w->win_row) : 0,
                        .mu = w && w->has_mu ? (uint64_t)(uintptr_t)w->mu : 0,
                    };
                    ((int32_t *)(cb->stage_h + idx_off))[k] = i;
                }
            }
            sets[n_sets].n_tok = k - sets[n_sets].tok0;
            sets[n_sets].n_grp = ng - sets[n_sets].grp0;
            if (sets[n_sets].n_tok > 0) n_sets++;
        }
    flush_copies(cb);
    /* the queries as this layer's KV append prepared them (its buffer had room for n) */
    const bool prepped = cb->qprep_of == a->q && cb->qprep_n == n && cb->qprep_scale == a->scale;
    cb->qprep_of = NULL;
    if (ensure_signs(cb, D, views[0].signs) != 0 || !ensure_qprep(cb, n, a->n_head, D)) return;
    const float *signs = cb->signs;
    const struct cuk_xq *xq = round_into_xq(cb, a->out, n, (int64_t)a->n_head * D);
    prof_end(cb, P_ATTN_HOST, t0);
    t0 = prof_begin(cb);
    for (int i = 0; i < n_sets && !cb->failed; i++) {
        const struct kv_view *v = &views[sets[i].fmt];
        struct cuk_attn_args args = {
            .k_bits = v->k_bits, .k_group = v->k_group, .v_bits = v->v_bits, .v_group = v->v_group,
            .k_rot = v->k_rot, .v_rot = v->v_rot, .k_row = v->k_row, .v_row = v->v_row,
            .head_bytes = v->head_bytes, .win_row = v->win_row,
            .n_head = a->n_head, .n_kv = a->n_kv, .head_dim = D, .scale = a->scale,
            .signs = signs, .q = a->q, .out = a->out,
            .toks = (const struct cuk_attn_tok *)(cb->stage_d + toks_off) + sets[i].tok0,
            .tok_index = (const int32_t *)(cb->stage_d + idx_off) + sets[i].tok0,
            .n = sets[i].n_tok,
            .groups = (const struct cuk_attn_group *)(cb->stage_d + grp_off) + sets[i].grp0,
            .n_groups = sets[i].n_grp, .max_group = sets[i].max_group,
            .partial = cb->part, .n_sm = cb->n_sm,
            .xq = xq ? *xq : (struct cuk_xq){NULL, NULL},
            .qprep = cb->qprep, .q_prepped = prepped,
        };
        cuk_attention(&cb->q, &args);
    }
    cb->q.attn_rows = attn_rows;
    cb->q.after_attn = true;
    prof_end(cb, P_ATTN_GPU, t0);
}

static int cuda_sync(struct backend *b) {
    struct cuda_backend *cb = cuda(b);
    record_stop(cb);
    steps_mark(cb->steps, cb->stream, false);
    for (int i = 0; i < cb->n_post; i++)
        ck(cb, cudaMemcpyAsync(cb->post[i].dst, cb->post[i].src, cb->post[i].bytes, cudaMemcpyDeviceToHost, cb->stream),
           "reading results");
    cb->n_post = 0;
    steps_mark(cb->steps, cb->stream, true);
    /* the rows no segment's copy took: after everything, into a buffer grown now */
    if (cb->n_pending > cb->rows_copied && cb->rb_used > cb->rb_h_cap) {
        wait_streams(cb);
        rb_host_make(cb, cb->rb_cap);
        cb->rows_copied = cb->n_row_copies = 0; /* the early copies went to the old buffer: all again */
        cb->rb_copied = 0;
    }
    if (cb->n_pending > cb->rows_copied && cb->rb_h)
        ck(cb, cudaMemcpyAsync(cb->rb_h + cb->rb_copied, cb->rb_d + cb->rb_copied, cb->rb_used - cb->rb_copied,
                               cudaMemcpyDeviceToHost, cb->stream),
           "reading new KV rows");
    /* the segments' rows as they arrive, while the GPU runs the rest of the step: filed
     * after the wait, they took 0.8 ms of a 16-token step (H100, llama3-8b, K4V4) */
    for (int i = 0; i < cb->n_row_copies; i++)
        if (!cb->failed && ck(cb, cudaEventSynchronize(cb->row_ev[i]), "running the step")) file_rows(cb, cb->row_end[i]);
    cb->n_row_copies = 0;
    for (int i = 0; i < RESULT_SLICES; i++) /* done at once where no slices were copied this step */
        ck(cb, cudaEventSynchronize(cb->result_ev[i]), "reading results");
    if (end_step(cb) != 0) {
        drop_pending(cb);
        cb->rb_used = 0;
        steps_done(cb->steps, true);
        return -1;
    }
    steps_waited(cb->steps);
    const int rc = finish_appends(cb);
    steps_done(cb->steps, false);
    return rc;
}

static void cuda_free(struct backend *b) {
    struct cuda_backend *cb = cuda(b);
    if (!cb) return;
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    if (cb->copy_stream) cudaStreamSynchronize(cb->copy_stream);
    if (cb->prof || cb->steps) {
        double total = 0;
        for (int i = 0; i < P_N; i++) total += cb->prof_s[i];
        fprintf(stderr, "kvq cuda profile (%.3f s %s):\n", total, cb->prof ? "in operations" : "of host time in operations");
        for (int i = 0; i < P_N; i++)
            if (cb->prof_n[i])
                fprintf(stderr, "  %-40s %9.3f ms %5.1f%% %8ld calls %8.1f us/call\n", prof_names[i], 1e3 * cb->prof_s[i],
                        100 * cb->prof_s[i] / total, cb->prof_n[i], 1e6 * cb->prof_s[i] / (double)cb->prof_n[i]);
    }
    if (cb->steps) {
        fprintf(stderr, "kvq cuda: recorded steps: %ld as graphs, %ld captured, %ld launch by launch\n", cb->q.n_replays,
                cb->q.n_captures, cb->q.n_eager);
        steps_print(cb->steps);
        steps_free(cb->steps);
    }
    kvq_threads_free(cb->pool);
    for (int i = 0; i < cb->n_ents; i++) cudaFree(cb->ents[i].dev);
    free(cb->ents);
    cudaFree(cb->deq);
    cudaFree(cb->x16);
    cudaFree(cb->xq.q);
    cudaFree(cb->xq.dsum);
    cudaFree(cb->wide_part);
    cudaFree(cb->mv.partial);
    cudaFree(cb->mv.counters);
    cudaFree(cb->part);
    cudaFree(cb->qprep);
    cudaFree(cb->defer);
    for (int i = 0; i < cb->n_dead; i++) cudaFree(cb->dead[i]);
    free(cb->dead);
    free(cb->post);
    cuk_queue_free(&cb->q);
    cudaFree(cb->signs);
    cudaFreeHost(cb->stage_h);
    cudaFree(cb->stage_d);
    cudaFree(cb->rb_d);
    for (int i = 0; i < ROW_COPIES; i++)
        if (cb->row_ev[i]) cudaEventDestroy(cb->row_ev[i]);
    for (int i = 0; i < RESULT_SLICES; i++)
        if (cb->result_ev[i]) cudaEventDestroy(cb->result_ev[i]);
    if (cb->work_ev) cudaEventDestroy(cb->work_ev);
    cudaFreeHost(cb->rb_h);
    free(cb->pending);
    free(cb->seq_fmt);
    free(cb->copies);
    free(cb->uc);
    free(cb->uc_mirror);
    free(cb->uc_chunk);
    arena_free(cb->host_arena);
    arena_free(cb->dev_arena);
    if (cb->blas) cublasDestroy(cb->blas);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    if (cb->copy_stream) cudaStreamDestroy(cb->copy_stream);
    free(cb);
}

static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .host_memory = false,
    .encodes_kv = true,
    .free = cuda_free,
    .reserve = cuda_reserve,
    .reserve_kv = cuda_reserve_kv,
    .alloc = cuda_alloc,
    .release = cuda_release,
    .upload_weight = cuda_upload_weight,
    .upload_vector = cuda_upload_vector,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .kv_pool_new = cuda_kv_pool_new,
    .matmul = cuda_matmul,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .add_norm = cuda_add_norm,
    .rope_table = cuda_rope_table,
    .glu = cuda_glu,
    .kv_append = cuda_kv_append,
    .attention = cuda_attention,
    .sync = cuda_sync,
};

/* n events without timing (they only order work and wake the host). */
static cudaError_t new_events(cudaEvent_t *ev, int n) {
    cudaError_t st = cudaSuccess;
    for (int i = 0; i < n && st == cudaSuccess; i++) st = cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming);
    return st;
}

struct backend *backend_cuda_new(int n_threads) {
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
    cb->n_threads = n_threads;
    const char *prof = getenv("KVQ_CUDA_PROFILE");
    if (prof && strcmp(prof, "steps") == 0) cb->steps = steps_new();
    cb->prof = prof && *prof && strcmp(prof, "0") != 0 && strcmp(prof, "steps") != 0;
    /* KVQ_CUDA_GRAPHS=0: decode steps launch by launch (the per-operation profile waits
     * for each operation, so it does too) */
    const char *graphs = getenv("KVQ_CUDA_GRAPHS");
    cb->q.graphs = !cb->prof && !(graphs && strcmp(graphs, "0") == 0);
    cb->q.last = -1;
    struct cudaDeviceProp prop;
    if ((st = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess || (st = cudaSetDevice(0)) != cudaSuccess ||
        (st = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (st = cudaStreamCreateWithFlags(&cb->copy_stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (st = new_events(&cb->work_ev, 1)) != cudaSuccess || (st = new_events(cb->row_ev, ROW_COPIES)) != cudaSuccess ||
        (st = new_events(cb->result_ev, RESULT_SLICES)) != cudaSuccess) {
        kvq_error("CUDA: cannot start on the device: %s", cudaGetErrorString(st));
        cuda_free(&cb->base);
        return NULL;
    }
    cb->q.stream = cb->stream;
    cb->q.pdl = prop.major >= 9; /* Hopper's programmatic dependent launch (an sm_80/89 build runs without) */
    cb->n_sm = prop.multiProcessorCount;
    cb->uva = prop.unifiedAddressing != 0;
    /* KVQ_CUDA_RESULT_SPLIT=bytes: results of that size or more come in slices (the tests
     * set 0, so that their small vocabularies take that path too) */
    const char *split = getenv("KVQ_CUDA_RESULT_SPLIT");
    cb->result_split = split ? strtoull(split, NULL, 10) : RESULT_SPLIT_BYTES;
    const char *fetch = getenv("KVQ_CUDA_STAGE_FETCH"); /* 0: copies as before (a measurement aid) */
    cb->stage_fetch = !fetch || atoi(fetch) != 0;
    const char *idle = getenv("KVQ_CUDA_IDLE_BESIDE");
    cb->idle_beside = !idle || atoi(idle) != 0;
    if (cublasCreate(&cb->blas) != CUBLAS_STATUS_SUCCESS || cublasSetStream(cb->blas, cb->stream) != CUBLAS_STATUS_SUCCESS) {
        kvq_error("cuBLAS: cannot start");
        cuda_free(&cb->base);
        return NULL;
    }
    return &cb->base;
}
