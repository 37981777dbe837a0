/* Saving and loading one cache.
 *
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
 * The rows are the held positions in order (idx = size). Files written before the
 * paged cache may hold a rotating cache's slots in ring order: every row is placed at
 * its position, so any order loads.
 * Version 1 ('KVL1') has no residual in the config and no window part: it loads as
 * residual 0. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

#define LAYER_MAGIC_V1 0x314c564bu /* "KVL1" */
#define LAYER_MAGIC 0x324c564bu    /* "KVL2" */

/* ---- little-endian buffers ---- */

void kv_buf_put(struct kv_buf *b, const void *p, size_t n) {
    if (b->oom || n == 0) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        uint8_t *d = realloc(b->data, cap);
        if (!d) {
            b->oom = true;
            return;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}
void kv_buf_u32(struct kv_buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    kv_buf_put(b, x, 4);
}
void kv_buf_u64(struct kv_buf *b, uint64_t v) {
    kv_buf_u32(b, (uint32_t)v);
    kv_buf_u32(b, (uint32_t)(v >> 32));
}
bool kv_read(struct kv_reader *r, void *p, size_t n) {
    if (r->off > r->len || r->len - r->off < n) return false;
    if (n) memcpy(p, r->data + r->off, n);
    r->off += n;
    return true;
}
bool kv_read_u32(struct kv_reader *r, uint32_t *v) {
    uint8_t x[4];
    if (!kv_read(r, x, 4)) return false;
    *v = (uint32_t)x[0] | (uint32_t)x[1] << 8 | (uint32_t)x[2] << 16 | (uint32_t)x[3] << 24;
    return true;
}
bool kv_read_i32(struct kv_reader *r, int32_t *v) {
    uint32_t u;
    if (!kv_read_u32(r, &u)) return false;
    memcpy(v, &u, 4);
    return true;
}
bool kv_read_u64(struct kv_reader *r, uint64_t *v) {
    uint32_t lo, hi;
    if (!kv_read_u32(r, &lo) || !kv_read_u32(r, &hi)) return false;
    *v = (uint64_t)hi << 32 | lo;
    return true;
}

static int kind_code(const struct kv_cache *c) {
    const char *k = kv_store_kind(c);
    return !strcmp(k, "dense") ? 0 : !strcmp(k, "quantized") ? 1 : !strcmp(k, "rotating") ? 2 : 3;
}

void kv_store_save(const struct kv_cache *c, struct kv_buf *b) {
    const struct kv_store *st = store_of(c);
    const struct kv_cache_config *cf = &c->cfg;
    const int H = c->shape.n_kv_heads;
    if (kv_store_fetch(c, 0, c->n_past) != 0) {
        b->oom = true; /* the device's error stands */
        return;
    }
    int32_t size = 0;
    for (int32_t p = 0; p < c->n_past; p++) size += kv_held(c, p);
    int32_t hdr[] = {cf->k_bits,   cf->v_bits,          cf->k_group,       cf->v_group,  cf->max_size,
                     cf->keep,     cf->quantized_start, cf->hadamard,      cf->residual, H,
                     c->shape.head_dim, st->kf.bits,    st->kf.group,      st->kf.rot,   st->vf.bits,
                     st->vf.group, st->vf.rot,          c->n_past,         size,         size};
    kv_buf_u32(b, LAYER_MAGIC);
    kv_buf_u32(b, (uint32_t)kind_code(c));
    for (size_t i = 0; i < sizeof hdr / sizeof hdr[0]; i++) kv_buf_u32(b, (uint32_t)hdr[i]);
    kv_buf_u32(b, st->mu_set);
    size_t n_mu = 2 * (size_t)H * c->shape.head_dim;
    for (size_t i = 0; i < n_mu && st->mu_set; i++) {
        uint32_t u;
        memcpy(&u, &st->mu[i], 4);
        kv_buf_u32(b, u);
    }
    for (int32_t p = 0; p < c->n_past; p++)
        if (kv_held(c, p)) kv_buf_u32(b, (uint32_t)p);
    for (int side = 0; side < 2; side++)
        for (int h = 0; h < H; h++)
            for (int32_t p = 0; p < c->n_past; p++)
                if (kv_held(c, p))
                    kv_buf_put(b, kv_block_row(c, kv_store_block(st, p), side, h, p), side ? st->vf.row : st->kf.row);
    bool win = kv_win_on(st);
    int32_t sn = win ? st->sink->n : 0, rn = win ? st->rec->n : 0;
    /* of the residual window, the last R rows (all before the offsets' point), as a
     * one-token append leaves it: what it holds beyond them depends on how the tokens
     * were batched (kv_windows_make_room) */
    const int32_t T = mu_tokens(c), keep_from = c->n_past >= T ? c->n_past - c->cfg.residual : 0;
    const int32_t skip = rn && keep_from > st->rec->p0 ? keep_from - st->rec->p0 : 0;
    rn -= skip < rn ? skip : rn;
    kv_buf_u32(b, (uint32_t)sn);
    kv_buf_u32(b, (uint32_t)(rn ? st->rec->p0 + skip : 0));
    kv_buf_u32(b, (uint32_t)rn);
    const struct kv_win *ws[2] = {st->sink, st->rec};
    for (int w = 0; w < 2; w++) {
        int32_t n = w ? rn : sn;
        for (int side = 0; side < 2; side++)
            for (int h = 0; h < H && n > 0; h++) {
                const struct kv_fmt *f = side ? &st->wvf : &st->wkf;
                kv_buf_put(b, kv_win_row(ws[w], f, side, h, w ? skip : 0), f->row * (size_t)n);
            }
    }
}

/* True when n rows of format f hold only finite floats: f16/f32 values, or the
 * f16 scale and bias of every group of a uniform packed row. A checksum-correct file can
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
    if (f->group == KERN_KVQ_NF && f->bits != 16) return true; /* a byte scale: every value is finite */
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

/* A side's stored format from its bits, group and rotation (f): one of the config's
 * initial or final formats, else false. */
static bool stored_fmt(const struct kv_cache *c, int side, const int32_t *f, struct kv_fmt *out) {
    const struct kv_fmt cand[2] = {kv_fmt_initial(c, side), kv_fmt_target(c, side)};
    for (int i = 0; i < 2; i++)
        if (f[0] == cand[i].bits && f[1] == cand[i].group && f[2] == (int32_t)cand[i].rot) {
            *out = cand[i];
            return true;
        }
    return false;
}

static int load_fail(struct kv_cache *c, const char *what) {
    kv_store_clear(c);
    return kvq_error_code(KVQ_ERR_FORMAT, "invalid KV cache section: %s", what);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Places the rows of positions pos[0..size) (each holding a key row per head, then a
 * value row per head, at rows_k/rows_v) into fresh blocks. */
static int place_rows(struct kv_cache *c, const int32_t *pos, int32_t size, const uint8_t *rows_k,
                      const uint8_t *rows_v) {
    struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads;
    int32_t *sorted = malloc(sizeof(int32_t) * (size_t)(size ? size : 1));
    if (!sorted) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    memcpy(sorted, pos, sizeof(int32_t) * (size_t)size);
    qsort(sorted, (size_t)size, sizeof *sorted, cmp_i32);
    int rc = 0;
    for (int32_t i = 1; i < size && rc == 0; i++)
        if (sorted[i] == sorted[i - 1])
            rc = kvq_error_code(KVQ_ERR_FORMAT, "invalid KV cache section: repeated token position");
    /* the first block past the kept ones starts the table's sliding part */
    for (int32_t i = 0; i < size && rc == 0; i++)
        if (sorted[i] / KV_BLOCK_TOKENS >= st->nkb) {
            st->base = sorted[i] / KV_BLOCK_TOKENS - st->nkb;
            break;
        }
    free(sorted);
    if (rc != 0) return rc;
    for (int32_t s = 0; s < size; s++) {
        struct kv_block *b = kv_store_block(st, pos[s]);
        if (!b) {
            /* allocate the block of this position (the table grows as needed) */
            int32_t saved = c->n_past;
            c->n_past = pos[s];
            rc = kv_store_reserve_rows(c, 1);
            c->n_past = saved;
            if (rc != 0) return rc;
            b = kv_store_block(st, pos[s]);
        }
        kv_block_touch(st->pool, b, pos[s] % KV_BLOCK_TOKENS, pos[s] % KV_BLOCK_TOKENS + 1);
        for (int h = 0; h < H; h++) {
            memcpy(kv_block_row(c, b, 0, h, pos[s]), rows_k + ((size_t)h * size + s) * st->kf.row, st->kf.row);
            memcpy(kv_block_row(c, b, 1, h, pos[s]), rows_v + ((size_t)h * size + s) * st->vf.row, st->vf.row);
        }
    }
    return 0;
}

int kv_store_load(struct kv_cache *c, struct kv_reader *r) {
    struct kv_store *st = store_of(c);
    uint32_t magic, kind;
    int32_t hv[20], *h = hv + 1, residual = 0;
    kv_store_clear(c);
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
        kv_store_clear(c);
        return kvq_error("the saved KV cache was made with other settings (K%d/V%d bits, groups %d/%d, max %d, keep "
                         "%d, quantized start %d, rotation %d, residual %d)",
                         h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], residual);
    }
    if (h[8] != c->shape.n_kv_heads || h[9] != c->shape.head_dim) return load_fail(c, "shape differs from the model");
    struct kv_fmt kf, vf;
    if (!stored_fmt(c, 0, h + 10, &kf)) return load_fail(c, "key row format");
    if (!stored_fmt(c, 1, h + 13, &vf)) return load_fail(c, "value row format");
    int32_t n_past = h[16], size = h[17], idx = h[18];
    if (n_past < 0 || size < 0 || size > n_past || idx < 0 || idx > size) return load_fail(c, "offsets");
    if (cf->max_size == 0 && c->shape.window <= 0 && (size != n_past || idx != size)) return load_fail(c, "offsets");
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
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)(size ? size : 1));
    if (!pos) {
        kv_store_clear(c);
        return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    }
    int32_t pmin = n_past;
    for (int32_t s = 0; s < size; s++) {
        kv_read_i32(r, &pos[s]);
        bool bad = pos[s] < 0 || pos[s] >= n_past || (cf->max_size == 0 && c->shape.window <= 0 && pos[s] != s);
        if (bad) {
            free(pos);
            return load_fail(c, "token position");
        }
        if (pos[s] >= (cf->max_size > 0 ? cf->keep : 0) && pos[s] < pmin) pmin = pos[s];
    }
    const uint8_t *rows_k = r->data + r->off, *rows_v = rows_k + rows * kf.row;
    r->off += rows * (kf.row + vf.row);
    if (!rows_finite(rows_k, &kf, c->shape.head_dim, rows) || !rows_finite(rows_v, &vf, c->shape.head_dim, rows)) {
        free(pos);
        return load_fail(c, "non-finite values in the rows");
    }
    int rc = place_rows(c, pos, size, rows_k, rows_v);
    free(pos);
    if (rc != 0) {
        kv_store_clear(c);
        return -1;
    }
    c->n_past = n_past;
    /* held from the earliest query that still sees the oldest row */
    int32_t a = n_past > 0 ? n_past - 1 : 0;
    if (cf->max_size > 0 && pmin < n_past && pmin + (cf->max_size - cf->keep) - 1 < a)
        a = pmin + (cf->max_size - cf->keep) - 1;
    if (c->shape.window > 0 && pmin < n_past && pmin + c->shape.window - 1 < a) a = pmin + c->shape.window - 1;
    st->last_first = a > 0 ? a : 0;
    if (!v2) return 0; /* version 1: residual 0, the windows stay empty */
    int32_t sn, rp0, rn;
    if (!kv_read_i32(r, &sn) || !kv_read_i32(r, &rp0) || !kv_read_i32(r, &rn)) return load_fail(c, "truncated windows");
    bool win = kv_win_on(st);
    if (sn < 0 || rn < 0 || rp0 < 0 || (!win && (sn || rn)) || sn > kv_sink_target(c) || sn > n_past ||
        (rn > 0 && (rn > n_past || rp0 != n_past - rn))) /* no rp0 + rn: it can overflow */
        return load_fail(c, "window rows");
    need = ((size_t)sn + (size_t)rn) * (size_t)c->shape.n_kv_heads * (st->wkf.row + st->wvf.row);
    if (r->len - r->off < need) return load_fail(c, "truncated window rows");
    if (kv_win_reserve(c, &st->sink, sn) != 0 || kv_win_reserve(c, &st->rec, rn) != 0) {
        kv_store_clear(c);
        return -1;
    }
    struct kv_win *ws[2] = {st->sink, st->rec};
    st->sink->start = st->rec->start = 0; /* private after the reserve: read in from slot 0, below cap */
    for (int w = 0; w < 2; w++) {
        int32_t n = w ? rn : sn;
        for (int side = 0; side < 2; side++)
            for (int hh = 0; hh < c->shape.n_kv_heads && n > 0; hh++) {
                const struct kv_fmt *f = side ? &st->wvf : &st->wkf;
                kv_read(r, kv_win_row(ws[w], f, side, hh, 0), f->row * (size_t)n);
                if (!rows_finite(kv_win_row(ws[w], f, side, hh, 0), f, c->shape.head_dim, (size_t)n))
                    return load_fail(c, "non-finite values in the window rows");
            }
    }
    st->sink->n = sn;
    st->rec->p0 = rn ? rp0 : n_past;
    st->rec->n = rn;
    return 0;
}

/* ---- a stretch of rows: one layer's part of a shared prefix's block ----
 *   i32 key format: bits group rot; value format: bits group rot
 *   i32 offsets chosen (0/1), then f32 key and value offsets [2][n_kv_heads][head_dim] if 1
 *   i32 sink rows s: the f16 copies of positions [0, s) (a stretch from position 0 only)
 *   key rows [n_kv_heads][n], value rows [n_kv_heads][n] (positions first .. first + n - 1)
 *   f16 sink rows: keys [n_kv_heads][s], values [n_kv_heads][s] (the window format)
 * The offsets travel with every stretch: the rows were encoded with them. */

int kv_store_save_rows(const struct kv_cache *c, int32_t first, int32_t n, struct kv_buf *b) {
    const struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads;
    for (int32_t p = first; p < first + n; p++)
        if (!kv_held(c, p)) return kvq_error("position %d of the KV cache is not held", p);
    if (kv_store_fetch(c, first, first + n) != 0) return -1;
    const int32_t sn = first == 0 && kv_win_on(st) && st->sink->n <= n ? st->sink->n : 0;
    int32_t hdr[] = {st->kf.bits, st->kf.group, st->kf.rot, st->vf.bits, st->vf.group, st->vf.rot, st->mu_set};
    for (size_t i = 0; i < sizeof hdr / sizeof hdr[0]; i++) kv_buf_u32(b, (uint32_t)hdr[i]);
    for (size_t i = 0; st->mu_set && i < 2 * (size_t)H * c->shape.head_dim; i++) {
        uint32_t u;
        memcpy(&u, &st->mu[i], 4);
        kv_buf_u32(b, u);
    }
    kv_buf_u32(b, (uint32_t)sn);
    for (int side = 0; side < 2; side++)
        for (int h = 0; h < H; h++)
            for (int32_t p = first; p < first + n; p++)
                kv_buf_put(b, kv_block_row(c, kv_store_block(st, p), side, h, p), side ? st->vf.row : st->kf.row);
    for (int side = 0; side < 2; side++)
        for (int h = 0; h < H && sn > 0; h++) {
            const struct kv_fmt *f = side ? &st->wvf : &st->wkf;
            kv_buf_put(b, kv_win_row(st->sink, f, side, h, 0), f->row * (size_t)sn);
        }
    return 0;
}

#define F16_MAX 65504.0f /* the largest finite f16 */

/* A stretch read and checked: pointers into the reader's bytes. */
struct kv_rows {
    const struct kv_cache *like; /* a cache of the rows' config (their rotation signs) */
    int32_t n, sinks;
    struct kv_fmt f[2], wf[2];
    bool mu_set;
    float *mu;                    /* [2][n_kv_heads][head_dim] when mu_set */
    const uint8_t *rows[2], *sink_rows[2];
};

void kv_rows_free(struct kv_rows *x) {
    if (!x) return;
    free(x->mu);
    free(x);
}

static struct kv_rows *rows_fail(struct kv_rows *x, const char *what) {
    kv_rows_free(x);
    kvq_error_code(KVQ_ERR_FORMAT, "invalid KV rows: %s", what);
    return NULL;
}

struct kv_rows *kv_rows_read(const struct kv_cache *like, struct kv_reader *r, int32_t n) {
    const int H = like->shape.n_kv_heads, D = like->shape.head_dim;
    struct kv_rows *x = calloc(1, sizeof *x);
    if (!x) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    x->like = like;
    x->n = n;
    int32_t f[7];
    for (int i = 0; i < 7; i++)
        if (!kv_read_i32(r, &f[i])) return rows_fail(x, "truncated header");
    if (!stored_fmt(like, 0, f, &x->f[0]) || !stored_fmt(like, 1, f + 3, &x->f[1])) return rows_fail(x, "row format");
    if (f[6] != 0 && f[6] != 1) return rows_fail(x, "offsets flag");
    x->mu_set = f[6];
    const size_t n_mu = 2 * (size_t)H * D;
    if (x->mu_set && !(x->mu = malloc(sizeof(float) * n_mu))) return rows_fail(x, "out of memory");
    for (size_t i = 0; x->mu_set && i < n_mu; i++) {
        uint32_t u;
        if (!kv_read_u32(r, &u)) return rows_fail(x, "truncated offsets");
        memcpy(&x->mu[i], &u, 4);
        if (!(fabsf(x->mu[i]) <= F16_MAX)) return rows_fail(x, "offsets");
    }
    const bool win = kern_kvq_bits_quantized(x->f[0].bits) || kern_kvq_bits_quantized(x->f[1].bits);
    if (!kv_read_i32(r, &x->sinks) || x->sinks < 0 || x->sinks > n || (!win && x->sinks) ||
        x->sinks > kv_sink_target(like))
        return rows_fail(x, "sink rows");
    const size_t rows = (size_t)n * H, sinks = (size_t)x->sinks * H;
    for (int side = 0; side < 2; side++) {
        x->wf[side] = kv_fmt_window(like, x->f[side]);
        if (r->len - r->off < rows * x->f[side].row) return rows_fail(x, "truncated rows");
        x->rows[side] = r->data + r->off;
        if (!rows_finite(x->rows[side], &x->f[side], D, rows)) return rows_fail(x, "non-finite values");
        r->off += rows * x->f[side].row;
    }
    for (int side = 0; side < 2; side++) {
        if (r->len - r->off < sinks * x->wf[side].row) return rows_fail(x, "truncated sink rows");
        x->sink_rows[side] = r->data + r->off;
        if (!rows_finite(x->sink_rows[side], &x->wf[side], D, sinks)) return rows_fail(x, "non-finite values");
        r->off += sinks * x->wf[side].row;
    }
    return x;
}

/* Whether c takes x's rows as they are: the same formats, and rows encoded with c's
 * offsets (an empty cache takes theirs). */
static bool rows_fit(const struct kv_cache *c, const struct kv_rows *x) {
    const struct kv_store *st = store_of(c);
    if (!kv_fmt_eq(x->f[0], st->kf) || !kv_fmt_eq(x->f[1], st->vf) || x->f[0].row != st->kf.row ||
        x->f[1].row != st->vf.row)
        return false;
    if (!kv_win_on(st) || c->n_past == 0) return true;
    return st->mu_set == x->mu_set &&
           (!x->mu_set || !memcmp(st->mu, x->mu, sizeof(float) * 2 * (size_t)c->shape.n_kv_heads * c->shape.head_dim));
}

/* The rows into new blocks as they are (and, from position 0, the offsets and sinks):
 * the state a cached prefix cut back to this length has. */
static int place_rows_as_is(struct kv_cache *c, const struct kv_rows *x) {
    struct kv_store *st = store_of(c);
    const int H = c->shape.n_kv_heads;
    const int32_t np = c->n_past, n = x->n;
    if (kv_store_reserve_rows(c, n) != 0 || kv_store_fetch(c, np, np + n) != 0) return -1;
    if (np == 0 && x->sinks > 0 && kv_win_reserve(c, &st->sink, x->sinks) != 0) return -1;
    for (int32_t t = 0; t < n; t++) {
        struct kv_block *b = kv_store_block(st, np + t);
        kv_block_touch(st->pool, b, (np + t) % KV_BLOCK_TOKENS, (np + t) % KV_BLOCK_TOKENS + 1);
        for (int side = 0; side < 2; side++)
            for (int h = 0; h < H; h++)
                memcpy(kv_block_row(c, b, side, h, np + t), x->rows[side] + ((size_t)h * n + t) * x->f[side].row,
                       x->f[side].row);
    }
    if (np == 0 && kv_win_on(st)) {
        st->mu_set = x->mu_set;
        if (x->mu_set) memcpy(st->mu, x->mu, sizeof(float) * 2 * (size_t)H * c->shape.head_dim);
        st->sink->start = 0; /* private after the reserve */
        for (int side = 0; side < 2; side++)
            for (int h = 0; h < H && x->sinks > 0; h++)
                memcpy(kv_win_row(st->sink, &x->wf[side], side, h, 0),
                       x->sink_rows[side] + (size_t)h * x->sinks * x->wf[side].row, x->wf[side].row * (size_t)x->sinks);
        st->sink->n = x->sinks;
    }
    c->n_past = np + n;
    st->last_first = c->n_past - 1;
    return 0;
}

/* The rows decoded (the sinks from their f16 copies) and appended as new tokens, a
 * few at a time (a small buffer, reused). Values an f16 row cannot hold are refused:
 * finite scales can still decode beyond it, and the f16 windows, the offsets chosen
 * from them and an f16 cache would turn them into inf and NaN. */
static int append_decoded(struct kv_cache *c, const struct kv_rows *x) {
    const struct kv_store *st = store_of(x->like);
    const int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    const int32_t n = x->n, from_zero = c->n_past == 0;
    int32_t chunk = (int32_t)(8192 / ((size_t)H * D));
    chunk = chunk < 1 ? 1 : chunk > n ? n : chunk;
    float *kv = malloc(sizeof(float) * 2 * (size_t)chunk * H * D);
    int rc = kv ? 0 : kvq_error_code(KVQ_ERR_OOM, "out of memory");
    for (int32_t t0 = 0; t0 < n && rc == 0; t0 += chunk) {
        const int32_t m = n - t0 < chunk ? n - t0 : chunk;
        for (int side = 0; side < 2; side++)
            for (int h = 0; h < H; h++) {
                const float *mu = x->mu_set && kern_kvq_bits_quantized(x->f[side].bits)
                                      ? x->mu + ((size_t)side * H + h) * D
                                      : NULL;
                for (int32_t t = t0; t < t0 + m; t++) {
                    float *out = kv + (((size_t)side * m + (t - t0)) * H + h) * D;
                    if (t < x->sinks && from_zero)
                        kv_decode_row(st, &x->wf[side], D,
                                      x->sink_rows[side] + ((size_t)h * x->sinks + t) * x->wf[side].row, NULL, out);
                    else
                        kv_decode_row(st, &x->f[side], D, x->rows[side] + ((size_t)h * n + t) * x->f[side].row, mu,
                                      out);
                }
            }
        for (size_t i = 0; i < 2 * (size_t)m * H * D && rc == 0; i++)
            if (!(fabsf(kv[i]) <= F16_MAX)) rc = kvq_error_code(KVQ_ERR_FORMAT, "invalid KV rows: values beyond f16");
        if (rc == 0) rc = kv_store_append(c, m, kv, kv + (size_t)m * H * D);
    }
    free(kv);
    return rc;
}

int kv_store_append_rows_from(struct kv_cache *c, const struct kv_rows *x) {
    return rows_fit(c, x) ? place_rows_as_is(c, x) : append_decoded(c, x);
}
