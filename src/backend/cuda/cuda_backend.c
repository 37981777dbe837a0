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
#include "backend/cuda/cuda_private.h"

/* Records the first failure; sync reports it. */
bool ck(struct cuda_backend *cb, cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "CUDA: %s: %s", what, cudaGetErrorString(e));
    }
    return false;
}


bool ck_blas(struct cuda_backend *cb, cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "cuBLAS: %s failed (status %d)", what, (int)st);
    }
    return false;
}


static void *cuda_alloc(struct backend *b, size_t bytes) {
    void *p = NULL;
    cudaError_t st = cudaMalloc(&p, bytes ? bytes : 1);
    if (st != cudaSuccess) {
        kvq_error_code(KVQ_ERR_DEVICE, "CUDA: no device memory for %zu bytes (%s)", bytes, cudaGetErrorString(st));
        (void)b;
        return NULL;
    }
    return p;
}

static void cuda_release(struct backend *b, void *p) {
    settle_sums(cuda(b)); /* before p, which it may write, is gone */
    cudaFree(p);
}


/* Pinned: a copy to it runs at the link's speed and needs no staging copy
 * (16 tokens' logits of a 128K vocabulary: 0.15 ms instead of 0.7 on the H100). */
static void *cuda_host_alloc(struct backend *b, size_t bytes) {
    (void)b;
    void *p = NULL;
    const cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        kvq_error_code(KVQ_ERR_DEVICE, "CUDA: %zu bytes of pinned host memory: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cuda_host_free(struct backend *b, void *p) {
    (void)b;
    if (p) cudaFreeHost(p);
}


/* Staging a pass may take this much a token (a 384-token pass of llama3-8b with K8V4
 * staged 4-8 MB: plans, block tables, window rows): made at the start, since growing
 * waits for the GPU and pins memory (slow) in the middle of a pass. */
#define STAGE_BYTES_PER_TOKEN ((size_t)16 << 10)


static int cuda_reserve(struct backend *b, int max_tokens, int64_t widest) {
    struct cuda_backend *cb = cuda(b);
    cb->max_tokens = max_tokens;
    const size_t stage = STAGE_BYTES_PER_TOKEN * (size_t)max_tokens;
    if (stage > cb->stage_cap && !stage_grow(cb, stage)) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    if (max_tokens > CUK_MATVEC_MAX || (cb->wide && max_tokens >= CUK_WIDE_MIN)) { /* f16 inputs of wide products */
        cudaFree(cb->x16);
        if (!(cb->x16 = cuda_alloc(b, sizeof(uint16_t) * (size_t)max_tokens * (size_t)widest))) return -1;
        cb->x16_cols = widest;
    }
    if (max_tokens > CUK_MATVEC_MAX && !cb->deq && !(cb->deq = cuda_alloc(b, DEQ_BYTES))) return -1;
    const size_t n = (size_t)(max_tokens < CUK_MATVEC_MAX ? max_tokens : CUK_MATVEC_MAX);
    cudaFree(cb->xq.q);
    cudaFree(cb->xq.dsum);
    cb->xq.q = cuda_alloc(b, n * (size_t)widest);
    cb->xq.dsum = cuda_alloc(b, sizeof(float2) * n * (size_t)(widest / 32 + 1));
    cb->xq_cols = widest;
    cb->xq_of = cb->x16_of = NULL;
    return cb->xq.q && cb->xq.dsum ? 0 : -1;
}



/* Waits for the work and the row copies behind it. */
void wait_streams(struct cuda_backend *cb) {
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
    rings_step_end(cb, !cb->failed);
    if (cb->failed) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    return 0;
}


/* A device buffer of at least need floats at *buf (*have of them now): a new one when
 * short, the old freed after the step (its recorded work may still read it). false
 * with the failure recorded. */
bool grow_floats(struct cuda_backend *cb, float **buf, size_t *have, size_t need, const char *what) {
    if (need <= *have) return true;
    free_after_step(cb, *buf);
    *buf = NULL;
    *have = 0;
    if (!ck(cb, cudaMalloc((void **)buf, sizeof(float) * need), what)) return false;
    *have = need;
    return true;
}


int cuda_sync(struct backend *b) {
    struct cuda_backend *cb = cuda(b);
    settle_sums(cb);
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
        if (!cb->failed && ck(cb, cudaEventSynchronize(cb->row_ev[i]), "running the step"))
            file_rows(cb, cb->row_end[i], i + 1 == cb->n_row_copies);
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
    prof_print(cb);
    steps_free(cb->steps);
    kvq_threads_free(cb->pool);
    for (int i = 0; i < cb->n_ents; i++) cudaFree(cb->ents[i].dev), cudaFree(cb->ents[i].f16);
    free(cb->ents);
    cudaFree(cb->deq);
    cudaFree(cb->x16);
    cudaFree(cb->xq.q);
    cudaFree(cb->xq.dsum);
    cudaFree(cb->wide_part);
    cudaFree(cb->top_d);
    cudaFree(cb->top_scratch);
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
    free(cb->seq_enc);
    cudaFreeHost(cb->offs_h);
    cudaFreeHost(cb->fetch_h);
    free(cb->copies);
    free(cb->uc);
    free(cb->uc_mirror);
    free(cb->uc_chunk);
    rings_step_end(cb, false);
    free(cb->long_rings);
    free(cb->later);
    for (int i = 0; i < cb->n_spare; i++) free(cb->spare[i].p);
    free(cb->spare);
    arena_free(cb->host_arena);
    arena_free(cb->dev_arena);
    arena_free(cb->mirror_arena);
    if (cb->blas) cublasDestroy(cb->blas);
    for (int i = 0; i < CUK_MATVEC_JOBS - 1; i++) {
        if (cb->side_blas[i]) cublasDestroy(cb->side_blas[i]);
        if (cb->side[i]) cudaStreamDestroy(cb->side[i]);
        if (cb->join_ev[i]) cudaEventDestroy(cb->join_ev[i]);
    }
    if (cb->fork_ev) cudaEventDestroy(cb->fork_ev);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    if (cb->copy_stream) cudaStreamDestroy(cb->copy_stream);
    free(cb);
}


static const struct backend_ops cuda_ops = {
    .name = "cuda",
    .host_memory = false,
    .encodes_kv = true,
    .chooses_offsets = true,
    .attends_nf = true,
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
    .run_on_host_threads = cuda_run_on_host_threads,
    .draw = cuda_draw,
    .read = cuda_read,
};


/* n events without timing (they only order work and wake the host). */
static cudaError_t new_events(cudaEvent_t *ev, int n) {
    cudaError_t st = cudaSuccess;
    for (int i = 0; i < n && st == cudaSuccess; i++) st = cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming);
    return st;
}


static void tuning_read(struct cuda_tuning *t) {
    const char *prof = getenv("KVQ_CUDA_PROFILE"), *graphs = getenv("KVQ_CUDA_GRAPHS");
    const char *split = getenv("KVQ_CUDA_RESULT_SPLIT"), *leave = getenv("KVQ_CUDA_LEAVE_OUT");
    const char *grid = getenv("KVQ_MV_STREAM_GRID"), *warp_items = getenv("KVQ_CUDA_WARP_ITEMS");
    t->steps = prof && strcmp(prof, "steps") == 0;
    t->prof = prof && *prof && strcmp(prof, "0") != 0 && !t->steps;
    t->graphs = !t->prof && !(graphs && strcmp(graphs, "0") == 0); /* the profile waits for each operation */
    t->result_split = split ? strtoull(split, NULL, 10) : RESULT_SPLIT_BYTES;
    snprintf(t->leave_out, sizeof t->leave_out, "%s", leave ? leave : "");
    t->kernels.stream_grid = grid ? atoi(grid) : 0;
    t->kernels.warp_items = warp_items ? atoi(warp_items) : 0;
}


struct cuda_backend *cuda_backend_on(int device, int n_threads, bool f16_weights) {
    int n = 0;
    cudaError_t st = cudaGetDeviceCount(&n);
    if (st != cudaSuccess || n == 0) {
        kvq_error_code(KVQ_ERR_DEVICE, "no CUDA device: %s", st != cudaSuccess ? cudaGetErrorString(st) : "none found");
        return NULL;
    }
    if (device < 0 || device >= n) {
        kvq_error_code(KVQ_ERR_DEVICE, "no CUDA device %d (this machine has %d: 0..%d)", device, n, n - 1);
        return NULL;
    }
    struct cuda_backend *cb = calloc(1, sizeof *cb);
    if (!cb) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    cb->base.ops = &cuda_ops;
    cb->n_threads = n_threads;
    tuning_read(&cb->tune);
    cb->f16_weights = f16_weights;
    cb->q.graphs = cb->tune.graphs;
    cb->q.leave_out = cb->tune.leave_out[0] ? cb->tune.leave_out : NULL;
    cuk_set_tuning(&cb->tune.kernels);
    cb->q.last = -1;
    struct cudaDeviceProp prop;
    cb->device = device;
    if ((st = cudaGetDeviceProperties(&prop, device)) != cudaSuccess || (st = cudaSetDevice(device)) != cudaSuccess ||
        (st = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (st = cudaStreamCreateWithFlags(&cb->copy_stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (st = new_events(&cb->work_ev, 1)) != cudaSuccess || (st = new_events(cb->row_ev, ROW_COPIES)) != cudaSuccess ||
        (st = new_events(cb->result_ev, RESULT_SLICES)) != cudaSuccess || (st = new_events(&cb->fork_ev, 1)) != cudaSuccess ||
        (st = new_events(cb->join_ev, CUK_MATVEC_JOBS - 1)) != cudaSuccess) {
        kvq_error_code(KVQ_ERR_DEVICE, "CUDA: cannot start on the device: %s", cudaGetErrorString(st));
        cuda_free(&cb->base);
        return NULL;
    }
    if (cb->tune.steps) cb->steps = steps_new(); /* events of this device */
    cb->q.stream = cb->stream;
    cb->q.device = device;
    cb->q.pdl = prop.major >= 9; /* Hopper's programmatic dependent launch (an sm_80/89 build runs without) */
    cb->n_sm = prop.multiProcessorCount;
    cb->wide = cuk_wide_available() != 0;
    cb->uva = prop.unifiedAddressing != 0;
    bool blas = cublasCreate(&cb->blas) == CUBLAS_STATUS_SUCCESS &&
                cublasSetStream(cb->blas, cb->stream) == CUBLAS_STATUS_SUCCESS;
    for (int i = 0; blas && i < CUK_MATVEC_JOBS - 1; i++)
        blas = cudaStreamCreateWithFlags(&cb->side[i], cudaStreamNonBlocking) == cudaSuccess &&
               cublasCreate(&cb->side_blas[i]) == CUBLAS_STATUS_SUCCESS &&
               cublasSetStream(cb->side_blas[i], cb->side[i]) == CUBLAS_STATUS_SUCCESS;
    if (!blas) {
        kvq_error_code(KVQ_ERR_DEVICE, "cuBLAS: cannot start");
        cuda_free(&cb->base);
        return NULL;
    }
    return cb;
}


struct backend *backend_cuda_new(int n_threads, bool f16_weights, int tp, const int *devices) {
    if (tp > 1) return backend_cuda_tp_new(tp, devices, n_threads, f16_weights);
    struct cuda_backend *cb = cuda_backend_on(0, n_threads, f16_weights);
    return cb ? &cb->base : NULL;
}
