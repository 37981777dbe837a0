/* What a query sees and the attention over it. A query at q reads, in this order:
 * the packed rows of the visible positions, block by block (at most two ranges: the
 * rotating cache's kept first tokens and the window before q), then the sink rows
 * (f16) and the residual window's f16 rows of positions (q - R, q]. The packed rows go
 * in parts of KV_ATTEND_PART positions, each part's online softmax merged into the
 * query's in order: a backend may attend the parts of a long context on several
 * threads (kv_cache_attend_part, kv_cache_attend_merge) and get the same bits. */
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* What every part of a group's attention needs: the queries scaled (and rotated as the
 * keys are), each token's plan, and the whole blocks every token sees [lo, hi]. */
struct attend_setup {
    int group, nq;
    struct kv_query_plan plan[KERN_KVQ_ATTN_HEADS];
    int32_t lo, hi;
    int32_t first, last; /* the parts with packed rows */
};

/* The tokens' plans, the shared blocks and the parts with packed rows. */
static void attend_plan(const struct kv_cache *c, int32_t q_pos, int n, struct attend_setup *a) {
    assert(n >= 1 && n <= kv_store_attend_tokens_max(&c->shape));
    a->group = c->shape.n_heads / c->shape.n_kv_heads;
    a->nq = n * a->group;
    int32_t lo = INT32_MIN, hi = INT32_MAX, p0 = INT32_MAX, p1 = -1; /* the rows every token sees; all rows */
    for (int t = 0; t < n; t++) {
        const struct kv_query_plan *pt = &a->plan[t];
        kv_cache_query_plan(c, q_pos + t, &a->plan[t]);
        lo = max32(lo, pt->a2);
        hi = min32(hi, pt->b2);
        if (pt->a1 <= pt->b1) p0 = min32(p0, pt->a1), p1 = max32(p1, pt->b1);
        if (pt->a2 <= pt->b2) p0 = min32(p0, pt->a2), p1 = max32(p1, pt->b2);
    }
    const int32_t B = KV_BLOCK_TOKENS;
    lo = (lo + B - 1) / B * B; /* whole blocks */
    hi = (hi + 1) / B * B - 1;
    if (n == 1 || lo > hi) lo = INT32_MAX, hi = INT32_MAX - 1; /* none shared: all before it, alone */
    a->lo = lo, a->hi = hi;
    a->first = p0 <= p1 ? p0 / KV_ATTEND_PART : 0;
    a->last = p0 <= p1 ? p1 / KV_ATTEND_PART : -1;
}

/* The plan, and the queries scaled (and rotated as the keys are) into qs. */
static void attend_setup(const struct kv_cache *c, const float *const *q, int32_t q_pos, int n, float scale, float *qs,
                         struct attend_setup *a) {
    const struct kv_store *st = store_of(c);
    const int D = c->shape.head_dim;
    attend_plan(c, q_pos, n, a);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < a->group * D; i++) qs[(size_t)t * a->group * D + i] = q[t][i] * scale;
    if (st->kf.rot)
        for (int h = 0; h < a->nq; h++) kern_kvq_hadamard(qs + (size_t)h * D, D, st->signs);
}

/* Part i's packed rows (positions [i P, i P + P), P = KV_ATTEND_PART) into the state s
 * of all the group's heads (made here over mem): for each token the kept first tokens,
 * then the rows before the shared ones; the shared ones for all; then each token's
 * after them: the order one token alone reads them in, within the part. */
static void attend_part(const struct kv_cache *c, int kv_head, const float *qs, const struct attend_setup *a, int n,
                        int32_t i, float *mem, struct kern_attn_state *s) {
    const int D = c->shape.head_dim;
    const int32_t pl = i * KV_ATTEND_PART, ph = pl + KV_ATTEND_PART - 1;
    kern_attn_state_init(s, a->nq, D, mem);
    for (int t = 0; t < n; t++) {
        struct kern_attn_state st = state_view(s, t * a->group, a->group);
        const float *qt = qs + (size_t)t * a->group * D;
        const struct kv_query_plan *pt = &a->plan[t];
        attn_part(c, &st, qt, kv_head, pt->a1, pt->b1, pl, ph);
        attn_part(c, &st, qt, kv_head, pt->a2, pt->b2, pl, min32(ph, a->lo - 1));
    }
    attn_part(c, s, qs, kv_head, a->lo, a->hi, pl, ph);
    for (int t = 0; t < n; t++) {
        struct kern_attn_state st = state_view(s, t * a->group, a->group);
        attn_part(c, &st, qs + (size_t)t * a->group * D, kv_head, a->plan[t].a2, a->plan[t].b2, max32(pl, a->hi + 1),
                  ph);
    }
}

/* s takes p's rows: the online softmax of both (p after s's rows). A state with no
 * row visible (l 0) changes nothing; into an empty one, p is copied as it is. */
static void state_merge(struct kern_attn_state *s, const struct kern_attn_state *p) {
    const int D = s->d;
    for (int h = 0; h < s->n_q; h++) {
        float *a = s->acc + (size_t)h * D;
        const float *b = p->acc + (size_t)h * D;
        if (!(p->l[h] > 0)) continue;
        if (!(s->l[h] > 0)) {
            s->m[h] = p->m[h], s->l[h] = p->l[h];
            memcpy(a, b, sizeof(float) * (size_t)D);
            continue;
        }
        const float m = fmaxf(s->m[h], p->m[h]), fa = expf(s->m[h] - m), fb = expf(p->m[h] - m);
        s->l[h] = s->l[h] * fa + p->l[h] * fb;
        for (int k = 0; k < D; k++) a[k] = a[k] * fa + b[k] * fb;
        s->m[h] = m;
    }
}

int kv_cache_attend_parts(const struct kv_cache *c, int32_t q_pos, int n) {
    struct attend_setup a;
    attend_plan(c, q_pos, n, &a);
    return a.last - a.first + 1;
}

size_t kv_cache_attend_part_floats(const struct kv_shape *shape) {
    return kern_attn_state_floats(shape->n_heads / shape->n_kv_heads * kv_store_attend_tokens_max(shape),
                                  shape->head_dim);
}

void kv_cache_attend_part(const struct kv_cache *c, int kv_head, const float *const *q, int32_t q_pos, int n,
                          float scale, int i, float *part, float *scratch) {
    struct attend_setup a;
    attend_setup(c, q, q_pos, n, scale, scratch, &a);
    struct kern_attn_state s;
    attend_part(c, kv_head, scratch, &a, n, a.first + i, part, &s);
}

/* The packed rows in parts, each merged into the tokens' states in order, then the
 * rest: the offsets' corrections, the sink and f16 window rows. parts: NULL, or each
 * part's state as kv_cache_attend_part made it (kv_cache_attend_part_floats apart). */
static void attend(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out, int32_t q_pos,
                   int n, float scale, const float *parts, float *scratch) {
    const struct kv_store *st = store_of(c);
    const int D = c->shape.head_dim;
    struct attend_setup a;
    float *qs = scratch;
    attend_setup(c, q, q_pos, n, scale, qs, &a);
    const int group = a.group, nq = a.nq;
    float *state = qs + (size_t)nq * D, *part = state + kern_attn_state_floats(nq, D);
    float *pm = part + kern_attn_state_floats(nq, D), *pl = pm + nq;
    const size_t stride = kv_cache_attend_part_floats(&c->shape);
    struct kern_attn_state all, ps;
    kern_attn_state_init(&all, nq, D, state);
    for (int32_t i = a.first; i <= a.last; i++) {
        if (parts) {
            float *m = (float *)parts + (size_t)(i - a.first) * stride;
            ps = (struct kern_attn_state){nq, D, m, m + nq, m + 2 * nq};
        } else {
            attend_part(c, kv_head, qs, &a, n, i, part, &ps);
        }
        state_merge(&all, &ps);
    }
    /* The packed keys lack the key offset: their scores are short of q.mu, the same
     * for all of them, so adding it to the running max makes them comparable with
     * the f16 rows (which carry no offset). The packed values lack the value offset:
     * it comes back weighted by the packed rows' share of the softmax mass. */
    const float *kmu = kv_side_mu(st, &st->kf, 0, kv_head, D, c->shape.n_kv_heads);
    const float *vmu = kv_side_mu(st, &st->vf, 1, kv_head, D, c->shape.n_kv_heads);
    for (int t = 0; t < n; t++) {
        struct kern_attn_state s = state_view(&all, t * group, group);
        const float *qt = qs + (size_t)t * group * D;
        const int32_t p = q_pos + t, sn = a.plan[t].sinks, ws = a.plan[t].ws;
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

void kv_store_attend(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out, int32_t q_pos,
                     int n, float scale, float *scratch) {
    attend(c, kv_head, q, out, q_pos, n, scale, NULL, scratch);
}

void kv_cache_attend_merge(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out,
                           int32_t q_pos, int n, float scale, const float *parts, float *scratch) {
    attend(c, kv_head, q, out, q_pos, n, scale, parts, scratch);
}
