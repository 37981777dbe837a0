/* The CPU backend: host buffers, weights read in place from the mapped file (or
 * from the backend's 16-row copy, see cpu_weights.h), and
 * every operation split over a thread pool. Matrix products split their output rows
 * into chunks, attention has one work item per (token group, KV head), or where
 * those are fewer than the threads can share, one per part of 1024 positions of each,
 * merged after (a long decode on many cores; the same bits), and per-token work
 * (norms, RoPE, activation quantization) splits the tokens. Each thread (the
 * caller's included) takes its own share of the chunks or items first, then helps
 * with what the others have left (core/threadpool.h, kvq_work), so a thread that is
 * slower or descheduled for a while (the machine shared with other work) does not
 * hold the others at the end of the task; attention items are dealt longest first.
 * Per-token work that is small in all runs on the calling thread: waking the pool
 * and waiting for it costs more than the work. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_weights.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "kernels/activation.h"
#include "kernels/kv_quant.h"
#include "kernels/matmul.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"

/* Activation buffers for up to this many distinct weight types per input. */
#define MAX_ACT_TYPES 3

struct act_set {
    int n;
    uint32_t types[MAX_ACT_TYPES];
    uint8_t *bufs[MAX_ACT_TYPES];
    size_t row_bytes[MAX_ACT_TYPES];
};

struct cpu_backend {
    struct backend base;
    struct kvq_threads *pool;
    struct cpu_weights weights;
    uint8_t *act_mem[MAX_ACT_TYPES]; /* prepared activations of one matmul input */
    size_t act_cap;
    float *attn_scratch; /* per thread */
    size_t attn_scratch_floats;
    int attn_scratch_threads;
    /* [max_tokens]: a batch's tokens by cache and position, and in groups of consecutive
     * positions of one cache attended together, the longest attention first */
    struct attn_tok *attn_toks;
    struct attn_group *attn_groups;
    int attn_cap;
    /* a long attention of few items in parts (kv_cache_attend_part): each (group, KV
     * head)'s first part, the parts' items and their states, in one mapping of
     * attn_split_bytes (not the heap: made between KV blocks, it would keep the
     * blocks freed below it from going back to the system) */
    void *attn_split;
    size_t attn_split_bytes;
    size_t *attn_part0;
    struct attn_part *attn_parts;
    float *attn_part_mem;
    struct append_row *append_rows; /* [max_tokens]: an append's rows being encoded */
    int append_rows_cap;
    uint8_t *staging; /* their encoded bytes */
    size_t staging_cap;
    struct kvq_work *work; /* the work items of the task running on the pool */
};

static struct cpu_backend *cpu(struct backend *b) { return (struct cpu_backend *)b; }

/* Per-token work of fewer than this many value operations in all runs on the calling
 * thread (a 16-token decode batch's RMSNorm of 512 values, for instance). */
#define INLINE_WORK 8192

/* Runs fn(arg, t) over t in [0, n) on the pool, or inline when n tokens of `cost`
 * value operations each are little work. */
typedef void (*token_fn)(const void *arg, int t);
struct token_task {
    const void *arg;
    token_fn fn;
    int n;
};
static void token_task_run(void *p, int ith, int nth) {
    struct token_task *tt = p;
    long b, e;
    kvq_split(tt->n, ith, nth, &b, &e);
    for (long t = b; t < e; t++) tt->fn(tt->arg, (int)t);
}
static void for_each_token(struct cpu_backend *cb, int n, int64_t cost, token_fn fn, const void *arg) {
    struct token_task tt = {arg, fn, n};
    if (n < 4 || (int64_t)n * cost <= INLINE_WORK) token_task_run(&tt, 0, 1);
    else kvq_threads_run(cb->pool, token_task_run, &tt);
}

/* ---- matrix products ---------------------------------------------------- */

/* Bytes of the largest prepared row of k values over every weight type. */
static size_t max_act_row_bytes(int64_t k) {
    static const uint32_t types[] = {0, 1, 2, 8, 12, 14, 30};
    size_t best = 0;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        size_t b = kern_act_row_bytes(types[i], k);
        if (b > best) best = b;
    }
    return best;
}

static int ensure_act(struct cpu_backend *cb, size_t bytes) {
    if (bytes <= cb->act_cap) return 0;
    for (int i = 0; i < MAX_ACT_TYPES; i++) {
        free(cb->act_mem[i]);
        cb->act_mem[i] = malloc(bytes);
        if (!cb->act_mem[i]) {
            cb->act_cap = 0;
            return kvq_error_code(KVQ_ERR_OOM, "out of memory for activations");
        }
    }
    cb->act_cap = bytes;
    return 0;
}

/* Which prepared forms of an input [n][k] the given weights need. */
static void act_plan(struct cpu_backend *cb, struct act_set *as, const struct be_matmul *jobs, int n_jobs, int64_t k) {
    as->n = 0;
    for (int i = 0; i < n_jobs; i++) {
        int j = 0;
        while (j < as->n && as->types[j] != jobs[i].w->type) j++;
        if (j == as->n) {
            as->types[j] = jobs[i].w->type;
            as->bufs[j] = cb->act_mem[j];
            as->row_bytes[j] = kern_act_row_bytes(jobs[i].w->type, k);
            as->n++;
        }
    }
}

static int act_index(const struct act_set *as, uint32_t type) {
    for (int j = 0; j < as->n; j++)
        if (as->types[j] == type) return j;
    return 0;
}

struct act_arg {
    const struct act_set *as;
    const float *x;
    int64_t k, x_stride;
};
static void act_prepare_token(const void *p, int t) {
    const struct act_arg *a = p;
    for (int j = 0; j < a->as->n; j++)
        kern_act_prepare(a->as->types[j], a->x + (size_t)t * a->x_stride, a->as->bufs[j] + (size_t)t * a->as->row_bytes[j],
                         a->k);
}

/* Row chunks are a multiple of this many rows, so kernels see whole tiles. */
#define MM_ROW_ALIGN 16
/* Chunks per job and thread: a thread finishing early finds work left to help with. */
#define MM_CHUNKS_PER_THREAD 4

/* Thread i's part holds, of every job, the i-th of nth nearly equal runs of chunks
 * (contiguous rows, as a static split would give it). */
struct mm_task {
    const struct act_set *as;
    int n_tok, n_jobs, nth;
    const struct be_matmul *jobs;
    const void *w16[3]; /* the jobs' weights in 16-row form, or NULL */
    int64_t chunk_rows[3];
    int n_chunks[3];
    struct kvq_work *work;
};

static void mm_task_run(void *p, int ith, int nth) {
    const struct mm_task *mt = p;
    (void)nth;
    int part, s;
    while ((s = kvq_work_next(mt->work, ith, &part)) >= 0) {
        int j = 0;
        long b, e;
        for (;; j++) { /* slot s of the part: which job, which chunk */
            kvq_split(mt->n_chunks[j], part, mt->nth, &b, &e);
            if (s < e - b) break;
            s -= (int)(e - b);
        }
        const struct be_matmul *job = &mt->jobs[j];
        const struct weight *w = job->w;
        int ai = act_index(mt->as, w->type);
        int64_t r0 = (b + s) * mt->chunk_rows[j], r1 = r0 + mt->chunk_rows[j];
        if (r1 > w->rows) r1 = w->rows;
        struct kern_matmul_args a = {
            .wtype = w->type,
            .w = w->data,
            .w_row_bytes = w->row_bytes,
            .k = w->cols,
            .xa = mt->as->bufs[ai],
            .xa_row_bytes = mt->as->row_bytes[ai],
            .n_tok = mt->n_tok,
            .y = job->y,
            .y_stride = w->rows,
            .w16 = mt->w16[j],
        };
        kern_matmul(&a, r0, r1);
        if (job->bias)
            for (int t = 0; t < mt->n_tok; t++)
                for (int64_t r = r0; r < r1; r++) job->y[(size_t)t * w->rows + r] += job->bias[r];
    }
}

static void cpu_matmul(struct backend *b, const float *x, int64_t x_stride, int n, int n_jobs,
                       const struct be_matmul *jobs) {
    struct cpu_backend *cb = cpu(b);
    int64_t k = jobs[0].w->cols; /* the act buffers were sized by cpu_reserve */
    struct act_set as;
    act_plan(cb, &as, jobs, n_jobs, k);
    struct act_arg aa = {&as, x, k, x_stride};
    for_each_token(cb, n, k * as.n, act_prepare_token, &aa);
    const int nth = kvq_threads_size(cb->pool);
    struct mm_task mt = {.as = &as, .n_tok = n, .n_jobs = n_jobs, .nth = nth, .jobs = jobs, .work = cb->work};
    int *counts = kvq_work_counts(cb->work);
    for (int j = 0; j < n_jobs; j++) {
        const int64_t rows = jobs[j].w->rows, want = (int64_t)nth * MM_CHUNKS_PER_THREAD;
        int64_t cr = (rows + want - 1) / want;
        cr = (cr + MM_ROW_ALIGN - 1) / MM_ROW_ALIGN * MM_ROW_ALIGN;
        mt.chunk_rows[j] = cr;
        mt.n_chunks[j] = (int)((rows + cr - 1) / cr);
        mt.w16[j] = cpu_weights_rows16(&cb->weights, jobs[j].w);
        for (int i = 0; i < nth; i++) {
            long b, e;
            kvq_split(mt.n_chunks[j], i, nth, &b, &e);
            counts[i] += (int)(e - b);
        }
    }
    kvq_work_start(cb->work);
    kvq_threads_run(cb->pool, mm_task_run, &mt);
}

/* ---- per-token operations ------------------------------------------------ */

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float s = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * s * w[i];
}

struct embed_arg {
    const struct weight *e;
    const void *rows16;
    const int32_t *tokens;
    float scale, *x;
};
static void embed_token(const void *p, int t) {
    const struct embed_arg *a = p;
    const struct weight *e = a->e;
    float *x = a->x + (size_t)t * e->cols;
    if (a->rows16) /* a tied output's copy: the file's pages of it were released */
        kern_rows16_row(e->type, a->rows16, e->cols, a->tokens[t], x);
    else
        kern_dequantize_row(e->type, (const uint8_t *)e->data + (size_t)a->tokens[t] * e->row_bytes, x, e->cols);
    if (a->scale != 1.0f)
        for (int64_t i = 0; i < e->cols; i++) x[i] *= a->scale;
}
static void cpu_embed(struct backend *b, const struct weight *e, const int32_t *tokens, int n, float scale, float *x) {
    struct embed_arg a = {e, cpu_weights_rows16(&cpu(b)->weights, e), tokens, scale, x};
    for_each_token(cpu(b), n, e->cols, embed_token, &a);
}

struct norm_arg {
    const float *x;
    float *add, *out;
    const int32_t *rows;
    const float *post, *w;
    int dim;
    float eps;
};
static void norm_token(const void *p, int t) {
    const struct norm_arg *a = p;
    int r = a->rows ? a->rows[t] : t;
    rmsnorm(a->out + (size_t)t * a->dim, a->x + (size_t)r * a->dim, a->w, a->dim, a->eps);
}
static void cpu_rmsnorm(struct backend *b, const float *x, const int32_t *rows, const float *w, int n, int dim,
                        float eps, float *out) {
    struct norm_arg a = {.x = x, .rows = rows, .w = w, .dim = dim, .eps = eps, .out = out};
    for_each_token(cpu(b), n, dim, norm_token, &a);
}

static void add_norm_token(const void *p, int t) {
    const struct norm_arg *a = p;
    float *x = (float *)a->x + (size_t)t * a->dim, *add = a->add + (size_t)t * a->dim;
    if (a->post) rmsnorm(add, add, a->post, a->dim, a->eps);
    for (int i = 0; i < a->dim; i++) x[i] += add[i];
    if (a->w) rmsnorm(a->out + (size_t)t * a->dim, x, a->w, a->dim, a->eps);
}
static void cpu_add_norm(struct backend *b, float *x, float *add, const float *post, const float *w, int n, int dim,
                         float eps, float *out) {
    struct norm_arg a = {.x = x, .add = add, .post = post, .w = w, .dim = dim, .eps = eps, .out = out};
    for_each_token(cpu(b), n, (int64_t)dim * ((post != NULL) + (w != NULL) + 1), add_norm_token, &a);
}

struct rope_table_arg {
    const int32_t *pos;
    const float *inv_freq;
    float linear;
    int half;
    float *cos, *sin;
};
static void rope_table_token(const void *p, int t) {
    const struct rope_table_arg *a = p;
    float pos = (float)a->pos[t] / a->linear;
    for (int i = 0; i < a->half; i++) {
        float theta = pos * a->inv_freq[i];
        a->cos[(size_t)t * a->half + i] = cosf(theta);
        a->sin[(size_t)t * a->half + i] = sinf(theta);
    }
}
static void cpu_rope_table(struct backend *b, const int32_t *pos, int n, const float *inv_freq, float linear,
                           int half, float *cos, float *sin) {
    struct rope_table_arg a = {pos, inv_freq, linear, half, cos, sin};
    for_each_token(cpu(b), n, (int64_t)half * 16, rope_table_token, &a); /* cosf + sinf */
}

static void rope_apply(float *vec, const float *cs, const float *sn, int half, enum rope_pairing pairing) {
    if (pairing == ROPE_ADJACENT) {
        for (int i = 0; i < half; i++) {
            float a = vec[2 * i], b = vec[2 * i + 1];
            vec[2 * i] = a * cs[i] - b * sn[i];
            vec[2 * i + 1] = a * sn[i] + b * cs[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float a = vec[i], b = vec[i + half];
            vec[i] = a * cs[i] - b * sn[i];
            vec[i + half] = a * sn[i] + b * cs[i];
        }
    }
}

static void qk_rope_token(const void *p, int t) {
    const struct be_rope *r = p;
    const int D = r->head_dim;
    float *q = r->q + (size_t)t * r->n_head * D, *k = r->k + (size_t)t * r->n_kv * D;
    const float *cs = r->cos + (size_t)t * r->half, *sn = r->sin + (size_t)t * r->half;
    for (int h = 0; h < r->n_head; h++) {
        if (r->q_norm) rmsnorm(q + h * D, q + h * D, r->q_norm, D, r->eps);
        rope_apply(q + h * D, cs, sn, r->half, (enum rope_pairing)r->pairing);
    }
    for (int h = 0; h < r->n_kv; h++) {
        if (r->k_norm) rmsnorm(k + h * D, k + h * D, r->k_norm, D, r->eps);
        rope_apply(k + h * D, cs, sn, r->half, (enum rope_pairing)r->pairing);
    }
}

struct glu_arg {
    enum be_glu act;
    const float *gate, *up;
    int n_ff;
    float *out;
};
static void glu_token(const void *p, int t) {
    const struct glu_arg *a = p;
    const int n = a->n_ff;
    const float *g = a->gate + (size_t)t * n, *u = a->up + (size_t)t * n;
    float *out = a->out + (size_t)t * n;
    if (a->act == BE_GLU_SILU) kern_silu_mul(g, u, out, n);
    else kern_gelu_mul(g, u, out, n);
}
static void cpu_glu(struct backend *b, enum be_glu act, const float *gate, const float *up, int n, int n_ff,
                    float *out) {
    struct glu_arg a = {act, gate, up, n_ff, out};
    for_each_token(cpu(b), n, (int64_t)n_ff * 8, glu_token, &a); /* expf or tanhf */
}

/* ---- KV cache and attention ---------------------------------------------- */

/* A part of one token's rows being encoded (kv_cache_encode_rows) into the append staging. */
struct append_row {
    const struct kv_cache *c;
    const float *k, *v;
    uint8_t *kr, *vr, *wk, *wv;
    int part, parts;
};
/* Part t of a cache's offsets re-encoding (kv_cache_append_end); the parts write
 * disjoint rows, so each is a task of its own. */
static void offsets_part_token(const void *c, int t) { kv_cache_offsets_part((struct kv_cache *)c, t); }

static void append_row_token(const void *p, int t) {
    const struct append_row *r = (const struct append_row *)p + t;
    kv_cache_encode_rows(r->c, r->k, r->v, r->kr, r->vr, r->wk, r->wv, r->part, r->parts);
}

/* Whether a cache's rows cost enough to encode (normal-float rows try many scales a
 * row: microseconds, against a tenth of one for uniform groups) that even one token's
 * are worth the pool's threads: on the calling thread alone, the others wait. */
static bool encode_costly(const struct kv_cache *c) {
    struct kv_view vw;
    kv_cache_view(c, &vw);
    return vw.k_group == KERN_KVQ_NF || vw.v_group == KERN_KVQ_NF;
}

static int ensure_append(struct cpu_backend *cb, int n) {
    if (n <= cb->append_rows_cap) return 0;
    free(cb->append_rows);
    cb->append_rows = malloc(sizeof *cb->append_rows * (size_t)n);
    cb->append_rows_cap = cb->append_rows ? n : 0;
    return cb->append_rows ? 0 : kvq_error_code(KVQ_ERR_OOM, "out of memory");
}

/* Bytes of staging for a sequence's n rows of each side and window (kv_cache_append_rows's layout). */
static size_t append_staging(const struct kv_view *vw, int n_kv, int n) {
    return (size_t)n * n_kv * (vw->k_row + vw->v_row + 2 * vw->win_row);
}

/* Appends of several tokens encode their rows on the pool's threads (the rotation
 * and packing of each row are most of an append): every cache makes its changes
 * first (kv_cache_append_begin), the threads encode each token's rows into staging,
 * and kv_cache_append_rows copies them in: the device-append split of kv_cache.h, the
 * same bytes as kv_cache_append for appends kv_cache_append_exact_part takes whole.
 * first: the batch's first position for a second part (kv_cache_append_begin), or -1;
 * costly: the caches' rows are encode_costly, so even one token's go to every thread. */
static int append_encoded(struct cpu_backend *cb, const struct be_kv_append *seqs, int n_seqs, const float *k,
                          const float *v, int32_t first, bool costly) {
    const struct kv_shape *sh = kv_cache_get_shape(seqs[0].cache);
    const int H = sh->n_kv_heads, threads = kvq_threads_size(cb->pool);
    const size_t tok = (size_t)H * sh->head_dim;
    int m = 0;
    for (int s = 0; s < n_seqs; s++) m += seqs[s].n;
    /* costly rows of tokens fewer than threads: each token's (head, side) rows in parts */
    int parts = costly ? (threads + m - 1) / m : 1;
    if (parts > 2 * H) parts = 2 * H;
    if (ensure_append(cb, m * parts) != 0) return -1;
    size_t need = 0;
    for (int s = 0; s < n_seqs; s++) {
        if (kv_cache_append_begin(seqs[s].cache, seqs[s].n, first >= 0 ? first : kv_cache_n_past(seqs[s].cache), false) != 0)
            return -1;
        struct kv_view vw;
        kv_cache_view(seqs[s].cache, &vw);
        need += append_staging(&vw, H, seqs[s].n);
    }
    if (need > cb->staging_cap) {
        free(cb->staging);
        cb->staging = malloc(need);
        cb->staging_cap = cb->staging ? need : 0;
        if (!cb->staging) return kvq_error_code(KVQ_ERR_OOM, "out of memory encoding KV rows");
    }
    uint8_t *at = cb->staging;
    for (int s = 0, j = 0; s < n_seqs; j += seqs[s++].n) {
        struct kv_view vw;
        kv_cache_view(seqs[s].cache, &vw);
        const int n = seqs[s].n;
        uint8_t *kr = at, *vr = kr + (size_t)n * H * vw.k_row, *wk = vr + (size_t)n * H * vw.v_row,
                *wv = wk + (size_t)n * H * vw.win_row;
        for (int i = 0; i < n; i++) {
            const size_t off = (size_t)(seqs[s].first + i) * tok, r = (size_t)i * H;
            for (int p = 0; p < parts; p++)
                cb->append_rows[(j + i) * parts + p] =
                    (struct append_row){seqs[s].cache,      k + off, v + off, kr + r * vw.k_row, vr + r * vw.v_row,
                                        wk + r * vw.win_row, wv + r * vw.win_row, p, parts};
        }
        at += append_staging(&vw, H, n);
    }
    if (costly) { /* on every thread, however few the tasks */
        struct token_task tt = {cb->append_rows, append_row_token, m * parts};
        kvq_threads_run(cb->pool, token_task_run, &tt);
    } else {
        for_each_token(cb, m, (int64_t)tok * 16, append_row_token, cb->append_rows); /* rotation + packing */
    }
    for (int s = 0, j = 0; s < n_seqs; j += seqs[s++].n) {
        const struct append_row *r = &cb->append_rows[j * parts];
        const int32_t p0 = kv_cache_n_past(seqs[s].cache) - seqs[s].n;
        kv_cache_append_rows(seqs[s].cache, p0, seqs[s].n, r->kr, r->vr, r->wk, r->wv, p0);
        const int offs_parts = kv_cache_append_end(seqs[s].cache, p0, seqs[s].n);
        if (offs_parts < 0) return -1;
        /* a batch ending at the offsets' point: 2 H parts of T rows each */
        for_each_token(cb, offs_parts, (int64_t)tok * 64, offsets_part_token, seqs[s].cache);
    }
    return 0;
}

/* kv_cache_append of one sequence's rows, on the calling thread. */
static int append_here(const struct be_kv_append *sq, const float *k, const float *v) {
    const struct kv_shape *sh = kv_cache_get_shape(sq->cache);
    const size_t off = (size_t)sq->first * sh->n_kv_heads * sh->head_dim;
    return kv_cache_append(sq->cache, sq->n, k + off, v + off);
}

static int cpu_kv_append(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k,
                         const float *v, const struct be_rope *r) {
    struct cpu_backend *cb = cpu(b);
    if (n_seqs <= 0) return 0;
    const int n_tok = seqs[n_seqs - 1].first + seqs[n_seqs - 1].n;
    if (r) {
        const int64_t cost = (int64_t)(r->n_head + r->n_kv) * r->head_dim * (1 + (r->q_norm != NULL));
        for_each_token(cb, n_tok, cost, qk_rope_token, r);
    }
    const bool costly = encode_costly(seqs[0].cache);
    if ((n_tok < 4 && !costly) || kvq_threads_size(cb->pool) == 1) {
        for (int s = 0; s < n_seqs; s++)
            if (append_here(&seqs[s], k, v) != 0) return -1;
        return 0;
    }
    bool whole = true;
    for (int s = 0; s < n_seqs && whole; s++) whole = kv_cache_append_exact_part(seqs[s].cache, seqs[s].n) == seqs[s].n;
    if (whole) return append_encoded(cb, seqs, n_seqs, k, v, -1, costly);
    /* an append crossing the offsets' point (a prompt's): a sequence at a time, its rows
     * up to the point, then the rest with the offsets chosen there */
    for (int s = 0; s < n_seqs; s++) {
        struct be_kv_append part = seqs[s];
        const int32_t first = kv_cache_n_past(part.cache);
        part.n = kv_cache_append_exact_part(part.cache, part.n);
        if (part.n == 0) { /* no exact part */
            if (append_here(&seqs[s], k, v) != 0) return -1;
            continue;
        }
        if (append_encoded(cb, &part, 1, k, v, first, costly) != 0) return -1;
        if (part.n == seqs[s].n) continue;
        part.first += part.n;
        part.n = seqs[s].n - part.n;
        if (append_encoded(cb, &part, 1, k, v, first, costly) != 0) return -1;
    }
    return 0;
}

struct attn_tok {
    uintptr_t cache;
    int32_t pos, t;
};
struct attn_group {
    int32_t last, first, n; /* the last position; tokens attn_toks[first .. first + n) */
    int32_t np;             /* its parts (kv_cache_attend_parts), where attended in parts */
};

struct attn_part {
    int32_t g, h, i; /* group, KV head, part */
};

struct attn_task {
    struct cpu_backend *cb;
    const struct be_attention *a;
    int phase; /* 0: whole items; 1: parts; 2: parts merged */
    size_t pf; /* floats of a part's state */
};

/* Group gi's query and output heads of KV head h. */
static const struct attn_tok *group_heads(const struct cpu_backend *cb, const struct be_attention *a, int gi, int h,
                                          const float **q, float **out) {
    const int D = a->head_dim, group = a->n_head / a->n_kv, q_dim = a->n_head * D;
    const struct attn_group *g = &cb->attn_groups[gi];
    const struct attn_tok *tk = &cb->attn_toks[g->first];
    for (int i = 0; i < g->n; i++) {
        const size_t off = (size_t)tk[i].t * q_dim + (size_t)h * group * D;
        q[i] = a->q + off;
        out[i] = a->out + off;
    }
    return tk;
}

/* Items are (group, KV head) pairs, the groups dealt round-robin to the threads'
 * parts: each part starts with long items and ends with short ones; or the parts of
 * few long ones, then their merges. */
static void attn_task_run(void *p, int ith, int nth) {
    const struct attn_task *at = p;
    const struct cpu_backend *cb = at->cb;
    const struct be_attention *a = at->a;
    float *scratch = cb->attn_scratch + (size_t)ith * cb->attn_scratch_floats;
    const size_t pf = at->pf;
    int part, s;
    while ((s = kvq_work_next(cb->work, ith, &part)) >= 0) {
        const int item = s * nth + part;
        const float *q[KERN_KVQ_ATTN_HEADS];
        float *out[KERN_KVQ_ATTN_HEADS];
        if (at->phase == 1) {
            const struct attn_part *pi = &cb->attn_parts[item];
            const struct attn_tok *tk = group_heads(cb, a, pi->g, pi->h, q, out);
            float *mem = cb->attn_part_mem + (cb->attn_part0[pi->g * a->n_kv + pi->h] + (size_t)pi->i) * pf;
            kv_cache_attend_part(a->caches[tk[0].t], pi->h, q, tk[0].pos, cb->attn_groups[pi->g].n, a->scale, pi->i,
                                 mem, scratch);
            continue;
        }
        const int gi = item / a->n_kv, h = item % a->n_kv, n = cb->attn_groups[gi].n;
        const struct attn_tok *tk = group_heads(cb, a, gi, h, q, out);
        if (at->phase == 2)
            kv_cache_attend_merge(a->caches[tk[0].t], h, q, out, tk[0].pos, n, a->scale,
                                  cb->attn_part_mem + cb->attn_part0[item] * pf, scratch);
        else kv_cache_attend_tokens(a->caches[tk[0].t], h, q, out, tk[0].pos, n, a->scale, scratch);
    }
}

static void attn_phase(struct cpu_backend *cb, struct attn_task *at, int phase, int items) {
    const int nth = kvq_threads_size(cb->pool);
    int *counts = kvq_work_counts(cb->work);
    for (int i = 0; i < nth; i++) counts[i] = (items - i + nth - 1) / nth;
    at->phase = phase;
    kvq_work_start(cb->work);
    kvq_threads_run(cb->pool, attn_task_run, at);
}

/* Fewer items than threads to keep busy: each (group, KV head) in parts of its
 * positions where it has several, the parts on all threads, then the merges (the
 * same bits as whole items). False where that does not apply or finds no memory. */
static bool attn_in_parts(struct cpu_backend *cb, struct attn_task *at, int ng) {
    const struct be_attention *a = at->a;
    const int items = ng * a->n_kv;
    size_t total = 0;
    for (int gi = 0; gi < ng; gi++) {
        struct attn_group *g = &cb->attn_groups[gi];
        g->np = kv_cache_attend_parts(a->caches[cb->attn_toks[g->first].t], g->last - g->n + 1, g->n);
        total += (size_t)g->np * (size_t)a->n_kv;
    }
    if (total <= (size_t)items || total > INT32_MAX / 2) return false;
    const size_t pf = at->pf = kv_cache_attend_part_floats(&(struct kv_shape){a->n_head, a->n_kv, a->head_dim, 0});
    const size_t b0 = sizeof(size_t) * (size_t)items, b1 = sizeof(struct attn_part) * total;
    const size_t need = b0 + b1 + sizeof(float) * pf * total + 64;
    if (need > cb->attn_split_bytes) {
        if (cb->attn_split) munmap(cb->attn_split, cb->attn_split_bytes);
        const size_t bytes = 2 * need;
        void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        cb->attn_split = m == MAP_FAILED ? NULL : m;
        cb->attn_split_bytes = cb->attn_split ? bytes : 0;
        if (!cb->attn_split) return false;
    }
    cb->attn_part0 = cb->attn_split;
    cb->attn_parts = (struct attn_part *)((uint8_t *)cb->attn_split + b0);
    cb->attn_part_mem = (float *)((uintptr_t)((uint8_t *)cb->attn_split + b0 + b1 + 63) & ~(uintptr_t)63);
    size_t k = 0;
    for (int gi = 0; gi < ng; gi++)
        for (int h = 0; h < a->n_kv; h++) {
            cb->attn_part0[gi * a->n_kv + h] = k;
            for (int i = 0; i < cb->attn_groups[gi].np; i++) cb->attn_parts[k++] = (struct attn_part){gi, h, i};
        }
    attn_phase(cb, at, 1, (int)total);
    attn_phase(cb, at, 2, items);
    return true;
}

static int ensure_attn(struct cpu_backend *cb, int n) {
    if (n <= cb->attn_cap) return 0;
    free(cb->attn_toks);
    free(cb->attn_groups);
    cb->attn_toks = malloc(sizeof *cb->attn_toks * (size_t)n);
    cb->attn_groups = malloc(sizeof *cb->attn_groups * (size_t)n);
    cb->attn_cap = cb->attn_toks && cb->attn_groups ? n : 0;
    return cb->attn_cap ? 0 : -1;
}

static int cmp_tok(const void *x, const void *y) {
    const struct attn_tok *a = x, *b = y;
    if (a->cache != b->cache) return a->cache < b->cache ? -1 : 1;
    return a->pos < b->pos ? -1 : a->pos > b->pos;
}

/* The longest attention first; equal ones in token order. */
static int cmp_group(const void *x, const void *y) {
    const struct attn_group *a = x, *b = y;
    if (a->last != b->last) return a->last > b->last ? -1 : 1;
    return a->first < b->first ? -1 : a->first > b->first;
}

static void cpu_attention(struct backend *b, const struct be_attention *a, int n) {
    struct cpu_backend *cb = cpu(b);
    struct kv_shape shape = {a->n_head, a->n_kv, a->head_dim, 0};
    size_t floats = kv_cache_scratch_floats(&shape);
    int nth = kvq_threads_size(cb->pool);
    if (floats > cb->attn_scratch_floats || nth > cb->attn_scratch_threads) { /* once, at the first batch */
        free(cb->attn_scratch);
        cb->attn_scratch = malloc(sizeof(float) * floats * (size_t)nth);
        cb->attn_scratch_floats = cb->attn_scratch ? floats : 0;
        cb->attn_scratch_threads = cb->attn_scratch ? nth : 0;
        if (!cb->attn_scratch) return;
    }
    if (ensure_attn(cb, n) != 0) return; /* reserve sized it for max_tokens */
    struct attn_tok *tk = cb->attn_toks;
    for (int t = 0; t < n; t++) tk[t] = (struct attn_tok){(uintptr_t)a->caches[t], a->pos[t], t};
    qsort(tk, (size_t)n, sizeof *tk, cmp_tok);
    /* runs of consecutive positions of one cache (a prompt chunk), as many tokens a
     * group as attend together */
    const int per = kv_cache_attend_tokens_max(&shape);
    int ng = 0;
    for (int t = 0; t < n; t++) {
        struct attn_group *g = ng ? &cb->attn_groups[ng - 1] : NULL;
        if (g && g->n < per && tk[t].cache == tk[t - 1].cache && tk[t].pos == tk[t - 1].pos + 1) {
            g->n++;
            g->last = tk[t].pos;
        } else {
            cb->attn_groups[ng++] = (struct attn_group){tk[t].pos, t, 1, 0};
        }
    }
    qsort(cb->attn_groups, (size_t)ng, sizeof *cb->attn_groups, cmp_group);
    struct attn_task at = {cb, a, 0, 0};
    if (nth > 1 && ng * a->n_kv < 2 * nth && attn_in_parts(cb, &at, ng)) return;
    attn_phase(cb, &at, 0, ng * a->n_kv);
}

/* ---- memory --------------------------------------------------------------- */

static int cpu_reserve(struct backend *b, int max_tokens, int64_t widest) {
    struct cpu_backend *cb = cpu(b);
    if (ensure_attn(cb, max_tokens) != 0 || ensure_append(cb, max_tokens) != 0)
        return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    return ensure_act(cb, max_act_row_bytes(widest) * (size_t)max_tokens);
}

static void *cpu_alloc(struct backend *b, size_t bytes) {
    (void)b;
    void *p = malloc(bytes ? bytes : 1);
    if (!p) kvq_error_code(KVQ_ERR_OOM, "out of memory (%zu bytes)", bytes);
    return p;
}
static void cpu_release(struct backend *b, void *p) {
    (void)b;
    free(p);
}
static int cpu_upload_weight(struct backend *b, const struct weight *w) {
    struct cpu_backend *cb = cpu(b);
    return cpu_weights_add(&cb->weights, cb->pool, w);
}
static int cpu_upload_vector(struct backend *b, const float *v, int64_t n) {
    (void)b;
    (void)v;
    (void)n;
    return 0;
}
static struct kv_pool *cpu_kv_pool_new(struct backend *b, size_t budget) {
    (void)b;
    return kv_pool_new(budget);
}
static int cpu_sync(struct backend *b) {
    (void)b;
    return 0;
}

static void cpu_free(struct backend *b) {
    struct cpu_backend *cb = cpu(b);
    if (!cb) return;
    if (cb->pool) kvq_threads_free(cb->pool);
    cpu_weights_free(&cb->weights);
    for (int i = 0; i < MAX_ACT_TYPES; i++) free(cb->act_mem[i]);
    free(cb->attn_scratch);
    free(cb->attn_toks);
    free(cb->attn_groups);
    if (cb->attn_split) munmap(cb->attn_split, cb->attn_split_bytes);
    free(cb->append_rows);
    free(cb->staging);
    kvq_work_free(cb->work);
    free(cb);
}

static void cpu_run_on_host_threads(struct backend *b, kvq_task_fn fn, void *arg) {
    kvq_threads_run(cpu(b)->pool, fn, arg);
}

static const struct backend_ops cpu_ops = {
    .name = "cpu",
    .host_memory = true,
    .attends_nf = true,
    .free = cpu_free,
    .reserve = cpu_reserve,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .upload_weight = cpu_upload_weight,
    .upload_vector = cpu_upload_vector,
    .host_alloc = cpu_alloc, /* activations are host memory already */
    .host_free = cpu_release,
    .kv_pool_new = cpu_kv_pool_new,
    .matmul = cpu_matmul,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add_norm = cpu_add_norm,
    .rope_table = cpu_rope_table,
    .glu = cpu_glu,
    .kv_append = cpu_kv_append,
    .attention = cpu_attention,
    .sync = cpu_sync,
    .run_on_host_threads = cpu_run_on_host_threads,
};

struct backend *backend_cpu_new(int n_threads) {
    struct cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    cb->base.ops = &cpu_ops;
    cb->pool = kvq_threads_new(n_threads);
    if (cb->pool) cb->work = kvq_work_new(kvq_threads_size(cb->pool));
    if (!cb->pool || !cb->work) {
        if (cb->pool) kvq_threads_free(cb->pool);
        free(cb);
        kvq_error("cannot start %d threads", n_threads);
        return NULL;
    }
    return &cb->base;
}
