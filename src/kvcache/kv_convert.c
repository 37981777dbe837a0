/* Formats and offsets of a cache's rows: the one conversion step (kv_convert) that
 * re-encodes a cache's blocks and windows into other row formats, which
 * quantize-after-N (kv_store_to_quantized) and held prefixes of another format
 * (kv_cache_convert) go through, and the per-channel key/value offsets chosen at T
 * tokens from the residual window (kv_offsets_from_window, or in parts when a device
 * wrote the rows: kv_cache_append_end). */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

#define B KV_BLOCK_TOKENS

/* ---- format conversion ---- */

/* With R > 0, the offsets are the means of positions 1..T-1, chosen when the sequence
 * reaches T = max(R + 1, MU_TOKENS) tokens; until then every row stays in the window and
 * queries before T read f16 rows only (0: no offsets). */
#define MU_TOKENS 128 /* kv-quality, K4/V4 R 32: 0.00259 at 64, 0.00246 at 128, 0.00249 at 256 */
static int32_t config_mu_tokens(const struct kv_cache_config *cfg) {
    const int32_t R = cfg->residual, M = cfg->max_size;
    int32_t T = M > 0 && M < MU_TOKENS ? M : MU_TOKENS; /* a rotating cache stays bounded */
    return R <= 0 ? 0 : R + 1 > T ? R + 1 : T;
}

int32_t mu_tokens(const struct kv_cache *c) { return config_mu_tokens(&c->cfg); }

int32_t kv_cache_config_offsets_tokens(const struct kv_cache_config *cfg) {
    return kern_kvq_bits_quantized(cfg->k_bits) || kern_kvq_bits_quantized(cfg->v_bits) ? config_mu_tokens(cfg) : 0;
}

/* The offsets from n tokens of keys and values ([n][H][D] each; the first at position
 * 0, left out: an attention sink, unlike the others). */
static void set_mu(struct kv_cache *c, const float *k, const float *v, size_t tok_stride, int n) {
    struct kv_store *st = store_of(c);
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    memset(st->mu, 0, sizeof(float) * 2 * (size_t)H * D);
    for (int w = 0; w < 2; w++) {
        const float *x = w ? v : k;
        float *mu = st->mu + (size_t)w * H * D;
        for (int t = 1; t < n; t++)
            for (int i = 0; i < H * D; i++) mu[i] += x[(size_t)t * tok_stride + i] / (float)(n - 1);
    }
    st->mu_set = true;
}

/* Decodes position p of every head into k, v ([H][D]) with the cache's formats. */
static void decode_pos(const struct kv_cache *c, int32_t p, float *k, float *v) {
    const struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    const struct kv_block *b = kv_store_block(st, p);
    for (int h = 0; h < H; h++) {
        kv_decode_row(st, &st->kf, D, kv_block_row(c, b, 0, h, p), kv_side_mu(st, &st->kf, 0, h, D, H), k + (size_t)h * D);
        kv_decode_row(st, &st->vf, D, kv_block_row(c, b, 1, h, p), kv_side_mu(st, &st->vf, 1, h, D, H), v + (size_t)h * D);
    }
}

/* The one step that changes a cache's formats: every held block is re-encoded into new
 * blocks of formats nkf/nvf; the windows take the f16 rows of the sinks and of the
 * last R positions; the offsets are chosen on the way when the cache holds their
 * positions. All or nothing: on failure the cache is as it was. */
int kv_convert(struct kv_cache *c, struct kv_fmt nkf, struct kv_fmt nvf) {
    struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    const int32_t np = c->n_past, T = mu_tokens(c), S = kv_sink_target(c), R = c->cfg.residual;
    const size_t tok = (size_t)H * D;
    struct kv_block **nt = calloc((size_t)(st->n_blk ? st->n_blk : 1), sizeof *nt);
    int32_t nx = T > B ? T : B;
    float *x = malloc(sizeof(float) * (size_t)nx * tok * 2);
    if (!nt || !x) {
        free(nt);
        free(x);
        return kvq_error_code(KVQ_ERR_OOM, "out of memory converting the KV cache");
    }
    float *xv = x + (size_t)nx * tok;
    if (kv_store_fetch(c, 0, np) != 0) {
        free(nt);
        free(x);
        return -1;
    }
    /* offsets (R > 0) from positions 1..T-1 when the cache holds them, else chosen later */
    bool new_mu = !st->mu_set && T > 0 && np >= T && c->cfg.max_size == 0 && kern_kvq_bits_quantized(nkf.bits | nvf.bits);
    if (new_mu)
        for (int32_t p = 0; p < T; p++) decode_pos(c, p, x + (size_t)p * tok, xv + (size_t)p * tok);
    /* the windows, decoded before the old blocks go */
    struct kv_fmt okf = st->kf, ovf = st->vf;
    struct kv_win *sink = kv_win_new(st->pool), *rec = kv_win_new(st->pool);
    bool win = kern_kvq_bits_quantized(nkf.bits) || kern_kvq_bits_quantized(nvf.bits);
    int rc = sink && rec ? 0 : -1;
    if (rc == 0 && win) {
        struct kv_win *keep_sink = st->sink, *keep_rec = st->rec;
        st->sink = sink;
        st->rec = rec;
        float k1[KERN_KVQ_MAX_DIM * 8], v1[KERN_KVQ_MAX_DIM * 8];
        float *kb = tok <= KERN_KVQ_MAX_DIM * 8 ? k1 : malloc(sizeof(float) * tok * 2), *vb = kb == k1 ? v1 : kb + tok;
        if (!kb) rc = kvq_error_code(KVQ_ERR_OOM, "out of memory converting the KV cache");
        if (rc == 0 && S > 0 && kv_win_reserve(c, &st->sink, S) != 0) rc = -1;
        for (int32_t p = 0; rc == 0 && p < S && p < np && kv_store_block(st, p); p++) {
            decode_pos(c, p, kb, vb);
            kv_win_put(c, st->sink, kb, vb);
        }
        st->rec->p0 = np - R > 0 ? np - R : 0;
        if (rc == 0 && R > 0 && kv_win_reserve(c, &st->rec, R) != 0) rc = -1;
        for (int32_t p = st->rec->p0; rc == 0 && R > 0 && p < np; p++) {
            if (!kv_held(c, p)) { /* keep the window contiguous */
                st->rec->n = 0;
                st->rec->p0 = p + 1;
                continue;
            }
            decode_pos(c, p, kb, vb);
            kv_win_put(c, st->rec, kb, vb);
        }
        if (kb != k1) free(kb);
        sink = st->sink;
        rec = st->rec;
        st->sink = keep_sink;
        st->rec = keep_rec;
    }
    if (rc == 0 && new_mu) set_mu(c, x, xv, tok, T);
    /* every block into the new formats */
    size_t nbytes = kv_block_size(c, &nkf, &nvf);
    for (int32_t i = 0; rc == 0 && i < st->n_blk; i++) {
        if (!st->blk[i]) continue;
        int32_t L = i < st->nkb ? i : i + st->base, p0 = L * B, n = np - p0 < B ? np - p0 : B;
        for (int32_t j = 0; j < n; j++) {
            st->kf = okf;
            st->vf = ovf;
            bool had = st->mu_set;
            st->mu_set = st->mu_set && !new_mu; /* old rows carry no offsets */
            decode_pos(c, p0 + j, x + (size_t)j * tok, xv + (size_t)j * tok);
            st->mu_set = had;
        }
        if (!(nt[i] = kv_block_new(st->pool, nbytes))) {
            rc = -1;
            break;
        }
        st->kf = nkf;
        st->vf = nvf;
        for (int32_t j = 0; j < n; j++) {
            const struct kv_block *save = st->blk[i];
            st->blk[i] = nt[i];
            kv_store_write_row(c, p0 + j, x + (size_t)j * tok, xv + (size_t)j * tok);
            st->blk[i] = (struct kv_block *)save;
        }
    }
    if (rc != 0) { /* leave the cache as it was */
        st->kf = okf;
        st->vf = ovf;
        if (new_mu) st->mu_set = false;
        for (int32_t i = 0; i < st->n_blk; i++) kv_block_unref(st->pool, nt[i]);
        kv_win_unref(sink);
        kv_win_unref(rec);
    } else {
        for (int32_t i = 0; i < st->n_blk; i++) {
            kv_block_unref(st->pool, st->blk[i]);
            st->blk[i] = nt[i];
        }
        st->kf = nkf;
        st->vf = nvf;
        kv_win_unref(st->sink);
        kv_win_unref(st->rec);
        st->sink = sink;
        st->rec = rec;
    }
    free(nt);
    free(x);
    return rc;
}

int kv_store_to_quantized(struct kv_cache *c) {
    struct kv_store *st = store_of(c);
    struct kv_fmt tk = kv_fmt_target(c, 0), tv = kv_fmt_target(c, 1);
    if (kv_fmt_eq(st->kf, tk) && kv_fmt_eq(st->vf, tv)) return 0;
    c->epoch++; /* new windows */
    return kv_convert(c, tk, tv);
}

int kv_cache_convert(struct kv_cache *dst, const struct kv_cache *src) {
    if (dst == src) return 0;
    const struct kv_shape *a = &dst->shape, *b = &src->shape;
    if (a->n_heads != b->n_heads || a->n_kv_heads != b->n_kv_heads || a->head_dim != b->head_dim ||
        a->window != b->window || dst->cfg.max_size != src->cfg.max_size || dst->cfg.keep != src->cfg.keep)
        return kvq_error("a KV cache converts only to another format of the same shape and window");
    if (kv_store_fork(dst, src) != 0) return -1; /* shares every block and window for now */
    struct kv_store *st = store_of(dst);
    /* what an appending sequence of this length holds: quantize-after-N is float until N */
    bool initial = dst->cfg.quantized_start > 0 && dst->n_past <= dst->cfg.quantized_start;
    struct kv_fmt tk = initial ? kv_fmt_initial(dst, 0) : kv_fmt_target(dst, 0);
    struct kv_fmt tv = initial ? kv_fmt_initial(dst, 1) : kv_fmt_target(dst, 1);
    if (kv_fmt_eq(st->kf, tk) && kv_fmt_eq(st->vf, tv)) return 0;
    if (kv_convert(dst, tk, tv) != 0) {
        kv_store_clear(dst);
        return -1;
    }
    if (!kv_win_on(st)) { /* float rows need no windows: drop the ones shared with src */
        struct kv_win *ws[2] = {kv_win_new(st->pool), kv_win_new(st->pool)};
        if (!ws[0] || !ws[1]) {
            kv_win_unref(ws[0]);
            kv_win_unref(ws[1]);
            kv_store_clear(dst);
            return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        }
        kv_win_unref(st->sink);
        kv_win_unref(st->rec);
        st->sink = ws[0];
        st->rec = ws[1];
    }
    return 0;
}

/* ---- value offsets ---- */

/* The offsets come from the residual window's f16 rows of positions 1..T-1 (it holds
 * every position so far), and the packed rows of positions 0..T-1 are then encoded
 * again with them from those f16 rows. (Window rows never carry the offsets.) In two
 * steps, so that a backend can spread the second over threads: offsets_choose makes
 * the blocks private and marks the rows changed; each of its 2 H parts (a side and a
 * head, kv_cache_offsets_part) then sets its offsets and writes its rows, touching
 * nothing another part reads or writes. Returns the parts, 0 when the window does not
 * have the expected shape (e.g. after a trim: no offsets), -1 on error. */
static int offsets_choose(struct kv_cache *c) {
    struct kv_store *st = store_of(c);
    const int32_t T = mu_tokens(c);
    const struct kv_win *w = st->rec;
    if (w->p0 != 0 || w->n < T) return 0;
    for (int32_t L = 0; L <= (T - 1) / B; L++) {
        if (kv_store_block_private(c, L) != 0 || kv_store_fetch(c, L * B, L * B + 1) != 0) return -1;
        struct kv_block *b = kv_store_block(st, L * B);
        if (b) kv_block_touch(st->pool, b, 0, T - L * B < B ? T - L * B : B);
    }
    st->mu_set = true; /* each part sets its own offsets before it reads them (the
                        * windows stay as they are: a device copies the offsets alone) */
    return 2 * c->shape.n_kv_heads;
}

int32_t kv_offsets_claim(struct kv_cache *c, int n) {
    const struct kv_store *st = store_of(c);
    const int32_t T = mu_tokens(c), p = c->n_past;
    const struct kv_win *w = st->rec;
    if (st->mu_set || !kv_win_on(st) || T <= 0 || p >= T || p + n < T || (p > 0 && (w->p0 != 0 || w->n != p)))
        return 0; /* not reached, chosen, or the window lacks rows (after a trim: none then) */
    for (int32_t L = 0; L * B < p; L++) /* the append's own blocks are made private by its begin */
        if (kv_store_block_private(c, L) != 0) return -1;
    return T;
}

void kv_cache_offsets_given(struct kv_cache *c, const float *mu) {
    struct kv_store *st = store_of(c);
    memcpy(st->mu, mu, sizeof(float) * 2 * (size_t)c->shape.n_kv_heads * (size_t)c->shape.head_dim);
    st->mu_set = true;
    for (int32_t p = 0; p < mu_tokens(c) && p < c->n_past; p += B) /* the device encoded them again */
        kv_block_device_wrote(st->pool, kv_store_block(st, p), 0, B);
}

void kv_cache_offsets_part(struct kv_cache *c, int part) {
    struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim, side = part / H, h = part % H;
    const int32_t T = mu_tokens(c);
    const struct kv_win *w = st->rec;
    const struct kv_fmt *wf = side ? &st->wvf : &st->wkf, *pf = side ? &st->vf : &st->kf;
    float *mu = st->mu + ((size_t)side * H + h) * D, x[KERN_KVQ_MAX_DIM], rot_mu[KERN_KVQ_MAX_DIM] = {0};
    /* The window rows are rotated as the packed rows are (wf->rot == pf->rot), and the
     * rotation is linear: the offsets' rotation is the mean of the rotated rows, and a
     * row's packed form, the rotation of (row - offsets), is the window row less it. No
     * rotation per row, either way (it was most of this work, which every prompt does
     * for every layer). */
    assert(wf->rot == pf->rot);
    for (int32_t p = 1; p < T; p++) {
        kern_kvq_dequantize_row(kv_win_row(w, wf, side, h, p), D, wf->bits, wf->group, x);
        for (int i = 0; i < D; i++) rot_mu[i] += x[i] / (float)(T - 1);
    }
    memcpy(mu, rot_mu, sizeof(float) * (size_t)D);
    if (wf->rot) kern_kvq_hadamard_inv(mu, D, st->signs);
    if (!kv_side_mu(st, pf, side, h, D, H)) return; /* a float side: its rows stay as they are */
    for (int32_t p = 0; p < T; p++) {
        struct kv_block *b = kv_store_block(st, p);
        if (!b) continue;
        kern_kvq_dequantize_row(kv_win_row(w, wf, side, h, p), D, wf->bits, wf->group, x);
        for (int i = 0; i < D; i++) x[i] -= rot_mu[i];
        kern_kvq_quantize_row(x, D, pf->bits, pf->group, kv_block_row(c, b, side, h, p));
    }
}

int kv_offsets_from_window(struct kv_cache *c) {
    const int parts = offsets_choose(c);
    for (int i = 0; i < parts; i++) kv_cache_offsets_part(c, i);
    return parts < 0 ? -1 : 0;
}

int32_t kv_cache_offsets_point(const struct kv_cache *c) {
    const struct kv_store *st = store_of((struct kv_cache *)c);
    const int32_t T = mu_tokens(c);
    return !st->mu_set && kv_win_on(st) && T > c->n_past ? T : 0;
}

int kv_cache_append_end(struct kv_cache *c, int32_t p0, int n) {
    struct kv_store *st = store_of(c);
    st->batch_view = false;
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    if (p0 < 0 || n <= 0 || p0 + n > c->n_past) return 0; /* trimmed since: nothing to keep */
    const bool win = kv_win_on(st);
    /* The offsets are chosen at T tokens (the device encoded without them): the rows
     * before T are encoded again with them by the caller (the parts), the rows from T
     * on here, from their f16 window rows. */
    const int32_t T = mu_tokens(c);
    int parts = 0;
    if (!st->mu_set && win && T > 0 && p0 < T && p0 + n >= T) {
        if (p0 + n > T) { /* rows past T need the offsets now (devices end a pass at T) */
            if (kv_offsets_from_window(c) != 0) return -1;
        } else if ((parts = offsets_choose(c)) < 0) {
            return -1;
        }
        float x[KERN_KVQ_MAX_DIM];
        if (st->mu_set && kv_store_fetch(c, T, p0 + n) != 0) return -1;
        for (int32_t p = T; st->mu_set && p < p0 + n; p++) {
            struct kv_block *b = kv_store_block(st, p);
            if (!b || p < st->rec->p0 || p >= st->rec->p0 + st->rec->n) continue;
            kv_block_touch(st->pool, b, p % B, p % B + 1);
            for (int side = 0; side < 2; side++) {
                const struct kv_fmt *wf = side ? &st->wvf : &st->wkf, *pf = side ? &st->vf : &st->kf;
                for (int h = 0; h < H; h++) {
                    kv_decode_row(st, wf, D, kv_win_row(st->rec, wf, side, h, p - st->rec->p0), NULL, x);
                    kv_encode_row(st, pf, D, x, kv_side_mu(st, pf, side, h, D, H), kv_block_row(c, b, side, h, p));
                }
            }
        }
    }
    return parts;
}
