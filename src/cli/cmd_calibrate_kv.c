/* kvq calibrate-kv: which layers should take more KV bits. A quantized cache's error
 * is not spread evenly over the layers (on tinydoc one layer of six holds half the KL
 * divergence of 4-bit keys), so bytes given to the layers that lose most buy more
 * quality than the same bytes spread over all (docs/kv-formats.md).
 *
 * The text is cut into chunks as `kvq perplexity` does; the f16 cache's distributions
 * are the reference. The cache of --kv-bits is measured (mean KL divergence over the
 * scored tokens), then the same with one layer at a time raised to --to's bits; the
 * layers are taken in order of KLD saved per byte while the packed rows stay within
 * --budget-bits. The choice is measured again and printed as --kv-layer-bits. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "kvq.h"

static const char *const calibrate_help =
    "usage: kvq calibrate-kv -m MODEL -f TEXT --kv-bits B|K,V[:nf] [--to K,V] [--budget-bits X]\n"
    "                        [-c 512] [--chunks 4] [options] [cache flags]\n"
    "\n"
    "Measures, for each layer, how much closer to the f16 cache's output (KL divergence)\n"
    "the model comes when that layer's keys and values take --to's bits instead of\n"
    "--kv-bits', and picks the layers that gain most per byte while the packed rows stay\n"
    "within --budget-bits bits a value. Prints each layer's measurement, the KLD of\n"
    "--kv-bits, of the choice and of every layer at --to, and the --kv-layer-bits that\n"
    "gives the choice. Costs one pass over the chunks per layer, plus four.\n"
    "\n"
    "  -m, --model FILE       GGUF model\n"
    "  -f, --file FILE        calibration text (e.g. wikitext-2)\n"
    "  --to B|K,V             the raised layers' bits (default: keys one width up, values\n"
    "                         as they are; keys cost more quality than values)\n"
    "  --budget-bits X        bits a value in the packed rows, codes and scales (default\n"
    "                         for normal-float rows: what uniform rows of the same bits in\n"
    "                         groups of 64 take, e.g. 4.5 for 4,4:nf)\n"
    "  -c, --ctx-size N       tokens per chunk (default 512, at least 256; the second half\n"
    "                         is scored)\n"
    "  --chunks N             chunks (default 4)\n"
    "  -t, --threads N        threads (default: all cores)\n";

struct cal_opts {
    const char *model, *file;
    int n_ctx, n_chunks;
    float budget;
    bool budget_given, to_given;
    int to[2];
    struct kvq_context_params cp;
};

static bool parse_to(const char *flag, const char *v, void *out) {
    int *to = out;
    return cli_parse_quantized_bits(flag, v, &to[0], &to[1]);
}

static int parse_args(int argc, char **argv, struct cal_opts *o) {
    kvq_context_params_default(&o->cp);
    o->n_ctx = 512;
    o->n_chunks = 4;
    struct cli_opt opts[] = {
        CLI_STR(&o->model, "-m", "--model"),
        CLI_STR(&o->file, "-f", "--file"),
        CLI_INT(&o->n_ctx, 256, 1 << 20, "-c", "--ctx-size"),
        CLI_INT(&o->n_chunks, 1, 1 << 20, "--chunks"),
        CLI_INT(&o->cp.n_threads, 1, 1024, "-t", "--threads"),
        {.names = {"--budget-bits"}, .type = CLI_OPT_FLOAT, .out = &o->budget, .min = 1, .max = 32,
         .given = &o->budget_given},
        {.names = {"--to"}, .type = CLI_OPT_FN, .out = o->to, .fn = parse_to, .given = &o->to_given},
        CLI_END,
    };
    if (cli_parse_args(argc, argv, "calibrate-kv", opts, &o->cp, NULL, calibrate_help, cli_kv_flags_help)) return 1;
    if (!o->model) return cli_fail("calibrate-kv needs a model: -m FILE");
    if (!o->file) return cli_fail("calibrate-kv needs a calibration text: -f FILE");
    const struct kvq_kv_config *kv = &o->cp.kv;
    if (kv->k_bits >= 16 || kv->v_bits >= 16)
        return cli_fail("calibrate-kv raises layers of a quantized cache: give --kv-bits, e.g. 4,4:nf");
    if (kv->n_layer_bits > 0) return cli_fail("calibrate-kv chooses the layers' bits itself: drop --kv-layer-bits");
    if (kv->max_size > 0) return cli_fail("calibrate-kv needs the whole chunk in the cache: drop --max-kv-size");
    if (!o->to_given) { /* keys one width up: what they can take in their row kind */
        static const int up[] = {0, 0, 3, 4, 5, 6, 8, 0, 0};
        o->to[0] = up[kv->k_bits];
        o->to[1] = kv->v_bits;
        if (!o->to[0] || (kv->k_group == KVQ_KV_NF && o->to[0] > 5))
            return cli_fail("--kv-bits' keys have no wider width in their row kind: give --to K,V");
    }
    if (o->to[0] < kv->k_bits || o->to[1] < kv->v_bits || (o->to[0] == kv->k_bits && o->to[1] == kv->v_bits))
        return cli_fail("--to %d,%d must raise --kv-bits %d,%d", o->to[0], o->to[1], kv->k_bits, kv->v_bits);
    return cli_kv_config_check(kv) ? 0 : 1;
}

/* The chunks and the reference every run is compared with. */
struct cal_run {
    struct kvq_model *m;
    struct kvq_context_params cp; /* all but the KV config */
    const kvq_token *toks;
    int n_vocab, n_ctx, n_chunk, n_par, first, n_scored;
    bool add_bos;
    float *base; /* [n_chunk][n_scored][n_vocab] log-probabilities of the f16 cache's run */
    float *lp;   /* [n_vocab] */
    kvq_token *bt;
    int32_t *bs;
    bool *bl;
};

static void log_softmax(const float *logits, int n, float *out) {
    float mx = logits[0];
    for (int i = 1; i < n; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)(logits[i] - mx));
    const float lse = mx + (float)log(sum);
    for (int i = 0; i < n; i++) out[i] = logits[i] - lse;
}

/* Runs the chunks with cache kv: fills the reference when it is f16 and none is held
 * yet, else sets *kld to the mean KL divergence from it. 0, or -1 after an error. */
static int evaluate(struct cal_run *r, const struct kvq_kv_config *kv, double *kld) {
    struct kvq_context_params cp = r->cp;
    cp.kv = *kv;
    cp.n_ctx = r->n_ctx;
    cp.n_seq = r->n_par;
    struct kvq_context *ctx = kvq_context_new(r->m, &cp);
    if (!ctx) return cli_fail("%s", kvq_last_error());
    const bool fill = kld == NULL;
    double sum = 0;
    const kvq_token bos = kvq_token_bos(r->m);
    for (int c0 = 0; c0 < r->n_chunk; c0 += r->n_par) {
        const int ns = r->n_chunk - c0 < r->n_par ? r->n_chunk - c0 : r->n_par;
        for (int s = 0; s < ns; s++) {
            kvq_seq_clear(ctx, s);
            const kvq_token *ct = r->toks + (size_t)(c0 + s) * r->n_ctx;
            for (int j = 0; j < r->n_ctx; j++) {
                const size_t k = (size_t)s * r->n_ctx + j;
                r->bt[k] = j == 0 && r->add_bos ? bos : ct[j];
                r->bs[k] = s;
                r->bl[k] = j >= r->first && j < r->first + r->n_scored;
            }
        }
        struct kvq_batch b = {.n_tokens = ns * r->n_ctx, .tokens = r->bt, .seq_ids = r->bs, .logits = r->bl};
        if (kvq_decode(ctx, &b) != 0) {
            cli_fail("evaluation failed: %s", kvq_last_error());
            kvq_context_free(ctx);
            return -1;
        }
        for (int s = 0; s < ns; s++)
            for (int j = 0; j < r->n_scored; j++) {
                float *ref = r->base + ((size_t)(c0 + s) * r->n_scored + j) * r->n_vocab;
                const float *lg = kvq_get_logits(ctx, s * r->n_ctx + r->first + j);
                log_softmax(lg, r->n_vocab, fill ? ref : r->lp);
                if (fill) continue;
                double d = 0;
                for (int i = 0; i < r->n_vocab; i++) d += exp((double)ref[i]) * (double)(ref[i] - r->lp[i]);
                sum += d;
            }
    }
    kvq_context_free(ctx);
    if (!fill) *kld = sum / ((double)r->n_chunk * r->n_scored);
    return 0;
}

static double rows_bits(const struct kvq_model *m, const struct kvq_kv_config *kv, int n) {
    double rows, all;
    cli_kv_bits(m, kv, n, &rows, &all);
    return rows;
}

static void set_all(bool *b, int n, bool v) {
    for (int i = 0; i < n; i++) b[i] = v;
}

/* kv with layers chosen[0..n_layer) at bits `to`, in ranges of consecutive layers. */
static void with_layers(const struct kvq_kv_config *kv, const bool *chosen, int n_layer, const int *to,
                        struct kvq_kv_config *out) {
    *out = *kv;
    out->n_layer_bits = 0;
    for (int il = 0; il < n_layer; il++) {
        if (!chosen[il]) continue;
        struct kvq_layer_bits *last = out->n_layer_bits ? &out->layer_bits[out->n_layer_bits - 1] : NULL;
        if (last && last->last == il - 1) last->last = il;
        else if (out->n_layer_bits < KVQ_MAX_LAYER_BITS) out->layer_bits[out->n_layer_bits++] = (struct kvq_layer_bits){il, il, to[0], to[1]};
    }
}

int cmd_calibrate_kv(int argc, char **argv) {
    struct cal_opts o = {0};
    if (parse_args(argc, argv, &o) != 0) return 1;
    int rc = 1;
    char *text = NULL;
    kvq_token *toks = NULL;
    struct cal_run r = {.cp = o.cp};
    double *gain = NULL, *extra = NULL;
    bool *chosen = NULL;
    int *order = NULL;
    struct kvq_model_info info;
    if (!(r.m = cli_load_model(o.model, &info))) goto done;
    size_t len;
    int n_tok;
    if (!(text = cli_read_file(o.file, &len)) || !(toks = cli_tokenize(r.m, text, len, true, false, &n_tok))) goto done;
    if (n_tok < o.n_ctx) {
        cli_fail("'%s' has %d tokens; one chunk of -c %d needs at least %d", o.file, n_tok, o.n_ctx, o.n_ctx);
        goto done;
    }
    const struct kvq_kv_config *low = &o.cp.kv;
    struct kvq_kv_config f16 = *low, high, mix;
    f16.k_bits = f16.v_bits = 16;
    struct kvq_kv_config uniform = *low; /* the default budget: uniform rows of these bits */
    if (uniform.k_group == KVQ_KV_NF) uniform.k_group = 64;
    if (uniform.v_group == KVQ_KV_NF) uniform.v_group = 64;
    const double bits_low = rows_bits(r.m, low, o.n_ctx);
    const double budget = o.budget_given ? o.budget : rows_bits(r.m, &uniform, o.n_ctx);
    if (!o.budget_given && budget <= bits_low) {
        cli_fail("--kv-bits %s leaves no bytes to spend at the default budget: give --budget-bits",
                 cli_kv_config_name(low));
        goto done;
    }
    if (budget < bits_low) {
        cli_fail("--budget-bits %.4f is below --kv-bits' own %.4f bits a value", budget, bits_low);
        goto done;
    }
    r.toks = toks;
    r.n_vocab = info.n_vocab;
    r.n_ctx = o.n_ctx;
    r.n_chunk = n_tok / o.n_ctx < o.n_chunks ? n_tok / o.n_ctx : o.n_chunks;
    r.n_par = 2048 / o.n_ctx > 1 ? 2048 / o.n_ctx : 1;
    if (r.n_par > r.n_chunk) r.n_par = r.n_chunk;
    r.first = o.n_ctx / 2;
    r.n_scored = o.n_ctx - 1 - r.first;
    r.add_bos = cli_model_adds_bos(r.m);
    const size_t nb = (size_t)r.n_par * o.n_ctx, ref = (size_t)r.n_chunk * r.n_scored * info.n_vocab;
    r.base = malloc(sizeof *r.base * ref);
    r.lp = malloc(sizeof *r.lp * (size_t)info.n_vocab);
    r.bt = malloc(sizeof *r.bt * nb);
    r.bs = malloc(sizeof *r.bs * nb);
    r.bl = malloc(sizeof *r.bl * nb);
    gain = calloc((size_t)info.n_layer, sizeof *gain);
    chosen = calloc((size_t)info.n_layer, sizeof *chosen);
    extra = calloc((size_t)info.n_layer, sizeof *extra);
    order = malloc(sizeof *order * (size_t)info.n_layer);
    if (!r.base || !r.lp || !r.bt || !r.bs || !r.bl || !gain || !extra || !chosen || !order) {
        cli_fail("out of memory (the reference holds %.0f MiB: fewer --chunks or a smaller -c)",
                 (double)(ref * sizeof *r.base) / (1 << 20));
        goto done;
    }
    const bool tty = isatty(STDERR_FILENO);
    fprintf(stderr, "kvq: %d chunks of %d tokens (%d scored each), KV %s, layers raised to K%d/V%d, budget %.4f bits\n",
            r.n_chunk, r.n_ctx, r.n_scored, cli_kv_config_name(low), o.to[0], o.to[1], budget);
    double kld_low, kld_high, kld_mix;
    if (evaluate(&r, &f16, NULL) != 0 || evaluate(&r, low, &kld_low) != 0) goto done;
    printf("layer  KLD (this layer at K%d/V%d)  KLD saved  bits a value\n", o.to[0], o.to[1]);
    for (int il = 0; il < info.n_layer; il++) {
        if (tty) fprintf(stderr, "\rkvq: layer %d of %d", il + 1, info.n_layer);
        struct kvq_kv_config one;
        set_all(chosen, info.n_layer, false);
        chosen[il] = true;
        with_layers(low, chosen, info.n_layer, o.to, &one);
        double kld;
        if (evaluate(&r, &one, &kld) != 0) goto done;
        gain[il] = kld_low - kld;
        extra[il] = rows_bits(r.m, &one, o.n_ctx) - bits_low; /* a sliding layer's bytes stop at its window */
        order[il] = il;
        printf("%5d  %27.6f  %9.6f  %12.4f\n", il, kld, gain[il], bits_low + extra[il]);
    }
    if (tty) fprintf(stderr, "\r\033[K");
    /* the most KLD saved per bit first */
    for (int i = 1; i < info.n_layer; i++)
        for (int j = i; j > 0 && gain[order[j]] / extra[order[j]] > gain[order[j - 1]] / extra[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    set_all(chosen, info.n_layer, false);
    for (int i = 0; i < info.n_layer; i++) {
        const int il = order[i];
        if (gain[il] <= 0) break;
        chosen[il] = true;
        with_layers(low, chosen, info.n_layer, o.to, &mix);
        if (mix.n_layer_bits == KVQ_MAX_LAYER_BITS || rows_bits(r.m, &mix, o.n_ctx) > budget + 1e-9) chosen[il] = false;
    }
    with_layers(low, chosen, info.n_layer, o.to, &mix);
    set_all(chosen, info.n_layer, true);
    with_layers(low, chosen, info.n_layer, o.to, &high);
    if (evaluate(&r, &mix, &kld_mix) != 0 || evaluate(&r, &high, &kld_high) != 0) goto done;
    char layers[2048];
    if (kvq_kv_layer_bits_name(&mix, layers, sizeof layers) < 0) snprintf(layers, sizeof layers, "(too long)");
    printf("\n%-28s  bits a value  mean KLD\n", "KV");
    printf("%-28s  %12.4f  %.6f\n", "--kv-bits alone", bits_low, kld_low);
    printf("%-28s  %12.4f  %.6f\n", "chosen layers raised", rows_bits(r.m, &mix, o.n_ctx), kld_mix);
    printf("%-28s  %12.4f  %.6f\n", "every layer raised", rows_bits(r.m, &high, o.n_ctx), kld_high);
    bool gains = false;
    for (int il = 0; il < info.n_layer; il++) gains |= gain[il] > 0;
    if (!gains) printf("\nno layer gains from more bits here (a longer -c puts more of each chunk past the f16 window)\n");
    else if (mix.n_layer_bits == 0) printf("\nno layer fits the budget of %.4f bits a value\n", budget);
    else printf("\nwith --kv-bits as given: --kv-layer-bits %s\n", layers);
    rc = 0;
done:
    free(order);
    free(chosen);
    free(gain);
    free(extra);
    free(r.base);
    free(r.lp);
    free(r.bt);
    free(r.bs);
    free(r.bl);
    free(toks);
    free(text);
    kvq_model_free(r.m);
    return rc;
}
