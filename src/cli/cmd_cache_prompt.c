/* kvq cache-prompt: evaluate a prompt once and save the KV cache state (with the
 * prompt's token ids and its last logits) so that `kvq generate --prompt-cache FILE`
 * continues from it without recomputing. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

static const char *const cache_prompt_help =
    "usage: kvq cache-prompt -m MODEL (-p PROMPT | -f FILE) -o OUT [options]\n"
    "\n"
    "Evaluates the prompt and writes the KV cache state after it to OUT.\n"
    "\n"
    "  -m, --model FILE     GGUF model\n"
    "  -p, --prompt TEXT    prompt text\n"
    "  -f, --file FILE      read the prompt from a file\n"
    "  -o, --output FILE    where to write the state\n"
    "  -c, --ctx-size N     context length in tokens (default: the model's)\n"
    "  -t, --threads N      threads (default: all cores)\n"
    "  -b, --batch-size N   prompt tokens per forward pass (default 512)\n"
    "  -h, --help           this text\n";

static const char *const cache_prompt_value_flags[] = {"-m", "--model", "-p", "--prompt", "-f", "--file", "-o", "--output", "-c", "--ctx-size", "-t", "--threads", "-b", "--batch-size", NULL};

int cmd_cache_prompt(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *prompt_file = NULL, *out = NULL;
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        int kv = cli_parse_kv_flag(argc, argv, &i, &cp);
        if (kv < 0) return 1;
        if (kv > 0) continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(cache_prompt_help, stdout);
            fputs(cli_kv_flags_help, stdout);
            return 0;
        }
        if (!(v = cli_option_value(argc, argv, &i, cache_prompt_value_flags, "cache-prompt"))) return 1;
        bool ok = true;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) prompt = v;
        else if (!strcmp(a, "-f") || !strcmp(a, "--file")) prompt_file = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--output")) out = v;
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) ok = cli_parse_int(a, v, 0, 1 << 24, &cp.n_ctx);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) ok = cli_parse_int(a, v, 1, 1024, &cp.n_threads);
        else if (!strcmp(a, "-b") || !strcmp(a, "--batch-size")) ok = cli_parse_int(a, v, 1, 1 << 16, &cp.n_batch);
        else return cli_fail("unknown option '%s' for cache-prompt (see 'kvq cache-prompt --help')", a);
        if (!ok) return 1;
    }
    if (!model) return cli_fail("cache-prompt needs a model: -m FILE");
    if (!prompt && !prompt_file) return cli_fail("cache-prompt needs a prompt: -p TEXT or -f FILE");
    if (prompt && prompt_file) return cli_fail("give either -p or -f, not both");
    if (!out) return cli_fail("cache-prompt needs an output file: -o FILE");
    if (!cli_kv_config_check(&cp.kv)) return 1;
    size_t len;
    char *text = prompt_file ? cli_read_file(prompt_file, &len) : strdup(prompt);
    if (!text) return 1;
    if (!prompt_file) len = strlen(text);
    int rc = 1;
    kvq_token *toks = NULL;
    struct kvq_context *ctx = NULL;
    struct kvq_model *m = cli_load_model(model, NULL);
    if (!m) goto done;
    int cap = (int)(len < INT_MAX / 2 ? len : INT_MAX / 2) + 8;
    toks = malloc(sizeof *toks * (size_t)cap);
    int n = toks ? kvq_tokenize(m, text, len, true, true, toks, cap) : -1;
    if (n <= 0 || n > cap) {
        cli_fail("cannot tokenize the prompt: %s", n == 0 ? "it is empty" : kvq_last_error());
        goto done;
    }
    ctx = kvq_context_new(m, &cp);
    if (!ctx) {
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    if (cp.kv.max_size == 0 && n >= kvq_context_n_ctx(ctx)) {
        cli_fail("the prompt has %d tokens, more than the context of %d allows", n, kvq_context_n_ctx(ctx));
        goto done;
    }
    double t0 = cli_now();
    int last = 0;
    for (int done = 0; done < n; done += cp.n_batch) {
        int len_b = n - done < cp.n_batch ? n - done : cp.n_batch;
        struct kvq_batch b = {.n_tokens = len_b, .tokens = toks + done};
        if (kvq_decode(ctx, &b) != 0) {
            cli_fail("prompt evaluation failed: %s", kvq_last_error());
            goto done;
        }
        last = len_b - 1;
    }
    double t1 = cli_now();
    if (kvq_seq_save_ex(ctx, 0, out, toks, n, kvq_get_logits(ctx, last)) != 0) {
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    fprintf(stderr, "kvq: prompt %d tokens in %.2f ms; KV cache %s: %.2f MiB saved to %s\n", n, (t1 - t0) * 1e3,
            cli_kv_config_name(&cp.kv), kvq_kv_bytes(ctx) / 1048576.0, out);
    rc = 0;
done:
    kvq_context_free(ctx);
    kvq_model_free(m);
    free(toks);
    free(text);
    return rc;
}
