/* A cache's layout as a device backend reads it (kv_cache.h, "for device backends"). */
#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

void kv_cache_view(const struct kv_cache *c, struct kv_view *v) {
    const struct kv_store *st = store_of(c);
    const int32_t R = c->cfg.residual, T = mu_tokens(c);
    *v = (struct kv_view){
        .k_bits = st->kf.bits, .k_group = st->kf.group, .v_bits = st->vf.bits, .v_group = st->vf.group,
        .k_rot = st->kf.rot, .v_rot = st->vf.rot, .k_row = st->kf.row, .v_row = st->vf.row,
        .head_bytes = (size_t)KV_BLOCK_TOKENS * (st->kf.row + st->vf.row),
        .blk = st->blk, .n_blk = st->n_blk, .nkb = st->nkb, .base = st->base,
        .windows = kv_win_on(st), .win_row = st->wkf.row,
        /* before the offsets every row is read in f16; after, the newest R */
        .win_span = R > 0 ? (T > R ? T : R) : 0,
        .sinks = kv_sink_target(c),
        .mu = st->mu_set ? st->mu : NULL,
        .signs = st->signs,
    };
}

bool kv_cache_visible(const struct kv_cache *c, int32_t p, int32_t q) { return kv_visible(c, p, q); }

const uint8_t *kv_cache_window_row(const struct kv_cache *c, int side, int h, int32_t p) {
    const struct kv_store *st = store_of(c);
    const struct kv_fmt *f = side ? &st->wvf : &st->wkf;
    if (!kv_win_on(st)) return NULL;
    if (p >= 0 && p < st->sink->n) return kv_win_row(st->sink, f, side, h, p);
    const struct kv_win *w = st->rec;
    if (p >= w->p0 && p < w->p0 + w->n) return kv_win_row(w, f, side, h, p - w->p0);
    return NULL;
}

void kv_cache_encode_rows(const struct kv_cache *c, const float *k, const float *v, uint8_t *kr, uint8_t *vr, uint8_t *wk,
                          uint8_t *wv, int part, int parts) {
    const struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    const bool win = kv_win_on(st) && c->cfg.residual > 0;
    /* row r: head r / 2's keys (r even) or values, as kv_store_write_row and kv_win_put write them */
    for (int r = 2 * H * part / parts; r < 2 * H * (part + 1) / parts; r++) {
        const int h = r / 2, side = r % 2;
        const struct kv_fmt *f = side ? &st->vf : &st->kf, *wf = side ? &st->wvf : &st->wkf;
        const float *x = (side ? v : k) + (size_t)h * D;
        kv_encode_row(st, f, D, x, kv_side_mu(st, f, side, h, D, H), (side ? vr : kr) + (size_t)h * f->row);
        if (win) kv_encode_row(st, wf, D, x, NULL, (side ? wv : wk) + (size_t)h * wf->row);
    }
}

int kv_cache_append_exact_part(const struct kv_cache *c, int n) {
    const struct kv_store *st = store_of(c);
    const int32_t T = mu_tokens(c), p = c->n_past, qs = c->cfg.quantized_start;
    if (st->mu_set || T <= 0 || p >= T || p + n <= T) return n;
    /* kv_cache_append converts to the quantized formats before the whole append: a
     * first part short of the conversion would be appended unconverted */
    const bool converts = qs > 0 && p + n > qs &&
                          !(kv_fmt_eq(st->kf, kv_fmt_target(c, 0)) && kv_fmt_eq(st->vf, kv_fmt_target(c, 1)));
    return converts && T <= qs ? 0 : (int)(T - p);
}

uint32_t kv_cache_epoch(const struct kv_cache *c) { return c->epoch; }
void **kv_cache_mirror(struct kv_cache *c) { return &c->mirror; }
