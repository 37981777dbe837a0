/* kvq kv-quality: what a KV cache config costs in output quality. Runs the model over
 * chunks of a text with f16 KV and with each config, and reports the mean KL
 * divergence of the next-token distributions, how often the top token agrees, and
 * the perplexity ratio (llama.cpp's conventions: BOS first, the second half of each
 * chunk scored). */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

static const char *const quality_help =
    "usage: kvq kv-quality -m MODEL -f TEXT [options] CONFIG...\n"
    "\n"
    "Compares each KV cache CONFIG against f16 keys and values. CONFIG is\n"
    "  KBITS[,VBITS][:KGROUP[,VGROUP]][+rot][/R][#KEEP][@START]\n"
    "  e.g. 8  8,4  4:32  4,2:64+rot  4,2+rot/32  4+rot/32#0  4@256\n"
    "  +rot: Hadamard rotation; /R: residual window of R f16 tokens (default 0 here);\n"
    "  #KEEP: first tokens also held in f16 when R > 0 (default 4)\n"
    "\n"
    "  -m, --model FILE     GGUF model\n"
    "  -f, --file FILE      text to evaluate\n"
    "  -c, --ctx-size N     tokens per chunk (default 1024)\n"
    "  --chunks N           chunks to evaluate (default 40)\n"
    "  -t, --threads N      threads (default: all cores)\n";

static bool parse_config(const char *spec, struct kvq_kv_config *kv) {
    kvq_kv_config_default(kv);
    kv->hadamard = false;
    kv->residual = 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", spec);
    char *at = strchr(buf, '@');
    if (at) {
        *at = 0;
        kv->quantized_start = atoi(at + 1);
    }
    char *hash = strchr(buf, '#');
    if (hash) {
        *hash = 0;
        kv->keep = atoi(hash + 1);
    }
    char *slash = strchr(buf, '/');
    if (slash) {
        *slash = 0;
        kv->residual = atoi(slash + 1);
    }
    char *plus = strchr(buf, '+');
    if (plus) {
        *plus = 0;
        if (strcmp(plus + 1, "rot") != 0) return false;
        kv->hadamard = true;
    }
    char *colon = strchr(buf, ':');
    if (colon) {
        *colon = 0;
        if (sscanf(colon + 1, "%d,%d", &kv->k_group, &kv->v_group) == 1) kv->v_group = kv->k_group;
    }
    int n = sscanf(buf, "%d,%d", &kv->k_bits, &kv->v_bits);
    if (n == 1) kv->v_bits = kv->k_bits;
    return n >= 1;
}

static void log_softmax(const float *x, int n, double *out) {
    double mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    double s = 0;
    for (int i = 0; i < n; i++) s += exp(x[i] - mx);
    double l = log(s) + mx;
    for (int i = 0; i < n; i++) out[i] = x[i] - l;
}

/* Runs one chunk; writes log-probs of the scored positions [first, n-1) to lp. */
static int run_chunk(struct kvq_model *m, const struct kvq_context_params *cp, const kvq_token *toks, int n, int first,
                     int n_vocab, double *lp) {
    struct kvq_context *ctx = kvq_context_new(m, cp);
    if (!ctx) return -1;
    bool *want = calloc((size_t)n, sizeof *want);
    for (int i = first; i < n - 1; i++) want[i] = true;
    struct kvq_batch b = {.n_tokens = n, .tokens = toks, .logits = want};
    int rc = kvq_decode(ctx, &b);
    for (int i = first; i < n - 1 && rc == 0; i++)
        log_softmax(kvq_get_logits(ctx, i), n_vocab, lp + (size_t)(i - first) * n_vocab);
    free(want);
    kvq_context_free(ctx);
    return rc;
}

int cmd_kv_quality(int argc, char **argv) {
    const char *model = NULL, *file = NULL;
    int n_ctx = 1024, n_chunks = 40, n_threads = 0;
    const char *specs[64];
    int n_specs = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(quality_help, stdout);
            return 0;
        }
        if (a[0] != '-') {
            if (n_specs < 64) specs[n_specs++] = a;
            continue;
        }
        if (!(v = cli_flag_value(argc, argv, &i))) return 1;
        bool ok = true;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "-f") || !strcmp(a, "--file")) file = v;
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) ok = cli_parse_int(a, v, 16, 1 << 16, &n_ctx);
        else if (!strcmp(a, "--chunks")) ok = cli_parse_int(a, v, 1, 100000, &n_chunks);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) ok = cli_parse_int(a, v, 1, 1024, &n_threads);
        else return cli_fail("unknown option '%s' for kv-quality", a);
        if (!ok) return 1;
    }
    if (!model || !file || n_specs == 0) return cli_fail("kv-quality needs -m MODEL, -f TEXT and at least one CONFIG");
    size_t len;
    char *text = cli_read_file(file, &len);
    if (!text) return 1;
    struct kvq_model *m = kvq_model_load(model);
    if (!m) {
        free(text);
        return cli_fail("%s", kvq_last_error());
    }
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    int cap = (int)(len < INT_MAX / 2 ? len : INT_MAX / 2) + 8;
    kvq_token *toks = malloc(sizeof *toks * (size_t)cap);
    int n_tok = kvq_tokenize(m, text, len, true, false, toks, cap);
    free(text);
    if (n_tok < n_ctx) {
        free(toks);
        kvq_model_free(m);
        return cli_fail("the text has only %d tokens", n_tok);
    }
    if (n_chunks > n_tok / n_ctx) n_chunks = n_tok / n_ctx;
    int first = n_ctx / 2, n_scored = n_ctx - 1 - first, V = info.n_vocab;
    double *base = malloc(sizeof(double) * (size_t)n_scored * V), *cur = malloc(sizeof(double) * (size_t)n_scored * V);
    double *kld = calloc((size_t)n_specs, sizeof(double)), *nll = calloc((size_t)n_specs + 1, sizeof(double));
    long *same = calloc((size_t)n_specs, sizeof(long));
    kvq_token *chunk = malloc(sizeof(kvq_token) * (size_t)n_ctx);
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.n_threads = n_threads;
    struct kvq_kv_config kvs[64];
    for (int s = 0; s < n_specs; s++)
        if (!parse_config(specs[s], &kvs[s])) return cli_fail("invalid config '%s'", specs[s]);
    double t0 = cli_now();
    for (int c = 0; c < n_chunks; c++) {
        memcpy(chunk, toks + (size_t)c * n_ctx, sizeof(kvq_token) * (size_t)n_ctx);
        chunk[0] = kvq_token_bos(m);
        kvq_kv_config_default(&cp.kv);
        cp.kv.hadamard = false;
        if (run_chunk(m, &cp, chunk, n_ctx, first, V, base) != 0) return cli_fail("%s", kvq_last_error());
        for (int i = 0; i < n_scored; i++) nll[n_specs] -= base[(size_t)i * V + chunk[first + i + 1]];
        for (int s = 0; s < n_specs; s++) {
            cp.kv = kvs[s];
            if (run_chunk(m, &cp, chunk, n_ctx, first, V, cur) != 0) return cli_fail("%s: %s", specs[s], kvq_last_error());
            for (int i = 0; i < n_scored; i++) {
                const double *p = base + (size_t)i * V, *q = cur + (size_t)i * V;
                double k = 0;
                int ap = 0, aq = 0;
                for (int t = 0; t < V; t++) {
                    k += exp(p[t]) * (p[t] - q[t]);
                    if (p[t] > p[ap]) ap = t;
                    if (q[t] > q[aq]) aq = t;
                }
                kld[s] += k;
                same[s] += ap == aq;
                nll[s] -= q[chunk[first + i + 1]];
            }
        }
        fprintf(stderr, "\rkvq: chunk %d/%d (%.0f s)", c + 1, n_chunks, cli_now() - t0);
    }
    fputc('\n', stderr);
    double n_tot = (double)n_chunks * n_scored;
    printf("model %s, %d chunks of %d tokens, f16-KV perplexity %.4f\n", model, n_chunks, n_ctx,
           exp(nll[n_specs] / n_tot));
    printf("| config | bits/value K/V | mean KLD | same top-1 | PPL ratio | bytes/token | f16 window bytes |\n"
           "|---|---|---|---|---|---|---|\n");
    for (int s = 0; s < n_specs; s++) {
        const struct kvq_kv_config *kv = &kvs[s];
        double bk = kv->k_bits >= 16 ? kv->k_bits : kv->k_bits + 32.0 / kv->k_group;
        double bv = kv->v_bits >= 16 ? kv->v_bits : kv->v_bits + 32.0 / kv->v_group;
        printf("| %s | %.2f / %.2f | %.6f | %.2f%% | %.4f | %zu | %zu |\n", specs[s], bk, bv, kld[s] / n_tot,
               100.0 * same[s] / n_tot, exp((nll[s] - nll[n_specs]) / n_tot), kvq_kv_token_bytes(m, kv),
               kvq_kv_window_bytes(m, kv));
    }
    free(base);
    free(cur);
    free(kld);
    free(nll);
    free(same);
    free(chunk);
    free(toks);
    kvq_model_free(m);
    return 0;
}
