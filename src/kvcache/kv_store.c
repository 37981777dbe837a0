/* Blocks of a cache: the table, append, release, trim, fork, and the cache operations
 * built on them (see kv_store.h for the layout; format conversion and the key/value
 * offsets are kv_convert.c's). */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

#define B KV_BLOCK_TOKENS

size_t kv_block_size(const struct kv_cache *c, const struct kv_fmt *kf, const struct kv_fmt *vf) {
    return (size_t)c->shape.n_kv_heads * B * (kf->row + vf->row);
}

/* The table entry of logical block L, or NULL when it lies outside the table. */
static struct kv_block **entry_of(const struct kv_store *st, int32_t L) {
    int32_t i = L < st->nkb ? L : L - st->base;
    if (L < 0 || (L >= st->nkb && i < st->nkb) || i >= st->n_blk) return NULL;
    return &st->blk[i];
}

struct kv_block *kv_store_block(const struct kv_store *st, int32_t p) {
    struct kv_block **e = entry_of(st, p / B);
    return e ? *e : NULL;
}

/* A block is [head][keys B rows, values B rows]: attention of one KV head reads one
 * contiguous stretch per block. */
uint8_t *kv_block_row(const struct kv_cache *c, const struct kv_block *b, int side, int h, int32_t p) {
    const struct kv_store *st = store_of(c);
    uint8_t *head = b->data + (size_t)h * B * (st->kf.row + st->vf.row);
    if (!side) return head + (size_t)(p % B) * st->kf.row;
    return head + (size_t)B * st->kf.row + (size_t)(p % B) * st->vf.row;
}

bool kv_visible(const struct kv_cache *c, int32_t p, int32_t q) {
    const int32_t M = c->cfg.max_size, keep = c->cfg.keep, W = c->shape.window;
    return p <= q && (M == 0 || p < keep || p > q - (M - keep)) && (W <= 0 || p > q - W);
}

/* Whether no query at >= first can see position p. */
static bool dead_for(const struct kv_cache *c, int32_t p, int32_t first) {
    const int32_t M = c->cfg.max_size, keep = c->cfg.keep, W = c->shape.window;
    return !((M == 0 || p < keep || p > first - (M - keep)) && (W <= 0 || p > first - W));
}

/* Rows count as held while a query of the latest batch (or after it) can see them. */
bool kv_held(const struct kv_cache *c, int32_t p) {
    const struct kv_store *st = store_of(c);
    return p >= 0 && p < c->n_past && !dead_for(c, p, st->last_first) && kv_store_block(st, p) != NULL;
}

/* A block of positions [s, e] is dead when all its positions are: beyond `keep` the
 * newest decides; below it only the sliding window can kill them. */
static bool block_dead(const struct kv_cache *c, int32_t L, int32_t first) {
    const int32_t s = L * B, e = s + B - 1, K = c->cfg.max_size > 0 ? c->cfg.keep : 0;
    return dead_for(c, e, first) && (s >= K || dead_for(c, e < K - 1 ? e : K - 1, first));
}

void kv_store_release_before(struct kv_cache *c, int32_t first) {
    struct kv_store *st = store_of(c);
    if (c->cfg.max_size == 0) return; /* a sliding window alone masks but keeps every row (--swa-full) */
    for (int32_t i = 0; i < st->nkb && i < st->n_blk; i++)
        if (st->blk[i] && block_dead(c, i, first)) {
            kv_block_unref(st->pool, st->blk[i]);
            st->blk[i] = NULL;
        }
    int32_t drop = 0;
    while (st->nkb + drop < st->n_blk &&
           (!st->blk[st->nkb + drop] || block_dead(c, st->nkb + drop + st->base, first))) {
        kv_block_unref(st->pool, st->blk[st->nkb + drop]);
        drop++;
    }
    if (drop == 0) return;
    memmove(st->blk + st->nkb, st->blk + st->nkb + drop, sizeof(*st->blk) * (size_t)(st->n_blk - st->nkb - drop));
    st->n_blk -= drop;
    st->base += drop;
}

/* Unreferences every block from logical block L on (the table ends before it). */
static void release_from(struct kv_cache *c, int32_t L) {
    struct kv_store *st = store_of(c);
    for (int32_t i = 0; i < st->n_blk; i++) {
        int32_t li = i < st->nkb ? i : i + st->base;
        if (li < L) continue;
        kv_block_unref(st->pool, st->blk[i]);
        st->blk[i] = NULL;
    }
    int32_t keep_entries = L < st->nkb ? L : L - st->base;
    if (keep_entries < st->n_blk) st->n_blk = keep_entries > 0 ? keep_entries : 0;
    if (st->n_blk <= st->nkb) st->base = 0;
}

void kv_store_drop_blocks(struct kv_cache *c) {
    release_from(c, 0);
    store_of(c)->base = 0;
}

/* The table entry for logical block L, extending the table by one when L comes next. */
static struct kv_block **entry_for_write(struct kv_cache *c, int32_t L) {
    struct kv_store *st = store_of(c);
    struct kv_block **e = entry_of(st, L);
    if (e) return e;
    int32_t i = L < st->nkb ? L : L - st->base;
    if (i < st->n_blk || i < 0) return NULL; /* released: cannot write there */
    if (i >= st->cap_blk) {
        int32_t cap = st->cap_blk ? st->cap_blk * 2 : 16;
        while (cap <= i) cap *= 2;
        struct kv_block **t = realloc(st->blk, sizeof(*t) * (size_t)cap);
        if (!t) {
            kvq_error_code(KVQ_ERR_OOM, "out of memory growing a KV block table");
            return NULL;
        }
        st->blk = t;
        st->cap_blk = cap;
    }
    while (st->n_blk <= i) st->blk[st->n_blk++] = NULL;
    return &st->blk[i];
}

/* Makes the block of logical index L exist and belong to this cache alone. */
int kv_store_block_private(struct kv_cache *c, int32_t L) {
    struct kv_store *st = store_of(c);
    struct kv_block **e = entry_for_write(c, L);
    if (!e) return kvq_last_error()[0] ? -1 : kvq_error("KV block %d was released", L);
    if (*e && (*e)->refs == 1) return 0;
    size_t bytes = kv_block_size(c, &st->kf, &st->vf);
    struct kv_block *nb = kv_block_new(st->pool, bytes);
    if (!nb) return -1;
    if (*e) { /* shared: copy on write (a device mirror needs all of it; a new block's
               * rows reach the mirror as they are written) */
        const struct kv_block *old = *e;
        const struct kv_pool_mirror *m = kv_pool_get_mirror(st->pool);
        if (old->stale_lo < old->stale_hi) { /* the device's rows copied there, the host's left stale */
            m->copy(m->ctx, nb, old, bytes);
            kv_block_device_wrote(st->pool, nb, 0, B);
        } else {
            memcpy(nb->data, old->data, bytes);
            kv_block_touch(st->pool, nb, 0, B);
        }
        kv_block_unref(st->pool, *e);
    }
    *e = nb;
    return 0;
}

int kv_store_reserve_rows(struct kv_cache *c, int32_t n) {
    if (n <= 0) return 0;
    for (int32_t L = c->n_past / B; L <= (c->n_past + n - 1) / B; L++)
        if (kv_store_block_private(c, L) != 0) return -1;
    return 0;
}

int kv_store_fetch(const struct kv_cache *c, int32_t lo, int32_t hi) {
    const struct kv_store *st = store_of(c);
    if (!kv_pool_device_rows(st->pool)) return 0;
    for (int32_t L = lo > 0 ? lo / B : 0; L * B < hi;) {
        struct kv_block *b[64];
        int n = 0;
        for (; n < 64 && L * B < hi; L++) b[n++] = kv_store_block(st, L * B);
        if (kv_blocks_fetch(st->pool, b, n) != 0) return -1;
    }
    return 0;
}

void kv_store_write_row(struct kv_cache *c, int32_t p, const float *k, const float *v) {
    const struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    struct kv_block *b = kv_store_block(st, p);
    assert(b && b->refs == 1); /* copy on write: a shared block is copied before */
    kv_block_touch(st->pool, b, p % B, p % B + 1);
    for (int h = 0; h < H; h++) {
        kv_encode_row(st, &st->kf, D, k + (size_t)h * D, kv_side_mu(st, &st->kf, 0, h, D, H), kv_block_row(c, b, 0, h, p));
        kv_encode_row(st, &st->vf, D, v + (size_t)h * D, kv_side_mu(st, &st->vf, 1, h, D, H), kv_block_row(c, b, 1, h, p));
    }
}

/* Bytes of new blocks an append of n tokens may take: the blocks it writes that are
 * new or shared, and every block again when it converts the format. */
size_t kv_cache_append_bytes(const struct kv_cache *c, int n, int chunk) {
    const struct kv_store *st = store_of(c);
    if (n <= 0) return 0;
    struct kv_fmt kf = st->kf, vf = st->vf;
    size_t convert = 0;
    if (c->cfg.quantized_start > 0 && c->n_past + n > c->cfg.quantized_start) {
        kf = kv_fmt_target(c, 0);
        vf = kv_fmt_target(c, 1);
        if (!kv_fmt_eq(kf, st->kf) || !kv_fmt_eq(vf, st->vf))
            for (int32_t i = 0; i < st->n_blk; i++) convert += st->blk[i] ? kv_block_size(c, &kf, &vf) : 0;
    }
    size_t per = kv_block_size(c, &kf, &vf), n_new = 0;
    for (int32_t L = c->n_past / B; L <= (c->n_past + n - 1) / B; L++) {
        const struct kv_block *b = kv_store_block(st, L * B);
        n_new += !b || b->refs > 1;
    }
    /* the offsets re-encode the first T positions in place */
    int32_t T = mu_tokens(c);
    if (!st->mu_set && T > 0 && c->n_past < T && c->n_past + n >= T)
        for (int32_t L = 0; L <= (T - 1) / B && L < c->n_past / B; L++) {
            const struct kv_block *b = kv_store_block(st, L * B);
            n_new += b && b->refs > 1;
        }
    /* a window gives blocks back before each append of at most `chunk` tokens: the
     * cache never holds more than the window, a chunk and the kept first tokens */
    int32_t win = c->cfg.max_size;
    if (win > 0 && chunk > 0) {
        size_t cap = (size_t)((win + chunk - 1 + B - 1) / B + 1 + st->nkb), held = 0;
        for (int32_t i = 0; i < st->n_blk; i++) held += st->blk[i] != NULL;
        size_t room = cap > held ? cap - held : 0;
        const struct kv_block *last = kv_store_block(st, c->n_past / B * B);
        room += last && last->refs > 1; /* a shared block is copied, the original stays */
        if (n_new > room) n_new = room;
    }
    return convert + n_new * per;
}

/* Appends n tokens; `first` is the position of the first token of the whole batch
 * (its queries' needs decide what may be released). */
static int store_append_at(struct kv_cache *c, int n, const float *k, const float *v, int32_t first) {
    struct kv_store *st = store_of(c);
    const size_t tok = (size_t)c->shape.n_kv_heads * c->shape.head_dim;
    const int32_t T = mu_tokens(c);
    if (!st->mu_set && kv_win_on(st) && T > 0 && c->n_past < T && c->n_past + n > T) {
        /* the offsets are chosen at T tokens: the part after T is encoded with them */
        int n1 = (int)(T - c->n_past);
        if (store_append_at(c, n1, k, v, first) != 0) return -1;
        return store_append_at(c, n - n1, k + (size_t)n1 * tok, v + (size_t)n1 * tok, first);
    }
    kv_store_release_before(c, first);
    if (kv_store_reserve_rows(c, n) != 0 || kv_store_fetch(c, c->n_past, c->n_past + n) != 0 ||
        kv_windows_append(c, n, k, v, tok, first) != 0)
        return -1;
    for (int t = 0; t < n; t++) kv_store_write_row(c, c->n_past + t, k + (size_t)t * tok, v + (size_t)t * tok);
    c->n_past += n;
    st->last_first = first;
    if (!st->mu_set && kv_win_on(st) && T > 0 && c->n_past == T) return kv_offsets_from_window(c);
    return 0;
}

int kv_store_append(struct kv_cache *c, int n, const float *k, const float *v) {
    if (n <= 0) return 0;
    if (c->cfg.quantized_start > 0 && c->n_past + n > c->cfg.quantized_start && kv_store_to_quantized(c) != 0)
        return -1;
    return store_append_at(c, n, k, v, c->n_past);
}

/* ---- appends whose rows a device writes (kv_cache.h) ---- */

static int append_begin(struct kv_cache *c, int n, int32_t first, bool later_only, bool claimed) {
    struct kv_store *st = store_of(c);
    if (n <= 0) return 0;
    if (c->cfg.quantized_start > 0 && c->n_past + n > c->cfg.quantized_start && kv_store_to_quantized(c) != 0)
        return -1;
    int32_t ns, nr;
    kv_store_release_before(c, first);
    if (kv_store_reserve_rows(c, n) != 0 || kv_windows_make_room(c, n, first, later_only, claimed, &ns, &nr) != 0)
        return -1;
    for (int32_t p = c->n_past, end; p < c->n_past + n; p = end) { /* the device writes the rows */
        end = (p / B + 1) * B < c->n_past + n ? (p / B + 1) * B : c->n_past + n;
        kv_block_device_wrote(st->pool, kv_store_block(st, p), p % B, p % B + (end - p));
    }
    if (kv_win_on(st)) { /* the rows are counted now, written by kv_cache_append_end */
        if (c->cfg.residual > 0) st->rec->n += nr;
        st->sink->n += ns;
    }
    c->n_past += n;
    st->last_first = first;
    return 0;
}

int kv_cache_append_begin(struct kv_cache *c, int n, int32_t first, bool later_only) {
    return append_begin(c, n, first, later_only, false);
}

int32_t kv_cache_append_begin_claim(struct kv_cache *c, int n, int32_t first) {
    const int32_t T = n > 0 ? kv_offsets_claim(c, n) : 0;
    return T < 0 || append_begin(c, n, first, true, T > 0) != 0 ? -1 : T;
}

int32_t kv_cache_window_rows_from(const struct kv_cache *c, int32_t p0) {
    const struct kv_store *st = store_of(c);
    if (!kv_win_on(st) || p0 < st->sink->n) return p0;
    if (c->cfg.residual <= 0) return c->n_past;
    return st->rec->p0 > p0 ? st->rec->p0 : p0;
}

void kv_cache_append_heads(struct kv_cache *c, int32_t p0, int n, const uint8_t *k, const uint8_t *v,
                           const uint8_t *wk, const uint8_t *wv, int32_t w0, int h0, int nh) {
    const struct kv_store *st = store_of(c);
    assert(h0 >= 0 && nh > 0 && h0 + nh <= c->shape.n_kv_heads);
    if (p0 < 0 || n <= 0 || p0 + n > c->n_past) return; /* trimmed since: nothing to keep */
    const bool win = kv_win_on(st);
    for (int t = 0; t < n; t++) {
        const int32_t p = p0 + t;
        const struct kv_block *b = k ? kv_store_block(st, p) : NULL;
        for (int h = 0; h < nh && b; h++) {
            memcpy(kv_block_row(c, b, 0, h0 + h, p), k + ((size_t)t * nh + h) * st->kf.row, st->kf.row);
            memcpy(kv_block_row(c, b, 1, h0 + h, p), v + ((size_t)t * nh + h) * st->vf.row, st->vf.row);
        }
        if (!win || p < w0) continue;
        const struct kv_win *ws[2] = {p < st->sink->n ? st->sink : NULL,
                                      p >= st->rec->p0 && p < st->rec->p0 + st->rec->n ? st->rec : NULL};
        for (int i = 0; i < 2; i++)
            for (int h = 0; h < nh && ws[i]; h++) {
                const int32_t j = p - ws[i]->p0;
                const size_t at = (size_t)(p - w0) * nh + h;
                memcpy(kv_win_row(ws[i], &st->wkf, 0, h0 + h, j), wk + at * st->wkf.row, st->wkf.row);
                memcpy(kv_win_row(ws[i], &st->wvf, 1, h0 + h, j), wv + at * st->wvf.row, st->wvf.row);
                kv_win_mirror(st, ws[i], h0 + h, j);
            }
    }
}

void kv_cache_append_rows(struct kv_cache *c, int32_t p0, int n, const uint8_t *k, const uint8_t *v,
                          const uint8_t *wk, const uint8_t *wv, int32_t w0) {
    kv_cache_append_heads(c, p0, n, k, v, wk, wv, w0, 0, c->shape.n_kv_heads);
}

/* Keeps the first n positions. A rotating or sliding-window cache can go back only
 * while it still holds every row a query at n would see. */
int kv_cache_can_keep_prefix(const struct kv_cache *c, int32_t n) {
    const struct kv_store *st = store_of(c);
    for (int32_t p = (n < c->n_past ? n : c->n_past) - 1; p >= 0; p--) {
        if (!kv_visible(c, p, n)) {
            if (c->cfg.max_size > 0 && p >= c->cfg.keep) p = c->cfg.keep; /* skip to the kept tokens */
            continue;
        }
        if (!kv_store_block(st, p))
            return kvq_error("cannot go back to %d tokens: the rotating window no longer holds position %d", n, p);
    }
    return 0;
}

int kv_store_keep_prefix(struct kv_cache *c, int32_t n) {
    struct kv_store *st = store_of(c);
    if (n < 0) n = 0;
    if (n >= c->n_past) return 0;
    if (kv_cache_can_keep_prefix(c, n) != 0) return -1;
    if (kv_win_own(c, &st->sink) != 0 || kv_win_own(c, &st->rec) != 0) return -1;
    release_from(c, (n + B - 1) / B);
    c->n_past = n;
    st->batch_view = false;
    if (st->last_first > n - 1) st->last_first = n > 0 ? n - 1 : 0;
    if (st->sink->n > n) st->sink->n = n;
    if (st->rec->p0 + st->rec->n > n) st->rec->n = n > st->rec->p0 ? n - st->rec->p0 : 0;
    if (n == 0) st->mu_set = false;
    assert(st->sink->n <= n && (st->rec->n == 0 || st->rec->p0 + st->rec->n <= n));
    return 0;
}

int kv_store_trim(struct kv_cache *c, int n) {
    if (n > c->n_past) n = c->n_past;
    return kv_store_keep_prefix(c, c->n_past - n) == 0 ? n : 0;
}

void kv_store_clear(struct kv_cache *c) {
    struct kv_store *st = store_of(c);
    kv_store_drop_blocks(c);
    c->n_past = 0;
    st->last_first = 0;
    st->mu_set = false;
    st->batch_view = false;
    struct kv_win *ws[2] = {kv_win_new(st->pool), kv_win_new(st->pool)};
    if (ws[0] && ws[1]) { /* else keep the old ones, emptied */
        kv_win_unref(st->sink);
        kv_win_unref(st->rec);
        st->sink = ws[0];
        st->rec = ws[1];
    } else {
        kv_win_unref(ws[0]);
        kv_win_unref(ws[1]);
        st->sink->n = st->rec->n = st->rec->p0 = 0;
    }
    st->kf = kv_fmt_initial(c, 0);
    st->vf = kv_fmt_initial(c, 1);
}

int kv_store_fork(struct kv_cache *dst, const struct kv_cache *src) {
    struct kv_store *d = store_of(dst);
    const struct kv_store *s = store_of(src);
    if (d->pool != s->pool) return kvq_error("caches of different contexts cannot share blocks");
    if (s->n_blk > d->cap_blk) {
        struct kv_block **t = realloc(d->blk, sizeof(*t) * (size_t)s->n_blk);
        if (!t) return kvq_error_code(KVQ_ERR_OOM, "out of memory forking a sequence");
        d->blk = t;
        d->cap_blk = s->n_blk;
    }
    kv_store_drop_blocks(dst);
    for (int32_t i = 0; i < s->n_blk; i++) {
        d->blk[i] = s->blk[i];
        if (d->blk[i]) kv_block_ref(d->blk[i]);
    }
    d->n_blk = s->n_blk;
    d->base = s->base;
    d->last_first = s->last_first;
    d->kf = s->kf;
    d->vf = s->vf;
    kv_win_unref(d->sink);
    kv_win_unref(d->rec);
    d->sink = s->sink;
    d->rec = s->rec;
    d->sink->refs++;
    d->rec->refs++;
    assert(d->sink->refs > 1 && d->rec->refs > 1);
    memcpy(d->mu, s->mu, sizeof(float) * 2 * (size_t)src->shape.n_kv_heads * src->shape.head_dim);
    d->mu_set = s->mu_set;
    dst->n_past = src->n_past;
    return 0;
}

/* Calls fn for each held position in order (with its block present). */
static int32_t held_positions(const struct kv_cache *c, int32_t *out, int32_t max) {
    const struct kv_store *st = store_of(c);
    int32_t n = 0;
    for (int32_t i = 0; i < st->n_blk; i++) {
        int32_t L = i < st->nkb ? i : i + st->base;
        if (!st->blk[i]) continue;
        for (int32_t p = L * B; p < L * B + B && p < c->n_past; p++)
            if (kv_held(c, p)) {
                if (out && n < max) out[n] = p;
                n++;
            }
    }
    return n;
}

int kv_store_size(const struct kv_cache *c) { return held_positions(c, NULL, 0); }

size_t kv_store_bytes(const struct kv_cache *c) {
    const struct kv_store *st = store_of(c);
    size_t held = kv_win_on(st) ? kv_win_bytes(c, st->sink) + kv_win_bytes(c, st->rec) : 0;
    return (size_t)c->shape.n_kv_heads * (size_t)kv_store_size(c) * (st->kf.row + st->vf.row) + held;
}

struct kv_append_bound kv_config_append_bound(const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    struct kv_cache c = {.cfg = *cfg, .shape = *shape};
    struct kv_fmt k = kv_fmt_target(&c, 0), v = kv_fmt_target(&c, 1);
    return (struct kv_append_bound){kv_block_size(&c, &k, &v), mu_tokens(&c), cfg->quantized_start > 0};
}

size_t kv_cache_budget_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape, int n_tokens) {
    struct kv_cache c = {.cfg = *cfg, .shape = *shape};
    struct kv_fmt ik = kv_fmt_initial(&c, 0), iv = kv_fmt_initial(&c, 1), tk = kv_fmt_target(&c, 0),
                  tv = kv_fmt_target(&c, 1);
    size_t per = kv_block_size(&c, &tk, &tv);
    if (!kv_fmt_eq(ik, tk) || !kv_fmt_eq(iv, tv)) per += kv_block_size(&c, &ik, &iv); /* both during conversion */
    int32_t kept = cfg->max_size > 0 && cfg->keep > 0 ? (cfg->keep + B - 1) / B : 0; /* a rotating cache's first block */
    return per * (size_t)((n_tokens + B - 1) / B + 1 + kept);
}

size_t kv_cache_window_memory(const struct kv_cache *c) {
    const struct kv_store *st = store_of(c);
    /* rounded up, so that the holders' shares add up to at least the window */
    return (kv_win_bytes(c, st->sink) + (size_t)st->sink->refs - 1) / (size_t)st->sink->refs +
           (kv_win_bytes(c, st->rec) + (size_t)st->rec->refs - 1) / (size_t)st->rec->refs;
}

struct kv_pool *kv_cache_pool(const struct kv_cache *c) { return store_of(c)->pool; }

void kv_store_free(struct kv_cache *c) {
    struct kv_store *st = store_of(c);
    if (st) {
        kv_store_drop_blocks(c);
        free(st->blk);
        kv_win_unref(st->sink);
        kv_win_unref(st->rec);
        free(st->signs);
        free(st->mu);
        if (st->own_pool) kv_pool_free(st->pool);
        free(st);
    }
    c->impl = NULL;
}

const char *kv_store_kind(const struct kv_cache *c) {
    const struct kv_store *st = store_of(c);
    bool q = kern_kvq_bits_quantized(st->kf.bits) || kern_kvq_bits_quantized(st->vf.bits);
    if (c->cfg.max_size > 0) return q ? "quantized-rotating" : "rotating";
    return q ? "quantized" : "dense";
}

int kv_store_read_rows(const struct kv_cache *c, int kv_head, int which, float *out, int32_t *pos, int max) {
    const struct kv_store *st = store_of(c);
    const struct kv_fmt *f = which ? &st->vf : &st->kf;
    const int D = c->shape.head_dim;
    int32_t n = held_positions(c, NULL, 0);
    int32_t *ps = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!ps || kv_store_fetch(c, 0, c->n_past) != 0) {
        free(ps);
        return 0;
    }
    held_positions(c, ps, n);
    int m = 0;
    for (int32_t i = 0; i < n && m < max; i++, m++) {
        kv_decode_row(st, f, D, kv_block_row(c, kv_store_block(st, ps[i]), which, kv_head, ps[i]),
                      kv_side_mu(st, f, which, kv_head, D, c->shape.n_kv_heads), out + (size_t)m * D);
        if (pos) pos[m] = ps[i];
    }
    free(ps);
    return m;
}

int kv_store_init(struct kv_cache *c, struct kv_pool *pool) {
    struct kv_store *st = calloc(1, sizeof *st);
    float *signs = malloc(sizeof(float) * (size_t)c->shape.head_dim);
    float *mu = calloc(2 * (size_t)c->shape.n_kv_heads * c->shape.head_dim, sizeof(float));
    bool own = !pool;
    if (own) pool = kv_pool_new(0);
    struct kv_win *sink = pool ? kv_win_new(pool) : NULL, *rec = pool ? kv_win_new(pool) : NULL;
    if (!st || !signs || !mu || !sink || !rec || !pool) {
        free(st);
        free(signs);
        free(mu);
        kv_win_unref(sink);
        kv_win_unref(rec);
        if (own) kv_pool_free(pool);
        return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    }
    kern_kvq_hadamard_signs(signs, c->shape.head_dim, HADAMARD_SEED);
    *st = (struct kv_store){.pool = pool, .own_pool = own, .sink = sink, .rec = rec, .signs = signs, .mu = mu};
    if (c->cfg.max_size > 0 && c->cfg.keep > 0) st->nkb = (c->cfg.keep + B - 1) / B;
    st->kf = kv_fmt_initial(c, 0);
    st->vf = kv_fmt_initial(c, 1);
    st->wkf = kv_fmt_window(c, kv_fmt_target(c, 0));
    st->wvf = kv_fmt_window(c, kv_fmt_target(c, 1));
    c->impl = st;
    return 0;
}
