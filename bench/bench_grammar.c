/* Benchmark (not a test) of grammar masks against a decode step, at batch 16.
 * Usage: bench_grammar MODEL [VOCAB.gguf ...] [-t THREADS] [-n STEPS]
 * MODEL: 16 sequences decode together, each under one of the first 16 schemas of
 * tests/fixtures/json_schemas.json (a grammar that ends starts over), sampled at
 * temperature 0.9; per step: the decode's time and the 16 masks' (one thread, as
 * kvq_sampler_sample applies them; the server spreads draws over threads).
 * VOCAB: the same 16 grammars over a larger vocabulary (a vocabulary-only GGUF),
 * driven by random logits: the masks' cost alone. The first mask of a grammar also
 * builds the vocabulary's tables once per model (timed apart). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvq.h"

#define B 16

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static char *schema_text[B];

static void load_schemas(void) {
    json_error_t e;
    json_t *a = json_load_file(KVQ_SOURCE_DIR "/tests/fixtures/json_schemas.json", 0, &e);
    if (!a) {
        fprintf(stderr, "bench_grammar: %s\n", e.text);
        exit(1);
    }
    for (int i = 0; i < B; i++) schema_text[i] = json_dumps(json_array_get(a, (size_t)i), JSON_COMPACT);
    json_decref(a);
}

static struct kvq_grammar *grammar(const struct kvq_model *m, int i) {
    struct kvq_grammar *g = kvq_grammar_from_json_schema(m, schema_text[i], strlen(schema_text[i]), NULL, NULL);
    if (!g) {
        fprintf(stderr, "bench_grammar: schema %d: %s\n", i, kvq_last_error());
        exit(1);
    }
    return g;
}

/* Seconds the model's first grammar takes (it builds the vocabulary's tables). */
static double first_grammar_s(const struct kvq_model *m) {
    const double t0 = now();
    kvq_grammar_free(grammar(m, 0));
    return now() - t0;
}

struct seq {
    struct kvq_grammar *g;
    struct kvq_sampler *s;
    int schema;
};

/* Masks and draws for the 16 sequences from their logits; returns the masks' seconds. */
static double masks_and_draws(const struct kvq_model *m, struct seq *q, float *const *logits, kvq_token *out,
                              int n_vocab) {
    double t_mask = 0;
    for (int i = 0; i < B; i++) {
        double t0 = now();
        kvq_grammar_apply(q[i].g, logits[i]);
        t_mask += now() - t0;
        /* the sampler applies the mask again, from the grammar's cache of the last one */
        kvq_token t = out[i] = kvq_sampler_sample(q[i].s, logits[i]);
        if (kvq_grammar_accept(q[i].g, t) != 0 || kvq_grammar_done(q[i].g) || kvq_token_is_eog(m, t)) {
            kvq_grammar_free(q[i].g);
            q[i].g = grammar(m, q[i].schema);
            kvq_sampler_set_grammar(q[i].s, q[i].g);
        }
    }
    (void)n_vocab;
    return t_mask;
}

static void seqs_new(const struct kvq_model *m, struct seq *q, int n_vocab) {
    for (int i = 0; i < B; i++) {
        struct kvq_sampler_params sp;
        kvq_sampler_params_default(&sp);
        sp.temp = 0.9f;
        sp.seed = 7 + (uint64_t)i;
        q[i].schema = i;
        q[i].g = grammar(m, i);
        q[i].s = kvq_sampler_new(&sp, n_vocab);
        kvq_sampler_set_grammar(q[i].s, q[i].g);
    }
}

static void seqs_free(struct seq *q) {
    for (int i = 0; i < B; i++) {
        kvq_grammar_free(q[i].g);
        kvq_sampler_free(q[i].s);
    }
}

/* m, or the loader's error and exit. */
static struct kvq_model *loaded(struct kvq_model *m) {
    if (!m) {
        fprintf(stderr, "bench_grammar: %s\n", kvq_last_error());
        exit(1);
    }
    return m;
}

static void bench_model(const char *path, int threads, int steps) {
    struct kvq_model *m = loaded(kvq_model_load(path));
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = steps + 64;
    cp.n_seq = B;
    cp.n_threads = threads;
    struct kvq_context *c = kvq_context_new(m, &cp);
    const double t_vocab = first_grammar_s(m);
    struct seq q[B];
    seqs_new(m, q, info.n_vocab);
    const char *prompt = "The configuration is written as JSON:\n";
    kvq_token ptok[64], tok[B * 64];
    int32_t sid[B * 64];
    bool want[B * 64];
    const int np = kvq_tokenize(m, prompt, strlen(prompt), true, false, ptok, 64);
    int n = 0;
    for (int i = 0; i < B; i++)
        for (int j = 0; j < np; j++, n++) tok[n] = ptok[j], sid[n] = i, want[n] = j == np - 1;
    float *logits[B];
    for (int i = 0; i < B; i++) logits[i] = malloc(sizeof(float) * (size_t)info.n_vocab);
    double t_dec = 0, t_mask = 0;
    for (int step = 0; step <= steps; step++) {
        struct kvq_batch b = {.n_tokens = n, .tokens = tok, .seq_ids = sid, .logits = want};
        double a = now();
        if (kvq_decode(c, &b) != 0) {
            fprintf(stderr, "bench_grammar: %s\n", kvq_last_error());
            exit(1);
        }
        if (step > 0) t_dec += now() - a; /* the prefill is not a decode step */
        int k = 0;
        for (int i = 0; i < n; i++)
            if (want[i]) memcpy(logits[k++], kvq_get_logits(c, i), sizeof(float) * (size_t)info.n_vocab);
        kvq_token next[B];
        t_mask += masks_and_draws(m, q, logits, next, info.n_vocab);
        for (int i = 0; i < B; i++) {
            if (kvq_seq_len(c, i) >= cp.n_ctx - 1) kvq_seq_clear(c, i);
            tok[i] = next[i], sid[i] = i, want[i] = true;
        }
        n = B;
    }
    printf("%s (vocabulary %d), %d threads: vocabulary tables %.1f ms (once)\n", path, info.n_vocab, threads,
           t_vocab * 1e3);
    printf("  decode step at batch %d: %.3f ms; 16 masks: %.3f ms (%.1f%% of the step), %.1f us a sequence\n", B,
           t_dec / steps * 1e3, t_mask / (steps + 1) * 1e3, 100 * (t_mask / (steps + 1)) / (t_dec / steps),
           t_mask / (steps + 1) / B * 1e6);
    seqs_free(q);
    for (int i = 0; i < B; i++) free(logits[i]);
    kvq_context_free(c);
    kvq_model_free(m);
}

static void bench_vocab(const char *path, int steps) {
    struct kvq_model *m = loaded(kvq_model_load_vocab(path));
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    const double t_vocab = first_grammar_s(m);
    struct seq q[B];
    seqs_new(m, q, info.n_vocab);
    float *logits[B];
    uint64_t rng = 12345;
    for (int i = 0; i < B; i++) logits[i] = malloc(sizeof(float) * (size_t)info.n_vocab);
    double t_mask = 0;
    for (int step = 0; step < steps; step++) {
        for (int i = 0; i < B; i++)
            for (int v = 0; v < info.n_vocab; v++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                logits[i][v] = (float)(rng >> 40) * (8.0f / 16777216.0f);
            }
        kvq_token next[B];
        t_mask += masks_and_draws(m, q, logits, next, info.n_vocab);
    }
    printf("%s (vocabulary %d): vocabulary tables %.1f ms (once); 16 masks a step: %.3f ms, %.1f us a sequence\n", path,
           info.n_vocab, t_vocab * 1e3, t_mask / steps * 1e3, t_mask / steps / B * 1e6);
    seqs_free(q);
    for (int i = 0; i < B; i++) free(logits[i]);
    kvq_model_free(m);
}

int main(int argc, char **argv) {
    int threads = 2, steps = 200;
    const char *model = NULL, *vocabs[16];
    int n_vocabs = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-t") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-n") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!model) model = argv[i];
        else if (n_vocabs < 16) vocabs[n_vocabs++] = argv[i];
    }
    if (!model || steps < 1) {
        fprintf(stderr, "usage: bench_grammar MODEL [VOCAB.gguf ...] [-t THREADS] [-n STEPS]\n");
        return 1;
    }
    load_schemas();
    bench_model(model, threads, steps);
    for (int i = 0; i < n_vocabs; i++) bench_vocab(vocabs[i], steps);
    return 0;
}
