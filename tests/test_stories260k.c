/* karpathy's stories260K: greedy decoding from "Once upon a time" must reproduce
 * the continuation documented by llama2.c (refs/stories260K/expected.md). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvq.h"

/* The expected text: the indented line of expected.md. */
static void read_expected(char *out, size_t size) {
    FILE *f = fopen(require_shared("refs/stories260K/expected.md"), "r");
    char line[1024];
    out[0] = '\0';
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "    ", 4) == 0) {
            line[strcspn(line, "\n")] = '\0';
            snprintf(out, size, "%s", line + 4);
            break;
        }
    fclose(f);
}

int main(void) {
    char expected[1024], got[4096] = "";
    read_expected(expected, sizeof expected);
    CHECK(strlen(expected) > 50, "expected text found");
    struct kvq_model *m = kvq_model_load(require_shared("models/stories260K.gguf"));
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return check_finish();
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_threads = 2;
    struct kvq_context *ctx = kvq_context_new(m, &cp);
    struct kvq_sampler_params sp;
    kvq_sampler_params_default(&sp);
    sp.temp = 0;
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    struct kvq_sampler *smp = kvq_sampler_new(&sp, info.n_vocab);
    struct kvq_detok *dt = kvq_detok_new(m);

    const char *prompt = "Once upon a time";
    kvq_token toks[32];
    int n = kvq_tokenize(m, prompt, strlen(prompt), true, false, toks, 32);
    CHECK(n > 1 && toks[0] == kvq_token_bos(m), "prompt tokenized with BOS (%d tokens)", n);
    struct kvq_batch b = {.n_tokens = n, .tokens = toks};
    size_t len = 0;
    for (int step = 0; step < 200 && len < strlen(expected); step++) {
        CHECK(kvq_decode(ctx, &b) == 0, "decode: %s", kvq_last_error());
        kvq_token t = kvq_sampler_sample(smp, kvq_get_logits(ctx, b.n_tokens - 1));
        if (kvq_token_is_eog(m, t)) break;
        len += (size_t)kvq_detok_feed(dt, t, got + len, (int)(sizeof got - len));
        toks[0] = t;
        b = (struct kvq_batch){.n_tokens = 1, .tokens = toks};
    }
    got[len] = '\0';
    printf("generated: %s\n", got);
    CHECK(strncmp(got, expected, strlen(expected)) == 0, "continuation differs:\n got: %s\nwant: %s", got, expected);
    kvq_detok_free(dt);
    kvq_sampler_free(smp);
    kvq_context_free(ctx);
    kvq_model_free(m);
    return check_finish();
}
