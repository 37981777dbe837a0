/* The public API: ties the model, tokenizer, thread pool and KV caches together. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "backend/backend.h"
#include "gguf/gguf.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"
#include "engine/engine_internal.h"
#include "engine/grammar.h"
#include "kvq.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

struct kvq_model {
    struct model *model;
    struct tokenizer *tok;
    pthread_mutex_t grammar_mu;
    struct grammar_vocab *grammar_vocab; /* made on first use */
    uint64_t fingerprint;                /* engine_fingerprint, computed once */
};

struct kvq_context {
    struct kvq_model *m;
    struct kvq_context_params p;
    struct backend *be;       /* where the forward pass runs and the KV blocks live */
    struct forward *fwd;
    struct kv_pool *kv_pool;   /* every KV block of the context's sequences and prefixes */
    struct kv_cache **caches;  /* [n_seq][n_layer] */
    struct kvq_prefix *prefixes; /* held prefixes, to count their windows and free leftovers */
    /* Logits of the last batch: row_of[i] is the row of batch token i, or -1 (rows in
     * the order the passes make them: grouped by sequence, c->order). */
    float *logits;
    size_t logits_cap; /* rows */
    int *row_of;
    int row_of_cap;
    int last_n_tokens;
    /* Rows settled where the logits are (a top_only batch's, or drawn by samplers on a
     * device): the KVQ_TOP_N largest logits of each and their ids, the device's draws
     * (dev.logits unused: the rows' logits are `logits`); one host_alloc block */
    bool last_top_only;
    int last_rows;
    struct be_draw_out dev;
    void *dev_block;
    size_t top_cap; /* rows */
    /* How each row is settled (NULL: every row's logits come to the host), with the
     * rows' adjustments; the samplers' draws (last_drawn false: none drawn) */
    struct be_draw *draws;
    int draws_cap;
    struct be_draw_op *draw_ops;
    int draw_ops_cap;
    struct kvq_sampler **row_sampler; /* [rows] */
    int row_sampler_cap;
    kvq_token *drawn; /* [rows] */
    int drawn_cap;
    struct row_logprobs *lp; /* [rows]: k < 0 where none were asked for */
    int lp_cap;
    bool *row_read; /* [rows]: a BE_ROW_CUT row the host read, its candidates short */
    int row_read_cap;
    bool last_drawn, last_dev;
    atomic_int row_next; /* the next row settle_rows_task takes */
    /* Reordering scratch: the batch grouped by sequence, first_pass of them before the
     * tokens that must wait for a later pass (plan_batch). */
    int32_t *order;
    int order_cap, first_pass;
    int *count;               /* [3 * (n_seq + 1)]: tokens per sequence, cursors */
    struct kv_append_bound *append_bound; /* [n_layer]: of the layers' caches (plan_batch) */
    int32_t *chunk_tokens;    /* [2 * n_batch]: a forward pass's tokens, then its logit rows */
    struct fwd_seq *chunk_seqs; /* [n_batch] */
};

/* A row's log-probabilities (kvq_get_logprobs). */
struct row_logprobs {
    int k;
    float drawn;
    kvq_token ids[KVQ_LOGPROBS_MAX];
    float lps[KVQ_LOGPROBS_MAX];
};

struct kvq_prefix {
    struct kvq_context *c;
    struct kvq_kv_config kv;  /* its caches' config: the context's, or another format */
    struct kv_cache **caches; /* [n_layer] */
    struct kvq_prefix *prev, *next;
};

/* An empty model handle (kvq_model_free takes it as it is). */
static struct kvq_model *model_handle(void) {
    struct kvq_model *m = calloc(1, sizeof *m);
    if (!m) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&m->grammar_mu, NULL);
    return m;
}

struct kvq_model *kvq_model_load(const char *path) {
    struct kvq_model *m = model_handle();
    if (!m) return NULL;
    m->model = model_load(path);
    if (!m->model) goto fail;
    m->tok = tokenizer_from_gguf(m->model->file);
    if (!m->tok) goto fail;
    if (tokenizer_n_vocab(m->tok) > m->model->hp.n_vocab) {
        kvq_error("tokenizer has %d tokens but the model only %d", tokenizer_n_vocab(m->tok), m->model->hp.n_vocab);
        goto fail;
    }
    m->fingerprint = engine_fingerprint(m->model);
    return m;
fail:
    kvq_model_free(m);
    return NULL;
}

struct kvq_model *kvq_model_load_vocab(const char *path) {
    struct kvq_model *m = model_handle();
    if (!m) return NULL;
    struct gguf_file *f = gguf_open(path);
    if (!f) goto fail;
    m->tok = tokenizer_from_gguf(f); /* copies what it needs */
    gguf_close(f);
    if (!m->tok) goto fail;
    return m;
fail:
    kvq_model_free(m);
    return NULL;
}

void kvq_model_free(struct kvq_model *m) {
    if (!m) return;
    grammar_vocab_free(m->grammar_vocab);
    pthread_mutex_destroy(&m->grammar_mu);
    tokenizer_free(m->tok);
    model_free(m->model);
    free(m);
}

void kvq_model_get_info(const struct kvq_model *m, struct kvq_model_info *info) {
    if (!m->model) { /* vocabulary only */
        memset(info, 0, sizeof *info);
        info->arch = info->weight_type = "none";
        info->n_vocab = tokenizer_n_vocab(m->tok);
        return;
    }
    const struct model_hparams *hp = &m->model->hp;
    info->arch = hp->arch_name;
    info->weight_type = model_weight_type_name(m->model);
    info->n_vocab = hp->n_vocab;
    info->n_ctx_train = hp->n_ctx_train;
    info->n_embd = hp->n_embd;
    info->n_layer = hp->n_layer;
    info->n_head = hp->n_head;
    info->n_head_kv = hp->n_head_kv;
    info->head_dim = hp->head_dim;
    info->n_ff = hp->n_ff;
    info->n_params = m->model->n_params;
    info->weight_bytes = m->model->weight_bytes;
}

int kvq_model_meta_str(const struct kvq_model *m, const char *key, char *buf, size_t size) {
    const struct gguf_value *v = gguf_find(m->model->file, key);
    if (!v || v->type != GGUF_TYPE_STRING || v->str.len > INT32_MAX) return -1;
    if (size > 0) {
        size_t n = v->str.len < size ? v->str.len : size - 1;
        memcpy(buf, v->str.ptr, n);
        buf[n] = '\0';
    }
    return (int)v->str.len;
}

struct grammar_vocab *engine_grammar_vocab(const struct kvq_model *cm) {
    struct kvq_model *m = (struct kvq_model *)cm; /* the vocabulary is a cache: made once, then read-only */
    pthread_mutex_lock(&m->grammar_mu);
    if (!m->grammar_vocab) {
        struct kvq_model_info info;
        kvq_model_get_info(m, &info);
        m->grammar_vocab = grammar_vocab_new(m->tok, info.n_vocab);
    }
    struct grammar_vocab *v = m->grammar_vocab;
    pthread_mutex_unlock(&m->grammar_mu);
    return v;
}

/* ---- tokenizer ---- */

int kvq_tokenize(const struct kvq_model *m, const char *text, size_t len, bool add_special, bool parse_special,
                 kvq_token *out, int max) {
    return tokenizer_encode(m->tok, text, len, add_special, parse_special, out, max);
}
kvq_token kvq_token_bos(const struct kvq_model *m) { return tokenizer_bos(m->tok); }
kvq_token kvq_token_eos(const struct kvq_model *m) { return tokenizer_eos(m->tok); }
bool kvq_token_is_eog(const struct kvq_model *m, kvq_token t) { return tokenizer_is_eog(m->tok, t); }
int kvq_token_bytes(const struct kvq_model *m, kvq_token t, char *buf, int size) {
    return tokenizer_token_bytes(m->tok, t, true, buf, size);
}

struct kvq_detok {
    struct tokenizer_stream s;
};

struct kvq_detok *kvq_detok_new(const struct kvq_model *m) {
    struct kvq_detok *d = calloc(1, sizeof *d);
    if (!d) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    tokenizer_stream_init(&d->s, m->tok, false);
    return d;
}
int kvq_detok_feed(struct kvq_detok *d, kvq_token t, char *out, int size) {
    return tokenizer_stream_feed(&d->s, t, out, size);
}
int kvq_detok_flush(struct kvq_detok *d, char *out, int size) { return tokenizer_stream_flush(&d->s, out, size); }
void kvq_detok_free(struct kvq_detok *d) { free(d); }

/* ---- KV config ---- */

void kvq_kv_config_default(struct kvq_kv_config *kv) {
    memset(kv, 0, sizeof *kv);
    kv->k_bits = kv->v_bits = 16;
    kv->k_group = kv->v_group = 64;
    kv->keep = 4;
    kv->residual = 32;
    kv->hadamard = true; /* applies to quantized rows only; lowers KLD at every width (kv-quality) */
}

/* Layer il's cache config under kv. */
static void to_cache_config(const struct kvq_kv_config *kv, int il, struct kv_cache_config *cc) {
    kvq_kv_layer_bits(kv, il, &cc->k_bits, &cc->v_bits);
    cc->k_group = kv->k_group;
    cc->v_group = kv->v_group;
    cc->max_size = kv->max_size;
    cc->keep = kv->keep;
    cc->quantized_start = kv->quantized_start;
    cc->hadamard = kv->hadamard;
    cc->residual = kv->residual;
}

/* The cache of layer il: the user's config, narrowed on a sliding layer to what the
 * layer attends. A sliding layer of window W is a rotating cache of W tokens without
 * kept tokens (it attends exactly (p - W, p]); a smaller --max-kv-size wins, with its
 * --keep, as on the global layers (the tighter window, like mlx-lm's hybrid caches). */
static void layer_cache_setup(const struct model *m, int il, const struct kvq_kv_config *kv,
                              struct kv_cache_config *cc, struct kv_shape *s) {
    int window = m->layer_attn[il].window;
    to_cache_config(kv, il, cc);
    *s = (struct kv_shape){m->hp.n_head, m->hp.n_head_kv, m->hp.head_dim, window};
    if (window > 0 && !kv->swa_full && (cc->max_size == 0 || cc->max_size > window)) {
        cc->max_size = window;
        cc->keep = 0;
    }
}

/* Sums a per-layer size over the layers, each with its own cache config. */
static size_t sum_layers(const struct kvq_model *m, const struct kvq_kv_config *kv,
                         size_t (*per_layer)(const struct kv_cache_config *, const struct kv_shape *)) {
    size_t total = 0;
    for (int il = 0; m->model && il < m->model->hp.n_layer; il++) {
        struct kv_cache_config cc;
        struct kv_shape s;
        layer_cache_setup(m->model, il, kv, &cc, &s);
        total += per_layer(&cc, &s);
    }
    return total;
}

size_t kvq_kv_token_bytes(const struct kvq_model *m, const struct kvq_kv_config *kv) {
    return sum_layers(m, kv, kv_cache_token_bytes);
}

size_t kvq_kv_window_bytes(const struct kvq_model *m, const struct kvq_kv_config *kv) {
    return sum_layers(m, kv, kv_cache_window_bytes);
}

/* ---- context ---- */

void kvq_context_params_default(struct kvq_context_params *p) {
    memset(p, 0, sizeof *p);
    p->n_seq = 1;
    p->n_batch = 512;
    kvq_kv_config_default(&p->kv);
}

/* Tensor parallelism's GPUs as asked: 0, or -1 with an error. */
static int check_gpus(const struct kvq_context_params *p, const struct model_hparams *hp) {
    if (p->tp <= 1)
        return p->n_gpus == 0 ? 0
                              : kvq_error_code(KVQ_ERR_UNSUPPORTED, "--devices picks the GPUs of --tp N (N >= 2); for one "
                                                                    "GPU other than the first, set CUDA_VISIBLE_DEVICES");
    if (p->device != KVQ_DEVICE_CUDA)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "tensor parallelism (--tp %d) runs on GPUs: add --device cuda", p->tp);
    if (p->tp > KVQ_MAX_GPUS || hp->n_head_kv % p->tp != 0)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "--tp %d: the GPUs must divide the model's %d KV heads (and be at most %d)",
                              p->tp, hp->n_head_kv, KVQ_MAX_GPUS);
    if (p->n_gpus != 0 && p->n_gpus != p->tp)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "--devices names %d GPU%s for --tp %d: name %d", p->n_gpus,
                              p->n_gpus == 1 ? "" : "s", p->tp, p->tp);
    return 0;
}

/* Caches for one sequence, [n_layer], with blocks from the context's pool, in the
 * config kv (a held prefix's may differ from the context's in format). */
static struct kv_cache **new_caches_kv(const struct kvq_context *c, const struct kvq_kv_config *kv) {
    const struct model *m = c->m->model;
    struct kv_cache **cs = calloc((size_t)m->hp.n_layer, sizeof *cs);
    if (!cs) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    for (int il = 0; il < m->hp.n_layer; il++) {
        struct kv_cache_config cc;
        struct kv_shape shape;
        layer_cache_setup(m, il, kv, &cc, &shape);
        if (!(cs[il] = kv_cache_new_in(c->kv_pool, &cc, &shape))) {
            while (il-- > 0) kv_cache_free(cs[il]);
            free(cs);
            return NULL;
        }
    }
    return cs;
}

static struct kv_cache **new_caches(const struct kvq_context *c) { return new_caches_kv(c, &c->p.kv); }

/* What n_ctx tokens of every sequence take in whole blocks (a rotating cache holds
 * its window and a batch). */
static size_t default_budget(const struct kvq_context *c) {
    const struct model *m = c->m->model;
    size_t per_seq = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        struct kv_cache_config cc;
        struct kv_shape shape;
        layer_cache_setup(m, il, &c->p.kv, &cc, &shape);
        int n = c->p.n_ctx;
        if (cc.max_size > 0 && (int64_t)cc.max_size + c->p.n_batch < n) n = cc.max_size + c->p.n_batch;
        per_seq += kv_cache_budget_bytes(&cc, &shape, n);
    }
    return per_seq * (size_t)c->p.n_seq;
}

/* Bytes of the KV rows a forward pass of n_batch tokens appends at most: each token's
 * block rows and f16 window rows in every layer (the caches' formats as made). */
static size_t pass_kv_bytes(const struct kvq_context *c) {
    const struct model_hparams *hp = &c->m->model->hp;
    size_t per_token = 0;
    for (int l = 0; l < hp->n_layer; l++) {
        struct kv_view v;
        kv_cache_view(c->caches[l], &v);
        const bool rows_back = !kv_pool_device_rows(kv_cache_pool(c->caches[l])); /* else windows only */
        per_token += (size_t)hp->n_head_kv * ((rows_back ? v.k_row + v.v_row : 0) + (v.windows ? 2 * v.win_row : 0));
    }
    return per_token * (size_t)c->p.n_batch;
}

/* Rows of logits a forward pass holds. */
static int logit_rows_max(const struct kvq_context_params *p) {
    return p->max_logit_rows > 0 && p->max_logit_rows < p->n_batch ? p->max_logit_rows : p->n_batch;
}

struct kvq_context *kvq_context_new(struct kvq_model *m, const struct kvq_context_params *p) {
    if (!m->model) {
        kvq_error("the model was loaded for its vocabulary only");
        return NULL;
    }
    const struct model_hparams *hp = &m->model->hp;
    if (p->n_seq <= 0 || p->n_seq > 4096) {
        kvq_error("number of sequences must be 1..4096 (got %d)", p->n_seq);
        return NULL;
    }
    if (p->n_batch <= 0 || p->n_ctx < 0 || p->max_logit_rows < 0) {
        kvq_error("invalid context parameters: n_ctx %d, n_batch %d, max_logit_rows %d", p->n_ctx, p->n_batch,
                  p->max_logit_rows);
        return NULL;
    }
    /* the rotating size is added to batch sizes below: bounded first */
    if (p->kv.max_size < 0 || p->kv.max_size > (1 << 30)) {
        kvq_error("invalid rotating cache size %d: expected 0 .. %d tokens", p->kv.max_size, 1 << 30);
        return NULL;
    }
    /* A residual window or sink count beyond the context can never fill: refuse it
     * rather than report (and plan for) memory that is never used. */
    int n_ctx = p->n_ctx ? p->n_ctx : hp->n_ctx_train;
    bool quant = p->kv.k_bits < 16 || p->kv.v_bits < 16;
    if (quant && p->kv.residual > 0 && (p->kv.residual > n_ctx || p->kv.keep > n_ctx)) {
        kvq_error("KV residual window %d and keep %d must not exceed the context of %d tokens", p->kv.residual,
                  p->kv.keep, n_ctx);
        return NULL;
    }
    if (engine_check_layer_bits(&p->kv, hp->n_layer) != 0 || check_gpus(p, hp) != 0 ||
        (p->device == KVQ_DEVICE_CUDA && engine_check_gpu_layouts(&p->kv, hp->n_layer, hp->head_dim) != 0))
        return NULL;
    struct kvq_context *c = calloc(1, sizeof *c);
    if (!c) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    c->m = m;
    c->p = *p;
    if (c->p.n_ctx == 0) c->p.n_ctx = hp->n_ctx_train;
    if (c->p.kv_budget_bytes == 0) c->p.kv_budget_bytes = default_budget(c);
    c->be = p->device == KVQ_DEVICE_CUDA ? backend_cuda_new(p->n_threads, !p->gpu_f16_weights_off, p->tp,
                                                                 p->n_gpus ? p->gpus : NULL) : backend_cpu_new(p->n_threads);
    if (c->be && !c->be->ops->attends_nf && quant && (p->kv.k_group == KVQ_KV_NF || p->kv.v_group == KVQ_KV_NF)) {
        kvq_error_code(KVQ_ERR_UNSUPPORTED, "the CUDA backend has no attention for normal-float KV rows (--kv-bits 3, "
                                            "2 or :nf): use uniform rows (e.g. --kv-bits 4 or 3,3:uniform) or --device cpu");
        goto fail;
    }
    c->fwd = c->be ? forward_new(m->model, c->be, p->n_batch, logit_rows_max(p)) : NULL;
    c->kv_pool = c->be ? c->be->ops->kv_pool_new(c->be, c->p.kv_budget_bytes) : NULL;
    c->caches = calloc((size_t)p->n_seq * hp->n_layer, sizeof *c->caches);
    c->count = calloc(3 * ((size_t)p->n_seq + 1), sizeof *c->count);
    c->append_bound = malloc(sizeof *c->append_bound * (size_t)hp->n_layer);
    c->chunk_tokens = malloc(sizeof(int32_t) * (size_t)p->n_batch * 2);
    c->chunk_seqs = malloc(sizeof *c->chunk_seqs * (size_t)p->n_batch);
    if (!c->be || !c->fwd || !c->kv_pool || !c->caches || !c->count || !c->append_bound || !c->chunk_tokens ||
        !c->chunk_seqs) {
        if (!c->fwd && kvq_last_error()[0]) goto fail;
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        goto fail;
    }
    for (int il = 0; il < hp->n_layer; il++) { /* every sequence's caches take the context's config */
        struct kv_cache_config cc;
        struct kv_shape shape;
        layer_cache_setup(m->model, il, &c->p.kv, &cc, &shape);
        c->append_bound[il] = kv_config_append_bound(&cc, &shape);
    }
    for (int s = 0; s < p->n_seq; s++) {
        struct kv_cache **cs = new_caches(c);
        if (!cs) goto fail;
        memcpy(c->caches + (size_t)s * hp->n_layer, cs, sizeof *cs * (size_t)hp->n_layer);
        free(cs);
    }
    if (c->be->ops->reserve_kv && c->be->ops->reserve_kv(c->be, pass_kv_bytes(c)) != 0) goto fail;
    return c;
fail:
    kvq_context_free(c);
    return NULL;
}

static void free_caches(struct kv_cache **cs, int n) {
    if (cs)
        for (int i = 0; i < n; i++) kv_cache_free(cs[i]);
}

void kvq_context_free(struct kvq_context *c) {
    if (!c) return;
    while (c->prefixes) kvq_prefix_free(c->prefixes);
    free_caches(c->caches, c->p.n_seq * c->m->model->hp.n_layer);
    free(c->caches);
    kv_pool_free(c->kv_pool);
    forward_free(c->fwd);
    if (c->be) {
        c->be->ops->host_free(c->be, c->logits);
        c->be->ops->host_free(c->be, c->dev_block);
        c->be->ops->free(c->be);
    }
    free(c->draws);
    free(c->draw_ops);
    free(c->row_sampler);
    free(c->drawn);
    free(c->lp);
    free(c->row_read);
    free(c->row_of);
    free(c->order);
    free(c->count);
    free(c->append_bound);
    free(c->chunk_tokens);
    free(c->chunk_seqs);
    free(c);
}

int kvq_context_n_ctx(const struct kvq_context *c) { return c->p.n_ctx; }

static struct kv_cache **seq_caches(const struct kvq_context *c, int seq) {
    return c->caches + (size_t)seq * c->m->model->hp.n_layer;
}

static int check_seq(const struct kvq_context *c, int seq) {
    return seq < 0 || seq >= c->p.n_seq ? kvq_error("sequence %d does not exist (0..%d)", seq, c->p.n_seq - 1) : 0;
}

int kvq_seq_len(const struct kvq_context *c, int seq) {
    if (check_seq(c, seq) != 0) return -1;
    return kv_cache_n_past(seq_caches(c, seq)[0]);
}

int kvq_seq_keep_prefix(struct kvq_context *c, int seq, int n) {
    if (check_seq(c, seq) != 0) return -1;
    if (n < 0) return kvq_error("cannot keep %d tokens", n);
    struct kv_cache **cs = seq_caches(c, seq);
    const int L = c->m->model->hp.n_layer;
    for (int il = 0; il < L; il++) /* all or nothing */
        if (kv_cache_can_keep_prefix(cs[il], n) != 0) return -1;
    for (int il = 0; il < L; il++)
        if (kv_cache_keep_prefix(cs[il], n) != 0) return -1;
    return 0;
}

int kvq_seq_trim(struct kvq_context *c, int seq, int n) {
    if (check_seq(c, seq) != 0) return -1;
    int len = kvq_seq_len(c, seq);
    if (n <= 0) return 0;
    if (n > len) n = len;
    return kvq_seq_keep_prefix(c, seq, len - n) == 0 ? n : 0;
}

void kvq_seq_clear(struct kvq_context *c, int seq) {
    if (seq < 0 || seq >= c->p.n_seq) return;
    for (int il = 0; il < c->m->model->hp.n_layer; il++) kv_cache_clear(seq_caches(c, seq)[il]);
}

/* dst's caches become copies of src's: sharing blocks (kv_cache_fork), or with convert,
 * src's tokens in dst's format (kv_cache_convert); dst is emptied on failure. */
static int copy_caches(struct kv_cache **dst, struct kv_cache *const *src, int n_layer, bool convert) {
    for (int il = 0; il < n_layer; il++)
        if ((convert ? kv_cache_convert(dst[il], src[il]) : kv_cache_fork(dst[il], src[il])) != 0) {
            for (int j = 0; j < n_layer; j++) kv_cache_clear(dst[j]);
            return -1;
        }
    return 0;
}

int kvq_seq_fork(struct kvq_context *c, int src, int dst) {
    if (check_seq(c, src) != 0 || check_seq(c, dst) != 0) return -1;
    return copy_caches(seq_caches(c, dst), seq_caches(c, src), c->m->model->hp.n_layer, false);
}

size_t kvq_kv_bytes(const struct kvq_context *c) {
    size_t total = kv_pool_used(c->kv_pool);
    const int L = c->m->model->hp.n_layer;
    for (int i = 0; i < c->p.n_seq * L; i++) total += kv_cache_window_memory(c->caches[i]);
    for (const struct kvq_prefix *p = c->prefixes; p; p = p->next)
        for (int il = 0; il < L; il++) total += kv_cache_window_memory(p->caches[il]);
    return total;
}

size_t kvq_kv_budget(const struct kvq_context *c) { return kv_pool_budget(c->kv_pool); }

int kvq_pass_split_tokens(const struct kvq_context *c) {
    /* the host's append, or the device's, chooses them mid-batch (plan_batch) */
    if (!c->be->ops->encodes_kv || c->be->ops->chooses_offsets) return 0;
    struct kv_cache_config cc;
    to_cache_config(&c->p.kv, 0, &cc);
    return kv_cache_config_offsets_tokens(&cc);
}
int64_t kvq_kv_blocks(const struct kvq_context *c) { return kv_pool_blocks(c->kv_pool); }
void kvq_run_parallel(struct kvq_context *c, void (*fn)(void *arg, int ith, int nth), void *arg) {
    c->be->ops->run_on_host_threads(c->be, fn, arg);
}

/* ---- held prefixes ---- */

bool engine_prefix_kv_ok(const struct kvq_context *c, const struct kvq_kv_config *kv) {
    const struct kvq_kv_config *k = &c->p.kv;
    return kv->max_size == k->max_size && kv->keep == k->keep && kv->hadamard == k->hadamard &&
           kv->residual == k->residual && kv->swa_full == k->swa_full &&
           (kv->quantized_start == 0 || kv->quantized_start == k->quantized_start) &&
           engine_check_layer_bits(kv, c->m->model->hp.n_layer) == 0;
}

/* The context's config with another format: bits and groups from kv, stored at once. */
static struct kvq_kv_config prefix_kv(const struct kvq_context *c, const struct kvq_kv_config *kv) {
    struct kvq_kv_config p = c->p.kv;
    p.k_bits = kv->k_bits;
    p.v_bits = kv->v_bits;
    p.k_group = kv->k_group;
    p.v_group = kv->v_group;
    p.n_layer_bits = kv->n_layer_bits;
    memcpy(p.layer_bits, kv->layer_bits, sizeof p.layer_bits);
    p.quantized_start = 0;
    return p;
}

static bool same_format(const struct kvq_kv_config *a, const struct kvq_kv_config *b) {
    return kvq_kv_same_format(a, b) && a->quantized_start == b->quantized_start;
}

struct kvq_prefix *engine_prefix_new_kv(struct kvq_context *c, const struct kvq_kv_config *kv) {
    if (kv && !engine_prefix_kv_ok(c, kv)) {
        kvq_error("a held prefix's KV config may differ from its context's only in bits and group sizes");
        return NULL;
    }
    struct kvq_prefix *p = calloc(1, sizeof *p);
    if (p) p->kv = kv ? *kv : c->p.kv;
    if (!p || !(p->caches = new_caches_kv(c, &p->kv))) {
        free(p);
        if (!p) kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    p->c = c;
    p->next = c->prefixes;
    if (c->prefixes) c->prefixes->prev = p;
    c->prefixes = p;
    return p;
}

struct kvq_prefix *engine_prefix_new(struct kvq_context *c) { return engine_prefix_new_kv(c, NULL); }
const struct kvq_kv_config *engine_prefix_kv(const struct kvq_prefix *p) { return &p->kv; }
struct kv_cache **engine_prefix_caches(const struct kvq_prefix *p) { return p->caches; }
struct kvq_context *engine_prefix_context(const struct kvq_prefix *p) { return p->c; }

struct kvq_prefix *kvq_prefix_hold(struct kvq_context *c, int seq) {
    if (check_seq(c, seq) != 0) return NULL;
    struct kvq_prefix *p = engine_prefix_new(c);
    if (p && copy_caches(p->caches, seq_caches(c, seq), c->m->model->hp.n_layer, false) != 0) {
        kvq_prefix_free(p);
        return NULL;
    }
    return p;
}

/* A new prefix holding the caches src in format pk (re-encoded: a copy). */
static struct kvq_prefix *prefix_converted(struct kvq_context *c, struct kv_cache *const *src,
                                           const struct kvq_kv_config *pk) {
    struct kvq_prefix *p = engine_prefix_new_kv(c, pk);
    if (p && copy_caches(p->caches, src, c->m->model->hp.n_layer, true) != 0) {
        kvq_prefix_free(p);
        return NULL;
    }
    return p;
}

struct kvq_prefix *kvq_prefix_hold_as(struct kvq_context *c, int seq, const struct kvq_kv_config *kv) {
    if (!kv) return kvq_prefix_hold(c, seq);
    if (check_seq(c, seq) != 0) return NULL;
    struct kvq_kv_config pk = prefix_kv(c, kv);
    if (same_format(&pk, &c->p.kv)) return kvq_prefix_hold(c, seq);
    return prefix_converted(c, seq_caches(c, seq), &pk);
}

struct kvq_prefix *kvq_prefix_convert(const struct kvq_prefix *p, const struct kvq_kv_config *kv) {
    const struct kvq_kv_config pk = prefix_kv(p->c, kv);
    return prefix_converted(p->c, p->caches, &pk);
}

int kvq_prefix_attach(struct kvq_context *c, int seq, const struct kvq_prefix *p) {
    if (check_seq(c, seq) != 0) return -1;
    if (p->c != c) return kvq_error("a held prefix attaches only to sequences of its own context");
    return copy_caches(seq_caches(c, seq), p->caches, c->m->model->hp.n_layer, !same_format(&p->kv, &c->p.kv));
}

int kvq_prefix_len(const struct kvq_prefix *p) { return kv_cache_n_past(p->caches[0]); }

int kvq_prefix_fetch(const struct kvq_prefix *p) {
    for (int il = 0; il < p->c->m->model->hp.n_layer; il++)
        if (kv_cache_fetch(p->caches[il]) != 0) return -1;
    return 0;
}

void kvq_prefix_free(struct kvq_prefix *p) {
    if (!p) return;
    struct kvq_context *c = p->c;
    if (p->prev) p->prev->next = p->next;
    else c->prefixes = p->next;
    if (p->next) p->next->prev = p->prev;
    free_caches(p->caches, c->m->model->hp.n_layer);
    free(p->caches);
    free(p);
}

int kvq_kv_layer_kinds(const struct kvq_context *c, struct kvq_kv_layer_kind *out, int max) {
    const struct model *m = c->m->model;
    int n = 0;
    struct kvq_kv_layer_kind g[8]; /* kinds x (sliding or not): few */
    for (int il = 0; il < m->hp.n_layer; il++) {
        const struct kv_cache *kc = c->caches[il];
        const char *kind = kv_cache_kind(kc);
        int window = m->layer_attn[il].window, max_size = kv_cache_get_config(kc)->max_size, j = 0;
        while (j < n && !(!strcmp(g[j].kind, kind) && g[j].window == window && g[j].max_size == max_size)) j++;
        if (j == n) {
            if (n == (int)(sizeof g / sizeof g[0])) continue;
            g[n++] = (struct kvq_kv_layer_kind){kind, window, max_size, 0, 0};
        }
        g[j].n_layers++;
        for (int s = 0; s < c->p.n_seq; s++) g[j].bytes += kv_cache_bytes(seq_caches(c, s)[il]);
    }
    for (int j = 0; j < n && j < max; j++) out[j] = g[j];
    return n;
}

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    void *q = realloc(*p, (size_t)need * elem);
    if (!q) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    *p = q;
    *cap = need;
    return 0;
}

/* Checks a batch and groups its tokens by sequence (stable), into c->order. Where
 * devices encode the rows but do not choose the offsets (tensor parallelism), a
 * sequence whose tokens cross the point where its offsets are chosen
 * (kv_cache_offsets_point) has its tokens from there on placed after every other
 * sequence's, from c->first_pass on: the first pass ends there, so the step's
 * other sequences (a server's decoding streams beside a prompt) are not cut out of it
 * into passes of their own. */
static int plan_batch(struct kvq_context *c, const struct kvq_batch *b) {
    int n = b->n_tokens;
    if (n <= 0) return kvq_error("empty batch");
    if (grow((void **)&c->order, &c->order_cap, n, sizeof *c->order)) return -1;
    int n_seq = c->p.n_seq, *count = c->count;
    memset(count, 0, sizeof *count * ((size_t)n_seq + 1));
    for (int i = 0; i < n; i++) {
        int s = b->seq_ids ? b->seq_ids[i] : 0;
        if (s < 0 || s >= n_seq) return kvq_error("batch token %d names sequence %d (0..%d)", i, s, n_seq - 1);
        if (b->tokens[i] < 0 || b->tokens[i] >= c->m->model->hp.n_vocab)
            return kvq_error("token id %d is outside the vocabulary (0..%d)", b->tokens[i],
                             c->m->model->hp.n_vocab - 1);
        count[s + 1]++;
    }
    /* the whole batch must fit the context and the KV budget before anything is written:
     * a bound from the layers' configurations first; the exact sum, which visits every
     * cache (0.5-1 ms a step of 128 sequences of 24-32 layers, their structures out of
     * the CPU's caches), only where the bound does not fit */
    const int n_layer = c->m->model->hp.n_layer;
    size_t need = 0;
    bool exact = false;
    for (int s = 0; s < n_seq; s++) {
        if (count[s + 1] == 0) continue;
        int len = kv_cache_n_past(seq_caches(c, s)[0]);
        if (c->p.kv.max_size == 0 && len + count[s + 1] > c->p.n_ctx)
            return kvq_error_code(KVQ_ERR_CONTEXT_FULL,
                                  "context full: sequence %d holds %d tokens, %d more would exceed the context of %d",
                                  s, len, count[s + 1], c->p.n_ctx);
        for (int il = 0; il < n_layer; il++) {
            exact |= c->append_bound[il].exact_only;
            need += kv_append_bound_bytes(&c->append_bound[il], len, count[s + 1]);
        }
    }
    if (exact || !kv_pool_fits(c->kv_pool, need)) {
        need = 0;
        for (int s = 0; s < n_seq; s++) {
            struct kv_cache **cs = seq_caches(c, s);
            for (int il = 0; il < n_layer && count[s + 1] > 0; il++)
                need += kv_cache_append_bytes(cs[il], count[s + 1], c->p.n_batch);
        }
    }
    if (!kv_pool_fits(c->kv_pool, need))
        return kvq_error_code(KVQ_ERR_BUDGET,
                              "KV cache budget exhausted: the batch needs up to %zu more bytes, %zu of %zu are in use "
                              "(raise the KV budget or free sequences)",
                              need, kv_pool_used(c->kv_pool), kv_pool_budget(c->kv_pool));
    int *head = count + n_seq + 1, *tail = head + n_seq + 1; /* cursors */
    int heads = 0;
    const bool split = kvq_pass_split_tokens(c) > 0;
    for (int s = 0; s < n_seq; s++) {
        const int n_s = count[s + 1];
        struct kv_cache *c0 = seq_caches(c, s)[0];
        const int32_t T = !split || n_s == 0 ? 0 : kv_cache_offsets_point(c0);
        const int32_t np = kv_cache_n_past(c0);
        head[s] = T > 0 && np + n_s > T ? (int)(T - np) : n_s;
        heads += head[s];
    }
    for (int s = 0, h = 0, t = heads; s < n_seq; s++) {
        const int n_s = count[s + 1];
        count[s + 1] = head[s]; /* how many go first: head[s] becomes their cursor */
        head[s] = h, tail[s] = t;
        h += count[s + 1], t += n_s - count[s + 1];
    }
    for (int i = 0; i < n; i++) {
        const int s = b->seq_ids ? b->seq_ids[i] : 0;
        if (count[s + 1] > 0) count[s + 1]--, c->order[head[s]++] = i;
        else c->order[tail[s]++] = i;
    }
    c->first_pass = heads;
    return 0;
}

_Static_assert(KVQ_TOP_N <= BE_TOP_MAX, "a backend finds as many largest logits as a batch keeps");

double kvq_logprobs(const float *x, int n, int k, kvq_token *ids, float *lps) {
    float mx = -INFINITY;
    int have = 0;
    for (int i = 0; i < n; i++) { /* an insertion into a short sorted list: k <= 20 */
        if (x[i] > mx) mx = x[i];
        if (k == 0 || (have == k && !(x[i] > lps[k - 1]))) continue;
        int j = have < k ? have++ : k - 1;
        for (; j > 0 && x[i] > lps[j - 1]; j--) ids[j] = ids[j - 1], lps[j] = lps[j - 1];
        ids[j] = i, lps[j] = x[i];
    }
    double sum = 0; /* in double: 150K terms in float would lose digits */
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - mx);
    const double log_z = (double)mx + log(sum);
    for (int j = 0; j < have; j++) lps[j] = (float)(lps[j] - log_z);
    return log_z;
}

/* Token t's logit among a BE_ROW_CUT row's candidates (-inf where it is not one). */
static float cut_logit(const struct be_draw_out *out, int r, kvq_token t) {
    const int m = be_cut_count(out, r);
    const size_t at = (size_t)r * BE_CUT_MAX;
    for (int i = 0; i < m; i++)
        if (out->cand_ids[at + (size_t)i] == t) return out->cand_vals[at + (size_t)i];
    return -INFINITY;
}

/* What the host does with the rows after the passes, a row at a time to whichever
 * thread asks next: a sampler's draw (from the logits, or finished from the device's
 * results), or a top_only row's largest logits where the device did not find them. */
static void settle_rows_task(void *arg, int ith, int nth) {
    (void)ith, (void)nth;
    struct kvq_context *c = arg;
    const int n_vocab = c->m->model->hp.n_vocab;
    for (int r; (r = atomic_fetch_add_explicit(&c->row_next, 1, memory_order_relaxed)) < c->last_rows;) {
        const float *logits = c->logits ? c->logits + (size_t)r * n_vocab : NULL;
        struct kvq_sampler *s = c->last_drawn ? c->row_sampler[r] : NULL;
        const struct be_draw *d = c->last_dev ? &c->draws[r] : NULL;
        struct row_logprobs *lp = s ? &c->lp[r] : NULL;
        if (s && (!d || d->row == BE_ROW_LOGITS || c->row_read[r])) {
            /* a cut row read back comes adjusted, which sampler_plan allows only where no
             * log-probabilities are asked for */
            const kvq_token t = c->drawn[r] = !d || d->row == BE_ROW_LOGITS ? kvq_sampler_sample(s, logits)
                                                                             : sampler_draw_adjusted(s, logits);
            if (lp->k >= 0) lp->drawn = (float)(logits[t] - kvq_logprobs(logits, n_vocab, lp->k, lp->ids, lp->lps));
        } else if (s) {
            const float *vals = c->dev.vals + (size_t)r * KVQ_TOP_N;
            const kvq_token *ids = c->dev.ids + (size_t)r * KVQ_TOP_N;
            const kvq_token t = c->drawn[r] = sampler_finish(s, d, &c->dev, r);
            if (lp->k >= 0) { /* the row as the model left it: its largest are the most likely */
                const double log_z = c->dev.log_z[r];
                float logit = d->row == BE_ROW_DRAW ? c->dev.drawn_logit[r] : -INFINITY;
                for (int j = 0; j < KVQ_TOP_N; j++) {
                    if (ids[j] == t) logit = vals[j];
                    if (j < lp->k) lp->ids[j] = ids[j], lp->lps[j] = (float)(vals[j] - log_z);
                }
                if (d->row == BE_ROW_CUT && logit == -INFINITY) logit = cut_logit(&c->dev, r, t);
                lp->drawn = (float)(logit - log_z);
            }
        } else if (c->last_top_only && !d) {
            sampler_top(logits, n_vocab, KVQ_TOP_N, c->dev.vals + (size_t)r * KVQ_TOP_N,
                        c->dev.ids + (size_t)r * KVQ_TOP_N);
        }
    }
}

/* Host memory for n_rows rows of logits (rewritten by every decode: nothing to keep). */
static int host_rows(struct kvq_context *c, int n_rows) {
    if ((size_t)n_rows <= c->logits_cap) return 0;
    c->be->ops->host_free(c->be, c->logits);
    c->logits = c->be->ops->host_alloc(c->be, sizeof(float) * (size_t)n_rows * (size_t)c->m->model->hp.n_vocab);
    c->logits_cap = c->logits ? (size_t)n_rows : 0;
    return c->logits ? 0 : kvq_error_wrap("%d rows of logits: %s", n_rows, kvq_last_error());
}

/* A pass's cut rows, a row at a time to whichever thread asks next: whether the
 * device's candidates settle each (their sort left in its sampler for the draw). */
struct cut_rows {
    struct kvq_context *c;
    int end;
    atomic_int next;
};

static void cut_rows_task(void *arg, int ith, int nth) {
    (void)ith, (void)nth;
    struct cut_rows *t = arg;
    struct kvq_context *c = t->c;
    for (int r; (r = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->end;)
        c->row_read[r] = c->draws[r].row == BE_ROW_CUT && !sampler_cut_settles(c->row_sampler[r], &c->dev, r);
}

/* After a pass: reads the rows of [row0, row1) whose cut the device's candidates do not
 * settle (before the next pass rewrites them). 0 or -1. */
static int read_unsettled(struct kvq_context *c, int row0, int row1, int n_rows) {
    bool cuts = false, any = false;
    for (int r = row0; r < row1; r++) cuts |= c->draws[r].row == BE_ROW_CUT;
    if (!cuts) return 0;
    struct cut_rows t = {.c = c, .end = row1};
    atomic_init(&t.next, row0);
    c->be->ops->run_on_host_threads(c->be, cut_rows_task, &t);
    for (int r = row0; r < row1; r++) {
        if (!c->row_read[r]) continue;
        if (host_rows(c, n_rows) != 0) return -1;
        forward_read_logits(c->fwd, r - row0, c->logits + (size_t)r * c->m->model->hp.n_vocab);
        any = true;
    }
    return any ? c->be->ops->sync(c->be) : 0;
}

/* The rows' samplers, and on a device that keeps the logits (dev) how each row is
 * settled there (c->draws, with their adjustments in c->draw_ops): how many
 * adjustments, or -1 with an error. */
static int plan_rows(struct kvq_context *c, const struct kvq_batch *b, int n_rows, bool dev) {
    if (b->samplers && (grow((void **)&c->row_sampler, &c->row_sampler_cap, n_rows, sizeof *c->row_sampler) ||
                        grow((void **)&c->drawn, &c->drawn_cap, n_rows, sizeof *c->drawn) ||
                        grow((void **)&c->lp, &c->lp_cap, n_rows, sizeof *c->lp)))
        return -1;
    if (dev && (grow((void **)&c->draws, &c->draws_cap, n_rows, sizeof *c->draws) ||
                grow((void **)&c->row_read, &c->row_read_cap, n_rows, sizeof *c->row_read)))
        return -1;
    int n_ops = 0;
    for (int i = 0; i < b->n_tokens; i++) {
        const int r = c->row_of[i];
        if (r < 0) continue;
        struct kvq_sampler *s = b->samplers ? b->samplers[i] : NULL;
        const int lp_k = s && b->logprobs ? b->logprobs[i] : -1;
        if (lp_k > KVQ_LOGPROBS_MAX || lp_k > c->m->model->hp.n_vocab)
            return kvq_error("%d log-probabilities a token (0..%d)", lp_k, KVQ_LOGPROBS_MAX);
        if (b->samplers) c->row_sampler[r] = s, c->lp[r].k = lp_k < 0 ? -1 : lp_k;
        if (!dev) continue;
        struct be_draw *d = &c->draws[r];
        *d = (struct be_draw){.row = b->top_only ? BE_ROW_TOP : BE_ROW_LOGITS};
        c->row_read[r] = false;
        if (!s) continue;
        if (grow((void **)&c->draw_ops, &c->draw_ops_cap, n_ops + sampler_draw_ops_max(s), sizeof *c->draw_ops))
            return -1;
        const int m = sampler_plan(s, lp_k, d, c->draw_ops + n_ops);
        d->op0 = n_ops;
        n_ops += m;
    }
    for (int r = 0; b->samplers && r < n_rows; r++) /* a sampler draws one token at a time */
        for (int q = 0; q < r && c->row_sampler[r]; q++)
            if (c->row_sampler[q] == c->row_sampler[r]) return kvq_error("one sampler for two rows of a batch");
    return n_ops;
}

int kvq_decode(struct kvq_context *c, const struct kvq_batch *b) {
    const struct model *m = c->m->model;
    if (plan_batch(c, b) != 0) return -1;
    int n = b->n_tokens, n_vocab = m->hp.n_vocab;
    if (b->top_only && n_vocab < KVQ_TOP_N) return kvq_error("a vocabulary of %d tokens has no %d largest logits", n_vocab, KVQ_TOP_N);
    int n_rows = 0;
    if (grow((void **)&c->row_of, &c->row_of_cap, n, sizeof *c->row_of)) return -1;
    for (int j = 0; j < n; j++) {
        const int i = c->order[j];
        bool want = b->logits ? b->logits[i] : i == n - 1;
        c->row_of[i] = want ? n_rows++ : -1;
    }
    c->last_n_tokens = 0; /* kvq_get_logits, kvq_get_top, kvq_get_drawn: none until this batch is done */
    /* a device settles the rows where the logits are (they stay there); the host, after
     * the passes */
    bool dev = (b->top_only || b->samplers) && c->be->ops->draw && !c->be->ops->host_memory && n_vocab >= KVQ_TOP_N;
    const int n_ops = plan_rows(c, b, n_rows, dev);
    if (n_ops < 0) return -1;
    bool host_logits = !dev, dev_rows = false;
    for (int r = 0; dev && r < n_rows; r++) {
        host_logits |= c->draws[r].row == BE_ROW_LOGITS;
        dev_rows |= c->draws[r].row != BE_ROW_LOGITS;
    }
    dev = dev && dev_rows; /* else the product sends every row as it makes them */
    if (host_logits && host_rows(c, n_rows) != 0) return -1;
    if ((b->top_only || dev) && (size_t)n_rows > c->top_cap) {
        const size_t rows = (size_t)n_rows;
        c->be->ops->host_free(c->be, c->dev_block);
        c->dev_block = c->be->ops->host_alloc(
            c->be, (2 * sizeof(double) + (sizeof(float) + sizeof(kvq_token)) * (KVQ_TOP_N + 1 + BE_CUT_MAX) +
                    sizeof(int32_t)) *
                       rows);
        if (!c->dev_block) {
            c->top_cap = 0;
            return kvq_error_wrap("%d rows of largest logits: %s", n_rows, kvq_last_error());
        }
        c->dev.log_z = c->dev_block;
        c->dev.sum = c->dev.log_z + rows;
        c->dev.vals = (float *)(c->dev.sum + rows);
        c->dev.drawn_logit = c->dev.vals + KVQ_TOP_N * rows;
        c->dev.cand_vals = c->dev.drawn_logit + rows;
        c->dev.ids = (kvq_token *)(c->dev.cand_vals + BE_CUT_MAX * rows);
        c->dev.drawn = c->dev.ids + KVQ_TOP_N * rows;
        c->dev.n_cand = c->dev.drawn + rows;
        c->dev.cand_ids = c->dev.n_cand + rows;
        c->top_cap = rows;
    }

    /* Forward passes over chunks of at most n_batch tokens of the grouped batch. */
    const int chunk = c->p.n_batch, max_rows = logit_rows_max(&c->p);
    int32_t *tokens = c->chunk_tokens, *logit_rows = tokens + chunk;
    struct fwd_seq *seqs = c->chunk_seqs;
    int rc = 0;
    for (int start = 0, len; start < n && rc == 0; start += len) {
        len = n - start < chunk ? n - start : chunk;
        if (start < c->first_pass && start + len > c->first_pass) len = c->first_pass - start;
        for (int j = 0, rows = 0; j < len; j++) /* and at most the rows of logits a pass holds */
            if (c->row_of[c->order[start + j]] >= 0 && ++rows > max_rows) len = j;
        struct fwd_batch fb = {.n_tokens = len, .tokens = tokens, .seqs = seqs, .logit_rows = logit_rows};
        int first_row = -1;
        for (int j = 0; j < len; j++) {
            int i = c->order[start + j];
            int s = b->seq_ids ? b->seq_ids[i] : 0;
            tokens[j] = b->tokens[i];
            if (fb.n_seqs == 0 || seqs[fb.n_seqs - 1].caches != seq_caches(c, s)) {
                seqs[fb.n_seqs++] = (struct fwd_seq){j, 0, seq_caches(c, s)};
            }
            struct fwd_seq *sq = &seqs[fb.n_seqs - 1];
            sq->n++;
            if (c->row_of[i] >= 0) {
                if (first_row < 0) first_row = c->row_of[i];
                logit_rows[fb.n_logits++] = j;
            }
        }
        /* rows are numbered in chunk order: the pass writes them in place */
        const size_t row0 = (size_t)(first_row < 0 ? 0 : first_row);
        struct be_draw_out out;
        if (dev) {
            out = (struct be_draw_out){c->dev.vals + row0 * KVQ_TOP_N,
                                       c->dev.ids + row0 * KVQ_TOP_N,
                                       c->dev.drawn + row0,
                                       c->dev.drawn_logit + row0,
                                       c->dev.log_z + row0,
                                       host_logits ? c->logits + row0 * n_vocab : NULL,
                                       c->dev.sum + row0,
                                       c->dev.n_cand + row0,
                                       c->dev.cand_vals + row0 * BE_CUT_MAX,
                                       c->dev.cand_ids + row0 * BE_CUT_MAX};
            fb.draws = c->draws + row0;
            fb.draw_ops = c->draw_ops;
            fb.n_draw_ops = n_ops;
            fb.draw_out = &out;
        }
        rc = forward_run(c->fwd, &fb, host_logits ? c->logits + row0 * n_vocab : NULL);
        if (rc == 0 && dev) rc = read_unsettled(c, (int)row0, (int)row0 + fb.n_logits, n_rows);
    }
    if (rc != 0) return rc;
    c->last_top_only = b->top_only;
    c->last_drawn = b->samplers != NULL;
    c->last_dev = dev;
    c->last_rows = n_rows;
    if (n_rows > 0 && (b->samplers || (b->top_only && !dev))) {
        atomic_store_explicit(&c->row_next, 0, memory_order_relaxed);
        c->be->ops->run_on_host_threads(c->be, settle_rows_task, c);
    }
    c->last_n_tokens = n;
    return 0;
}

int kvq_embed(struct kvq_context *c, int seq, const kvq_token *tokens, int n, enum kvq_pooling pooling, float *out) {
    const struct model_hparams *hp = &c->m->model->hp;
    if (!c->be->ops->host_memory) return kvq_error("embeddings are computed on the CPU only (this context runs on %s)", c->be->ops->name);
    if (seq < 0 || seq >= c->p.n_seq) return kvq_error("sequence %d does not exist (0..%d)", seq, c->p.n_seq - 1);
    if (n <= 0 || n > c->p.n_ctx) return kvq_error("%d tokens to embed (1..%d)", n, c->p.n_ctx);
    if (pooling != KVQ_POOLING_MEAN && pooling != KVQ_POOLING_LAST) return kvq_error("unknown pooling %d", (int)pooling);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return kvq_error("token id %d is outside the vocabulary (0..%d)", tokens[i], hp->n_vocab - 1);
    const int chunk = logit_rows_max(&c->p), d = hp->n_embd; /* every token's hidden state is a row */
    float *h = malloc(sizeof *h * (size_t)chunk * (size_t)d);
    double *sum = calloc((size_t)d, sizeof *sum);
    int32_t *rows = c->chunk_tokens + chunk;
    int rc = h && sum ? 0 : kvq_error_code(KVQ_ERR_OOM, "out of memory");
    kvq_seq_clear(c, seq);
    for (int start = 0, len; start < n && rc == 0; start += len) {
        len = n - start < chunk ? n - start : chunk;
        for (int j = 0; j < len; j++) rows[j] = j;
        struct fwd_seq sq = {0, len, seq_caches(c, seq)};
        struct fwd_batch fb = {.n_tokens = len, .tokens = tokens + start, .n_seqs = 1, .seqs = &sq, .n_logits = len,
                               .logit_rows = rows, .hidden = h};
        rc = forward_run(c->fwd, &fb, NULL);
        for (int j = pooling == KVQ_POOLING_MEAN ? 0 : len - 1; rc == 0 && j < len; j++)
            for (int k = 0; k < d; k++) sum[k] += h[(size_t)j * d + k];
    }
    kvq_seq_clear(c, seq);
    double norm = 0;
    for (int k = 0; rc == 0 && k < d; k++) norm += sum[k] * sum[k];
    norm = norm > 0 ? 1.0 / sqrt(norm) : 0; /* the mean's 1/n cancels out */
    for (int k = 0; rc == 0 && k < d; k++) out[k] = (float)(sum[k] * norm);
    free(h);
    free(sum);
    return rc;
}

const float *kvq_get_logits(const struct kvq_context *c, int i) {
    if (i < 0 || i >= c->last_n_tokens || c->row_of[i] < 0 || c->last_top_only) return NULL;
    const int r = c->row_of[i];
    if ((c->last_drawn && c->row_sampler[r]) || (c->last_dev && c->draws[r].row != BE_ROW_LOGITS)) return NULL;
    return c->logits + (size_t)r * c->m->model->hp.n_vocab;
}

kvq_token kvq_get_drawn(const struct kvq_context *c, int i) {
    if (i < 0 || i >= c->last_n_tokens || c->row_of[i] < 0 || !c->last_drawn || !c->row_sampler[c->row_of[i]])
        return -1;
    return c->drawn[c->row_of[i]];
}

int kvq_get_logprobs(const struct kvq_context *c, int i, float *drawn, kvq_token *ids, float *lps) {
    if (kvq_get_drawn(c, i) < 0 || c->lp[c->row_of[i]].k < 0) return -1;
    const struct row_logprobs *lp = &c->lp[c->row_of[i]];
    *drawn = lp->drawn;
    memcpy(ids, lp->ids, sizeof *ids * (size_t)lp->k);
    memcpy(lps, lp->lps, sizeof *lps * (size_t)lp->k);
    return lp->k;
}

int kvq_get_top(const struct kvq_context *c, int i, float *vals, kvq_token *ids) {
    if (i < 0 || i >= c->last_n_tokens || c->row_of[i] < 0 || !c->last_top_only) return -1;
    memcpy(vals, c->dev.vals + (size_t)c->row_of[i] * KVQ_TOP_N, sizeof *vals * KVQ_TOP_N);
    memcpy(ids, c->dev.ids + (size_t)c->row_of[i] * KVQ_TOP_N, sizeof *ids * KVQ_TOP_N);
    return 0;
}

/* ---- internal accessors (engine_internal.h), for seq_state.c ---- */

const struct model *engine_model(const struct kvq_context *c) { return c->m->model; }
const struct model *engine_model_data(const struct kvq_model *m) { return m->model; }
uint64_t engine_context_fingerprint(const struct kvq_context *c) { return c->m->fingerprint; }
const struct kvq_kv_config *engine_kv_config(const struct kvq_context *c) { return &c->p.kv; }
struct kv_cache **engine_seq_caches(const struct kvq_context *c, int seq) {
    if (seq < 0 || seq >= c->p.n_seq) {
        kvq_error("sequence %d does not exist (0..%d)", seq, c->p.n_seq - 1);
        return NULL;
    }
    return seq_caches(c, seq);
}
