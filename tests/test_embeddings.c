/* kvq_embed against Hugging Face transformers on tinydoc. Its output layer is the tied
 * embedding matrix W times the final normed hidden state, so W times the last-token
 * embedding must point where the reference logits of the last position point, and W
 * times the mean embedding where their sum over all positions points. Also: unit
 * length, pooling that does not depend on how the prompt is cut into passes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "gguf/gguf.h"
#include "kvq.h"
#include "refs.h"

static float half_to_float(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? ldexpf((float)m, -24) : ldexpf((float)(m | 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}

/* cos(W e, ref) over the vocabulary. */
static double cosine_wx(const float *w, int n_vocab, int d, const float *e, const double *ref) {
    double dot = 0, a = 0, b = 0;
    for (int t = 0; t < n_vocab; t++) {
        double y = 0;
        for (int k = 0; k < d; k++) y += (double)w[(size_t)t * d + k] * e[k];
        dot += y * ref[t], a += y * y, b += ref[t] * ref[t];
    }
    return dot / sqrt(a * b);
}

static struct kvq_context *context(struct kvq_model *m, int n_batch) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 128;
    cp.n_seq = 2;
    cp.n_batch = n_batch;
    cp.n_threads = 2;
    return kvq_context_new(m, &cp);
}

int main(void) {
    struct ref_prompt refs[REFS_PROMPTS];
    refs_load(refs);
    const char *path = require_shared("models/tinydoc-f16.gguf");
    struct kvq_model *m = kvq_model_load(path);
    struct gguf_file *g = gguf_open(path);
    CHECK(m && g, "load: %s", kvq_last_error());
    if (!m || !g) return check_finish();
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    const int nv = info.n_vocab, d = info.n_embd;
    const struct gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    CHECK(te && te->ne[0] == (uint64_t)d && te->ne[1] == (uint64_t)nv && te->type == 1, "token_embd is f16 [%d][%d]", nv, d);
    float *w = malloc(sizeof *w * (size_t)nv * d);
    for (size_t i = 0; te && i < (size_t)nv * d; i++) w[i] = half_to_float(((const uint16_t *)te->data)[i]);
    struct kvq_context *big = context(m, 64), *small = context(m, 5);
    float *e = malloc(sizeof *e * d), *e2 = malloc(sizeof *e2 * d);
    double *ref = malloc(sizeof *ref * nv);
    for (int p = 0; p < REFS_PROMPTS && te; p++) {
        const struct ref_prompt *r = &refs[p];
        float *logits = refs_logits(r, nv);
        /* last-token pooling: the last position's logits */
        CHECK(kvq_embed(big, 1, r->ids, r->n_ids, KVQ_POOLING_LAST, e) == 0, "embed: %s", kvq_last_error());
        double norm = 0;
        for (int k = 0; k < d; k++) norm += (double)e[k] * e[k];
        CHECK(fabs(norm - 1) < 1e-5, "prompt %d: unit length (%.7f)", p, norm);
        for (int t = 0; t < nv; t++) ref[t] = logits[(size_t)(r->n_ids - 1) * nv + t];
        double c = cosine_wx(w, nv, d, e, ref);
        CHECK(c > 0.9999, "prompt %d: W x last-token embedding against the reference logits: cos %.6f", p, c);
        /* mean pooling: the sum of the logits over the positions */
        CHECK(kvq_embed(big, 1, r->ids, r->n_ids, KVQ_POOLING_MEAN, e) == 0, "embed mean: %s", kvq_last_error());
        for (int t = 0; t < nv; t++) {
            ref[t] = 0;
            for (int i = 0; i < r->n_ids; i++) ref[t] += logits[(size_t)i * nv + t];
        }
        c = cosine_wx(w, nv, d, e, ref);
        CHECK(c > 0.9999, "prompt %d: W x mean embedding against the summed reference logits: cos %.6f", p, c);
        /* the same in passes of 5 tokens, in sequence 0 */
        CHECK(kvq_embed(small, 0, r->ids, r->n_ids, KVQ_POOLING_MEAN, e2) == 0, "embed in passes");
        double diff = 0;
        for (int k = 0; k < d; k++) diff = fmax(diff, fabs((double)e[k] - e2[k]));
        CHECK(diff < 1e-4, "prompt %d: mean pooled over passes of 5 tokens differs by %g", p, diff);
        CHECK(kvq_seq_len(small, 0) == 0 && kvq_seq_len(big, 1) == 0, "the sequence is left empty");
        free(logits);
    }
    /* one token: mean and last agree; bad input is an error */
    CHECK(kvq_embed(big, 0, refs[0].ids, 1, KVQ_POOLING_MEAN, e) == 0 &&
              kvq_embed(big, 0, refs[0].ids, 1, KVQ_POOLING_LAST, e2) == 0 && !memcmp(e, e2, sizeof *e * d),
          "one token: mean = last");
    const kvq_token bad = nv;
    CHECK(kvq_embed(big, 0, &bad, 1, KVQ_POOLING_MEAN, e) == -1, "a token outside the vocabulary is an error");
    CHECK(kvq_embed(big, 2, refs[0].ids, 1, KVQ_POOLING_MEAN, e) == -1, "a missing sequence is an error");
    CHECK(kvq_embed(big, 0, refs[0].ids, 0, KVQ_POOLING_MEAN, e) == -1, "no tokens is an error");
    free(w), free(e), free(e2), free(ref);
    kvq_context_free(big);
    kvq_context_free(small);
    gguf_close(g);
    kvq_model_free(m);
    return check_finish();
}
