/* The public face of grammars (kvq.h): a compiled grammar bound to the model's
 * vocabulary, its token masks applied to logits. */
#include <math.h>
#include <stdlib.h>

#include "core/error.h"
#include "engine/engine_internal.h"
#include "engine/grammar.h"
#include "engine/json_schema.h"
#include "kvq.h"

struct kvq_grammar {
    struct grammar *g;
    const struct kvq_model *m;
    const struct grammar_vocab *v;
    uint64_t *allowed; /* the mask of the current step */
    int n_vocab;
};

struct kvq_grammar *kvq_grammar_from_json_schema(const struct kvq_model *m, const char *schema, size_t len,
                                                 const char *prefix, const char *suffix) {
    struct grammar_vocab *v = engine_grammar_vocab(m);
    if (!v) return NULL;
    struct kvq_grammar *kg = calloc(1, sizeof *kg);
    if (!kg || !(kg->g = grammar_new())) {
        free(kg);
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    kg->m = m;
    kg->v = v;
    kg->n_vocab = info.n_vocab;
    int root = json_schema_compile(kg->g, schema, len, prefix, suffix);
    if (root < 0 || grammar_start(kg->g, root) || grammar_bind_vocab(kg->g, v) ||
        !(kg->allowed = malloc(sizeof *kg->allowed * (size_t)((info.n_vocab + 63) / 64)))) {
        if (root >= 0 && !kg->allowed) kvq_error_code(KVQ_ERR_OOM, "out of memory");
        kvq_grammar_free(kg);
        return NULL;
    }
    return kg;
}

void kvq_grammar_free(struct kvq_grammar *g) {
    if (!g) return;
    grammar_free(g->g);
    free(g->allowed);
    free(g);
}

int kvq_grammar_apply(struct kvq_grammar *g, float *logits) {
    int count = grammar_mask(g->g, g->allowed);
    for (int w = 0; w * 64 < g->n_vocab; w++) {
        const uint64_t bits = g->allowed[w];
        float *l = logits + w * 64;
        const int n = g->n_vocab - w * 64 < 64 ? g->n_vocab - w * 64 : 64;
        if (bits == ~0ull) continue;
        if (bits == 0) /* most words of a mask: written whole, in vectors */
            for (int i = 0; i < n; i++) l[i] = -INFINITY;
        else
            for (int i = 0; i < n; i++)
                if (!(bits >> i & 1)) l[i] = -INFINITY;
    }
    return count;
}

int kvq_grammar_accept(struct kvq_grammar *g, kvq_token t) {
    if (kvq_token_is_eog(g->m, t)) return grammar_accepting(g->g) ? 0 : kvq_error("grammar: the text is not complete");
    const char *bytes;
    int n = grammar_vocab_token(g->v, t, &bytes);
    if (n == 0) return kvq_error("grammar: token %d has no text", (int)t);
    return grammar_accept_bytes(g->g, bytes, (size_t)n) ? kvq_error("grammar: token %d is not allowed here", (int)t) : 0;
}

bool kvq_grammar_done(const struct kvq_grammar *g) {
    return grammar_accepting(g->g) && !grammar_can_continue(g->g);
}
