/* kvq generate: continue a prompt, printing only the generated text on stdout and
 * timing lines on stderr. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/threadpool.h"

static const char *const generate_help =
    "usage: kvq generate -m MODEL (-p PROMPT | -f FILE) [options]\n"
    "\n"
    "Generates a continuation of the prompt. Only the generated text goes to stdout;\n"
    "timings and the KV cache size go to stderr.\n"
    "\n"
    "  -m, --model FILE     GGUF model\n"
    "  -p, --prompt TEXT    prompt text\n"
    "  -f, --file FILE      read the prompt from a file\n"
    "  -n, --n-predict N    tokens to generate (default 128; -1: until EOS or context end)\n"
    "  -c, --ctx-size N     context length in tokens (default: the model's)\n"
    "  -t, --threads N      threads (default: all cores)\n"
    "  -b, --batch-size N   prompt tokens per forward pass (default 512; 2048 on a GPU)\n"
    "  --temp T             temperature (default 0.8; 0 = greedy)\n"
    "  --top-k K            keep the K most likely tokens (default 40; 0 = off)\n"
    "  --top-p P            nucleus sampling (default 0.95; 1 = off)\n"
    "  --min-p P            drop tokens below P x the best one's probability (default 0.05)\n"
    "  --repeat-penalty R   penalty for recent tokens (default 1.0 = off)\n"
    "  --repeat-last-n N    how many recent tokens the penalty sees (default 64)\n"
    "  --seed S             random seed (default: fixed)\n"
    "  --ignore-eos         keep generating past end-of-sequence tokens\n"
    "  --json-schema JSON   the output is a JSON value under this JSON Schema ('{}': any value;\n"
    "                       the subset 'kvq serve' takes as response_format); it ends when complete\n"
    "  --json-schema-file FILE  the same, read from a file\n"
    "  --prompt-cache FILE  continue from a state saved by 'kvq cache-prompt' (its KV cache\n"
    "                       settings apply); -p then gives text to add after it (optional)\n"
    "  -h, --help           this text\n";

struct generate_opts {
    const char *model, *prompt, *prompt_file, *prompt_cache, *schema, *schema_file;
    int n_predict;
    bool ignore_eos;
    struct kvq_context_params cp;
    struct kvq_sampler_params sp;
};

static int parse_args(int argc, char **argv, struct generate_opts *o) {
    kvq_context_params_default(&o->cp);
    kvq_sampler_params_default(&o->sp);
    o->n_predict = 128;
    bool kv_given = false;
    const struct cli_opt opts[] = {
        CLI_FLAG(&o->ignore_eos, "--ignore-eos"),
        CLI_STR(&o->model, "-m", "--model"),
        CLI_STR(&o->prompt, "-p", "--prompt"),
        CLI_STR(&o->prompt_file, "-f", "--file"),
        CLI_STR(&o->prompt_cache, "--prompt-cache"),
        CLI_STR(&o->schema, "--json-schema"),
        CLI_STR(&o->schema_file, "--json-schema-file"),
        CLI_INT(&o->n_predict, -1, INT_MAX, "-n", "--n-predict"),
        CLI_INT(&o->cp.n_ctx, 0, 1 << 24, "-c", "--ctx-size"),
        CLI_INT(&o->cp.n_threads, 1, 1024, "-t", "--threads"),
        CLI_INT(&o->cp.n_batch, 1, 1 << 16, "-b", "--batch-size"),
        CLI_FLOAT(&o->sp.temp, 0, 100, "--temp"),
        CLI_INT(&o->sp.top_k, 0, INT_MAX, "--top-k"),
        CLI_FLOAT(&o->sp.top_p, 0, 1, "--top-p"),
        CLI_FLOAT(&o->sp.min_p, 0, 1, "--min-p"),
        CLI_FLOAT(&o->sp.repeat_penalty, 0.01, 100, "--repeat-penalty"),
        CLI_INT(&o->sp.repeat_last_n, 0, 1 << 20, "--repeat-last-n"),
        CLI_U64(&o->sp.seed, "--seed"),
        CLI_END,
    };
    if (cli_parse_args(argc, argv, "generate", opts, &o->cp, &kv_given, generate_help, cli_kv_flags_help)) return 1;
    if (!o->model) return cli_fail("generate needs a model: -m FILE");
    if (o->prompt_cache && !o->prompt && !o->prompt_file) o->prompt = "";
    if (o->prompt_cache) {
        struct kvq_kv_config asked = o->cp.kv;
        if (kvq_seq_file_kv_config(o->prompt_cache, &o->cp.kv) != 0) return cli_fail("%s", kvq_last_error());
        /* the cache's settings apply: a different explicit one would be silently ignored */
        if (kv_given && memcmp(&asked, &o->cp.kv, sizeof asked) != 0) {
            char theirs[96];
            snprintf(theirs, sizeof theirs, "%s", cli_kv_config_name(&o->cp.kv));
            return cli_fail("'%s' was saved with KV cache %s, not %s: drop the --kv-* options (its settings apply)",
                            o->prompt_cache, theirs, cli_kv_config_name(&asked));
        }
    }
    if (!o->prompt && !o->prompt_file) return cli_fail("generate needs a prompt: -p TEXT or -f FILE");
    if (o->prompt && o->prompt_file) return cli_fail("give either -p or -f, not both");
    if (o->schema && o->schema_file) return cli_fail("give either --json-schema or --json-schema-file, not both");
    if (!cli_kv_config_check(&o->cp.kv)) return 1;
    return 0;
}

/* Feeds the prompt in n_batch pieces, showing progress on a terminal. */
static int prefill(struct kvq_context *ctx, const kvq_token *toks, int n, int n_batch, int *last) {
    bool tty = isatty(STDERR_FILENO);
    for (int done = 0; done < n; done += n_batch) {
        int len = n - done < n_batch ? n - done : n_batch;
        struct kvq_batch b = {.n_tokens = len, .tokens = toks + done};
        if (kvq_decode(ctx, &b) != 0) return cli_fail("prompt evaluation failed: %s", kvq_last_error());
        *last = len - 1; /* the logits of the batch's last token */
        if (tty && n > n_batch) fprintf(stderr, "\rkvq: prompt %d/%d tokens", done + len, n);
    }
    if (tty && n > n_batch) fputc('\n', stderr);
    return 0;
}

/* The text of one token; the buffer grows for long vocabulary entries (the
 * detokenizer leaves its state as it was when the buffer is too small). */
static int feed_piece(struct kvq_detok *dt, kvq_token t, char **buf, int *cap) {
    for (;;) {
        int w = kvq_detok_feed(dt, t, *buf, *cap);
        if (w >= 0 || *cap >= (1 << 26)) return w;
        char *nb = realloc(*buf, (size_t)*cap * 4);
        if (!nb) return w;
        *buf = nb;
        *cap *= 4;
    }
}

int cmd_generate(int argc, char **argv) {
    struct generate_opts o = {0};
    if (parse_args(argc, argv, &o) != 0) return 1;
    size_t len;
    char *text = o.prompt_file ? cli_read_file(o.prompt_file, &len) : strdup(o.prompt);
    if (!text) return 1;
    if (!o.prompt_file) len = strlen(text);

    int rc = 1;
    struct kvq_context *ctx = NULL;
    struct kvq_sampler *smp = NULL;
    struct kvq_grammar *grammar = NULL;
    char *schema = NULL;
    struct kvq_detok *dt = NULL;
    kvq_token *toks = NULL;
    struct kvq_seq_extra saved = {0};
    char *piece = NULL;
    struct kvq_model_info info;
    struct kvq_model *m = cli_load_model(o.model, &info);
    if (!m) goto done;
    int n_prompt;
    /* Text that continues a cached prompt gets no BOS. */
    toks = cli_tokenize(m, text, len, !o.prompt_cache, true, &n_prompt);
    if (!toks) goto done;
    if ((n_prompt == 0 || len == 0) && !o.prompt_cache) { /* BOS alone is no prompt */
        cli_fail("the prompt is empty");
        goto done;
    }
    ctx = kvq_context_new(m, &o.cp);
    if (!ctx) {
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    int n_ctx = kvq_context_n_ctx(ctx);
    if (o.cp.kv.max_size == 0 && n_prompt >= n_ctx) {
        cli_fail("the prompt has %d tokens, more than the context of %d allows (use -c to raise it)", n_prompt, n_ctx);
        goto done;
    }
    smp = kvq_sampler_new(&o.sp, info.n_vocab);
    dt = kvq_detok_new(m);
    if (!smp || !dt) {
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    if (o.schema_file && !(schema = cli_read_file(o.schema_file, NULL))) goto done;
    if (o.schema || schema) {
        const char *sch = schema ? schema : o.schema;
        if (!(grammar = kvq_grammar_from_json_schema(m, sch, strlen(sch), NULL, NULL)) ||
            kvq_sampler_set_grammar(smp, grammar) != 0) {
            cli_fail("%s", kvq_last_error());
            goto done;
        }
    }
    const float *pending = NULL; /* logits saved with the prompt cache */
    if (o.prompt_cache) {
        if (kvq_seq_load_ex(ctx, 0, o.prompt_cache, &saved) != 0) {
            cli_fail("%s", kvq_last_error());
            goto done;
        }
        for (int i = 0; i < saved.n_tokens; i++) kvq_sampler_accept(smp, saved.tokens[i]);
        pending = saved.logits;
        if (!pending && n_prompt == 0) {
            cli_fail("'%s' holds no logits: give more prompt text with -p", o.prompt_cache);
            goto done;
        }
        int n_cached = kvq_seq_len(ctx, 0);
        if (o.cp.kv.max_size == 0 && n_cached + n_prompt >= n_ctx) { /* fail before evaluating anything */
            cli_fail("'%s' holds %d tokens and the prompt adds %d, more than the context of %d allows (use -c to "
                     "raise it)",
                     o.prompt_cache, n_cached, n_prompt, n_ctx);
            goto done;
        }
    }
    for (int i = 0; i < n_prompt; i++) kvq_sampler_accept(smp, toks[i]);

    double t0 = cli_now();
    int last = 0;
    if (n_prompt > 0 && prefill(ctx, toks, n_prompt, o.cp.n_batch, &last) != 0) goto done;
    if (n_prompt > 0) pending = NULL;
    double t1 = cli_now();
    int n_gen = 0;
    int piece_cap = 256;
    piece = malloc((size_t)piece_cap);
    bool stopped_by_ctx = false;
    if (!piece) {
        cli_fail("out of memory");
        goto done;
    }
    while (o.n_predict < 0 || n_gen < o.n_predict) {
        kvq_token t = kvq_sampler_sample(smp, pending ? pending : kvq_get_logits(ctx, last));
        pending = NULL;
        last = 0;
        if (!o.ignore_eos && kvq_token_is_eog(m, t)) break;
        if (grammar && kvq_grammar_accept(grammar, t) != 0) break; /* an end-of-text token --ignore-eos let through */
        kvq_sampler_accept(smp, t);
        int w = feed_piece(dt, t, &piece, &piece_cap);
        if (w < 0) {
            cli_fail("cannot detokenize token %d: %s", t, kvq_last_error());
            goto done;
        }
        if (fwrite(piece, 1, (size_t)w, stdout) != (size_t)w || fflush(stdout) != 0) {
            cli_fail("cannot write the output: %s", strerror(errno));
            goto done;
        }
        n_gen++;
        if (o.n_predict >= 0 && n_gen >= o.n_predict) break;
        if (grammar && kvq_grammar_done(grammar)) break; /* the value is complete */
        if (o.cp.kv.max_size == 0 && kvq_seq_len(ctx, 0) >= n_ctx) {
            stopped_by_ctx = true;
            break;
        }
        struct kvq_batch b = {.n_tokens = 1, .tokens = &t};
        if (kvq_decode(ctx, &b) != 0) {
            cli_fail("decoding failed: %s", kvq_last_error());
            goto done;
        }
    }
    int w = kvq_detok_flush(dt, piece, piece_cap);
    if (w < 0 || fwrite(piece, 1, (size_t)w, stdout) != (size_t)w || fputc('\n', stdout) == EOF ||
        fflush(stdout) != 0) {
        cli_fail("cannot write the output: %s", w < 0 ? kvq_last_error() : strerror(errno));
        goto done;
    }
    double t2 = cli_now();
    if (stopped_by_ctx) fprintf(stderr, "kvq: stopped: the context of %d tokens is full\n", n_ctx);
    fprintf(stderr, "kvq: model %s (%s, %s), %d threads\n", o.model, info.arch, info.weight_type,
            o.cp.n_threads > 0 ? o.cp.n_threads : kvq_online_cpus());
    fprintf(stderr, "kvq: prompt    %6d tokens in %9.2f ms (%8.2f tok/s)\n", n_prompt, (t1 - t0) * 1e3,
            n_prompt / (t1 - t0));
    /* The first sampled token came from the prompt's logits; the decode steps made the rest. */
    int n_steps = n_gen > 0 ? n_gen - 1 : 0;
    fprintf(stderr, "kvq: generate  %6d tokens in %9.2f ms (%8.2f tok/s)\n", n_gen, (t2 - t1) * 1e3,
            n_steps > 0 ? n_steps / (t2 - t1) : 0.0);
    fprintf(stderr, "kvq: KV cache %s: %.2f MiB for %d tokens (%zu bytes/token + %zu bytes of f16 window)\n",
            cli_kv_config_name(&o.cp.kv), kvq_kv_bytes(ctx) / 1048576.0, kvq_seq_len(ctx, 0),
            kvq_kv_token_bytes(m, &o.cp.kv), kvq_kv_window_bytes(m, &o.cp.kv));
    cli_print_kv_layer_kinds(ctx);
    rc = 0;
done:
    free(piece);
    kvq_seq_extra_free(&saved);
    kvq_detok_free(dt);
    kvq_sampler_free(smp);
    kvq_grammar_free(grammar);
    free(schema);
    kvq_context_free(ctx);
    kvq_model_free(m);
    free(toks);
    free(text);
    return rc;
}
