/* Products, embeddings, norms, RoPE tables and the GLU. Repacked weights on Hopper:
 * packed wide kernels from CUK_WIDE_MIN to CUK_WIDE_MAX tokens. Otherwise
 * matrix-vector kernels up to CUK_MATVEC_MAX tokens; beyond, cuBLAS on the weights'
 * f16 copies (dev_weight_f16), or where there are none on bands of rows dequantized
 * for each product. */
#include "backend/cuda/cuda_private.h"


/* A wide product's partial sums left pending (cb->sums) written to its outputs now:
 * step_op calls this for every operation but the two that take them (take_sums) and
 * read them as they are; reads, releases and the step's end call it too. */
void settle_sums(struct cuda_backend *cb) {
    if (cb->sums.splits < 2) return;
    cuk_wide_settle(&cb->q, &cb->sums);
    cb->sums.splits = 0;
}

/* The pending sums as the inputs y[0..n_jobs) of n tokens of rows values, if they are
 * those jobs' whole outputs: then taken, in[j] describing job j's (the caller reads
 * them all, so that nothing else need be written). */
static bool take_sums(struct cuda_backend *cb, int n_jobs, const float *const *y, int n, int rows,
                      struct cuk_sum_in *in) {
    const struct cuk_wide_pending *p = &cb->sums;
    if (p->splits < 2 || p->n_jobs != n_jobs || p->n != n) return false;
    for (int j = 0; j < n_jobs; j++)
        if (p->y[j] != y[j] || p->rows[j] != rows || p->y_stride[j] != rows) return false;
    for (int j = 0; j < n_jobs; j++)
        in[j] = (struct cuk_sum_in){p->part[j], p->bias[j], p->splits, rows, (int64_t)p->n * rows};
    cb->sums.splits = 0;
    return true;
}


/* What an operation writing n rows of k floats at out writes besides them, in the
 * form a product of repacked weights takes them (NULL: nothing): rounded into xq for
 * the matrix-vector kernels, else in f16 into x16 for the wide kernels (in their
 * order) or cuBLAS, so that the product needs no launch to convert them. */
const struct cuk_xq *product_input(struct cuda_backend *cb, const float *out, int n, int64_t k) {
    cb->xq_of = cb->x16_of = NULL;
    if (out == cb->x32_unread) cb->x32_unread = NULL; /* written again */
    if (!out || !cb->any_repacked || k % 32 != 0) return NULL;
    const bool wide = cb->wide && n >= CUK_WIDE_MIN;
    if (n <= CUK_MATVEC_MAX && !wide) {
        if (k > cb->xq_cols) return NULL;
        cb->xq_of = out;
        cb->xq_n = n;
        cb->xq_k = k;
        return &cb->xq;
    }
    if (!cb->x16 || k > cb->x16_cols || n > cb->max_tokens) return NULL;
    cb->x16_of = out;
    cb->x16_n = n;
    cb->x16_k = k;
    cb->x16_wide = wide && n <= CUK_WIDE_MAX; /* past it, cuBLAS */
    cb->into = (struct cuk_xq){NULL, NULL, cb->x16_wide ? NULL : cb->x16, cb->x16_wide ? cb->x16 : NULL};
    return &cb->into;
}


/* Where the operation that product_input just served writes its floats: nowhere (NULL)
 * where the product after it reads only the f16 form: past CUK_WIDE_MAX tokens every
 * repacked weight goes to cuBLAS on x16 (an f16 copy or a dequantized band), and no
 * weight is float (TF32 on the floats). x32_unread remembers the buffer: a product
 * that would read its floats after all fails (x32_readable) rather than read what was
 * never written. */
float *product_f32(struct cuda_backend *cb, float *out, int n) {
    if (!out || cb->x16_of != out || n <= CUK_WIDE_MAX || cb->float_matrix) return out;
    cb->x32_unread = out;
    return NULL;
}


static bool x32_readable(struct cuda_backend *cb, const float *x) {
    if (x != cb->x32_unread) return true;
    if (!cb->failed) {
        cb->failed = true;
        snprintf(cb->failure, sizeof cb->failure, "internal: a product read floats its input's operation left out");
    }
    return false;
}


/* x (n rows of k floats, x_stride apart) in f16 in x16, in the wide kernels' order or
 * not: converted unless the operation that wrote x left them there. */
static void x16_make(struct cuda_backend *cb, const float *x, int64_t x_stride, int n, int64_t k, bool wide) {
    if (cb->x16_of == x && x_stride == k && cb->x16_n == n && cb->x16_k == k && cb->x16_wide == wide) return;
    if (!x32_readable(cb, x)) return;
    if (wide) cuk_to_half_wide(&cb->q, x, x_stride, n, k, cb->x16);
    else cuk_to_half(&cb->q, x, x_stride, n, k, cb->x16);
    cb->x16_of = x_stride == k ? x : NULL;
    cb->x16_n = n;
    cb->x16_k = k;
    cb->x16_wide = wide;
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
 * a weight of another type, left to the other paths). The jobs share x, made f16
 * once; consecutive jobs of one type and width share a launch. */
static bool wide_products(struct cuda_backend *cb, const float *x, int64_t x_stride, int n, int n_jobs,
                          const struct be_matmul *jobs) {
    struct cuk_matvec_job wj[8];
    if (n_jobs < 1 || n_jobs > 8) return false;
    for (int j = 0; j < n_jobs; j++) {
        wj[j] = (struct cuk_matvec_job){dev_weight(cb, jobs[j].w), jobs[j].y, dev_vec(cb, jobs[j].bias), 0};
        if (!wj[j].w) return true; /* failed: the backend says why */
        if (!cuk_repacked(wj[j].w->type) || wj[j].w->cols != wj[0].w->cols) return false;
    }
    int first[9], n_launch = 0; /* the launches' first jobs */
    size_t floats = 0;
    for (int j = 0; j < n_jobs; j++) {
        if (j == 0 || wj[j].w->type != wj[j - 1].w->type || j - first[n_launch - 1] == CUK_MATVEC_JOBS)
            first[n_launch++] = j;
    }
    first[n_launch] = n_jobs;
    for (int l = 0; l < n_launch; l++) {
        const size_t f = cuk_matmul_wide_scratch(wj + first[l], first[l + 1] - first[l], n, cb->n_sm);
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
    x16_make(cb, x, x_stride, n, wj[0].w->cols, true);
    /* one launch whose outputs stay on the device may leave its sums to the next
     * operation (not under tensor parallelism, whose all-reduce reads the outputs) */
    bool host = false;
    for (int j = 0; j < n_jobs; j++) host |= jobs[j].host_y != NULL;
    for (int l = 0; l < n_launch; l++)
        cuk_matmul_wide(&cb->q, wj + first[l], first[l + 1] - first[l], cb->x16, n, cb->wide_part, cb->n_sm,
                        n_launch == 1 && !host && !cb->tp ? &cb->sums : NULL);
    for (int j = 0; j < n_jobs; j++)
        if (jobs[j].host_y) post_copy(cb, jobs[j].host_y, jobs[j].y, sizeof(float) * (size_t)n * (size_t)wj[j].w->rows);
    return true;
}


#define BESIDE_MAX 256 /* tokens up to which a GEMM product's jobs run side by side */

void cuda_matmul(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs,
                        const struct be_matmul *jobs) {
    struct cuda_backend *cb = cuda(b);
    step_op(cb, n, false);
    cb->qprep_of = NULL; /* the products may write the queries */
    for (int j = 0; j < n_jobs; j++) { /* or an input an earlier operation converted */
        if (jobs[j].y == cb->xq_of || jobs[j].y == cb->x16_of) cb->xq_of = cb->x16_of = NULL;
        if (jobs[j].y == cb->x32_unread) cb->x32_unread = NULL; /* its floats written now */
    }
    double t0 = prof_begin(cb);
    /* the output product ends the step: the work before it goes out as a segment of its
     * own, so that the rows it encoded are read back and filed while this product runs,
     * not after the step (a one-token step only where its results go to the host, as
     * measured; its draws on the device keep the segment whole) */
    if (cb->q.recording && cb->n_pending > cb->rows_copied && n_jobs > 0 && jobs[0].logits &&
        (jobs[0].host_y || !cb->one_token))
        cut_segment(cb);
    /* (results for the host up to CUK_MATVEC_MAX tokens stay with the matrix-vector
     * kernels, which copy them out in slices while computing the rest) */
    if (cb->wide && n >= CUK_WIDE_MIN && n <= CUK_WIDE_MAX && n_jobs > 0 && !(jobs[0].host_y && n <= CUK_MATVEC_MAX) &&
        wide_products(cb, x, x_stride, n, n_jobs, jobs)) {
        prof_end(cb, P_WIDE, t0);
        return;
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
            if (!x32_readable(cb, x)) return;
            cuk_quantize_x(&cb->q, x, x_stride, n, k, &cb->xq); /* the jobs share x: rounded once */
            cb->xq_of = x_stride == k ? x : NULL;
            cb->xq_n = n;
            cb->xq_k = k;
        }
        if (n_mj == 1 && jobs[0].host_y && cuk_repacked(mj[0].w->type) && mj[0].w->rows >= 16 * RESULT_SLICES &&
            sizeof(float) * (size_t)n * (size_t)mj[0].w->rows >= cb->tune.result_split) {
            matvec_in_slices(cb, &mj[0], jobs[0].host_y, x, x_stride, n);
        } else {
            /* results the host wants, under the slices' size, the product writes there itself
             * (host_alloc's pinned memory): no copy after the step (16 us of a one-token step
             * on the H100, its 0.5 MB of logits) */
            for (int j = 0; j < n_mj; j++)
                if (jobs[j].host_y && cb->uva && sizeof(float) * (size_t)n * (size_t)mj[j].w->rows < cb->tune.result_split)
                    mj[j].y = jobs[j].host_y;
            cuk_matvec(&cb->q, mj, n_mj, x, x_stride, &cb->xq, n, &cb->mv);
            for (int j = 0; j < n_mj; j++)
                if (jobs[j].host_y && mj[j].y != jobs[j].host_y)
                    post_copy(cb, jobs[j].host_y, jobs[j].y, sizeof(float) * (size_t)n * (size_t)mj[j].w->rows);
        }
        prof_end(cb, P_MATVEC, t0);
        return;
    }
    record_stop(cb); /* cuBLAS launches directly */
    cb->xq_of = NULL;
    cb->q.after_attn = false;
    /* up to BESIDE_MAX tokens, jobs on f16 copies run side by side: job j > 0 on side
     * stream j - 1, joined before anything reads their outputs. K's and V's GEMMs
     * alone fill a few multiprocessors at such widths; wider, each fills the GPU and
     * side by side they were slower (docs/cuda-performance.md). Bands of dequantized
     * rows share cb->deq: one after the other. */
    bool beside = n_jobs > 1 && n_jobs <= CUK_MATVEC_JOBS && n <= BESIDE_MAX;
    for (int j = 0; j < n_jobs && beside; j++) beside = dev_weight_f16(cb, jobs[j].w) != NULL;
    for (int j = 0; j < n_jobs; j++) {
        const struct cuk_weight *w = dev_weight(cb, jobs[j].w);
        if (!w) return;
        /* wide batches: bands of rows dequantized for a GEMM (y^T = W x^T, column-major) on
         * tensor cores: quantized weights with f16 operands and f32 sums (their inputs
         * lose less in f16 than the CPU's int8 rounding); float weights in TF32, as
         * f16 would lose small activations, and bf16 weights' range */
        const bool f16 = w->type != KVQ_F32 && w->type != KVQ_BF16 && w->type != KVQ_F16;
        if (f16) x16_make(cb, x, x_stride, n, w->cols, false); /* the jobs share x: once */
        else if (!x32_readable(cb, x)) return;
        cublasHandle_t h = cb->blas;
        /* the side streams start from the shared input, before job 0's GEMM */
        if (beside && j == 0 && !ck(cb, cudaEventRecord(cb->fork_ev, cb->stream), "ordering products")) return;
        if (beside && j > 0) {
            if (!ck(cb, cudaStreamWaitEvent(cb->side[j - 1], cb->fork_ev, 0), "ordering products")) return;
            h = cb->side_blas[j - 1];
        }
        const float one = 1.0f, zero = 0.0f;
        const void *w16 = dev_weight_f16(cb, jobs[j].w);
        int64_t band = w16 ? w->rows : (int64_t)(DEQ_BYTES / (f16 ? 2 : 4) / (size_t)w->cols);
        if (band > w->rows) band = w->rows;
        for (int64_t r0 = 0; r0 < w->rows; r0 += band) {
            int64_t r1 = r0 + band < w->rows ? r0 + band : w->rows;
            if (!w16) cuk_dequantize(&cb->q, w, r0, r1, cb->deq, f16);
            cublasStatus_t st =
                f16 ? cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)(r1 - r0), n, (int)w->cols, &one,
                                   w16 ? w16 : cb->deq, CUDA_R_16F, (int)w->cols, cb->x16, CUDA_R_16F, (int)w->cols,
                                   &zero, jobs[j].y + r0, CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT)
                    : cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)(r1 - r0), n, (int)w->cols, &one, cb->deq,
                                   CUDA_R_32F, (int)w->cols, x, CUDA_R_32F, (int)x_stride, &zero, jobs[j].y + r0,
                                   CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
            if (!ck_blas(cb, st, "GEMM")) return;
        }
        if (beside && j > 0 && !ck(cb, cudaEventRecord(cb->join_ev[j - 1], cb->side[j - 1]), "ordering products")) return;
    }
    for (int j = 1; beside && j < n_jobs; j++)
        if (!ck(cb, cudaStreamWaitEvent(cb->stream, cb->join_ev[j - 1], 0), "ordering products")) return;
    for (int j = 0; j < n_jobs; j++) {
        const float *bias = dev_vec(cb, jobs[j].bias);
        const int64_t rows = dev_weight(cb, jobs[j].w)->rows; /* a rank's own rows under --tp */
        if (bias) cuk_add_bias(&cb->q, jobs[j].y, bias, n, rows);
        if (jobs[j].host_y) post_copy(cb, jobs[j].host_y, jobs[j].y, sizeof(float) * (size_t)n * (size_t)rows);
    }
    prof_end(cb, P_GEMM, t0);
}


void cuda_embed(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x) {
    struct cuda_backend *cb = cuda(b);
    const struct cuk_weight *w = dev_weight(cb, e);
    step_op(cb, n, false);
    double t0 = prof_begin(cb);
    const int32_t *t = stage_array(cb, tokens, sizeof(int32_t) * (size_t)n);
    cb->xq_of = cb->x16_of = NULL;
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


void cuda_rmsnorm(struct backend *b, const float *x, const int32_t *rows, const float *w, int n, int dim,
                         float eps, float *out) {
    struct cuda_backend *cb = cuda(b);
    if (!norm_dim_ok(cb, dim)) return;
    step_op(cb, n, false);
    const int32_t *r = rows ? stage_array(cb, rows, sizeof(int32_t) * (size_t)n) : NULL;
    const float *wd = dev_vec(cb, w);
    if ((rows && !r) || !wd) return;
    double t0 = prof_begin(cb);
    cuk_rmsnorm(&cb->q, x, r, wd, n, dim, eps, out, product_input(cb, out, n, dim));
    prof_end(cb, P_NORM, t0);
}


void cuda_add_norm(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                          float eps, float *out) {
    struct cuda_backend *cb = cuda(b);
    if (!norm_dim_ok(cb, dim)) return;
    struct cuk_sum_in as;
    const float *ys[1] = {add};
    const bool sums = take_sums(cb, 1, ys, n, dim, &as); /* else step_op settles them */
    step_op(cb, n, false);
    launch_held_packs(cb); /* the O product is queued (held_pack) */
    double t0 = prof_begin(cb);
    const struct cuk_xq *xq = product_input(cb, w ? out : NULL, w ? n : 0, dim);
    cuk_add_norm(&cb->q, x, add, sums ? &as : NULL, dev_vec(cb, post), dev_vec(cb, w), n, dim, eps,
                 product_f32(cb, out, n), xq);
    prof_end(cb, P_NORM, t0);
}


void cuda_rope_table(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear,
                            int half, float *cos, float *sin) {
    struct cuda_backend *cb = cuda(b);
    step_op(cb, n, false);
    const int32_t *p = stage_array(cb, pos, sizeof(int32_t) * (size_t)n);
    const float *f = dev_vec(cb, inv_freq);
    if (p && f) cuk_rope_table(&cb->q, p, n, f, linear, half, cos, sin);
}


/* The rows of logits settled where the product left them: a greedy step reads k pairs
 * a row back, a draw the token, not the row (64 MB for 128 rows of a 128K vocabulary).
 * Buffers for max_tokens rows, made once (a recorded step keeps them). */
_Static_assert(BE_TOP_MAX == CUK_TOP_MAX, "the kernel finds as many as the backend is asked for");

void cuda_draw(struct backend *b, float *x, int n, int cols, const struct be_draw *d, const struct be_draw_op *ops,
               int n_ops, const struct be_draw_out *out) {
    struct cuda_backend *cb = cuda(b);
    step_op(cb, n, false);
    if (cb->failed) return;
    const size_t row_bytes =
        2 * sizeof(double) + (sizeof(float) + sizeof(int32_t)) * (CUK_TOP_MAX + 1 + BE_CUT_MAX) + sizeof(int32_t);
    if (n > cb->top_rows) {
        const int rows = n > cb->max_tokens ? n : cb->max_tokens;
        free_after_step(cb, cb->top_d);
        free_after_step(cb, cb->top_scratch);
        cb->top_d = NULL;
        cb->top_scratch = NULL;
        cb->top_rows = 0;
        if (!ck(cb, cudaMalloc(&cb->top_d, row_bytes * (size_t)rows), "device memory for the largest logits") ||
            !ck(cb, cudaMalloc(&cb->top_scratch, cuk_top_scratch_bytes(rows)), "device memory for the largest logits"))
            return;
        cb->top_rows = rows;
    }
    const size_t rows = (size_t)cb->top_rows;
    double *log_z = cb->top_d, *sum = log_z + rows;
    float *vals = (float *)(sum + rows), *drawn_logit = vals + CUK_TOP_MAX * rows, *cand_v = drawn_logit + rows;
    int32_t *ids = (int32_t *)(cand_v + BE_CUT_MAX * rows), *drawn = ids + CUK_TOP_MAX * rows, *n_cand = drawn + rows;
    int32_t *cand_i = n_cand + rows;
    const struct be_draw *d_d = stage_array(cb, d, sizeof *d * (size_t)n);
    const struct be_draw_op *ops_d = n_ops > 0 ? stage_array(cb, ops, sizeof *ops * (size_t)n_ops) : NULL;
    if (!d_d || (n_ops > 0 && !ops_d)) return;
    bool draws = false, lps = false, cuts = false;
    for (int r = 0; r < n; r++)
        draws |= d[r].row == BE_ROW_DRAW, lps |= d[r].logprobs != 0, cuts |= d[r].row == BE_ROW_CUT;
    if (n_ops > 0) cuk_adjust(&cb->q, x, n, cols, d_d, ops_d);
    cuk_top(&cb->q, x, n, cols, CUK_TOP_MAX, vals, ids, cb->top_scratch, cb->n_sm);
    if (draws || lps) cuk_draw(&cb->q, x, n, cols, d_d, ops_d, vals, ids, drawn, drawn_logit, log_z);
    if (cuts) cuk_cut(&cb->q, x, n, cols, d_d, vals, sum, n_cand, cand_v, cand_i);
    post_copy(cb, out->vals, vals, sizeof(float) * (size_t)n * CUK_TOP_MAX);
    post_copy(cb, out->ids, ids, sizeof(int32_t) * (size_t)n * CUK_TOP_MAX);
    if (draws) post_copy(cb, out->drawn, drawn, sizeof(int32_t) * (size_t)n);
    if (draws) post_copy(cb, out->drawn_logit, drawn_logit, sizeof(float) * (size_t)n);
    if (lps) post_copy(cb, out->log_z, log_z, sizeof(double) * (size_t)n);
    if (cuts) {
        post_copy(cb, out->sum, sum, sizeof(double) * (size_t)n);
        post_copy(cb, out->n_cand, n_cand, sizeof(int32_t) * (size_t)n);
        post_copy(cb, out->cand_vals, cand_v, sizeof(float) * BE_CUT_MAX * (size_t)n);
        post_copy(cb, out->cand_ids, cand_i, sizeof(int32_t) * BE_CUT_MAX * (size_t)n);
    }
    for (int r0 = 0, r1; r0 < n; r0 = r1) { /* runs of rows whose logits the host reads */
        for (r1 = r0 + 1; r1 < n && (d[r1].row == BE_ROW_LOGITS) == (d[r0].row == BE_ROW_LOGITS);) r1++;
        if (d[r0].row == BE_ROW_LOGITS)
            post_copy(cb, out->logits + (size_t)r0 * cols, x + (size_t)r0 * cols,
                      sizeof(float) * (size_t)(r1 - r0) * cols);
    }
}


void cuda_glu(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff,
                     float *out) {
    struct cuda_backend *cb = cuda(b);
    struct cuk_sum_in gu[2];
    const float *ys[2] = {gate, up};
    const bool sums = take_sums(cb, 2, ys, n, n_ff, gu); /* else step_op settles them */
    step_op(cb, n, true);
    double t0 = prof_begin(cb);
    const struct cuk_xq *xq = product_input(cb, out, n, n_ff);
    cuk_glu(&cb->q, act == BE_GLU_GELU_TANH, gate, up, sums ? gu : NULL, n, n_ff, product_f32(cb, out, n), xq);
    prof_end(cb, P_GLU, t0);
}


void cuda_read(struct backend *b, void *dst, const void *src, size_t bytes) {
    struct cuda_backend *cb = cuda(b);
    settle_sums(cb);
    if (!cb->failed) ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "reading results");
}
