/* Micro-benchmark of the compute kernels (not a test): matvec / matmul at the
 * tinydoc shapes for every weight type, a simulated tinydoc-q8_0 decode token,
 * and attention at depths 512 / 4096. Single thread.
 * Usage: bench_kernels [scalar|avx2|avx2vnni|avx512] [cold|ceilings] (avx2: without AVX-VNNI)
 * "cold": decode token and attention over working sets larger than the caches
 * (mean time, GB/s), the way generate meets them.
 * "ceilings": what the machine itself allows, with 1 and 2 threads: reads from DRAM
 * (GB/s) and, on AVX-512 VNNI, int8 multiply-adds (vpdpbusd) per second; the floors a
 * batch's decode step is measured against. */
#include "core/cpu.h"
#include "core/dtype.h"
#include "kernels/attention.h"
#include "kernels/f16.h"
#include "kernels/kv_quant.h"
#include "kernels/matmul.h"
#include "kernels/matmul_impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint32_t rs = 12345;
static uint32_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 17;
    rs ^= rs << 5;
    return rs;
}

/* Random but valid weights: random bytes with small f16 scales patched in. */
static void fill_weights(uint32_t type, uint8_t *w, int64_t rows, int64_t k) {
    size_t rb = kvq_dtype_row_bytes(type, (uint64_t)k);
    for (size_t i = 0; i < rb * (size_t)rows; i++) w[i] = (uint8_t)rnd();
    uint16_t small = kvq_f32_to_f16(0.01f);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *p = w + (size_t)r * rb;
        switch (type) {
        case KVQ_F32:
            for (int64_t i = 0; i < k; i++) { float f = (float)(rnd() % 2000) / 1000.0f - 1.0f; memcpy(p + 4 * i, &f, 4); }
            break;
        case KVQ_F16:
        case KVQ_BF16:
            for (int64_t i = 0; i < k; i++) {
                float f = (float)(rnd() % 2000) / 1000.0f - 1.0f;
                uint16_t h = type == KVQ_F16 ? kvq_f32_to_f16(f) : kvq_f32_to_bf16(f);
                memcpy(p + 2 * i, &h, 2);
            }
            break;
        case KVQ_Q8_0: for (int64_t b = 0; b < k / 32; b++) memcpy(p + 34 * b, &small, 2); break;
        case KVQ_Q4_0: for (int64_t b = 0; b < k / 32; b++) memcpy(p + 18 * b, &small, 2); break;
        case KVQ_Q4_K:
            for (int64_t b = 0; b < k / 256; b++) { memcpy(p + 144 * b, &small, 2); memcpy(p + 144 * b + 2, &small, 2); }
            break;
        case KVQ_Q6_K: for (int64_t b = 0; b < k / 256; b++) memcpy(p + 210 * b + 208, &small, 2); break;
        }
    }
}

struct shape { int64_t rows, k; };
static const struct shape shapes[] = {{512, 512}, {256, 512}, {1536, 512}, {512, 1536}, {8192, 512}};
static const uint32_t types[] = {KVQ_F32, KVQ_F16, KVQ_BF16, KVQ_Q8_0, KVQ_Q4_0, KVQ_Q4_K, KVQ_Q6_K};

/* Best of several batches: the machine may be shared, the minimum is the kernel's speed. */
static double time_matmul(const struct kern_matmul_args *a, int64_t rows, double min_time) {
    kern_matmul(a, 0, rows); /* warm */
    double best = 1e30;
    for (int batch = 0; batch < 7; batch++) {
        int iters = 0;
        double t0 = now(), t;
        do {
            kern_matmul(a, 0, rows);
            iters++;
            t = now() - t0;
        } while (t < min_time / 7);
        if (t / iters < best) best = t / iters;
    }
    return best;
}

static void bench_matmul(void) {
    printf("\n%-5s %-11s %12s %10s %14s %12s\n", "type", "rows x k", "matvec us", "GB/s", "matmul512 ms", "GFLOP/s");
    const int NT = 512;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        uint32_t type = types[ti];
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            int64_t rows = shapes[si].rows, k = shapes[si].k;
            size_t wrb = kvq_dtype_row_bytes(type, (uint64_t)k), xrb = kern_act_row_bytes(type, k);
            uint8_t *w = malloc(wrb * (size_t)rows);
            fill_weights(type, w, rows, k);
            float *x = malloc(sizeof(float) * (size_t)(NT * k));
            for (int64_t i = 0; i < NT * k; i++) x[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
            uint8_t *xa = malloc(xrb * NT);
            for (int t = 0; t < NT; t++) kern_act_prepare(type, x + t * k, xa + t * xrb, k);
            float *y = malloc(sizeof(float) * (size_t)(NT * rows));
            struct kern_matmul_args a = {type, w, wrb, k, xa, xrb, 1, y, rows, NULL};
            double tv = time_matmul(&a, rows, 0.15);
            a.n_tok = NT;
            double tm = time_matmul(&a, rows, 0.3);
            printf("%-5s %5lldx%-5lld %12.2f %10.1f %14.3f %12.1f\n", kvq_dtype_name(type), (long long)rows,
                   (long long)k, tv * 1e6, (double)(wrb * rows) / tv * 1e-9, tm * 1e3,
                   2.0 * rows * k * NT / tm * 1e-9);
            free(w);
            free(x);
            free(xa);
            free(y);
        }
    }
}

/* Same token split over 2 threads (rows halved, spin barrier after each matrix). */
struct dec2 {
    int nm;
    const struct shape *s;
    uint8_t *const *w;
    uint32_t type;
    const uint8_t *xa;
    float *y;
    atomic_int bar;
    int iters;
};

static void spin_barrier(atomic_int *b, int gen_target) {
    atomic_fetch_add(b, 1);
    while (atomic_load(b) < gen_target) {
    }
}

/* Seconds for fn on nt (1 or 2) threads: this one with a0, another with a1. */
static double run_threads(void *(*fn)(void *), int nt, void *a0, void *a1) {
    pthread_t th;
    const double t0 = now();
    if (nt > 1) pthread_create(&th, NULL, fn, a1);
    fn(a0);
    if (nt > 1) pthread_join(th, NULL);
    return now() - t0;
}

struct dec2_arg {
    struct dec2 *p;
    int ith;
    double best;
};

static void *dec2_run(void *a_) {
    struct dec2_arg *a = a_;
    struct dec2 *p = a->p;
    int gen = 0;
    a->best = 1e30;
    for (int it = 0; it < p->iters; it++) {
        double t0 = now();
        for (int i = 0; i < p->nm; i++) {
            int64_t rows = p->s[i].rows, half = (rows / 2 + 15) & ~(int64_t)15;
            int64_t r0 = a->ith ? half : 0, r1 = a->ith ? rows : half;
            struct kern_matmul_args m = {p->type, p->w[i], kvq_dtype_row_bytes(p->type, (uint64_t)p->s[i].k), p->s[i].k,
                                         p->xa, kern_act_row_bytes(p->type, p->s[i].k), 1, p->y, rows, NULL};
            kern_matmul(&m, r0, r1);
            gen += 2;
            spin_barrier(&p->bar, gen);
        }
        double dt = now() - t0;
        if (it >= 2 && dt < a->best) a->best = dt;
    }
    return NULL;
}

/* One decode token of tinydoc-q8_0 (6 layers + output), weights not cache-resident
 * when the total exceeds the cache: every matrix is a separate buffer. */
static void bench_decode(uint32_t type) {
    const int L = 6;
    struct shape layer[] = {{512, 512}, {256, 512}, {256, 512}, {512, 512}, {1536, 512}, {1536, 512}, {512, 1536}};
    const int nm = 7 * L + 1;
    struct shape s[7 * 6 + 1];
    uint8_t *w[7 * 6 + 1];
    size_t total = 0;
    for (int i = 0; i < nm; i++) {
        s[i] = i < 7 * L ? layer[i % 7] : (struct shape){8192, 512};
        size_t rb = kvq_dtype_row_bytes(type, (uint64_t)s[i].k);
        w[i] = malloc(rb * (size_t)s[i].rows);
        fill_weights(type, w[i], s[i].rows, s[i].k);
        total += rb * (size_t)s[i].rows;
    }
    float x[1536], y[8192];
    for (int i = 0; i < 1536; i++) x[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
    static uint8_t xa[1536 * 4];
    double t = 1e30;
    for (int it = 0; it < 300; it++) {
        double t0 = now();
        for (int i = 0; i < nm; i++) {
            kern_act_prepare(type, x, xa, s[i].k);
            struct kern_matmul_args a = {type, w[i], kvq_dtype_row_bytes(type, (uint64_t)s[i].k), s[i].k, xa,
                                         kern_act_row_bytes(type, s[i].k), 1, y, s[i].rows, NULL};
            kern_matmul(&a, 0, s[i].rows);
        }
        double dt = now() - t0;
        if (it >= 2 && dt < t) t = dt; /* best token after 2 warm-up tokens */
    }
    printf("decode token, best of 300 (tinydoc shapes, %s, %.1f MB weights, 1 thread): %.3f ms = %.1f GB/s = %.0f tok/s\n",
           kvq_dtype_name(type), total * 1e-6, t * 1e3, total / t * 1e-9, 1.0 / t);
    {
        static uint8_t xa2[1536 * 4];
        kern_act_prepare(type, x, xa2, 512);
        struct dec2 p = {nm, s, w, type, xa2, y, 0, 300};
        struct dec2_arg a0 = {&p, 0, 0}, a1 = {&p, 1, 0};
        run_threads(dec2_run, 2, &a0, &a1);
        double t2 = a0.best;
        printf("decode token, 2 threads (matmuls only, best of 300): %.3f ms = %.1f GB/s = %.0f tok/s\n", t2 * 1e3,
               total / t2 * 1e-9, 1.0 / t2);
    }
    for (int i = 0; i < nm; i++) free(w[i]);
}


static void bench_attention(void) {
    const int n_q = 2, d = 128;
    printf("\n");
    for (int f = 0; f < 2; f++) {
        const int depths[] = {512, 4096};
        for (int di = 0; di < 2; di++) {
            int n = depths[di];
            size_t es = f ? 4 : 2;
            uint8_t *k = malloc((size_t)n * d * es), *v = malloc((size_t)n * d * es);
            for (size_t i = 0; i < (size_t)n * d; i++) {
                float a = (float)(rnd() % 2000) / 1000.0f - 1.0f, b = (float)(rnd() % 2000) / 1000.0f - 1.0f;
                if (f) { memcpy(k + 4 * i, &a, 4); memcpy(v + 4 * i, &b, 4); }
                else { uint16_t ha = kvq_f32_to_f16(a), hb = kvq_f32_to_f16(b); memcpy(k + 2 * i, &ha, 2); memcpy(v + 2 * i, &hb, 2); }
            }
            float q[2 * 128], out[2 * 128], mem[2 * 130];
            for (int i = 0; i < n_q * d; i++) q[i] = ((float)(rnd() % 2000) / 1000.0f - 1.0f) * 0.1f;
            double t = 1e30;
            for (int it = 0; it < 2000; it++) {
                double t0 = now();
                struct kern_attn_state st;
                kern_attn_state_init(&st, n_q, d, mem);
                kern_attn_accumulate(&st, q, k, d, v, d, f ? 32 : 16, n);
                kern_attn_finish(&st, out);
                double dt = now() - t0;
                if (dt < t) t = dt;
            }
            double bytes = 2.0 * n * d * es;
            printf("attention %s n_q=%d d=%d depth %5d: %8.2f us  %6.1f GB/s of K/V  (x12 kv-head-layers: %.0f us)\n",
                   f ? "f32" : "f16", n_q, d, n, t * 1e6, bytes / t * 1e-9, 12 * t * 1e6);
            free(k);
            free(v);
        }
    }
}

/* ---- cold mode: working sets larger than the caches, as in a real decode ---- */

/* One tinydoc-q8_0 decode token per iteration over 4 copies of the weight set
 * (about 100 MB, > L3), rotating: the weights stream from DRAM as in generate. */
static void bench_decode_cold(uint32_t type) {
    enum { L = 6, NM = 7 * L + 1, COPIES = 4 };
    struct shape layer[] = {{512, 512}, {256, 512}, {256, 512}, {512, 512}, {1536, 512}, {1536, 512}, {512, 1536}};
    struct shape s[NM];
    uint8_t *w[COPIES][NM];
    size_t total = 0;
    for (int i = 0; i < NM; i++) {
        s[i] = i < 7 * L ? layer[i % 7] : (struct shape){8192, 512};
        size_t rb = kvq_dtype_row_bytes(type, (uint64_t)s[i].k);
        total += rb * (size_t)s[i].rows;
        for (int c = 0; c < COPIES; c++) {
            w[c][i] = malloc(rb * (size_t)s[i].rows);
            fill_weights(type, w[c][i], s[i].rows, s[i].k);
        }
    }
    float x[1536], y[8192];
    for (int i = 0; i < 1536; i++) x[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
    static uint8_t xa[1536 * 4];
    const int iters = 200;
    double sum = 0, best = 1e30;
    for (int it = 0; it < iters + 4; it++) {
        double t0 = now();
        for (int i = 0; i < NM; i++) {
            kern_act_prepare(type, x, xa, s[i].k);
            struct kern_matmul_args a = {type, w[it % COPIES][i], kvq_dtype_row_bytes(type, (uint64_t)s[i].k), s[i].k,
                                         xa, kern_act_row_bytes(type, s[i].k), 1, y, s[i].rows, NULL};
            kern_matmul(&a, 0, s[i].rows);
        }
        double dt = now() - t0;
        if (it >= 4) {
            sum += dt;
            if (dt < best) best = dt;
        }
    }
    double t = sum / iters;
    printf("COLD decode token (%s, %d copies x %.1f MB rotating, 1 thread): mean %.3f ms = %.1f GB/s = %.0f tok/s"
           " (best %.3f ms = %.1f GB/s)\n",
           kvq_dtype_name(type), COPIES, total * 1e-6, t * 1e3, total / t * 1e-9, 1.0 / t, best * 1e3,
           total / best * 1e-9);
    for (int c = 0; c < COPIES; c++)
        for (int i = 0; i < NM; i++) free(w[c][i]);
}

/* Blocks of `bytes` for a working set of COLD_MB (at least 12, at most COLD_MAX_BLOCKS):
 * more than a server CPU's L3, so each call streams its block from DRAM, as a batch's
 * sequences do (a working set inside L3 hides whether the kernel prefetches). */
#define COLD_MB 128
#define COLD_MAX_BLOCKS 256
static int cold_blocks(double bytes) {
    int nb = (int)(COLD_MB * 1e6 / bytes) + 1;
    return nb < 12 ? 12 : nb > COLD_MAX_BLOCKS ? COLD_MAX_BLOCKS : nb;
}

/* Attention at depth 4096 over separate (layer, kv-head) K/V blocks, rotating: each
 * call streams its block from DRAM. n_q query heads of d values a KV head. */
static void bench_attention_cold(int n_q, int d) {
    const int n = 4096;
    for (int f = 0; f < 2; f++) {
        size_t es = f ? 4 : 2, bytes = (size_t)n * d * es;
        const int nb = cold_blocks(2.0 * (double)bytes);
        uint8_t *k[COLD_MAX_BLOCKS], *v[COLD_MAX_BLOCKS];
        for (int b = 0; b < nb; b++) {
            k[b] = malloc(bytes);
            v[b] = malloc(bytes);
            for (size_t i = 0; i < (size_t)n * d; i++) {
                float a = (float)(rnd() % 2000) / 1000.0f - 1.0f, c = (float)(rnd() % 2000) / 1000.0f - 1.0f;
                if (f) { memcpy(k[b] + 4 * i, &a, 4); memcpy(v[b] + 4 * i, &c, 4); }
                else { uint16_t ha = kvq_f32_to_f16(a), hc = kvq_f32_to_f16(c); memcpy(k[b] + 2 * i, &ha, 2); memcpy(v[b] + 2 * i, &hc, 2); }
            }
        }
        float q[8 * 128], out[8 * 128], mem[8 * 130];
        for (int i = 0; i < n_q * d; i++) q[i] = ((float)(rnd() % 2000) / 1000.0f - 1.0f) * 0.1f;
        const int rounds = 720 / nb + 1;
        double t0 = 0;
        for (int it = 0; it < (rounds + 1) * nb; it++) {
            if (it == nb) t0 = now(); /* first round warms up */
            struct kern_attn_state st;
            kern_attn_state_init(&st, n_q, d, mem);
            kern_attn_accumulate(&st, q, k[it % nb], d, v[it % nb], d, f ? 32 : 16, n);
            kern_attn_finish(&st, out);
        }
        double t = (now() - t0) / (rounds * nb);
        printf("COLD attention %s n_q=%d d=%d depth %d, %d blocks rotating (%.0f MB): %8.2f us/call  %6.1f GB/s"
               "  (x12 = %.0f us/token)\n",
               f ? "f32" : "f16", n_q, d, n, nb, nb * 2.0 * bytes * 1e-6, t * 1e6, 2.0 * bytes / t * 1e-9,
               12 * t * 1e6);
        for (int b = 0; b < nb; b++) {
            free(k[b]);
            free(v[b]);
        }
    }
}

/* Same, over quantized rows at 4 and 8 bits in groups of `group`, and normal-float rows
 * (K4V3, K3V2), laid out as the paged cache lays them (kvcache/kv_pool.h): runs of 64
 * rows, a run's keys then its values, read by kern_kvq_attn_accumulate_runs. Short runs
 * are what the hardware prefetchers do not follow, so this measures the kernel's own
 * prefetching. */
static void bench_kvq_attention_cold(int n_q, int d, int group_u) {
    enum { RUN = 64 };
    const int n = 4096, n_runs = n / RUN;
    const int bitss[][3] = {{4, 4, group_u}, {8, 4, group_u}, {8, 8, group_u}, {4, 3, KERN_KVQ_NF}, {3, 2, KERN_KVQ_NF}};
    for (size_t bi = 0; bi < sizeof bitss / sizeof bitss[0]; bi++) {
        int kb = bitss[bi][0], vb = bitss[bi][1], group = bitss[bi][2];
        size_t krb = kern_kvq_row_bytes(kb, group, d), vrb = kern_kvq_row_bytes(vb, group, d);
        const size_t run_bytes = RUN * (krb + vrb);
        const int nb = cold_blocks((double)run_bytes * n_runs);
        uint8_t *kv[COLD_MAX_BLOCKS];
        float row[KERN_KVQ_MAX_DIM];
        for (int b = 0; b < nb; b++) {
            kv[b] = malloc(run_bytes * n_runs);
            for (int j = 0; j < n; j++) {
                uint8_t *r = kv[b] + (size_t)(j / RUN) * run_bytes;
                for (int i = 0; i < d; i++) row[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
                kern_kvq_quantize_row(row, d, kb, group, r + (size_t)(j % RUN) * krb);
                for (int i = 0; i < d; i++) row[i] = (float)(rnd() % 2000) / 1000.0f - 1.0f;
                kern_kvq_quantize_row(row, d, vb, group, r + RUN * krb + (size_t)(j % RUN) * vrb);
            }
        }
        float q[8 * 128], out[8 * 128], mem[8 * 130];
        for (int i = 0; i < n_q * d; i++) q[i] = ((float)(rnd() % 2000) / 1000.0f - 1.0f) * 0.1f;
        struct kern_kv_run runs[4096 / RUN];
        const struct kern_kv_rows kf = {NULL, krb, kb, group}, vf = {NULL, vrb, vb, group};
        const int rounds = 720 / nb + 1;
        double t0 = 0;
        for (int it = 0; it < (rounds + 1) * nb; it++) {
            if (it == nb) t0 = now();
            struct kern_attn_state st;
            kern_attn_state_init(&st, n_q, d, mem);
            for (int r = 0; r < n_runs; r++) {
                const uint8_t *base = kv[it % nb] + (size_t)r * run_bytes;
                runs[r] = (struct kern_kv_run){base, base + RUN * krb, RUN};
            }
            kern_kvq_attn_accumulate_runs(&st, q, &kf, &vf, runs, n_runs);
            kern_attn_finish(&st, out);
        }
        double t = (now() - t0) / (rounds * nb);
        double bytes = (double)run_bytes * n_runs;
        printf("COLD kvq attention K%d/V%d%s n_q=%d d=%d depth %d in runs of %d, %d blocks (%.0f MB): %8.2f us/call"
               "  %6.1f GB/s  (x12 = %.0f us/token)\n",
               kb, vb, group == KERN_KVQ_NF ? " nf" : "", n_q, d, n, RUN, nb, nb * bytes * 1e-6, t * 1e6, bytes / t * 1e-9,
               12 * t * 1e6);
        for (int b = 0; b < nb; b++) free(kv[b]);
    }
}

/* ---- ceilings: what two threads of this machine can read and multiply ---- */
#define CEIL_BYTES ((size_t)512 << 20) /* far past any L3 */
#define CEIL_DP 200000000L             /* vpdpbusd a thread */
struct ceil_arg {
    const uint8_t *p;
    size_t n;
};
static volatile uint64_t ceil_sink; /* keeps the reads and sums */

static void *ceil_read(void *arg) {
    const struct ceil_arg *a = arg;
    uint64_t s[8] = {0};
    for (size_t i = 0; i < a->n; i += 64) {
        const uint64_t *w = (const uint64_t *)(a->p + i);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) s[j] += w[j];
    }
    ceil_sink = s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
    return NULL;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same with one 64-byte load a line (about 10% more from DRAM than 8-byte loads). */
__attribute__((target("avx512f"))) static void *ceil_read512(void *arg) {
    const struct ceil_arg *a = arg;
    __m512i s = _mm512_setzero_si512();
    for (size_t i = 0; i < a->n; i += 64) s = _mm512_add_epi64(s, _mm512_load_si512(a->p + i));
    ceil_sink = (uint64_t)_mm512_reduce_add_epi64(s);
    return NULL;
}

/* CEIL_DP vpdpbusd in 16 independent chains: enough to cover its latency on both pipes. */
__attribute__((target("avx512f,avx512vnni"))) static void *ceil_dp(void *arg) {
    (void)arg;
    __m512i acc[16];
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
    for (long n = 0; n < CEIL_DP; n += 16)
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    int32_t s = 0;
    for (int i = 0; i < 16; i++) s += _mm512_reduce_add_epi32(acc[i]);
    ceil_sink = (uint64_t)s;
    return NULL;
}
static bool ceil_avx512(void) { return kvq_simd_level() == KVQ_SIMD_AVX512; }
#else
#define ceil_read512 ceil_read
static void *ceil_dp(void *arg) { return arg; }
static bool ceil_avx512(void) { return false; }
#endif

static void bench_ceilings(void) {
    uint8_t *buf = aligned_alloc(64, CEIL_BYTES);
    if (!buf) {
        fprintf(stderr, "ceilings: out of memory\n");
        return;
    }
    for (size_t i = 0; i < CEIL_BYTES; i++) buf[i] = (uint8_t)i;
    void *(*read)(void *) = ceil_avx512() ? ceil_read512 : ceil_read;
    for (int nt = 1; nt <= 2; nt++) {
        struct ceil_arg a[2] = {{buf, CEIL_BYTES / nt}, {buf + CEIL_BYTES / 2, CEIL_BYTES / 2}};
        double best = 1e30;
        for (int it = 0; it < 4; it++) {
            const double t = run_threads(read, nt, &a[0], &a[1]);
            if (t < best) best = t;
        }
        printf("DRAM read, %d thread%s: %.1f GB/s\n", nt, nt > 1 ? "s" : "", (double)CEIL_BYTES / best * 1e-9);
    }
    free(buf);
    if (ceil_avx512())
        for (int nt = 1; nt <= 2; nt++)
            printf("int8 multiply-adds (vpdpbusd), %d thread%s: %.0f G/s\n", nt, nt > 1 ? "s" : "",
                   (double)nt * CEIL_DP * 64 / run_threads(ceil_dp, nt, NULL, NULL) * 1e-9);
}

int main(int argc, char **argv) {
    int cold = 0, ceilings = 0;
    if (argc > 1 && strcmp(argv[argc - 1], "cold") == 0) {
        cold = 1;
        argc--;
    } else if (argc > 1 && strcmp(argv[argc - 1], "ceilings") == 0) {
        ceilings = 1;
        argc--;
    }
    if (argc > 1) {
        /* avx2: without AVX-VNNI; avx2vnni: with it */
        const int vnni = strcmp(argv[1], "avx2vnni") == 0;
        enum kvq_simd l = KVQ_SIMD_AVX512;
        if (strcmp(argv[1], "scalar") == 0) l = KVQ_SIMD_SCALAR;
        else if (vnni || strcmp(argv[1], "avx2") == 0) l = KVQ_SIMD_AVX2;
        kvq_cpu_use_avx_vnni(vnni);
        if (kvq_simd_force(l) != 0 || (vnni && !kvq_cpu_avx_vnni())) {
            fprintf(stderr, "level %s not available\n", argv[1]);
            return 1;
        }
    }
    printf("kernels: %s\n", kern_simd_level());
    if (ceilings) {
        bench_ceilings();
        return 0;
    }
    if (cold) {
        bench_decode_cold(KVQ_Q8_0);
        if (argc > 2 || getenv("KVQ_BENCH_ALL_TYPES")) {
            bench_decode_cold(KVQ_Q4_0);
            bench_decode_cold(KVQ_Q4_K);
            bench_decode_cold(KVQ_Q6_K);
            bench_decode_cold(KVQ_F16);
        }
        bench_attention_cold(2, 128);
        bench_kvq_attention_cold(2, 128, 32);
        bench_attention_cold(7, 64); /* Qwen2.5's 7 query heads a KV head, of 64 values */
        bench_kvq_attention_cold(7, 64, 64);
        return 0;
    }
    bench_decode(KVQ_Q8_0);
    bench_attention();
    bench_matmul();
    return 0;
}
