#include "server/tool_calls.h"

#include <ctype.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/strbuf.h"

enum tool_syntax tool_syntax_detect(const char *t) {
    if (!t || strstr(t, "<tool_call>")) return TOOL_SYNTAX_HERMES;
    if (strstr(t, "[TOOL_CALLS]")) return TOOL_SYNTAX_MISTRAL;
    /* Llama 3.1's JSON calls; Llama 3's own template has none, and its models take them best */
    if (strstr(t, "<|python_tag|>") || strstr(t, "<|start_header_id|>")) return TOOL_SYNTAX_LLAMA3;
    return TOOL_SYNTAX_HERMES;
}

const char *tool_syntax_name(enum tool_syntax s) {
    return s == TOOL_SYNTAX_LLAMA3 ? "llama3-json" : s == TOOL_SYNTAX_MISTRAL ? "mistral" : "hermes";
}

/* ---- the prompt ---- */

/* The tools as the syntax's templates describe them (Qwen 2.5's words for Hermes,
 * Llama 3.1's for its JSON calls). */
static void describe_tools(struct strbuf *b, enum tool_syntax s, const struct tool_def *tools, int n) {
    switch (s) {
    case TOOL_SYNTAX_HERMES:
        strbuf_add(b, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>");
        for (int i = 0; i < n; i++) strbuf_printf(b, "\n%s", tools[i].json);
        strbuf_add(b, "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                      "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                      "\"arguments\": <args-json-object>}\n</tool_call>");
        break;
    case TOOL_SYNTAX_LLAMA3:
        strbuf_add(b, "You have access to the following functions. To call a function, please respond with JSON for a "
                      "function call. Respond in the format {\"name\": function name, \"parameters\": dictionary of "
                      "argument name and its value}. Do not use variables.");
        for (int i = 0; i < n; i++) strbuf_printf(b, "\n\n%s", tools[i].json);
        break;
    case TOOL_SYNTAX_MISTRAL:
        strbuf_add(b, "[AVAILABLE_TOOLS][");
        for (int i = 0; i < n; i++) strbuf_printf(b, "%s%s", i ? ", " : "", tools[i].json);
        strbuf_add(b, "][/AVAILABLE_TOOLS]");
        break;
    }
}

/* An assistant message's calls (OpenAI's tool_calls list) as the model writes them. */
static void write_calls(struct strbuf *b, enum tool_syntax s, const json_t *calls) {
    size_t i;
    json_t *c;
    if (s == TOOL_SYNTAX_MISTRAL) strbuf_add(b, "[TOOL_CALLS][");
    json_array_foreach(calls, i, c) {
        json_t *fn = json_object_get(c, "function"), *args = json_object_get(fn, "arguments");
        json_t *parsed = json_is_string(args) ? json_loads(json_string_value(args), JSON_DECODE_ANY, NULL) : NULL;
        json_t *value = parsed ? parsed : args;
        char *a = value ? json_dumps(value, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
        json_decref(parsed);
        char *n = json_dumps(json_object_get(fn, "name"), JSON_ENCODE_ANY);
        if (s == TOOL_SYNTAX_HERMES)
            strbuf_printf(b, "%s<tool_call>\n{\"name\": %s, \"arguments\": %s}\n</tool_call>", i || b->len ? "\n" : "",
                          n ? n : "\"\"", a ? a : "{}");
        else
            strbuf_printf(b, "%s{\"name\": %s, \"%s\": %s}", i ? (s == TOOL_SYNTAX_MISTRAL ? ", " : "; ") : "",
                          n ? n : "\"\"", s == TOOL_SYNTAX_LLAMA3 ? "parameters" : "arguments", a ? a : "{}");
        free(a);
        free(n);
    }
    if (s == TOOL_SYNTAX_MISTRAL) strbuf_add(b, "]");
}

/* A message of role and content (a new reference; content is taken). */
static json_t *message(const char *role, char *content) {
    json_t *m = content ? json_pack("{s:s,s:s}", "role", role, "content", content) : NULL;
    free(content);
    return m;
}

json_t *tool_messages(enum tool_syntax s, const json_t *messages, const struct tool_def *tools, int n_tools) {
    json_t *out = json_array();
    size_t i = 0, n = json_array_size(messages);
    bool oom = !out;
    if (!oom && n_tools > 0) {
        struct strbuf b = {0};
        const json_t *m0 = json_array_get(messages, 0);
        const char *sys = json_string_value(json_object_get(m0, "role"));
        const bool has_system = sys && !strcmp(sys, "system");
        const char *text = has_system ? json_string_value(json_object_get(m0, "content")) : NULL;
        if (text && *text) strbuf_printf(&b, "%s\n\n", text);
        describe_tools(&b, s, tools, n_tools);
        oom |= json_array_append_new(out, message("system", strbuf_take(&b))) != 0;
        i = has_system;
    }
    for (; i < n && !oom; i++) {
        json_t *m = json_array_get(messages, i), *calls = json_object_get(m, "tool_calls");
        const char *role = json_string_value(json_object_get(m, "role"));
        const char *text = json_string_value(json_object_get(m, "content"));
        struct strbuf b = {0};
        json_t *w;
        if (!strcmp(role, "assistant") && json_array_size(calls) > 0) {
            strbuf_add(&b, text ? text : "");
            write_calls(&b, s, calls);
            w = message("assistant", strbuf_take(&b));
        } else if (!strcmp(role, "tool")) {
            if (s == TOOL_SYNTAX_HERMES) strbuf_printf(&b, "<tool_response>\n%s\n</tool_response>", text ? text : "");
            else if (s == TOOL_SYNTAX_LLAMA3) strbuf_add(&b, text ? text : "");
            else strbuf_printf(&b, "[TOOL_RESULTS]%s[/TOOL_RESULTS]", text ? text : "");
            w = message(s == TOOL_SYNTAX_LLAMA3 ? "ipython" : "user", strbuf_take(&b));
        } else
            w = json_pack("{s:s,s:s}", "role", role, "content", text ? text : "");
        oom |= json_array_append_new(out, w) != 0;
    }
    if (oom) {
        json_decref(out);
        return NULL;
    }
    return out;
}

/* ---- the grammar of a call ---- */

/* Moves a parameters schema's $defs / definitions into the call schema's root, where
 * its "#/$defs/..." references now point. */
static void hoist_defs(json_t *params, json_t *root) {
    static const char *const keys[] = {"$defs", "definitions"};
    for (int i = 0; i < 2; i++) {
        json_t *d = json_object_get(params, keys[i]);
        if (!json_is_object(d)) continue;
        json_t *into = json_object_get(root, keys[i]);
        if (!into) json_object_set_new(root, keys[i], into = json_object());
        json_object_update(into, d);
        json_object_del(params, keys[i]);
    }
}

char *tool_call_schema(enum tool_syntax s, const struct tool_def *tools, int n_tools, const char *only,
                       const char **prefix, const char **suffix, const char **err) {
    json_t *root = json_object(), *alts = json_array();
    const char *args_key = s == TOOL_SYNTAX_LLAMA3 ? "parameters" : "arguments";
    *err = NULL;
    for (int i = 0; i < n_tools && !*err; i++) {
        if (only && strcmp(only, tools[i].name)) continue;
        json_t *params = json_loads(tools[i].parameters, 0, NULL);
        if (!json_is_object(params)) {
            *err = "a tool's 'parameters' must be a JSON Schema object";
            json_decref(params);
            break;
        }
        hoist_defs(params, root);
        if (json_object_size(params) == 0) json_object_set_new(params, "type", json_string("object"));
        json_array_append_new(alts, json_pack("{s:s, s:{s:{s:s}, s:o}, s:[s, s], s:b}", "type", "object", "properties",
                                              "name", "const", tools[i].name, args_key, params, "required", "name",
                                              args_key, "additionalProperties", 0));
    }
    if (!*err && json_array_size(alts) == 0) *err = "no tool has the name given in 'tool_choice'";
    char *text = NULL;
    if (!*err) {
        if (json_array_size(alts) == 1) json_object_update(root, json_array_get(alts, 0));
        else json_object_set(root, "anyOf", alts);
        if (s == TOOL_SYNTAX_MISTRAL) { /* a list of calls: the same root, one level down */
            json_t *list = json_pack("{s:s, s:O, s:i}", "type", "array", "items", root, "minItems", 1);
            static const char *const keys[] = {"$defs", "definitions"};
            for (int i = 0; i < 2; i++)
                if (json_object_get(root, keys[i])) {
                    json_object_set(list, keys[i], json_object_get(root, keys[i]));
                    json_object_del(root, keys[i]);
                }
            json_decref(root);
            root = list;
        }
        text = json_dumps(root, JSON_COMPACT);
        if (!text) *err = "out of memory";
    }
    json_decref(root);
    json_decref(alts);
    *prefix = s == TOOL_SYNTAX_HERMES ? "<tool_call>\n" : NULL;
    *suffix = s == TOOL_SYNTAX_HERMES ? "\n</tool_call>" : NULL;
    return text;
}

/* ---- calls out of text ---- */

static const char *skip_ws(const char *p, const char *end) {
    while (p < end && isspace((unsigned char)*p)) p++;
    return p;
}

static bool starts(const char *p, const char *end, const char *lit) {
    size_t n = strlen(lit);
    return (size_t)(end - p) >= n && !memcmp(p, lit, n);
}

static char *call_id(void) {
    static atomic_ullong counter;
    uint64_t z = (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull + atomic_fetch_add(&counter, 1) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    char id[40];
    snprintf(id, sizeof id, "call_%016llx%08x", (unsigned long long)(z ^ (z >> 29)), (unsigned)(z >> 7));
    return strdup(id);
}

/* One call object: its name and arguments (an object, or a string holding one). */
static int add_call(json_t *obj, struct tool_call **calls, int *n) {
    json_t *name = json_object_get(obj, "name"), *args = json_object_get(obj, "arguments");
    if (!args) args = json_object_get(obj, "parameters");
    json_t *parsed = json_is_string(args) ? json_loads(json_string_value(args), 0, NULL) : NULL;
    if (parsed) args = parsed;
    if (!json_is_string(name) || !json_is_object(args)) {
        json_decref(parsed);
        return 1;
    }
    struct tool_call *c = realloc(*calls, sizeof *c * (size_t)(*n + 1));
    if (!c) {
        json_decref(parsed);
        return -1;
    }
    *calls = c;
    c[*n] = (struct tool_call){call_id(), strdup(json_string_value(name)), json_dumps(args, JSON_COMPACT)};
    json_decref(parsed);
    (*n)++;
    return c[*n - 1].id && c[*n - 1].name && c[*n - 1].arguments ? 0 : -1;
}

/* A JSON value at p: it and where it ends, or NULL. */
static json_t *value_at(const char *p, const char *end, const char **after) {
    json_error_t e;
    json_t *v = json_loadb(p, (size_t)(end - p), JSON_DISABLE_EOF_CHECK, &e);
    if (v) *after = p + e.position;
    return v;
}

int tool_calls_parse(enum tool_syntax s, const char *text, size_t len, struct tool_call **calls, int *n_calls,
                     size_t *content_len) {
    const char *end = text + len, *p = text, *after;
    *calls = NULL;
    *n_calls = 0;
    *content_len = len;
    int rc = 0;
    if (s == TOOL_SYNTAX_HERMES) {
        const char *tag = "<tool_call>";
        p = memmem(text, len, tag, strlen(tag));
        if (!p) return 0;
        *content_len = (size_t)(p - text);
        while (rc == 0 && p && starts(p, end, tag)) {
            json_t *v = value_at(skip_ws(p + strlen(tag), end), end, &after);
            rc = v ? add_call(v, calls, n_calls) : 1;
            json_decref(v);
            if (rc) break;
            p = skip_ws(after, end);
            if (starts(p, end, "</tool_call>")) p = skip_ws(p + strlen("</tool_call>"), end);
        }
        if (rc == 0 && p < end) rc = 1; /* text after the calls: not what the syntax writes */
    } else {
        p = skip_ws(p, end);
        if (s == TOOL_SYNTAX_MISTRAL && starts(p, end, "[TOOL_CALLS]")) p = skip_ws(p + strlen("[TOOL_CALLS]"), end);
        json_t *v = value_at(p, end, &after);
        if (!v || skip_ws(after, end) != end) rc = 1;
        else if (s == TOOL_SYNTAX_MISTRAL && json_is_array(v)) {
            size_t i;
            json_t *c;
            json_array_foreach(v, i, c) if (rc == 0) rc = add_call(c, calls, n_calls);
            if (json_array_size(v) == 0) rc = 1;
        } else if (s == TOOL_SYNTAX_LLAMA3 && json_is_object(v)) {
            rc = add_call(v, calls, n_calls);
        } else {
            rc = 1;
        }
        json_decref(v);
        *content_len = 0;
    }
    if (rc) { /* not calls after all: plain content */
        tool_calls_free(*calls, *n_calls);
        *calls = NULL;
        *n_calls = 0;
        *content_len = len;
    }
    return rc < 0 ? -1 : 0;
}

void tool_calls_free(struct tool_call *calls, int n) {
    for (int i = 0; i < n; i++) {
        free(calls[i].id);
        free(calls[i].name);
        free(calls[i].arguments);
    }
    free(calls);
}

size_t tool_stream_safe(enum tool_syntax s, const char *text, size_t len) {
    if (s == TOOL_SYNTAX_HERMES) {
        static const char tag[] = "<tool_call>";
        const char *p = memmem(text, len, tag, sizeof tag - 1);
        if (p) return (size_t)(p - text);
        for (size_t k = sizeof tag - 2; k > 0; k--) /* a tail that may become the tag waits */
            if (k <= len && !memcmp(text + len - k, tag, k)) return len - k;
        return len;
    }
    /* a call is the whole answer: it starts with '{' (Llama 3) or '[' (Mistral) */
    const char *p = skip_ws(text, text + len);
    if (p == text + len) return 0;
    return *p == (s == TOOL_SYNTAX_LLAMA3 ? '{' : '[') ? 0 : len;
}
