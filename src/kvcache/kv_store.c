/* Every cache kind as one slot store. Keys and values are rows of head_dim values in
 * a row format (f16, f32, or packed b-bit groups: kernels/kv_quant.h), one block per
 * KV head ([n_kv_heads][capacity][row_bytes]) so attention streams memory in order.
 * Each slot records the position of its token.
 *
 *   dense / quantized: slot s holds position s; grows without bound.
 *   rotating (max_size M, keep K): the first K tokens stay in slots [0, K); the
 *     others share a ring [K, M) written at `idx`, like mlx-lm's RotatingKVCache.
 *     A query at position p sees the first K tokens and the last M-K tokens <= p:
 *     exactly what a one-token decode step sees. A multi-token append larger than
 *     the free room first puts the slots in temporal order and keeps the last M-K-1
 *     old tokens (so every query of the batch sees its own window), then appends;
 *     the next append trims back to M.
 *   quantize after N: rows are f16 until the sequence exceeds N tokens, then every
 *     stored row is re-encoded in place (positions, offset and idx unchanged).
 * Quantized rows are Hadamard-rotated first when the config asks for it: the query
 * is rotated the same way, the attention output is rotated back. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/attention.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_cache_impl.h"


#define HADAMARD_SEED 0x6b7671726f74ull /* "kvqrot": fixed so saved caches stay valid */

struct kv_fmt {
    int bits, group;
    bool rot;
    size_t row; /* bytes per row */
};

/* f16 copies of the rows of positions [p0, p0+n), in the window formats. */
struct kv_win {
    int32_t p0, n, cap;
    uint8_t *k, *v; /* [H][cap][row] */
};

struct kv_store {
    struct kv_fmt kf, vf;
    struct kv_fmt wkf, wvf; /* window rows: f16 in the packed rows' space (rotated, centered) */
    struct kv_win rec;      /* the newest positions (the residual window) */
    struct kv_win sink;     /* positions [0, sinks) */
    int32_t cap, size, idx; /* slots allocated, in use, next ring slot */
    int32_t *pos;           /* [cap] position of each slot */
    uint8_t *k, *v;         /* [H][cap][row] */
    float *signs;           /* [head_dim] Hadamard signs */
    float *mu;              /* [2][n_kv_heads][head_dim] key and value offsets removed before quantizing */
    bool mu_set;
};

static struct kv_fmt make_fmt(const struct kv_cache *c, int bits, int group) {
    struct kv_fmt f = {bits, group, c->cfg.hadamard && kern_kvq_bits_quantized(bits), 0};
    f.row = kern_kvq_row_bytes(bits, group, c->shape.head_dim);
    return f;
}
static struct kv_fmt target_k(const struct kv_cache *c) { return make_fmt(c, c->cfg.k_bits, c->cfg.k_group); }
static struct kv_fmt target_v(const struct kv_cache *c) { return make_fmt(c, c->cfg.v_bits, c->cfg.v_group); }
/* Before conversion, a quantized side is held as f16. */
static struct kv_fmt initial_fmt(const struct kv_cache *c, int bits, int group) {
    if (c->cfg.quantized_start > 0 && kern_kvq_bits_quantized(bits)) return make_fmt(c, 16, group);
    return make_fmt(c, bits, group);
}
static bool fmt_eq(struct kv_fmt a, struct kv_fmt b) {
    return a.bits == b.bits && a.rot == b.rot && (!kern_kvq_bits_quantized(a.bits) || a.group == b.group);
}

/* The window format of a side: f16 where the side is quantized (same rotation). */
static struct kv_fmt window_fmt(const struct kv_cache *c, struct kv_fmt f) {
    if (kern_kvq_bits_quantized(f.bits)) f.bits = 16;
    f.row = kern_kvq_row_bytes(f.bits, f.group, c->shape.head_dim);
    return f;
}

static uint8_t *row_ptr(uint8_t *base, const struct kv_fmt *f, int32_t cap, int h, int32_t slot) {
    return base + ((size_t)h * (size_t)cap + (size_t)slot) * f->row;
}

/* mu: the key offset of the row's head (NULL for values and float rows). Removing a
 * per-channel constant from every key shifts all scores of a query by the same
 * amount, which softmax ignores: attention needs no correction. */
static void encode_row(const struct kv_store *st, const struct kv_fmt *f, int d, const float *x, const float *mu,
                       uint8_t *dst) {
    float tmp[KERN_KVQ_MAX_DIM];
    if (mu || f->rot) {
        for (int i = 0; i < d; i++) tmp[i] = mu ? x[i] - mu[i] : x[i];
        if (f->rot) kern_kvq_hadamard(tmp, d, st->signs);
        x = tmp;
    }
    kern_kvq_quantize_row(x, d, f->bits, f->group, dst);
}

static void decode_row(const struct kv_store *st, const struct kv_fmt *f, int d, const uint8_t *src, const float *mu,
                       float *x) {
    kern_kvq_dequantize_row(src, d, f->bits, f->group, x);
    if (f->rot) kern_kvq_hadamard_inv(x, d, st->signs);
    if (mu)
        for (int i = 0; i < d; i++) x[i] += mu[i];
}

/* The offset of a quantized side (NULL for float rows or before it is chosen). */
static const float *side_mu(const struct kv_store *st, const struct kv_fmt *f, int which, int h, int d, int H) {
    return kern_kvq_bits_quantized(f->bits) && st->mu_set ? st->mu + ((size_t)which * H + h) * d : NULL;
}

/* Chooses the offsets from n tokens of keys and values ([n][H][D] each; the first at
 * position p0): their per-channel means, leaving out the first token of the sequence
 * (an attention sink, unlike the others). A lone first token leaves them at 0.
 * Offsets exist only with a residual window R > 0: they are the means of positions
 * 1..T-1, chosen when the sequence reaches T tokens (mu_tokens), from the f16 window
 * rows, so they do not depend on how the tokens were batched. */
static void set_mu(struct kv_cache *c, const float *k, const float *v, size_t tok_stride, int n, int32_t p0) {
    struct kv_store *st = c->impl;
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    int t0 = p0 == 0 ? 1 : 0;
    memset(st->mu, 0, sizeof(float) * 2 * (size_t)H * D);
    for (int w = 0; w < 2; w++) {
        const float *x = w ? v : k;
        float *mu = st->mu + (size_t)w * H * D;
        for (int t = t0; t < n; t++)
            for (int i = 0; i < H * D; i++) mu[i] += x[(size_t)t * tok_stride + i] / (float)(n - t0);
    }
    st->mu_set = true;
}

/* Copies the first `used` rows of every head of a [H][old_cap][row] block into a
 * new [H][cap][row] block; NULL when out of memory. */
static uint8_t *regrow_heads(const uint8_t *old, size_t row, int H, int32_t old_cap, int32_t cap, int32_t used) {
    uint8_t *nb = malloc(row * (size_t)cap * (size_t)H);
    if (nb && used > 0)
        for (int h = 0; h < H; h++) memcpy(nb + row * (size_t)cap * h, old + row * (size_t)old_cap * h, row * (size_t)used);
    return nb;
}

/* Reallocates a K/V pair of head blocks to `cap` rows, keeping the first `used`. */
static int regrow_kv(uint8_t **k, uint8_t **v, size_t k_row, size_t v_row, int H, int32_t old_cap, int32_t cap,
                     int32_t used) {
    uint8_t *nk = regrow_heads(*k, k_row, H, old_cap, cap, used);
    uint8_t *nv = regrow_heads(*v, v_row, H, old_cap, cap, used);
    if (!nk || !nv) {
        free(nk);
        free(nv);
        return kvq_error("out of memory growing the KV cache to %d tokens", cap);
    }
    free(*k);
    free(*v);
    *k = nk;
    *v = nv;
    return 0;
}

/* Reallocates to `cap` slots, keeping slots [0, size). */
static int store_realloc(struct kv_cache *c, int32_t cap) {
    struct kv_store *st = c->impl;
    int32_t *np = malloc(sizeof(int32_t) * (size_t)cap);
    if (!np) return kvq_error("out of memory growing the KV cache to %d tokens", cap);
    if (regrow_kv(&st->k, &st->v, st->kf.row, st->vf.row, c->shape.n_kv_heads, st->cap, cap, st->size) != 0) {
        free(np);
        return -1;
    }
    if (st->size > 0) memcpy(np, st->pos, sizeof(int32_t) * (size_t)st->size);
    free(st->pos);
    st->pos = np;
    st->cap = cap;
    return 0;
}

static int store_reserve(struct kv_cache *c, int32_t need) {
    struct kv_store *st = c->impl;
    if (need <= st->cap) return 0;
    int32_t cap = st->cap ? st->cap : 64;
    while (cap < need) cap = cap > (1 << 29) ? need : cap * 2;
    return store_realloc(c, cap);
}

static void write_slot(struct kv_cache *c, int32_t slot, int32_t pos, const float *k, const float *v) {
    struct kv_store *st = c->impl;
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    for (int h = 0; h < H; h++) {
        encode_row(st, &st->kf, D, k + (size_t)h * D, side_mu(st, &st->kf, 0, h, D, H),
                   row_ptr(st->k, &st->kf, st->cap, h, slot));
        encode_row(st, &st->vf, D, v + (size_t)h * D, side_mu(st, &st->vf, 1, h, D, H),
                   row_ptr(st->v, &st->vf, st->cap, h, slot));
    }
    st->pos[slot] = pos;
}

/* ---- f16 windows ---- */

static bool win_on(const struct kv_store *st) {
    return kern_kvq_bits_quantized(st->kf.bits) || kern_kvq_bits_quantized(st->vf.bits);
}
/* First tokens held in f16 besides their packed rows (with a residual window). */
static int32_t sink_target(const struct kv_cache *c) { return c->cfg.residual > 0 ? c->cfg.keep : 0; }

static int win_reserve(struct kv_cache *c, struct kv_win *w, int32_t need) {
    struct kv_store *st = c->impl;
    if (need <= w->cap) return 0;
    int32_t cap = w->cap ? w->cap : 16;
    while (cap < need) cap *= 2;
    if (regrow_kv(&w->k, &w->v, st->wkf.row, st->wvf.row, c->shape.n_kv_heads, w->cap, cap, w->n) != 0) return -1;
    w->cap = cap;
    return 0;
}

static void win_drop_front(struct kv_cache *c, struct kv_win *w, int32_t drop) {
    struct kv_store *st = c->impl;
    if (drop <= 0) return;
    if (drop >= w->n) {
        w->p0 += w->n;
        w->n = 0;
        return;
    }
    int32_t keep = w->n - drop;
    for (int h = 0; h < c->shape.n_kv_heads; h++) {
        memmove(row_ptr(w->k, &st->wkf, w->cap, h, 0), row_ptr(w->k, &st->wkf, w->cap, h, drop),
                st->wkf.row * (size_t)keep);
        memmove(row_ptr(w->v, &st->wvf, w->cap, h, 0), row_ptr(w->v, &st->wvf, w->cap, h, drop),
                st->wvf.row * (size_t)keep);
    }
    w->p0 += drop;
    w->n = keep;
}

/* Appends the row of position p0+n (capacity reserved); k, v: [H][D]. */
static void win_put(struct kv_cache *c, struct kv_win *w, const float *k, const float *v) {
    struct kv_store *st = c->impl;
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    for (int h = 0; h < H; h++) {
        encode_row(st, &st->wkf, D, k + (size_t)h * D, NULL, row_ptr(w->k, &st->wkf, w->cap, h, w->n));
        encode_row(st, &st->wvf, D, v + (size_t)h * D, NULL, row_ptr(w->v, &st->wvf, w->cap, h, w->n));
    }
    w->n++;
}

/* Before appending n tokens at p = n_past: the sinks take the batch's positions below
 * the sink count; the residual window drops positions older than first - R + 1 (what
 * the batch's first query still needs; nothing before the offsets' point) and takes
 * the whole batch. So a query at q reads f16 rows for (q - R, q] however the tokens
 * were batched. Window rows are f16 of the (rotated) input, without the offsets. */
static int32_t mu_tokens(const struct kv_cache *c);

static int windows_append(struct kv_cache *c, int n, const float *k, const float *v, size_t tok, int32_t first) {
    struct kv_store *st = c->impl;
    if (!win_on(st)) return 0;
    const int32_t p = c->n_past, S = sink_target(c), R = c->cfg.residual;
    int32_t ns = 0;
    if (st->sink.n == p && p < S) {
        ns = S - p < n ? S - p : n;
        if (win_reserve(c, &st->sink, p + ns) != 0) return -1;
    }
    if (R > 0) {
        if (st->rec.n > 0 && st->rec.p0 + st->rec.n != p) st->rec.n = 0; /* not contiguous: restart */
        if (st->rec.n == 0) st->rec.p0 = p;
        /* queries before the offsets' point read every row in f16: all kept until then */
        int32_t lo = first - R + 1 > 0 && first >= mu_tokens(c) ? first - R + 1 : 0;
        if (win_reserve(c, &st->rec, (st->rec.p0 < lo ? p - lo : st->rec.n) + n) != 0) return -1;
        win_drop_front(c, &st->rec, lo - st->rec.p0);
        for (int t = 0; t < n; t++) win_put(c, &st->rec, k + (size_t)t * tok, v + (size_t)t * tok);
    }
    for (int t = 0; t < ns; t++) win_put(c, &st->sink, k + (size_t)t * tok, v + (size_t)t * tok);
    return 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Puts the slots in position order (idx = size afterwards). */
static int temporal_order(struct kv_cache *c) {
    struct kv_store *st = c->impl;
    bool sorted = true;
    for (int32_t s = 1; s < st->size && sorted; s++) sorted = st->pos[s - 1] < st->pos[s];
    if (sorted) {
        st->idx = st->size;
        return 0;
    }
    /* The order after a wrap is known: [0, keep) [idx, size) [keep, idx). */
    int32_t keep = c->cfg.keep < st->size ? c->cfg.keep : st->size;
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)st->size);
    int H = c->shape.n_kv_heads;
    uint8_t *nk = malloc(st->kf.row * (size_t)st->cap * (size_t)H);
    uint8_t *nv = malloc(st->vf.row * (size_t)st->cap * (size_t)H);
    int32_t *np = malloc(sizeof(int32_t) * (size_t)st->cap);
    if (!perm || !nk || !nv || !np) {
        free(perm);
        free(nk);
        free(nv);
        free(np);
        return kvq_error("out of memory reordering the KV cache");
    }
    int32_t n = 0;
    for (int32_t s = 0; s < keep; s++) perm[n++] = s;
    for (int32_t s = st->idx; s < st->size; s++) perm[n++] = s;
    for (int32_t s = keep; s < st->idx; s++) perm[n++] = s;
    bool ok = true;
    for (int32_t s = 1; s < n && ok; s++) ok = st->pos[perm[s - 1]] < st->pos[perm[s]];
    if (!ok) { /* not the usual ring shape: sort by position */
        uint64_t *key = malloc(sizeof(uint64_t) * (size_t)st->size);
        if (!key) {
            free(perm);
            free(nk);
            free(nv);
            free(np);
            return kvq_error("out of memory reordering the KV cache");
        }
        for (int32_t s = 0; s < st->size; s++) key[s] = (uint64_t)(uint32_t)st->pos[s] << 32 | (uint32_t)s;
        qsort(key, (size_t)st->size, sizeof *key, cmp_u64);
        for (int32_t s = 0; s < st->size; s++) perm[s] = (int32_t)(key[s] & 0xffffffffu);
        free(key);
    }
    for (int32_t s = 0; s < st->size; s++) {
        np[s] = st->pos[perm[s]];
        for (int h = 0; h < H; h++) {
            memcpy(row_ptr(nk, &st->kf, st->cap, h, s), row_ptr(st->k, &st->kf, st->cap, h, perm[s]), st->kf.row);
            memcpy(row_ptr(nv, &st->vf, st->cap, h, s), row_ptr(st->v, &st->vf, st->cap, h, perm[s]), st->vf.row);
        }
    }
    free(perm);
    free(st->k);
    free(st->v);
    free(st->pos);
    st->k = nk;
    st->v = nv;
    st->pos = np;
    st->idx = st->size;
    return 0;
}

/* With the slots in temporal order, drops the oldest tokens after the first `keep`
 * so that at most `retain` of the others remain. */
static void drop_oldest(struct kv_cache *c, int32_t retain) {
    struct kv_store *st = c->impl;
    int32_t nk = 0;
    while (nk < st->size && st->pos[nk] < c->cfg.keep) nk++;
    int32_t others = st->size - nk;
    if (others <= retain) return;
    int32_t drop = others - retain;
    for (int h = 0; h < c->shape.n_kv_heads; h++) {
        memmove(row_ptr(st->k, &st->kf, st->cap, h, nk), row_ptr(st->k, &st->kf, st->cap, h, nk + drop),
                st->kf.row * (size_t)retain);
        memmove(row_ptr(st->v, &st->vf, st->cap, h, nk), row_ptr(st->v, &st->vf, st->cap, h, nk + drop),
                st->vf.row * (size_t)retain);
    }
    memmove(st->pos + nk, st->pos + nk + drop, sizeof(int32_t) * (size_t)retain);
    st->size -= drop;
    st->idx = st->size;
}

/* With R > 0, the offsets are the means of positions 1..T-1, chosen when the sequence
 * reaches T = max(R + 1, MU_TOKENS) tokens; until then every row stays in the window and
 * queries before T read f16 rows only (0: no offsets). */
#define MU_TOKENS 128 /* kv-quality, K4/V4 R 32: 0.00259 at 64, 0.00246 at 128, 0.00249 at 256 */
static int32_t mu_tokens(const struct kv_cache *c) {
    const int32_t R = c->cfg.residual, M = c->cfg.max_size;
    int32_t T = M > 0 && M < MU_TOKENS ? M : MU_TOKENS; /* a rotating cache stays bounded */
    return R <= 0 ? 0 : R + 1 > T ? R + 1 : T;
}

/* The slot holding position p, or -1. */
static int32_t slot_of(const struct kv_cache *c, int32_t p) {
    const struct kv_store *st = c->impl;
    if (c->cfg.max_size == 0) return p < st->size ? p : -1;
    for (int32_t s = 0; s < st->size; s++)
        if (st->pos[s] == p) return s;
    return -1;
}

/* Re-encodes every stored row into new formats (same slots). */
static int reencode(struct kv_cache *c, struct kv_fmt nkf, struct kv_fmt nvf) {
    struct kv_store *st = c->impl;
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    int32_t cap = st->cap;
    uint8_t *nk = malloc(nkf.row * (size_t)(cap ? cap : 1) * (size_t)H);
    uint8_t *nv = malloc(nvf.row * (size_t)(cap ? cap : 1) * (size_t)H);
    if (!nk || !nv) {
        free(nk);
        free(nv);
        return kvq_error("out of memory converting the KV cache");
    }
    size_t n_tok = (size_t)(st->size ? st->size : 1);
    float *x = malloc(sizeof(float) * n_tok * H * D * 2);
    if (!x) {
        free(nk);
        free(nv);
        return kvq_error("out of memory converting the KV cache");
    }
    float *xv = x + n_tok * H * D;
    /* decode everything, the earliest token first (slots 0 and `first` swapped) */
    int32_t first = 0;
    for (int32_t s = 0; s < st->size; s++)
        if (st->pos[s] < st->pos[first]) first = s;
#define SLOT_OF(t) ((t) == 0 ? first : (t) == first ? 0 : (t))
    for (int32_t t = 0; t < st->size; t++)
        for (int h = 0; h < H; h++) {
            decode_row(st, &st->kf, D, row_ptr(st->k, &st->kf, cap, h, SLOT_OF(t)), side_mu(st, &st->kf, 0, h, D, H),
                       x + ((size_t)t * H + h) * D);
            decode_row(st, &st->vf, D, row_ptr(st->v, &st->vf, cap, h, SLOT_OF(t)), side_mu(st, &st->vf, 1, h, D, H),
                       xv + ((size_t)t * H + h) * D);
        }
    /* offsets (R > 0) from positions 1..R when present, else chosen later by append */
    const int32_t T = mu_tokens(c);
    if (!st->mu_set && T > 0 && c->n_past >= T && c->cfg.max_size == 0 && st->pos[first] == 0)
        set_mu(c, x, xv, (size_t)H * D, T, 0);
    for (int32_t t = 0; t < st->size; t++)
        for (int h = 0; h < H; h++) {
            encode_row(st, &nkf, D, x + ((size_t)t * H + h) * D, side_mu(st, &nkf, 0, h, D, H),
                       row_ptr(nk, &nkf, cap, h, SLOT_OF(t)));
            encode_row(st, &nvf, D, xv + ((size_t)t * H + h) * D, side_mu(st, &nvf, 1, h, D, H),
                       row_ptr(nv, &nvf, cap, h, SLOT_OF(t)));
        }
    free(st->k);
    free(st->v);
    st->k = nk;
    st->v = nv;
    st->kf = nkf;
    st->vf = nvf;
    /* the windows take the f16 rows of the sinks and of the last R positions */
    st->sink.n = st->rec.n = 0;
    if (win_on(st)) {
        const int32_t S = sink_target(c), R = c->cfg.residual, np = c->n_past;
        if (S > 0 && win_reserve(c, &st->sink, S) == 0)
            for (int32_t p = 0; p < S && p < np; p++) {
                int32_t sl = slot_of(c, p);
                if (sl < 0) break;
                win_put(c, &st->sink, x + (size_t)SLOT_OF(sl) * H * D, xv + (size_t)SLOT_OF(sl) * H * D);
            }
        st->rec.p0 = np - R > 0 ? np - R : 0;
        if (R > 0 && win_reserve(c, &st->rec, R) == 0)
            for (int32_t p = st->rec.p0; p < np; p++) {
                int32_t sl = slot_of(c, p);
                if (sl < 0) { /* keep the window contiguous */
                    st->rec.n = 0;
                    st->rec.p0 = p + 1;
                    continue;
                }
                win_put(c, &st->rec, x + (size_t)SLOT_OF(sl) * H * D, xv + (size_t)SLOT_OF(sl) * H * D);
            }
    }
#undef SLOT_OF
    free(x);
    return 0;
}

static int store_to_quantized(struct kv_cache *c) {
    struct kv_store *st = c->impl;
    struct kv_fmt tk = target_k(c), tv = target_v(c);
    if (fmt_eq(st->kf, tk) && fmt_eq(st->vf, tv)) return 0;
    return reencode(c, tk, tv);
}

static int store_append_rows(struct kv_cache *c, int n, const float *k, const float *v, size_t tok, int32_t first);


/* Sets the offsets from the residual window's f16 rows of positions 1..T-1 (it holds
 * every position so far), then re-encodes the packed rows of positions 0..T-1 with
 * them from those f16 rows. (Window rows never carry the offsets.) */
static void offsets_from_window(struct kv_cache *c) {
    struct kv_store *st = c->impl;
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    const int32_t T = mu_tokens(c);
    struct kv_win *w = &st->rec;
    if (w->p0 != 0 || w->n < T) return; /* not the expected shape (e.g. after a trim): no offsets */
    float x[KERN_KVQ_MAX_DIM];
    memset(st->mu, 0, sizeof(float) * 2 * (size_t)H * D);
    for (int side = 0; side < 2; side++)
        for (int h = 0; h < H; h++) {
            float *mu = st->mu + ((size_t)side * H + h) * D;
            const struct kv_fmt *f = side ? &st->wvf : &st->wkf;
            for (int32_t p = 1; p < T; p++) {
                decode_row(st, f, D, row_ptr(side ? w->v : w->k, f, w->cap, h, p), NULL, x);
                for (int i = 0; i < D; i++) mu[i] += x[i] / (float)(T - 1);
            }
        }
    st->mu_set = true;
    for (int side = 0; side < 2; side++) {
        const struct kv_fmt *wf = side ? &st->wvf : &st->wkf, *pf = side ? &st->vf : &st->kf;
        for (int h = 0; h < H; h++) {
            const float *mu = side_mu(st, pf, side, h, D, H);
            for (int32_t p = 0; p < T; p++) {
                uint8_t *wr = row_ptr(side ? w->v : w->k, wf, w->cap, h, p);
                decode_row(st, wf, D, wr, NULL, x);
                int32_t sl = slot_of(c, p);
                if (sl >= 0) encode_row(st, pf, D, x, mu, row_ptr(side ? st->v : st->k, pf, st->cap, h, sl));
            }
        }
    }
}

/* Appends n tokens; `first` is the position of the first token of the whole batch
 * (its queries' needs decide what may be dropped). */
static int store_append_at(struct kv_cache *c, int n, const float *k, const float *v, int32_t first) {
    struct kv_store *st = c->impl;
    const size_t tok = (size_t)c->shape.n_kv_heads * c->shape.head_dim;
    const int32_t T = mu_tokens(c);
    if (!st->mu_set && win_on(st) && T > 0 && c->n_past < T && c->n_past + n > T) {
        /* the offsets are chosen at T tokens: the part after T is encoded with them */
        int n1 = (int)(T - c->n_past);
        if (store_append_at(c, n1, k, v, first) != 0) return -1;
        return store_append_at(c, n - n1, k + (size_t)n1 * tok, v + (size_t)n1 * tok, first);
    }
    if (windows_append(c, n, k, v, tok, first) != 0) return -1;
    int rc = store_append_rows(c, n, k, v, tok, first);
    if (rc == 0 && !st->mu_set && win_on(st) && T > 0 && c->n_past == T) offsets_from_window(c);
    return rc;
}

static int store_append(struct kv_cache *c, int n, const float *k, const float *v) {
    if (n <= 0) return 0;
    if (c->cfg.quantized_start > 0 && c->n_past + n > c->cfg.quantized_start && store_to_quantized(c) != 0) return -1;
    return store_append_at(c, n, k, v, c->n_past);
}

/* Writes the packed rows of n tokens (the windows already took them). */
static int store_append_rows(struct kv_cache *c, int n, const float *k, const float *v, size_t tok, int32_t first) {
    struct kv_store *st = c->impl;
    const int32_t M = c->cfg.max_size, keep = c->cfg.keep, earlier = c->n_past - first; /* same batch */
    if (M > 0 && n == 1 && st->size >= M && earlier == 0) {
        if (st->size > M) { /* back from a multi-token append: trim to the window */
            if (temporal_order(c) != 0) return -1;
            drop_oldest(c, M - keep - 1);
            write_slot(c, st->size, c->n_past, k, v);
            st->size++;
            st->idx = st->size;
        } else { /* in place: overwrite the oldest ring slot */
            if (st->idx >= M) st->idx = keep;
            write_slot(c, st->idx, c->n_past, k, v);
            st->idx++;
        }
        c->n_past++;
        return 0;
    }
    if (M > 0 && st->size + n > M) { /* concatenate: keep what the batch's queries see */
        if (temporal_order(c) != 0) return -1;
        drop_oldest(c, M - keep - 1 + earlier);
    }
    if (store_reserve(c, st->size + n) != 0) return -1;
    for (int t = 0; t < n; t++) write_slot(c, st->size + t, c->n_past + t, k + (size_t)t * tok, v + (size_t)t * tok);
    st->size += n;
    st->idx = st->size;
    c->n_past += n;
    return 0;
}

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

static void run_attn(const struct kv_cache *c, struct kern_attn_state *s, const float *qs, int kv_head, int32_t s0,
                     int32_t n) {
    const struct kv_store *st = c->impl;
    attn_rows(c, s, qs, row_ptr(st->k, &st->kf, st->cap, kv_head, s0), &st->kf,
              row_ptr(st->v, &st->vf, st->cap, kv_head, s0), &st->vf, n);
}

/* Whether a query at q sees position p (rotating window, sliding-window attention). */
static bool visible(const struct kv_cache *c, int32_t p, int32_t q) {
    const int32_t M = c->cfg.max_size, keep = c->cfg.keep, W = c->shape.window;
    return p <= q && (M == 0 || p < keep || p > q - (M - keep)) && (W <= 0 || p > q - W);
}

/* Attention over the window rows of positions [a, b] that q sees, in runs. */
static void win_attn(const struct kv_cache *c, struct kern_attn_state *s, const float *qs, int kv_head,
                     const struct kv_win *w, int32_t a, int32_t b, int32_t q) {
    const struct kv_store *st = c->impl;
    int32_t run0 = -1;
    for (int32_t p = a; p <= b + 1; p++) {
        bool vis = p <= b && visible(c, p, q);
        if (vis && run0 < 0) run0 = p;
        if (!vis && run0 >= 0) {
            int32_t j = run0 - w->p0;
            attn_rows(c, s, qs, row_ptr(w->k, &st->wkf, w->cap, kv_head, j), &st->wkf,
                      row_ptr(w->v, &st->wvf, w->cap, kv_head, j), &st->wvf, p - run0);
            run0 = -1;
        }
    }
}

/* A query at q_pos reads, in this order: the sink rows (f16), the packed rows, and
 * the residual window's f16 rows of positions (q_pos - R, q_pos]. */
static void store_attend(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale,
                         float *out, float *scratch) {
    const struct kv_store *st = c->impl;
    const int D = c->shape.head_dim, group = c->shape.n_heads / c->shape.n_kv_heads;
    float *qs = scratch;
    for (int i = 0; i < group * D; i++) qs[i] = q[i] * scale;
    if (st->kf.rot)
        for (int h = 0; h < group; h++) kern_kvq_hadamard(qs + (size_t)h * D, D, st->signs);
    struct kern_attn_state s;
    kern_attn_state_init(&s, group, D, scratch + (size_t)group * D);
    const int32_t M = c->cfg.max_size, W = c->shape.window, R = c->cfg.residual;
    const bool win = win_on(st);
    /* packed rows serve positions [sn, ws) */
    int32_t sn = win ? st->sink.n : 0, ws = q_pos + 1;
    if (sn > q_pos + 1) sn = q_pos + 1;
    if (win && R > 0 && st->rec.n > 0 && q_pos < st->rec.p0 + st->rec.n) {
        ws = q_pos < mu_tokens(c) ? 0 : q_pos - R + 1; /* before the offsets: all f16 */
        if (ws < st->rec.p0) ws = st->rec.p0;
        if (ws < sn) ws = sn;
        if (ws > q_pos + 1) ws = q_pos + 1;
    }
    if (M == 0) { /* slot == position */
        int32_t hi = ws - 1 < st->size - 1 ? ws - 1 : st->size - 1;
        int32_t lo = W > 0 && q_pos - W + 1 > 0 ? q_pos - W + 1 : 0;
        if (lo < sn) lo = sn;
        if (hi >= lo) run_attn(c, &s, qs, kv_head, lo, hi - lo + 1);
    } else {
        int32_t run0 = -1;
        for (int32_t sl = 0; sl <= st->size; sl++) {
            bool vis = false;
            if (sl < st->size) {
                int32_t p = st->pos[sl];
                vis = p >= sn && p < ws && visible(c, p, q_pos);
            }
            if (vis && run0 < 0) run0 = sl;
            if (!vis && run0 >= 0) {
                run_attn(c, &s, qs, kv_head, run0, sl - run0);
                run0 = -1;
            }
        }
    }
    /* The packed keys lack the key offset: their scores are short of q.mu, the same
     * for all of them, so adding it to the running max makes them comparable with
     * the f16 rows (which carry no offset). The packed values lack the value offset:
     * it comes back weighted by the packed rows' share of the softmax mass. */
    const float *kmu = side_mu(st, &st->kf, 0, kv_head, D, c->shape.n_kv_heads);
    const float *vmu = side_mu(st, &st->vf, 1, kv_head, D, c->shape.n_kv_heads);
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
    if (sn > 0) win_attn(c, &s, qs, kv_head, &st->sink, 0, sn - 1, q_pos);
    if (ws <= q_pos) win_attn(c, &s, qs, kv_head, &st->rec, ws, q_pos, q_pos);
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

static int store_trim(struct kv_cache *c, int n) {
    struct kv_store *st = c->impl;
    if (c->n_past != st->size || st->idx != st->size) return 0; /* wrapped: the window cannot go back */
    if (n > st->size) n = st->size;
    st->size -= n;
    st->idx = st->size;
    c->n_past -= n;
    if (st->sink.n > c->n_past) st->sink.n = c->n_past;
    if (st->rec.p0 + st->rec.n > c->n_past) st->rec.n = c->n_past > st->rec.p0 ? c->n_past - st->rec.p0 : 0;
    return n;
}

static void store_clear(struct kv_cache *c) {
    struct kv_store *st = c->impl;
    st->size = st->idx = 0;
    c->n_past = 0;
    st->mu_set = false;
    st->sink.n = st->rec.n = st->rec.p0 = 0;
    struct kv_fmt ik = initial_fmt(c, c->cfg.k_bits, c->cfg.k_group), iv = initial_fmt(c, c->cfg.v_bits, c->cfg.v_group);
    if (!fmt_eq(st->kf, ik) || !fmt_eq(st->vf, iv)) {
        /* back to the dense phase; storage is re-made for the new row sizes */
        free(st->k);
        free(st->v);
        free(st->pos);
        st->k = st->v = NULL;
        st->pos = NULL;
        st->cap = 0;
        st->kf = ik;
        st->vf = iv;
    }
}

static size_t store_bytes(const struct kv_cache *c) {
    const struct kv_store *st = c->impl;
    size_t held = win_on(st) ? (size_t)(st->sink.n + st->rec.n) : 0;
    return (size_t)c->shape.n_kv_heads *
           ((size_t)st->size * (st->kf.row + st->vf.row) + held * (st->wkf.row + st->wvf.row));
}

static void store_free(struct kv_cache *c) {
    struct kv_store *st = c->impl;
    if (st) {
        free(st->k);
        free(st->v);
        free(st->pos);
        free(st->signs);
        free(st->mu);
        free(st->rec.k);
        free(st->rec.v);
        free(st->sink.k);
        free(st->sink.v);
        free(st);
    }
    c->impl = NULL;
}

static const char *store_kind(const struct kv_cache *c) {
    const struct kv_store *st = c->impl;
    bool q = kern_kvq_bits_quantized(st->kf.bits) || kern_kvq_bits_quantized(st->vf.bits);
    if (c->cfg.max_size > 0) return q ? "quantized-rotating" : "rotating";
    return q ? "quantized" : "dense";
}

static int store_size(const struct kv_cache *c) { return ((const struct kv_store *)c->impl)->size; }

static int store_read_rows(const struct kv_cache *c, int kv_head, int which, float *out, int32_t *pos, int max) {
    const struct kv_store *st = c->impl;
    const struct kv_fmt *f = which ? &st->vf : &st->kf;
    const uint8_t *base = which ? st->v : st->k;
    int D = c->shape.head_dim, n = 0;
    /* temporal order without modifying: pick slots by increasing position */
    int32_t last = -1;
    while (n < max && n < st->size) {
        int32_t best = -1;
        for (int32_t s = 0; s < st->size; s++)
            if (st->pos[s] > last && (best < 0 || st->pos[s] < st->pos[best])) best = s;
        if (best < 0) break;
        decode_row(st, f, D, row_ptr((uint8_t *)base, f, st->cap, kv_head, best),
                   side_mu(st, f, which, kv_head, D, c->shape.n_kv_heads), out + (size_t)n * D);
        if (pos) pos[n] = st->pos[best];
        last = st->pos[best];
        n++;
    }
    return n;
}

/* ---- serialization ----
 * A layer section, version 2 (little-endian):
 *   u32 'KVL2', u32 kind (0 dense, 1 quantized, 2 rotating, 3 quantized-rotating)
 *   i32 config: k_bits v_bits k_group v_group max_size keep quantized_start hadamard residual
 *   i32 n_kv_heads head_dim
 *   i32 stored formats: k_bits k_group k_rot v_bits v_group v_rot
 *   i32 n_past size idx
 *   i32 offsets chosen (0/1), then f32 key and value offsets [2][n_kv_heads][head_dim] if 1
 *   i32 pos[size]; key rows [n_kv_heads][size]; value rows [n_kv_heads][size]
 *   i32 sinks held, residual window first position, residual window rows held; then the
 *   f16 window rows: sink keys [n_kv_heads][sinks], sink values, window keys
 *   [n_kv_heads][rows], window values (all 0 rows for float caches)
 * Slots keep their order, so the ring's rotation index survives a round trip.
 * Version 1 ('KVL1') has no residual in the config and no window part: it loads as
 * residual 0. */
#define LAYER_MAGIC_V1 0x314c564bu /* "KVL1" */
#define LAYER_MAGIC 0x324c564bu    /* "KVL2" */

static int kind_code(const struct kv_cache *c) {
    const char *k = store_kind(c);
    return !strcmp(k, "dense") ? 0 : !strcmp(k, "quantized") ? 1 : !strcmp(k, "rotating") ? 2 : 3;
}

static void store_save(const struct kv_cache *c, struct kv_buf *b) {
    const struct kv_store *st = c->impl;
    const struct kv_cache_config *cf = &c->cfg;
    int32_t hdr[] = {cf->k_bits,   cf->v_bits,          cf->k_group,       cf->v_group,  cf->max_size,
                     cf->keep,     cf->quantized_start, cf->hadamard,      cf->residual, c->shape.n_kv_heads,
                     c->shape.head_dim, st->kf.bits,    st->kf.group,      st->kf.rot,   st->vf.bits,
                     st->vf.group, st->vf.rot,          c->n_past,         st->size,     st->idx};
    kv_buf_u32(b, LAYER_MAGIC);
    kv_buf_u32(b, (uint32_t)kind_code(c));
    for (size_t i = 0; i < sizeof hdr / sizeof hdr[0]; i++) kv_buf_u32(b, (uint32_t)hdr[i]);
    kv_buf_u32(b, st->mu_set);
    size_t n_mu = 2 * (size_t)c->shape.n_kv_heads * c->shape.head_dim;
    for (size_t i = 0; i < n_mu && st->mu_set; i++) {
        uint32_t u;
        memcpy(&u, &st->mu[i], 4);
        kv_buf_u32(b, u);
    }
    for (int32_t s = 0; s < st->size; s++) kv_buf_u32(b, (uint32_t)st->pos[s]);
    for (int h = 0; h < c->shape.n_kv_heads && st->size > 0; h++) /* an empty store may have no blocks */
        kv_buf_put(b, row_ptr(st->k, &st->kf, st->cap, h, 0), st->kf.row * (size_t)st->size);
    for (int h = 0; h < c->shape.n_kv_heads && st->size > 0; h++) /* an empty store may have no blocks */
        kv_buf_put(b, row_ptr(st->v, &st->vf, st->cap, h, 0), st->vf.row * (size_t)st->size);
    bool win = win_on(st);
    int32_t sn = win ? st->sink.n : 0, rn = win ? st->rec.n : 0;
    kv_buf_u32(b, (uint32_t)sn);
    kv_buf_u32(b, (uint32_t)(rn ? st->rec.p0 : 0));
    kv_buf_u32(b, (uint32_t)rn);
    const struct kv_win *ws[2] = {&st->sink, &st->rec};
    for (int w = 0; w < 2; w++) {
        int32_t n = w ? rn : sn;
        for (int h = 0; h < c->shape.n_kv_heads && n > 0; h++)
            kv_buf_put(b, row_ptr(ws[w]->k, &st->wkf, ws[w]->cap, h, 0), st->wkf.row * (size_t)n);
        for (int h = 0; h < c->shape.n_kv_heads && n > 0; h++)
            kv_buf_put(b, row_ptr(ws[w]->v, &st->wvf, ws[w]->cap, h, 0), st->wvf.row * (size_t)n);
    }
}

/* True when n rows of format f hold only finite floats: f16/f32 values, or the
 * f16 scale and bias of every group of a packed row. A checksum-correct file can
 * still carry a NaN, which attention would spread to every later token. */
static bool rows_finite(const uint8_t *p, const struct kv_fmt *f, int d, size_t n) {
    size_t skip = 0, halves = (size_t)d; /* f16 rows: every value */
    if (f->bits == 32) {
        for (size_t i = 0; i < n * (size_t)d; i++) {
            float x;
            memcpy(&x, p + 4 * i, 4);
            if (!isfinite(x)) return false;
        }
        return true;
    }
    if (f->bits != 16) { /* packed: codes, then the groups' scales and biases */
        skip = (size_t)d * (size_t)f->bits / 8;
        halves = 2 * (size_t)(d / f->group);
    }
    for (size_t r = 0; r < n; r++, p += f->row)
        for (size_t i = 0; i < halves; i++) {
            uint16_t h = (uint16_t)(p[skip + 2 * i] | p[skip + 2 * i + 1] << 8);
            if ((h & 0x7c00) == 0x7c00) return false; /* exponent all ones: inf or NaN */
        }
    return true;
}

static int load_fail(struct kv_cache *c, const char *what) {
    store_clear(c);
    return kvq_error("invalid KV cache section: %s", what);
}

static int store_load(struct kv_cache *c, struct kv_reader *r) {
    struct kv_store *st = c->impl;
    uint32_t magic, kind;
    int32_t hv[20], *h = hv + 1, residual = 0;
    store_clear(c);
    if (!kv_read_u32(r, &magic) || (magic != LAYER_MAGIC && magic != LAYER_MAGIC_V1))
        return load_fail(c, "bad layer marker");
    const bool v2 = magic == LAYER_MAGIC;
    if (!kv_read_u32(r, &kind) || kind > 3) return load_fail(c, "unknown cache kind");
    /* h[0..7]: config, h[8..18]: shape, formats and offsets (the v1 layout); v2 has
     * the residual after the config */
    for (int i = 0; i < 8; i++)
        if (!kv_read_i32(r, &h[i])) return load_fail(c, "truncated header");
    if (v2 && !kv_read_i32(r, &residual)) return load_fail(c, "truncated header");
    for (int i = 8; i < 19; i++)
        if (!kv_read_i32(r, &h[i])) return load_fail(c, "truncated header");
    const struct kv_cache_config *cf = &c->cfg;
    if (h[0] != cf->k_bits || h[1] != cf->v_bits || h[2] != cf->k_group || h[3] != cf->v_group ||
        h[4] != cf->max_size || h[5] != cf->keep || h[6] != cf->quantized_start || h[7] != (int32_t)cf->hadamard ||
        residual != cf->residual) {
        store_clear(c);
        return kvq_error("the saved KV cache was made with other settings (K%d/V%d bits, groups %d/%d, max %d, keep "
                         "%d, quantized start %d, rotation %d, residual %d)",
                         h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], residual);
    }
    if (h[8] != c->shape.n_kv_heads || h[9] != c->shape.head_dim) return load_fail(c, "shape differs from the model");
    /* the stored formats must be the config's initial or final ones */
    struct kv_fmt ik = initial_fmt(c, cf->k_bits, cf->k_group), iv = initial_fmt(c, cf->v_bits, cf->v_group);
    struct kv_fmt tk = target_k(c), tv = target_v(c), kf, vf;
    if (h[10] == ik.bits && h[11] == ik.group && h[12] == ik.rot) kf = ik;
    else if (h[10] == tk.bits && h[11] == tk.group && h[12] == tk.rot) kf = tk;
    else return load_fail(c, "key row format");
    if (h[13] == iv.bits && h[14] == iv.group && h[15] == iv.rot) vf = iv;
    else if (h[13] == tv.bits && h[14] == tv.group && h[15] == tv.rot) vf = tv;
    else return load_fail(c, "value row format");
    int32_t n_past = h[16], size = h[17], idx = h[18];
    if (n_past < 0 || size < 0 || size > n_past || idx < 0 || idx > size) return load_fail(c, "offsets");
    if (cf->max_size > 0 && size > cf->max_size && idx != size) return load_fail(c, "rotation index");
    if (cf->max_size == 0 && (size != n_past || idx != size)) return load_fail(c, "offsets");
    int32_t mu_set;
    size_t n_mu = 2 * (size_t)c->shape.n_kv_heads * c->shape.head_dim;
    if (!kv_read_i32(r, &mu_set) || (mu_set != 0 && mu_set != 1)) return load_fail(c, "offsets flag");
    for (size_t i = 0; i < n_mu && mu_set; i++) {
        uint32_t u;
        if (!kv_read_u32(r, &u)) return load_fail(c, "truncated offsets");
        memcpy(&st->mu[i], &u, 4);
        if (!(fabsf(st->mu[i]) < 1e30f)) return load_fail(c, "offsets");
    }
    st->mu_set = mu_set;
    size_t rows = (size_t)size * (size_t)c->shape.n_kv_heads;
    size_t need = (size_t)size * 4 + rows * (kf.row + vf.row);
    if (r->len - r->off < need) return load_fail(c, "truncated rows");
    st->kf = kf;
    st->vf = vf;
    if (kind != (uint32_t)kind_code(c)) return load_fail(c, "cache kind differs from its formats");
    if (store_reserve(c, size) != 0) {
        store_clear(c);
        return -1;
    }
    for (int32_t s = 0; s < size; s++) {
        kv_read_i32(r, &st->pos[s]);
        if (st->pos[s] < 0 || st->pos[s] >= n_past) return load_fail(c, "token position");
        if (cf->max_size == 0 && st->pos[s] != s) return load_fail(c, "token position");
    }
    /* size > 0: an empty store may have no blocks, and NULL + 0 is undefined */
    for (int hh = 0; hh < c->shape.n_kv_heads && size > 0; hh++) kv_read(r, row_ptr(st->k, &st->kf, st->cap, hh, 0), kf.row * (size_t)size);
    for (int hh = 0; hh < c->shape.n_kv_heads && size > 0; hh++) kv_read(r, row_ptr(st->v, &st->vf, st->cap, hh, 0), vf.row * (size_t)size);
    for (int hh = 0; hh < c->shape.n_kv_heads && size > 0; hh++)
        if (!rows_finite(row_ptr(st->k, &kf, st->cap, hh, 0), &kf, c->shape.head_dim, (size_t)size) ||
            !rows_finite(row_ptr(st->v, &vf, st->cap, hh, 0), &vf, c->shape.head_dim, (size_t)size))
            return load_fail(c, "non-finite values in the rows");
    st->size = size;
    st->idx = idx;
    c->n_past = n_past;
    if (!v2) return 0; /* version 1: residual 0, the windows stay empty */
    int32_t sn, rp0, rn;
    if (!kv_read_i32(r, &sn) || !kv_read_i32(r, &rp0) || !kv_read_i32(r, &rn)) return load_fail(c, "truncated windows");
    bool win = win_on(st);
    if (sn < 0 || rn < 0 || rp0 < 0 || (!win && (sn || rn)) || sn > sink_target(c) || sn > n_past ||
        (rn > 0 && (rn > n_past || rp0 != n_past - rn))) /* no rp0 + rn: it can overflow */
        return load_fail(c, "window rows");
    need = ((size_t)sn + (size_t)rn) * (size_t)c->shape.n_kv_heads * (st->wkf.row + st->wvf.row);
    if (r->len - r->off < need) return load_fail(c, "truncated window rows");
    if (win_reserve(c, &st->sink, sn) != 0 || win_reserve(c, &st->rec, rn) != 0) {
        store_clear(c);
        return -1;
    }
    struct kv_win *ws[2] = {&st->sink, &st->rec};
    for (int w = 0; w < 2; w++) {
        int32_t n = w ? rn : sn;
        for (int hh = 0; hh < c->shape.n_kv_heads && n > 0; hh++)
            kv_read(r, row_ptr(ws[w]->k, &st->wkf, ws[w]->cap, hh, 0), st->wkf.row * (size_t)n);
        for (int hh = 0; hh < c->shape.n_kv_heads && n > 0; hh++)
            kv_read(r, row_ptr(ws[w]->v, &st->wvf, ws[w]->cap, hh, 0), st->wvf.row * (size_t)n);
        for (int hh = 0; hh < c->shape.n_kv_heads && n > 0; hh++)
            if (!rows_finite(row_ptr(ws[w]->k, &st->wkf, ws[w]->cap, hh, 0), &st->wkf, c->shape.head_dim, (size_t)n) ||
                !rows_finite(row_ptr(ws[w]->v, &st->wvf, ws[w]->cap, hh, 0), &st->wvf, c->shape.head_dim, (size_t)n))
                return load_fail(c, "non-finite values in the window rows");
    }
    st->sink.n = sn;
    st->rec.p0 = rn ? rp0 : n_past;
    st->rec.n = rn;
    return 0;
}

static const struct kv_cache_ops store_ops = {
    .append = store_append,
    .attend = store_attend,
    .trim = store_trim,
    .clear = store_clear,
    .bytes = store_bytes,
    .free = store_free,
    .to_quantized = store_to_quantized,
    .kind = store_kind,
    .size = store_size,
    .read_rows = store_read_rows,
    .save = store_save,
    .load = store_load,
};

int kv_store_init(struct kv_cache *c) {
    struct kv_store *st = calloc(1, sizeof *st);
    float *signs = malloc(sizeof(float) * (size_t)c->shape.head_dim);
    float *mu = calloc(2 * (size_t)c->shape.n_kv_heads * c->shape.head_dim, sizeof(float));
    if (!st || !signs || !mu) {
        free(st);
        free(signs);
        free(mu);
        return kvq_error("out of memory");
    }
    st->mu = mu;
    kern_kvq_hadamard_signs(signs, c->shape.head_dim, HADAMARD_SEED);
    st->signs = signs;
    st->kf = initial_fmt(c, c->cfg.k_bits, c->cfg.k_group);
    st->vf = initial_fmt(c, c->cfg.v_bits, c->cfg.v_group);
    st->wkf = window_fmt(c, target_k(c));
    st->wvf = window_fmt(c, target_v(c));
    c->impl = st;
    c->ops = &store_ops;
    return 0;
}
