/* The append split a device backend uses (kv_cache_append_begin, then the rows,
 * kv_cache_append_rows, or kv_cache_append_heads a head at a time, and
 * kv_cache_append_end): given the rows a host append writes, it leaves the cache
 * byte for byte as the host append does (saved sections compared), for every cache
 * kind; rows of positions trimmed in between are dropped; and a batch across the
 * offsets' point ends with the offsets chosen, as on the host, or as a device that
 * chooses them hands them over; so too where the device keeps the block rows and the
 * host fetches them (a fork's shared block copied on the device). The CPU backend's
 * append, which encodes a batch's rows on its threads through the same split, leaves
 * every sequence's cache as kv_cache_append does. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "check.h"
#include "kvq.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"

static uint64_t rng = 99;
static float frnd(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) % 20001) / 10000.0f - 1.0f;
}

/* The rows of positions [p0, p0 + n) of a host cache, as a device would hand them over. */
static void rows_of(const struct kv_cache *c, int32_t p0, int n, uint8_t *k, uint8_t *v, uint8_t *wk, uint8_t *wv) {
    struct kv_view vw;
    kv_cache_view(c, &vw);
    const int H = kv_cache_get_shape(c)->n_kv_heads;
    for (int t = 0; t < n; t++) {
        const int32_t p = p0 + t, L = p / KV_BLOCK_TOKENS, e = L < vw.nkb ? L : L - vw.base;
        const uint8_t *blk = vw.blk[e]->data;
        for (int h = 0; h < H; h++) {
            const uint8_t *hb = blk + (size_t)h * vw.head_bytes;
            memcpy(k + ((size_t)t * H + h) * vw.k_row, hb + (size_t)(p % KV_BLOCK_TOKENS) * vw.k_row, vw.k_row);
            memcpy(v + ((size_t)t * H + h) * vw.v_row,
                   hb + (size_t)KV_BLOCK_TOKENS * vw.k_row + (size_t)(p % KV_BLOCK_TOKENS) * vw.v_row, vw.v_row);
            const uint8_t *rk = kv_cache_window_row(c, 0, h, p), *rv = kv_cache_window_row(c, 1, h, p);
            if (rk) memcpy(wk + ((size_t)t * H + h) * vw.win_row, rk, vw.win_row);
            if (rv) memcpy(wv + ((size_t)t * H + h) * vw.win_row, rv, vw.win_row);
        }
    }
}

static bool same_bytes(const struct kv_cache *a, const struct kv_cache *b) {
    struct kv_buf x = {0}, y = {0};
    kv_cache_save(a, &x);
    kv_cache_save(b, &y);
    bool same = !x.oom && !y.oom && x.len == y.len && memcmp(x.data, y.data, x.len) == 0;
    free(x.data);
    free(y.data);
    return same;
}

/* A device that keeps the rows (kv_pool_mirror.fetch), played by host memory: the
 * blocks' device copies are its own, and the host's copies see their rows only
 * through fetch (counted). */
struct fake_dev {
    void **mem;
    int n, cap;
    long fetched, copied, idled;
};

static void *fake_alloc(void *ctx, size_t bytes) {
    struct fake_dev *d = ctx;
    if (d->n == d->cap) {
        d->cap = d->cap ? 2 * d->cap : 256;
        d->mem = realloc(d->mem, sizeof *d->mem * (size_t)d->cap);
    }
    return d->mem[d->n++] = calloc(1, bytes);
}

static void fake_cache_free(void *ctx, void *mirror) { (void)ctx, (void)mirror; }

static int fake_fetch(void *ctx, struct kv_block *const *b, int n, size_t bytes) {
    struct fake_dev *d = ctx;
    for (int i = 0; i < n; i++) memcpy(b[i]->data, b[i]->dev, bytes);
    d->fetched += n;
    return 0;
}

static void fake_copy(void *ctx, struct kv_block *dst, const struct kv_block *src, size_t bytes) {
    struct fake_dev *d = ctx;
    memcpy(dst->dev, src->dev, bytes);
    d->copied++;
}

/* A freed block's host copy given back: its bytes are undefined from here (poisoned). */
static void fake_idle(void *ctx, void *data, size_t bytes) {
    struct fake_dev *d = ctx;
    memset(data, 0xa5, bytes);
    d->idled++;
}

static struct kv_pool *fake_pool(struct fake_dev *d) {
    const struct kv_pool_mirror m = {d, fake_alloc, fake_alloc, fake_cache_free, fake_fetch, fake_copy, fake_idle};
    return kv_pool_new_mirrored(0, &m);
}

static void fake_free(struct kv_pool *p, struct fake_dev *d) {
    kv_pool_free(p);
    for (int i = 0; i < d->n; i++) free(d->mem[i]);
    free(d->mem);
}

/* The rows the host wrote since the last sync, to the device, as a backend does before
 * its encode (whole blocks: a block with rows the host wrote has no stale ones). */
static void fake_sync(struct kv_pool *p) {
    struct kv_block **bl;
    const int n = kv_pool_take_dirty(p, &bl);
    for (int i = 0; i < n; i++)
        if (bl[i]->refs > 0) {
            memcpy(bl[i]->dev, bl[i]->data, kv_block_bytes(p, bl[i]));
            bl[i]->dirty_lo = bl[i]->dirty_hi = 0;
        }
}

/* The device's encode: block rows k, v ([n][H]) of positions [p0, p0 + n) into the
 * device copies, after the host's rows reached them. */
static void fake_put_rows(struct kv_cache *c, int32_t p0, int n, const uint8_t *k, const uint8_t *v) {
    struct kv_view vw;
    kv_cache_view(c, &vw);
    fake_sync(kv_cache_pool(c));
    const int H = kv_cache_get_shape(c)->n_kv_heads;
    for (int t = 0; t < n; t++) {
        const int32_t p = p0 + t;
        uint8_t *blk = vw.blk[kv_view_entry(&vw, p)]->dev;
        for (int h = 0; h < H; h++) {
            uint8_t *hb = blk + (size_t)h * vw.head_bytes;
            memcpy(hb + (size_t)(p % KV_BLOCK_TOKENS) * vw.k_row, k + ((size_t)t * H + h) * vw.k_row, vw.k_row);
            memcpy(hb + (size_t)KV_BLOCK_TOKENS * vw.k_row + (size_t)(p % KV_BLOCK_TOKENS) * vw.v_row,
                   v + ((size_t)t * H + h) * vw.v_row, vw.v_row);
        }
    }
}

struct split_case {
    const char *name;
    struct kv_cache_config cfg;
    int window;
};

/* The rows of head h alone out of rows of H heads: `rows` of `bytes` each. */
static void head_rows(const uint8_t *all, int rows, int H, int h, size_t bytes, uint8_t *out) {
    for (int t = 0; t < rows; t++) memcpy(out + (size_t)t * bytes, all + ((size_t)t * H + h) * bytes, bytes);
}

/* kv_cache_append_rows and _end, then the re-encoding parts it returns (at the offsets' point),
 * last first: they may run in any order. by_heads: the rows handed over a head at a
 * time, last head first (kv_cache_append_heads: tensor parallelism's GPUs each file
 * their heads). */
static int append_end(struct kv_cache *c, int32_t p0, int n, const uint8_t *k, const uint8_t *v, const uint8_t *wk,
                      const uint8_t *wv, int32_t w0, bool by_heads, int *parts) {
    if (!by_heads) {
        kv_cache_append_rows(c, p0, n, k, v, wk, wv, w0);
    } else {
        struct kv_view vw;
        kv_cache_view(c, &vw);
        const int H = kv_cache_get_shape(c)->n_kv_heads, nw = p0 + n - w0;
        uint8_t *hk = malloc(vw.k_row * (size_t)n), *hv = malloc(vw.v_row * (size_t)n);
        uint8_t *hwk = malloc(vw.win_row * (size_t)(nw + 1)), *hwv = malloc(vw.win_row * (size_t)(nw + 1));
        for (int h = H - 1; h >= 0 && hk && hv && hwk && hwv; h--) {
            head_rows(k, n, H, h, vw.k_row, hk);
            head_rows(v, n, H, h, vw.v_row, hv);
            if (vw.windows) head_rows(wk, nw, H, h, vw.win_row, hwk), head_rows(wv, nw, H, h, vw.win_row, hwv);
            kv_cache_append_heads(c, p0, n, hk, hv, hwk, hwv, w0, h, 1);
        }
        free(hk), free(hv), free(hwk), free(hwv);
    }
    *parts = kv_cache_append_end(c, p0, n);
    for (int i = *parts - 1; i >= 0; i--) kv_cache_offsets_part(c, i);
    return *parts < 0 ? -1 : 0;
}

/* later_only: begin as a device that attends from its own windows calls it (the host
 * keeps only the window rows later queries read: the saved bytes are still the same). */
static void run_case(const struct split_case *sc, bool later_only, bool by_heads, bool device_rows) {
    const struct kv_shape shape = {8, 2, 64, sc->window};
    const int H = 2, D = 64;
    /* chunks ending where the offsets are chosen (128, or 100 for a rotating 100) */
    const int chunks[] = {40, 60, 28, 64, 1, 1, 30};
    struct fake_dev dev = {0};
    struct kv_pool *pool = device_rows ? fake_pool(&dev) : NULL;
    struct kv_cache *host = kv_cache_new(&sc->cfg, &shape), *split = kv_cache_new_in(pool, &sc->cfg, &shape);
    CHECK(host && split, "%s: caches: %s", sc->name, kvq_last_error());
    if (!host || !split) return;
    float *k = malloc(sizeof(float) * 64 * H * D), *v = malloc(sizeof(float) * 64 * H * D);
    size_t big = (size_t)64 * H * D * 4;
    uint8_t *rk = malloc(big), *rv = malloc(big), *rwk = malloc(big), *rwv = malloc(big);
    bool all_same = true;
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
        int n = chunks[c];
        for (int i = 0; i < n * H * D; i++) k[i] = frnd() + 0.5f * (float)(i % D == 5), v[i] = frnd();
        int32_t p0 = kv_cache_n_past(host);
        CHECK(kv_cache_append(host, n, k, v) == 0, "%s: host append", sc->name);
        rows_of(host, p0, n, rk, rv, rwk, rwv);
        CHECK(kv_cache_append_begin(split, n, kv_cache_n_past(split), later_only) == 0, "%s: begin: %s", sc->name,
              kvq_last_error());
        CHECK(kv_cache_n_past(split) == p0 + n, "%s: begin advances the sequence", sc->name);
        struct kv_view before, after;
        kv_cache_view(split, &before);
        /* the batch's queries read what they read after a host append, whatever rows
         * the host's windows keep (a device reads them from its own copy) */
        bool same_plans = true;
        for (int32_t q = p0; q < p0 + n; q++) {
            struct kv_query_plan a, b;
            kv_cache_query_plan(host, q, &a);
            kv_cache_query_plan(split, q, &b);
            same_plans = same_plans && !memcmp(&a, &b, sizeof a);
        }
        CHECK(same_plans, "%s: a query of the batch at %d..%d reads other rows", sc->name, p0, p0 + n - 1);
        /* the window rows from w0 on, as a device reads back only those */
        const int32_t w0 = kv_cache_window_rows_from(split, p0);
        CHECK(w0 >= p0 && w0 <= p0 + n && (later_only || w0 == p0 || w0 == p0 + n), "%s: window rows from %d of [%d, %d)",
              sc->name, w0, p0, p0 + n);
        const size_t wo = (size_t)(w0 - p0) * H * before.win_row;
        int parts;
        if (device_rows) fake_put_rows(split, p0, n, rk, rv);
        CHECK(append_end(split, p0, n, device_rows ? NULL : rk, device_rows ? NULL : rv, rwk + wo, rwv + wo, w0, by_heads,
                         &parts) == 0,
              "%s: end: %s", sc->name, kvq_last_error());
        /* a chunk ending at the offsets' point leaves their re-encoding in parts */
        kv_cache_view(split, &after);
        const bool chosen = !before.mu && after.mu;
        CHECK(parts == (chosen ? 2 * H : 0), "%s: end at %d tokens returned %d parts", sc->name, p0 + n, parts);
        all_same = all_same && same_bytes(host, split);
    }
    CHECK(all_same, "%s: begin + rows + end differs from a host append", sc->name);
    CHECK(!device_rows || dev.fetched > 0, "%s: the host's rows came from nowhere", sc->name);
    if (device_rows) { /* rows only the device has, then a fork appends into the block it shares with them
                        * (copied on write): the original keeps its rows */
        struct kv_cache *hf = kv_cache_new_in(kv_cache_pool(host), &sc->cfg, &shape),
                        *sf = kv_cache_new_in(pool, &sc->cfg, &shape);
        for (int i = 0; i < 2; i++) {
            struct kv_cache *h = i ? hf : host, *d = i ? sf : split;
            if (i) CHECK(kv_cache_fork(hf, host) == 0 && kv_cache_fork(sf, split) == 0, "%s: fork", sc->name);
            const int32_t p0 = kv_cache_n_past(d);
            CHECK(kv_cache_append(h, 5, k, v) == 0, "%s: host append", sc->name);
            rows_of(h, p0, 5, rk, rv, rwk, rwv);
            CHECK(kv_cache_append_begin(d, 5, p0, later_only) == 0, "%s: begin", sc->name);
            const int32_t w0 = kv_cache_window_rows_from(d, p0);
            struct kv_view vw;
            kv_cache_view(d, &vw);
            const size_t wo = (size_t)(w0 - p0) * H * vw.win_row;
            fake_put_rows(d, p0, 5, rk, rv);
            int parts;
            CHECK(append_end(d, p0, 5, NULL, NULL, rwk + wo, rwv + wo, w0, false, &parts) == 0, "%s: end", sc->name);
        }
        CHECK(same_bytes(hf, sf) && same_bytes(host, split), "%s: a fork's append through a shared block differs",
              sc->name);
        CHECK(dev.copied > 0, "%s: the shared block was not copied on the device", sc->name);
        kv_cache_free(hf);
        kv_cache_free(sf);
    }
    /* a batch that failed is trimmed away, as on the host; its rows, handed over late,
     * are dropped by end */
    int32_t np = kv_cache_n_past(split);
    CHECK(kv_cache_append(host, 3, k, v) == 0 && kv_cache_trim(host, 3) == 3, "%s: host append + trim", sc->name);
    CHECK(kv_cache_append_begin(split, 3, kv_cache_n_past(split), later_only) == 0, "%s: begin", sc->name);
    CHECK(kv_cache_trim(split, 3) == 3, "%s: trim", sc->name);
    int parts;
    CHECK(append_end(split, np, 3, device_rows ? NULL : rk, device_rows ? NULL : rv, rwk, rwv, np, by_heads, &parts) == 0 &&
              parts == 0 && kv_cache_n_past(split) == np,
          "%s: end after a trim", sc->name);
    /* (with later_only, begin let go of the window rows before the batch that only its
     * queries read: they stay gone, and later queries read those positions packed) */
    CHECK(later_only || same_bytes(host, split), "%s: a dropped batch changed the cache", sc->name);
    printf("%-34s split appends%s%s%s equal host appends: %s\n", sc->name, later_only ? " (later rows only)" : "",
           by_heads ? " (a head at a time)" : "", device_rows ? " (rows kept on the device)" : "", all_same ? "yes" : "NO");
    free(k), free(v), free(rk), free(rv), free(rwk), free(rwv);
    kv_cache_free(host);
    kv_cache_free(split);
    if (pool) fake_free(pool, &dev);
}

/* A batch across the offsets' point: the split append ends with the offsets chosen
 * and every row readable (its rows from the point on come from their f16 copies). */
static void test_across_offsets(void) {
    const struct kv_cache_config cfg = {8, 4, 64, 64, 0, 4, 0, true, 32};
    const struct kv_shape shape = {8, 2, 64, 0};
    const int H = 2, D = 64, n = 150;
    struct kv_cache *host = kv_cache_new(&cfg, &shape), *split = kv_cache_new(&cfg, &shape);
    float *k = malloc(sizeof(float) * n * H * D), *v = malloc(sizeof(float) * n * H * D);
    size_t big = (size_t)n * H * D * 4;
    uint8_t *rk = malloc(big), *rv = malloc(big), *rwk = malloc(big), *rwv = malloc(big);
    for (int i = 0; i < n * H * D; i++) k[i] = frnd() + 0.5f * (float)(i % D == 5), v[i] = frnd();
    CHECK(kv_cache_append(host, n, k, v) == 0, "host append");
    /* the device encodes without offsets (it has none yet): give the split cache such rows */
    struct kv_cache_config plain = cfg;
    plain.residual = 0;
    struct kv_cache *unshifted = kv_cache_new(&plain, &shape);
    CHECK(kv_cache_append(unshifted, n, k, v) == 0, "plain append");
    rows_of(unshifted, 0, n, rk, rv, rwk, rwv);
    CHECK(kv_cache_append_begin(split, n, kv_cache_n_past(split), false) == 0, "begin");
    /* window rows: the host cache's f16 copies (f16 of the rotated input) */
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            const uint8_t *a = kv_cache_window_row(host, 0, h, t), *b = kv_cache_window_row(host, 1, h, t);
            struct kv_view vw;
            kv_cache_view(host, &vw);
            if (a) memcpy(rwk + ((size_t)t * H + h) * vw.win_row, a, vw.win_row);
            if (b) memcpy(rwv + ((size_t)t * H + h) * vw.win_row, b, vw.win_row);
        }
    uint32_t epoch = kv_cache_epoch(split);
    kv_cache_append_rows(split, 0, n, rk, rv, rwk, rwv, 0);
    CHECK(kv_cache_append_end(split, 0, n) == 0, "end: %s", kvq_last_error());
    struct kv_view a, b;
    kv_cache_view(host, &a);
    kv_cache_view(split, &b);
    /* the windows stay as they were: a device copies the offsets alone */
    CHECK(b.mu != NULL && kv_cache_epoch(split) == epoch, "the offsets are chosen at the end of the batch");
    double worst = 0;
    for (int i = 0; a.mu && b.mu && i < 2 * H * D; i++) worst = fmax(worst, fabs(a.mu[i] - b.mu[i]));
    CHECK(worst == 0, "offsets differ from the host's by %g", worst);
    /* every row reads back close to the host cache's (f16 sources for rows >= 128) */
    float *x = malloc(sizeof(float) * n * D), *y = malloc(sizeof(float) * n * D);
    for (int side = 0; side < 2; side++) {
        int na = kv_cache_read_rows(host, 1, side, x, NULL, n), nb = kv_cache_read_rows(split, 1, side, y, NULL, n);
        double err = 0;
        for (int i = 0; i < na * D && na == nb; i++) err = fmax(err, fabs(x[i] - y[i]));
        CHECK(na == nb && err < 0.05, "side %d: rows differ by %g (%d vs %d rows)", side, err, na, nb);
    }
    free(x), free(y), free(k), free(v), free(rk), free(rv), free(rwk), free(rwv);
    kv_cache_free(host);
    kv_cache_free(split);
    kv_cache_free(unshifted);
}

/* A device that chooses the offsets itself in the batch that reaches their point
 * (kv_cache_append_begin_claim, then kv_cache_offsets_given): played here by a host cache's own append,
 * whose rows, earlier blocks and offsets it hands over. The split cache must save byte
 * for byte as the host's, keep only the window rows later queries read, and claim
 * nothing outside that batch. */
static void test_device_offsets(bool device_rows) {
    const struct kv_cache_config cfg = {8, 4, 64, 64, 0, 4, 0, true, 32};
    const struct kv_shape shape = {8, 2, 64, 0};
    const int H = 2, D = 64, chunks[] = {100, 64, 20}, claims[] = {0, 128, 0};
    struct fake_dev dev = {0};
    struct kv_pool *pool = device_rows ? fake_pool(&dev) : NULL;
    struct kv_cache *host = kv_cache_new(&cfg, &shape), *split = kv_cache_new_in(pool, &cfg, &shape);
    float *k = malloc(sizeof(float) * 100 * H * D), *v = malloc(sizeof(float) * 100 * H * D);
    uint8_t *rk = malloc(100 * 4096), *rv = malloc(100 * 4096), *rwk = malloc(100 * 4096), *rwv = malloc(100 * 4096);
    for (int c = 0; c < 3; c++) {
        const int n = chunks[c];
        const int32_t p0 = kv_cache_n_past(split);
        for (int i = 0; i < n * H * D; i++) k[i] = frnd() + 0.5f * (float)(i % D == 5), v[i] = frnd();
        CHECK(kv_cache_append(host, n, k, v) == 0, "host append");
        const int32_t T = kv_cache_append_begin_claim(split, n, p0);
        CHECK(T == claims[c], "chunk %d claims the offsets' point %d, not %d (%s)", c, T, claims[c], kvq_last_error());
        const int32_t w0 = kv_cache_window_rows_from(split, p0);
        rows_of(host, p0, n, rk, rv, rwk, rwv);
        struct kv_view vw;
        kv_cache_view(split, &vw);
        const size_t wo = (size_t)(w0 - p0) * H * vw.win_row;
        if (device_rows) fake_put_rows(split, p0, n, rk, rv);
        kv_cache_append_rows(split, p0, n, device_rows ? NULL : rk, device_rows ? NULL : rv, rwk + wo, rwv + wo, w0);
        if (T > 0) { /* the blocks before the batch as the device encoded them again, and the offsets */
            struct kv_view hv;
            kv_cache_view(host, &hv);
            for (int32_t L = 0; L * KV_BLOCK_TOKENS < p0; L++)
                memcpy(device_rows ? vw.blk[L]->dev : vw.blk[L]->data, hv.blk[L]->data, (size_t)H * hv.head_bytes);
            kv_cache_offsets_given(split, hv.mu);
            /* the window keeps the rows queries after the batch read: its last R */
            CHECK(!kv_cache_window_row(split, 0, 1, p0 + n - 33) && kv_cache_window_row(split, 0, 1, p0 + n - 32),
                  "the window after the offsets' batch holds other rows than its last 32");
        }
        CHECK(kv_cache_append_end(split, p0, n) == 0, "end: %s", kvq_last_error());
        CHECK(same_bytes(host, split), "chunk %d: the cache whose device chose the offsets differs from the host's", c);
    }
    printf("offsets chosen by a device in the batch across them%s: the cache saves as the host's\n",
           device_rows ? " (rows kept on the device)" : "");
    free(k), free(v), free(rk), free(rv), free(rwk), free(rwv);
    kv_cache_free(host);
    kv_cache_free(split);
    if (pool) fake_free(pool, &dev);
}

/* Three sequences appended together through the CPU backend, in batches whose
 * lengths cross the offsets' point (128), the quantize-after-N conversion and block
 * edges, against each sequence appended alone on the host. */
static void test_cpu_backend(const struct split_case *sc) {
    const struct kv_shape shape = {8, 2, 64, sc->window};
    const int H = 2, D = 64, S = 3;
    const int steps[][3] = {{40, 1, 7}, {60, 1, 70}, {28, 1, 1}, {64, 1, 60}, {1, 1, 1}, {1, 130, 1}, {30, 2, 5}};
    struct backend *be = backend_cpu_new(2);
    struct kv_cache *host[3], *cpu[3];
    for (int s = 0; s < S; s++) {
        host[s] = kv_cache_new(&sc->cfg, &shape);
        cpu[s] = kv_cache_new(&sc->cfg, &shape);
    }
    float *k = malloc(sizeof(float) * 256 * H * D), *v = malloc(sizeof(float) * 256 * H * D);
    bool same = be != NULL;
    for (size_t i = 0; i < sizeof steps / sizeof steps[0] && same; i++) {
        struct be_kv_append seqs[3];
        int n = 0;
        for (int s = 0; s < S; s++) {
            seqs[s] = (struct be_kv_append){cpu[s], n, steps[i][s]};
            n += steps[i][s];
        }
        for (int j = 0; j < n * H * D; j++) k[j] = frnd() + 0.5f * (float)(j % D == 5), v[j] = frnd();
        CHECK(be->ops->kv_append(be, seqs, S, k, v, NULL) == 0, "%s: backend append: %s", sc->name, kvq_last_error());
        for (int s = 0; s < S; s++) {
            const size_t off = (size_t)seqs[s].first * H * D;
            CHECK(kv_cache_append(host[s], seqs[s].n, k + off, v + off) == 0, "%s: host append", sc->name);
            same = same && same_bytes(host[s], cpu[s]);
        }
    }
    CHECK(same, "%s: the CPU backend's batched append differs from host appends", sc->name);
    printf("%-34s CPU backend appends equal host appends: %s\n", sc->name, same ? "yes" : "NO");
    free(k), free(v);
    for (int s = 0; s < S; s++) {
        kv_cache_free(host[s]);
        kv_cache_free(cpu[s]);
    }
    if (be) be->ops->free(be);
}

int main(void) {
    static const struct split_case cases[] = {
        {"f16", {16, 16, 64, 64, 0, 4, 0, false, 32}, 0},
        {"K8V4 residual 32, offsets", {8, 4, 64, 64, 0, 4, 0, true, 32}, 0},
        {"K4V2 no window, no rotation", {4, 2, 32, 32, 0, 4, 0, false, 0}, 0},
        {"K8 rotating 200 keep 4", {8, 8, 64, 64, 200, 4, 0, true, 32}, 0},
        {"K4V4 sliding window 100", {4, 4, 64, 64, 100, 4, 0, true, 32}, 100},
        {"quantize after 150, K4V4", {4, 4, 64, 64, 0, 4, 150, true, 32}, 0},
        {"quantize after 50, K8V4", {8, 4, 64, 64, 0, 4, 50, true, 32}, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        run_case(&cases[i], false, false, false);
        run_case(&cases[i], true, false, false);
        run_case(&cases[i], true, true, false);
        run_case(&cases[i], true, false, true);
    }
    test_across_offsets();
    test_device_offsets(false);
    test_device_offsets(true);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_cpu_backend(&cases[i]);
    return check_finish();
}
