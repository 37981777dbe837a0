/* The f16 windows of a quantized cache: the first `keep` positions (attention sinks)
 * and the newest R positions (the residual window), held besides their packed rows.
 * A query at q reads f16 rows for (q - R, q] however the tokens were batched. Window
 * rows are f16 of the (rotated) input, without the offsets. Forks share a window
 * until one of them writes to it. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

bool kv_win_on(const struct kv_store *st) {
    return kern_kvq_bits_quantized(st->kf.bits) || kern_kvq_bits_quantized(st->vf.bits);
}

/* First tokens held in f16 besides their packed rows (with a residual window). */
int32_t kv_sink_target(const struct kv_cache *c) { return c->cfg.residual > 0 ? c->cfg.keep : 0; }

struct kv_win *kv_win_new(void) {
    struct kv_win *w = calloc(1, sizeof *w);
    if (!w) {
        kvq_error("out of memory");
        return NULL;
    }
    w->refs = 1;
    return w;
}

void kv_win_unref(struct kv_win *w) {
    if (!w || --w->refs > 0) return;
    free(w->k);
    free(w->v);
    free(w);
}

/* Replaces *wp by a private window of `cap` rows holding the same rows. */
static int win_realloc(struct kv_cache *c, struct kv_win **wp, int32_t cap) {
    const struct kv_store *st = store_of(c);
    struct kv_win *old = *wp;
    const int H = c->shape.n_kv_heads;
    struct kv_win *w = calloc(1, sizeof *w);
    uint8_t *k = malloc(st->wkf.row * (size_t)cap * (size_t)H), *v = malloc(st->wvf.row * (size_t)cap * (size_t)H);
    if (!w || !k || !v) {
        free(w);
        free(k);
        free(v);
        return kvq_error("out of memory growing the KV cache window to %d tokens", cap);
    }
    *w = (struct kv_win){1, old->p0, old->n, cap, 0, k, v};
    for (int h = 0; h < H && old->n > 0; h++) {
        memcpy(kv_win_row(w, &st->wkf, 0, h, 0), kv_win_row(old, &st->wkf, 0, h, 0), st->wkf.row * (size_t)old->n);
        memcpy(kv_win_row(w, &st->wvf, 1, h, 0), kv_win_row(old, &st->wvf, 1, h, 0), st->wvf.row * (size_t)old->n);
    }
    kv_win_unref(old);
    *wp = w;
    return 0;
}

int kv_win_own(struct kv_cache *c, struct kv_win **w) {
    return (*w)->refs > 1 ? win_realloc(c, w, (*w)->cap > (*w)->n ? (*w)->cap : (*w)->n + 1) : 0;
}

int kv_win_reserve(struct kv_cache *c, struct kv_win **w, int32_t need) {
    if (need <= (*w)->cap && (*w)->refs == 1) return 0;
    int32_t cap = (*w)->cap ? (*w)->cap : 16;
    while (cap < need) cap *= 2;
    return win_realloc(c, w, cap);
}

static void win_drop_front(struct kv_win *w, int32_t drop) {
    if (drop <= 0) return;
    if (drop >= w->n) drop = w->n;
    w->p0 += drop;
    w->n -= drop;
    w->start = w->n ? w->start + drop : 0;
}

/* Room for `more` rows after the window's rows: its rows moved back to slot 0 when
 * they would run past cap (private, cap >= n + more). */
static void win_room_after(struct kv_cache *c, struct kv_win *w, int32_t more) {
    const struct kv_store *st = store_of(c);
    if (w->start + w->n + more <= w->cap) return;
    for (int h = 0; h < c->shape.n_kv_heads; h++) {
        uint8_t *k0 = w->k + (size_t)h * (size_t)w->cap * st->wkf.row, *v0 = w->v + (size_t)h * (size_t)w->cap * st->wvf.row;
        memmove(k0, kv_win_row(w, &st->wkf, 0, h, 0), st->wkf.row * (size_t)w->n);
        memmove(v0, kv_win_row(w, &st->wvf, 1, h, 0), st->wvf.row * (size_t)w->n);
    }
    w->start = 0;
}

/* Appends the row of position p0+n (capacity reserved, window private); k, v: [H][D]. */
void kv_win_put(struct kv_cache *c, struct kv_win *w, const float *k, const float *v) {
    const struct kv_store *st = store_of(c);
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    for (int h = 0; h < H; h++) {
        kv_encode_row(st, &st->wkf, D, k + (size_t)h * D, NULL, kv_win_row(w, &st->wkf, 0, h, w->n));
        kv_encode_row(st, &st->wvf, D, v + (size_t)h * D, NULL, kv_win_row(w, &st->wvf, 1, h, w->n));
    }
    w->n++;
}

/* Before appending n tokens at p = n_past: the sinks take the batch's positions below
 * the sink count; the residual window drops positions older than first - R + 1 (what
 * the batch's first query still needs; nothing before the offsets' point) and takes
 * the whole batch. Makes room for those rows; *n_sink: how many go to the sinks. */
int kv_windows_make_room(struct kv_cache *c, int n, int32_t first, int32_t *n_sink) {
    struct kv_store *st = store_of(c);
    *n_sink = 0;
    if (!kv_win_on(st)) return 0;
    const int32_t p = c->n_past, S = kv_sink_target(c), R = c->cfg.residual;
    if (st->sink->n == p && p < S) {
        *n_sink = S - p < n ? S - p : n;
        if (kv_win_reserve(c, &st->sink, p + *n_sink) != 0) return -1;
    }
    if (R > 0) {
        if (kv_win_own(c, &st->rec) != 0) return -1;
        struct kv_win *w = st->rec;
        if (w->n > 0 && w->p0 + w->n != p) w->n = 0; /* not contiguous: restart */
        if (w->n == 0) {
            w->p0 = p;
            w->start = 0;
        }
        /* queries before the offsets' point read every row in f16: all kept until then */
        int32_t lo = first - R + 1 > 0 && first >= mu_tokens(c) ? first - R + 1 : 0;
        /* R rows to spare: the rows then move back to slot 0 once every R tokens or so */
        if (kv_win_reserve(c, &st->rec, (w->p0 < lo ? p - lo : w->n) + n + R) != 0) return -1;
        win_drop_front(st->rec, lo - st->rec->p0);
        win_room_after(c, st->rec, n);
    }
    return 0;
}

int kv_windows_append(struct kv_cache *c, int n, const float *k, const float *v, size_t tok, int32_t first) {
    struct kv_store *st = store_of(c);
    int32_t ns;
    if (kv_windows_make_room(c, n, first, &ns) != 0) return -1;
    if (!kv_win_on(st)) return 0;
    if (c->cfg.residual > 0)
        for (int t = 0; t < n; t++) kv_win_put(c, st->rec, k + (size_t)t * tok, v + (size_t)t * tok);
    for (int t = 0; t < ns; t++) kv_win_put(c, st->sink, k + (size_t)t * tok, v + (size_t)t * tok);
    return 0;
}

size_t kv_win_bytes(const struct kv_cache *c, const struct kv_win *w) {
    const struct kv_store *st = store_of(c);
    return (size_t)w->n * (size_t)c->shape.n_kv_heads * (st->wkf.row + st->wvf.row);
}
