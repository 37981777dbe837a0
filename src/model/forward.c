/* The forward pass of a Llama-family model over a batch of tokens: what each layer
 * computes, in order. How and where each step runs is the backend's business
 * (backend/backend.h); this file only passes buffers between the steps. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "kvcache/kv_cache.h"
#include "model/model.h"

struct forward {
    const struct model *m;
    struct backend *be;
    int max_tokens, max_logits;
    int q_dim, kv_dim, half_rope;
    /* activations in backend memory */
    float *x, *xn, *q, *k, *v, *attn, *tmp, *gate, *up;
    float *rope_cos, *rope_sin; /* [n_rope_sets][T][rope_dim/2] */
    float *logits;              /* [max_logits][n_vocab] when activations are not host memory */
    /* host-side step parameters */
    int32_t *pos;                /* [T] */
    struct kv_cache **tok_cache; /* [T]: this layer's cache of the token's sequence */
    struct be_kv_append *append; /* [T] */
};

/* Hands every weight and vector of the model to the backend. */
static int upload_model(const struct model *m, struct backend *be) {
    const struct backend_ops *op = be->ops;
    const struct model_hparams *hp = &m->hp;
    int rc = op->upload_weight(be, &m->tok_embd) | op->upload_weight(be, &m->output) |
             op->upload_vector(be, m->output_norm, hp->n_embd) |
             op->upload_vector(be, m->rope_inv_freq, (int64_t)m->n_rope_sets * (hp->rope_dim / 2));
    for (int il = 0; il < hp->n_layer && rc == 0; il++) {
        const struct layer_weights *L = &m->layers[il];
        for (int i = 0; i < MODEL_LAYER_PRODUCTS; i++) rc |= op->upload_weight(be, model_layer_product(L, i));
        const float *norms[] = {L->attn_norm, L->ffn_norm, L->post_attn_norm, L->post_ffn_norm};
        for (size_t i = 0; i < sizeof norms / sizeof norms[0]; i++)
            if (norms[i]) rc |= op->upload_vector(be, norms[i], hp->n_embd);
        if (L->q_norm) rc |= op->upload_vector(be, L->q_norm, hp->head_dim);
        if (L->k_norm) rc |= op->upload_vector(be, L->k_norm, hp->head_dim);
        if (L->bq) rc |= op->upload_vector(be, L->bq, (int64_t)hp->n_head * hp->head_dim);
        if (L->bk) rc |= op->upload_vector(be, L->bk, (int64_t)hp->n_head_kv * hp->head_dim);
        if (L->bv) rc |= op->upload_vector(be, L->bv, (int64_t)hp->n_head_kv * hp->head_dim);
    }
    return rc ? -1 : 0;
}

struct forward *forward_new(const struct model *m, struct backend *be, int max_tokens, int max_logits) {
    const struct model_hparams *hp = &m->hp;
    struct forward *f = calloc(1, sizeof *f);
    if (!f) goto oom;
    f->m = m;
    f->be = be;
    f->max_tokens = max_tokens;
    f->max_logits = max_logits;
    f->q_dim = hp->n_head * hp->head_dim;
    f->kv_dim = hp->n_head_kv * hp->head_dim;
    f->half_rope = hp->rope_dim / 2;
    size_t T = (size_t)max_tokens;
    int64_t widest = hp->n_embd;
    if (hp->n_ff > widest) widest = hp->n_ff;
    if (f->q_dim > widest) widest = f->q_dim;
    float **bufs[] = {&f->x, &f->xn, &f->q, &f->k, &f->v, &f->attn, &f->tmp, &f->gate, &f->up, &f->rope_cos, &f->rope_sin};
    size_t sizes[] = {(size_t)hp->n_embd, (size_t)widest, (size_t)f->q_dim, (size_t)f->kv_dim, (size_t)f->kv_dim,
                      (size_t)f->q_dim, (size_t)hp->n_embd, (size_t)hp->n_ff, (size_t)hp->n_ff,
                      (size_t)f->half_rope * (size_t)m->n_rope_sets, (size_t)f->half_rope * (size_t)m->n_rope_sets};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (!(*bufs[i] = be->ops->alloc(be, sizeof(float) * T * sizes[i]))) goto fail;
    if (!be->ops->host_memory && !(f->logits = be->ops->alloc(be, sizeof(float) * (size_t)max_logits * hp->n_vocab)))
        goto fail;
    f->pos = malloc(sizeof(int32_t) * T);
    f->tok_cache = malloc(sizeof(struct kv_cache *) * T);
    f->append = malloc(sizeof *f->append * T);
    if (!f->pos || !f->tok_cache || !f->append) goto oom;
    if (be->ops->reserve(be, max_tokens, widest) != 0 || upload_model(m, be) != 0) goto fail;
    return f;
oom:
    kvq_error_code(KVQ_ERR_OOM, "out of memory allocating buffers for %d tokens", max_tokens);
fail:
    forward_free(f);
    return NULL;
}

void forward_free(struct forward *f) {
    if (!f) return;
    float *bufs[] = {f->x, f->xn, f->q, f->k, f->v, f->attn, f->tmp, f->gate, f->up, f->rope_cos, f->rope_sin};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) f->be->ops->release(f->be, bufs[i]);
    if (f->logits) f->be->ops->release(f->be, f->logits);
    free(f->pos);
    free(f->tok_cache);
    free(f->append);
    free(f);
}

static int run_layer(struct forward *f, const struct fwd_batch *b, int il) {
    const struct backend_ops *op = f->be->ops;
    struct backend *be = f->be;
    const struct model_hparams *hp = &f->m->hp;
    const struct layer_weights *L = &f->m->layers[il];
    const int n = b->n_tokens, D = hp->head_dim;

    if (il == 0) /* later layers get theirs from the previous layer's last add_norm */
        op->rmsnorm(be, f->x, NULL, L->attn_norm, n, hp->n_embd, hp->rms_eps, f->xn);
    struct be_matmul qkv[3] = {{.w = &L->wq, .y = f->q, .bias = L->bq},
                               {.w = &L->wk, .y = f->k, .bias = L->bk},
                               {.w = &L->wv, .y = f->v, .bias = L->bv}};
    op->matmul(be, f->xn, hp->n_embd, n, 3, qkv);
    size_t table = (size_t)f->m->layer_attn[il].rope_set * f->max_tokens * f->half_rope;
    struct be_rope rope = {f->q, f->k, hp->n_head, hp->n_head_kv, D, L->q_norm, L->k_norm, hp->rms_eps,
                           f->rope_cos + table, f->rope_sin + table, f->half_rope, (int)hp->rope_pairing,
                           hp->attn_scale};

    for (int s = 0; s < b->n_seqs; s++) {
        const struct fwd_seq *sq = &b->seqs[s];
        f->append[s] = (struct be_kv_append){sq->caches[il], sq->first, sq->n};
        for (int t = sq->first; t < sq->first + sq->n; t++) f->tok_cache[t] = sq->caches[il];
    }
    if (op->kv_append(be, f->append, b->n_seqs, f->k, f->v, &rope) != 0) return -1;
    struct be_attention at = {f->q, f->attn, f->tok_cache, f->pos, hp->n_head, hp->n_head_kv, D, hp->attn_scale};
    op->attention(be, &at, n);

    struct be_matmul o = {.w = &L->wo, .y = f->tmp};
    op->matmul(be, f->attn, f->q_dim, n, 1, &o);
    op->add_norm(be, f->x, f->tmp, L->post_attn_norm, L->ffn_norm, n, hp->n_embd, hp->rms_eps, f->xn);
    struct be_matmul gu[2] = {{.w = &L->w_gate, .y = f->gate}, {.w = &L->w_up, .y = f->up}};
    op->matmul(be, f->xn, hp->n_embd, n, 2, gu);
    op->glu(be, hp->ffn_act == FFN_GELU_TANH ? BE_GLU_GELU_TANH : BE_GLU_SILU, f->gate, f->up, n, hp->n_ff, f->xn);
    struct be_matmul down = {.w = &L->w_down, .y = f->tmp};
    op->matmul(be, f->xn, hp->n_ff, n, 1, &down);
    const float *next_norm = il + 1 < hp->n_layer ? f->m->layers[il + 1].attn_norm : NULL;
    op->add_norm(be, f->x, f->tmp, L->post_ffn_norm, next_norm, n, hp->n_embd, hp->rms_eps, next_norm ? f->xn : NULL);
    return 0;
}

static int check_batch(const struct forward *f, const struct fwd_batch *b) {
    const struct model_hparams *hp = &f->m->hp;
    if (b->n_tokens <= 0 || b->n_tokens > f->max_tokens)
        return kvq_error("batch of %d tokens (1..%d allowed)", b->n_tokens, f->max_tokens);
    if (b->n_logits < 0 || b->n_logits > b->n_tokens || b->n_logits > f->max_logits)
        return kvq_error("invalid number of logit rows");
    if (b->draws && (!f->logits || !f->be->ops->draw || hp->n_vocab < BE_TOP_MAX))
        return kvq_error("logits settled where they are, by a backend that cannot");
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
    for (int i = 0; b->draws && i < b->n_logits; i++) { /* the device writes where these say */
        const struct be_draw *d = &b->draws[i];
        if (d->row < BE_ROW_LOGITS || d->row > BE_ROW_CUT ||
            ((d->row == BE_ROW_DRAW || d->row == BE_ROW_CUT) && hp->n_vocab > BE_DRAW_MAX_COLS) ||
            d->op0 < 0 || d->n_ops < 0 || d->n_ops > b->n_draw_ops - d->op0)
            return kvq_error("invalid draw for logit row %d", i);
        for (int j = d->op0; j < d->op0 + d->n_ops; j++)
            if (b->draw_ops[j].id < 0 || b->draw_ops[j].id >= hp->n_vocab) return kvq_error("invalid logit adjustment");
    }
    return 0;
}

/* Keeps the sequences consistent after a failure: drops what layers [0, n_layers)
 * appended in this batch. */
static void undo_appends(struct forward *f, const struct fwd_batch *b, int n_layers) {
    for (int s = 0; s < b->n_seqs; s++)
        for (int j = 0; j < n_layers; j++) {
            struct kv_cache *c = b->seqs[s].caches[j];
            kv_cache_trim(c, kv_cache_n_past(c) - f->pos[b->seqs[s].first]);
        }
}

int forward_run(struct forward *f, const struct fwd_batch *b, float *logits) {
    const struct backend_ops *op = f->be->ops;
    struct backend *be = f->be;
    const struct model_hparams *hp = &f->m->hp;
    if (check_batch(f, b) != 0) return -1;
    int n = b->n_tokens;
    for (int s = 0; s < b->n_seqs; s++) {
        int32_t p0 = kv_cache_n_past(b->seqs[s].caches[0]);
        for (int i = 0; i < b->seqs[s].n; i++) f->pos[b->seqs[s].first + i] = p0 + i;
    }
    op->embed(be, &f->m->tok_embd, b->tokens, n, hp->embd_scale, f->x);
    for (int set = 0; set < f->m->n_rope_sets; set++) { /* Gemma: local and global RoPE */
        size_t table = (size_t)set * f->max_tokens * f->half_rope;
        op->rope_table(be, f->pos, n, f->m->rope_inv_freq + (size_t)set * f->half_rope,
                       f->m->rope_linear_factor[set], f->half_rope, f->rope_cos + table, f->rope_sin + table);
    }
    for (int il = 0; il < hp->n_layer; il++) {
        if (run_layer(f, b, il) != 0) {
            undo_appends(f, b, il + 1);
            return -1;
        }
    }
    if (b->n_logits > 0 && b->hidden) {
        op->rmsnorm(be, f->x, b->logit_rows, f->m->output_norm, b->n_logits, hp->n_embd, hp->rms_eps, b->hidden);
    } else if (b->n_logits > 0) {
        op->rmsnorm(be, f->x, b->logit_rows, f->m->output_norm, b->n_logits, hp->n_embd, hp->rms_eps, f->xn);
        struct be_matmul out = {.w = &f->m->output,
                                .y = f->logits ? f->logits : logits,
                                .host_y = f->logits && !b->draws ? logits : NULL,
                                .logits = true};
        op->matmul(be, f->xn, hp->n_embd, b->n_logits, 1, &out);
        if (b->draws)
            op->draw(be, f->logits, b->n_logits, hp->n_vocab, b->draws, b->draw_ops, b->n_draw_ops, b->draw_out);
    }
    if (op->sync(be) != 0) {
        undo_appends(f, b, hp->n_layer);
        return -1;
    }
    return 0;
}

void forward_read_logits(struct forward *f, int row, float *dst) {
    const int n_vocab = f->m->hp.n_vocab;
    f->be->ops->read(f->be, dst, f->logits + (size_t)row * n_vocab, sizeof(float) * (size_t)n_vocab);
}
