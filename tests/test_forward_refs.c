/* The forward pass against Hugging Face transformers on tinydoc: logits at every
 * position of four prompts, and greedy continuations, for f16 and q8_0 weights. */
#include <stdlib.h>

#include "check.h"
#include "kvq.h"
#include "refs.h"

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Greedy continuation of a prompt until EOS or max tokens; returns its length. */
static int greedy(struct kvq_context *ctx, const struct kvq_model *m, const int32_t *ids, int n_ids, int32_t *out,
                  int max, int n_vocab) {
    struct kvq_batch b = {.n_tokens = n_ids, .tokens = ids};
    if (kvq_decode(ctx, &b) != 0) return -1;
    int n = 0;
    while (n < max) {
        int32_t t = argmax(kvq_get_logits(ctx, b.n_tokens - 1), n_vocab);
        out[n++] = t;
        if (kvq_token_is_eog(m, t)) break;
        b = (struct kvq_batch){.n_tokens = 1, .tokens = &t};
        if (kvq_decode(ctx, &b) != 0) return -1;
    }
    return n;
}

static void check_model(const char *file, const struct ref_prompt *refs, bool compare_logits) {
    struct kvq_model *m = kvq_model_load(require_shared(file));
    CHECK(m != NULL, "load %s: %s", file, kvq_last_error());
    if (!m) return;
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 128;
    cp.n_threads = 2;
    int exact = 0;
    for (int i = 0; i < REFS_PROMPTS; i++) {
        const struct ref_prompt *r = &refs[i];
        struct kvq_context *ctx = kvq_context_new(m, &cp);
        CHECK(ctx != NULL, "context: %s", kvq_last_error());
        if (compare_logits) {
            char label[96];
            snprintf(label, sizeof label, "%s prompt %d", file, i);
            refs_check_logits(ctx, r, info.n_vocab, label);
            kvq_seq_clear(ctx, 0);
        }
        int32_t got[REFS_MAX_IDS];
        int n = greedy(ctx, m, r->ids, r->n_ids, got, r->n_next, info.n_vocab);
        int same = 0;
        while (same < n && same < r->n_next && got[same] == r->next[same]) same++;
        printf("%s prompt %d: greedy continuation matches HF for %d/%d tokens\n", file, i, same, r->n_next);
        exact += same == r->n_next && n == r->n_next;
        CHECK(same == r->n_next && n == r->n_next, "%s prompt %d: greedy continuation diverges at token %d", file, i,
              same);
        kvq_context_free(ctx);
    }
    printf("%s: %d/%d greedy continuations exact\n", file, exact, REFS_PROMPTS);
    kvq_model_free(m);
}

int main(void) {
    struct ref_prompt refs[REFS_PROMPTS];
    refs_load(refs);
    check_model("models/tinydoc-f16.gguf", refs, true);
    check_model("models/tinydoc-q8_0.gguf", refs, false);
    return check_finish();
}
