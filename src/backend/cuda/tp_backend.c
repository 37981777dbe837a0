/* Tensor parallelism over NCCL: one model across 2-8 GPUs of one host, split as
 * Megatron does. One cuda_backend a GPU (a rank), all driven by the caller's thread:
 * each operation is issued to every rank in turn with its arguments cut to the rank's
 * share, and the ranks exchange data only through NCCL (an all-reduce after each
 * product split by input columns: NCCL's, or for a decode step's small sums our kernel
 * on NCCL's symmetric memory and barriers, all_reduce.h).
 *
 * What a rank holds: Q/K/V and gate/up by output rows (its query and KV heads, its FFN
 * columns), O and down by input columns, the embeddings whole (every rank embeds, so
 * the residual stream is the same on all), the output matrix on rank 0, which alone
 * computes the logits. Every activation buffer the forward pass allocates exists on
 * every rank at the same size; an address inside rank 0's stands for the same offset
 * in rank r's.
 *
 * Why one host thread and not a thread or process a rank: the KV policy (positions,
 * windows, block tables) lives on the host in one copy holding every head (rank 0
 * begins the appends, the last rank ends them: cuda_private.h), so a saved sequence
 * or prefix-cache entry is the same file under any number of GPUs, and the scheduler
 * drives one engine. The ranks' launches are asynchronous, so issuing them in turn
 * costs host time, not GPU time. A decode step is recorded by every rank, its
 * all-reduces as meeting points of the ranks' records (NCCL calls of all ranks in one
 * group), and issued in a few segments, each a CUDA graph a GPU with NCCL's kernels
 * inside, captured and replayed by all ranks together (queue.h, cuk_group). Every op
 * leaves the caller's current device as it found it. docs/tensor-parallel.md has the
 * measurements, the attempts that were not kept, and the design across hosts. */
#include "backend/cuda/cuda_private.h"

#ifdef KVQ_HAVE_NCCL
#include <nccl.h>

#include "backend/cuda/all_reduce.h"

struct tp_buf {
    uint8_t *base[TP_MAX];
    size_t bytes;
};

/* A weight's part on each rank; `cols` parts are copies made for the upload. */
struct tp_weight {
    const struct weight *whole;
    struct weight part[TP_MAX];
};

struct tp_backend {
    struct backend base;
    struct tp_shared sh;
    ncclComm_t comm[TP_MAX];
    struct cuk_reducer *reducer; /* small all-reduces (all_reduce.h); NULL: NCCL's all-reduce for all */
    struct tp_buf *bufs;
    int n_bufs, cap_bufs;
    struct tp_weight **ws; /* sorted by `whole` */
    int n_ws, cap_ws;
};

static struct tp_backend *tp_of(struct backend *b) { return (struct tp_backend *)b; }

/* The caller's current device, which every op restores (a process may drive other
 * contexts' GPUs from this thread). */
static int caller_device(void) {
    int d = 0;
    cudaGetDevice(&d);
    return d;
}

/* Rank r's backend, its device made current. */
static struct backend *on(struct tp_backend *t, int r) {
    cudaSetDevice(t->sh.rank[r]->device);
    return &t->sh.rank[r]->base;
}

/* Rank r's address for p, an address inside a buffer of alloc (NULL: p is no such
 * address, host memory say). */
static void *at_rank(const struct tp_backend *t, int r, const void *p) {
    if (!p) return NULL;
    const uint8_t *q = p;
    for (int i = 0; i < t->n_bufs; i++) {
        const struct tp_buf *b = &t->bufs[i];
        if (q >= b->base[0] && q < b->base[0] + b->bytes) return b->base[r] + (q - b->base[0]);
    }
    return NULL;
}

static const struct tp_weight *weight_of(const struct tp_backend *t, const struct weight *w) {
    int lo = 0, hi = t->n_ws - 1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (t->ws[mid]->whole == w) return t->ws[mid];
        if ((uintptr_t)t->ws[mid]->whole < (uintptr_t)w) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

/* Records a failed NCCL call as rank 0's failure (sync reports it). */
static bool nccl_ck(struct tp_backend *t, ncclResult_t res, const char *what) {
    if (res == ncclSuccess) return true;
    struct cuda_backend *cb = t->sh.rank[0];
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "NCCL: %s: %s", what, ncclGetErrorString(res));
    }
    return false;
}

/* The group's collective (cuk_group): the all-reduce of each rank's bytes at p[r], on
 * its stream: the reducer's kernel where it takes them, else one NCCL group call for all
 * ranks. */
static void meet(void *ctx, void *const *p, size_t bytes) {
    struct tp_backend *t = ctx;
    if (cuk_reducer_takes(t->reducer, p, bytes)) {
        cudaStream_t s[TP_MAX];
        for (int r = 0; r < t->sh.n; r++) s[r] = t->sh.rank[r]->stream;
        ck(t->sh.rank[0], cuk_reducer_run(t->reducer, p, bytes, s, t->sh.rank[0]->q.pdl), "all-reduce kernel");
        return;
    }
    nccl_ck(t, ncclGroupStart(), "group start");
    for (int r = 0; r < t->sh.n; r++)
        nccl_ck(t, ncclAllReduce(p[r], p[r], bytes / sizeof(float), ncclFloat, ncclSum, t->comm[r], t->sh.rank[r]->stream),
                "all-reduce");
    nccl_ck(t, ncclGroupEnd(), "all-reduce");
}

/* A recorded step is issued in segments, all ranks' together, cut after the all-reduce
 * numbered `reduces` (from 1) of the step: the GPUs start once the first layer is
 * recorded, and the host records each next segment while they run the one before.
 * Each cut is a boundary between graphs, where the kernel after it cannot start early
 * (PDL); segments of 12 layers ran the Llama-3-70B shape as fast as longer ones
 * (docs/tensor-parallel.md). */
static bool segment_cut(int reduces) { return reduces == 2 || reduces == 8 || (reduces > 8 && (reduces - 8) % 24 == 0); }

/* The sum over the ranks of each rank's n floats at p (rank 0's address), in place.
 * Recorded, it is a meeting point of the ranks' records, within their graphs. */
static void all_reduce(struct tp_backend *t, float *p, size_t n) {
    const size_t bytes = n * sizeof(float);
    bool recorded = true;
    for (int r = 0; r < t->sh.n; r++) recorded = recorded && t->sh.rank[r]->q.recording;
    if (recorded) {
        for (int r = 0; r < t->sh.n; r++) cuk_queue_meet(&t->sh.rank[r]->q, at_rank(t, r, p), bytes);
        t->sh.reduces++;
        if (segment_cut(t->sh.reduces)) issue_records_together(&t->sh);
        return;
    }
    for (int r = 0; r < t->sh.n; r++) { /* a rank recording: what it recorded goes first */
        on(t, r);
        record_stop(t->sh.rank[r]);
    }
    void *at[TP_MAX];
    for (int r = 0; r < t->sh.n; r++) at[r] = at_rank(t, r, p);
    cuk_group_meet_now(&t->sh.group, at, bytes);
}

static void tp_free(struct backend *b) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    for (int r = 0; r < t->sh.n; r++) /* first the ranks' graphs, which hold NCCL's captured work */
        if (t->sh.rank[r]) {
            struct backend *rb = on(t, r);
            rb->ops->free(rb);
        }
    cuk_reducer_free(t->reducer);
    for (int r = 0; r < t->sh.n; r++)
        if (t->comm[r]) ncclCommDestroy(t->comm[r]);
    for (int i = 0; i < t->n_ws; i++) free(t->ws[i]);
    free(t->ws);
    free(t->bufs);
    free(t->sh.dirty);
    free(t);
    cudaSetDevice(dev);
}

static int tp_reserve(struct backend *b, int max_tokens, int64_t widest) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    int rc = 0;
    for (int r = 0; r < t->sh.n && rc == 0; r++) {
        struct backend *rb = on(t, r);
        rc = rb->ops->reserve(rb, max_tokens, widest);
    }
    cudaSetDevice(dev);
    return rc;
}

static int tp_reserve_kv(struct backend *b, size_t bytes) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    int rc = 0;
    for (int r = 0; r < t->sh.n && rc == 0; r++) {
        struct backend *rb = on(t, r);
        rc = rb->ops->reserve_kv(rb, bytes / (size_t)t->sh.n);
    }
    cudaSetDevice(dev);
    return rc;
}

static void tp_release(struct backend *b, void *p) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    int i = 0;
    while (i < t->n_bufs && t->bufs[i].base[0] != p) i++;
    for (int r = 0; r < t->sh.n && i < t->n_bufs; r++) {
        struct backend *rb = on(t, r);
        rb->ops->release(rb, t->bufs[i].base[r]);
    }
    if (i < t->n_bufs) t->bufs[i] = t->bufs[--t->n_bufs];
    cudaSetDevice(dev);
}

static void *tp_alloc(struct backend *b, size_t bytes) {
    struct tp_backend *t = tp_of(b);
    if (t->n_bufs == t->cap_bufs) {
        int cap = t->cap_bufs ? 2 * t->cap_bufs : 32;
        struct tp_buf *nb = realloc(t->bufs, sizeof *nb * (size_t)cap);
        if (!nb) {
            kvq_error_code(KVQ_ERR_OOM, "out of memory");
            return NULL;
        }
        t->bufs = nb;
        t->cap_bufs = cap;
    }
    const int dev = caller_device();
    struct tp_buf nb = {.bytes = bytes};
    int r = 0;
    for (; r < t->sh.n; r++) {
        struct backend *rb = on(t, r);
        if (!(nb.base[r] = rb->ops->alloc(rb, bytes))) break;
    }
    if (r == t->sh.n) t->bufs[t->n_bufs++] = nb;
    else
        while (r-- > 0) on(t, r)->ops->release(on(t, r), nb.base[r]);
    cudaSetDevice(dev);
    return r == t->sh.n ? nb.base[0] : NULL;
}

/* Rank r's part of w: a run of its rows, or a copy of a run of its columns. */
static int cut_weight(const struct weight *w, int r, int n, struct weight *part) {
    *part = *w;
    if (w->split == WEIGHT_BY_ROWS) {
        if (w->rows % n != 0)
            return kvq_error_code(KVQ_ERR_UNSUPPORTED, "tensor parallelism: %lld rows of a weight do not split over %d GPUs",
                                  (long long)w->rows, n);
        part->rows = w->rows / n;
        part->data = (const uint8_t *)w->data + (size_t)r * (size_t)part->rows * w->row_bytes;
        return 0;
    }
    const int64_t cols = w->cols / n;
    const size_t row_bytes = w->cols % n == 0 ? kvq_dtype_row_bytes(w->type, (uint64_t)cols) : 0;
    if (row_bytes == 0)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED,
                              "tensor parallelism: %lld columns of a %s weight do not split over %d GPUs in whole blocks",
                              (long long)w->cols, kvq_dtype_name(w->type), n);
    uint8_t *data = malloc(row_bytes * (size_t)w->rows);
    if (!data) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    for (int64_t i = 0; i < w->rows; i++)
        memcpy(data + (size_t)i * row_bytes, (const uint8_t *)w->data + (size_t)i * w->row_bytes + (size_t)r * row_bytes,
               row_bytes);
    part->data = data;
    part->cols = cols;
    part->row_bytes = row_bytes;
    part->file = NULL; /* not the file's pages */
    return 0;
}

static int upload_weight(struct tp_backend *t, const struct weight *w) {
    const int n = t->sh.n;
    if (w->split == WEIGHT_WHOLE) { /* embeddings on every rank; the output matrix on rank 0 */
        for (int r = 0; r < (w->lookup ? n : 1); r++) {
            struct backend *rb = on(t, r);
            if (rb->ops->upload_weight(rb, w) != 0) return -1;
        }
        return 0;
    }
    if (weight_of(t, w)) return 0;
    if (t->n_ws == t->cap_ws) {
        int cap = t->cap_ws ? 2 * t->cap_ws : 256;
        struct tp_weight **nw = realloc(t->ws, sizeof *nw * (size_t)cap);
        if (!nw) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        t->ws = nw;
        t->cap_ws = cap;
    }
    struct tp_weight *tw = calloc(1, sizeof *tw); /* the parts' addresses are the ranks' keys: never moved */
    if (!tw) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    tw->whole = w;
    int rc = 0;
    for (int r = 0; r < n && rc == 0; r++) {
        struct backend *rb = on(t, r);
        rc = cut_weight(w, r, n, &tw->part[r]);
        if (rc == 0) rc = rb->ops->upload_weight(rb, &tw->part[r]);
        if (w->split == WEIGHT_BY_COLS) { /* the rank has its copy on the device */
            free((void *)tw->part[r].data);
            tw->part[r].data = NULL;
        }
    }
    if (rc != 0) {
        free(tw);
        return -1;
    }
    int i = t->n_ws;
    while (i > 0 && (uintptr_t)t->ws[i - 1]->whole > (uintptr_t)w) t->ws[i] = t->ws[i - 1], i--;
    t->ws[i] = tw;
    t->n_ws++;
    return 0;
}

static int tp_upload_weight(struct backend *b, const struct weight *w) {
    const int dev = caller_device();
    const int rc = upload_weight(tp_of(b), w);
    cudaSetDevice(dev);
    return rc;
}

static int tp_upload_vector(struct backend *b, const float *v, int64_t n) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    int rc = 0;
    for (int r = 0; r < t->sh.n && rc == 0; r++) {
        struct backend *rb = on(t, r);
        rc = rb->ops->upload_vector(rb, v, n);
    }
    cudaSetDevice(dev);
    return rc;
}

static void *tp_host_alloc(struct backend *b, size_t bytes) {
    const int dev = caller_device();
    struct backend *rb = on(tp_of(b), 0);
    void *p = rb->ops->host_alloc(rb, bytes);
    cudaSetDevice(dev);
    return p;
}

static void tp_host_free(struct backend *b, void *p) {
    const int dev = caller_device();
    struct backend *rb = on(tp_of(b), 0);
    rb->ops->host_free(rb, p);
    cudaSetDevice(dev);
}

static struct kv_pool *tp_pool_new(struct backend *b, size_t budget) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    on(t, 0);
    struct kv_pool *p = tp_kv_pool_new(&t->sh, budget);
    cudaSetDevice(dev);
    return p;
}

static void tp_matmul(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs,
                      const struct be_matmul *jobs) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    const enum weight_split split = jobs[0].w->split;
    if (split == WEIGHT_WHOLE) { /* the logits: rank 0, which holds the output matrix */
        struct backend *rb = on(t, 0);
        rb->ops->matmul(rb, x, x_stride, n, n_jobs, jobs);
        cudaSetDevice(dev);
        return;
    }
    assert(n_jobs <= 3 && (split == WEIGHT_BY_ROWS || (n_jobs == 1 && x_stride == jobs[0].w->cols)));
    for (int r = 0; r < t->sh.n; r++) {
        struct be_matmul part[3];
        for (int j = 0; j < n_jobs; j++) {
            const struct tp_weight *tw = weight_of(t, jobs[j].w);
            assert(tw && jobs[j].w->split == split && !jobs[j].host_y);
            const float *bias = jobs[j].bias;
            if (bias && split == WEIGHT_BY_ROWS) bias += (size_t)r * (size_t)tw->part[r].rows; /* the rank's rows' */
            else if (r > 0) bias = NULL;                                                     /* added once to the sum */
            part[j] = (struct be_matmul){.w = &tw->part[r], .y = at_rank(t, r, jobs[j].y), .bias = bias};
        }
        struct backend *rb = on(t, r);
        /* by columns, the input is the rank's share of the heads or FFN columns, packed */
        rb->ops->matmul(rb, at_rank(t, r, x), split == WEIGHT_BY_COLS ? x_stride / t->sh.n : x_stride, n, n_jobs, part);
    }
    if (split == WEIGHT_BY_COLS) all_reduce(t, jobs[0].y, (size_t)n * (size_t)jobs[0].w->rows);
    cudaSetDevice(dev);
}

static void tp_embed(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    for (int r = 0; r < t->sh.n; r++) {
        struct backend *rb = on(t, r);
        rb->ops->embed(rb, e, tokens, n, scale, at_rank(t, r, x));
    }
    cudaSetDevice(dev);
}

static void tp_rmsnorm(struct backend *b, const float *x, const int32_t *rows, const float *w, int n, int dim, float eps,
                       float *out) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    const int ranks = at_rank(t, 0, out) ? t->sh.n : 1; /* into host memory: rank 0's */
    for (int r = 0; r < ranks; r++) {
        struct backend *rb = on(t, r);
        rb->ops->rmsnorm(rb, at_rank(t, r, x), rows, w, n, dim, eps, ranks > 1 ? at_rank(t, r, out) : out);
    }
    cudaSetDevice(dev);
}

static void tp_add_norm(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                        float eps, float *out) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    for (int r = 0; r < t->sh.n; r++) {
        struct backend *rb = on(t, r);
        rb->ops->add_norm(rb, at_rank(t, r, x), at_rank(t, r, add), post, w, n, dim, eps, at_rank(t, r, out));
    }
    cudaSetDevice(dev);
}

static void tp_rope_table(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear, int half,
                          float *cos, float *sin) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    for (int r = 0; r < t->sh.n; r++) {
        struct backend *rb = on(t, r);
        rb->ops->rope_table(rb, pos, n, inv_freq, linear, half, at_rank(t, r, cos), at_rank(t, r, sin));
    }
    cudaSetDevice(dev);
}

static void tp_glu(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff, float *out) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    for (int r = 0; r < t->sh.n; r++) {
        struct backend *rb = on(t, r);
        rb->ops->glu(rb, act, at_rank(t, r, gate), at_rank(t, r, up), n, n_ff / t->sh.n, at_rank(t, r, out));
    }
    cudaSetDevice(dev);
}

static int tp_kv_append(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k, const float *v,
                        const struct be_rope *rope) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    int rc = 0;
    for (int r = 0; r < t->sh.n && rc == 0; r++) {
        struct be_rope part;
        if (rope) {
            part = *rope;
            part.q = at_rank(t, r, rope->q);
            part.k = at_rank(t, r, rope->k);
            part.cos = at_rank(t, r, rope->cos);
            part.sin = at_rank(t, r, rope->sin);
            part.n_head /= t->sh.n;
            part.n_kv /= t->sh.n;
        }
        struct backend *rb = on(t, r);
        rc = rb->ops->kv_append(rb, seqs, n_seqs, at_rank(t, r, k), at_rank(t, r, v), rope ? &part : NULL);
    }
    if (rc != 0) /* the forward pass drops the batch */
        for (int q = 0; q < t->sh.n; q++) drop_pending(t->sh.rank[q]);
    cudaSetDevice(dev);
    return rc;
}

static void tp_attention(struct backend *b, const struct be_attention *a, int n) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    for (int r = 0; r < t->sh.n; r++) {
        struct be_attention part = *a;
        part.q = at_rank(t, r, a->q);
        part.out = at_rank(t, r, a->out);
        part.n_head /= t->sh.n;
        part.n_kv /= t->sh.n;
        struct backend *rb = on(t, r);
        rb->ops->attention(rb, &part, n);
    }
    cudaSetDevice(dev);
}

/* Every rank waits and files its heads' rows, rank 0 first; the last one ends the appends. */
static int tp_sync(struct backend *b) {
    struct tp_backend *t = tp_of(b);
    const int dev = caller_device();
    int rc = 0;
    for (int r = 0; r < t->sh.n; r++) {
        struct backend *rb = on(t, r);
        if (rb->ops->sync(rb) != 0) rc = -1;
    }
    cuk_group_idle(&t->sh.group);
    t->sh.reduces = 0;
    cudaSetDevice(dev);
    return rc;
}

/* Rank 0's threads: the ranks' own host work runs within their operations. */
static void tp_run_on_host_threads(struct backend *b, kvq_task_fn fn, void *arg) {
    cuda_run_on_host_threads(&tp_of(b)->sh.rank[0]->base, fn, arg);
}

static const struct backend_ops tp_ops = {
    .name = "cuda",
    .host_memory = false,
    .encodes_kv = true,
    .attends_nf = true,
    .free = tp_free,
    .reserve = tp_reserve,
    .reserve_kv = tp_reserve_kv,
    .alloc = tp_alloc,
    .release = tp_release,
    .upload_weight = tp_upload_weight,
    .upload_vector = tp_upload_vector,
    .host_alloc = tp_host_alloc,
    .host_free = tp_host_free,
    .kv_pool_new = tp_pool_new,
    .matmul = tp_matmul,
    .embed = tp_embed,
    .rmsnorm = tp_rmsnorm,
    .add_norm = tp_add_norm,
    .rope_table = tp_rope_table,
    .glu = tp_glu,
    .kv_append = tp_kv_append,
    .attention = tp_attention,
    .sync = tp_sync,
    .run_on_host_threads = tp_run_on_host_threads,
};

struct backend *backend_cuda_tp_new(int n, const int *devices, int n_threads, bool f16_weights) {
    int have = 0;
    if (cudaGetDeviceCount(&have) != cudaSuccess) have = 0;
    if (n < 2 || n > TP_MAX) {
        kvq_error_code(KVQ_ERR_UNSUPPORTED, "tensor parallelism takes 2 to %d GPUs, not %d", TP_MAX, n);
        return NULL;
    }
    int devs[TP_MAX];
    for (int r = 0; r < n; r++) {
        devs[r] = devices ? devices[r] : r;
        if (have == 0) {
            kvq_error_code(KVQ_ERR_DEVICE, "tensor parallelism over %d GPUs: no CUDA device on this machine", n);
            return NULL;
        }
        if (devs[r] < 0 || devs[r] >= have) {
            kvq_error_code(KVQ_ERR_DEVICE, "tensor parallelism over %d GPUs: no CUDA device %d (this machine has %d)", n,
                           devs[r], have);
            return NULL;
        }
        for (int q = 0; q < r; q++)
            if (devs[q] == devs[r]) {
                kvq_error_code(KVQ_ERR_UNSUPPORTED, "tensor parallelism: GPU %d is named twice", devs[r]);
                return NULL;
            }
    }
    const int dev = caller_device();
    struct tp_backend *t = calloc(1, sizeof *t);
    if (!t) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    t->base.ops = &tp_ops;
    t->sh.n = n;
    /* host threads shared out between the ranks (each files its heads' rows) */
    const int per_rank = n_threads > 0 ? (n_threads + n - 1) / n : 0;
    for (int r = 0; r < n; r++) {
        if (!(t->sh.rank[r] = cuda_backend_on(devs[r], per_rank, f16_weights))) goto fail;
        t->sh.rank[r]->tp = &t->sh;
        t->sh.rank[r]->rank = r;
        t->sh.group.q[r] = &t->sh.rank[r]->q;
    }
    t->sh.group.n = n;
    t->sh.group.meet = meet;
    t->sh.group.ctx = t;
    setenv("NCCL_GRAPH_MIXING_SUPPORT", "0", 0); /* cuk_group: why */
    ncclResult_t res = ncclCommInitAll(t->comm, n, devs);
    if (res != ncclSuccess) {
        memset(t->comm, 0, sizeof t->comm);
        kvq_error_code(KVQ_ERR_DEVICE, "NCCL: cannot join %d GPUs: %s", n, ncclGetErrorString(res));
        goto fail;
    }
    char why[160];
    if (!(t->reducer = cuk_reducer_new(t->comm, devs, n, why, sizeof why)))
        fprintf(stderr, "kvq: tensor parallelism: NCCL's all-reduce for every sum (no %s)\n", why);
    cudaSetDevice(dev);
    return &t->base;
fail:
    tp_free(&t->base);
    cudaSetDevice(dev);
    return NULL;
}
#else
struct backend *backend_cuda_tp_new(int n, const int *devices, int n_threads, bool f16_weights) {
    (void)n, (void)devices, (void)n_threads, (void)f16_weights;
    kvq_error_code(KVQ_ERR_UNSUPPORTED, "this kvq was built without NCCL: no tensor parallelism (--tp)");
    return NULL;
}
#endif
