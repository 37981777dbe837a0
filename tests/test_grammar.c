/* The grammar engine: JSON Schemas compiled to grammars that accept and refuse
 * given texts (the expectations are JSON Schema's and JSON's own rules), and token
 * masks over tinydoc's vocabulary equal to trying every token on its own. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine/engine_internal.h"
#include "engine/grammar.h"
#include "engine/json_schema.h"
#include "kvq.h"

/* 1 when the whole text is accepted and complete, 0 when refused or incomplete, -1
 * when the schema does not compile. */
static int matches(const char *schema, const char *prefix, const char *suffix, const char *text) {
    struct grammar *g = grammar_new();
    int root = json_schema_compile(g, schema, strlen(schema), prefix, suffix);
    int rc = -1;
    if (root >= 0 && grammar_start(g, root) == 0)
        rc = grammar_accept_bytes(g, text, strlen(text)) == 0 && grammar_accepting(g);
    grammar_free(g);
    return rc;
}

struct expect {
    const char *schema, *text;
    int want;
};

static const struct expect cases[] = {
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},\"required\":[\"a\"]}",
     "{\"a\":1}", 1},
    {NULL, "{\"a\": -12, \"b\": \"x\\\"y\\\\ \\u00e9 \\n\"}", 1},
    {NULL, "{\n  \"a\": 0,\n  \"b\": \"caf\xc3\xa9\"\n}", 1},
    {NULL, "{\"b\":\"x\"}", 0},      /* a is required */
    {NULL, "{\"a\":01}", 0},         /* no leading zeros */
    {NULL, "{\"a\":1,}", 0},         /* no trailing comma */
    {NULL, "{\"a\":1.5}", 0},        /* not an integer */
    {NULL, "{\"a\":1,\"c\":2}", 0},  /* undeclared property */
    {NULL, "{\"a\":1,\"b\":\"x\ny\"}", 0}, /* raw control character in a string */
    {NULL, "{\"a\":1,\"b\":\"\\q\"}", 0},  /* unknown escape */
    {NULL, "{\"a\":1", 0},           /* incomplete */
    {"{\"enum\":[\"red\",\"green\",3,null]}", "\"red\"", 1},
    {NULL, "3", 1},
    {NULL, "null", 1},
    {NULL, "\"blue\"", 0},
    {NULL, "4", 0},
    {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":2,\"maxItems\":3}", "[true,false]", 1},
    {NULL, "[true, false, true]", 1},
    {NULL, "[true]", 0},
    {NULL, "[true,true,true,true]", 0},
    {NULL, "[]", 0},
    {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}", "\"x\"", 1},
    {NULL, "-5", 1},
    {NULL, "true", 0},
    {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\","
     "\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\",\"kids\"],\"additionalProperties\":false}},"
     "\"$ref\":\"#/$defs/node\"}",
     "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[]},{\"v\":3,\"kids\":[{\"v\":4,\"kids\":[]}]}]}", 1},
    {NULL, "{\"v\":1,\"kids\":[{\"v\":2}]}", 0},
    {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", "\"ab\"", 1},
    {NULL, "\"abc\"", 1},
    {NULL, "\"\xc3\xa9\x31\"", 0}, /* bounded strings are ASCII: one byte a character */
    {NULL, "\"a\\nb\"", 0},         /* ... without escapes */
    {NULL, "\"a\"", 0},
    {NULL, "\"abcd\"", 0},
    {"{\"type\":\"string\",\"minLength\":2}", "\"ab cd\"", 1},
    {NULL, "\"a\"", 0},
    {"{\"type\":\"string\",\"maxLength\":0}", "\"\"", 1},
    {"{\"type\":\"number\"}", "1.5e10", 1},
    {NULL, "-0.25", 1},
    {NULL, "0", 1},
    {NULL, "1.", 0},
    {NULL, ".5", 0},
    {NULL, "01", 0},
    {NULL, "+1", 0},
    {"{\"const\":{\"k\":[1,2]}}", "{\"k\":[1,2]}", 1},
    {NULL, "{\"k\":[1,3]}", 0},
    {"{\"type\":\"object\"}", "{}", 1},
    {NULL, "{\"x\":{\"y\":[1,\"2\",null,true,{}]}}", 1},
    {NULL, "[]", 0},
    {NULL, "{\"x\":}", 0},
    {"{\"type\":[\"string\",\"null\"]}", "null", 1},
    {NULL, "\"a\"", 1},
    {NULL, "1", 0},
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"},\"b\":{\"type\":\"null\"},\"c\":{\"type\":\"integer\"}}}",
     "{}", 1},
    {NULL, "{\"b\":null}", 1},
    {NULL, "{\"a\":true,\"c\":2}", 1},
    {NULL, "{\"c\":2,\"a\":true}", 0}, /* the schema's order */
    {"{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}", "{\"x\":1,\"y\":2}", 1},
    {NULL, "{\"x\":\"1\"}", 0},
    {"true", "[1,{\"a\":\"b\"}]", 1},
    {"{\"type\":\"integer\",\"minimum\":3,\"maximum\":120}", "3", 1},
    {NULL, "50", 1},
    {NULL, "99", 1},
    {NULL, "120", 1},
    {NULL, "2", 0},
    {NULL, "121", 0},
    {NULL, "130", 0},
    {NULL, "-1", 0},
    {NULL, "1000", 0},
    {"{\"type\":\"integer\",\"exclusiveMinimum\":0}", "1", 1},
    {NULL, "12345678", 1},
    {NULL, "0", 0},
    {"{\"type\":\"integer\",\"maximum\":-5}", "-5", 1},
    {NULL, "-100", 1},
    {NULL, "-4", 0},
    {NULL, "0", 0},
    {"{\"type\":\"integer\",\"minimum\":-20,\"exclusiveMaximum\":7.5}", "-20", 1},
    {NULL, "-3", 1},
    {NULL, "0", 1},
    {NULL, "7", 1},
    {NULL, "-21", 0},
    {NULL, "8", 0},
    {NULL, "-0", 0},
    {"{\"type\":\"number\",\"minimum\":0}", "0.5", 1},
    {NULL, "3e2", 1},
    {NULL, "-1", 0},
};

static void test_accept_reject(void) {
    const char *schema = NULL;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].schema) schema = cases[i].schema;
        int got = matches(schema, NULL, NULL, cases[i].text);
        CHECK(got == cases[i].want, "schema %s text %s: got %d, want %d (%s)", schema, cases[i].text, got,
              cases[i].want, kvq_last_error());
    }
    const char *call = "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"f\"}},\"required\":[\"name\"]}";
    CHECK(matches(call, "<tool_call>\n", "\n</tool_call>", "<tool_call>\n{\"name\":\"f\"}\n</tool_call>") == 1, "prefix");
    CHECK(matches(call, "<tool_call>\n", "\n</tool_call>", "{\"name\":\"f\"}") == 0, "prefix required");
}

static void test_refused(void) {
    static const char *const bad[][2] = {
        {"{\"type\":\"string\",\"pattern\":\"a+\"}", "pattern"},
        {"{\"type\":\"number\",\"maximum\":3}", "bounds on numbers"},
        {"{\"type\":\"integer\",\"minimum\":3,\"maximum\":2}", "no integer"},
        {"{\"type\":\"integer\",\"multipleOf\":2}", "multipleOf"},
        {"{\"not\":{}}", "not"},
        {"{\"$ref\":\"#/$defs/missing\"}", "missing"},
        {"{\"$ref\":\"http://x/y\"}", "local"},
        {"{\"type\":\"frob\"}", "frob"},
        {"{\"type\":\"array\",\"maxItems\":-1}", "maxItems"},
        {"{\"allOf\":[{},{}]}", "allOf"},
        {"{\"enum\":[]}", "enum"},
        {"[1,2]", "schema"},
        {"{\"type\":", "invalid JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int got = matches(bad[i][0], NULL, NULL, "");
        CHECK(got == -1 && strstr(kvq_last_error(), bad[i][1]), "%s: got %d, error '%s'", bad[i][0], got,
              kvq_last_error());
    }
}

/* A schema whose grammar would pass the bounds is refused, not built. */
static void test_too_large(void) {
    const int n = 30000;
    char *s = malloc((size_t)n * 16 + 32), *p = s;
    p += sprintf(p, "{\"enum\":[");
    for (int i = 0; i < n; i++) p += sprintf(p, "%s\"value%05d\"", i ? "," : "", i);
    sprintf(p, "]}");
    int got = matches(s, NULL, NULL, "\"value00001\"");
    CHECK(got == -1 && strstr(kvq_last_error(), "too large"), "a 30000-value enum: %d '%s'", got, kvq_last_error());
    free(s);
}

static void test_done(void) {
    struct grammar *g = grammar_new();
    const char *s = "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\"}},\"required\":[\"n\"]}";
    int root = json_schema_compile(g, s, strlen(s), NULL, NULL);
    CHECK(root >= 0 && grammar_start(g, root) == 0, "compile");
    CHECK(grammar_accept_bytes(g, "{\"n\":12", 7) == 0 && !grammar_accepting(g), "open object not complete");
    CHECK(grammar_accept_bytes(g, "x", 1) == -1, "refused byte");
    CHECK(grammar_accept_bytes(g, "}", 1) == 0 && grammar_accepting(g) && !grammar_can_continue(g), "closed: done");
    grammar_free(g);
    g = grammar_new();
    s = "{\"type\":\"integer\"}";
    root = json_schema_compile(g, s, strlen(s), NULL, NULL);
    CHECK(grammar_start(g, root) == 0 && grammar_accept_bytes(g, "42", 2) == 0 && grammar_accepting(g) &&
              grammar_can_continue(g), "a number may go on");
    grammar_free(g);
}

/* The mask after a prefix equals trying each token's bytes after that prefix. */
static void test_masks(const struct kvq_model *m) {
    static const char *const schemas[] = {
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
        "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a b\",\"c\"]}}},\"required\":[\"name\",\"age\"]}",
        "{\"type\":\"object\"}",
        "{\"type\":\"array\",\"items\":{\"anyOf\":[{\"type\":\"string\",\"minLength\":3,\"maxLength\":6},"
        "{\"type\":\"string\",\"minLength\":2}]}}",
    };
    static const char *const prefixes[][6] = {
        {"", "{", "{\"na", "{\"name\": \"The ker", "{\"name\": \"x\\", "{\"name\":\"a\",\"age\":1"},
        {"", "{\"", "{\"k\": [1, \"x", "{\"k\":tr", "{\"k\":{}", "{\"a\":1}"},
        {"[\"", "[\"a", "[\"abcd", "[\"abcdef", "[\"abc\",\"", "[\"abc\",\"xyz"},
    };
    struct grammar_vocab *v = engine_grammar_vocab(m);
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    uint64_t *bits = malloc(sizeof *bits * (size_t)(info.n_vocab / 64 + 1));
    float *logits = malloc(sizeof *logits * (size_t)info.n_vocab);
    for (int si = 0; si < 3; si++)
        for (int pi = 0; pi < 6; pi++) {
            const char *s = schemas[si], *p = prefixes[si][pi];
            struct grammar *g = grammar_new();
            int root = json_schema_compile(g, s, strlen(s), NULL, NULL);
            CHECK(root >= 0 && grammar_start(g, root) == 0 && grammar_bind_vocab(g, v) == 0, "compile");
            CHECK(grammar_accept_bytes(g, p, strlen(p)) == 0, "prefix %s", p);
            const bool acc = grammar_accepting(g);
            int count = grammar_mask(g, bits), again = grammar_mask(g, bits); /* the second from the cache */
            int expect = 0, wrong = 0;
            for (int t = 0; t < info.n_vocab; t++) {
                const char *b;
                int n = grammar_vocab_token(v, t, &b);
                bool ok = kvq_token_is_eog(m, t) ? acc : false;
                if (n > 0) {
                    grammar_start(g, root);
                    ok = grammar_accept_bytes(g, p, strlen(p)) == 0 && grammar_accept_bytes(g, b, (size_t)n) == 0;
                }
                expect += ok;
                if (ok != (bool)(bits[t >> 6] >> (t & 63) & 1) && wrong++ < 5)
                    fprintf(stderr, "prefix %s token %d '%.*s': mask %d, alone %d\n", p, t, n, b, !ok, ok);
            }
            CHECK(wrong == 0 && count == expect && again == count, "schema %d prefix '%s': %d wrong, %d vs %d allowed",
                  si, p, wrong, count, expect);
            grammar_free(g);
        }
    /* through the public API: the forbidden logits become -inf */
    struct kvq_grammar *kg = kvq_grammar_from_json_schema(m, schemas[0], strlen(schemas[0]), NULL, NULL);
    CHECK(kg != NULL, "public compile: %s", kvq_last_error());
    for (int i = 0; i < info.n_vocab; i++) logits[i] = 1.0f;
    int allowed = kvq_grammar_apply(kg, logits), finite = 0;
    for (int i = 0; i < info.n_vocab; i++) finite += isfinite(logits[i]);
    CHECK(allowed == finite && allowed > 0, "apply: %d allowed, %d finite", allowed, finite);
    kvq_token t[64];
    const char *text = "{\"name\": \"x\", \"age\": 7}";
    int n = kvq_tokenize(m, text, strlen(text), false, false, t, 64);
    for (int i = 0; i < n; i++) CHECK(kvq_grammar_accept(kg, t[i]) == 0, "token %d", i);
    CHECK(kvq_grammar_done(kg), "done after the closing brace");
    CHECK(kvq_grammar_accept(kg, t[0]) == -1, "nothing after the end");
    CHECK(kvq_grammar_accept(kg, kvq_token_eos(m)) == 0, "EOS once complete");
    kvq_grammar_free(kg);
    CHECK(kvq_grammar_from_json_schema(m, "{\"pattern\":\"x\"}", 15, NULL, NULL) == NULL &&
              strstr(kvq_last_error(), "pattern"), "public compile error");
    free(bits);
    free(logits);
}

/* The sampler draws only what the grammar allows whatever else applies: bans alone
 * (ignore_eos, min_tokens: the path that draws from the logits without adjusting
 * them), then a bias of +100 on the likeliest forbidden token and penalties. Greedy
 * takes the best allowed token that is not banned (found here by a plain scan). */
static void test_sampler_masked(const struct kvq_model *m) {
    const char *schema = "{\"enum\":[\"kernel\",\"keyboard\",\"true\",1234,[5]]}";
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    const int nv = info.n_vocab;
    float *logits = malloc(sizeof *logits * (size_t)nv), *masked = malloc(sizeof *masked * (size_t)nv);
    uint64_t z = 42;
    for (int i = 0; i < nv; i++) {
        z = z * 6364136223846793005ull + 1442695040888963407ull;
        logits[i] = (float)(z >> 40) / (float)(1 << 24) * 8 - 4;
    }
    struct kvq_grammar *kg = kvq_grammar_from_json_schema(m, schema, strlen(schema), NULL, NULL);
    CHECK(kg != NULL, "compile: %s", kvq_last_error());
    if (!kg) return;
    memcpy(masked, logits, sizeof *masked * (size_t)nv);
    const int n_allowed = kvq_grammar_apply(kg, masked);
    kvq_token best = -1, second = -1, forbidden = -1;
    for (int i = 0; i < nv; i++) {
        if (!isfinite(masked[i])) {
            if (forbidden < 0 || logits[i] > logits[forbidden]) forbidden = i;
        } else if (best < 0 || masked[i] > masked[best]) {
            second = best;
            best = i;
        } else if (second < 0 || masked[i] > masked[second]) {
            second = i;
        }
    }
    CHECK(n_allowed > 2 && n_allowed < nv / 2 && second >= 0 && logits[forbidden] > logits[best],
          "%d tokens allowed; a forbidden one ahead of them", n_allowed);
    const kvq_token ban[2] = {best, kvq_token_eos(m)}, bias_id[1] = {forbidden};
    const float bias[1] = {100};
    for (int mode = 0; mode < 4; mode++) {
        struct kvq_sampler_params p;
        kvq_sampler_params_default(&p);
        p.temp = mode % 2 ? 1.0f : 0.0f;
        p.top_k = 0, p.top_p = 1, p.min_p = 0, p.repeat_penalty = 1;
        int bad = 0, not_second = 0;
        for (int seed = 0; seed < 64; seed++) {
            p.seed = (uint64_t)seed;
            struct kvq_sampler *s = kvq_sampler_new(&p, nv);
            kvq_sampler_set_grammar(s, kg);
            kvq_sampler_ban(s, ban, 2);
            if (mode >= 2) {
                kvq_sampler_set_logit_bias(s, bias_id, bias, 1);
                kvq_sampler_set_penalties(s, 0.5f, 0.5f);
                kvq_sampler_accept_output(s, forbidden);
            }
            const kvq_token t = kvq_sampler_sample(s, logits);
            bad += !isfinite(masked[t]) || t == best;
            not_second += p.temp == 0 && t != second;
            kvq_sampler_free(s);
        }
        CHECK(bad == 0 && not_second == 0, "mode %d: %d draws forbidden or banned, %d greedy draws not token %d", mode,
              bad, not_second, second);
    }
    kvq_grammar_free(kg);
    free(logits);
    free(masked);
}

int main(void) {
    test_accept_reject();
    test_refused();
    test_too_large();
    test_done();
    const char *path = shared_path("models/tinydoc-f16.gguf");
    if (!path) printf("note: ../shared/models/tinydoc-f16.gguf missing: token masks not tested\n");
    else {
        struct kvq_model *m = kvq_model_load_vocab(path);
        CHECK(m != NULL, "load %s", kvq_last_error());
        if (m) test_masks(m);
        if (m) test_sampler_masked(m);
        kvq_model_free(m);
    }
    return check_finish();
}
