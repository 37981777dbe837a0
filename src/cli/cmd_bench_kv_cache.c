/* kvq bench-kv-cache: memory, reconstruction error and speed of the KV row formats.
 * Keys and values are Gaussian, or real activations of a model over a text
 * (--from-model), laid out [layers][heads][seq][head_dim]. For each mode: memory and
 * compression against f16, mean/max absolute error after a round trip, quantize and
 * dequantize time, and the time of one decode-step attention per head over the whole
 * cache read from the packed rows, against the same attention over f16 rows. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "engine/engine_internal.h"
#include "kernels/attention.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_cache.h"

static const char *const bench_help =
    "usage: kvq bench-kv-cache [options]\n"
    "\n"
    "  --layers N            layers (default 32)\n"
    "  --seq-len N           tokens (default 512)\n"
    "  --heads N             KV heads (default 32)\n"
    "  --head-dim N          values per head (default 128)\n"
    "  --bits LIST           modes, e.g. 16,8,4,3,2,4nf,3nf (default 16,8,6,5,4,3,2,5nf,4nf,3nf,2nf);\n"
    "                        Bnf: normal-float rows of B bits (2-5; one scale a row)\n"
    "  --group-size G        values per group (default 64)\n"
    "  --rotation MODE       none | hadamard (rotate rows before quantizing)\n"
    "  --from-model MODEL    use the model's keys and values over -f TEXT instead of Gaussian data\n"
    "  -f, --file TEXT       text for --from-model\n"
    "  --repeat N            timing repetitions, best kept (default 3)\n";

struct data {
    int L, H, S, D;
    float *k, *v; /* [L][H][S][D] */
};

/* A --bits entry of normal-float rows ("4nf"). */
static bool mode_nf(const char *tok) {
    size_t n = strlen(tok);
    return n > 2 && !strcmp(tok + n - 2, "nf");
}

static float gauss(uint64_t *s) {
    double u = 0;
    for (int i = 0; i < 2; i++) {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
    }
    double a = ((*s >> 11) + 0.5) / 9007199254740992.0;
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    double b = (*s >> 11) / 9007199254740992.0;
    u = sqrt(-2 * log(a)) * cos(6.283185307179586 * b);
    return (float)u;
}

static int from_model(const char *model, const char *file, int seq, struct data *d) {
    size_t len;
    char *text = cli_read_file(file, &len);
    if (!text) return -1;
    struct kvq_model_info info;
    struct kvq_model *m = cli_load_model(model, &info);
    if (!m) {
        free(text);
        return 1;
    }
    kvq_token *toks = len < (1u << 28) ? malloc(sizeof(kvq_token) * (len + 8)) : NULL;
    int n = toks ? kvq_tokenize(m, text, len, true, false, toks, (int)len + 8) : -1;
    free(text);
    if (n <= 0 || n > (int)len + 8) {
        cli_fail("cannot tokenize '%s': %s", file, n == 0 ? "it is empty" : toks ? kvq_last_error() : "out of memory");
        kvq_model_free(m);
        free(toks);
        return -1;
    }
    if (n > seq) n = seq;
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = n + 1;
    cp.n_batch = 512;
    cp.kv.k_bits = cp.kv.v_bits = 32;
    struct kvq_context *ctx = kvq_context_new(m, &cp);
    int rc = ctx ? 0 : -1;
    /* every layer must hold all S rows: sliding-window layers hold only their window */
    struct kvq_kv_layer_kind kinds[8];
    int nk = ctx ? kvq_kv_layer_kinds(ctx, kinds, 8) : 0;
    for (int i = 0; i < nk && i < 8; i++)
        if (kinds[i].max_size > 0 && kinds[i].max_size < n) {
            fprintf(stderr, "kvq: using %d tokens: the model's sliding layers hold only their window\n",
                    kinds[i].max_size);
            n = kinds[i].max_size;
        }
    for (int i = 0; i < n && rc == 0; i += 512) {
        struct kvq_batch b = {.n_tokens = n - i < 512 ? n - i : 512, .tokens = toks + i};
        rc = kvq_decode(ctx, &b);
    }
    if (rc != 0) {
        cli_fail("%s", kvq_last_error());
    } else {
        d->L = info.n_layer;
        d->H = info.n_head_kv;
        d->S = n;
        d->D = info.head_dim;
        size_t total = (size_t)d->L * d->H * d->S * d->D;
        d->k = malloc(sizeof(float) * total);
        d->v = malloc(sizeof(float) * total);
        if (!d->k || !d->v) {
            kvq_context_free(ctx);
            kvq_model_free(m);
            free(toks);
            return cli_fail("out of memory for %zu values", total);
        }
        struct kv_cache **caches = engine_seq_caches(ctx, 0);
        for (int l = 0; l < d->L; l++)
            for (int h = 0; h < d->H; h++) {
                size_t off = ((size_t)l * d->H + h) * d->S * d->D;
                kv_cache_read_rows(caches[l], h, 0, d->k + off, NULL, d->S);
                kv_cache_read_rows(caches[l], h, 1, d->v + off, NULL, d->S);
            }
        printf("keys and values of %s over %d tokens of %s: %d layers, %d KV heads, head_dim %d\n", model, n, file,
               d->L, d->H, d->D);
    }
    kvq_context_free(ctx);
    kvq_model_free(m);
    free(toks);
    return rc;
}

/* One decode-step attention per (layer, head) over all S rows; returns ms. */
static double time_attention(const struct data *d, const uint8_t *kb, const uint8_t *vb, size_t row, int bits,
                             int group, const float *q, int repeat) {
    float *mem = malloc(sizeof(float) * kern_attn_state_floats(1, d->D)), *out = malloc(sizeof(float) * d->D);
    double best = 1e30;
    volatile float sink = 0;
    for (int r = 0; r < repeat; r++) {
        double t0 = cli_now();
        for (int lh = 0; lh < d->L * d->H; lh++) {
            struct kern_attn_state st;
            kern_attn_state_init(&st, 1, d->D, mem);
            const uint8_t *k = kb + (size_t)lh * d->S * row, *v = vb + (size_t)lh * d->S * row;
            if (bits >= 16) {
                kern_attn_accumulate(&st, q, k, (size_t)d->D, v, (size_t)d->D, bits, d->S);
            } else {
                struct kern_kv_rows kr = {k, row, bits, group}, vr = {v, row, bits, group};
                kern_kvq_attn_accumulate(&st, q, &kr, &vr, d->S);
            }
            kern_attn_finish(&st, out);
            sink += out[0];
        }
        double t = (cli_now() - t0) * 1e3;
        best = t < best ? t : best;
    }
    (void)sink;
    free(mem);
    free(out);
    return best;
}

static const char *const bench_kv_cache_value_flags[] = {"--layers", "--seq-len", "--heads", "--head-dim", "--group-size", "--repeat", "--bits", "--from-model", "-f", "--file", "--rotation", NULL};

int cmd_bench_kv_cache(int argc, char **argv) {
    int L = 32, S = 512, H = 32, D = 128, group = 64, repeat = 3;
    bool rot = false;
    const char *bits_list = "16,8,6,5,4,3,2,5nf,4nf,3nf,2nf", *model = NULL, *file = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(bench_help, stdout);
            return 0;
        }
        if (!(v = cli_option_value(argc, argv, &i, bench_kv_cache_value_flags, "bench-kv-cache"))) return 1;
        bool ok = true;
        if (!strcmp(a, "--layers")) ok = cli_parse_int(a, v, 1, 1024, &L);
        else if (!strcmp(a, "--seq-len")) ok = cli_parse_int(a, v, 1, 1 << 20, &S);
        else if (!strcmp(a, "--heads")) ok = cli_parse_int(a, v, 1, 1024, &H);
        else if (!strcmp(a, "--head-dim")) ok = cli_parse_int(a, v, 8, KERN_KVQ_MAX_DIM, &D);
        else if (!strcmp(a, "--group-size")) ok = cli_parse_int(a, v, 8, 128, &group);
        else if (!strcmp(a, "--repeat")) ok = cli_parse_int(a, v, 1, 1000, &repeat);
        else if (!strcmp(a, "--bits")) bits_list = v;
        else if (!strcmp(a, "--from-model")) model = v;
        else if (!strcmp(a, "-f") || !strcmp(a, "--file")) file = v;
        else if (!strcmp(a, "--rotation")) {
            if (strcmp(v, "hadamard") && strcmp(v, "none")) return cli_fail("--rotation: expected none or hadamard");
            rot = !strcmp(v, "hadamard");
        } else return cli_fail("unknown option '%s' for bench-kv-cache (see 'kvq bench-kv-cache --help')", a);
        if (!ok) return 1;
    }
    char list[128];
    snprintf(list, sizeof list, "%s", bits_list);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) { /* all checked before any allocation */
        int bits = atoi(tok);
        if (bits != 16 && bits != 32 && !kern_kvq_bits_quantized(bits)) return cli_fail("invalid bits '%s'", tok);
        if (mode_nf(tok) && !kern_kvq_nf_bits(bits)) return cli_fail("invalid bits '%s': normal-float rows have 2 to 5", tok);
    }
    if (model && !file) return cli_fail("--from-model needs a text: -f FILE");
    struct data d = {L, H, S, D, NULL, NULL};
    int rc = 1;
    float *signs = NULL, *q = NULL, *x = NULL;
    uint8_t *kb = NULL, *vb = NULL;
    if (model) {
        if (from_model(model, file, S, &d) != 0) goto done;
    } else {
        size_t total = (size_t)L * H * S * D;
        d.k = malloc(sizeof(float) * total);
        d.v = malloc(sizeof(float) * total);
        if (!d.k || !d.v) {
            cli_fail("out of memory for %zu values", total);
            goto done;
        }
        uint64_t s = 0x9e3779b97f4a7c15ull;
        for (size_t i = 0; i < total; i++) d.k[i] = gauss(&s), d.v[i] = gauss(&s);
    }
    if (d.D % group != 0) {
        cli_fail("group size %d does not divide head_dim %d", group, d.D);
        goto done;
    }
    size_t n_rows = (size_t)d.L * d.H * d.S;
    signs = malloc(sizeof(float) * d.D), q = malloc(sizeof(float) * d.D), x = malloc(sizeof(float) * d.D);
    if (!signs || !q || !x) {
        cli_fail("out of memory");
        goto done;
    }
    kern_kvq_hadamard_signs(signs, d.D, 1);
    uint64_t s = 42;
    for (int i = 0; i < d.D; i++) q[i] = gauss(&s) / sqrtf((float)d.D);
    size_t f16_bytes = n_rows * d.D * 2 * 2;
    printf("bench-kv-cache: %d layers x %d heads x %d tokens x head_dim %d, group %d%s, kernels %s, 1 thread\n", d.L,
           d.H, d.S, d.D, group, rot ? ", hadamard" : "", kern_kvq_simd_level());
    printf("| mode | bits per value | memory MiB | vs f16 | mean abs err | max abs err | quantize ms | dequantize ms | "
           "attention ms | f16 attention ms |\n|---|---|---|---|---|---|---|---|---|---|\n");
    double f16_attn = -1;
    snprintf(list, sizeof list, "%s", bits_list);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        int bits = atoi(tok);
        const int G = mode_nf(tok) ? KERN_KVQ_NF : group;
        size_t row = kern_kvq_row_bytes(bits, G, d.D);
        kb = malloc(row * n_rows), vb = malloc(row * n_rows);
        if (!kb || !vb) {
            cli_fail("out of memory");
            goto done;
        }
        double t0 = cli_now();
        for (size_t r = 0; r < n_rows; r++)
            for (int w = 0; w < 2; w++) {
                const float *src = (w ? d.v : d.k) + r * d.D;
                if (rot && bits < 16) {
                    memcpy(x, src, sizeof(float) * d.D);
                    kern_kvq_hadamard(x, d.D, signs);
                    src = x;
                }
                kern_kvq_quantize_row(src, d.D, bits, G, (w ? vb : kb) + r * row);
            }
        double tq = (cli_now() - t0) * 1e3;
        double err_sum = 0, err_max = 0;
        t0 = cli_now();
        for (size_t r = 0; r < n_rows; r++)
            for (int w = 0; w < 2; w++) {
                kern_kvq_dequantize_row((w ? vb : kb) + r * row, d.D, bits, G, x);
                if (rot && bits < 16) kern_kvq_hadamard_inv(x, d.D, signs);
                const float *src = (w ? d.v : d.k) + r * d.D;
                for (int i = 0; i < d.D; i++) {
                    double e = fabs((double)x[i] - src[i]);
                    err_sum += e;
                    err_max = e > err_max ? e : err_max;
                }
            }
        double tdq = (cli_now() - t0) * 1e3;
        if (bits == 16 || f16_attn < 0) {
            /* the f16 reference attention (built once) */
            if (bits == 16) {
                f16_attn = time_attention(&d, kb, vb, row, 16, G, q, repeat);
            } else {
                size_t r16 = (size_t)d.D * 2;
                uint8_t *k16 = malloc(r16 * n_rows), *v16 = malloc(r16 * n_rows);
                if (!k16 || !v16) {
                    free(k16);
                    free(v16);
                    cli_fail("out of memory");
                    goto done;
                }
                for (size_t r = 0; r < n_rows; r++) {
                    kern_kvq_quantize_row(d.k + r * d.D, d.D, 16, G, k16 + r * r16);
                    kern_kvq_quantize_row(d.v + r * d.D, d.D, 16, G, v16 + r * r16);
                }
                f16_attn = time_attention(&d, k16, v16, r16, 16, G, q, repeat);
                free(k16);
                free(v16);
            }
        }
        double ta = bits == 16 ? f16_attn : time_attention(&d, kb, vb, row, bits, G, q, repeat);
        size_t bytes = row * n_rows * 2;
        char name[32];
        if (G == KERN_KVQ_NF) snprintf(name, sizeof name, "nf%d", bits);
        else snprintf(name, sizeof name, bits >= 16 ? "f%d" : "q%d g%d", bits, G);
        printf("| %s | %.4f | %.1f | %.2fx | %.5f | %.4f | %.1f | %.1f | %.2f | %.2f |\n", name, 8.0 * row / d.D, bytes / 1048576.0,
               (double)f16_bytes / bytes, err_sum / (2.0 * n_rows * d.D), err_max, tq, tdq, ta, f16_attn);
        fflush(stdout);
        free(kb);
        free(vb);
        kb = vb = NULL;
    }
    rc = 0;
done:
    free(kb);
    free(vb);
    free(signs);
    free(q);
    free(x);
    free(d.k);
    free(d.v);
    return rc;
}
