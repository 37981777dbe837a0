/* The f16 windows of a quantized cache: the first `keep` positions (attention sinks)
 * and the newest R positions (the residual window), held besides their packed rows.
 * A query at q reads f16 rows for (q - R, q] however the tokens were batched. Window
 * rows are f16 of the (rotated) input, without the offsets. Forks share a window
 * until one of them writes to it. */
#include <assert.h>
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

struct kv_win *kv_win_new(struct kv_pool *pool) {
    struct kv_win *w = calloc(1, sizeof *w);
    if (!w) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    w->refs = 1;
    w->pool = pool;
    return w;
}

void kv_win_unref(struct kv_win *w) {
    assert(!w || w->refs > 0);
    if (!w || --w->refs > 0) return;
    kv_pool_win_free(w->pool, w->k, w->k_bytes);
    kv_pool_win_free(w->pool, w->v, w->v_bytes);
    free(w);
}

/* Replaces *wp by a private window of `cap` rows holding its rows but the first `skip`;
 * false when memory is short (*wp unchanged). touch: every page of the new window
 * written now, so that the rows appended later do not fault them in one at a time. */
static bool win_copy(struct kv_cache *c, struct kv_win **wp, int32_t cap, bool touch, int32_t skip) {
    const struct kv_store *st = store_of(c);
    struct kv_win *old = *wp;
    const int H = c->shape.n_kv_heads;
    const size_t kb = st->wkf.row * 2 * (size_t)cap * (size_t)H, vb = st->wvf.row * 2 * (size_t)cap * (size_t)H;
    struct kv_win *w = calloc(1, sizeof *w);
    bool k_fresh, v_fresh;
    uint8_t *k = kv_pool_win_alloc(st->pool, kb, &k_fresh), *v = kv_pool_win_alloc(st->pool, vb, &v_fresh);
    if (!w || !k || !v) {
        free(w);
        kv_pool_win_free(st->pool, k, kb);
        kv_pool_win_free(st->pool, v, vb);
        return false;
    }
    if (touch && k_fresh) memset(k, 0, kb);
    if (touch && v_fresh) memset(v, 0, vb);
    const int32_t n = old->n - skip;
    *w = (struct kv_win){1, old->p0 + skip, n, cap, 0, k, v, kb, vb, st->pool};
    for (int h = 0; h < H && n > 0; h++) { /* to slots [0, n): no second copies */
        memcpy(kv_win_row(w, &st->wkf, 0, h, 0), kv_win_row(old, &st->wkf, 0, h, skip), st->wkf.row * (size_t)n);
        memcpy(kv_win_row(w, &st->wvf, 1, h, 0), kv_win_row(old, &st->wvf, 1, h, skip), st->wvf.row * (size_t)n);
    }
    kv_win_unref(old);
    *wp = w;
    return true;
}

/* Replaces *wp by a private window of `cap` rows holding its rows but the first skip. */
static int win_realloc(struct kv_cache *c, struct kv_win **wp, int32_t cap, int32_t skip) {
    return win_copy(c, wp, cap, false, skip)
               ? 0
               : kvq_error_code(KVQ_ERR_OOM, "out of memory growing the KV cache window to %d tokens", cap);
}

/* A capacity for `need` rows: doubled for a window that grows a row at a time, a
 * batch's need as it is. */
static int32_t win_grown(int32_t cap, int32_t need) {
    const int32_t grow = cap >= 8 ? 2 * cap : 16;
    return need > grow ? (need + 15) / 16 * 16 : grow;
}

int kv_win_own(struct kv_cache *c, struct kv_win **w) {
    return (*w)->refs > 1 ? win_realloc(c, w, (*w)->cap > (*w)->n ? (*w)->cap : (*w)->n + 1, 0) : 0;
}

int kv_win_reserve(struct kv_cache *c, struct kv_win **w, int32_t need) {
    if (need <= (*w)->cap && (*w)->refs == 1) return 0;
    return win_realloc(c, w, need <= (*w)->cap ? (*w)->cap : win_grown((*w)->cap, need), 0);
}

static void win_drop_front(struct kv_win *w, int32_t drop) {
    if (drop <= 0) return;
    if (drop >= w->n) drop = w->n;
    w->p0 += drop;
    w->n -= drop;
    w->start = w->n ? (w->start + drop) % w->cap : 0;
    assert(w->n >= 0 && w->n <= w->cap && (w->n == 0 || w->start < w->cap));
}

/* A window grown for a long batch (a prompt) is cut back to twice what the short
 * batches after it keep (`keep` rows), its pages written at once, so that decoding
 * turns its ring over pages already mapped. Before, decode steps walked the rows
 * through the rest of a big buffer: every 16 tokens (4 KB of 256-byte rows) each
 * head's and side's next page faulted in while the step's rows were filed, 512 faults
 * and 0.2-0.5 ms every 16 tokens of a llama3-8b decode at 4096 rows (H100 host), and
 * the window held 128 MB where 16 MB serve. Memory short: the big window stays. */
static void win_shrink(struct kv_cache *c, struct kv_win **wp, int32_t keep) {
    int32_t cap = 16;
    while (cap < 2 * keep) cap *= 2;
    if ((*wp)->cap >= 4 * cap && (*wp)->refs == 1) win_copy(c, wp, cap, true, 0);
}

/* The rows back to slots [0, n) (private window). */
static void win_rebase(struct kv_cache *c, struct kv_win *w) {
    const struct kv_store *st = store_of(c);
    if (w->start == 0) return;
    for (int h = 0; h < c->shape.n_kv_heads; h++) {
        memmove(kv_win_row(w, &st->wkf, 0, h, -w->start), kv_win_row(w, &st->wkf, 0, h, 0), st->wkf.row * (size_t)w->n);
        memmove(kv_win_row(w, &st->wvf, 1, h, -w->start), kv_win_row(w, &st->wvf, 1, h, 0), st->wvf.row * (size_t)w->n);
    }
    w->start = 0;
}

/* Appends the row of position p0+n (capacity reserved, window private); k, v: [H][D]. */
void kv_win_put(struct kv_cache *c, struct kv_win *w, const float *k, const float *v) {
    const struct kv_store *st = store_of(c);
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    assert(w->refs == 1 && w->n < w->cap && w->start < w->cap); /* private, with room */
    for (int h = 0; h < H; h++) {
        kv_encode_row(st, &st->wkf, D, k + (size_t)h * D, NULL, kv_win_row(w, &st->wkf, 0, h, w->n));
        kv_encode_row(st, &st->wvf, D, v + (size_t)h * D, NULL, kv_win_row(w, &st->wvf, 1, h, w->n));
        kv_win_mirror(st, w, h, w->n);
    }
    w->n++;
}

/* Before appending n tokens at p = n_past: the sinks take the batch's positions below
 * the sink count; the residual window drops positions older than first - R + 1 (what
 * the batch's first query still needs; nothing before the offsets' point) and takes
 * the whole batch, or with later_only (a device attends for the batch's queries from
 * its own copy) only what the queries after the batch read, once the offsets' point is
 * behind or where the device chooses the offsets in this batch (claimed). Makes room
 * for those rows; *n_sink, *n_rec: how many go to the sinks and to the residual window
 * (the batch's last ones). */
int kv_windows_make_room(struct kv_cache *c, int n, int32_t first, bool later_only, bool claimed, int32_t *n_sink,
                         int32_t *n_rec) {
    struct kv_store *st = store_of(c);
    *n_sink = 0;
    *n_rec = n;
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
        const int32_t T = mu_tokens(c);
        int32_t lo = first - R + 1 > 0 && first >= T ? first - R + 1 : 0;
        st->batch_view = later_only;
        st->batch_lo = lo > w->p0 ? (lo < p ? lo : p) : w->p0; /* the window's start without later_only */
        /* as a one-token batch leaves it; so also where the device chooses the offsets */
        if (later_only && (first >= T || claimed) && p + n - R > lo) lo = p + n - R;
        if (lo > p) { /* none of the rows before the batch, nor its first lo - p */
            w->n = 0;
            w->p0 = lo;
            w->start = 0;
            *n_rec = p + n - lo;
            return kv_win_reserve(c, &st->rec, *n_rec);
        }
        const int32_t drop = lo <= w->p0 ? 0 : lo - w->p0 < w->n ? lo - w->p0 : w->n, keep = w->n - drop + n;
        if (keep > w->cap) /* the rows dropped are not copied; memory short: nothing changed */
            return win_realloc(c, &st->rec, win_grown(w->cap, keep), drop);
        win_drop_front(w, drop);
        win_shrink(c, &st->rec, keep);
        /* a batch longer than the rows before it: those back to slot 0, so that the
         * batch's rows land below slot cap and need no second copy */
        if (n > st->rec->n && st->rec->start + keep > st->rec->cap) win_rebase(c, st->rec);
    }
    return 0;
}

int kv_windows_append(struct kv_cache *c, int n, const float *k, const float *v, size_t tok, int32_t first) {
    struct kv_store *st = store_of(c);
    int32_t ns, nr;
    if (kv_windows_make_room(c, n, first, false, false, &ns, &nr) != 0) return -1;
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
