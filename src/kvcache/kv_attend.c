/* What a query sees and the attention over it. A query at q reads, in this order:
 * the packed rows of the visible positions, block by block (at most two ranges: the
 * rotating cache's kept first tokens and the window before q), then the sink rows
 * (f16) and the residual window's f16 rows of positions (q - R, q]. */
#include <math.h>

#include "kernels/attention.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

static void attn_rows(const struct kv_cache *c, struct kern_attn_state *s, const float *qs, const uint8_t *kb,
                      const struct kv_fmt *kf, const uint8_t *vb, const struct kv_fmt *vf, int32_t n) {
    if (kf->bits == vf->bits && !kern_kvq_bits_quantized(kf->bits)) {
        kern_attn_accumulate(s, qs, kb, (size_t)c->shape.head_dim, vb, (size_t)c->shape.head_dim, kf->bits, n);
        return;
    }
    struct kern_kv_rows kr = {kb, kf->row, kf->bits, kf->group};
    struct kern_kv_rows vr = {vb, vf->row, vf->bits, vf->group};
    kern_kvq_attn_accumulate(s, qs, &kr, &vr, n);
}

/* Packed rows of positions [a, b]: one run per block, handed to the kernel in
 * batches so that its setup is paid once per batch, not once per block. */
#define RUNS_PER_CALL 64
static void attn_blocks(const struct kv_cache *c, struct kern_attn_state *s, const float *qs, int kv_head, int32_t a,
                        int32_t b) {
    const struct kv_store *st = store_of(c);
    const struct kern_kv_rows kf = {NULL, st->kf.row, st->kf.bits, st->kf.group};
    const struct kern_kv_rows vf = {NULL, st->vf.row, st->vf.bits, st->vf.group};
    struct kern_kv_run runs[RUNS_PER_CALL];
    int n = 0;
    for (int32_t p = a; p <= b;) {
        int32_t e = (p / KV_BLOCK_TOKENS + 1) * KV_BLOCK_TOKENS - 1;
        if (e > b) e = b;
        const struct kv_block *blk = kv_store_block(st, p);
        if (blk) {
            runs[n++] = (struct kern_kv_run){kv_block_row(c, blk, 0, kv_head, p), kv_block_row(c, blk, 1, kv_head, p),
                                             e - p + 1};
            if (n == RUNS_PER_CALL) {
                kern_kvq_attn_accumulate_runs(s, qs, &kf, &vf, runs, n);
                n = 0;
            }
        }
        p = e + 1;
    }
    if (n > 0) kern_kvq_attn_accumulate_runs(s, qs, &kf, &vf, runs, n);
}

/* Attention over the window rows of positions [a, b] that q sees, in runs. */
static void win_attn(const struct kv_cache *c, struct kern_attn_state *s, const float *qs, int kv_head,
                     const struct kv_win *w, int32_t a, int32_t b, int32_t q) {
    const struct kv_store *st = store_of(c);
    int32_t run0 = -1;
    for (int32_t p = a; p <= b + 1; p++) {
        bool vis = p <= b && kv_visible(c, p, q);
        if (vis && run0 < 0) run0 = p;
        if (!vis && run0 >= 0) {
            int32_t j = run0 - w->p0;
            attn_rows(c, s, qs, kv_win_row(w, &st->wkf, 0, kv_head, j), &st->wkf, kv_win_row(w, &st->wvf, 1, kv_head, j),
                      &st->wvf, p - run0);
            run0 = -1;
        }
    }
}

static int32_t max32(int32_t a, int32_t b) { return a > b ? a : b; }
static int32_t min32(int32_t a, int32_t b) { return a < b ? a : b; }

void kv_cache_query_plan(const struct kv_cache *c, int32_t q_pos, struct kv_query_plan *p) {
    const struct kv_store *st = store_of(c);
    const int32_t M = c->cfg.max_size, W = c->shape.window, R = c->cfg.residual;
    const bool win = kv_win_on(st);
    /* packed rows serve positions [sn, ws) */
    int32_t sn = win ? st->sink->n : 0, ws = q_pos + 1;
    if (sn > q_pos + 1) sn = q_pos + 1;
    const struct kv_win *rec = st->rec;
    if (win && R > 0 && rec->n > 0 && q_pos < rec->p0 + rec->n) {
        ws = q_pos < mu_tokens(c) ? 0 : q_pos - R + 1; /* before the offsets: all f16 */
        ws = min32(max32(max32(ws, st->batch_view ? st->batch_lo : rec->p0), sn), q_pos + 1);
    }
    const int32_t K = M > 0 ? c->cfg.keep : 0;
    const int32_t wlo = W > 0 ? q_pos - W + 1 : 0, mlo = M > 0 ? q_pos - (M - K) + 1 : 0;
    p->a1 = max32(sn, wlo);                                  /* the kept first tokens */
    p->b1 = min32(K, ws) - 1;
    p->a2 = max32(max32(max32(sn, wlo), max32(mlo, K)), 0); /* the window before q */
    p->b2 = ws - 1;
    p->sinks = sn;
    p->ws = ws;
}

void kv_store_attend(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale, float *out,
                     float *scratch) {
    const struct kv_store *st = store_of(c);
    const int D = c->shape.head_dim, group = c->shape.n_heads / c->shape.n_kv_heads;
    float *qs = scratch;
    for (int i = 0; i < group * D; i++) qs[i] = q[i] * scale;
    if (st->kf.rot)
        for (int h = 0; h < group; h++) kern_kvq_hadamard(qs + (size_t)h * D, D, st->signs);
    struct kern_attn_state s;
    kern_attn_state_init(&s, group, D, scratch + (size_t)group * D);
    struct kv_query_plan plan;
    kv_cache_query_plan(c, q_pos, &plan);
    const int32_t sn = plan.sinks, ws = plan.ws;
    if (plan.a1 <= plan.b1) attn_blocks(c, &s, qs, kv_head, plan.a1, plan.b1);
    if (plan.a2 <= plan.b2) attn_blocks(c, &s, qs, kv_head, plan.a2, plan.b2);
    /* The packed keys lack the key offset: their scores are short of q.mu, the same
     * for all of them, so adding it to the running max makes them comparable with
     * the f16 rows (which carry no offset). The packed values lack the value offset:
     * it comes back weighted by the packed rows' share of the softmax mass. */
    const float *kmu = kv_side_mu(st, &st->kf, 0, kv_head, D, c->shape.n_kv_heads);
    const float *vmu = kv_side_mu(st, &st->vf, 1, kv_head, D, c->shape.n_kv_heads);
    float *pm = scratch + (size_t)group * D * 2 + kern_attn_state_floats(group, D) + 64, *pl = pm + group;
    for (int h = 0; h < group; h++) {
        if (kmu && s.l[h] > 0) {
            float dot = 0;
            for (int i = 0; i < D; i++) dot += q[(size_t)h * D + i] * kmu[i];
            s.m[h] += dot * scale;
        }
        pm[h] = s.m[h];
        pl[h] = s.l[h];
    }
    if (sn > 0) win_attn(c, &s, qs, kv_head, st->sink, 0, sn - 1, q_pos);
    if (ws <= q_pos) win_attn(c, &s, qs, kv_head, st->rec, ws, q_pos, q_pos);
    kern_attn_finish(&s, out);
    if (st->vf.rot)
        for (int h = 0; h < group; h++) kern_kvq_hadamard_inv(out + (size_t)h * D, D, st->signs);
    if (vmu)
        for (int h = 0; h < group; h++) {
            if (!(pl[h] > 0) || !(s.l[h] > 0)) continue;
            float share = pl[h] * expf(pm[h] - s.m[h]) / s.l[h];
            for (int i = 0; i < D; i++) out[(size_t)h * D + i] += share * vmu[i];
        }
}
