/* The model on the device: weights in their GGUF types (repacked where kernels read
 * them so) and vectors, found again by their host address. */
#include "backend/cuda/cuda_private.h"
#include "gguf/gguf.h"


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


const float *dev_vec(struct cuda_backend *cb, const float *host) {
    if (!host) return NULL;
    const struct dev_entry *e = find(cb, host);
    if (!e) {
        ck(cb, cudaErrorInvalidValue, "a vector the model did not upload");
        return NULL;
    }
    return (const float *)(e->dev + ((const uint8_t *)host - e->host));
}


const struct cuk_weight *dev_weight(struct cuda_backend *cb, const struct weight *w) {
    const struct dev_entry *e = find(cb, w);
    if (!e || !e->w.data) {
        ck(cb, cudaErrorInvalidValue, "a weight the model did not upload");
        return NULL;
    }
    return &e->w;
}


/* Device memory an f16 copy must leave free: the step's own allocations (staging,
 * read-back rows, cuBLAS's workspace) still have to fit after it. */
#define F16_RESERVE ((size_t)2 << 30)

/* A quantized weight's rows in f16 for products of more than 16 tokens (cuBLAS on
 * them, no dequantized band a product), made at its first such product where the
 * memory left allows; NULL where it does not (said once) or the backend keeps none. */
const void *dev_weight_f16(struct cuda_backend *cb, const struct weight *w) {
    struct dev_entry *e = (struct dev_entry *)find(cb, w);
    if (!cb->f16_weights || !e || !e->w.data || e->w.type == KVQ_F32 || e->w.type == KVQ_F16 || e->w.type == KVQ_BF16)
        return NULL;
    if (e->f16 || e->f16_none) return e->f16;
    record_stop(cb); /* a one-time allocation, never recorded */
    const size_t bytes = 2 * (size_t)e->w.rows * (size_t)e->w.cols;
    size_t free_b = 0, total = 0;
    if (cudaMemGetInfo(&free_b, &total) != cudaSuccess || free_b < bytes + F16_RESERVE ||
        cudaMalloc(&e->f16, bytes) != cudaSuccess) {
        cudaGetLastError();
        e->f16 = NULL;
        e->f16_none = true;
        if (!cb->f16_short)
            fprintf(stderr, "kvq: CUDA: no device memory left for f16 copies of the weights (%.2f GiB free): products "
                            "of more than 16 tokens dequantize them at every step (slower)\n", free_b / 1073741824.0);
        cb->f16_short = true;
        return NULL;
    }
    cuk_dequantize(&cb->q, &e->w, 0, e->w.rows, e->f16, 1);
    return e->f16;
}


/* Frees every f16 weight copy and makes no more, for memory the KV cache needs: the
 * copies are a speed-up, the cache is not (a 70B model's copies on one GPU left no
 * room for the windows of later sequences). Waits for the work queued so far, which
 * may read them; graphs that did are not replayed again, since products without the
 * copies record other launches. False when there was none to free. */
bool drop_f16_copies(struct cuda_backend *cb) {
    bool any = false;
    for (int i = 0; i < cb->n_ents; i++) any = any || cb->ents[i].f16;
    if (!any) return false;
    record_stop(cb);
    wait_streams(cb);
    for (int i = 0; i < cb->n_ents; i++) {
        cudaFree(cb->ents[i].f16);
        cb->ents[i].f16 = NULL;
    }
    cb->f16_weights = false; /* dev_weight_f16 makes none from here on */
    fprintf(stderr, "kvq: CUDA: f16 copies of the weights freed for the KV cache: products of more than 16 tokens "
                    "dequantize them at every step (slower)\n");
    return true;
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
        if (!e) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        cb->ents = e;
        cb->cap_ents = cap;
    }
    struct dev_entry *e = &cb->ents[cb->n_ents];
    memset(e, 0, sizeof *e);
    e->host = host;
    e->bytes = bytes;
    cudaError_t st = cudaMalloc((void **)&e->dev, data_bytes ? data_bytes : 1);
    if (st != cudaSuccess)
        return kvq_error_code(KVQ_ERR_DEVICE, "CUDA: no device memory for %zu bytes of weights (%s)", data_bytes,
                              cudaGetErrorString(st));
    if (data) st = cudaMemcpy(e->dev, data, data_bytes, cudaMemcpyHostToDevice);
    if (st != cudaSuccess) {
        cudaFree(e->dev);
        return kvq_error_code(KVQ_ERR_DEVICE, "CUDA: copying weights: %s", cudaGetErrorString(st));
    }
    cb->n_ents++;
    qsort(cb->ents, (size_t)cb->n_ents, sizeof *cb->ents, ent_cmp);
    *out = (struct dev_entry *)find(cb, host);
    return 0;
}


/* The file's pages of an uploaded weight leave the process's resident memory (a later
 * read, a tensor-parallel rank's share say, maps them again from the page cache): a
 * model's size less of RSS once on the GPU. */
static void release_host(const struct weight *w) {
    if (w->file) gguf_release_pages(w->file, w->data, w->row_bytes * (size_t)w->rows);
}


int cuda_upload_weight(struct backend *b, const struct weight *w) {
    struct cuda_backend *cb = cuda(b);
    if (!cuk_type_supported(w->type) || w->cols % 8 != 0)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "the CUDA backend cannot multiply %s weights of %lld columns",
                              kvq_dtype_name(w->type), (long long)w->cols);
    struct dev_entry *e;
    if (!cuk_repacked(w->type)) {
        if (add_entry(cb, w, sizeof *w, w->data, w->row_bytes * (size_t)w->rows, &e) != 0) return -1;
        if (e) e->w = (struct cuk_weight){w->type, e->dev, w->rows, w->cols, w->row_bytes, NULL};
        cb->float_matrix = true;
        release_host(w);
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
    if (st != cudaSuccess)
        return kvq_error_code(KVQ_ERR_DEVICE, "CUDA: repacking a weight of %zu bytes: %s", raw_bytes,
                              cudaGetErrorString(st));
    release_host(w);
    return 0;
}


int cuda_upload_vector(struct backend *b, const float *v, int64_t n) {
    struct dev_entry *e;
    return add_entry(cuda(b), v, sizeof(float) * (size_t)n, v, sizeof(float) * (size_t)n, &e);
}
