/* The forward pass of a Llama-family model over a batch of tokens.
 *
 * Each step is a task on the thread pool: matrix products split their output rows
 * among threads, per-token work (norms, RoPE, activation quantization) splits the
 * tokens, attention splits (token, KV head) pairs. A decode step of one token does
 * the tiny per-token work on the calling thread to avoid waking the pool for it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/threadpool.h"
#include "kernels/matmul.h"
#include "kvcache/kv_cache.h"
#include "model/model.h"

/* Activation buffers for up to this many distinct weight types per input. */
#define MAX_ACT_TYPES 3

struct act_set {
    int n;
    uint32_t types[MAX_ACT_TYPES];
    uint8_t *bufs[MAX_ACT_TYPES];
    size_t row_bytes[MAX_ACT_TYPES];
};

struct forward {
    const struct model *m;
    int max_tokens;
    int q_dim, kv_dim, half_rope;
    float *x, *xn, *q, *k, *v, *attn, *tmp, *gate, *up;
    float *rope_cos, *rope_sin; /* [n_rope_sets][T][rope_dim/2] */
    int32_t *pos;               /* [T] */
    struct kv_cache **tok_cache; /* [T]: this layer's cache of the token's sequence */
    uint8_t *act_mem[MAX_ACT_TYPES];
    size_t act_cap; /* bytes per act buffer */
    float *attn_scratch;
    int attn_scratch_threads;
    size_t attn_scratch_floats;
};

static size_t max_act_row_bytes(int64_t k) {
    static const uint32_t types[] = {0, 1, 2, 8, 12, 14, 30};
    size_t best = 0;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        size_t b = kern_act_row_bytes(types[i], k);
        if (b > best) best = b;
    }
    return best;
}

struct forward *forward_new(const struct model *m, int max_tokens) {
    const struct model_hparams *hp = &m->hp;
    struct forward *f = calloc(1, sizeof *f);
    if (!f) goto oom;
    f->m = m;
    f->max_tokens = max_tokens;
    f->q_dim = hp->n_head * hp->head_dim;
    f->kv_dim = hp->n_head_kv * hp->head_dim;
    f->half_rope = hp->rope_dim / 2;
    size_t T = (size_t)max_tokens;
    int64_t widest = hp->n_embd;
    if (hp->n_ff > widest) widest = hp->n_ff;
    if (f->q_dim > widest) widest = f->q_dim;
    f->x = malloc(sizeof(float) * T * hp->n_embd);
    f->xn = malloc(sizeof(float) * T * widest);
    f->q = malloc(sizeof(float) * T * f->q_dim);
    f->k = malloc(sizeof(float) * T * f->kv_dim);
    f->v = malloc(sizeof(float) * T * f->kv_dim);
    f->attn = malloc(sizeof(float) * T * f->q_dim);
    f->tmp = malloc(sizeof(float) * T * hp->n_embd);
    f->gate = malloc(sizeof(float) * T * hp->n_ff);
    f->up = malloc(sizeof(float) * T * hp->n_ff);
    f->rope_cos = malloc(sizeof(float) * T * f->half_rope * (size_t)m->n_rope_sets);
    f->rope_sin = malloc(sizeof(float) * T * f->half_rope * (size_t)m->n_rope_sets);
    f->pos = malloc(sizeof(int32_t) * T);
    f->tok_cache = malloc(sizeof(struct kv_cache *) * T);
    f->act_cap = max_act_row_bytes(widest) * T;
    for (int i = 0; i < MAX_ACT_TYPES; i++) {
        f->act_mem[i] = malloc(f->act_cap);
        if (!f->act_mem[i]) goto oom;
    }
    if (!f->x || !f->xn || !f->q || !f->k || !f->v || !f->attn || !f->tmp || !f->gate || !f->up || !f->rope_cos ||
        !f->rope_sin || !f->pos || !f->tok_cache)
        goto oom;
    struct kv_shape shape = {hp->n_head, hp->n_head_kv, hp->head_dim, hp->sliding_window};
    f->attn_scratch_floats = kv_cache_scratch_floats(&shape);
    return f;
oom:
    forward_free(f);
    kvq_error("out of memory allocating buffers for %d tokens", max_tokens);
    return NULL;
}

void forward_free(struct forward *f) {
    if (!f) return;
    float *bufs[] = {f->x, f->xn, f->q, f->k, f->v, f->attn, f->tmp, f->gate, f->up, f->rope_cos, f->rope_sin,
                     f->attn_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    for (int i = 0; i < MAX_ACT_TYPES; i++) free(f->act_mem[i]);
    free(f->pos);
    free(f->tok_cache);
    free(f);
}

/* ---- per-token operations ------------------------------------------------ */

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float s = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * s * w[i];
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

/* Runs fn over tokens [0, n) on the pool, or inline when there are too few
 * tokens for waking the pool to pay off. */
typedef void (*token_fn)(struct forward *f, const void *arg, int t);
struct token_task {
    struct forward *f;
    const void *arg;
    token_fn fn;
    int n;
};
static void token_task_run(void *p, int ith, int nth) {
    struct token_task *tt = p;
    long b, e;
    kvq_split(tt->n, ith, nth, &b, &e);
    for (long t = b; t < e; t++) tt->fn(tt->f, tt->arg, (int)t);
}
static void for_each_token(struct forward *f, struct kvq_pool *pool, int n, token_fn fn, const void *arg) {
    struct token_task tt = {f, arg, fn, n};
    if (n < 4) token_task_run(&tt, 0, 1);
    else kvq_pool_run(pool, token_task_run, &tt);
}

/* ---- activation preparation ---------------------------------------------- */

/* Decides which prepared forms of an input [n][k] the given weights need. */
static void act_plan(struct forward *f, struct act_set *as, const struct weight *const *ws, int n_w, int64_t k) {
    as->n = 0;
    for (int i = 0; i < n_w; i++) {
        int j = 0;
        while (j < as->n && as->types[j] != ws[i]->type) j++;
        if (j == as->n) {
            as->types[j] = ws[i]->type;
            as->bufs[j] = f->act_mem[j];
            as->row_bytes[j] = kern_act_row_bytes(ws[i]->type, k);
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
static void act_prepare_token(struct forward *f, const void *p, int t) {
    (void)f;
    const struct act_arg *a = p;
    for (int j = 0; j < a->as->n; j++)
        kern_act_prepare(a->as->types[j], a->x + (size_t)t * a->x_stride, a->as->bufs[j] + (size_t)t * a->as->row_bytes[j],
                         a->k);
}

/* ---- matrix products ----------------------------------------------------- */

struct mm_job {
    const struct weight *w;
    float *y; /* [n_tok][w->rows] */
    const float *bias;
};

struct mm_task {
    const struct act_set *as;
    int n_tok;
    int n_jobs;
    struct mm_job jobs[3];
};

/* Rows per thread are rounded to a multiple of this, so kernels see whole tiles. */
#define MM_ROW_ALIGN 16

static void mm_task_run(void *p, int ith, int nth) {
    const struct mm_task *mt = p;
    for (int j = 0; j < mt->n_jobs; j++) {
        const struct mm_job *job = &mt->jobs[j];
        const struct weight *w = job->w;
        int ai = act_index(mt->as, w->type);
        long chunks = (long)((w->rows + MM_ROW_ALIGN - 1) / MM_ROW_ALIGN), b, e;
        kvq_split(chunks, ith, nth, &b, &e);
        int64_t r0 = b * MM_ROW_ALIGN, r1 = e * MM_ROW_ALIGN;
        if (r1 > w->rows) r1 = w->rows;
        if (r0 >= r1) continue;
        struct kern_matmul_args a = {
            .wtype = w->type, .w = w->data, .w_row_bytes = w->row_bytes, .k = w->cols,
            .xa = mt->as->bufs[ai], .xa_row_bytes = mt->as->row_bytes[ai], .n_tok = mt->n_tok,
            .y = job->y, .y_stride = w->rows,
        };
        kern_matmul(&a, r0, r1);
        if (job->bias)
            for (int t = 0; t < mt->n_tok; t++)
                for (int64_t r = r0; r < r1; r++) job->y[(size_t)t * w->rows + r] += job->bias[r];
    }
}

/* y_j = x W_j^T (+ b_j) for up to three weights sharing the input x [n][k]. */
static void matmul_multi(struct forward *f, struct kvq_pool *pool, const float *x, int64_t x_stride, int n,
                         int n_jobs, const struct mm_job *jobs) {
    const struct weight *ws[3];
    for (int j = 0; j < n_jobs; j++) ws[j] = jobs[j].w;
    struct act_set as;
    act_plan(f, &as, ws, n_jobs, jobs[0].w->cols);
    struct act_arg aa = {&as, x, jobs[0].w->cols, x_stride};
    for_each_token(f, pool, n, act_prepare_token, &aa);
    struct mm_task mt = {&as, n, n_jobs, {{0}}};
    memcpy(mt.jobs, jobs, sizeof(struct mm_job) * (size_t)n_jobs);
    kvq_pool_run(pool, mm_task_run, &mt);
}

/* ---- the layer steps ------------------------------------------------------ */

struct norm_arg {
    const float *w;
    const float *src; /* NULL: normalize f->x */
};
static void attn_norm_token(struct forward *f, const void *p, int t) {
    const struct norm_arg *a = p;
    int d = f->m->hp.n_embd;
    rmsnorm(f->xn + (size_t)t * d, f->x + (size_t)t * d, a->w, d, f->m->hp.rms_eps);
}

/* Adds the block output (f->tmp, normalized first by `post` when the model has
 * post-norms: Gemma) to the residual; then, with `w`, normalizes for the FFN. */
struct residual_arg {
    const float *post, *w;
};
static void residual_token(struct forward *f, const void *p, int t) {
    const struct residual_arg *a = p;
    int d = f->m->hp.n_embd;
    float *x = f->x + (size_t)t * d, *add = f->tmp + (size_t)t * d;
    if (a->post) rmsnorm(add, add, a->post, d, f->m->hp.rms_eps);
    for (int i = 0; i < d; i++) x[i] += add[i];
    if (a->w) rmsnorm(f->xn + (size_t)t * d, x, a->w, d, f->m->hp.rms_eps);
}

/* Per-head q/k norms (qwen3) and RoPE for one token's queries and keys. */
static void qk_rope_token(struct forward *f, const void *p, int t) {
    const int *il = p;
    const struct layer_weights *L = &f->m->layers[*il];
    const struct model_hparams *hp = &f->m->hp;
    int D = hp->head_dim;
    float *q = f->q + (size_t)t * f->q_dim, *k = f->k + (size_t)t * f->kv_dim;
    size_t row = ((size_t)f->m->layer_attn[*il].rope_set * f->max_tokens + (size_t)t) * f->half_rope;
    const float *cs = f->rope_cos + row, *sn = f->rope_sin + row;
    for (int h = 0; h < hp->n_head; h++) {
        if (L->q_norm) rmsnorm(q + h * D, q + h * D, L->q_norm, D, hp->rms_eps);
        rope_apply(q + h * D, cs, sn, f->half_rope, hp->rope_pairing);
    }
    for (int h = 0; h < hp->n_head_kv; h++) {
        if (L->k_norm) rmsnorm(k + h * D, k + h * D, L->k_norm, D, hp->rms_eps);
        rope_apply(k + h * D, cs, sn, f->half_rope, hp->rope_pairing);
    }
}

static void swiglu_token(struct forward *f, const void *p, int t) {
    (void)p;
    int n = f->m->hp.n_ff;
    const float *g = f->gate + (size_t)t * n, *u = f->up + (size_t)t * n;
    float *out = f->xn + (size_t)t * n;
    for (int i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Gemma's FFN: GELU (tanh approximation) of the gate times up. */
static void geglu_token(struct forward *f, const void *p, int t) {
    (void)p;
    int n = f->m->hp.n_ff;
    const float *g = f->gate + (size_t)t * n, *u = f->up + (size_t)t * n;
    float *out = f->xn + (size_t)t * n;
    const float c = 0.7978845608f; /* sqrt(2/pi) */
    for (int i = 0; i < n; i++) out[i] = 0.5f * g[i] * (1.0f + tanhf(c * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
}

struct attn_task {
    struct forward *f;
    int n_tok;
};
static void attn_task_run(void *p, int ith, int nth) {
    const struct attn_task *at = p;
    struct forward *f = at->f;
    const struct model_hparams *hp = &f->m->hp;
    int D = hp->head_dim, group = hp->n_head / hp->n_head_kv;
    float scale = hp->attn_scale;
    float *scratch = f->attn_scratch + (size_t)ith * f->attn_scratch_floats;
    long b, e;
    kvq_split((long)at->n_tok * hp->n_head_kv, ith, nth, &b, &e);
    for (long item = b; item < e; item++) {
        int t = (int)(item / hp->n_head_kv), h = (int)(item % hp->n_head_kv);
        size_t off = (size_t)t * f->q_dim + (size_t)h * group * D;
        kv_cache_attend(f->tok_cache[t], h, f->q + off, f->pos[t], scale, f->attn + off, scratch);
    }
}

static int ensure_attn_scratch(struct forward *f, int n_threads) {
    if (f->attn_scratch_threads >= n_threads) return 0;
    free(f->attn_scratch);
    f->attn_scratch = malloc(sizeof(float) * f->attn_scratch_floats * (size_t)n_threads);
    if (!f->attn_scratch) {
        f->attn_scratch_threads = 0;
        return kvq_error("out of memory");
    }
    f->attn_scratch_threads = n_threads;
    return 0;
}

static int run_layer(struct forward *f, struct kvq_pool *pool, const struct fwd_batch *b, int il) {
    const struct model_hparams *hp = &f->m->hp;
    const struct layer_weights *L = &f->m->layers[il];
    int n = b->n_tokens;

    struct norm_arg na = {L->attn_norm, NULL};
    for_each_token(f, pool, n, attn_norm_token, &na);
    struct mm_job qkv[3] = {{&L->wq, f->q, L->bq}, {&L->wk, f->k, L->bk}, {&L->wv, f->v, L->bv}};
    matmul_multi(f, pool, f->xn, hp->n_embd, n, 3, qkv);
    for_each_token(f, pool, n, qk_rope_token, &il);

    for (int s = 0; s < b->n_seqs; s++) {
        const struct fwd_seq *sq = &b->seqs[s];
        struct kv_cache *c = sq->caches[il];
        if (kv_cache_append(c, sq->n, f->k + (size_t)sq->first * f->kv_dim, f->v + (size_t)sq->first * f->kv_dim) != 0)
            return -1;
        for (int t = sq->first; t < sq->first + sq->n; t++) f->tok_cache[t] = c;
    }
    struct attn_task at = {f, n};
    kvq_pool_run(pool, attn_task_run, &at);

    struct mm_job o = {&L->wo, f->tmp, NULL};
    matmul_multi(f, pool, f->attn, f->q_dim, n, 1, &o);
    struct residual_arg ra = {L->post_attn_norm, L->ffn_norm};
    for_each_token(f, pool, n, residual_token, &ra);
    struct mm_job gu[2] = {{&L->w_gate, f->gate, NULL}, {&L->w_up, f->up, NULL}};
    matmul_multi(f, pool, f->xn, hp->n_embd, n, 2, gu);
    for_each_token(f, pool, n, hp->ffn_act == FFN_GELU_TANH ? geglu_token : swiglu_token, NULL);
    struct mm_job down = {&L->w_down, f->tmp, NULL};
    matmul_multi(f, pool, f->xn, hp->n_ff, n, 1, &down);
    struct residual_arg fa = {L->post_ffn_norm, NULL};
    for_each_token(f, pool, n, residual_token, &fa);
    return 0;
}

static void embed_token(struct forward *f, const void *p, int t) {
    const int32_t *tokens = p;
    const struct weight *e = &f->m->tok_embd;
    float *x = f->x + (size_t)t * f->m->hp.n_embd, s = f->m->hp.embd_scale;
    kern_dequantize_row(e->type, (const uint8_t *)e->data + (size_t)tokens[t] * e->row_bytes, x, e->cols);
    if (s != 1.0f)
        for (int64_t i = 0; i < e->cols; i++) x[i] *= s;
}

static void rope_table_token(struct forward *f, const void *p, int t) {
    (void)p;
    const struct model *m = f->m;
    for (int set = 0; set < m->n_rope_sets; set++) {
        float pos = (float)f->pos[t] / m->rope_linear_factor[set];
        const float *inv = m->rope_inv_freq + (size_t)set * f->half_rope;
        size_t row = ((size_t)set * f->max_tokens + (size_t)t) * f->half_rope;
        for (int i = 0; i < f->half_rope; i++) {
            float theta = pos * inv[i];
            f->rope_cos[row + i] = cosf(theta);
            f->rope_sin[row + i] = sinf(theta);
        }
    }
}

/* Gathers the rows whose logits are wanted and normalizes them into xn. */
static void final_norm_token(struct forward *f, const void *p, int i) {
    const int32_t *rows = p;
    int d = f->m->hp.n_embd;
    rmsnorm(f->xn + (size_t)i * d, f->x + (size_t)rows[i] * d, f->m->output_norm, d, f->m->hp.rms_eps);
}

static int check_batch(const struct forward *f, const struct fwd_batch *b) {
    const struct model_hparams *hp = &f->m->hp;
    if (b->n_tokens <= 0 || b->n_tokens > f->max_tokens)
        return kvq_error("batch of %d tokens (1..%d allowed)", b->n_tokens, f->max_tokens);
    if (b->n_logits < 0 || b->n_logits > b->n_tokens) return kvq_error("invalid number of logit rows");
    for (int t = 0; t < b->n_tokens; t++)
        if (b->tokens[t] < 0 || b->tokens[t] >= hp->n_vocab)
            return kvq_error("token id %d is outside the vocabulary (0..%d)", b->tokens[t], hp->n_vocab - 1);
    int covered = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        if (b->seqs[s].first != covered || b->seqs[s].n <= 0) return kvq_error("batch sequences must tile the batch");
        covered += b->seqs[s].n;
    }
    if (covered != b->n_tokens) return kvq_error("batch sequences must tile the batch");
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens) return kvq_error("invalid logit row");
    return 0;
}

int forward_run(struct forward *f, struct kvq_pool *pool, const struct fwd_batch *b, float *logits) {
    const struct model_hparams *hp = &f->m->hp;
    if (check_batch(f, b) != 0 || ensure_attn_scratch(f, kvq_pool_size(pool)) != 0) return -1;
    int n = b->n_tokens;
    for (int s = 0; s < b->n_seqs; s++) {
        int32_t p0 = kv_cache_n_past(b->seqs[s].caches[0]);
        for (int i = 0; i < b->seqs[s].n; i++) f->pos[b->seqs[s].first + i] = p0 + i;
    }
    for_each_token(f, pool, n, embed_token, b->tokens);
    for_each_token(f, pool, n, rope_table_token, NULL);
    for (int il = 0; il < hp->n_layer; il++) {
        if (run_layer(f, pool, b, il) != 0) {
            /* Keep the sequences consistent: drop what the layers appended so far. */
            for (int s = 0; s < b->n_seqs; s++)
                for (int j = 0; j <= il; j++) {
                    struct kv_cache *c = b->seqs[s].caches[j];
                    kv_cache_trim(c, kv_cache_n_past(c) - f->pos[b->seqs[s].first]);
                }
            return -1;
        }
    }
    if (b->n_logits == 0) return 0;
    for_each_token(f, pool, b->n_logits, final_norm_token, b->logit_rows);
    struct mm_job out = {&f->m->output, logits, NULL};
    matmul_multi(f, pool, f->xn, hp->n_embd, b->n_logits, 1, &out);
    return 0;
}
