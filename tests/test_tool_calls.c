/* Tool calls in the model's own syntax: the syntax a template shows, calls parsed
 * out of text (and text that is not a call left as content), the schema that forces
 * a call (checked by compiling it into a grammar and matching calls against it), the
 * stream's hold-back of a possible call, and earlier calls and results written into
 * the messages. */
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
    const struct chat_message m[] = {{"system", "Be brief."}, {"user", "Weather?"}, {"assistant", ""}, {"tool", "{\"t\":21}"}};
    char *calls[] = {NULL, NULL,
                     "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":"
                     "\"{\\\"city\\\":\\\"Rome\\\"}\"}}]",
                     NULL};
    int n, n_owned;
    char **owned;
    struct chat_message *out = tool_messages(TOOL_SYNTAX_HERMES, m, calls, 4, tools, 2, &n, &owned, &n_owned);
    CHECK(out && n == 4, "four messages");
    if (!out) return;
    CHECK(!strcmp(out[0].role, "system") && !strncmp(out[0].content, "Be brief.\n\n# Tools", 18) &&
              strstr(out[0].content, "<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}\n"),
          "tools in the system message: %s", out[0].content);
    CHECK(!strcmp(out[2].content, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Rome\"}}\n</tool_call>"),
          "the call as the model writes it: %s", out[2].content);
    CHECK(!strcmp(out[3].role, "user") && !strcmp(out[3].content, "<tool_response>\n{\"t\":21}\n</tool_response>"),
          "the result: %s", out[3].content);
    tool_messages_free(out, owned, n_owned);
    out = tool_messages(TOOL_SYNTAX_LLAMA3, m + 1, calls + 1, 3, NULL, 0, &n, &owned, &n_owned);
    CHECK(out && n == 3 && !strcmp(out[1].content, "{\"name\": \"get_weather\", \"parameters\": {\"city\":\"Rome\"}}") &&
              !strcmp(out[2].role, "ipython"),
          "llama3 call and result");
    if (out) tool_messages_free(out, owned, n_owned);
}

int main(void) {
    CHECK(tool_syntax_detect("{% if tools %}<tool_call>{% endif %}<|im_start|>", CHAT_CHATML) == TOOL_SYNTAX_HERMES, "qwen");
    CHECK(tool_syntax_detect("[INST] [TOOL_CALLS] [AVAILABLE_TOOLS]", CHAT_MISTRAL) == TOOL_SYNTAX_MISTRAL, "mistral");
    CHECK(tool_syntax_detect("<|start_header_id|> \"parameters\": d", CHAT_LLAMA3) == TOOL_SYNTAX_LLAMA3, "llama 3.1");
    CHECK(tool_syntax_detect(NULL, CHAT_LLAMA3) == TOOL_SYNTAX_LLAMA3, "llama 3 by family");
    CHECK(tool_syntax_detect(NULL, CHAT_ZEPHYR) == TOOL_SYNTAX_HERMES, "the default");
    test_parse();
    test_schema();
    test_stream();
    test_messages();
    return check_finish();
}
