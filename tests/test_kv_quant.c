/* Quantized KV row kernels: round trip and error bound for every bits/group pair,
 * the Hadamard rotation, and attention on packed rows (scalar, AVX2, AVX-512)
 * against a float reference over the dequantized rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/cpu.h"
#include "kernels/f16.h"
#include "kernels/kv_quant.h"
#include "kernels/kv_quant_impl.h"

static uint64_t rng = 88172645463325252ull;
static double urand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}
static float gauss(void) {
    double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}

static const int all_bits[] = {2, 3, 4, 5, 6, 8};
static const int all_groups[] = {8, 16, 32, 64, 128};

static void test_round_trip(void) {
    const int d = 128;
    float x[128], y[128];
    uint8_t buf[1024];
    for (int bi = 0; bi < 6; bi++)
        for (int gi = 0; gi < 5; gi++) {
            int bits = all_bits[bi], G = all_groups[gi];
            CHECK(kern_kvq_row_bytes(bits, G, d) == (size_t)d * bits / 8 + 4 * (size_t)d / G, "row bytes");
            double worst = 0;
            for (int trial = 0; trial < 20; trial++) {
                float amp = trial % 4 == 0 ? 100.0f : trial % 4 == 1 ? 0.01f : 1.0f;
                for (int i = 0; i < d; i++) x[i] = amp * gauss() + (trial % 3 == 0 ? 5.0f : 0.0f);
                if (trial == 7) x[3] = 40 * amp; /* an outlier */
                if (trial == 9)
                    for (int i = 0; i < d; i++) x[i] = 1.5f; /* constant group: scale 0 */
                kern_kvq_quantize_row(x, d, bits, G, buf);
                kern_kvq_dequantize_row(buf, d, bits, G, y);
                const uint8_t *sb = buf + d * bits / 8;
                for (int g = 0; g < d / G; g++) {
                    float mn = x[g * G], mx = x[g * G];
                    for (int i = g * G; i < (g + 1) * G; i++) {
                        mn = fminf(mn, x[i]);
                        mx = fmaxf(mx, x[i]);
                    }
                    uint16_t sh, bh;
                    memcpy(&sh, sb + 4 * g, 2);
                    memcpy(&bh, sb + 4 * g + 2, 2);
                    float s = kvq_f16_to_f32(sh), b = kvq_f16_to_f32(bh);
                    /* scale/2 plus the f16 rounding of scale (times the top code) and bias */
                    float bound = s / 2 + fabsf(mx - mn) * 1e-3f + fabsf(b) * 1e-3f + 1e-6f;
                    for (int i = g * G; i < (g + 1) * G; i++) {
                        float e = fabsf(x[i] - y[i]);
                        worst = fmax(worst, e / (s > 0 ? s : 1));
                        CHECK(e <= bound, "bits %d group %d: |x - deq| = %g > %g", bits, G, e, bound);
                    }
                }
            }
            printf("bits %d group %3d: max error %.3f scale\n", bits, G, worst);
        }
    /* unpackers agree with the scalar one for every bit width */
    uint8_t src[512], a[1024], b[1024];
    for (int i = 0; i < 512; i++) src[i] = (uint8_t)(urand() * 256);
    for (int bi = 0; bi < 6; bi++) {
        int bits = all_bits[bi], n = 1024 * 8 / 16 / bits * 2; /* fits src */
        n -= n % 8;
        kern_kvq_unpack_scalar(src, n, bits, a);
        kern_kvq_unpack_codes(src, n, bits, b);
        CHECK(memcmp(a, b, (size_t)n) == 0, "unpack %d bits (%s)", bits, kern_kvq_simd_level());
        if (kvq_simd_available(KVQ_SIMD_AVX2)) {
            kern_kvq_unpack_avx2(src, n, bits, b);
            CHECK(memcmp(a, b, (size_t)n) == 0, "unpack avx2 %d bits", bits);
        }
        if (kvq_simd_available(KVQ_SIMD_AVX512)) {
            kern_kvq_unpack_avx512(src, n, bits, b);
            CHECK(memcmp(a, b, (size_t)n) == 0, "unpack avx512 %d bits", bits);
        }
    }
}

/* f16 rows (bits 16) at every SIMD level: bit-identical to the scalar kvq_f32_to_f16
 * (round to nearest even, subnormals, overflow to inf), NaN stays NaN. */
static void test_f16_rows(void) {
    enum { D = 200 };
    float x[D];
    uint8_t row[2 * D];
    const float special[] = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 65519.0f, 65520.0f, -1e6f, 1e-8f, -3e-5f,
                             6.1e-5f, 5.96e-8f, 2.98e-8f, 2.99e-8f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048,
                             INFINITY, -INFINITY, NAN};
    const int ns = (int)(sizeof special / sizeof special[0]);
    const enum kvq_simd levels[] = {KVQ_SIMD_SCALAR, KVQ_SIMD_AVX2, KVQ_SIMD_AVX512};
    for (int li = 0; li < 3; li++) {
        if (kvq_simd_force(levels[li]) != 0) continue;
        const int dims[] = {D, 128, 24, 7};
        for (int di = 0; di < 4; di++) {
            const int d = dims[di];
            for (int i = 0; i < d; i++) x[i] = i < ns ? special[i] : (float)(gauss() * pow(10, (int)(urand() * 12) - 7));
            memset(row, 0xAB, sizeof row);
            kern_kvq_quantize_row(x, d, 16, 0, row);
            int bad = 0;
            for (int i = 0; i < d; i++) {
                uint16_t h;
                memcpy(&h, row + 2 * i, 2);
                const uint16_t want = kvq_f32_to_f16(x[i]);
                if (isnan(x[i])) bad += (h & 0x7c00) != 0x7c00 || (h & 0x3ff) == 0;
                else bad += h != want;
            }
            for (int i = 2 * d; i < 2 * D; i++) bad += row[i] != 0xAB; /* nothing past the row */
            CHECK(bad == 0, "f16 row d=%d at %s: %d values differ from kvq_f32_to_f16", d, kvq_simd_name(levels[li]),
                  bad);
            /* and back, exactly: every f16 value (subnormals, infinities) as kvq_f16_to_f32 gives it */
            float y[D + 1];
            y[d] = 12345.0f;
            for (int i = 0; i < d; i++) memcpy(row + 2 * i, &(uint16_t){(uint16_t)(urand() * 65536)}, 2);
            kern_kvq_dequantize_row(row, d, 16, 0, y);
            bad = y[d] != 12345.0f;
            for (int i = 0; i < d; i++) {
                uint16_t h;
                memcpy(&h, row + 2 * i, 2);
                const float want = kvq_f16_to_f32(h);
                bad += isnan(want) ? !isnan(y[i]) : memcmp(&y[i], &want, 4) != 0;
            }
            CHECK(bad == 0, "f16 row d=%d read at %s: %d values differ from kvq_f16_to_f32", d,
                  kvq_simd_name(levels[li]), bad);
        }
    }
    kvq_simd_force(kvq_simd_max());
}

/* Packed rows at every SIMD level: byte for byte the scalar encoder's (the GPU's
 * encoder is checked against it too), on rows with ties, zeros of either sign,
 * outliers and constant groups. */
static void test_quantize_levels(void) {
    const int dims[] = {64, 128, 256}, groups[] = {32, 64, 128, KERN_KVQ_NF}, all_bits[] = {2, 3, 4, 5, 6, 8};
    const enum kvq_simd levels[] = {KVQ_SIMD_AVX2, KVQ_SIMD_AVX512};
    float x[256];
    uint8_t want[512], got[512];
    int rows = 0;
    for (int rep = 0; rep < 40; rep++)
        for (int di = 0; di < 3; di++)
            for (int gi = 0; gi < 4; gi++)
                for (int bi = 0; bi < 6; bi++) {
                    const int d = dims[di], G = groups[gi], bits = all_bits[bi];
                    if (G > d || (G == KERN_KVQ_NF && !kern_kvq_nf_bits(bits))) continue;
                    for (int i = 0; i < d; i++) {
                        switch (rep % 5) {
                        case 0: x[i] = gauss(); break;
                        case 1: x[i] = (float)(int)(urand() * 9) - 4; break; /* ties */
                        case 2: x[i] = urand() < 0.5 ? (urand() < 0.5 ? -0.0f : 0.0f) : fabsf(gauss()); break;
                        case 3: x[i] = gauss() * (i % 17 == 0 ? 1000.0f : 1.0f); break;
                        default: x[i] = i < d / 2 ? 0.25f : -3.0f; break; /* constant groups */
                        }
                    }
                    const size_t nb = kern_kvq_row_bytes(bits, G, d);
                    kvq_simd_force(KVQ_SIMD_SCALAR);
                    kern_kvq_quantize_row(x, d, bits, G, want);
                    for (int li = 0; li < 2; li++) {
                        if (kvq_simd_force(levels[li]) != 0) continue;
                        memset(got, 0xAB, sizeof got);
                        kern_kvq_quantize_row(x, d, bits, G, got);
                        CHECK(memcmp(got, want, nb) == 0 && got[nb] == 0xAB,
                              "row d=%d group %d bits %d (kind %d): %s differs from scalar", d, G, bits, rep % 5,
                              kvq_simd_name(levels[li]));
                    }
                    rows++;
                }
    kvq_simd_force(kvq_simd_max());
    printf("packed rows encode alike at every level (%d rows)\n", rows);
}

static void test_hadamard(void) {
    const int dims[] = {8, 64, 96, 128, 256};
    for (int di = 0; di < 5; di++) {
        int d = dims[di];
        float s[256], x[256], y[256], z[256];
        kern_kvq_hadamard_signs(s, d, 42);
        for (int i = 0; i < d; i++) x[i] = y[i] = gauss(), z[i] = gauss();
        double dot0 = 0, dot1 = 0, n0 = 0, n1 = 0;
        for (int i = 0; i < d; i++) dot0 += x[i] * z[i], n0 += x[i] * x[i];
        kern_kvq_hadamard(y, d, s);
        kern_kvq_hadamard(z, d, s);
        for (int i = 0; i < d; i++) dot1 += y[i] * z[i], n1 += y[i] * y[i];
        CHECK(fabs(dot0 - dot1) < 1e-4 * (1 + fabs(dot0)) && fabs(n0 - n1) < 1e-4 * n0, "d %d: dot %g vs %g", d, dot0,
              dot1);
        kern_kvq_hadamard_inv(y, d, s);
        double e = 0;
        for (int i = 0; i < d; i++) e = fmax(e, fabs(y[i] - x[i]));
        CHECK(e < 1e-5, "d %d: inverse error %g", d, e);
    }
    /* every level rotates bit for bit as the scalar butterflies do (the device and the
     * host encode the same bytes) */
    for (int di = 0; di < 5; di++) {
        const int d = dims[di] * 4; /* blocks of 32 to 1024 */
        float s[1024], x[1024], want[2][1024], got[2][1024];
        kern_kvq_hadamard_signs(s, d, 3);
        for (int i = 0; i < d; i++) x[i] = gauss() * (i % 7 == 0 ? 50 : 1);
        const enum kvq_simd levels[] = {KVQ_SIMD_SCALAR, KVQ_SIMD_AVX2, KVQ_SIMD_AVX512};
        for (int li = 0; li < 3; li++) {
            if (kvq_simd_force(levels[li]) != 0) continue;
            memcpy(got[0], x, sizeof(float) * d);
            kern_kvq_hadamard(got[0], d, s);
            memcpy(got[1], got[0], sizeof(float) * d);
            kern_kvq_hadamard_inv(got[1], d, s);
            if (li == 0) memcpy(want, got, sizeof got);
            CHECK(memcmp(got[0], want[0], sizeof(float) * d) == 0 && memcmp(got[1], want[1], sizeof(float) * d) == 0,
                  "d %d: %s rotation differs from scalar", d, kvq_simd_name(levels[li]));
        }
        kvq_simd_force(kvq_simd_max());
    }
    /* an outlier channel is spread over the block */
    float s[128], x[128] = {0};
    kern_kvq_hadamard_signs(s, 128, 7);
    x[5] = 100;
    kern_kvq_hadamard(x, 128, s);
    float mx = 0;
    for (int i = 0; i < 128; i++) mx = fmaxf(mx, fabsf(x[i]));
    CHECK(fabsf(mx - 100 / sqrtf(128)) < 1e-3, "outlier spread: max %g", mx);
}

/* Float reference over dequantized rows, in double. */
static void ref_attn(int nq, int d, const float *q, const float *K, const float *V, int n, float *out) {
    for (int h = 0; h < nq; h++) {
        double *sc = malloc(sizeof(double) * (size_t)n), mx = -1e300, l = 0;
        for (int j = 0; j < n; j++) {
            double t = 0;
            for (int i = 0; i < d; i++) t += (double)q[h * d + i] * K[(size_t)j * d + i];
            sc[j] = t;
            mx = fmax(mx, t);
        }
        for (int j = 0; j < n; j++) l += sc[j] = exp(sc[j] - mx);
        for (int i = 0; i < d; i++) {
            double a = 0;
            for (int j = 0; j < n; j++) a += sc[j] * V[(size_t)j * d + i];
            out[h * d + i] = (float)(a / l);
        }
        free(sc);
    }
}

/* The AVX-512 VNNI path's definition: q rounded to int8 with one scale per head
 * (sq = max|q| / 127) against the codes, the group bias against the exact q:
 * score = sum_g scale_g * sq * (q8 . codes)_g + bias_g * sum_g(q). digits = 2 (8-bit keys
 * and values) adds a second digit: q8 + r / 128, r = round((q / sq - q8) * 128).
 * Normal-float keys: their level bytes as the codes, one group. */
static void ref_attn_vnni(int nq, int d, const float *q, const uint8_t *K, int kb, int kg, size_t kr, const float *V,
                          int n, int digits, float *out) {
    uint8_t codes[128];
    const int G = kvq_gsize(kg, d);
    for (int h = 0; h < nq; h++) {
        const float *qh = q + (size_t)h * d;
        float amax = 0;
        for (int i = 0; i < d; i++) amax = fmaxf(amax, fabsf(qh[i]));
        const float sq = amax > 0 ? amax / 127.0f : 1.0f;
        double *sc = malloc(sizeof(double) * (size_t)n), mx = -1e300, l = 0;
        for (int j = 0; j < n; j++) {
            const uint8_t *row = K + kr * (size_t)j, *sb = row + (size_t)d * kb / 8;
            kern_kvq_row_codes_scalar(row, d, kb, kg, codes);
            double t = 0;
            for (int g = 0; g < d / G; g++) {
                double dot = 0, qs = 0;
                for (int i = g * G; i < (g + 1) * G; i++) {
                    const float y = qh[i] / sq, q8 = (float)lrintf(y);
                    dot += (q8 + (digits == 2 ? lrintf((y - q8) * 128) / 128.0 : 0.0)) * codes[i];
                    qs += qh[i];
                }
                float gs, gb;
                kvq_gparams(sb, g, kg, &gs, &gb);
                t += gs * sq * dot + gb * qs;
            }
            sc[j] = t;
            mx = fmax(mx, t);
        }
        for (int j = 0; j < n; j++) l += sc[j] = exp(sc[j] - mx);
        for (int i = 0; i < d; i++) {
            double a = 0;
            for (int j = 0; j < n; j++) a += sc[j] * V[(size_t)j * d + i];
            out[h * d + i] = (float)(a / l);
        }
        free(sc);
    }
}

typedef void (*attn_fn)(struct kern_attn_state *, int, int, const float *, const struct kern_kv_rows *,
                        const struct kern_kv_rows *, int);

static double max_err(const float *a, const float *b, int n) {
    double e = 0;
    for (int i = 0; i < n; i++) e = fmax(e, fabs(a[i] - b[i]));
    return e;
}

static void test_attention(void) {
    struct {
        int kb, kg, vb, vg;
    } fmts[] = {{8, 64, 8, 64}, {4, 64, 4, 64}, {4, 32, 2, 32}, {8, 128, 4, 16}, {3, 32, 5, 64}, {6, 16, 6, 16},
                {2, 64, 2, 64}, {16, 0, 4, 64}, {8, 64, 16, 0}, {32, 0, 3, 32}, {4, 8, 4, 8},
                /* the AVX-512 fast path: 4/8-bit K and V, groups of 32..128 */
                {4, 32, 4, 32}, {8, 32, 4, 128}, {4, 128, 8, 32}, {8, 128, 8, 128}, {8, 32, 8, 32}, {4, 64, 8, 64},
                /* normal-float rows, alone and beside uniform and float ones */
                {4, KERN_KVQ_NF, 3, KERN_KVQ_NF}, {3, KERN_KVQ_NF, 2, KERN_KVQ_NF}, {5, KERN_KVQ_NF, 4, KERN_KVQ_NF},
                {2, KERN_KVQ_NF, 5, KERN_KVQ_NF}, {16, 0, 3, KERN_KVQ_NF}, {4, KERN_KVQ_NF, 8, 64}, {8, 32, 2, KERN_KVQ_NF},
                {4, 64, 5, KERN_KVQ_NF}, {3, KERN_KVQ_NF, 4, 32}, {5, KERN_KVQ_NF, 3, KERN_KVQ_NF},
                /* float rows on both sides: the runs entry point takes the float kernel */
                {16, 0, 16, 0}, {32, 0, 32, 0}};
    const int ratios[] = {1, 2, 3, 4, 7, 8, 9}, lens[] = {1, 31, 33, 200};
    /* the fast paths round the value weights to 16 bits: up to 2.2e-4 here (3-bit
     * normal-float keys, 4-bit values in groups of 32, d 64, 8 heads, 31 rows) */
    const double tol = 2.5e-4;
    /* avx512-novbmi: the AVX-512 fast path's normal-float rows without VBMI, where the
     * CPU has it */
    const char *names[] = {"scalar", "avx2", "avx512", "avx512-novbmi"};
    attn_fn fns[] = {kern_kvq_attn_scalar, kern_kvq_attn_avx2, kern_kvq_attn_avx512, kern_kvq_attn_avx512};
    bool have[] = {true, kvq_simd_available(KVQ_SIMD_AVX2), kvq_simd_available(KVQ_SIMD_AVX512),
                   kvq_cpu_avx512_vbmi() != 0};
    /* head_dim 64 too: 4-bit keys of 64 values take the two-rows-per-vector scoring */
    for (int d = 128; d >= 64; d -= 64)
    for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++)
        for (int ri = 0; ri < 7; ri++)
            for (int li = 0; li < 4; li++) {
                int nq = ratios[ri], n = lens[li];
                if (d == 64 && (fmts[fi].kg > 64 || fmts[fi].vg > 64)) continue;
                int kb = fmts[fi].kb, kg = fmts[fi].kg, vb = fmts[fi].vb, vg = fmts[fi].vg;
                size_t kr = kern_kvq_row_bytes(kb, kg, d), vr = kern_kvq_row_bytes(vb, vg, d);
                uint8_t *K = malloc(kr * n), *V = malloc(vr * n);
                float *Kd = malloc(sizeof(float) * d * n), *Vd = malloc(sizeof(float) * d * n), x[128];
                float q[9 * 128], want[9 * 128], got[9 * 128], mem[9 * 130];
                for (int j = 0; j < n; j++) {
                    for (int i = 0; i < d; i++) x[i] = gauss() * (i == 7 ? 8 : 1);
                    kern_kvq_quantize_row(x, d, kb, kg, K + kr * j);
                    kern_kvq_dequantize_row(K + kr * j, d, kb, kg, Kd + (size_t)d * j);
                    for (int i = 0; i < d; i++) x[i] = gauss();
                    kern_kvq_quantize_row(x, d, vb, vg, V + vr * j);
                    kern_kvq_dequantize_row(V + vr * j, d, vb, vg, Vd + (size_t)d * j);
                }
                for (int i = 0; i < nq * d; i++) q[i] = gauss() * 0.3f;
                ref_attn(nq, d, q, Kd, Vd, n, want);
                float want8[9 * 128];
                if (kb < 16) ref_attn_vnni(nq, d, q, K, kb, kg, kr, Vd, n, kb == 8 && vb == 8 ? 2 : 1, want8);
                else memcpy(want8, want, sizeof(float) * (size_t)nq * d);
                struct kern_kv_rows krow = {K, kr, kb, kg}, vrow = {V, vr, vb, vg};
                bool simd_ok = (kb >= 16 || kg < 0 || kg % 16 == 0) && (vb >= 16 || vg < 0 || vg % 16 == 0);
                for (int v = 0; v < 4; v++) {
                    if (!have[v] || (v > 0 && !simd_ok)) continue;
                    kern_kvq_use_vbmi_avx512(v != 3);
                    struct kern_attn_state st;
                    kern_attn_state_init(&st, nq, d, mem);
                    /* in two calls, as a cache with two runs of visible rows would */
                    int cut = n / 3;
                    for (int h0 = 0; h0 < nq; h0 += KVQ_ATTN_MAXH) {
                        int nh = nq - h0 < KVQ_ATTN_MAXH ? nq - h0 : KVQ_ATTN_MAXH;
                        if (cut) fns[v](&st, h0, nh, q, &krow, &vrow, cut);
                        struct kern_kv_rows k2 = {K + kr * cut, kr, kb, kg}, v2 = {V + vr * cut, vr, vb, vg};
                        fns[v](&st, h0, nh, q, &k2, &v2, n - cut);
                    }
                    kern_attn_finish(&st, got);
                    double e = 0;
                    e = fmin(max_err(got, want, nq * d), max_err(got, want8, nq * d));
                    CHECK(e < tol, "%s K%d/%d V%d/%d group %d n %d: max error %g", names[v], kb, kg, vb, vg, nq, n, e);
                }
                kern_kvq_use_vbmi_avx512(1);
                /* the dispatcher too */
                struct kern_attn_state st;
                kern_attn_state_init(&st, nq, d, mem);
                kern_kvq_attn_accumulate(&st, q, &krow, &vrow, n);
                kern_attn_finish(&st, got);
                double e = 0;
                e = fmin(max_err(got, want, nq * d), max_err(got, want8, nq * d));
                CHECK(e < tol, "dispatch K%d V%d group %d n %d: max error %g", kb, vb, nq, n, e);
                /* the rows split into runs as a paged cache holds them (blocks of any size) */
                struct kern_kv_run runs[8];
                const int sizes[] = {1, 7, 64, 5, 40};
                int nr = 0;
                for (int j = 0; j < n; nr++) {
                    int m = nr == 7 || sizes[nr % 5] > n - j ? n - j : sizes[nr % 5];
                    runs[nr] = (struct kern_kv_run){K + kr * j, V + vr * j, m};
                    j += m;
                }
                kern_attn_state_init(&st, nq, d, mem);
                kern_kvq_attn_accumulate_runs(&st, q, &krow, &vrow, runs, nr);
                kern_attn_finish(&st, got);
                e = 0;
                e = fmin(max_err(got, want, nq * d), max_err(got, want8, nq * d));
                CHECK(e < tol, "runs K%d V%d group %d n %d (%d runs): max error %g", kb, vb, nq, n, nr, e);
                for (int v = 1; v < 4; v++) { /* the fast paths' own run loops, where they apply */
                    if (!have[v]) continue;
                    kern_kvq_use_vbmi_avx512(v != 3);
                    kern_attn_state_init(&st, nq, d, mem);
                    bool fast = true;
                    for (int h0 = 0; h0 < nq && fast; h0 += KVQ_ATTN_MAXH) {
                        int nh = nq - h0 < KVQ_ATTN_MAXH ? nq - h0 : KVQ_ATTN_MAXH;
                        fast = v >= 2 ? kern_kvq_attn_avx512_runs(&st, h0, nh, q, &krow, &vrow, runs, nr)
                                      : kern_kvq_attn_avx2_runs(&st, h0, nh, q, &krow, &vrow, runs, nr);
                    }
                    kern_kvq_use_vbmi_avx512(1);
                    kern_attn_finish(&st, got);
                    e = 0;
                    e = fmin(max_err(got, want, nq * d), max_err(got, want8, nq * d));
                    CHECK(!fast || e < tol, "%s runs K%d V%d group %d n %d: max error %g", names[v], kb, vb, nq, n, e);
                }
                free(K);
                free(V);
                free(Kd);
                free(Vd);
            }
    printf("attention on packed rows matches the float reference (%s)\n", kern_kvq_simd_level());
}

/* One key far above the others for head 0 (by `margin` in score), the rest spread: the
 * fast path's per-block int16 value weights must keep the small weights (7-bit ones
 * would round the others' share of the softmax, ~1e-3 each, to 0) and its per-block
 * scales must survive blocks whose weights are all far below the maximum. */
static void test_attention_dominant(void) {
    const struct {
        int kb, kg, vb, vg;
    } fmts[] = {{4, 64, 4, 64}, {8, 64, 4, 64}, {8, 64, 8, 64}, {4, 32, 4, 32}, {8, 128, 4, 32},
                {4, KERN_KVQ_NF, 3, KERN_KVQ_NF}, {3, KERN_KVQ_NF, 2, KERN_KVQ_NF}};
    const int n = 200, dom = 150; /* blocks of 64: the dominant key in the third */
    for (int d = 128; d >= 64; d -= 64)
        for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++)
            for (int nq = 2; nq <= 7; nq += 5)
                for (int mi = 0; mi < 2; mi++) {
                    const float margin = mi ? 60.0f : 12.0f;
                    int kb = fmts[fi].kb, kg = fmts[fi].kg, vb = fmts[fi].vb, vg = fmts[fi].vg;
                    if (d % kvq_gsize(kg, d) || d % kvq_gsize(vg, d)) continue;
                    size_t kr = kern_kvq_row_bytes(kb, kg, d), vr = kern_kvq_row_bytes(vb, vg, d);
                    uint8_t *K = malloc(kr * n), *V = malloc(vr * n);
                    float *Kd = malloc(sizeof(float) * d * n), *Vd = malloc(sizeof(float) * d * n), x[128];
                    float q[7 * 128], want[7 * 128], want8[7 * 128], got[7 * 128], mem[7 * 130];
                    for (int i = 0; i < nq * d; i++) q[i] = gauss() * 0.3f;
                    double qq = 0;
                    for (int i = 0; i < d; i++) qq += (double)q[i] * q[i];
                    for (int j = 0; j < n; j++) {
                        for (int i = 0; i < d; i++) x[i] = j == dom ? (float)(q[i] * margin / qq) : gauss() * 0.5f;
                        kern_kvq_quantize_row(x, d, kb, kg, K + kr * j);
                        kern_kvq_dequantize_row(K + kr * j, d, kb, kg, Kd + (size_t)d * j);
                        for (int i = 0; i < d; i++) x[i] = gauss();
                        kern_kvq_quantize_row(x, d, vb, vg, V + vr * j);
                        kern_kvq_dequantize_row(V + vr * j, d, vb, vg, Vd + (size_t)d * j);
                    }
                    ref_attn(nq, d, q, Kd, Vd, n, want);
                    ref_attn_vnni(nq, d, q, K, kb, kg, kr, Vd, n, kb == 8 && vb == 8 ? 2 : 1, want8);
                    struct kern_kv_rows krow = {K, kr, kb, kg}, vrow = {V, vr, vb, vg};
                    struct kern_kv_run runs[4];
                    for (int r = 0; r < 4; r++)
                        runs[r] = (struct kern_kv_run){K + kr * 64 * r, V + vr * 64 * r, r < 3 ? 64 : n - 192};
                    /* the fast path of every SIMD level the CPU runs */
                    const enum kvq_simd top = kvq_simd_level();
                    for (int l = KVQ_SIMD_AVX2; l <= (int)top + (kvq_cpu_avx512_vbmi() != 0); l++) {
                        kvq_simd_force(l > (int)top ? top : (enum kvq_simd)l);
                        kern_kvq_use_vbmi_avx512(l <= (int)top); /* past top: AVX-512 without VBMI */
                        struct kern_attn_state st;
                        kern_attn_state_init(&st, nq, d, mem);
                        kern_kvq_attn_accumulate_runs(&st, q, &krow, &vrow, runs, 4);
                        kern_attn_finish(&st, got);
                        double e = fmin(max_err(got, want, nq * d), max_err(got, want8, nq * d));
                        CHECK(e < 2e-4, "%s%s: dominant key (margin %g) d %d K%d/%d V%d/%d heads %d: max error %g",
                              kvq_simd_name(kvq_simd_level()), l > (int)top ? " (no VBMI)" : "", margin, d, kb, kg, vb, vg,
                              nq, e);
                    }
                    kern_kvq_use_vbmi_avx512(1);
                    kvq_simd_force(top);
                    free(K);
                    free(V);
                    free(Kd);
                    free(Vd);
                }
    printf("attention with a dominant key matches the float reference\n");
}

/* Normal-float rows: the byte formula, and on normal data a squared error close to the
 * Lloyd-Max quantizer's for N(0,1) (Max 1960: 0.1175, 0.03454, 0.009497, 0.002499 for
 * 2..5 bits), at every SIMD level (the codes map to level bytes per ISA). */
static void test_nf_rows(void) {
    static const double lloyd_max[6] = {0, 0, 0.1175, 0.03454, 0.009497, 0.002499};
    const int d = 128;
    float x[128], y[128];
    uint8_t buf[256];
    for (int bits = 2; bits <= 5; bits++) {
        CHECK(kern_kvq_row_bytes(bits, KERN_KVQ_NF, d) == (size_t)d * bits / 8 + 1, "nf row bytes");
        double err = 0, var = 0;
        for (int trial = 0; trial < 200; trial++) {
            const float amp = trial % 3 == 0 ? 30.0f : trial % 3 == 1 ? 0.02f : 1.0f;
            for (int i = 0; i < d; i++) x[i] = amp * gauss();
            kern_kvq_quantize_row(x, d, bits, KERN_KVQ_NF, buf);
            const enum kvq_simd levels[] = {KVQ_SIMD_SCALAR, KVQ_SIMD_AVX2, KVQ_SIMD_AVX512};
            float y0[128];
            for (int li = 0; li < 3; li++) {
                if (kvq_simd_force(levels[li]) != 0) continue;
                kern_kvq_dequantize_row(buf, d, bits, KERN_KVQ_NF, li ? y : y0);
                if (li) CHECK(memcmp(y, y0, sizeof y) == 0, "nf %d bits: level %d decodes as scalar", bits, li);
            }
            kvq_simd_force(kvq_simd_max());
            for (int i = 0; i < d; i++) err += (double)(x[i] - y0[i]) * (x[i] - y0[i]) / (amp * amp), var += (double)x[i] * x[i] / (amp * amp);
        }
        const double rel = err / var;
        CHECK(rel < 1.15 * lloyd_max[bits] && rel > 0.7 * lloyd_max[bits], "nf %d bits: relative squared error %g (Lloyd-Max %g)",
              bits, rel, lloyd_max[bits]);
    }
    for (int i = 0; i < d; i++) x[i] = 0;
    kern_kvq_quantize_row(x, d, 3, KERN_KVQ_NF, buf);
    kern_kvq_dequantize_row(buf, d, 3, KERN_KVQ_NF, y);
    CHECK(memcmp(x, y, sizeof x) == 0 && buf[d * 3 / 8] == 0, "nf zero row: scale 0, zeros back");
}

int main(void) {
    test_round_trip();
    test_nf_rows();
    test_f16_rows();
    test_quantize_levels();
    test_hadamard();
    test_attention();
    test_attention_dominant();
    return check_finish();
}
