/* kvq bench: prefill and decode speed, KV cache size and memory for each KV config
 * x depth x batch.
 *
 * One measurement (config, depth d, batch B): a fresh context with B sequences; each
 * sequence gets d + p random tokens by real model evaluation (all B sequences in
 * one batch call: the prefill, timed), then n decode steps where the B sequences
 * each take one token per step together (timed). prefill tok/s = B*(d+p) / time,
 * decode tok/s = B*n / time. Each sequence's logits are asked for at its last token;
 * with more than one sequence only their KVQ_TOP_N largest are kept (kvq_batch.top_only,
 * all a greedy draw reads, as the server asks for them), so that on a GPU no step
 * copies B rows of the vocabulary to the host (64 MB for 128 rows of 128K), which no
 * serving step does; one sequence's row is read whole, as llama-bench reads it.
 * Configs run interleaved (A B C A B C ...) for each repetition, so slow drifts of a
 * noisy machine hit all configs alike; the report gives medians over the repetitions. An untimed warm-up run of each config comes first,
 * and each measurement's first WARM_STEPS decode steps are untimed: a context's first
 * steps record its decode step as CUDA graphs (ms, once per context), which a server's
 * long-lived context pays once, not per token (llama-bench also warms up a token). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/cpu.h"
#include "core/outfile.h"
#include "core/threadpool.h"

static const char *const bench_help =
    "usage: kvq bench -m MODEL [-p 512] [-n 128] [-d 0,4096,16384] [-b 1,4,16] [--kv SPEC ...]\n"
    "                 [-t N] [-r REPS] [--json] [--plot FILE.svg]\n"
    "\n"
    "For each KV config x depth x batch: prefill tok/s, decode tok/s at that depth, KV bytes\n"
    "and memory. Each sequence of the batch is filled with depth + p random tokens by real\n"
    "evaluation (timed as prefill), then the B sequences decode n tokens together (timed,\n"
    "after 3 untimed steps). With more than one sequence each step keeps only each\n"
    "sequence's 8 largest logits (what greedy decoding and the server read).\n"
    "Configs run interleaved with repetitions; the report shows medians.\n"
    "\n"
    "  -m, --model FILE     GGUF model\n"
    "  -p N                 prompt tokens after the depth (default 512)\n"
    "  -n N                 decode steps (default 128)\n"
    "  -d LIST              depths: tokens already in the cache (default 0)\n"
    "  -b LIST              batches: sequences decoding together (default 1)\n"
    "  --kv SPEC            a KV config; repeat for several (default f16), e.g.\n"
    "                       --kv f16 --kv 8 --kv 8,4 --kv 4:g32 (SPEC is described below)\n"
    "  -t, --threads N      threads (default: all cores)\n"
    "  --batch-size N       tokens per forward pass (default 512)\n"
    "  --device cpu|cuda    where the model runs (default cpu; also -ngl N)\n"
    "  --gpu-f16-weights auto|off  cuda: f16 weight copies for wide products (default auto)\n"
    "  --tp N               cuda: tensor parallelism over N GPUs (also -tp); --devices LIST\n"
    "  -r, --reps N         repetitions (default 3)\n"
    "  --json               JSON instead of the Markdown table\n"
    "  --plot FILE.svg      also write an SVG plot of decode tok/s vs depth per config\n"
    "  -h, --help           this text\n"
    "\n"
    "Memory: rss = VmRSS at the end of a measurement (context alive; includes the mapped\n"
    "weights pages touched so far); peak = VmHWM, the process's high-water mark so far\n"
    "(cumulative over the run: it never goes down; from getrusage when /proc is missing).\n";

#define MAX_LIST 32
#define WARM_STEPS 3

struct kv_spec {
    char name[64];
    struct kvq_kv_config kv;
};

struct result {
    double *prefill, *decode; /* [reps] */
    size_t kv_bytes, kv_token_bytes;
    long long rss, peak;
};

struct bench_opts {
    const char *model, *plot;
    int p, n, reps, n_threads, n_batch;
    enum kvq_device device;
    bool f16_weights_off;
    struct kvq_context_params gpus; /* --tp, --devices */
    int depths[MAX_LIST], n_depths, batches[MAX_LIST], n_batches;
    struct kv_spec kvs[MAX_LIST];
    int n_kvs;
    bool json;
};

static bool parse_list(const char *flag, const char *v, long min, long max, int *out, int *n) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", v);
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n == MAX_LIST) {
            cli_fail("%s takes at most %d values", flag, MAX_LIST);
            return false;
        }
        if (!cli_parse_int(flag, tok, min, max, &out[(*n)++])) return false;
    }
    if (*n == 0) {
        cli_fail("%s needs at least one value", flag);
        return false;
    }
    return true;
}

/* Runs one KV flag through the shared parser (same rules and messages as the flags). */
static bool parse_kv_spec(const char *spec, struct kv_spec *out) {
    snprintf(out->name, sizeof out->name, "%s", spec);
    return cli_parse_kv_spec(spec, &out->kv);
}

static bool parse_depths(const char *flag, const char *v, void *out) {
    struct bench_opts *o = out;
    return parse_list(flag, v, 0, 1 << 22, o->depths, &o->n_depths);
}

static bool parse_batches(const char *flag, const char *v, void *out) {
    struct bench_opts *o = out;
    return parse_list(flag, v, 1, 4096, o->batches, &o->n_batches);
}

static bool add_kv(const char *flag, const char *v, void *out) {
    (void)flag;
    struct bench_opts *o = out;
    if (o->n_kvs == MAX_LIST) return cli_fail("at most %d --kv configs", MAX_LIST), false;
    return parse_kv_spec(v, &o->kvs[o->n_kvs++]);
}

static bool parse_device(const char *flag, const char *v, void *out) { return cli_parse_device(flag, v, out); }
static bool parse_f16w(const char *flag, const char *v, void *out) { return cli_parse_f16_weights(flag, v, out); }
static bool parse_tp(const char *flag, const char *v, void *out) { return cli_parse_tp(flag, v, out); }

static int parse_args(int argc, char **argv, struct bench_opts *o) {
    o->p = 512;
    o->n = 128;
    o->reps = 3;
    o->n_batch = 512;
    o->depths[0] = 0, o->n_depths = 1;
    o->batches[0] = 1, o->n_batches = 1;
    const struct cli_opt opts[] = {
        CLI_FLAG(&o->json, "--json"),
        CLI_STR(&o->model, "-m", "--model"),
        CLI_INT(&o->p, 1, 1 << 20, "-p"),
        CLI_INT(&o->n, 1, 1 << 20, "-n"),
        CLI_FN(parse_depths, o, "-d"),
        CLI_FN(parse_batches, o, "-b"),
        CLI_FN(add_kv, o, "--kv"),
        CLI_INT(&o->n_threads, 1, 1024, "-t", "--threads"),
        CLI_INT(&o->n_batch, 1, 1 << 16, "--batch-size"),
        CLI_FN(parse_device, &o->device, "--device", "-ngl", "--n-gpu-layers", "--gpu-layers"),
        CLI_FN(parse_f16w, &o->f16_weights_off, "--gpu-f16-weights"),
        CLI_FN(parse_tp, &o->gpus, "--tp", "--tensor-parallel-size", "-tp", "--devices"),
        CLI_INT(&o->reps, 1, 1000, "-r", "--reps"),
        CLI_STR(&o->plot, "--plot"),
        CLI_END,
    };
    if (cli_parse_args(argc, argv, "bench", opts, NULL, NULL, bench_help, cli_kv_spec_help)) return 1;
    if (!o->model) return cli_fail("bench needs a model: -m FILE");
    if (o->n_kvs == 0) parse_kv_spec("f16", &o->kvs[o->n_kvs++]);
    return 0;
}

/* VmRSS and VmHWM in bytes (-1 when unknown). */
static void memory_usage(long long *rss, long long *peak) {
    *rss = *peak = -1;
    FILE *f = fopen("/proc/self/status", "r");
    if (f) {
        char line[256];
        long long v;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "VmRSS: %lld kB", &v) == 1) *rss = v * 1024;
            else if (sscanf(line, "VmHWM: %lld kB", &v) == 1) *peak = v * 1024;
        }
        fclose(f);
    }
    if (*peak < 0) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) == 0) *peak = (long long)ru.ru_maxrss * 1024;
    }
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* One measurement. Returns 0, or 1 with an error printed. */
static int measure(struct kvq_model *m, const struct bench_opts *o, const struct kv_spec *ks, int depth, int B,
                   int n_vocab, uint64_t seed, double *prefill, double *decode, struct result *r) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = depth + o->p + WARM_STEPS + o->n;
    cp.n_seq = B;
    cp.n_batch = o->n_batch;
    cp.n_threads = o->n_threads;
    cp.device = o->device;
    cp.gpu_f16_weights_off = o->f16_weights_off;
    cp.tp = o->gpus.tp;
    cp.n_gpus = o->gpus.n_gpus;
    memcpy(cp.gpus, o->gpus.gpus, sizeof cp.gpus);
    cp.kv = ks->kv;
    struct kvq_context *ctx = kvq_context_new(m, &cp);
    if (!ctx) return cli_fail("--kv %s: %s", ks->name, kvq_last_error());
    int per = depth + o->p;
    size_t nt = (size_t)per * B;
    kvq_token *tok = malloc(sizeof *tok * nt);
    int32_t *seq = malloc(sizeof *seq * nt);
    bool *lg = calloc(nt, sizeof *lg);
    int rc = 0;
    if (!tok || !seq || !lg) {
        rc = cli_fail("out of memory");
        goto out;
    }
    for (int b = 0; b < B; b++)
        for (int j = 0; j < per; j++) {
            size_t k = (size_t)b * per + j;
            tok[k] = (kvq_token)(splitmix(&seed) % (uint64_t)n_vocab);
            seq[k] = b;
            lg[k] = j == per - 1;
        }
    double t0 = cli_now();
    struct kvq_batch pb = {.n_tokens = (int)nt, .tokens = tok, .seq_ids = seq, .logits = lg, .top_only = B > 1};
    if (kvq_decode(ctx, &pb) != 0) {
        rc = cli_fail("--kv %s, depth %d, batch %d: prefill failed: %s", ks->name, depth, B, kvq_last_error());
        goto out;
    }
    double t1 = cli_now();
    for (int b = 0; b < B; b++) {
        seq[b] = b;
        lg[b] = true;
    }
    double t_dec = t1;
    for (int step = -WARM_STEPS; step < o->n; step++) {
        if (step == 0) t_dec = cli_now();
        for (int b = 0; b < B; b++) tok[b] = (kvq_token)(splitmix(&seed) % (uint64_t)n_vocab);
        struct kvq_batch db = {.n_tokens = B, .tokens = tok, .seq_ids = seq, .logits = lg, .top_only = B > 1};
        if (kvq_decode(ctx, &db) != 0) {
            rc = cli_fail("--kv %s, depth %d, batch %d: decode failed: %s", ks->name, depth, B, kvq_last_error());
            goto out;
        }
    }
    double t2 = cli_now();
    *prefill = (double)nt / (t1 - t0);
    *decode = (double)B * o->n / (t2 - t_dec);
    r->kv_bytes = kvq_kv_bytes(ctx);
    memory_usage(&r->rss, &r->peak);
out:
    free(tok);
    free(seq);
    free(lg);
    kvq_context_free(ctx);
    return rc;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double tmp[1000];
    memcpy(tmp, v, sizeof(double) * (size_t)n);
    qsort(tmp, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", *s);
        else fputc(*s, f);
    }
    fputc('"', f);
}

/* ---- SVG plot: decode tok/s vs depth, one line per config (and batch). ---- */

static int write_plot(const char *path, const struct bench_opts *o, struct result *res, const char *model_name) {
    struct kvq_outfile out;
    FILE *f = kvq_outfile_open(&out, path);
    if (!f) return cli_fail("%s", kvq_last_error());
    const int W = 720, H = 440, L = 70, R = 200, T = 40, Bm = 50;
    double xmax = 0, ymax = 0;
    for (int di = 0; di < o->n_depths; di++) xmax = o->depths[di] > xmax ? o->depths[di] : xmax;
    int nres = o->n_kvs * o->n_depths * o->n_batches;
    for (int i = 0; i < nres; i++) {
        double d = median(res[i].decode, o->reps);
        if (d > ymax) ymax = d;
    }
    if (xmax <= 0) xmax = 1;
    if (ymax <= 0) ymax = 1;
    ymax *= 1.1;
    double pw = W - L - R, ph = H - T - Bm;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
               "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
    fprintf(f, "<text x=\"%d\" y=\"22\" font-size=\"14\">decode tok/s vs depth: ", L);
    for (const char *c = model_name; *c; c++) {
        if (*c == '<') fputs("&lt;", f);
        else if (*c == '&') fputs("&amp;", f);
        else if (*c == '>') fputs("&gt;", f);
        else fputc(*c, f);
    }
    fprintf(f, "</text>\n");
    fprintf(f, "<line x1=\"%d\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n", L, T + ph, L + pw, T + ph);
    fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%g\" stroke=\"black\"/>\n", L, T, L, T + ph);
    for (int k = 0; k <= 5; k++) {
        double yv = ymax * k / 5, y = T + ph - ph * k / 5;
        fprintf(f, "<line x1=\"%d\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#ddd\"/>\n", L, y, L + pw, y);
        fprintf(f, "<text x=\"%d\" y=\"%g\" text-anchor=\"end\">%.3g</text>\n", L - 6, y + 4, yv);
    }
    for (int di = 0; di < o->n_depths; di++) {
        double x = L + pw * o->depths[di] / xmax;
        fprintf(f, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n", x, T + ph, x, T + ph + 5);
        fprintf(f, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%d</text>\n", x, T + ph + 18, o->depths[di]);
    }
    fprintf(f, "<text x=\"%g\" y=\"%d\" text-anchor=\"middle\">depth (tokens in the cache)</text>\n", L + pw / 2, H - 8);
    fprintf(f, "<text x=\"16\" y=\"%g\" transform=\"rotate(-90 16 %g)\" text-anchor=\"middle\">decode tok/s</text>\n",
            T + ph / 2, T + ph / 2);
    static const char *const colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                         "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
    int line = 0;
    for (int bi = 0; bi < o->n_batches; bi++)
        for (int ci = 0; ci < o->n_kvs; ci++, line++) {
            const char *col = colors[line % 10];
            fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", col,
                    bi % 2 ? " stroke-dasharray=\"6 3\"" : "");
            for (int di = 0; di < o->n_depths; di++) {
                struct result *r = &res[(di * o->n_batches + bi) * o->n_kvs + ci];
                fprintf(f, "%.1f,%.1f ", L + pw * o->depths[di] / xmax, T + ph - ph * median(r->decode, o->reps) / ymax);
            }
            fprintf(f, "\"/>\n");
            for (int di = 0; di < o->n_depths; di++) {
                struct result *r = &res[(di * o->n_batches + bi) * o->n_kvs + ci];
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", L + pw * o->depths[di] / xmax,
                        T + ph - ph * median(r->decode, o->reps) / ymax, col);
            }
            double ly = T + 10 + 18 * line;
            fprintf(f, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" stroke-width=\"2\"/>\n", L + pw + 15,
                    ly, L + pw + 40, ly, col);
            fprintf(f, "<text x=\"%g\" y=\"%g\">", L + pw + 46, ly + 4);
            for (const char *c = o->kvs[ci].name; *c; c++) fputc(*c == '<' || *c == '&' ? '_' : *c, f);
            fprintf(f, " (batch %d)</text>\n", o->batches[bi]);
        }
    fprintf(f, "</svg>\n");
    return kvq_outfile_commit(&out) != 0 ? cli_fail("%s", kvq_last_error()) : 0;
}

int cmd_bench(int argc, char **argv) {
    struct bench_opts o;
    memset(&o, 0, sizeof o);
    if (parse_args(argc, argv, &o) != 0) return 1;
    struct kvq_model_info info;
    struct kvq_model *m = cli_load_model(o.model, &info);
    if (!m) return 1;
    for (int di = 0; di < o.n_depths; di++)
        if (o.depths[di] + o.p + o.n > info.n_ctx_train)
            fprintf(stderr, "kvq: note: depth %d + %d + %d exceeds the model's training context %d\n", o.depths[di],
                    o.p, o.n, info.n_ctx_train);
    int nres = o.n_kvs * o.n_depths * o.n_batches, rc = 1;
    struct result *res = calloc((size_t)nres, sizeof *res);
    double *store = calloc((size_t)nres * o.reps * 2, sizeof *store);
    if (!res || !store) {
        cli_fail("out of memory");
        goto done;
    }
    for (int i = 0; i < nres; i++) {
        res[i].prefill = store + (size_t)i * o.reps * 2;
        res[i].decode = res[i].prefill + o.reps;
    }
    int threads = o.n_threads > 0 ? o.n_threads : kvq_online_cpus();
    bool tty = isatty(STDERR_FILENO);
    int total = nres * o.reps, done_n = 0;
    double t_start = cli_now();
    /* Untimed warm-up of every config (page in the weights, grow the buffers, load
     * each config's kernels; past 128 tokens, where quantized caches choose their
     * offsets) so no measurement pays for what happens once. Its own sizes: a short
     * prompt (-p 1) would leave less context than a cache's residual window needs. */
    for (int ci = 0; ci < o.n_kvs; ci++) {
        double pf, dc;
        struct result warm = {0};
        struct bench_opts wo = o;
        wo.p = 160;
        wo.n = 4;
        if (tty) fprintf(stderr, "\rkvq: warm-up %d/%d", ci + 1, o.n_kvs);
        if (measure(m, &wo, &o.kvs[ci], 0, 1, info.n_vocab, 1, &pf, &dc, &warm) != 0) goto done;
    }
    for (int di = 0; di < o.n_depths; di++)
        for (int bi = 0; bi < o.n_batches; bi++)
            for (int rep = 0; rep < o.reps; rep++)
                for (int ci = 0; ci < o.n_kvs; ci++) { /* interleaved: A B C A B C ... */
                    struct result *r = &res[(di * o.n_batches + bi) * o.n_kvs + ci];
                    uint64_t seed = 0x5eedull + (uint64_t)rep * 1000003u + (uint64_t)di * 7919u + (uint64_t)bi;
                    if (tty)
                        fprintf(stderr, "\rkvq: [%d/%d] kv %s, depth %d, batch %d, rep %d   ", done_n + 1, total,
                                o.kvs[ci].name, o.depths[di], o.batches[bi], rep + 1);
                    if (measure(m, &o, &o.kvs[ci], o.depths[di], o.batches[bi], info.n_vocab, seed, &r->prefill[rep],
                                &r->decode[rep], r) != 0)
                        goto done;
                    r->kv_token_bytes = kvq_kv_token_bytes(m, &o.kvs[ci].kv);
                    done_n++;
                }
    if (tty) fprintf(stderr, "\rkvq: %d measurements in %.1f s%30s\n", total, cli_now() - t_start, "");

    char cpu[64];
    kvq_cpu_model(cpu, sizeof cpu);
    const char *simd = kvq_simd_level_name(); /* the CPU kernels' level: KVQ_SIMD caps it */
    if (o.json) {
        printf("{\n  \"model\": ");
        json_str(stdout, o.model);
        printf(",\n  \"arch\": ");
        json_str(stdout, info.arch);
        printf(",\n  \"weight_type\": ");
        json_str(stdout, info.weight_type);
        printf(",\n  \"cpu\": ");
        json_str(stdout, cpu);
        printf(",\n  \"simd\": ");
        json_str(stdout, simd);
        printf(",\n  \"tensor_parallel\": %d", o.gpus.tp > 1 ? o.gpus.tp : 1);
        printf(",\n  \"n_params\": %llu,\n  \"threads\": %d,\n  \"prompt_tokens\": %d,\n  \"decode_tokens\": %d,\n"
               "  \"reps\": %d,\n  \"memory_note\": \"rss_bytes: VmRSS at the end of the measurement; peak_rss_bytes: "
               "VmHWM, the process high-water mark so far (cumulative)\",\n  \"results\": [\n",
               (unsigned long long)info.n_params, threads, o.p, o.n, o.reps);
        for (int i = 0; i < nres; i++) {
            int ci = i % o.n_kvs, bi = (i / o.n_kvs) % o.n_batches, di = i / o.n_kvs / o.n_batches;
            struct result *r = &res[i];
            const struct kvq_kv_config *kv = &o.kvs[ci].kv;
            printf("    {\"kv\": ");
            json_str(stdout, o.kvs[ci].name);
            char layers[1024];
            if (kvq_kv_layer_bits_name(kv, layers, sizeof layers) < 0) layers[0] = '\0';
            printf(", \"k_bits\": %d, \"v_bits\": %d, \"k_group\": %d, \"v_group\": %d, \"layer_bits\": ", kv->k_bits,
                   kv->v_bits, kv->k_group, kv->v_group);
            json_str(stdout, layers);
            printf(", \"rotation\": %s, "
                   "\"depth\": %d, \"batch\": %d, \"prefill_tok_s\": %.3f, \"decode_tok_s\": %.3f, "
                   "\"kv_bytes\": %zu, \"kv_bytes_per_token\": %zu, \"rss_bytes\": %lld, \"peak_rss_bytes\": %lld, "
                   "\"prefill_tok_s_reps\": [",
                   kv->hadamard ? "true" : "false", o.depths[di],
                   o.batches[bi], median(r->prefill, o.reps), median(r->decode, o.reps), r->kv_bytes,
                   r->kv_token_bytes, r->rss, r->peak);
            for (int k = 0; k < o.reps; k++) printf("%s%.3f", k ? ", " : "", r->prefill[k]);
            printf("], \"decode_tok_s_reps\": [");
            for (int k = 0; k < o.reps; k++) printf("%s%.3f", k ? ", " : "", r->decode[k]);
            printf("]}%s\n", i + 1 < nres ? "," : "");
        }
        printf("  ]\n}\n");
    } else {
        char dev[64] = "cpu";
        if (o.device == KVQ_DEVICE_CUDA && o.gpus.tp > 1)
            snprintf(dev, sizeof dev, "cuda, tensor parallel over %d GPUs", o.gpus.tp);
        else if (o.device == KVQ_DEVICE_CUDA)
            snprintf(dev, sizeof dev, "cuda");
        printf("model %s (%s, %s, %.3f B params), %s, p %d, n %d, median of %d reps\n\n", o.model, info.arch,
               info.weight_type, info.n_params / 1e9, dev, o.p, o.n, o.reps);
        if (o.device != KVQ_DEVICE_CUDA) printf("%d threads, cpu %s, simd %s\n\n", threads, cpu, simd);
        printf("| kv | depth | batch | prefill tok/s | decode tok/s | KV MiB | KV bytes/token | RSS MiB | peak RSS MiB |\n");
        printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (int i = 0; i < nres; i++) {
            int ci = i % o.n_kvs, bi = (i / o.n_kvs) % o.n_batches, di = i / o.n_kvs / o.n_batches;
            struct result *r = &res[i];
            printf("| %s | %d | %d | %.2f | %.2f | %.2f | %zu | %.1f | %.1f |\n", o.kvs[ci].name, o.depths[di],
                   o.batches[bi], median(r->prefill, o.reps), median(r->decode, o.reps), r->kv_bytes / 1048576.0,
                   r->kv_token_bytes, r->rss / 1048576.0, r->peak / 1048576.0);
        }
        printf("\nRSS: VmRSS at the end of each measurement; peak: VmHWM, the process's high-water mark so far.\n");
    }
    fflush(stdout);
    if (o.plot && write_plot(o.plot, &o, res, o.model) != 0) goto done;
    rc = 0;
done:
    free(store);
    free(res);
    kvq_model_free(m);
    return rc;
}
