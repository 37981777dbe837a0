/* Several sequences in one batch give the same logits as each run alone, whatever
 * the order of their tokens in the batch; trim rewinds a sequence exactly. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvq.h"
#include "refs.h"

static double max_diff(const float *a, const float *b, int n) {
    double d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs(a[i] - b[i]));
    return d;
}

int main(void) {
    struct ref_prompt refs[REFS_PROMPTS];
    refs_load(refs);
    struct kvq_model *m = kvq_model_load(require_shared("models/tinydoc-q8_0.gguf"));
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return check_finish();
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    int V = info.n_vocab;
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 64;
    cp.n_threads = 2;

    /* Alone: logits after each prompt's last token, and after one more token. */
    float *alone = malloc(sizeof(float) * V * REFS_PROMPTS * 2);
    for (int p = 0; p < REFS_PROMPTS; p++) {
        struct kvq_context *ctx = kvq_context_new(m, &cp);
        struct kvq_batch b = {.n_tokens = refs[p].n_ids, .tokens = refs[p].ids};
        CHECK(kvq_decode(ctx, &b) == 0, "decode: %s", kvq_last_error());
        memcpy(alone + (size_t)p * 2 * V, kvq_get_logits(ctx, b.n_tokens - 1), sizeof(float) * V);
        b = (struct kvq_batch){.n_tokens = 1, .tokens = &refs[p].next[0]};
        CHECK(kvq_decode(ctx, &b) == 0, "decode: %s", kvq_last_error());
        memcpy(alone + ((size_t)p * 2 + 1) * V, kvq_get_logits(ctx, 0), sizeof(float) * V);
        kvq_context_free(ctx);
    }

    /* Together: all prompts in one batch, tokens interleaved round-robin, with a
     * small n_batch so the batch is split into several forward passes. */
    cp.n_seq = REFS_PROMPTS;
    cp.n_batch = 16;
    struct kvq_context *ctx = kvq_context_new(m, &cp);
    kvq_token tokens[4 * REFS_MAX_IDS];
    int32_t seqs[4 * REFS_MAX_IDS];
    bool want[4 * REFS_MAX_IDS];
    int n = 0, last_of[REFS_PROMPTS];
    for (int i = 0; i < REFS_MAX_IDS; i++)
        for (int p = 0; p < REFS_PROMPTS; p++)
            if (i < refs[p].n_ids) {
                tokens[n] = refs[p].ids[i];
                seqs[n] = p;
                want[n] = i == refs[p].n_ids - 1;
                if (want[n]) last_of[p] = n;
                n++;
            }
    struct kvq_batch b = {.n_tokens = n, .tokens = tokens, .seq_ids = seqs, .logits = want};
    CHECK(kvq_decode(ctx, &b) == 0, "batched decode: %s", kvq_last_error());
    double worst = 0;
    for (int p = 0; p < REFS_PROMPTS; p++) {
        const float *l = kvq_get_logits(ctx, last_of[p]);
        CHECK(l != NULL, "logits of prompt %d", p);
        if (l) worst = fmax(worst, max_diff(l, alone + (size_t)p * 2 * V, V));
        CHECK(kvq_seq_len(ctx, p) == refs[p].n_ids, "sequence %d length", p);
    }
    CHECK(kvq_get_logits(ctx, 0) == NULL || last_of[0] == 0, "logits only where asked");
    /* The same batch where a pass holds 2 rows of logits (a server's limit: a row a
     * sequence): more passes, the same logits. */
    struct kvq_context_params few_cp = cp;
    few_cp.max_logit_rows = 2;
    struct kvq_context *few = kvq_context_new(m, &few_cp);
    CHECK(few && kvq_decode(few, &b) == 0, "decode with 2 rows of logits a pass: %s", kvq_last_error());
    double few_worst = few ? 0 : INFINITY;
    for (int p = 0; p < REFS_PROMPTS && few; p++) {
        const float *l = kvq_get_logits(few, last_of[p]);
        few_worst = l ? fmax(few_worst, max_diff(l, alone + (size_t)p * 2 * V, V)) : INFINITY;
    }
    printf("2 rows of logits a pass vs alone: max logit difference %.2e\n", few_worst);
    CHECK(few_worst < 1e-3, "logits with 2 rows a pass differ from single-sequence ones by %g", few_worst);
    few_cp.max_logit_rows = -1;
    CHECK(kvq_context_new(m, &few_cp) == NULL && strstr(kvq_last_error(), "max_logit_rows -1"),
          "a negative max_logit_rows is refused: %s", kvq_last_error());
    kvq_context_free(few);
    /* One decode step for all sequences together, in reverse order. */
    for (int p = 0; p < REFS_PROMPTS; p++) {
        tokens[p] = refs[REFS_PROMPTS - 1 - p].next[0];
        seqs[p] = REFS_PROMPTS - 1 - p;
        want[p] = true;
    }
    b = (struct kvq_batch){.n_tokens = REFS_PROMPTS, .tokens = tokens, .seq_ids = seqs, .logits = want};
    CHECK(kvq_decode(ctx, &b) == 0, "batched step: %s", kvq_last_error());
    for (int p = 0; p < REFS_PROMPTS; p++)
        worst = fmax(worst, max_diff(kvq_get_logits(ctx, p), alone + ((size_t)(REFS_PROMPTS - 1 - p) * 2 + 1) * V, V));
    printf("batched vs alone: max logit difference %.2e\n", worst);
    CHECK(worst < 1e-3, "batched logits differ from single-sequence ones by %g", worst);

    /* Trim the step away and redo it: same logits. */
    CHECK(kvq_seq_trim(ctx, 2, 1) == 1 && kvq_seq_len(ctx, 2) == refs[2].n_ids, "trim");
    b = (struct kvq_batch){.n_tokens = 1, .tokens = &refs[2].next[0], .seq_ids = (int32_t[]){2}};
    CHECK(kvq_decode(ctx, &b) == 0, "decode after trim");
    double d = max_diff(kvq_get_logits(ctx, 0), alone + (2 * 2 + 1) * (size_t)V, V);
    CHECK(d < 1e-3, "after trim: logits differ by %g", d);

    /* The step again with only the largest logits kept: those of the logits above. */
    float *step = malloc(sizeof(float) * V * REFS_PROMPTS);
    for (int p = 0; p < REFS_PROMPTS; p++) {
        seqs[p] = p;
        tokens[p] = refs[p].next[0];
        want[p] = true;
        CHECK(kvq_seq_trim(ctx, p, 1) == 1, "trim %d", p);
    }
    b = (struct kvq_batch){.n_tokens = REFS_PROMPTS, .tokens = tokens, .seq_ids = seqs, .logits = want};
    CHECK(kvq_decode(ctx, &b) == 0, "step with logits: %s", kvq_last_error());
    for (int p = 0; p < REFS_PROMPTS; p++) {
        memcpy(step + (size_t)p * V, kvq_get_logits(ctx, p), sizeof(float) * V);
        CHECK(kvq_seq_trim(ctx, p, 1) == 1, "trim %d", p);
    }
    b.top_only = true;
    CHECK(kvq_decode(ctx, &b) == 0, "step with the largest logits: %s", kvq_last_error());
    int same = 0;
    for (int p = 0; p < REFS_PROMPTS; p++) {
        float vals[KVQ_TOP_N], want_vals[KVQ_TOP_N];
        kvq_token ids[KVQ_TOP_N], want_ids[KVQ_TOP_N];
        refs_top_k(step + (size_t)p * V, V, KVQ_TOP_N, want_vals, want_ids);
        CHECK(kvq_get_top(ctx, p, vals, ids) == 0, "largest logits of row %d", p);
        CHECK(kvq_get_logits(ctx, p) == NULL, "no logits in a top_only batch");
        same += !memcmp(vals, want_vals, sizeof vals) && !memcmp(ids, want_ids, sizeof ids);
    }
    CHECK(same == REFS_PROMPTS, "largest logits equal to the logits' in %d of %d rows", same, REFS_PROMPTS);
    CHECK(kvq_get_top(ctx, REFS_PROMPTS, (float[KVQ_TOP_N]){0}, (kvq_token[KVQ_TOP_N]){0}) == -1, "no row past the batch");
    b.top_only = false;
    CHECK(kvq_decode(ctx, &(struct kvq_batch){.n_tokens = 1, .tokens = tokens, .seq_ids = seqs}) == 0 &&
              kvq_get_top(ctx, 0, (float[KVQ_TOP_N]){0}, (kvq_token[KVQ_TOP_N]){0}) == -1,
          "no largest logits after a batch with logits");
    CHECK(kvq_seq_trim(ctx, 0, 1) == 1, "trim 0"); /* that batch's token */

    /* The step again with samplers: each row's draw is its twin's from the step's logits
     * (a draw over the whole row, greedy with a ban, top-k), the others' rows keep theirs. */
    struct kvq_sampler *smp[REFS_PROMPTS], *twin[REFS_PROMPTS];
    for (int p = 0; p < REFS_PROMPTS; p++) {
        struct kvq_sampler_params sp;
        kvq_sampler_params_default(&sp);
        sp.temp = p % 3 == 1 ? 0 : 1.0f;
        sp.top_k = p % 3 == 2 ? 5 : 0;
        sp.top_p = 1, sp.min_p = 0, sp.seed = 7 + (uint64_t)p;
        smp[p] = kvq_sampler_new(&sp, V);
        twin[p] = kvq_sampler_new(&sp, V);
        if (p % 3 == 1) {
            kvq_token best[1];
            refs_top_k(step + (size_t)p * V, V, 1, (float[1]){0}, best);
            kvq_sampler_ban(smp[p], best, 1);
            kvq_sampler_ban(twin[p], best, 1);
        }
        CHECK(kvq_seq_trim(ctx, p, 1) == 1, "trim %d", p);
    }
    kvq_sampler_free(smp[REFS_PROMPTS - 1]);
    smp[REFS_PROMPTS - 1] = NULL; /* its logits, as asked */
    b.samplers = smp;
    CHECK(kvq_decode(ctx, &b) == 0, "step with samplers: %s", kvq_last_error());
    same = 0;
    for (int p = 0; p < REFS_PROMPTS - 1; p++) {
        CHECK(kvq_get_logits(ctx, p) == NULL, "no logits for a row its sampler drew");
        same += kvq_get_drawn(ctx, p) == kvq_sampler_sample(twin[p], step + (size_t)p * V);
    }
    CHECK(same == REFS_PROMPTS - 1, "draws equal to the twins' from the logits in %d of %d rows", same, REFS_PROMPTS - 1);
    const int last = REFS_PROMPTS - 1;
    CHECK(kvq_get_drawn(ctx, last) == -1 && kvq_get_logits(ctx, last) &&
              max_diff(kvq_get_logits(ctx, last), step + (size_t)last * V, V) == 0,
          "a row without a sampler keeps its logits");
    for (int p = 0; p < REFS_PROMPTS; p++) CHECK(kvq_seq_trim(ctx, p, 1) == 1, "trim %d", p);
    smp[last] = smp[0];
    CHECK(kvq_decode(ctx, &b) != 0 && strstr(kvq_last_error(), "one sampler"), "a sampler twice: %s", kvq_last_error());
    for (int p = 0; p < REFS_PROMPTS; p++) {
        kvq_sampler_free(p == last ? NULL : smp[p]);
        kvq_sampler_free(twin[p]);
    }
    free(step);

    /* Errors: unknown sequence, out-of-vocabulary token, context overflow. */
    const int len0 = kvq_seq_len(ctx, 0);
    int32_t bad_seq = 9;
    b = (struct kvq_batch){.n_tokens = 1, .tokens = tokens, .seq_ids = &bad_seq};
    CHECK(kvq_decode(ctx, &b) != 0 && strstr(kvq_last_error(), "sequence 9"), "bad seq: %s", kvq_last_error());
    kvq_token bad_tok = V + 5;
    b = (struct kvq_batch){.n_tokens = 1, .tokens = &bad_tok};
    CHECK(kvq_decode(ctx, &b) != 0 && strstr(kvq_last_error(), "outside the vocabulary"), "bad token: %s",
          kvq_last_error());
    CHECK(kvq_seq_len(ctx, 0) == len0, "failed batch left sequence 0 unchanged");
    kvq_token many[64] = {0};
    b = (struct kvq_batch){.n_tokens = 64, .tokens = many};
    CHECK(kvq_decode(ctx, &b) != 0 && strstr(kvq_last_error(), "context full"), "overflow: %s", kvq_last_error());
    kvq_context_free(ctx);
    free(alone);
    kvq_model_free(m);
    return check_finish();
}
