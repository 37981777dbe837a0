/* Cache kinds on random data: quantized attention vs a float reference, rotating
 * window semantics (keep, wrap-around, multi-token appends, temporal order), trim,
 * quantize-after-N conversion (after wrapping, repeated), memory accounting, save and
 * load of one cache, and config validation. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/error.h"
#include "kernels/kv_quant.h"
#include "kernels/kv_quant_impl.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"

static uint64_t rng = 0x1234567887654321ull;
static float gauss(void) {
    double s = 0;
    for (int i = 0; i < 4; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        s += (double)(rng >> 11) / 9007199254740992.0 - 0.5;
    }
    return (float)(s * 1.7320508);
}

#define H 2
#define NQ 6 /* GQA 3 */
#define D 64
static const struct kv_shape shape = {NQ, H, D, 0};

static struct kv_cache_config cfg_of(int kb, int vb, int g, int max, int keep, int qstart, bool rot) {
    struct kv_cache_config c = {kb, vb, g, g, max, keep, qstart, rot, 0};
    return c;
}

/* History of all tokens appended: [n][H][D] keys and values, as the reference sees them. */
struct hist {
    float *k, *v;
    int n, cap;
};
static void hist_add(struct hist *h, int n, const float *k, const float *v) {
    if (h->n + n > h->cap) {
        h->cap = (h->n + n) * 2;
        h->k = realloc(h->k, sizeof(float) * (size_t)h->cap * H * D);
        h->v = realloc(h->v, sizeof(float) * (size_t)h->cap * H * D);
    }
    memcpy(h->k + (size_t)h->n * H * D, k, sizeof(float) * (size_t)n * H * D);
    memcpy(h->v + (size_t)h->n * H * D, v, sizeof(float) * (size_t)n * H * D);
    h->n += n;
}

/* Reference attention of query position p over the visible history rows (the rows
 * as the cache reconstructs them: quantization itself is test_kv_quant's job). */
static void ref_attend(const struct hist *hs, const struct kv_cache_config *cf, int kvh, const float *q, int p,
                       float *out) {
    float kr[D], vr[D];
    for (int h = 0; h < NQ / H; h++) {
        double mx = -1e300, l = 0, acc[D] = {0};
        double *sc = malloc(sizeof(double) * (size_t)(p + 1));
        for (int t = 0; t <= p; t++) {
            bool vis = cf->max_size == 0 || t < cf->keep || t > p - (cf->max_size - cf->keep);
            sc[t] = -1e300;
            if (!vis) continue;
            memcpy(kr, hs->k + ((size_t)t * H + kvh) * D, sizeof kr);
            double s = 0;
            for (int i = 0; i < D; i++) s += (double)q[h * D + i] * kr[i];
            sc[t] = s / sqrt(D);
            mx = fmax(mx, sc[t]);
        }
        for (int t = 0; t <= p; t++) {
            if (sc[t] < -1e299) continue;
            double w = exp(sc[t] - mx);
            l += w;
            memcpy(vr, hs->v + ((size_t)t * H + kvh) * D, sizeof vr);
            for (int i = 0; i < D; i++) acc[i] += w * vr[i];
        }
        for (int i = 0; i < D; i++) out[h * D + i] = (float)(acc[i] / l);
        free(sc);
    }
}

static float *scratch_new(void) { return malloc(sizeof(float) * kv_cache_scratch_floats(&shape)); }

static void rand_tokens(int n, float *k, float *v) {
    for (int i = 0; i < n * H * D; i++) {
        k[i] = gauss() * ((i % D) == 3 ? 6.0f : 1.0f);
        v[i] = gauss();
    }
}

/* Appends tokens in batches of the given sizes and checks every query of each batch
 * against the reference. */
/* Tokens p0 .. p0 + n - 1 attended together (kv_cache_attend_tokens, as many as it
 * takes at once): each result exactly what the token alone gets; and in parts
 * (kv_cache_attend_part, last to first, then kv_cache_attend_merge) exactly what
 * together gives. */
static void check_together(const struct kv_cache *c, int p0, int n, float *scr, const char *name) {
    const int tmax = kv_cache_attend_tokens_max(&shape);
    const size_t pf = kv_cache_attend_part_floats(&shape);
    for (int t0 = 0; t0 < n; t0 += tmax) {
        const int nt = n - t0 < tmax ? n - t0 : tmax;
        float qs[8][NQ / H * D], alone[8][NQ / H * D], together[8][NQ / H * D], merged[8][NQ / H * D];
        const float *qp[8];
        float *op[8], *mp[8];
        for (int t = 0; t < nt; t++) {
            for (int i = 0; i < NQ / H * D; i++) qs[t][i] = gauss();
            qp[t] = qs[t];
            op[t] = together[t];
            mp[t] = merged[t];
            kv_cache_attend(c, 1, qs[t], p0 + t0 + t, 0.125f, alone[t], scr);
        }
        kv_cache_attend_tokens(c, 1, qp, op, p0 + t0, nt, 0.125f, scr);
        const int np = kv_cache_attend_parts(c, p0 + t0, nt);
        float *parts = malloc(sizeof(float) * pf * (size_t)(np > 0 ? np : 1));
        for (int i = np - 1; i >= 0; i--) kv_cache_attend_part(c, 1, qp, p0 + t0, nt, 0.125f, i, parts + i * pf, scr);
        kv_cache_attend_merge(c, 1, qp, mp, p0 + t0, nt, 0.125f, parts, scr);
        free(parts);
        for (int t = 0; t < nt; t++) {
            CHECK(!memcmp(alone[t], together[t], sizeof alone[t]), "%s: token %d of %d attended together", name,
                  p0 + t0 + t, nt);
            CHECK(!memcmp(merged[t], together[t], sizeof merged[t]), "%s: token %d of %d attended in %d parts", name,
                  p0 + t0 + t, nt, np);
        }
    }
}

static void run_against_ref(const char *name, struct kv_cache_config cf, const int *batches, int n_batches, double tol) {
    struct kv_cache *c = kv_cache_new(&cf, &shape);
    CHECK(c != NULL, "%s: %s", name, kvq_last_error());
    if (!c) return;
    struct hist hs = {0};
    float *scr = scratch_new(), q[NQ / H * D], got[NQ / H * D], want[NQ / H * D];
    double worst = 0;
    for (int b = 0; b < n_batches; b++) {
        int n = batches[b];
        float *k = malloc(sizeof(float) * n * H * D), *v = malloc(sizeof(float) * n * H * D);
        rand_tokens(n, k, v);
        int p0 = kv_cache_n_past(c);
        CHECK(kv_cache_append(c, n, k, v) == 0, "%s append: %s", name, kvq_last_error());
        /* the new tokens as stored: the newest n rows of each head, and close to the input */
        float *rows = malloc(sizeof(float) * (size_t)(kv_cache_size(c) + 1) * D);
        for (int w = 0; w < 2; w++)
            for (int kvh = 0; kvh < H; kvh++) {
                int m = kv_cache_read_rows(c, kvh, w, rows, NULL, kv_cache_size(c));
                for (int t = 0; t < n; t++)
                    for (int i = 0; i < D; i++) {
                        float *dst = (w ? v : k) + ((size_t)t * H + kvh) * D + i;
                        float got = rows[(size_t)(m - n + t) * D + i];
                        CHECK(fabsf(got - *dst) < (cf.k_bits == 32 ? 1e-6f : cf.k_bits == 16 ? 1e-3f * fabsf(*dst) + 1e-6f : 3.0f), "%s: stored row", name);
                        *dst = got;
                    }
            }
        free(rows);
        hist_add(&hs, n, k, v);
        if (cf.max_size == 0) { /* a conversion may have re-encoded every row: take them all */
            for (int w = 0; w < 2; w++)
                for (int kvh = 0; kvh < H; kvh++) {
                    float *all = malloc(sizeof(float) * (size_t)hs.n * D);
                    int m = kv_cache_read_rows(c, kvh, w, all, NULL, hs.n);
                    CHECK(m == hs.n, "%s: rows", name);
                    for (int t = 0; t < m; t++)
                        memcpy((w ? hs.v : hs.k) + ((size_t)t * H + kvh) * D, all + (size_t)t * D, sizeof(float) * D);
                    free(all);
                }
        }
        for (int t = 0; t < n; t++)
            for (int kvh = 0; kvh < H; kvh++) {
                for (int i = 0; i < NQ / H * D; i++) q[i] = gauss();
                kv_cache_attend(c, kvh, q, p0 + t, 1.0f / sqrtf(D), got, scr);
                ref_attend(&hs, &cf, kvh, q, p0 + t, want);
                for (int i = 0; i < NQ / H * D; i++) worst = fmax(worst, fabs(got[i] - want[i]));
            }
        check_together(c, p0, n, scr, name);
        free(k);
        free(v);
    }
    CHECK(worst < tol, "%s: max error vs reference %g", name, worst);
    if (cf.max_size > 0) CHECK(kv_cache_size(c) <= cf.max_size + batches[n_batches - 1] - 1, "%s: size", name);
    printf("%-40s %5d tokens, %4d stored, max error %.2e\n", name, kv_cache_n_past(c), kv_cache_size(c), worst);
    free(hs.k);
    free(hs.v);
    free(scr);
    kv_cache_free(c);
}

static void test_kinds_vs_reference(void) {
    int ones[140], mixed[] = {5, 1, 1, 37, 1, 2, 64, 1, 1, 1, 20, 3, 1, 1};
    for (int i = 0; i < 140; i++) ones[i] = 1;
    int nm = sizeof mixed / sizeof mixed[0];
    run_against_ref("dense f32", cfg_of(32, 32, 64, 0, 4, 0, false), mixed, nm, 1e-5);
    run_against_ref("dense f16", cfg_of(16, 16, 64, 0, 4, 0, false), mixed, nm, 1e-5);
    run_against_ref("quantized K8V8 g64", cfg_of(8, 8, 64, 0, 4, 0, false), mixed, nm, 1e-4);
    run_against_ref("quantized K4V2 g32", cfg_of(4, 2, 32, 0, 4, 0, false), mixed, nm, 1e-4);
    run_against_ref("quantized K3V5 g16", cfg_of(3, 5, 16, 0, 4, 0, false), mixed, nm, 1e-4);
    /* 100 decode steps past max-kv-size 40 with keep 4 */
    run_against_ref("rotating f32 max 40 keep 4, 1-token", cfg_of(32, 32, 64, 40, 4, 0, false), ones, 140, 1e-5);
    run_against_ref("rotating q4 max 40 keep 4, 1-token", cfg_of(4, 4, 64, 40, 4, 0, false), ones, 140, 1e-4);
    run_against_ref("rotating f32 max 40 keep 4, batches", cfg_of(32, 32, 64, 40, 4, 0, false), mixed, nm, 1e-5);
    run_against_ref("rotating K8V4 max 40 keep 4, batches", cfg_of(8, 4, 64, 40, 4, 0, false), mixed, nm, 1e-4);
    run_against_ref("rotating q4 max 16 keep 0, batches", cfg_of(4, 4, 32, 16, 0, 0, false), mixed, nm, 1e-4);
    run_against_ref("rotating hadamard K4V2 max 30 keep 4", cfg_of(4, 2, 32, 30, 4, 0, true), mixed, nm, 1e-4);
    run_against_ref("quantize after 50, K8V4 hadamard", cfg_of(8, 4, 64, 0, 4, 50, true), mixed, nm, 1e-4);
    run_against_ref("normal-float K4V3 hadamard", cfg_of(4, 3, KERN_KVQ_NF, 0, 4, 0, true), mixed, nm, 1e-4);
    run_against_ref("rotating normal-float K3V2 max 30 keep 4", cfg_of(3, 2, KERN_KVQ_NF, 30, 4, 0, true), mixed, nm, 1e-4);
    run_against_ref("quantize after 50, normal-float K5V4", cfg_of(5, 4, KERN_KVQ_NF, 0, 4, 50, true), mixed, nm, 1e-4);
    /* longer than a part of the packed rows (1024 positions): parts merged */
    int longer[] = {700, 1, 400, 1, 1, 64, 300, 1, 2, 700, 1, 1};
    const int nl = sizeof longer / sizeof longer[0];
    run_against_ref("dense f16, 2172 tokens", cfg_of(16, 16, 64, 0, 4, 0, false), longer, nl, 1e-5);
    run_against_ref("quantize after 50, K8V4 hadamard, 2172 tokens", cfg_of(8, 4, 64, 0, 4, 50, true), longer, nl, 1e-4);
    run_against_ref("rotating K4V4 max 1500 keep 4, 2172 tokens", cfg_of(4, 4, 32, 1500, 4, 0, true), longer, nl, 1e-4);
}

/* Rotation: attention with hadamard matches the unrotated float attention closely at
 * 8 bits (dot products are preserved) and a rotated cache reads back un-rotated rows. */
static void test_rotation(void) {
    struct kv_cache_config cf = cfg_of(8, 8, 32, 0, 4, 0, true), cd = cfg_of(32, 32, 64, 0, 4, 0, false);
    struct kv_cache *c = kv_cache_new(&cf, &shape), *r = kv_cache_new(&cd, &shape);
    float k[50 * H * D], v[50 * H * D], q[NQ / H * D], a[NQ / H * D], b[NQ / H * D], rows[50 * D];
    rand_tokens(50, k, v);
    kv_cache_append(c, 50, k, v);
    kv_cache_append(r, 50, k, v);
    float *scr = scratch_new();
    for (int i = 0; i < NQ / H * D; i++) q[i] = gauss();
    kv_cache_attend(c, 1, q, 49, 0.125f, a, scr);
    kv_cache_attend(r, 1, q, 49, 0.125f, b, scr);
    double e = 0;
    for (int i = 0; i < NQ / H * D; i++) e = fmax(e, fabs(a[i] - b[i]));
    CHECK(e < 0.03, "hadamard K8V8 vs f32 attention: %g", e);
    int n = kv_cache_read_rows(c, 1, 0, rows, NULL, 50);
    double re = 0;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < D; i++) re = fmax(re, fabs(rows[t * D + i] - k[(t * H + 1) * D + i]));
    CHECK(n == 50 && re < 0.1, "rotated rows read back: %d rows, error %g", n, re);
    free(scr);
    kv_cache_free(c);
    kv_cache_free(r);
}

/* Conversion (held prefixes in another format) into and out of normal-float rows: into
 * K4V3 nf the rows come back close (relative RMS error of 3-bit Lloyd-Max: ~0.19), out
 * of them into f32 exactly as the nf cache decodes them. */
static void test_convert_nf(void) {
    struct kv_cache_config c8 = cfg_of(8, 8, 64, 0, 4, 0, true), nf = cfg_of(4, 3, KERN_KVQ_NF, 0, 4, 0, true),
                           f32 = cfg_of(32, 32, 64, 0, 4, 0, false);
    c8.residual = nf.residual = 8;
    struct kv_cache *a = kv_cache_new(&c8, &shape);
    struct kv_cache *b = kv_cache_new_in(kv_cache_pool(a), &nf, &shape), *f = kv_cache_new_in(kv_cache_pool(a), &f32, &shape);
    float k[40 * H * D], v[40 * H * D];
    rand_tokens(40, k, v);
    kv_cache_append(a, 40, k, v);
    CHECK(kv_cache_convert(b, a) == 0 && kv_cache_n_past(b) == 40, "convert to nf: %s", kvq_last_error());
    CHECK(kv_cache_convert(f, b) == 0 && kv_cache_n_past(f) == 40, "convert from nf: %s", kvq_last_error());
    static float ra[40 * D], rb[40 * D], rf[40 * D];
    for (int side = 0; side < 2; side++) {
        int na = kv_cache_read_rows(a, 1, side, ra, NULL, 40), nb = kv_cache_read_rows(b, 1, side, rb, NULL, 40);
        int nf2 = kv_cache_read_rows(f, 1, side, rf, NULL, 40);
        double e = 0, x = 0, ef = 0;
        for (int i = 0; i < 40 * D; i++) {
            e += (ra[i] - rb[i]) * (ra[i] - rb[i]), x += ra[i] * ra[i];
            ef = fmax(ef, fabs(rf[i] - rb[i]));
        }
        const double bound = side ? 0.25 : 0.13; /* values 3-bit, keys 4-bit */
        CHECK(na == 40 && nb == 40 && nf2 == 40 && sqrt(e / x) < bound, "side %d: relative RMS error %g after nf conversion", side,
              sqrt(e / x));
        CHECK(ef < 1e-5, "side %d: f32 copy of the nf cache differs by %g", side, ef);
    }
    kv_cache_free(b);
    kv_cache_free(f);
    kv_cache_free(a); /* the pool's owner last */
}

static void test_wrap_convert_trim_bytes(void) {
    /* quantized-rotating built by conversion after the ring has wrapped */
    struct kv_cache_config cf = cfg_of(4, 4, 32, 20, 4, 30, true);
    struct kv_cache *c = kv_cache_new(&cf, &shape);
    float k[H * D], v[H * D];
    for (int t = 0; t < 27; t++) {
        rand_tokens(1, k, v);
        kv_cache_append(c, 1, k, v);
    }
    CHECK(!strcmp(kv_cache_kind(c), "rotating"), "dense phase kind %s", kv_cache_kind(c));
    CHECK(kv_cache_size(c) == 20 && kv_cache_n_past(c) == 27, "wrapped: size %d n_past %d", kv_cache_size(c),
          kv_cache_n_past(c));
    int32_t pos[64], pos2[64];
    float rows[64 * D], rows2[64 * D];
    int n = kv_cache_read_rows(c, 0, 1, rows, pos, 64);
    bool order = n == 20;
    for (int i = 0; i < n; i++) order = order && pos[i] == (i < 4 ? i : 27 - 16 + (i - 4));
    CHECK(order, "temporal order after wrap-around");
    size_t dense_bytes = kv_cache_bytes(c);
    CHECK(kv_cache_to_quantized(c) == 0, "convert: %s", kvq_last_error());
    CHECK(!strcmp(kv_cache_kind(c), "quantized-rotating"), "kind after conversion %s", kv_cache_kind(c));
    CHECK(kv_cache_size(c) == 20 && kv_cache_n_past(c) == 27, "conversion keeps offset");
    size_t qbytes = kv_cache_bytes(c);
    CHECK(qbytes == 20 * kv_cache_token_bytes(&cf, &shape), "bytes %zu", qbytes);
    CHECK(qbytes * 3 < dense_bytes, "quantized %zu vs dense %zu", qbytes, dense_bytes);
    int n2 = kv_cache_read_rows(c, 0, 1, rows2, pos2, 64);
    double e = 0;
    for (int i = 0; i < n2 * D; i++) e = fmax(e, fabs(rows[i] - rows2[i]));
    CHECK(n2 == n && !memcmp(pos, pos2, sizeof(int32_t) * n) && e < 0.6, "converted rows: error %g", e);
    /* idempotent */
    CHECK(kv_cache_to_quantized(c) == 0 && kv_cache_bytes(c) == qbytes, "repeated conversion");
    kv_cache_read_rows(c, 0, 1, rows, pos, 64);
    CHECK(!memcmp(rows, rows2, sizeof(float) * n2 * D), "repeated conversion changes nothing");
    /* the ring keeps rotating in place after conversion (rotation index kept) */
    for (int t = 0; t < 30; t++) {
        rand_tokens(1, k, v);
        CHECK(kv_cache_append(c, 1, k, v) == 0, "append after conversion");
    }
    n = kv_cache_read_rows(c, 0, 0, rows, pos, 64);
    CHECK(n == 20 && pos[3] == 3 && pos[4] == 57 - 16 && pos[19] == 56, "window after conversion: %d %d %d", n,
          pos[4], pos[19]);
    kv_cache_free(c);

    /* a rotating cache goes back only while it holds what the shorter sequence sees:
     * blocks of 64 positions no query can see any more are given back */
    struct kv_cache_config rf = cfg_of(32, 32, 64, 20, 4, 0, false);
    c = kv_cache_new(&rf, &shape);
    for (int t = 0; t < 300; t++) {
        rand_tokens(1, k, v);
        kv_cache_append(c, 1, k, v);
    }
    CHECK(kv_cache_trim(c, 100) == 0 && kv_cache_n_past(c) == 300, "a released window cannot come back");
    CHECK(kv_cache_trim(c, 10) == 10 && kv_cache_n_past(c) == 290 && kv_cache_size(c) == 20, "trim inside the window");
    n = kv_cache_read_rows(c, 0, 0, rows, pos, 64);
    CHECK(n == 20 && pos[3] == 3 && pos[4] == 290 - 16 && pos[19] == 289, "window after trim");
    kv_cache_free(c);

    /* automatic conversion: dense until the sequence exceeds N tokens */
    struct kv_cache_config qs = cfg_of(8, 4, 64, 0, 4, 10, false);
    c = kv_cache_new(&qs, &shape);
    float kk[10 * H * D], vv[10 * H * D];
    rand_tokens(10, kk, vv);
    kv_cache_append(c, 10, kk, vv);
    CHECK(!strcmp(kv_cache_kind(c), "dense"), "dense at N tokens: %s", kv_cache_kind(c));
    kv_cache_append(c, 1, kk, vv);
    CHECK(!strcmp(kv_cache_kind(c), "quantized"), "quantized past N: %s", kv_cache_kind(c));
    CHECK(kv_cache_bytes(c) == 11 * kv_cache_token_bytes(&qs, &shape), "bytes after conversion");
    CHECK(kv_cache_trim(c, 3) == 3 && kv_cache_n_past(c) == 8, "trim");
    kv_cache_clear(c);
    CHECK(!strcmp(kv_cache_kind(c), "dense") && kv_cache_n_past(c) == 0, "clear returns to the dense phase");
    kv_cache_free(c);
}


/* ---- residual window ---- */

static void det_query(int p, int kvh, float *q) {
    for (int i = 0; i < NQ / H * D; i++) q[i] = sinf((float)(p * 131 + kvh * 17 + i) * 0.37f);
}

/* The mean-offset point of kv_store.c: max(R + 1, min(128, max_size or 128)). */
static int mu_point(const struct kv_cache_config *cf) {
    int t = cf->max_size > 0 && cf->max_size < 128 ? cf->max_size : 128;
    return cf->residual + 1 > t ? cf->residual + 1 : t;
}

/* A query at p reads f16 rows for the sinks (t < keep), the window (p - R, p] and
 * every row before the offsets exist (p < T); dequantized rows otherwise. The
 * reference takes the input rows for the former and read_rows for the latter. */
static void test_residual_vs_reference(void) {
    struct kv_cache_config cf = cfg_of(4, 2, 32, 0, 4, 0, true);
    cf.residual = 8;
    const int T = mu_point(&cf), batches[] = {100, 1, 1, 60, 1, 3, 20, 900, 1, 2}; /* past a part (1024) */
    struct kv_cache *c = kv_cache_new(&cf, &shape);
    CHECK(c != NULL, "residual cache: %s", kvq_last_error());
    if (!c) return;
    struct hist raw = {0};
    float *scr = scratch_new(), q[NQ / H * D], got[NQ / H * D], want[NQ / H * D], gotq[NQ / H * D];
    double worst = 0, worst_q = 0;
    for (int b = 0; b < (int)(sizeof batches / sizeof batches[0]); b++) {
        int n = batches[b], p0 = kv_cache_n_past(c);
        float *k = malloc(sizeof(float) * n * H * D), *v = malloc(sizeof(float) * n * H * D);
        rand_tokens(n, k, v);
        CHECK(kv_cache_append(c, n, k, v) == 0, "residual append: %s", kvq_last_error());
        hist_add(&raw, n, k, v);
        struct hist deq = {0}, mix = {0};
        hist_add(&deq, raw.n, raw.k, raw.v);
        hist_add(&mix, raw.n, raw.k, raw.v);
        for (int w = 0; w < 2; w++)
            for (int kvh = 0; kvh < H; kvh++) {
                float *all = malloc(sizeof(float) * (size_t)raw.n * D);
                CHECK(kv_cache_read_rows(c, kvh, w, all, NULL, raw.n) == raw.n, "residual rows");
                for (int t = 0; t < raw.n; t++)
                    memcpy((w ? deq.v : deq.k) + ((size_t)t * H + kvh) * D, all + (size_t)t * D, sizeof(float) * D);
                free(all);
            }
        for (int t = 0; t < n; t++) {
            int p = p0 + t;
            for (int r = 0; r <= p; r++) {
                bool f16 = r < cf.keep || r > p - cf.residual || p < T;
                const struct hist *src = f16 ? &raw : &deq;
                memcpy(mix.k + (size_t)r * H * D, src->k + (size_t)r * H * D, sizeof(float) * H * D);
                memcpy(mix.v + (size_t)r * H * D, src->v + (size_t)r * H * D, sizeof(float) * H * D);
            }
            for (int kvh = 0; kvh < H; kvh++) {
                det_query(p, kvh, q);
                kv_cache_attend(c, kvh, q, p, 1.0f / sqrtf(D), got, scr);
                ref_attend(&mix, &cf, kvh, q, p, want);
                ref_attend(&deq, &cf, kvh, q, p, gotq);
                for (int i = 0; i < NQ / H * D; i++) {
                    worst = fmax(worst, fabs(got[i] - want[i]));
                    worst_q = fmax(worst_q, fabs(gotq[i] - want[i]));
                }
            }
        }
        check_together(c, p0, n, scr, "residual");
        free(deq.k);
        free(deq.v);
        free(mix.k);
        free(mix.v);
        free(k);
        free(v);
    }
    /* f16 rounding of the window rows only; all-dequantized rows are far off */
    CHECK(worst < 4e-3 && worst_q > 10 * worst, "residual vs reference: %g (all packed: %g)", worst, worst_q);
    printf("%-40s %5d tokens, max error %.2e (all packed %.2e)\n", "residual 8, K4/V2 g32 rot", kv_cache_n_past(c),
           worst, worst_q);
    free(raw.k);
    free(raw.v);
    free(scr);
    kv_cache_free(c);
}

/* Rows 0..T-1, encoded before the offsets existed and again with them at T, are as
 * close to their inputs as the rows encoded with them from the start, on keys and
 * values that sit on a per-channel offset (which packed rows without offsets keep at
 * a far larger error). Mean absolute error of read_rows against the inputs. */
static double offsets_rows_error(const struct kv_cache_config *cf, const float *k, const float *v, int n, int lo,
                                 int hi) {
    struct kv_cache *c = kv_cache_new(cf, &shape);
    CHECK(c != NULL, "offsets cache: %s", kvq_last_error());
    if (!c) return 0;
    for (int p = 0; p < n;) { /* a batch up to the offsets' point, then one by one */
        const int m = p == 0 ? mu_point(cf) : 1;
        CHECK(kv_cache_append(c, m, k + (size_t)p * H * D, v + (size_t)p * H * D) == 0, "offsets append: %s",
              kvq_last_error());
        p += m;
    }
    float *rows = malloc(sizeof(float) * (size_t)n * D);
    double err = 0;
    for (int w = 0; w < 2; w++)
        for (int h = 0; h < H; h++) {
            CHECK(kv_cache_read_rows(c, h, w, rows, NULL, n) == n, "offsets rows");
            for (int t = lo; t < hi; t++)
                for (int i = 0; i < D; i++)
                    err += fabs(rows[(size_t)t * D + i] - (w ? v : k)[((size_t)t * H + h) * D + i]);
        }
    free(rows);
    kv_cache_free(c);
    return err / (2.0 * H * D * (hi - lo));
}

static void test_offsets_reencode(void) {
    const int n = 300;
    float *k = malloc(sizeof(float) * n * H * D), *v = malloc(sizeof(float) * n * H * D);
    rand_tokens(n, k, v);
    for (int i = 0; i < n * H * D; i++) { /* every channel off centre */
        k[i] = 0.5f * k[i] + 4.0f * sinf(0.7f * (float)(i % (H * D)));
        v[i] = 0.5f * v[i] + 3.0f * cosf(0.3f * (float)(i % (H * D)));
    }
    for (int rot = 0; rot < 2; rot++) {
        struct kv_cache_config cf = cfg_of(4, 4, 32, 0, 4, 0, rot), none = cf;
        cf.residual = 8;
        const int T = mu_point(&cf);
        const double early = offsets_rows_error(&cf, k, v, n, 1, T), late = offsets_rows_error(&cf, k, v, n, T, n),
                     plain = offsets_rows_error(&none, k, v, n, 1, T);
        CHECK(early > 0 && early < 1.15 * late && plain > 2 * early,
              "rows re-encoded at the offsets' point (rotation %d): error %g, rows after %g, without offsets %g", rot,
              early, late, plain);
        printf("%-40s rows before T %.4f, after %.4f, no offsets %.4f\n", rot ? "offsets re-encode, rotated"
                                                                          : "offsets re-encode, unrotated",
               early, late, plain);
    }
    free(k);
    free(v);
}

/* One batch per chunk and one token at a time give the same attention (bit for bit
 * where slots == positions), and kv_cache_bytes counts the packed rows plus the f16
 * window rows held. The single tokens after the 150 turn the residual window's ring
 * (cut back after the long batch) over several times. */
static void test_residual_batching(void) {
    struct kv_cache_config cfs[] = {cfg_of(4, 2, 32, 0, 4, 0, true), cfg_of(8, 4, 64, 0, 2, 0, false),
                                    cfg_of(4, 4, 32, 48, 4, 0, true), cfg_of(3, 16, 16, 0, 0, 0, true)};
    int rs[] = {8, 16, 8, 200};
    int batches[49] = {70, 1, 90, 5, 1, 30, 40, 150}; /* then 41 single tokens */
    for (int i = 8; i < 49; i++) batches[i] = 1;
    float *scr = scratch_new();
    for (int ci = 0; ci < 4; ci++) {
        struct kv_cache_config cf = cfs[ci];
        cf.residual = rs[ci];
        struct kv_cache *a = kv_cache_new(&cf, &shape), *b = kv_cache_new(&cf, &shape);
        CHECK(a && b, "residual batching %d: %s", ci, kvq_last_error());
        if (!a || !b) return;
        const size_t tb = kv_cache_token_bytes(&cf, &shape), wb = kv_cache_window_bytes(&cf, &shape);
        const size_t rowb = wb / (size_t)(cf.residual + cf.keep);
        CHECK(rowb == (size_t)H * D * (cf.v_bits == 16 ? 4 : 4), "window row bytes");
        double worst = 0;
        bool same = true;
        for (int bi = 0; bi < (int)(sizeof batches / sizeof batches[0]); bi++) {
            int n = batches[bi], p0 = kv_cache_n_past(a);
            float *k = malloc(sizeof(float) * n * H * D), *v = malloc(sizeof(float) * n * H * D);
            float q[NQ / H * D], oa[NQ / H * D], ob[NQ / H * D];
            rand_tokens(n, k, v);
            kv_cache_append(a, n, k, v);
            for (int t = 0; t < n; t++) {
                kv_cache_append(b, 1, k + (size_t)t * H * D, v + (size_t)t * H * D);
                for (int kvh = 0; kvh < H; kvh++) {
                    det_query(p0 + t, kvh, q);
                    kv_cache_attend(b, kvh, q, p0 + t, 0.125f, ob, scr);
                    kv_cache_attend(a, kvh, q, p0 + t, 0.125f, oa, scr);
                    same = same && !memcmp(oa, ob, sizeof oa);
                    for (int i = 0; i < NQ / H * D; i++) worst = fmax(worst, fabs(oa[i] - ob[i]));
                }
            }
            /* exact accounting: packed rows + sinks + the window's rows */
            int np = kv_cache_n_past(a), T = mu_point(&cf);
            size_t sinks = (size_t)(np < cf.keep ? np : cf.keep);
            size_t win_a = p0 < T ? (size_t)np : (size_t)(cf.residual - 1 + n < np ? cf.residual - 1 + n : np);
            size_t win_b = (size_t)(np <= T ? np : cf.residual < np ? cf.residual : np);
            CHECK(kv_cache_bytes(a) == (size_t)kv_cache_size(a) * tb + (sinks + win_a) * rowb,
                  "config %d batch %d: bytes %zu", ci, bi, kv_cache_bytes(a));
            CHECK(kv_cache_bytes(b) == (size_t)kv_cache_size(b) * tb + (sinks + win_b) * rowb,
                  "config %d token-wise: bytes %zu", ci, kv_cache_bytes(b));
            if (np > T && cf.residual < np) CHECK(kv_cache_bytes(b) == (size_t)kv_cache_size(b) * tb + wb, "window formula");
            free(k);
            free(v);
        }
        if (cf.max_size == 0) CHECK(same, "config %d: batch and token-wise attention differ (%g)", ci, worst);
        /* rotating slots split the rows into different runs, which round differently
         * (the fast kernels add the V bias once per block of rows) */
        CHECK(worst <= 1e-5, "config %d: batch vs token-wise %g", ci, worst);
        /* trim keeps the window consistent; the cache keeps working */
        CHECK(kv_cache_trim(b, 3) == (cf.max_size ? 0 : 3), "config %d: trim: %s", ci, kvq_last_error());
        if (cf.max_size == 0) {
            size_t np = (size_t)kv_cache_n_past(b);
            CHECK(kv_cache_bytes(b) == np * tb + (size_t)(cf.keep + (cf.residual - 3 > 0 ? cf.residual - 3 : 0)) * rowb ||
                      cf.residual >= (int)np,
                  "bytes after trim");
        }
        printf("%-40s batch vs token-wise max diff %.1e%s\n", "residual batching", worst, same ? " (identical)" : "");
        kv_cache_free(a);
        kv_cache_free(b);
    }
    free(scr);
}

static void test_save_load(void) {
    struct kv_cache_config cfs[] = {cfg_of(4, 2, 32, 24, 4, 0, true), cfg_of(16, 16, 64, 0, 4, 0, false),
                                    cfg_of(8, 4, 64, 0, 4, 20, false), cfg_of(3, 6, 16, 30, 2, 0, false),
                                    cfg_of(4, 2, 32, 0, 4, 0, true),   cfg_of(4, 4, 32, 24, 4, 0, true),
                                    cfg_of(8, 4, 64, 0, 4, 20, true),  cfg_of(4, 3, KERN_KVQ_NF, 24, 4, 0, true),
                                    cfg_of(3, 2, KERN_KVQ_NF, 0, 4, 20, true)};
    cfs[7].residual = 8;  /* normal-float rows, rotating, with a window */
    cfs[8].residual = 16; /* normal-float rows after 20 */
    cfs[4].residual = 8;  /* version 2: before the offsets' point (every row in the window) */
    cfs[5].residual = 8;  /* rotating: offsets chosen at 24 tokens, window of 8 */
    cfs[6].residual = 16; /* quantize after 20 */
    float *scr = scratch_new();
    for (int ci = 0; ci < (int)(sizeof cfs / sizeof cfs[0]); ci++) {
        struct kv_cache *c = kv_cache_new(&cfs[ci], &shape), *d = kv_cache_new(&cfs[ci], &shape);
        float k[40 * H * D], v[40 * H * D];
        rand_tokens(40, k, v);
        kv_cache_append(c, 13, k, v);
        for (int t = 13; t < 40; t++) kv_cache_append(c, 1, k + t * H * D, v + t * H * D);
        struct kv_buf b = {0};
        kv_cache_save(c, &b);
        CHECK(!b.oom, "save");
        struct kv_reader r = {b.data, b.len, 0};
        CHECK(kv_cache_load(d, &r) == 0 && r.off == b.len, "config %d load: %s", ci, kvq_last_error());
        CHECK(kv_cache_n_past(d) == 40 && kv_cache_size(d) == kv_cache_size(c) &&
                  !strcmp(kv_cache_kind(c), kv_cache_kind(d)) && kv_cache_bytes(c) == kv_cache_bytes(d),
              "config %d state", ci);
        /* continue both identically */
        rand_tokens(5, k, v);
        for (int t = 0; t < 5; t++) {
            kv_cache_append(c, 1, k + t * H * D, v + t * H * D);
            kv_cache_append(d, 1, k + t * H * D, v + t * H * D);
        }
        float q[NQ / H * D], a[NQ / H * D], bb[NQ / H * D];
        for (int i = 0; i < NQ / H * D; i++) q[i] = gauss();
        kv_cache_attend(c, 1, q, 44, 0.1f, a, scr);
        kv_cache_attend(d, 1, q, 44, 0.1f, bb, scr);
        CHECK(!memcmp(a, bb, sizeof a), "config %d: loaded cache attends identically", ci);
        /* truncated and mismatched sections fail cleanly */
        for (size_t cut = 0; cut < b.len; cut += b.len / 17 + 1) {
            struct kv_reader t = {b.data, cut, 0};
            CHECK(kv_cache_load(d, &t) != 0 && kv_cache_n_past(d) == 0, "truncated at %zu accepted", cut);
        }
        struct kv_cache_config other = cfs[ci];
        other.k_bits = other.k_bits == 8 || other.k_group == KERN_KVQ_NF ? 4 + (other.k_bits == 4) : 8;
        struct kv_cache *e = kv_cache_new(&other, &shape);
        struct kv_reader t = {b.data, b.len, 0};
        CHECK(e && kv_cache_load(e, &t) != 0 && strstr(kvq_last_error(), "other settings"), "other config: %s",
              kvq_last_error());
        kv_cache_free(e);
        other = cfs[ci];
        other.residual = other.residual ? 0 : 8;
        e = kv_cache_new(&other, &shape);
        t = (struct kv_reader){b.data, b.len, 0};
        CHECK(e && kv_cache_load(e, &t) != 0 && strstr(kvq_last_error(), "residual"), "other residual: %s",
              kvq_last_error());
        kv_cache_free(e);
        free(b.data);
        kv_cache_free(c);
        kv_cache_free(d);
    }
    free(scr);
}

static void test_validation(void) {
    struct kv_shape s96 = {4, 2, 96, 0};
    struct kv_cache_config c = cfg_of(4, 4, 64, 0, 4, 0, false);
    CHECK(kv_cache_new(&c, &s96) == NULL && strstr(kvq_last_error(), "does not divide head_dim 96"), "G must divide: %s",
          kvq_last_error());
    c = cfg_of(7, 4, 32, 0, 4, 0, false);
    CHECK(kv_cache_new(&c, &shape) == NULL && strstr(kvq_last_error(), "bits"), "bits 7");
    c = cfg_of(4, 4, 24, 0, 4, 0, false);
    CHECK(kv_cache_new(&c, &s96) == NULL && strstr(kvq_last_error(), "group size 24"), "group 24");
    c = cfg_of(4, 4, 32, 8, 8, 0, false);
    CHECK(kv_cache_new(&c, &shape) == NULL, "keep >= max");
    /* memory formula: kv_heads x (head_dim x b/8 + 4 x head_dim/G), K plus V */
    c = cfg_of(4, 2, 32, 0, 4, 0, false);
    c.v_group = 64;
    CHECK(kv_cache_token_bytes(&c, &shape) == (size_t)H * (D * 4 / 8 + 4 * D / 32 + D * 2 / 8 + 4 * D / 64),
          "token bytes");
    c = cfg_of(16, 16, 64, 0, 4, 0, false);
    CHECK(kv_cache_token_bytes(&c, &shape) == (size_t)H * D * 4, "f16 token bytes");
}

/* Window memory given back to the pool comes back for a window of the same size class
 * (rounded up by at most a quarter), already used: not faulted in again. */
static void test_window_memory(void) {
    struct kv_pool *p = kv_pool_new(0);
    bool fresh;
    uint8_t *a = kv_pool_win_alloc(p, 10000, &fresh);
    CHECK(a && fresh, "a first window is fresh memory");
    if (a) memset(a, 1, 10000);
    kv_pool_win_free(p, a, 10000);
    uint8_t *b = kv_pool_win_alloc(p, 9000, &fresh); /* 10000 and 9000: both 10240 */
    CHECK(b == a && !fresh, "memory of the same class comes back (%p, %p, fresh %d)", (void *)a, (void *)b, fresh);
    uint8_t *c = kv_pool_win_alloc(p, 12300, &fresh); /* past 10240: the next class */
    CHECK(c && c != b && fresh, "a larger class is new memory");
    if (b) memset(b, 2, 9000);
    if (c) memset(c, 3, 12300);
    kv_pool_win_free(p, b, 9000);
    kv_pool_win_free(p, c, 12300);
    /* a cache's window grown for a prompt and cut back after it leaves its memory to
     * the next cache's prompt */
    struct kv_cache_config cfg = {.k_bits = 8, .v_bits = 4, .k_group = 32, .v_group = 32, .hadamard = true,
                                  .residual = 8, .keep = 4};
    struct kv_shape sh = {4, 2, 64, 0};
    float *x = malloc(sizeof(float) * 600 * 2 * 64);
    for (int i = 0; i < 600 * 2 * 64; i++) x[i] = sinf(0.37f * (float)i);
    struct kv_cache *k1 = kv_cache_new_in(p, &cfg, &sh);
    /* 128 tokens (the offsets' point: every row so far stays in the window), 372 more
     * (the window then holds 7 + 372 rows: 384), then single tokens (8 rows kept) */
    int rc = kv_cache_append(k1, 128, x, x) | kv_cache_append(k1, 372, x + 128 * 128, x + 128 * 128);
    for (int t = 0; t < 3 && rc == 0; t++) rc = kv_cache_append(k1, 1, x + (500 + t) * 128, x + (500 + t) * 128);
    CHECK(rc == 0, "appends: %s", kvq_last_error());
    const size_t prompt_win = (size_t)2 * 2 * 384 * 2 * 64; /* [H][2 cap][f16 row of 64 values] */
    uint8_t *d = kv_pool_win_alloc(p, prompt_win, &fresh);
    CHECK(d && !fresh, "the prompt's window memory is kept by the pool");
    kv_pool_win_free(p, d, prompt_win);
    kv_cache_free(k1);
    free(x);
    kv_pool_free(p);
}

/* ---- a batch's budget check ---- */

/* The bound from a configuration (kv_config_append_bound) never says less than a
 * cache's exact bytes for the same append, through block boundaries, the offsets'
 * point, a rotating window and a fork's shared blocks; it is one block exactly where
 * an append opens one; and a quantize-after-N cache leaves the check to the exact sum. */
static void test_append_bound(void) {
    struct kv_cache_config cfs[4] = {cfg_of(16, 16, 32, 0, 0, 0, false), cfg_of(8, 4, 32, 0, 0, 0, true),
                                     cfg_of(4, 4, 32, 100, 4, 0, true), cfg_of(8, 4, 64, 0, 4, 40, false)};
    cfs[1].residual = 16;
    cfs[2].residual = 8;
    static const int sizes[] = {1, 5, 63, 64, 130, 300};
    float *k = malloc(sizeof(float) * 300 * H * D), *v = malloc(sizeof(float) * 300 * H * D);
    rand_tokens(300, k, v);
    for (int ci = 0; ci < 4; ci++) {
        const struct kv_append_bound b = kv_config_append_bound(&cfs[ci], &shape);
        CHECK(b.exact_only == (ci == 3), "config %d: exact only %d", ci, b.exact_only);
        struct kv_pool *p = kv_pool_new(0); /* a fork shares blocks within a pool */
        struct kv_cache *c = kv_cache_new_in(p, &cfs[ci], &shape), *f = kv_cache_new_in(p, &cfs[ci], &shape);
        const size_t one = kv_cache_append_bytes(c, 1, 512);
        CHECK(b.exact_only || (one == b.block && kv_append_bound_bytes(&b, 0, 1) == one),
              "config %d: a fresh cache's first token takes a block: %zu, bound %zu of %zu", ci, one,
              kv_append_bound_bytes(&b, 0, 1), b.block);
        int under = 0, checked = 0;
        for (int step = 0; step < 15; step++) {
            for (int side = 0; side < 2 && !b.exact_only; side++) {
                const struct kv_cache *x = side ? f : c;
                for (int j = 0; j < 6; j++, checked++)
                    under += kv_append_bound_bytes(&b, kv_cache_n_past(x), sizes[j]) < kv_cache_append_bytes(x, sizes[j], 512);
            }
            CHECK(kv_cache_append(c, sizes[step % 5], k, v) == 0, "config %d: append: %s", ci, kvq_last_error());
            if (step % 3 == 2) CHECK(kv_cache_fork(f, c) == 0, "config %d: fork: %s", ci, kvq_last_error());
            else CHECK(kv_cache_append(f, 1, k, v) == 0, "config %d: append to the fork: %s", ci, kvq_last_error());
        }
        CHECK(under == 0 && (b.exact_only || checked == 180), "config %d: the bound under the exact bytes %d of %d times",
              ci, under, checked);
        kv_cache_free(c);
        kv_cache_free(f);
        kv_pool_free(p);
    }
    free(k);
    free(v);
}

/* A token's rows encoded in parts (kv_cache_encode_rows: the CPU backend spreads one
 * token's costly rows over its threads) are the bytes of its rows encoded whole, in
 * normal-float and uniform caches with offsets and a residual window; the rows appended
 * through begin / encode / append_rows / end then read as kv_cache_append's. */
static void test_encode_parts(void) {
    const struct kv_cache_config cfgs[] = {cfg_of(4, 3, KERN_KVQ_NF, 0, 4, 0, true),
                                           cfg_of(3, 2, KERN_KVQ_NF, 0, 4, 0, true), cfg_of(8, 4, 32, 0, 4, 0, true)};
    int bad = 0, runs = 0;
    for (size_t ci = 0; ci < sizeof cfgs / sizeof cfgs[0]; ci++) {
        struct kv_cache_config cf = cfgs[ci];
        cf.residual = 16;
        struct kv_cache *a = kv_cache_new(&cf, &shape), *b = kv_cache_new(&cf, &shape);
        CHECK(a && b, "cache %zu", ci);
        if (!a || !b) return;
        float k[H * D], v[H * D];
        for (int t = 0; t < 140; t++) { /* past the offsets' point (128) */
            for (int i = 0; i < H * D; i++) k[i] = gauss(), v[i] = gauss();
            CHECK(kv_cache_append(a, 1, k, v) == 0 && kv_cache_append(b, 1, k, v) == 0, "append %d", t);
        }
        struct kv_view vw;
        kv_cache_view(b, &vw);
        const size_t kn = (size_t)H * vw.k_row, vn = (size_t)H * vw.v_row, wn = (size_t)H * vw.win_row;
        uint8_t *whole = calloc(1, kn + vn + 2 * wn), *split = malloc(kn + vn + 2 * wn);
        for (int t = 0; t < 3 && whole && split; t++) {
            for (int i = 0; i < H * D; i++) k[i] = gauss(), v[i] = gauss();
            const int32_t p0 = kv_cache_n_past(b);
            CHECK(kv_cache_append_begin(b, 1, p0, false) == 0, "begin");
            kv_cache_encode_rows(b, k, v, whole, whole + kn, whole + kn + vn, whole + kn + vn + wn, 0, 1);
            for (int parts = 2; parts <= 2 * H; parts++, runs++) {
                memset(split, 0xA5, kn + vn + 2 * wn);
                for (int p = parts - 1; p >= 0; p--) /* in any order */
                    kv_cache_encode_rows(b, k, v, split, split + kn, split + kn + vn, split + kn + vn + wn, p, parts);
                bad += memcmp(whole, split, kn + vn + 2 * wn) != 0;
            }
            kv_cache_append_rows(b, p0, 1, whole, whole + kn, whole + kn + vn, whole + kn + vn + wn, p0);
            CHECK(kv_cache_append_end(b, p0, 1) == 0, "end");
            CHECK(kv_cache_append(a, 1, k, v) == 0, "append");
        }
        struct kv_buf sa = {0}, sb = {0};
        kv_cache_save(a, &sa);
        kv_cache_save(b, &sb);
        CHECK(sa.len == sb.len && memcmp(sa.data, sb.data, sa.len) == 0,
              "config %zu: rows appended from encoded parts differ from kv_cache_append's", ci);
        free(sa.data), free(sb.data), free(whole), free(split);
        kv_cache_free(a);
        kv_cache_free(b);
    }
    printf("rows encoded in parts: %d of %d differ from the rows encoded whole\n", bad, runs);
    CHECK(bad == 0, "%d of %d encodings in parts differ", bad, runs);
}

int main(void) {
    /* this file checks which rows each query sees against a float reference; the
     * approximations of the AVX-512 fast path are test_kv_quant's */
    kern_kvq_use_fast(0);
    test_kinds_vs_reference();
    test_rotation();
    test_wrap_convert_trim_bytes();
    test_convert_nf();
    test_residual_vs_reference();
    test_offsets_reencode();
    test_residual_batching();
    test_save_load();
    test_validation();
    test_window_memory();
    test_append_bound();
    test_encode_parts();
    return check_finish();
}
