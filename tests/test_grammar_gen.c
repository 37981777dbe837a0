/* Constrained generation with tinydoc: every schema of tests/fixtures/json_schemas.json,
 * sampled at temperature 0.9 with several seeds, all sequences in one batch. Each
 * output that ends by its grammar (nine in ten at least; the others reach the token
 * limit inside a string or recursion the schema leaves unbounded) must validate
 * against its schema by Python's jsonschema (not ours); skipped when
 * python3-jsonschema is missing. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "kvq.h"

#define SEEDS 2
#define MAX_GEN 320

struct seq {
    struct kvq_grammar *g;
    struct kvq_sampler *smp;
    struct kvq_detok *dt;
    char *text;
    size_t len;
    int schema, n_gen, batch_pos;
    bool done, by_grammar;
};

static void add_text(struct seq *s, const char *p, int n) {
    if (n <= 0) return;
    s->text = realloc(s->text, s->len + (size_t)n + 1);
    memcpy(s->text + s->len, p, (size_t)n);
    s->len += (size_t)n;
    s->text[s->len] = '\0';
}

int main(void) {
    if (system("python3 -c 'import jsonschema' 2>/dev/null") != 0) {
        printf("SKIP: python3 with jsonschema (Debian's python3-jsonschema) is not installed\n");
        return 77;
    }
    const char *model_path = require_shared("models/tinydoc-f16.gguf");
    json_error_t jerr;
    json_t *schemas = json_load_file(KVQ_SOURCE_DIR "/tests/fixtures/json_schemas.json", 0, &jerr);
    CHECK(json_is_array(schemas), "fixtures: %s", jerr.text);
    if (!schemas) return check_finish();
    const int n_schemas = (int)json_array_size(schemas), n_seq = n_schemas * SEEDS;
    CHECK(n_schemas >= 30, "at least 30 schemas (%d)", n_schemas);
    struct kvq_model *m = kvq_model_load(model_path);
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return check_finish();
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 384;
    cp.n_seq = n_seq;
    cp.n_batch = 2048;
    cp.n_threads = 2;
    struct kvq_context *ctx = kvq_context_new(m, &cp);
    CHECK(ctx != NULL, "context: %s", kvq_last_error());

    const char *prompt = "The configuration is written as JSON:\n";
    kvq_token ptok[64];
    const int n_prompt = kvq_tokenize(m, prompt, strlen(prompt), true, false, ptok, 64);
    struct seq *seqs = calloc((size_t)n_seq, sizeof *seqs);
    kvq_token *tok = malloc(sizeof *tok * (size_t)(n_seq * n_prompt));
    int32_t *sid = malloc(sizeof *sid * (size_t)(n_seq * n_prompt));
    bool *want = malloc(sizeof *want * (size_t)(n_seq * n_prompt));
    int n = 0;
    for (int i = 0; i < n_seq; i++) {
        struct seq *s = &seqs[i];
        s->schema = i / SEEDS;
        char *text = json_dumps(json_array_get(schemas, (size_t)s->schema), JSON_COMPACT);
        s->g = kvq_grammar_from_json_schema(m, text, strlen(text), NULL, NULL);
        CHECK(s->g != NULL, "schema %d: %s", s->schema, kvq_last_error());
        free(text);
        struct kvq_sampler_params sp;
        kvq_sampler_params_default(&sp);
        sp.temp = 0.9f;
        sp.seed = 1000 + (uint64_t)i;
        s->smp = kvq_sampler_new(&sp, info.n_vocab);
        s->dt = kvq_detok_new(m);
        if (!s->g) {
            s->done = true;
            continue;
        }
        kvq_sampler_set_grammar(s->smp, s->g);
        for (int j = 0; j < n_prompt; j++, n++) {
            tok[n] = ptok[j];
            sid[n] = i;
            want[n] = j == n_prompt - 1;
            if (want[n]) s->batch_pos = n;
        }
    }
    for (int step = 0; n > 0 && step <= MAX_GEN; step++) {
        struct kvq_batch b = {.n_tokens = n, .tokens = tok, .seq_ids = sid, .logits = want};
        if (kvq_decode(ctx, &b) != 0) {
            CHECK(false, "decode: %s", kvq_last_error());
            break;
        }
        n = 0;
        for (int i = 0; i < n_seq; i++) {
            struct seq *s = &seqs[i];
            if (s->done) continue;
            kvq_token t = kvq_sampler_sample(s->smp, kvq_get_logits(ctx, s->batch_pos));
            CHECK(kvq_grammar_accept(s->g, t) == 0, "seq %d: sampled token %d refused: %s", i, t, kvq_last_error());
            char piece[256];
            if (kvq_token_is_eog(m, t)) s->done = s->by_grammar = true;
            else add_text(s, piece, kvq_detok_feed(s->dt, t, piece, sizeof piece));
            s->n_gen++;
            if (!s->done && kvq_grammar_done(s->g)) s->done = s->by_grammar = true;
            if (!s->done && s->n_gen >= MAX_GEN) s->done = true;
            if (s->done) {
                add_text(s, piece, kvq_detok_flush(s->dt, piece, sizeof piece));
                continue;
            }
            tok[n] = t;
            sid[n] = i;
            want[n] = true;
            s->batch_pos = n++;
        }
    }
    /* the outputs, one [schema index, text] a line, for the validator */
    char path[] = "/tmp/kvq-grammar-gen-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    int finished = 0;
    for (int i = 0; i < n_seq; i++) {
        struct seq *s = &seqs[i];
        if (!s->by_grammar) /* a value the schema leaves unbounded (a string, a recursion) may run on */
            printf("schema %d seed %d reached the token limit: %.120s...\n", s->schema, i % SEEDS, s->text ? s->text : "");
        finished += s->by_grammar;
        json_t *line = json_pack("[i, s]", s->schema, s->text ? s->text : "");
        char *lt = json_dumps(line, JSON_COMPACT);
        if (s->by_grammar) fprintf(f, "%s\n", lt); /* (a truncated value is not complete) */
        if (i < 6 || getenv("KVQ_TEST_VERBOSE")) printf("schema %d: %s\n", s->schema, s->text ? s->text : "");
        free(lt);
        json_decref(line);
        kvq_grammar_free(s->g);
        kvq_sampler_free(s->smp);
        kvq_detok_free(s->dt);
        free(s->text);
    }
    fclose(f);
    printf("%d of %d outputs ended by their grammar\n", finished, n_seq);
    CHECK(finished * 10 >= n_seq * 9, "most outputs end by their grammar: %d of %d", finished, n_seq);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "python3 - '%s' '%s' <<'PY'\n"
             "import json, sys, jsonschema\n"
             "schemas = json.load(open(sys.argv[1]))\n"
             "bad = 0; n = 0\n"
             "for line in open(sys.argv[2]):\n"
             "    i, text = json.loads(line); n += 1\n"
             "    try:\n"
             "        jsonschema.validate(json.loads(text), schemas[i])\n"
             "    except Exception as e:\n"
             "        bad += 1; print('INVALID schema %%d: %%r: %%s' %% (i, text, str(e).splitlines()[0]))\n"
             "print('jsonschema: %%d of %%d outputs valid' %% (n - bad, n))\n"
             "sys.exit(1 if bad else 0)\n"
             "PY",
             KVQ_SOURCE_DIR "/tests/fixtures/json_schemas.json", path);
    fflush(stdout);
    CHECK(system(cmd) == 0, "every output validates with jsonschema");
    unlink(path);
    free(seqs);
    free(tok);
    free(sid);
    free(want);
    json_decref(schemas);
    kvq_context_free(ctx);
    kvq_model_free(m);
    return check_finish();
}
