/* What a query sees and the attention over it. A query at q reads, in this order:
 * the packed rows of the visible positions, block by block (at most two ranges: the
 * rotating cache's kept first tokens and the window before q), then the sink rows
 * (f16) and the residual window's f16 rows of positions (q - R, q]. */
#include <assert.h>
#include <math.h>
#include <stdint.h>

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
        assert(!blk || blk->stale_lo == blk->stale_hi); /* a device's rows are attended there */
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

/* Positions [a, b] of kv_head's packed rows, whole blocks from `from` to `to` (either
 * end clipped to [a, b]). */
static void attn_part(const struct kv_cache *c, struct kern_attn_state *s, const float *qs, int kv_head, int32_t a,
                      int32_t b, int32_t from, int32_t to) {
    a = max32(a, from);
    b = min32(b, to);
    if (a <= b) attn_blocks(c, s, qs, kv_head, a, b);
}

/* Heads [h0, h0 + n) of s as a state of their own. */
static struct kern_attn_state state_view(const struct kern_attn_state *s, int h0, int n) {
    return (struct kern_attn_state){n, s->d, s->m + h0, s->l + h0, s->acc + (size_t)h0 * s->d};
}

int kv_store_attend_tokens_max(const struct kv_shape *shape) {
    const int group = shape->n_heads / shape->n_kv_heads;
    return group >= KERN_KVQ_ATTN_HEADS ? 1 : KERN_KVQ_ATTN_HEADS / group;
}

/* Tokens at consecutive positions (a prompt chunk) see mostly the same packed rows:
 * the whole blocks every one of them sees are read once for all, their query heads
 * side by side in one state (the kernels score up to KERN_KVQ_ATTN_HEADS heads a row at
 * once: a row's codes are loaded and unpacked once for them). What else a token sees
 * is read for it alone, each token's rows in the order one token alone reads them,
 * in the same runs (a run never crosses a block), so every token's result is what
 * attending alone gives. */
void kv_store_attend(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out, int32_t q_pos,
                     int n, float scale, float *scratch) {
    const struct kv_store *st = store_of(c);
    const int D = c->shape.head_dim, group = c->shape.n_heads / c->shape.n_kv_heads, nq = n * group;
    assert(n >= 1 && n <= kv_store_attend_tokens_max(&c->shape));
    float *qs = scratch, *state = qs + (size_t)nq * D, *pm = state + kern_attn_state_floats(nq, D), *pl = pm + nq;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < group * D; i++) qs[(size_t)t * group * D + i] = q[t][i] * scale;
    if (st->kf.rot)
        for (int h = 0; h < nq; h++) kern_kvq_hadamard(qs + (size_t)h * D, D, st->signs);
    struct kern_attn_state all;
    kern_attn_state_init(&all, nq, D, state);
    struct kv_query_plan plan[KERN_KVQ_ATTN_HEADS];
    int32_t lo = INT32_MIN, hi = INT32_MAX; /* the rows every token sees */
    for (int t = 0; t < n; t++) {
        kv_cache_query_plan(c, q_pos + t, &plan[t]);
        lo = max32(lo, plan[t].a2);
        hi = min32(hi, plan[t].b2);
    }
    const int32_t B = KV_BLOCK_TOKENS;
    lo = (lo + B - 1) / B * B; /* whole blocks */
    hi = (hi + 1) / B * B - 1;
    if (n == 1 || lo > hi) lo = INT32_MAX, hi = INT32_MAX - 1; /* none shared: all before it, alone */
    for (int t = 0; t < n; t++) { /* the kept first tokens, then the rows before the shared ones */
        struct kern_attn_state s = state_view(&all, t * group, group);
        const float *qt = qs + (size_t)t * group * D;
        if (plan[t].a1 <= plan[t].b1) attn_blocks(c, &s, qt, kv_head, plan[t].a1, plan[t].b1);
        attn_part(c, &s, qt, kv_head, plan[t].a2, plan[t].b2, INT32_MIN, lo - 1);
    }
    if (lo <= hi) attn_blocks(c, &all, qs, kv_head, lo, hi);
    /* The packed keys lack the key offset: their scores are short of q.mu, the same
     * for all of them, so adding it to the running max makes them comparable with
     * the f16 rows (which carry no offset). The packed values lack the value offset:
     * it comes back weighted by the packed rows' share of the softmax mass. */
    const float *kmu = kv_side_mu(st, &st->kf, 0, kv_head, D, c->shape.n_kv_heads);
    const float *vmu = kv_side_mu(st, &st->vf, 1, kv_head, D, c->shape.n_kv_heads);
    for (int t = 0; t < n; t++) {
        struct kern_attn_state s = state_view(&all, t * group, group);
        const float *qt = qs + (size_t)t * group * D;
        const int32_t p = q_pos + t, sn = plan[t].sinks, ws = plan[t].ws;
        attn_part(c, &s, qt, kv_head, plan[t].a2, plan[t].b2, hi + 1, INT32_MAX);
        for (int h = 0; h < group; h++) {
            if (kmu && s.l[h] > 0) {
                float dot = 0;
                for (int i = 0; i < D; i++) dot += q[t][(size_t)h * D + i] * kmu[i];
                s.m[h] += dot * scale;
            }
            pm[t * group + h] = s.m[h];
            pl[t * group + h] = s.l[h];
        }
        if (sn > 0) win_attn(c, &s, qt, kv_head, st->sink, 0, sn - 1, p);
        if (ws <= p) win_attn(c, &s, qt, kv_head, st->rec, ws, p, p);
        float *o = out[t];
        kern_attn_finish(&s, o);
        if (st->vf.rot)
            for (int h = 0; h < group; h++) kern_kvq_hadamard_inv(o + (size_t)h * D, D, st->signs);
        if (vmu)
            for (int h = 0; h < group; h++) {
                const float m0 = pm[t * group + h], l0 = pl[t * group + h];
                if (!(l0 > 0) || !(s.l[h] > 0)) continue;
                float share = l0 * expf(m0 - s.m[h]) / s.l[h];
                for (int i = 0; i < D; i++) o[(size_t)h * D + i] += share * vmu[i];
            }
    }
}
