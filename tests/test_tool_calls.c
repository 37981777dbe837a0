/* Tool calls in the model's own syntax: the syntax a template shows, calls parsed
 * out of text (and text that is not a call left as content), the schema that forces
 * a call (checked by compiling it into a grammar and matching calls against it), the
 * stream's hold-back of a possible call, and earlier calls and results written into
 * the messages. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine/grammar.h"
#include "engine/json_schema.h"
#include "server/tool_calls.h"

static const struct tool_def tools[] = {
    {"get_weather",
     "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"unit\":{\"$ref\":\"#/$defs/unit\"}},"
     "\"required\":[\"city\",\"unit\"],\"$defs\":{\"unit\":{\"enum\":[\"c\",\"f\"]}}}",
     "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}"},
    {"noop", "{}", "{\"type\":\"function\",\"function\":{\"name\":\"noop\"}}"},
};

static int parse(enum tool_syntax s, const char *text, struct tool_call **c, size_t *content) {
    int n = -1;
    CHECK(tool_calls_parse(s, text, strlen(text), c, &n, content) == 0, "parse %s", text);
    return n;
}

static void test_parse(void) {
    struct tool_call *c;
    size_t content;
    int n = parse(TOOL_SYNTAX_HERMES,
                  "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": "
                  "\"c\"}}\n</tool_call>\n<tool_call>{\"name\":\"noop\",\"arguments\":\"{}\"}</tool_call>",
                  &c, &content);
    CHECK(n == 2 && content == 13 && !strcmp(c[0].name, "get_weather") &&
              !strcmp(c[0].arguments, "{\"city\":\"Paris\",\"unit\":\"c\"}") && !strcmp(c[1].name, "noop") &&
              !strcmp(c[1].arguments, "{}") && !strncmp(c[0].id, "call_", 5) && strcmp(c[0].id, c[1].id),
          "hermes: two calls after content");
    tool_calls_free(c, n);
    n = parse(TOOL_SYNTAX_HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}", &c, &content);
    CHECK(n == 1 && content == 0, "hermes: the closing tag may be cut by the end");
    tool_calls_free(c, n);
    static const char *const not_calls[] = {"no calls here", "<tool_call>\n{\"name\": 3}\n</tool_call>",
                                            "<tool_call>{\"name\":\"f\",\"arguments\":[1]}</tool_call>",
                                            "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call> trailing text",
                                            "<tool_call>{broken"};
    for (size_t i = 0; i < sizeof not_calls / sizeof *not_calls; i++) {
        n = parse(TOOL_SYNTAX_HERMES, not_calls[i], &c, &content);
        CHECK(n == 0 && content == strlen(not_calls[i]) && !c, "not a call: %s", not_calls[i]);
    }
    n = parse(TOOL_SYNTAX_LLAMA3, " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}\n", &c, &content);
    CHECK(n == 1 && content == 0 && !strcmp(c[0].arguments, "{\"city\":\"Oslo\"}"), "llama3 call");
    tool_calls_free(c, n);
    n = parse(TOOL_SYNTAX_LLAMA3, "{\"answer\": 42}", &c, &content);
    CHECK(n == 0 && content == 14, "llama3: JSON that is no call is content");
    n = parse(TOOL_SYNTAX_MISTRAL, "[TOOL_CALLS][{\"name\":\"a\",\"arguments\":{}},{\"name\":\"b\",\"arguments\":{\"x\":1}}]",
              &c, &content);
    CHECK(n == 2 && !strcmp(c[1].name, "b") && !strcmp(c[1].arguments, "{\"x\":1}"), "mistral calls");
    tool_calls_free(c, n);
    n = parse(TOOL_SYNTAX_MISTRAL, "[{\"name\":\"a\",\"arguments\":{}}]", &c, &content);
    CHECK(n == 1, "mistral: the control token's text may be missing");
    tool_calls_free(c, n);
}

/* The forced-call schema accepts a call and refuses others. */
static int schema_accepts(enum tool_syntax s, const char *only, const char *text) {
    const char *prefix, *suffix, *err;
    char *schema = tool_call_schema(s, tools, 2, only, &prefix, &suffix, &err);
    if (!schema) return -1;
    struct grammar *g = grammar_new();
    int root = json_schema_compile(g, schema, strlen(schema), prefix, suffix), ok = -1;
    if (root >= 0 && grammar_start(g, root) == 0)
        ok = grammar_accept_bytes(g, text, strlen(text)) == 0 && grammar_accepting(g);
    grammar_free(g);
    free(schema);
    return ok;
}

static void test_schema(void) {
    const char *weather = "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\",\"unit\":\"f\"}}";
    char hermes[256];
    snprintf(hermes, sizeof hermes, "<tool_call>\n%s\n</tool_call>", weather);
    CHECK(schema_accepts(TOOL_SYNTAX_HERMES, NULL, hermes) == 1, "hermes call");
    CHECK(schema_accepts(TOOL_SYNTAX_HERMES, NULL, "<tool_call>\n{\"name\":\"noop\",\"arguments\":{}}\n</tool_call>") == 1,
          "the other tool");
    CHECK(schema_accepts(TOOL_SYNTAX_HERMES, "noop", hermes) == 0, "named: only that function");
    CHECK(schema_accepts(TOOL_SYNTAX_HERMES, NULL, weather) == 0, "hermes needs its tags");
    CHECK(schema_accepts(TOOL_SYNTAX_HERMES, NULL,
                         "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\",\"unit\":\"k\"}}\n</tool_call>") == 0,
          "arguments follow the parameters (a $ref hoisted)");
    CHECK(schema_accepts(TOOL_SYNTAX_LLAMA3, "get_weather",
                         "{\"name\":\"get_weather\",\"parameters\":{\"city\":\"Rome\",\"unit\":\"c\"}}") == 1, "llama3 call");
    char mistral[256];
    snprintf(mistral, sizeof mistral, "[%s, {\"name\":\"noop\",\"arguments\":{}}]", weather);
    CHECK(schema_accepts(TOOL_SYNTAX_MISTRAL, NULL, mistral) == 1, "mistral list of calls");
    const char *prefix, *suffix, *err;
    CHECK(!tool_call_schema(TOOL_SYNTAX_HERMES, tools, 2, "nope", &prefix, &suffix, &err) && err, "unknown name");
}

static void test_stream(void) {
    static const struct {
        enum tool_syntax s;
        const char *text;
        size_t safe;
    } cases[] = {
        {TOOL_SYNTAX_HERMES, "Hello there", 11},     {TOOL_SYNTAX_HERMES, "Hello <tool", 6},
        {TOOL_SYNTAX_HERMES, "Hi <tool_call>\n{", 3}, {TOOL_SYNTAX_HERMES, "a < b", 5},
        {TOOL_SYNTAX_LLAMA3, "  {\"name\"", 0},        {TOOL_SYNTAX_LLAMA3, "The answer", 10},
        {TOOL_SYNTAX_LLAMA3, "  ", 0},                 {TOOL_SYNTAX_MISTRAL, "[TOOL_CALLS][", 0},
        {TOOL_SYNTAX_MISTRAL, "Sure", 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        CHECK(tool_stream_safe(cases[i].s, cases[i].text, strlen(cases[i].text)) == cases[i].safe, "stream '%s'",
              cases[i].text);
}

static void test_messages(void) {
    json_t *m = json_loads("[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Weather?\"},"
                           "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":"
                           "\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":"
                           "\"{\\\"city\\\":\\\"Rome\\\"}\"}}]},{\"role\":\"tool\",\"content\":\"{\\\"t\\\":21}\"}]",
                           0, NULL);
    CHECK(m, "messages parse");
    json_t *out = tool_messages(TOOL_SYNTAX_HERMES, m, tools, 2);
    CHECK(json_array_size(out) == 4, "four messages");
#define ROLE(o, i) json_string_value(json_object_get(json_array_get(o, i), "role"))
#define TEXT(o, i) json_string_value(json_object_get(json_array_get(o, i), "content"))
    if (json_array_size(out) == 4) {
        CHECK(!strcmp(ROLE(out, 0), "system") && !strncmp(TEXT(out, 0), "Be brief.\n\n# Tools", 18) &&
                  strstr(TEXT(out, 0), "<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}\n"),
              "tools in the system message: %s", TEXT(out, 0));
        CHECK(!strcmp(TEXT(out, 2), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Rome\"}}\n</tool_call>") &&
                  !json_object_get(json_array_get(out, 2), "tool_calls"),
              "the call as the model writes it: %s", TEXT(out, 2));
        CHECK(!strcmp(ROLE(out, 3), "user") && !strcmp(TEXT(out, 3), "<tool_response>\n{\"t\":21}\n</tool_response>"),
              "the result: %s", TEXT(out, 3));
    }
    json_decref(out);
    json_array_remove(m, 0);
    out = tool_messages(TOOL_SYNTAX_LLAMA3, m, NULL, 0);
    CHECK(json_array_size(out) == 3 && !strcmp(TEXT(out, 1), "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Rome\"}}") &&
              !strcmp(ROLE(out, 2), "ipython"),
          "llama3 call and result");
#undef ROLE
#undef TEXT
    json_decref(out);
    json_decref(m);
}

int main(void) {
    CHECK(tool_syntax_detect("{% if tools %}<tool_call>{% endif %}<|im_start|>") == TOOL_SYNTAX_HERMES, "qwen");
    CHECK(tool_syntax_detect("[INST] [TOOL_CALLS] [AVAILABLE_TOOLS]") == TOOL_SYNTAX_MISTRAL, "mistral");
    CHECK(tool_syntax_detect("<|start_header_id|> \"parameters\": d") == TOOL_SYNTAX_LLAMA3, "llama 3.1");
    CHECK(tool_syntax_detect("<|start_header_id|>{{ m.content }}<|eot_id|>") == TOOL_SYNTAX_LLAMA3, "llama 3");
    CHECK(tool_syntax_detect("<|user|>{{ m.content }}<|end|>") == TOOL_SYNTAX_HERMES, "the default");
    CHECK(tool_syntax_detect(NULL) == TOOL_SYNTAX_HERMES, "no template");
    test_parse();
    test_schema();
    test_stream();
    test_messages();
    return check_finish();
}
