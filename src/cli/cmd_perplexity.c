/* kvq perplexity: perplexity over a text with llama-perplexity's conventions, and
 * KL divergence of a run against a stored base run.
 *
 * Conventions (so numbers line up with llama-perplexity's):
 *  - the whole text is tokenized once, with BOS in front when the model adds one;
 *  - chunk i is tokens [i*c, (i+1)*c); its first token is replaced by BOS for the
 *    evaluation (only in the batch; the targets come from the original tokens);
 *  - with first = c/2, the logits after positions first .. c-2 are scored against the
 *    next token, so each chunk scores c - 1 - c/2 tokens;
 *  - PPL = exp(mean NLL); its error is PPL * sqrt(var(NLL) / (count - 1)).
 *
 * KL-divergence base file (all little-endian, written by --kl-divergence-base without
 * --kl-divergence):
 *   header (struct kld_header, 128 bytes): magic, version, vocabulary size, c, chunk
 *   count, scored tokens per chunk, record size, a fingerprint of the model's shape and
 *   vocabulary, a hash of the evaluated tokens, and names for messages;
 *   tokens: int32 [chunks * c];
 *   one record per scored position: float scale, float floor, float NLL of the target,
 *   int32 top-1 token, then uint16 [n_vocab rounded up to even] log-probabilities
 *   quantized linearly: logp = floor + q * scale (q = 0: below the floor, ignored).
 *   The floor is max(min logp, top logp - 30), so the step is <= 30/65535 ~ 0.00046
 *   nats: relative probability error <= 0.023%. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/outfile.h"

static const char *const perplexity_help =
    "usage: kvq perplexity -m MODEL -f TEXT [-c 1024] [--chunks N] [options] [cache flags]\n"
    "\n"
    "Perplexity with llama-perplexity's conventions: the text is tokenized once (BOS first),\n"
    "cut into chunks of c tokens, each chunk evaluated from an empty cache with BOS as its\n"
    "first token, and the second half of each chunk scored. Prints the running estimate\n"
    "per chunk and 'Final estimate: PPL = X +/- E' (E: standard error).\n"
    "\n"
    "  -m, --model FILE             GGUF model\n"
    "  -f, --file FILE              text to evaluate (optional with --kl-divergence: the\n"
    "                               base file holds the tokens)\n"
    "  -c, --ctx-size N             tokens per chunk (default 1024)\n"
    "      --chunks N               evaluate at most N chunks (default: all)\n"
    "      --parallel N             chunks evaluated together as separate sequences\n"
    "                               (default: 2048/c, capped so their logits fit in 1 GiB)\n"
    "  -t, --threads N              threads (default: all cores)\n"
    "  -b, --batch-size N           tokens per forward pass (default 512; 2048 on a GPU)\n"
    "      --kl-divergence-base F   without --kl-divergence: store this run's token\n"
    "                               distributions in F (16-bit log-probabilities, ~2 bytes\n"
    "                               per vocabulary entry per scored token)\n"
    "      --kl-divergence          compare this run against the base file F: prints\n"
    "                               llama-perplexity's statistics (PPL ratio, KLD mean,\n"
    "                               percentiles, delta-p, same top token)\n"
    "  -h, --help                   this text\n";

#define KLD_MAGIC "KVQKLD\0\1"
#define KLD_VERSION 1u
#define KLD_RANGE 30.0f

struct kld_header {
    char magic[8];
    uint32_t version;
    uint32_t n_vocab, n_ctx, n_chunk, n_scored, record_bytes;
    uint32_t adds_bos;
    uint32_t reserved;
    uint64_t model_fp, token_hash;
    char arch[16], weight_type[16], kv_name[40];
};
_Static_assert(sizeof(struct kld_header) == 128, "KLD header layout");

struct ppl_opts {
    const char *model, *file, *kl_base;
    int n_ctx, n_chunks, parallel;
    bool kl, ctx_given;
    struct kvq_context_params cp;
};

static int parse_args(int argc, char **argv, struct ppl_opts *o) {
    kvq_context_params_default(&o->cp);
    o->n_ctx = 1024;
    o->n_chunks = -1;
    const struct cli_opt opts[] = {
        CLI_FLAG(&o->kl, "--kl-divergence"),
        CLI_STR(&o->model, "-m", "--model"),
        CLI_STR(&o->file, "-f", "--file"),
        {.names = {"-c", "--ctx-size"}, .type = CLI_OPT_INT, .out = &o->n_ctx, .min = 8, .max = 1 << 20,
         .given = &o->ctx_given},
        CLI_INT(&o->n_chunks, 1, INT_MAX, "--chunks"),
        CLI_INT(&o->parallel, 1, 256, "--parallel"),
        CLI_INT(&o->cp.n_threads, 1, 1024, "-t", "--threads"),
        CLI_INT(&o->cp.n_batch, 1, 1 << 16, "-b", "--batch-size"),
        CLI_STR(&o->kl_base, "--kl-divergence-base"),
        CLI_END,
    };
    if (cli_parse_args(argc, argv, "perplexity", opts, &o->cp, NULL, perplexity_help, cli_kv_flags_help)) return 1;
    if (!o->model) return cli_fail("perplexity needs a model: -m FILE");
    if (o->kl && !o->kl_base) return cli_fail("--kl-divergence needs the base file: --kl-divergence-base FILE");
    if (!o->kl && !o->file) return cli_fail("perplexity needs a text: -f FILE");
    struct stat sb, sf;
    if (!o->kl && o->kl_base && stat(o->kl_base, &sb) == 0 && stat(o->file, &sf) == 0 && sb.st_dev == sf.st_dev &&
        sb.st_ino == sf.st_ino)
        return cli_fail("--kl-divergence-base '%s' is the text file itself: writing it would replace the text",
                        o->kl_base);
    if (o->cp.kv.max_size > 0) return cli_fail("perplexity needs the whole chunk in the cache: drop --max-kv-size");
    if (!cli_kv_config_check(&o->cp.kv)) return 1;
    return 0;
}

/* ---- hashing ---- */

static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
#define FNV_INIT 0xcbf29ce484222325ull

/* Shape and vocabulary of the model (not its weights: a base run of f16 weights may be
 * compared with a run of quantized weights of the same model). */
static uint64_t model_fingerprint(const struct kvq_model *m, const struct kvq_model_info *info) {
    int32_t shape[] = {info->n_vocab, info->n_embd, info->n_layer, info->n_head, info->n_head_kv, info->head_dim,
                       info->n_ff};
    uint64_t h = fnv1a(FNV_INIT, info->arch, strlen(info->arch));
    h = fnv1a(h, shape, sizeof shape);
    char buf[512];
    for (kvq_token t = 0; t < info->n_vocab; t++) {
        struct kvq_detok *d = kvq_detok_new(m);
        if (!d) break;
        int n = kvq_detok_feed(d, t, buf, sizeof buf);
        if (n < 0) n = 0;
        if (n > (int)sizeof buf) n = sizeof buf;
        int k = kvq_detok_flush(d, buf + n, (int)sizeof buf - n);
        if (k > 0 && n + k <= (int)sizeof buf) n += k;
        kvq_detok_free(d);
        h = fnv1a(h, &t, sizeof t);
        h = fnv1a(h, buf, (size_t)n);
    }
    return h;
}

/* ---- statistics ---- */

struct kld_stats {
    double sum_nll, sum_nll2, sum_nll_base, sum_nll_base2, sum_nll_nll_base;
    double sum_kld, sum_kld2, sum_dp, sum_dp2, sum_dp4;
    size_t n_same_top, count;
    float *kld_values, *dp_values;
};

/* Mean of a sum over count values and its standard error. */
static void mean_err(double sum, double sum2, size_t count, double *mean, double *err) {
    *mean = count ? sum / count : 0;
    double var = count ? sum2 / count - *mean * *mean : 0;
    *err = var > 0 && count > 10 ? sqrt(var / (double)(count - 1)) : 0;
}

static double covariance(double sa, double sb, double sab, size_t n) {
    if (n < 10) return 0;
    return (sab / n - (sa / n) * (sb / n)) / (double)(n - 1);
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static double percentile(const float *v, size_t n, double frac) {
    if (frac <= 0) return v[0];
    if (frac >= 1) return v[n - 1];
    double p = frac * (double)(n - 1);
    size_t ip = (size_t)p;
    p -= (double)ip;
    return (1 - p) * v[ip] + p * v[ip + 1 < n ? ip + 1 : n - 1];
}

static double median(const float *v, size_t n) { return n % 2 ? v[n / 2] : 0.5 * (v[n / 2] + v[n / 2 - 1]); }

/* ---- per-position work ---- */

/* Max logit, its index and log-sum-exp of (logits - max). */
static void softmax_stats(const float *logits, int n, float *max_out, int *imax_out, double *lse_out) {
    float mx = logits[0];
    int im = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > mx) {
            mx = logits[i];
            im = i;
        }
    double s = 0;
    for (int i = 0; i < n; i++) s += exp((double)logits[i] - mx);
    *max_out = mx;
    *imax_out = im;
    *lse_out = log(s);
}

/* Fills a base-file record; returns the NLL of the target. */
static double encode_record(const float *logits, int n_vocab, kvq_token target, unsigned char *rec) {
    float mx;
    int im;
    double lse;
    softmax_stats(logits, n_vocab, &mx, &im, &lse);
    float mn = logits[0];
    for (int i = 1; i < n_vocab; i++)
        if (logits[i] < mn) mn = logits[i];
    /* In logit units: floor_logit .. mx maps to 0 .. 65535. */
    float floor_logit = mn > mx - KLD_RANGE ? mn : mx - KLD_RANGE;
    float scale = (mx - floor_logit) / 65535.0f;
    float lo = (float)(floor_logit - mx - lse);
    double nll = mx + lse - logits[target];
    float nllf = (float)nll;
    int32_t imax = im;
    memcpy(rec, &scale, 4);
    memcpy(rec + 4, &lo, 4);
    memcpy(rec + 8, &nllf, 4);
    memcpy(rec + 12, &imax, 4);
    uint16_t *q = (uint16_t *)(rec + 16);
    float inv = scale > 0 ? 1.0f / scale : 0;
    for (int i = 0; i < n_vocab; i++) {
        float x = (logits[i] - floor_logit) * inv;
        q[i] = logits[i] > floor_logit && scale > 0 ? (uint16_t)(x > 65535.0f ? 65535 : lrintf(x)) : 0;
    }
    if (n_vocab % 2) q[n_vocab] = 0;
    return nll;
}

/* Compares logits with a base record, updating the statistics. */
static double compare_record(const float *logits, int n_vocab, kvq_token target, const unsigned char *rec,
                             struct kld_stats *st) {
    float mx;
    int im;
    double lse;
    softmax_stats(logits, n_vocab, &mx, &im, &lse);
    float scale, lo, nll_base_f;
    int32_t imax_base;
    memcpy(&scale, rec, 4);
    memcpy(&lo, rec + 4, 4);
    memcpy(&nll_base_f, rec + 8, 4);
    memcpy(&imax_base, rec + 12, 4);
    const uint16_t *q = (const uint16_t *)(rec + 16);
    double nll = mx + lse - logits[target], nll_base = nll_base_f;
    double norm = mx + lse, kld = 0;
    for (int i = 0; i < n_vocab; i++) {
        if (q[i] == 0) continue;
        double lpb = lo + (double)scale * q[i];
        kld += exp(lpb) * (lpb - (logits[i] - norm));
    }
    double dp = exp(-nll) - exp(-nll_base);
    st->sum_nll += nll;
    st->sum_nll2 += nll * nll;
    st->sum_nll_base += nll_base;
    st->sum_nll_base2 += nll_base * nll_base;
    st->sum_nll_nll_base += nll * nll_base;
    st->sum_kld += kld;
    st->sum_kld2 += kld * kld;
    st->sum_dp += dp;
    st->sum_dp2 += dp * dp;
    st->sum_dp4 += dp * dp * dp * dp;
    st->n_same_top += im == imax_base;
    st->kld_values[st->count] = (float)kld;
    st->dp_values[st->count] = (float)dp;
    st->count++;
    return nll;
}

static void print_kld_report(struct kld_stats *st) {
    size_t n = st->count;
    if (n < 2) {
        printf("too few scored tokens (%zu) for statistics\n", n);
        return;
    }
    qsort(st->kld_values, n, sizeof(float), cmp_float);
    qsort(st->dp_values, n, sizeof(float), cmp_float);
    double lp, lp_err, lpb, lpb_err;
    mean_err(st->sum_nll, st->sum_nll2, n, &lp, &lp_err);
    mean_err(st->sum_nll_base, st->sum_nll_base2, n, &lpb, &lpb_err);
    double ppl = exp(lp), ppl_err = ppl * lp_err, pplb = exp(lpb), pplb_err = pplb * lpb_err;
    double cov = covariance(st->sum_nll, st->sum_nll_base, st->sum_nll_nll_base, n);
    double cor = lp_err > 0 && lpb_err > 0 ? cov / (lp_err * lpb_err) : 1.0;
    double lr = lp - lpb, lr_var = lp_err * lp_err + lpb_err * lpb_err - 2 * cov;
    double lr_err = lr_var > 0 ? sqrt(lr_var) : 0;
    double pc = ppl * pplb * cov, diff_var = ppl_err * ppl_err + pplb_err * pplb_err - 2 * pc;
    printf("\n====== Perplexity statistics ======\n");
    printf("Mean PPL(Q)                   : %10.6f ± %10.6f\n", ppl, ppl_err);
    printf("Mean PPL(base)                : %10.6f ± %10.6f\n", pplb, pplb_err);
    printf("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%\n", 100.0 * cor);
    printf("Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", lr, lr_err);
    printf("Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f\n", exp(lr), exp(lr) * lr_err);
    printf("Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f\n", ppl - pplb, diff_var > 0 ? sqrt(diff_var) : 0.0);

    double km, ke;
    mean_err(st->sum_kld, st->sum_kld2, n, &km, &ke);
    const float *k = st->kld_values;
    printf("\n====== KL divergence statistics ======\n");
    printf("Mean    KLD: %10.6f ± %10.6f\n", km, ke);
    printf("Maximum KLD: %10.6f\n", (double)k[n - 1]);
    printf("99.9%%   KLD: %10.6f\n", percentile(k, n, 0.999));
    printf("99.0%%   KLD: %10.6f\n", percentile(k, n, 0.990));
    printf("95.0%%   KLD: %10.6f\n", percentile(k, n, 0.950));
    printf("90.0%%   KLD: %10.6f\n", percentile(k, n, 0.900));
    printf("Median  KLD: %10.6f\n", median(k, n));
    printf("10.0%%   KLD: %10.6f\n", percentile(k, n, 0.100));
    printf(" 5.0%%   KLD: %10.6f\n", percentile(k, n, 0.050));
    printf(" 1.0%%   KLD: %10.6f\n", percentile(k, n, 0.010));
    printf(" 0.1%%   KLD: %10.6f\n", percentile(k, n, 0.001));
    printf("Minimum KLD: %10.6f\n", (double)k[0]);

    double dm, de, msm, mse;
    mean_err(st->sum_dp, st->sum_dp2, n, &dm, &de);
    mean_err(st->sum_dp2, st->sum_dp4, n, &msm, &mse);
    const float *d = st->dp_values;
    printf("\n====== Token probability statistics ======\n");
    printf("Mean    Δp: %6.3f ± %5.3f %%\n", 100 * dm, 100 * de);
    printf("Maximum Δp: %6.3f%%\n", 100.0 * d[n - 1]);
    static const double fr[] = {0.999, 0.99, 0.95, 0.90, 0.75};
    static const char *const lb[] = {"99.9%", "99.0%", "95.0%", "90.0%", "75.0%"};
    for (int i = 0; i < 5; i++) printf("%-8sΔp: %6.3f%%\n", lb[i], 100 * percentile(d, n, fr[i]));
    printf("Median  Δp: %6.3f%%\n", 100 * median(d, n));
    static const double fr2[] = {0.25, 0.10, 0.05, 0.01, 0.001};
    static const char *const lb2[] = {"25.0%", "10.0%", " 5.0%", " 1.0%", " 0.1%"};
    for (int i = 0; i < 5; i++) printf("%-8sΔp: %6.3f%%\n", lb2[i], 100 * percentile(d, n, fr2[i]));
    printf("Minimum Δp: %6.3f%%\n", 100.0 * d[0]);
    double rms = sqrt(msm > 0 ? msm : 0);
    printf("RMS Δp    : %6.3f ± %5.3f %%\n", 100 * rms, rms > 0 ? 100 * 0.5 / rms * mse : 0.0);
    double same = (double)st->n_same_top / (double)n;
    printf("Same top p: %6.3f ± %5.3f %%\n", 100 * same, 100 * sqrt(same * (1 - same) / (double)(n - 1)));
}

/* ---- base file ---- */

static size_t record_bytes(int n_vocab) { return 16 + 2 * (size_t)(n_vocab + (n_vocab & 1)); }

/* Reads and validates a base file's header and tokens. */
static kvq_token *read_base(FILE *f, const char *path, struct kld_header *h, uint64_t fp,
                            const struct kvq_model_info *info) {
    if (fread(h, sizeof *h, 1, f) != 1 || memcmp(h->magic, KLD_MAGIC, 8) != 0) {
        cli_fail("'%s' is not a kvq KL-divergence base file (written by kvq perplexity --kl-divergence-base)", path);
        return NULL;
    }
    if (h->version != KLD_VERSION) {
        cli_fail("'%s' has base-file version %u; this kvq reads version %u", path, h->version, KLD_VERSION);
        return NULL;
    }
    h->arch[sizeof h->arch - 1] = h->weight_type[sizeof h->weight_type - 1] = h->kv_name[sizeof h->kv_name - 1] = 0;
    if (h->n_vocab != (uint32_t)info->n_vocab) {
        cli_fail("'%s' was written with a vocabulary of %u tokens; this model has %d", path, h->n_vocab, info->n_vocab);
        return NULL;
    }
    if (h->model_fp != fp) {
        cli_fail("'%s' was written by a different model (%s %s): shape or vocabulary differ from this %s model", path,
                 h->arch, h->weight_type, info->arch);
        return NULL;
    }
    if (h->n_ctx < 8 || h->n_ctx > (1u << 20) || h->n_chunk == 0 || h->n_chunk > (1u << 24) ||
        h->n_scored != h->n_ctx - 1 - h->n_ctx / 2 || h->record_bytes != record_bytes(info->n_vocab)) {
        cli_fail("'%s' has an invalid header (c %u, chunks %u, scored %u)", path, h->n_ctx, h->n_chunk, h->n_scored);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long long size = ftell(f);
    long long want = (long long)sizeof *h + 4LL * h->n_ctx * h->n_chunk +
                     (long long)h->record_bytes * h->n_scored * h->n_chunk;
    if (size != want) {
        cli_fail("'%s' is %lld bytes but its header says %lld: the file is truncated or corrupt", path, size, want);
        return NULL;
    }
    fseek(f, (long)sizeof *h, SEEK_SET);
    size_t nt = (size_t)h->n_ctx * h->n_chunk;
    kvq_token *toks = malloc(nt * sizeof *toks);
    if (!toks || fread(toks, sizeof *toks, nt, f) != nt) {
        free(toks);
        cli_fail("cannot read the tokens of '%s'", path);
        return NULL;
    }
    if (fnv1a(FNV_INIT, toks, nt * sizeof *toks) != h->token_hash) {
        free(toks);
        cli_fail("'%s': the token hash does not match its tokens (corrupt file)", path);
        return NULL;
    }
    for (size_t i = 0; i < nt; i++)
        if (toks[i] < 0 || toks[i] >= info->n_vocab) {
            cli_fail("'%s' holds token %d outside the vocabulary", path, toks[i]);
            free(toks);
            return NULL;
        }
    return toks;
}

int cmd_perplexity(int argc, char **argv) {
    struct ppl_opts o = {0};
    if (parse_args(argc, argv, &o) != 0) return 1;
    int rc = 1;
    char *text = NULL;
    kvq_token *toks = NULL, *batch_tok = NULL;
    int32_t *batch_seq = NULL;
    bool *batch_logits = NULL;
    unsigned char *rec = NULL;
    FILE *bf = NULL;
    struct kvq_outfile bout = {0};
    struct kvq_context *ctx = NULL;
    struct kld_stats st = {0};
    bool write_base = o.kl_base && !o.kl;
    struct kvq_model_info info;
    struct kvq_model *m = cli_load_model(o.model, &info);
    if (!m) goto done;
    bool add_bos = cli_model_adds_bos(m);
    uint64_t fp = o.kl_base ? model_fingerprint(m, &info) : 0;
    int n_tok = 0, n_ctx = o.n_ctx, n_chunk;
    struct kld_header h;
    memset(&h, 0, sizeof h);

    if (o.kl) {
        bf = fopen(o.kl_base, "rb");
        if (!bf) {
            cli_fail("cannot open the base file '%s'", o.kl_base);
            goto done;
        }
        toks = read_base(bf, o.kl_base, &h, fp, &info);
        if (!toks) goto done;
        if (o.ctx_given && (uint32_t)o.n_ctx != h.n_ctx) {
            cli_fail("the base file was written with -c %u, not %d: use the same chunk size", h.n_ctx, o.n_ctx);
            goto done;
        }
        n_ctx = (int)h.n_ctx;
        n_chunk = (int)h.n_chunk;
        if (o.n_chunks > n_chunk) {
            cli_fail("the base file holds %d chunks; --chunks %d asks for more", n_chunk, o.n_chunks);
            goto done;
        }
        if (o.n_chunks > 0) n_chunk = o.n_chunks;
        n_tok = n_ctx * n_chunk;
        if (o.file) { /* the text must give the same tokens */
            size_t len;
            int nt2;
            text = cli_read_file(o.file, &len);
            kvq_token *t2 = text ? cli_tokenize(m, text, len, true, false, &nt2) : NULL;
            if (!t2) goto done;
            bool same = nt2 >= n_tok && memcmp(t2, toks, (size_t)n_tok * sizeof *toks) == 0;
            free(t2);
            if (!same) {
                cli_fail("'%s' does not tokenize to the tokens stored in the base file '%s' (different text or tokenizer)",
                         o.file, o.kl_base);
                goto done;
            }
        }
        fprintf(stderr, "kvq: base: %s %s, KV %s, c %d, %u chunks\n", h.arch, h.weight_type, h.kv_name, n_ctx,
                h.n_chunk);
    } else {
        size_t len;
        text = cli_read_file(o.file, &len);
        if (!text) goto done;
        toks = cli_tokenize(m, text, len, true, false, &n_tok);
        if (!toks) goto done;
        int n_max = n_tok / n_ctx;
        if (n_max < 1) {
            cli_fail("'%s' has %d tokens; one chunk of -c %d needs at least %d", o.file, n_tok, n_ctx, n_ctx);
            goto done;
        }
        n_chunk = o.n_chunks > 0 && o.n_chunks < n_max ? o.n_chunks : n_max;
    }

    int first = n_ctx / 2, n_scored = n_ctx - 1 - first;
    size_t rbytes = record_bytes(info.n_vocab);
    int n_par = o.parallel;
    if (n_par <= 0) {
        n_par = 2048 / n_ctx > 1 ? 2048 / n_ctx : 1;
        while (n_par > 1 && (double)n_par * n_scored * info.n_vocab * 4 > 1073741824.0) n_par--;
    }
    if (n_par > n_chunk) n_par = n_chunk;
    o.cp.n_ctx = n_ctx;
    o.cp.n_seq = n_par;
    ctx = kvq_context_new(m, &o.cp);
    if (!ctx) {
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    size_t nb = (size_t)n_par * n_ctx;
    batch_tok = malloc(nb * sizeof *batch_tok);
    batch_seq = malloc(nb * sizeof *batch_seq);
    batch_logits = malloc(nb * sizeof *batch_logits);
    rec = malloc(rbytes);
    if (!batch_tok || !batch_seq || !batch_logits || !rec) {
        cli_fail("out of memory");
        goto done;
    }
    if (write_base) {
        if (!(bf = kvq_outfile_open(&bout, o.kl_base))) {
            cli_fail("%s", kvq_last_error());
            goto done;
        }
        memcpy(h.magic, KLD_MAGIC, 8);
        h.version = KLD_VERSION;
        h.n_vocab = (uint32_t)info.n_vocab;
        h.n_ctx = (uint32_t)n_ctx;
        h.n_chunk = (uint32_t)n_chunk;
        h.n_scored = (uint32_t)n_scored;
        h.record_bytes = (uint32_t)rbytes;
        h.adds_bos = add_bos;
        h.model_fp = fp;
        h.token_hash = fnv1a(FNV_INIT, toks, (size_t)n_ctx * n_chunk * sizeof *toks);
        snprintf(h.arch, sizeof h.arch, "%s", info.arch);
        snprintf(h.weight_type, sizeof h.weight_type, "%s", info.weight_type);
        snprintf(h.kv_name, sizeof h.kv_name, "%s", cli_kv_config_name(&o.cp.kv));
        if (fwrite(&h, sizeof h, 1, bf) != 1 ||
            fwrite(toks, sizeof *toks, (size_t)n_ctx * n_chunk, bf) != (size_t)n_ctx * n_chunk) {
            cli_fail("cannot write '%s': %s", o.kl_base, strerror(errno));
            goto done;
        }
    }
    if (o.kl) {
        st.kld_values = malloc(sizeof(float) * (size_t)n_scored * n_chunk);
        st.dp_values = malloc(sizeof(float) * (size_t)n_scored * n_chunk);
        if (!st.kld_values || !st.dp_values) {
            cli_fail("out of memory");
            goto done;
        }
    }

    fprintf(stderr, "kvq: %d tokens, %d chunks of %d (%d scored each), %d in parallel, KV %s\n", n_tok, n_chunk, n_ctx,
            n_scored, n_par, cli_kv_config_name(&o.cp.kv));
    double bits_rows, bits_all;
    cli_kv_bits(m, &o.cp.kv, n_ctx, &bits_rows, &bits_all);
    printf("KV bits per value at %d tokens: %.4f in the packed rows (codes and scales), %.4f with the offsets and "
           "the f16 windows\n",
           n_ctx, bits_rows, bits_all);
    bool tty = isatty(STDERR_FILENO);
    double nll = 0, nll2 = 0, t0 = cli_now();
    long count = 0;
    kvq_token bos = kvq_token_bos(m);
    if (o.kl)
        printf("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
               "            Same top p\n");
    for (int c0 = 0; c0 < n_chunk; c0 += n_par) {
        int ns = n_chunk - c0 < n_par ? n_chunk - c0 : n_par;
        for (int s = 0; s < ns; s++) {
            kvq_seq_clear(ctx, s);
            const kvq_token *ct = toks + (size_t)(c0 + s) * n_ctx;
            for (int j = 0; j < n_ctx; j++) {
                size_t k = (size_t)s * n_ctx + j;
                batch_tok[k] = j == 0 && add_bos ? bos : ct[j];
                batch_seq[k] = s;
                batch_logits[k] = j >= first && j < n_ctx - 1;
            }
        }
        struct kvq_batch b = {.n_tokens = ns * n_ctx, .tokens = batch_tok, .seq_ids = batch_seq, .logits = batch_logits};
        if (kvq_decode(ctx, &b) != 0) {
            cli_fail("evaluation failed: %s", kvq_last_error());
            goto done;
        }
        for (int s = 0; s < ns; s++) {
            int ci = c0 + s;
            const kvq_token *ct = toks + (size_t)ci * n_ctx;
            for (int j = first; j < n_ctx - 1; j++) {
                const float *lg = kvq_get_logits(ctx, s * n_ctx + j);
                double v;
                if (write_base) {
                    v = encode_record(lg, info.n_vocab, ct[j + 1], rec);
                    if (fwrite(rec, rbytes, 1, bf) != 1) {
                        cli_fail("cannot write '%s': %s", o.kl_base, strerror(errno));
                        goto done;
                    }
                } else if (o.kl) {
                    if (fread(rec, rbytes, 1, bf) != 1) {
                        cli_fail("cannot read '%s'", o.kl_base);
                        goto done;
                    }
                    v = compare_record(lg, info.n_vocab, ct[j + 1], rec, &st);
                } else {
                    float mx;
                    int im;
                    double lse;
                    softmax_stats(lg, info.n_vocab, &mx, &im, &lse);
                    v = mx + lse - lg[ct[j + 1]];
                }
                nll += v;
                nll2 += v * v;
                count++;
            }
            if (o.kl) {
                double lp, lpe, lpb, lpbe, km, ke, msm, mse;
                size_t n = st.count;
                mean_err(st.sum_nll, st.sum_nll2, n, &lp, &lpe);
                mean_err(st.sum_nll_base, st.sum_nll_base2, n, &lpb, &lpbe);
                double cov = covariance(st.sum_nll, st.sum_nll_base, st.sum_nll_nll_base, n);
                double lrv = lpe * lpe + lpbe * lpbe - 2 * cov;
                mean_err(st.sum_kld, st.sum_kld2, n, &km, &ke);
                mean_err(st.sum_dp2, st.sum_dp4, n, &msm, &mse);
                double rms = sqrt(msm > 0 ? msm : 0), same = (double)st.n_same_top / (double)n;
                printf("%4d    %9.4f ± %9.4f    %10.5f ± %10.5f    %10.5f ± %10.5f    %6.3f ± %6.3f %%    %6.3f ± "
                       "%6.3f %%\n",
                       ci + 1, exp(lp), exp(lp) * lpe, lp - lpb, lrv > 0 ? sqrt(lrv) : 0.0, km, ke, 100 * rms,
                       rms > 0 ? 100 * 0.5 / rms * mse : 0.0, 100 * same,
                       n > 1 ? 100 * sqrt(same * (1 - same) / (double)(n - 1)) : 0.0);
            } else {
                printf("[%d]%.4f,", ci + 1, exp(nll / (double)count));
            }
            fflush(stdout);
        }
        if (tty) {
            double el = cli_now() - t0;
            int done_c = c0 + ns;
            fprintf(stderr, "\rkvq: %d/%d chunks, %.1f s, ETA %.1f s   ", done_c, n_chunk, el,
                    el / done_c * (n_chunk - done_c));
            if (done_c == n_chunk) fputc('\n', stderr);
        }
    }
    if (!o.kl) printf("\n");
    double mean = nll / (double)count, var = nll2 / (double)count - mean * mean, ppl = exp(mean);
    double err = var > 0 && count > 1 ? ppl * sqrt(var / (double)(count - 1)) : 0;
    if (o.kl) print_kld_report(&st);
    else printf("Final estimate: PPL = %.4f +/- %.5f\n", ppl, err);
    double el = cli_now() - t0;
    fprintf(stderr, "kvq: %ld tokens scored, %d evaluated in %.2f s (%.1f tok/s)\n", count, n_chunk * n_ctx, el,
            n_chunk * n_ctx / el);
    if (write_base) {
        bf = NULL;
        if (kvq_outfile_commit(&bout) != 0) {
            cli_fail("%s", kvq_last_error());
            goto done;
        }
        fprintf(stderr, "kvq: wrote the base distributions to %s\n", o.kl_base);
    }
    rc = 0;
done:
    if (write_base) kvq_outfile_abort(&bout); /* a failed run leaves the path as it was */
    else if (bf) fclose(bf);
    free(st.kld_values);
    free(st.dp_values);
    free(rec);
    free(batch_tok);
    free(batch_seq);
    free(batch_logits);
    kvq_context_free(ctx);
    kvq_model_free(m);
    free(toks);
    free(text);
    return rc;
}
