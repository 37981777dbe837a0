/* Quantized KV rows: packing, Hadamard rotation, dispatch and the scalar attention. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu.h"
#include "kernels/asan.h"
#include "kernels/kv_quant_impl.h"
#include "kernels/online_softmax.h"

bool kern_kvq_bits_quantized(int bits) {
    return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 6 || bits == 8;
}

bool kern_kvq_nf_bits(int bits) { return bits >= 2 && bits <= 5; }

static const uint8_t nf_levels2[4] = KERN_KVQ_NF_LEVELS2;
static const uint8_t nf_levels3[8] = KERN_KVQ_NF_LEVELS3;
static const uint8_t nf_levels4[16] = KERN_KVQ_NF_LEVELS4;
static const uint8_t nf_levels5[32] = KERN_KVQ_NF_LEVELS5;

const uint8_t *kern_kvq_nf_levels(int bits) {
    static const uint8_t *const t[6] = {NULL, NULL, nf_levels2, nf_levels3, nf_levels4, nf_levels5};
    return kern_kvq_nf_bits(bits) ? t[bits] : NULL;
}

static float nf_scale_tab[256];
static pthread_once_t nf_scale_once = PTHREAD_ONCE_INIT;
static void nf_scale_init(void) {
    for (int e = 0; e < 256; e++) nf_scale_tab[e] = kvq_nf_scale((uint8_t)e);
}
const float *kern_kvq_nf_scales(void) {
    pthread_once(&nf_scale_once, nf_scale_init);
    return nf_scale_tab;
}

size_t kern_kvq_row_bytes(int bits, int group, int d) {
    if (!kvq_is_quant(bits)) return (size_t)d * (size_t)bits / 8;
    if (group == KERN_KVQ_NF) return (size_t)d * (size_t)bits / 8 + 1;
    if (group <= 0) return (size_t)d * (size_t)bits / 8;
    return (size_t)d * (size_t)bits / 8 + 4 * (size_t)(d / group);
}

/* f16 that saturates instead of overflowing to infinity. */
static uint16_t f16_sat(float x) {
    if (x > 65504.0f) x = 65504.0f;
    if (x < -65504.0f) x = -65504.0f;
    return kvq_f32_to_f16(x);
}

static void pack_codes(const uint8_t *codes, int n, int bits, uint8_t *dst) {
    uint32_t buf = 0;
    int nb = 0;
    for (int i = 0; i < n; i++) {
        buf |= (uint32_t)codes[i] << nb;
        nb += bits;
        while (nb >= 8) {
            *dst++ = (uint8_t)buf;
            buf >>= 8;
            nb -= 8;
        }
    }
    if (nb > 0) *dst = (uint8_t)buf;
}

void kern_kvq_unpack_scalar(const uint8_t *src, int n, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, src, (size_t)n);
        return;
    }
    const uint32_t mask = (1u << bits) - 1;
    uint32_t buf = 0;
    int nb = 0;
    for (int i = 0; i < n; i++) {
        while (nb < bits) {
            buf |= (uint32_t)*src++ << nb;
            nb += 8;
        }
        out[i] = (uint8_t)(buf & mask);
        buf >>= bits;
        nb -= bits;
    }
}

/* ---- normal-float rows ---- */

/* Squared error of x[n] coded with levels lv (centred, ascending) at scale s; the
 * codes to c when not NULL. A code is the number of level midpoints below x (no
 * branches: the compiler vectorizes it). */
static float nf_fit(const float *x, int n, const float *lv, int nl, float s, uint8_t *c) {
    if (n % 16 == 0 && kvq_simd_level() == KVQ_SIMD_AVX512) return kern_kvq_nf_fit_avx512(x, n, lv, nl, s, c);
    if (n % 8 == 0 && kvq_simd_level() == KVQ_SIMD_AVX2) return kern_kvq_nf_fit_avx2(x, n, lv, nl, s, c);
    float thr[32], e = 0;
    kvq_nf_midpoints(lv, nl, s, thr);
    for (int i = 0; i < n; i++) {
        int k = 0;
        for (int t = 0; t + 1 < nl; t++) k += x[i] > thr[t];
        const float d = x[i] - s * lv[k];
        e += d * d;
        if (c) c[i] = (uint8_t)k;
    }
    return e;
}

static uint8_t nf_scale_code(float s) {
    if (!(s > 0)) return 0;
    const float e = 12.0f * log2f(s) + 216.0f;
    return e < 1 ? 1 : e > 255 ? 255 : (uint8_t)lrintf(e);
}

/* The scale: the best of a sweep of clipping points below the row's maximum (the
 * tails of the rotated rows are heavier than a normal's), refined by least squares on
 * its codes (a step of Lloyd's algorithm for the scale), then the best of the stored
 * scales around it. */
static void nf_quantize(const float *x, int d, int bits, uint8_t *dst) {
    const int nl = 1 << bits;
    const uint8_t *u = kern_kvq_nf_levels(bits);
    float lv[32] = {0}, amax = 0;
    for (int k = 0; k < nl; k++) lv[k] = (float)u[k] - 127.5f;
    for (int i = 0; i < d; i++) { /* fmaxf's result (a NaN ignored) without its call */
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    uint8_t c[KERN_KVQ_MAX_DIM];
    float bs = amax / lv[nl - 1], best = INFINITY;
    for (int a = 0; a < 11; a++) {
        const float sc = amax * (1.0f - 0.05f * (float)a) / lv[nl - 1], e = nf_fit(x, d, lv, nl, sc, NULL);
        if (e < best) best = e, bs = sc;
    }
    for (int it = 0; it < 2 && amax > 0; it++) {
        nf_fit(x, d, lv, nl, bs, c);
        double sxl = 0, sll = 0;
        for (int i = 0; i < d; i++) sxl += (double)x[i] * lv[c[i]], sll += (double)lv[c[i]] * lv[c[i]];
        const float sc = sll > 0 ? (float)(sxl / sll) : bs, e = nf_fit(x, d, lv, nl, sc, NULL);
        if (!(e < best)) break;
        best = e, bs = sc;
    }
    const uint8_t e0 = nf_scale_code(bs);
    uint8_t eb = e0;
    best = INFINITY;
    for (int t = e0 - 1; t <= e0 + 1 && e0; t++) {
        if (t < 1 || t > 255) continue;
        const float e = nf_fit(x, d, lv, nl, kvq_nf_scale((uint8_t)t), NULL);
        if (e < best) best = e, eb = (uint8_t)t;
    }
    nf_fit(x, d, lv, nl, kvq_nf_scale(eb), c);
    pack_codes(c, d, bits, dst);
    dst[(size_t)d * bits / 8] = eb;
}

void kern_kvq_quantize_row(const float *x, int d, int bits, int group, uint8_t *dst) {
    if (bits == 32) {
        memcpy(dst, x, (size_t)d * 4);
        return;
    }
    if (bits == 16) {
        switch (kvq_simd_level()) {
        case KVQ_SIMD_AVX512: kern_kvq_to_f16_avx512(x, d, dst); break;
        case KVQ_SIMD_AVX2: kern_kvq_to_f16_avx2(x, d, dst); break;
        default:
            for (int i = 0; i < d; i++) {
                uint16_t h = kvq_f32_to_f16(x[i]);
                memcpy(dst + 2 * i, &h, 2);
            }
        }
        return;
    }
    if (group == KERN_KVQ_NF) {
        nf_quantize(x, d, bits, dst);
        return;
    }
    if ((bits == 4 || bits == 8) && group % 16 == 0) {
        switch (kvq_simd_level()) {
        case KVQ_SIMD_AVX512: kern_kvq_quantize_avx512g(x, d, bits, group, dst); return;
        case KVQ_SIMD_AVX2: kern_kvq_quantize_avx2g(x, d, bits, group, dst); return;
        default: break;
        }
    }
    const int qmax = (1 << bits) - 1;
    uint8_t codes[KERN_KVQ_MAX_DIM];
    uint8_t *sb = dst + (size_t)d * bits / 8;
    for (int g = 0; g < d / group; g++) {
        const float *xg = x + (size_t)g * group;
        float mn, mx, bf, inv;
        kern_kvq_group_range(xg, group, &mn, &mx);
        kern_kvq_group_params(mn, mx, qmax, sb + 4 * g, &bf, &inv);
        for (int i = 0; i < group; i++) {
            float t = floorf((xg[i] - bf) * inv + 0.5f);
            codes[i] = (uint8_t)(t < 0 ? 0 : t > (float)qmax ? qmax : (int)t);
        }
        pack_codes(codes, group, bits, dst + (size_t)g * group * bits / 8);
    }
}

void kern_kvq_group_range(const float *x, int n, float *mn, float *mx) {
    float a = x[0], b = x[0];
    for (int i = 1; i < n; i++) {
        a = x[i] < a ? x[i] : a;
        b = x[i] > b ? x[i] : b;
    }
    *mn = a, *mx = b;
}

void kern_kvq_group_params(float mn, float mx, int qmax, uint8_t *sb, float *bias, float *inv) {
    const uint16_t sh = f16_sat((mx - mn) / (float)qmax), bh = f16_sat(mn);
    const float sf = kvq_f16_to_f32(sh);
    *bias = kvq_f16_to_f32(bh);
    *inv = sf > 0 ? 1.0f / sf : 0.0f;
    memcpy(sb, &sh, 2);
    memcpy(sb + 2, &bh, 2);
}

void kern_kvq_dequantize_row(const uint8_t *src, int d, int bits, int group, float *x) {
    if (bits == 32) {
        memcpy(x, src, (size_t)d * 4);
        return;
    }
    if (bits == 16) {
        switch (kvq_simd_level()) {
        case KVQ_SIMD_AVX512: kern_kvq_from_f16_avx512(src, d, x); break;
        case KVQ_SIMD_AVX2: kern_kvq_from_f16_avx2(src, d, x); break;
        default:
            for (int i = 0; i < d; i++) x[i] = kvq_load_f16(src + 2 * i);
        }
        return;
    }
    uint8_t codes[KERN_KVQ_MAX_DIM];
    kern_kvq_row_codes(src, d, bits, group, codes);
    const uint8_t *sb = src + (size_t)d * bits / 8;
    const int G = kvq_gsize(group, d);
    for (int g = 0; g < d / G; g++) {
        float s, b;
        kvq_gparams(sb, g, group, &s, &b);
        for (int i = g * G; i < (g + 1) * G; i++) x[i] = s * (float)codes[i] + b;
    }
}

/* ---- Hadamard rotation ---- */

static int hadamard_block(int d) {
    int b = d & -d;
    return b > 1024 ? 1024 : b;
}

static void fwht(float *x, int n) {
    if (n >= 16 && kvq_simd_level() == KVQ_SIMD_AVX512) {
        kern_kvq_fwht_avx512(x, n);
        return;
    }
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                float a = x[j], c = x[j + len];
                x[j] = a + c;
                x[j + len] = a - c;
            }
}

/* x <- H diag(signs) x / sqrt(b) in blocks of b, or (inverse) diag(signs) H x / sqrt(b):
 * AVX-512 holds a block of up to 256 in registers, in the same order of operations. */
static void rotate(float *x, int d, const float *signs, bool inverse) {
    const int b = hadamard_block(d);
    const float norm = 1.0f / sqrtf((float)b);
    if (b >= 16 && b <= 256 && kvq_simd_level() == KVQ_SIMD_AVX512) {
        kern_kvq_hadamard_avx512(x, d, b, signs, norm, inverse);
        return;
    }
    if (b >= 8 && kvq_simd_level() >= KVQ_SIMD_AVX2) {
        kern_kvq_hadamard_avx2(x, d, b, signs, norm, inverse);
        return;
    }
    if (!inverse)
        for (int i = 0; i < d; i++) x[i] *= signs[i];
    for (int o = 0; o < d; o += b) fwht(x + o, b);
    for (int i = 0; i < d; i++) x[i] *= inverse ? norm * signs[i] : norm;
}

void kern_kvq_hadamard(float *x, int d, const float *signs) { rotate(x, d, signs, false); }

void kern_kvq_hadamard_inv(float *x, int d, const float *signs) { rotate(x, d, signs, true); }

void kern_kvq_hadamard_signs(float *signs, int d, uint64_t seed) {
    uint64_t z = seed;
    for (int i = 0; i < d; i++) {
        z += 0x9e3779b97f4a7c15ull; /* splitmix64 */
        uint64_t r = z;
        r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
        r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
        r ^= r >> 31;
        signs[i] = (r >> 63) ? -1.0f : 1.0f;
    }
}

/* ---- dispatch ---- */

/* kept for callers that print it; the level is the engine-wide one (core/cpu.h) */
const char *kern_kvq_simd_level(void) { return kvq_simd_name(kvq_simd_level()); }

void kern_kvq_unpack_codes(const uint8_t *src, int n, int bits, uint8_t *out) {
    switch (kvq_simd_level()) {
    case KVQ_SIMD_AVX512: kern_kvq_unpack_avx512(src, n, bits, out); break;
    case KVQ_SIMD_AVX2: kern_kvq_unpack_avx2(src, n, bits, out); break;
    default: kern_kvq_unpack_scalar(src, n, bits, out); break;
    }
}

static void nf_map(uint8_t *c, int n, int bits) {
    const uint8_t *u = kern_kvq_nf_levels(bits);
    for (int i = 0; i < n; i++) c[i] = u[c[i]];
}

void kern_kvq_row_codes_scalar(const uint8_t *src, int n, int bits, int group, uint8_t *out) {
    kern_kvq_unpack_scalar(src, n, bits, out);
    if (group == KERN_KVQ_NF) nf_map(out, n, bits);
}

void kern_kvq_row_codes(const uint8_t *src, int n, int bits, int group, uint8_t *out) {
    kern_kvq_unpack_codes(src, n, bits, out);
    if (group != KERN_KVQ_NF) return;
    switch (kvq_simd_level()) {
    case KVQ_SIMD_AVX512: kern_kvq_nf_map_avx512(out, n, bits); break;
    case KVQ_SIMD_AVX2: kern_kvq_nf_map_avx2(out, n, bits); break;
    default: nf_map(out, n, bits); break;
    }
}

void kern_kvq_use_fast(int on) {
    kern_kvq_use_fast_avx2(on);
    kern_kvq_use_fast_avx512(on);
}

#ifdef KERN_ASAN
/* What the SIMD kernels will touch: the queries, the runs' rows, the state (kernels/asan.h). */
static void attn_runs_ranges(const struct kern_attn_state *s, const float *q, const struct kern_kv_rows *kf,
                             const struct kern_kv_rows *vf, const struct kern_kv_run *runs, int n_runs) {
    const size_t hd = (size_t)s->n_q * (size_t)s->d;
    kern_asan_range(q, hd * sizeof(float));
    for (int i = 0; i < n_runs; i++) {
        kern_asan_rows(runs[i].k, (size_t)runs[i].n, kern_kvq_row_bytes(kf->bits, kf->group, s->d), kf->stride);
        kern_asan_rows(runs[i].v, (size_t)runs[i].n, kern_kvq_row_bytes(vf->bits, vf->group, s->d), vf->stride);
    }
    kern_asan_range(s->acc, hd * sizeof(float));
    kern_asan_range(s->m, (size_t)s->n_q * sizeof(float));
    kern_asan_range(s->l, (size_t)s->n_q * sizeof(float));
}
#else
#define attn_runs_ranges(...) ((void)0)
#endif

void kern_kvq_attn_accumulate(struct kern_attn_state *s, const float *q, const struct kern_kv_rows *k,
                              const struct kern_kv_rows *v, int n) {
    if (n <= 0) return;
    /* The SIMD variants need whole vectors per group. */
    int simd_ok = s->d % 16 == 0 && (!kvq_is_quant(k->bits) || kvq_gsize(k->group, s->d) % 16 == 0) &&
                  (!kvq_is_quant(v->bits) || kvq_gsize(v->group, s->d) % 16 == 0);
    const enum kvq_simd l = simd_ok ? kvq_simd_level() : KVQ_SIMD_SCALAR;
    if (l >= KVQ_SIMD_AVX2) attn_runs_ranges(s, q, k, v, &(struct kern_kv_run){k->data, v->data, n}, 1);
    for (int h0 = 0; h0 < s->n_q; h0 += KVQ_ATTN_MAXH) {
        int nh = s->n_q - h0 < KVQ_ATTN_MAXH ? s->n_q - h0 : KVQ_ATTN_MAXH;
        if (l == KVQ_SIMD_AVX512) kern_kvq_attn_avx512(s, h0, nh, q, k, v, n);
        else if (l == KVQ_SIMD_AVX2) kern_kvq_attn_avx2(s, h0, nh, q, k, v, n);
        else kern_kvq_attn_scalar(s, h0, nh, q, k, v, n);
    }
}

/* ---- scalar attention ---- */

static void load_float_row(const uint8_t *r, int d, int bits, float *out) {
    if (bits == 32) memcpy(out, r, (size_t)d * 4);
    else
        for (int i = 0; i < d; i++) out[i] = kvq_load_f16(r + 2 * i);
}

void kern_kvq_attn_scalar(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                          const struct kern_kv_rows *v, int n) {
    const int d = s->d;
    const bool kq = kvq_is_quant(k->bits), vq = kvq_is_quant(v->bits);
    const int kg = kvq_gsize(k->group, d), vg = kvq_gsize(v->group, d);
    const int kng = kq ? d / kg : 0, vng = vq ? d / vg : 0;
    float qsum[KVQ_ATTN_MAXH][KERN_KVQ_MAX_DIM / 8];
    float sc[KVQ_ATTN_MAXH][KVQ_ATTN_BLOCK];
    uint8_t codes[KERN_KVQ_MAX_DIM];
    float row[KERN_KVQ_MAX_DIM];
    for (int h = 0; h < nh && kq; h++)
        for (int g = 0; g < kng; g++) {
            float t = 0;
            for (int i = g * kg; i < (g + 1) * kg; i++) t += q[(size_t)(h0 + h) * d + i];
            qsum[h][g] = t;
        }
    for (int j0 = 0; j0 < n; j0 += KVQ_ATTN_BLOCK) {
        const int nj = n - j0 < KVQ_ATTN_BLOCK ? n - j0 : KVQ_ATTN_BLOCK;
        for (int j = 0; j < nj; j++) {
            const uint8_t *r = k->data + (size_t)(j0 + j) * k->stride;
            if (kq) {
                kern_kvq_row_codes_scalar(r, d, k->bits, k->group, codes);
                const uint8_t *sb = r + (size_t)d * k->bits / 8;
                for (int h = 0; h < nh; h++) {
                    const float *qh = q + (size_t)(h0 + h) * d;
                    float tot = 0;
                    for (int g = 0; g < kng; g++) {
                        float dot = 0, gs, gb;
                        for (int i = g * kg; i < (g + 1) * kg; i++) dot += qh[i] * (float)codes[i];
                        kvq_gparams(sb, g, k->group, &gs, &gb);
                        tot += gs * dot + gb * qsum[h][g];
                    }
                    sc[h][j] = tot;
                }
            } else {
                load_float_row(r, d, k->bits, row);
                for (int h = 0; h < nh; h++) {
                    const float *qh = q + (size_t)(h0 + h) * d;
                    float dot = 0;
                    for (int i = 0; i < d; i++) dot += qh[i] * row[i];
                    sc[h][j] = dot;
                }
            }
        }
        for (int h = 0; h < nh; h++)
            kern_softmax_step_scalar(sc[h], nj, &s->m[h0 + h], &s->l[h0 + h], s->acc + (size_t)(h0 + h) * d, d);
        for (int j = 0; j < nj; j++) {
            const uint8_t *r = v->data + (size_t)(j0 + j) * v->stride;
            if (vq) {
                kern_kvq_row_codes_scalar(r, d, v->bits, v->group, codes);
                const uint8_t *sb = r + (size_t)d * v->bits / 8;
                for (int g = 0; g < vng; g++) {
                    float gs, gb;
                    kvq_gparams(sb, g, v->group, &gs, &gb);
                    for (int h = 0; h < nh; h++) {
                        float *a = s->acc + (size_t)(h0 + h) * d;
                        float ws = sc[h][j] * gs, wb = sc[h][j] * gb;
                        for (int i = g * vg; i < (g + 1) * vg; i++) a[i] += ws * (float)codes[i] + wb;
                    }
                }
            } else {
                load_float_row(r, d, v->bits, row);
                for (int h = 0; h < nh; h++) {
                    float *a = s->acc + (size_t)(h0 + h) * d;
                    for (int i = 0; i < d; i++) a[i] += sc[h][j] * row[i];
                }
            }
        }
    }
}

void kern_kvq_attn_accumulate_runs(struct kern_attn_state *s, const float *q, const struct kern_kv_rows *kf,
                                   const struct kern_kv_rows *vf, const struct kern_kv_run *runs, int n_runs) {
    const bool dense = kf->bits == vf->bits && !kvq_is_quant(kf->bits);
    const enum kvq_simd level = kvq_simd_level();
    if (!dense && level >= KVQ_SIMD_AVX2 && s->d % 16 == 0) {
        attn_runs_ranges(s, q, kf, vf, runs, n_runs);
        bool done = true;
        for (int h0 = 0; h0 < s->n_q && done; h0 += KVQ_ATTN_MAXH) {
            int nh = s->n_q - h0 < KVQ_ATTN_MAXH ? s->n_q - h0 : KVQ_ATTN_MAXH;
            done = level == KVQ_SIMD_AVX512 ? kern_kvq_attn_avx512_runs(s, h0, nh, q, kf, vf, runs, n_runs)
                                            : kern_kvq_attn_avx2_runs(s, h0, nh, q, kf, vf, runs, n_runs);
        }
        if (done) return;
    }
    for (int i = 0; i < n_runs; i++) {
        /* the next run lies elsewhere in memory: fetch all of it into L2 now, while
         * this one is scored (the kernels prefetch only within a run). Its first 16
         * rows alone, into L1, left batch 16's f16 attention (16 x 6.6 MB of rows per
         * step) waiting on DRAM: the whole run into L2 decoded 7-16% faster
         * (tinydoc-q8_0, depth 1024, batch 16, -t 2, 4 alternating pairs). */
        if (i + 1 < n_runs) kvq_prefetch_run_l2(&runs[i + 1], kf->stride, vf->stride);
        if (dense) {
            kern_attn_accumulate(s, q, runs[i].k, kf->stride * 8 / (size_t)kf->bits, runs[i].v,
                                 vf->stride * 8 / (size_t)vf->bits, kf->bits, runs[i].n);
            continue;
        }
        struct kern_kv_rows k = {runs[i].k, kf->stride, kf->bits, kf->group};
        struct kern_kv_rows v = {runs[i].v, vf->stride, vf->bits, vf->group};
        kern_kvq_attn_accumulate(s, q, &k, &v, runs[i].n);
    }
}
