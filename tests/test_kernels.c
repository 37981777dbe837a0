/* Kernel tests: dequantization (hand-built blocks and llama.cpp-made GGUF
 * tensors), kern_matmul vs a double-precision reference for every type and SIMD
 * level, and online-softmax attention vs a naive double softmax. */
#include "check.h"
#include "core/dtype.h"
#include "gguf/gguf.h"
#include "kernels/attention.h"
#include "kernels/f16.h"
#include "kernels/activation.h"
#include "kernels/asan.h"
#include "kernels/kv_quant.h"
#include "kernels/matmul.h"
#include "kernels/matmul_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}
static float frand(void) { return (float)((rnd() & 0xFFFFFF) / 16777216.0 * 2.0 - 1.0); } /* [-1, 1) */
static int irand(int lo, int hi) { return lo + (int)(rnd() % (uint32_t)(hi - lo + 1)); }   /* [lo, hi] */

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }

static const enum kvq_simd all_levels[] = {KVQ_SIMD_SCALAR, KVQ_SIMD_AVX2, KVQ_SIMD_AVX512};
static const char *level_name[] = {"scalar", "avx2", "avx512"};

/* ---- hand-built blocks: pack known integers, check the documented formula ---- */

/* Fills one row of n values of a quantized type from random integers and returns
 * the expected dequantized values (from the ggml formulas) in ref. */
static void build_row(uint32_t type, uint8_t *dst, float *ref, int64_t n) {
    switch (type) {
    case KVQ_Q8_0:
        for (int64_t b = 0; b < n / 32; b++) {
            uint8_t *blk = dst + b * 34;
            uint16_t dh = kvq_f32_to_f16(0.001f + 0.02f * (float)(rnd() % 1000) / 1000.0f);
            put16(blk, dh);
            float d = kvq_f16_to_f32(dh);
            for (int i = 0; i < 32; i++) {
                int q = irand(-128, 127);
                blk[2 + i] = (uint8_t)(int8_t)q;
                ref[b * 32 + i] = d * (float)q;
            }
        }
        break;
    case KVQ_Q4_0:
        for (int64_t b = 0; b < n / 32; b++) {
            uint8_t *blk = dst + b * 18;
            uint16_t dh = kvq_f32_to_f16(0.001f + 0.05f * (float)(rnd() % 1000) / 1000.0f);
            put16(blk, dh);
            float d = kvq_f16_to_f32(dh);
            memset(blk + 2, 0, 16);
            for (int j = 0; j < 32; j++) {
                int q = irand(0, 15); /* element j: low nibble of byte j (j<16), else high nibble of j-16 */
                if (j < 16) blk[2 + j] |= (uint8_t)q;
                else blk[2 + j - 16] |= (uint8_t)(q << 4);
                ref[b * 32 + j] = d * (float)(q - 8);
            }
        }
        break;
    case KVQ_Q4_K:
        for (int64_t b = 0; b < n / 256; b++) {
            uint8_t *blk = dst + b * 144;
            uint16_t dh = kvq_f32_to_f16(0.0005f + 0.002f * (float)(rnd() % 1000) / 1000.0f);
            uint16_t mh = kvq_f32_to_f16(0.0005f + 0.002f * (float)(rnd() % 1000) / 1000.0f);
            put16(blk, dh);
            put16(blk + 2, mh);
            float d = kvq_f16_to_f32(dh), dmin = kvq_f16_to_f32(mh);
            int sc[8], mn[8];
            for (int j = 0; j < 8; j++) {
                sc[j] = irand(0, 63);
                mn[j] = irand(0, 63);
            }
            uint8_t *s = blk + 4; /* 12 bytes: 6-bit scales and mins */
            for (int j = 0; j < 4; j++) {
                s[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
                s[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
                s[j + 8] = (uint8_t)((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
            }
            uint8_t *qs = blk + 16;
            memset(qs, 0, 128);
            for (int e = 0; e < 256; e++) {
                int q = irand(0, 15);
                int c = e / 64, w = e % 64; /* 32-byte chunk c: low nibbles = values 64c..64c+31 */
                if (w < 32) qs[32 * c + w] |= (uint8_t)q;
                else qs[32 * c + w - 32] |= (uint8_t)(q << 4);
                int j = e / 32;
                ref[b * 256 + e] = d * (float)sc[j] * (float)q - dmin * (float)mn[j];
            }
        }
        break;
    case KVQ_Q6_K:
        for (int64_t b = 0; b < n / 256; b++) {
            uint8_t *blk = dst + b * 210;
            uint8_t *ql = blk, *qh = blk + 128;
            int8_t *scales = (int8_t *)(blk + 192);
            memset(blk, 0, 192);
            uint16_t dh = kvq_f32_to_f16(0.0002f + 0.001f * (float)(rnd() % 1000) / 1000.0f);
            put16(blk + 208, dh);
            float d = kvq_f16_to_f32(dh);
            for (int j = 0; j < 16; j++) scales[j] = (int8_t)irand(-128, 127);
            for (int e = 0; e < 256; e++) {
                int q = irand(0, 63);
                int h = e / 128, r = e % 128, qq = r / 32, l = r % 32;
                int li = 64 * h + l + (qq & 1) * 32;
                if (qq < 2) ql[li] |= (uint8_t)(q & 0x0F);
                else ql[li] |= (uint8_t)((q & 0x0F) << 4);
                qh[32 * h + l] |= (uint8_t)((q >> 4) << (2 * qq));
                ref[b * 256 + e] = d * (float)scales[e / 16] * (float)(q - 32);
            }
        }
        break;
    case KVQ_F32:
        for (int64_t i = 0; i < n; i++) {
            ref[i] = frand();
            memcpy(dst + 4 * i, &ref[i], 4);
        }
        break;
    case KVQ_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = kvq_f32_to_f16(frand());
            put16(dst + 2 * i, h);
            ref[i] = kvq_f16_to_f32(h);
        }
        break;
    case KVQ_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = kvq_f32_to_bf16(frand());
            put16(dst + 2 * i, h);
            ref[i] = kvq_bf16_to_f32(h);
        }
        break;
    }
}

static const uint32_t all_types[] = {KVQ_F32, KVQ_F16, KVQ_BF16, KVQ_Q8_0, KVQ_Q4_0, KVQ_Q4_K, KVQ_Q6_K};

static void test_dequant_formula(void) {
    for (size_t ti = 0; ti < sizeof all_types / sizeof all_types[0]; ti++) {
        uint32_t type = all_types[ti];
        const int64_t n = 1024;
        uint8_t *buf = malloc(kvq_dtype_row_bytes(type, n));
        float *ref = malloc(n * sizeof(float)), *out = malloc(n * sizeof(float));
        build_row(type, buf, ref, n);
        kern_dequantize_row(type, buf, out, n);
        int bad = 0;
        for (int64_t i = 0; i < n; i++)
            if (fabsf(out[i] - ref[i]) > 1e-6f * fabsf(ref[i]) + 1e-9f) bad++;
        CHECK(bad == 0, "dequantize %s: %d of %d values differ from the formula", kvq_dtype_name(type), bad, (int)n);
        free(buf);
        free(ref);
        free(out);
    }
}

/* ---- matmul vs double reference ------------------------------------------------ */

static int block_of(uint32_t type) {
    if (type == KVQ_Q8_0 || type == KVQ_Q4_0) return 32;
    if (type == KVQ_Q4_K || type == KVQ_Q6_K) return 256;
    return 0;
}

static void test_matmul_case(uint32_t type, int64_t k, int M, int n_tok) {
    const size_t wrb = kvq_dtype_row_bytes(type, (uint64_t)k);
    uint8_t *w = malloc(wrb * (size_t)M);
    float *wd = malloc(sizeof(float) * (size_t)(M * k));
    for (int r = 0; r < M; r++) build_row(type, w + (size_t)r * wrb, wd + (size_t)r * k, k);
    /* dequantize_row must agree with the formula-built values (checked above);
     * use its output as the weights of the reference */
    for (int r = 0; r < M; r++) kern_dequantize_row(type, w + (size_t)r * wrb, wd + (size_t)r * k, k);

    float *x = malloc(sizeof(float) * (size_t)(n_tok * k));
    for (int64_t i = 0; i < n_tok * k; i++) x[i] = frand() * (1.0f + 3.0f * (float)(i % 7 == 0));
    const size_t xrb = kern_act_row_bytes(type, k);
    uint8_t *xa = malloc(xrb * (size_t)n_tok);
    for (int t = 0; t < n_tok; t++) kern_act_prepare(type, x + (size_t)t * k, xa + (size_t)t * xrb, k);

    /* reference and error bound per (t, r). Quantized activations: each x_i is
     * rounded to a multiple of dx = amax(block)/127, so |x_i - x~_i| <= dx/2 and
     * |dot error| <= sum_i |w_i| dx_i / 2; plus f32 accumulation: 1e-5 sum |w_i x_i|. */
    const int bs = block_of(type);
    double *ref = malloc(sizeof(double) * (size_t)(n_tok * M));
    double *tol = malloc(sizeof(double) * (size_t)(n_tok * M));
    double *tol_s = malloc(sizeof(double) * (size_t)(n_tok * M)); /* SIMD vs scalar: f32 rounding only */
    for (int t = 0; t < n_tok; t++) {
        const float *xt = x + (size_t)t * k;
        for (int r = 0; r < M; r++) {
            const float *wr = wd + (size_t)r * k;
            double s = 0, sabs = 0, qerr = 0;
            for (int64_t b0 = 0; b0 < k; b0 += (bs ? bs : k)) {
                int64_t b1 = b0 + (bs ? bs : k);
                double amax = 0;
                for (int64_t i = b0; i < b1; i++) amax = fmax(amax, fabs(xt[i]));
                for (int64_t i = b0; i < b1; i++) {
                    s += (double)wr[i] * xt[i];
                    sabs += fabs((double)wr[i] * xt[i]);
                    if (bs) qerr += fabs(wr[i]) * amax / 127.0 / 2.0;
                }
            }
            ref[t * M + r] = s;
            tol[t * M + r] = qerr * 1.0001 + 1e-5 * sabs + 1e-6;
            tol_s[t * M + r] = 1e-5 * (sabs + qerr) + 1e-6;
        }
    }

    const int64_t ys = M + 3;
    float *y = malloc(sizeof(float) * (size_t)(n_tok * ys));
    float *y_scalar = malloc(sizeof(float) * (size_t)(n_tok * ys));
    float *y_avx2 = malloc(sizeof(float) * (size_t)(n_tok * ys));
    float *y1 = malloc(sizeof(float) * (size_t)ys);
    /* Q8_0/Q4_0 also in the 16-row form (3 tiles, the last one partial) */
    const int has16 = type == KVQ_Q8_0 || type == KVQ_Q4_0;
    void *w16 = has16 ? aligned_alloc(64, kern_rows16_bytes(type, M, k)) : NULL;
    if (has16) {
        kern_rows16_pack(type, w, wrb, M, k, w16);
        /* packed in two runs of tiles (as threads pack), the same bytes */
        const size_t tb = kern_rows16_tile_bytes(type, k), bytes = kern_rows16_bytes(type, M, k);
        uint8_t *parts = aligned_alloc(64, bytes);
        kern_rows16_pack(type, w, wrb, 16, k, parts);
        kern_rows16_pack(type, w + 16 * wrb, wrb, M - 16, k, parts + tb);
        CHECK(memcmp(parts, w16, bytes) == 0, "rows16 %s k=%d: packing in two runs differs", kvq_dtype_name(type),
              (int)k);
        /* each row read back from the copy: what the row dequantizes to, bit for bit */
        int differ = 0;
        float *row = malloc(sizeof(float) * (size_t)k);
        for (int r = 0; r < M; r++) {
            kern_rows16_row(type, w16, k, r, row);
            differ += memcmp(row, wd + (size_t)r * k, sizeof(float) * (size_t)k) != 0;
        }
        CHECK(differ == 0, "rows16 %s k=%d: %d of %d rows read back differ", kvq_dtype_name(type), (int)k, differ, M);
        free(row);
        free(parts);
    }
    struct kern_matmul_args a = {.wtype = type, .w = w, .w_row_bytes = wrb, .k = k, .xa = xa,
                                 .xa_row_bytes = xrb, .n_tok = n_tok, .y = y, .y_stride = ys};
    /* the AVX2 level with and without AVX-VNNI (where the CPU has it) */
    static const struct {
        enum kvq_simd level;
        int vnni;
        const char *name;
    } variants[] = {{KVQ_SIMD_SCALAR, 0, "scalar"},
                    {KVQ_SIMD_AVX2, 0, "avx2"},
                    {KVQ_SIMD_AVX2, 1, "avx2vnni"},
                    {KVQ_SIMD_AVX512, 0, "avx512"}};
    for (size_t run = 0; run < 4 * (size_t)(1 + has16); run++) {
        const size_t li = run % 4;
        const char *vname = variants[li].name;
        a.w16 = run >= 4 ? w16 : NULL;
        if (kvq_simd_force(variants[li].level) != 0) continue;
        kvq_cpu_use_avx_vnni(variants[li].vnni);
        if (variants[li].vnni && !kvq_cpu_avx_vnni()) continue;
        for (int64_t i = 0; i < n_tok * ys; i++) y[i] = NAN;
        /* odd row ranges, not multiples of the register tile */
        const int64_t cuts[] = {0, 1, 6, 7, 22, M};
        for (int c = 0; c + 1 < 6; c++) kern_matmul(&a, cuts[c], cuts[c + 1]);
        int bad = 0, bad_pad = 0, bad_scalar = 0;
        double worst = 0;
        for (int t = 0; t < n_tok; t++) {
            for (int r = 0; r < M; r++) {
                double e = fabs((double)y[t * ys + r] - ref[t * M + r]);
                if (!(e <= tol[t * M + r])) bad++;
                if (e / tol[t * M + r] > worst) worst = e / tol[t * M + r];
                if (li == 0) y_scalar[t * ys + r] = y[t * ys + r];
                else if (!(fabs(y[t * ys + r] - y_scalar[t * ys + r]) <= tol_s[t * M + r]))
                    bad_scalar++;
            }
            for (int64_t r = M; r < ys; r++)
                if (!isnan(y[t * ys + r])) bad_pad++;
        }
        CHECK(bad == 0, "matmul %s %s k=%d M=%d n_tok=%d: %d outputs outside the bound (worst %.3g x tol)",
              kvq_dtype_name(type), vname, (int)k, M, n_tok, bad, worst);
        CHECK(bad_pad == 0, "matmul %s %s wrote outside [r0, r1)", kvq_dtype_name(type), vname);
        CHECK(bad_scalar == 0, "matmul %s %s%s k=%d n_tok=%d: %d outputs differ from scalar", kvq_dtype_name(type),
              vname, a.w16 ? " 16-row" : "", (int)k, n_tok, bad_scalar);
        /* vpdpbusd sums the products vpmaddubsw + vpmaddwd sum, exactly: the same bits */
        if (li == 1) memcpy(y_avx2, y, sizeof(float) * (size_t)(n_tok * ys));
        if (li == 2)
            CHECK(memcmp(y, y_avx2, sizeof(float) * (size_t)(n_tok * ys)) == 0,
                  "matmul %s avx2vnni%s k=%d n_tok=%d: differs from avx2", kvq_dtype_name(type),
                  a.w16 ? " 16-row" : "", (int)k, n_tok);
        /* a token's outputs do not depend on the tokens beside it: bit for bit */
        int varies = 0;
        for (int t = 0; t < n_tok; t++) {
            struct kern_matmul_args one = a;
            one.xa = xa + (size_t)t * xrb;
            one.n_tok = 1;
            one.y = y1;
            for (int c = 0; c + 1 < 6; c++) kern_matmul(&one, cuts[c], cuts[c + 1]);
            varies += memcmp(y1, y + (size_t)t * ys, sizeof(float) * (size_t)M) != 0;
        }
        CHECK(varies == 0, "matmul %s %s%s k=%d: %d of %d tokens differ when multiplied alone", kvq_dtype_name(type),
              vname, a.w16 ? " 16-row" : "", (int)k, varies, n_tok);
    }
    kvq_cpu_use_avx_vnni(1);
    free(w16);
    free(y_avx2);
    free(y1);
    kvq_simd_force(kvq_simd_max());
    free(w);
    free(wd);
    free(x);
    free(xa);
    free(ref);
    free(tol);
    free(tol_s);
    free(y);
    free(y_scalar);
}

static void test_matmul(void) {
    const int ntoks[] = {1, 3, 17, 64};
    for (size_t ti = 0; ti < sizeof all_types / sizeof all_types[0]; ti++) {
        uint32_t type = all_types[ti];
        int64_t ks[2];
        if (block_of(type) == 32) { ks[0] = 288; ks[1] = 512; }       /* 9 blocks: odd pair count */
        else if (block_of(type) == 256) { ks[0] = 256; ks[1] = 768; }
        else { ks[0] = 300; ks[1] = 512; }                           /* 300: not a multiple of 16 */
        for (int ki = 0; ki < 2; ki++)
            for (int ni = 0; ni < 4; ni++) test_matmul_case(type, ks[ki], 37, ntoks[ni]);
    }
}

/* ---- activations vs double reference --------------------------------------------- */

static void test_silu_mul(void) {
    enum { N = 1000 }; /* not a multiple of 8: the scalar tail too */
    float g[N], u[N], out[N];
    for (int i = 0; i < N; i++) {
        g[i] = i < 8 ? (float[]){-200, -88.5f, -87, -20, 0, 20, 88.5f, 200}[i] : 24.0f * frand();
        u[i] = 2.0f * frand();
    }
    for (size_t li = 0; li < 3; li++) {
        if (kvq_simd_force(all_levels[li]) != 0) continue;
        kern_silu_mul(g, u, out, N);
        int bad = 0;
        for (int i = 0; i < N; i++) {
            const double ref = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
            if (!(fabs(out[i] - ref) <= 4e-7 * fabs(ref) + 1e-30)) bad++;
        }
        CHECK(bad == 0, "silu_mul %s: %d of %d values off the reference", level_name[li], bad, N);
    }
    kvq_simd_force(kvq_simd_max());
}

static void test_exp_shifted(void) {
    enum { N = 1001 };
    float x[N], out[N];
    for (int i = 0; i < N; i++) x[i] = i < 6 ? (float[]){3.0f, 2.999f, -40, -80.5f, -200, -1e30f}[i] : 3.0f - 60 * frand();
    for (size_t li = 0; li < 3; li++) {
        if (kvq_simd_force(all_levels[li]) != 0) continue;
        kern_exp_shifted(x, 3.0f, 1.25f, out, N);
        int bad = 0;
        for (int i = 0; i < N; i++) {
            const float af = (x[i] - 3.0f) * 1.25f; /* the argument as the kernel rounds it */
            const double a = af, ref = exp(a);
            /* beneath e^-87 a weight may be 0 */
            if (!(fabs(out[i] - ref) <= 4e-7 * ref + (a < -87 ? 2e-38 : 1e-37))) bad++;
        }
        CHECK(bad == 0, "exp_shifted %s: %d of %d values off the reference", level_name[li], bad, N);
    }
    kvq_simd_force(kvq_simd_max());
}

/* Every level must prepare byte-identical activations (same rounding). */
static void test_prepare_levels(void) {
    const uint32_t qtypes[] = {KVQ_Q8_0, KVQ_Q4_0, KVQ_Q4_K, KVQ_Q6_K};
    for (int ti = 0; ti < 4; ti++) {
        const int64_t k = block_of(qtypes[ti]) == 32 ? 288 : 768;
        float x[768];
        for (int i = 0; i < k; i++) x[i] = i % 5 == 0 ? (float)(i % 11) * 0.5f : frand() * 10.0f; /* some ties */
        const size_t rb = kern_act_row_bytes(qtypes[ti], k);
        uint8_t *ref = malloc(rb), *out = malloc(rb);
        kvq_simd_force(KVQ_SIMD_SCALAR);
        kern_act_prepare(qtypes[ti], x, ref, k);
        for (size_t li = 1; li < 3; li++) {
            if (kvq_simd_force(all_levels[li]) != 0) continue;
            kern_act_prepare(qtypes[ti], x, out, k);
            CHECK(memcmp(ref, out, rb) == 0, "prepare %s at %s differs from scalar", kvq_dtype_name(qtypes[ti]),
                  level_name[li]);
        }
        kvq_simd_force(kvq_simd_max());
        free(ref);
        free(out);
    }
}

/* ---- dequantization vs llama.cpp-quantized model ---------------------------- */

static void test_dequant_gguf(void) {
    const char *pq = shared_path("models/tinydoc-q8_0.gguf");
    char qpath[4096];
    if (!pq) {
        printf("SKIP dequant vs gguf: shared models missing\n");
        return;
    }
    snprintf(qpath, sizeof qpath, "%s", pq);
    const char *pf = shared_path("models/tinydoc-f16.gguf");
    if (!pf) return;
    struct gguf_file *fq = gguf_open(qpath);
    struct gguf_file *ff = gguf_open(pf);
    CHECK(fq && ff, "open tinydoc gguf files");
    if (!fq || !ff) {
        gguf_close(fq);
        gguf_close(ff);
        return;
    }
    int n_checked = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(fq); i++) {
        const struct gguf_tensor *tq = gguf_tensor_at(fq, i);
        if (tq->type != KVQ_Q8_0) continue;
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)tq->name.len, tq->name.ptr);
        const struct gguf_tensor *tf = gguf_find_tensor(ff, name);
        CHECK(tf != NULL, "tensor %s in the f16 file", name);
        if (!tf) continue;
        CHECK(tf->ne[0] == tq->ne[0] && tf->ne[1] == tq->ne[1], "%s shapes", name);
        if (tf->ne[0] != tq->ne[0] || tf->ne[1] != tq->ne[1]) continue;
        const int64_t k = (int64_t)tq->ne[0];
        const int64_t rows = (int64_t)(tq->ne[1] * tq->ne[2] * tq->ne[3]);
        const size_t qrb = kvq_dtype_row_bytes(tq->type, (uint64_t)k);
        const size_t frb = kvq_dtype_row_bytes(tf->type, (uint64_t)k);
        float *a = malloc(sizeof(float) * (size_t)k), *b = malloc(sizeof(float) * (size_t)k);
        int bad = 0;
        /* every 7th row keeps the test fast under sanitizers */
        for (int64_t r = 0; r < rows; r += 7) {
            kern_dequantize_row(tq->type, (const uint8_t *)tq->data + (size_t)r * qrb, a, k);
            kern_dequantize_row(tf->type, (const uint8_t *)tf->data + (size_t)r * frb, b, k);
            for (int64_t b0 = 0; b0 < k; b0 += 32) {
                float amax = 0;
                for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(b[b0 + i]));
                /* half a quantization step, plus f16 rounding of the scale and the values */
                float tol = amax / 127.0f / 2.0f + amax * (2.0f / 2048.0f) + 1e-7f;
                for (int i = 0; i < 32; i++)
                    if (fabsf(a[b0 + i] - b[b0 + i]) > tol) bad++;
            }
        }
        CHECK(bad == 0, "%s: %d dequantized values off by more than half a step", name, bad);
        free(a);
        free(b);
        n_checked++;
    }
    CHECK(n_checked > 0, "some Q8_0 tensors checked (%d)", n_checked);
    printf("dequant vs f16 model: %d Q8_0 tensors checked\n", n_checked);
    gguf_close(fq);
    gguf_close(ff);
}

/* ---- attention ---------------------------------------------------------------- */

static void test_attention_case(int n_q, int d, int n, int f16) {
    const int stride = d + 5; /* rows not packed */
    float *q = malloc(sizeof(float) * (size_t)(n_q * d));
    float *kf = malloc(sizeof(float) * (size_t)(n * stride)), *vf = malloc(sizeof(float) * (size_t)(n * stride));
    void *k = malloc((size_t)(n * stride) * (f16 ? 2 : 4)), *v = malloc((size_t)(n * stride) * (f16 ? 2 : 4));
    for (int i = 0; i < n_q * d; i++) q[i] = frand() * 3.0f / sqrtf((float)d) * 2.0f;
    for (int i = 0; i < n * stride; i++) {
        float a = frand() * 1.5f, b = frand();
        if (f16) {
            ((uint16_t *)k)[i] = kvq_f32_to_f16(a);
            ((uint16_t *)v)[i] = kvq_f32_to_f16(b);
            a = kvq_f16_to_f32(((uint16_t *)k)[i]);
            b = kvq_f16_to_f32(((uint16_t *)v)[i]);
        } else {
            ((float *)k)[i] = a;
            ((float *)v)[i] = b;
        }
        kf[i] = a;
        vf[i] = b;
    }
    /* a drift so that later rows have larger scores (exercises the rescale) */
    for (int j = 0; j < n; j++)
        for (int i = 0; i < d; i++) {
            float extra = (float)j / (float)n * 0.5f * (i % 2 ? 1.0f : -1.0f);
            kf[j * stride + i] += extra;
            if (f16) {
                ((uint16_t *)k)[j * stride + i] = kvq_f32_to_f16(kf[j * stride + i]);
                kf[j * stride + i] = kvq_f16_to_f32(((uint16_t *)k)[j * stride + i]);
            } else {
                ((float *)k)[j * stride + i] = kf[j * stride + i];
            }
        }
    double *ref = malloc(sizeof(double) * (size_t)(n_q * d));
    double *sc = malloc(sizeof(double) * (size_t)n);
    for (int h = 0; h < n_q; h++) {
        double mx = -INFINITY, l = 0;
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int i = 0; i < d; i++) s += (double)q[h * d + i] * kf[j * stride + i];
            sc[j] = s;
            mx = fmax(mx, s);
        }
        for (int j = 0; j < n; j++) l += (sc[j] = exp(sc[j] - mx));
        for (int i = 0; i < d; i++) {
            double o = 0;
            for (int j = 0; j < n; j++) o += sc[j] * vf[j * stride + i];
            ref[h * d + i] = o / l;
        }
    }
    float *mem = malloc(sizeof(float) * kern_attn_state_floats(n_q, d));
    float *out = malloc(sizeof(float) * (size_t)(n_q * d));
    for (size_t li = 0; li < 3; li++) {
        if (kvq_simd_force(all_levels[li]) != 0) continue;
        struct kern_attn_state st;
        kern_attn_state_init(&st, n_q, d, mem);
        const size_t es = f16 ? 2 : 4;
        /* several calls with uneven sizes */
        int j = 0, step = 1;
        while (j < n) {
            int c = step < n - j ? step : n - j;
            kern_attn_accumulate(&st, q, (const uint8_t *)k + (size_t)j * stride * es, (size_t)stride,
                                 (const uint8_t *)v + (size_t)j * stride * es, (size_t)stride, f16 ? 16 : 32, c);
            j += c;
            step = step * 3 + 7;
        }
        kern_attn_finish(&st, out);
        double worst = 0;
        for (int i = 0; i < n_q * d; i++) worst = fmax(worst, fabs(out[i] - ref[i]));
        CHECK(worst < 2e-5, "attention %s f%d n_q=%d d=%d n=%d: max error %.3g", level_name[li], f16 ? 16 : 32,
              n_q, d, n, worst);
    }
    kvq_simd_force(kvq_simd_max());
    /* no rows: zeros */
    {
        struct kern_attn_state st;
        kern_attn_state_init(&st, n_q, d, mem);
        kern_attn_finish(&st, out);
        int nz = 0;
        for (int i = 0; i < n_q * d; i++) nz += out[i] != 0.0f;
        CHECK(nz == 0, "attention with no rows gives zeros");
    }
    free(q);
    free(kf);
    free(vf);
    free(k);
    free(v);
    free(ref);
    free(sc);
    free(mem);
    free(out);
}

static void test_attention(void) {
    const int nqs[] = {1, 2, 3, 4, 5, 8};
    const int ds[] = {8, 64, 128};
    const int ns[] = {1, 63, 200, 1000};
    for (int f16 = 0; f16 < 2; f16++)
        for (int a = 0; a < 6; a++)
            for (int b = 0; b < 3; b++)
                for (int c = 0; c < 4; c++) test_attention_case(nqs[a], ds[b], ns[c], f16);
    test_attention_case(20, 64, 150, 1); /* more heads than one pass handles */
}

#ifdef KERN_ASAN
#include <sys/wait.h>
#include <unistd.h>

/* Under AddressSanitizer the SIMD loops go unchecked and their dispatchers check the
 * ranges they will touch instead (kernels/asan.h). Each case below hands a kernel a
 * buffer one row (or half a row) short: run in a child process, it must end the way
 * ASan ends a program on a heap overflow. */
static int asan_reports(void (*run)(void)) {
    int fds[2];
    if (pipe(fds) != 0) return 0;
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        run();
        _exit(0);
    }
    close(fds[1]);
    char buf[4096] = {0};
    size_t got = 0;
    ssize_t r;
    while (got < sizeof buf - 1 && (r = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0) got += (size_t)r;
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) != 0 && strstr(buf, "heap-buffer-overflow") != NULL;
}

static void matmul_short_activations(void) { /* 3 tokens, room for 2.5 */
    const int64_t k = 64, M = 32;
    const size_t xrb = kern_act_row_bytes(KVQ_F32, k);
    float *w = calloc((size_t)(M * k), sizeof(float)), *y = calloc((size_t)(3 * M), sizeof(float));
    uint8_t *xa = calloc(1, 2 * xrb + xrb / 2);
    const struct kern_matmul_args a = {.wtype = KVQ_F32, .w = w, .w_row_bytes = (size_t)k * 4, .k = k, .xa = xa,
                                       .xa_row_bytes = xrb, .n_tok = 3, .y = y, .y_stride = M};
    kern_matmul(&a, 0, M);
}

static void attention_short_keys(void) { /* 10 f16 rows, room for 9 */
    const int d = 64, n = 10;
    float *q = calloc((size_t)(2 * d), sizeof(float)), *mem = calloc(kern_attn_state_floats(2, d), sizeof(float));
    uint16_t *k = calloc((size_t)((n - 1) * d), 2), *v = calloc((size_t)(n * d), 2);
    struct kern_attn_state st;
    kern_attn_state_init(&st, 2, d, mem);
    kern_attn_accumulate(&st, q, k, (size_t)d, v, (size_t)d, 16, n);
}

static void packed_short_values(void) { /* a second run of 8 rows of K4V4 values, room for 7 */
    const int d = 128;
    const size_t rb = kern_kvq_row_bytes(4, 32, d);
    float *q = calloc((size_t)(2 * d), sizeof(float)), *mem = calloc(kern_attn_state_floats(2, d), sizeof(float));
    uint8_t *k = calloc(16, rb), *v = calloc(8, rb), *v2 = calloc(7, rb);
    const struct kern_kv_rows kf = {NULL, rb, 4, 32}, vf = {NULL, rb, 4, 32};
    const struct kern_kv_run runs[2] = {{k, v, 8}, {k + 8 * rb, v2, 8}};
    struct kern_attn_state st;
    kern_attn_state_init(&st, 2, d, mem);
    kern_kvq_attn_accumulate_runs(&st, q, &kf, &vf, runs, 2);
}

static void test_asan_ranges(void) {
    for (int li = 1; li < 3; li++) {
        if (kvq_simd_force(all_levels[li]) != 0) continue;
        CHECK(asan_reports(matmul_short_activations), "%s: activations one token short not reported", level_name[li]);
        CHECK(asan_reports(attention_short_keys), "%s: f16 keys one row short not reported", level_name[li]);
        CHECK(asan_reports(packed_short_values), "%s: a run of packed values one row short not reported",
              level_name[li]);
    }
    kvq_simd_force(kvq_simd_max());
}
#endif

int main(void) {
    printf("SIMD level: %s\n", kern_simd_level());
#ifdef KERN_ASAN
    test_asan_ranges();
#endif
    test_dequant_formula();
    test_prepare_levels();
    test_matmul();
    test_silu_mul();
    test_exp_shifted();
    test_attention();
    test_dequant_gguf();
    return check_finish();
}
