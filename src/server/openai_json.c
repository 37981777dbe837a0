#include "server/openai_json.h"

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/strbuf.h"

void oai_error_set(struct oai_error *e, int status, const char *type, const char *param, const char *code,
                   const char *fmt, ...) {
    e->status = status;
    e->type = type;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

#define BAD(param, ...) (oai_error_set(e, 400, "invalid_request_error", param, NULL, __VA_ARGS__), -1)

/* A string value; strings holding NUL are refused by json_loadb already. */
static int get_string(json_t *v, const char *name, char **out, struct oai_error *e) {
    if (!json_is_string(v)) return BAD(name, "'%s' must be a string", name);
    free(*out);
    if (!(*out = strdup(json_string_value(v)))) return BAD(name, "out of memory");
    return 0;
}

static int get_number(json_t *v, const char *name, double lo, double hi, float *out, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    if (!json_is_number(v)) return BAD(name, "'%s' must be a number", name);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return BAD(name, "'%s' must be from %g to %g (got %g)", name, lo, hi, x);
    *out = (float)x;
    return 0;
}

static int get_int(json_t *v, const char *name, long long lo, long long hi, long long *out, struct oai_error *e) {
    if (!json_is_integer(v)) return BAD(name, "'%s' must be an integer", name);
    long long x = json_integer_value(v);
    if (x < lo || x > hi) return BAD(name, "'%s' must be from %lld to %lld (got %lld)", name, lo, hi, x);
    *out = x;
    return 0;
}

static int get_bool(json_t *v, const char *name, bool *out, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return BAD(name, "'%s' must be a boolean", name);
    *out = json_is_true(v);
    return 0;
}

static int get_stop(json_t *v, struct gen_params *g, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    json_t *one[1] = {v};
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > GEN_MAX_STOP) return BAD("stop", "'stop' holds at most %d strings", GEN_MAX_STOP);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_array(v) ? json_array_get(v, i) : one[0];
        if (!json_is_string(s)) return BAD("stop", "'stop' must be a string or a list of strings");
        if (json_string_length(s) == 0) return BAD("stop", "'stop' strings must not be empty");
        if (get_string(s, "stop", &g->stop[g->n_stop], e)) return -1;
        g->n_stop++;
    }
    return 0;
}

/* Message content: a string, or a list of {"type": "text", "text": ...} parts. */
static int get_content(json_t *v, char **out, struct oai_error *e) {
    if (json_is_null(v)) {
        free(*out);
        return (*out = strdup("")) ? 0 : BAD("messages", "out of memory");
    }
    if (json_is_string(v)) return get_string(v, "content", out, e);
    if (!json_is_array(v)) return BAD("messages", "message 'content' must be a string or a list of text parts");
    struct strbuf b = {0};
    size_t i;
    json_t *part;
    json_array_foreach(v, i, part) {
        json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0 || !json_is_string(text)) {
            strbuf_free(&b);
            return BAD("messages", "only text content parts are supported ({\"type\": \"text\", \"text\": ...})");
        }
        strbuf_add(&b, json_string_value(text));
    }
    free(*out);
    if (!(*out = strbuf_take(&b))) return BAD("messages", "out of memory");
    return 0;
}

/* The messages as the chat template sees them: each a copy of what was sent (tool
 * calls, tool_call_id, name and other fields kept) with "developer" read as
 * "system" and content made a string. */
static int get_messages(json_t *v, struct oai_request *r, struct oai_error *e) {
    if (!json_is_array(v) || json_array_size(v) == 0)
        return BAD("messages", "'messages' must be a non-empty list of messages");
    size_t n = json_array_size(v);
    if (n > 100000) return BAD("messages", "too many messages");
    if (!(r->messages = json_array())) return BAD("messages", "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m)) return BAD("messages", "messages[%zu] must be an object", i);
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) return BAD("messages", "messages[%zu].role must be a string", i);
        const char *rs = json_string_value(role);
        /* "developer" is OpenAI's newer name for the system role */
        if (!strcmp(rs, "developer")) rs = "system";
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "tool"))
            return BAD("messages", "messages[%zu].role '%s' is not supported (system, user, assistant, tool)", i, rs);
        json_t *calls = json_object_get(m, "tool_calls");
        if (calls && !json_is_null(calls) && (strcmp(rs, "assistant") || !json_is_array(calls)))
            return BAD("messages", "messages[%zu].tool_calls must be a list, on an assistant message", i);
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call) {
            json_t *fn = json_object_get(call, "function");
            if (!json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
                return BAD("messages", "messages[%zu].tool_calls[%zu] needs a function with a name", i, k);
        }
        /* an assistant turn of tool calls alone keeps its content null (or absent: null),
         * as templates test for it */
        json_t *c = json_object_get(m, "content");
        bool no_text = json_is_null(c) || (!c && json_array_size(calls) > 0);
        char *content = NULL;
        if (!no_text && get_content(c, &content, e)) {
            free(content);
            return -1;
        }
        json_t *copy = json_deep_copy(m);
        json_t *text = no_text ? json_null() : json_string(content);
        free(content);
        if (!copy || !text || json_object_set_new(copy, "role", json_string(rs)) ||
            json_object_set_new(copy, "content", text) || json_array_append_new(r->messages, copy)) {
            json_decref(copy);
            return BAD("messages", "out of memory");
        }
    }
    return 0;
}

/* A list of token ids (non-empty, each >= 0; the vocabulary is checked where it is known). */
static int get_ids(json_t *v, const char *name, int max, kvq_token **out, int *n_out, struct oai_error *e) {
    size_t n = json_array_size(v);
    if (!json_is_array(v) || n == 0) return BAD(name, "'%s' must be a non-empty list of token ids", name);
    if (n > (size_t)max) return BAD(name, "'%s' holds at most %d token ids", name, max);
    kvq_token *ids = malloc(sizeof *ids * n);
    if (!ids) return BAD(name, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            free(ids);
            return BAD(name, "'%s' must hold token ids (integers >= 0)", name);
        }
        ids[i] = (kvq_token)json_integer_value(x);
    }
    free(*out);
    *out = ids;
    *n_out = (int)n;
    return 0;
}

/* prompt (or input): a string, a list of strings, a list of token ids, or a list of such lists. */
static int get_prompts(json_t *v, const char *name, struct oai_prompt **out, int *n_out, struct oai_error *e) {
    bool many = json_is_array(v) && json_array_size(v) > 0 &&
                (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0)));
    size_t n = many ? json_array_size(v) : 1;
    if (!json_is_string(v) && !json_is_array(v))
        return BAD(name, "'%s' must be a string, a list of strings, a list of token ids or a list of lists of them", name);
    if (n > OAI_MAX_PROMPTS) return BAD(name, "'%s' holds at most %d prompts", name, OAI_MAX_PROMPTS);
    if (!(*out = calloc(n, sizeof **out))) return BAD(name, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *p = many ? json_array_get(v, i) : v;
        struct oai_prompt *o = &(*out)[(*n_out)++];
        if (json_is_string(p)) {
            if (get_string(p, name, &o->text, e)) return -1;
        } else if (json_is_array(p) && (!many || !json_is_array(json_array_get(p, 0)))) {
            if (get_ids(p, name, 1 << 24, &o->ids, &o->n_ids, e)) return -1;
        } else {
            return BAD(name, "'%s' must be a string, a list of strings, a list of token ids or a list of lists of them",
                       name);
        }
        if (many && json_is_string(p) != json_is_string(json_array_get(v, 0)))
            return BAD(name, "'%s' must not mix strings and token ids", name);
    }
    return 0;
}

static void prompts_free(struct oai_prompt *p, int n) {
    for (int i = 0; i < n; i++) {
        free(p[i].text);
        free(p[i].ids);
    }
    free(p);
}

/* logit_bias: OpenAI's {"token id": bias}, or llama.cpp's [[id, bias], ...] where a bias
 * of false bans the token. Biases from -100 to 100. */
static int get_logit_bias(json_t *v, struct gen_params *g, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    const char *shape = "'logit_bias' must map token ids to numbers from -100 to 100";
    size_t n = json_is_object(v) ? json_object_size(v) : json_array_size(v);
    if (!json_is_object(v) && !json_is_array(v)) return BAD("logit_bias", "%s", shape);
    if (n > 65536) return BAD("logit_bias", "'logit_bias' holds at most 65536 tokens");
    if (n == 0) return 0;
    g->bias_ids = malloc(sizeof *g->bias_ids * n);
    g->bias_values = malloc(sizeof *g->bias_values * n);
    if (!g->bias_ids || !g->bias_values) return BAD("logit_bias", "out of memory");
    const char *k;
    json_t *b, *pair;
    size_t i;
    if (json_is_object(v)) json_object_foreach(v, k, b) {
            char *end;
            long id = strtol(k, &end, 10);
            if (!*k || *end || id < 0 || id > INT32_MAX) return BAD("logit_bias", "%s ('%.32s' is not a token id)", shape, k);
            if (!json_is_number(b) || fabs(json_number_value(b)) > 100) return BAD("logit_bias", "%s", shape);
            g->bias_ids[g->n_bias] = (kvq_token)id;
            g->bias_values[g->n_bias++] = (float)json_number_value(b);
        }
    else json_array_foreach(v, i, pair) {
            json_t *id = json_array_get(pair, 0);
            b = json_array_get(pair, 1);
            if (json_array_size(pair) != 2 || !json_is_integer(id) || json_integer_value(id) < 0 ||
                json_integer_value(id) > INT32_MAX || !(json_is_false(b) || (json_is_number(b) && fabs(json_number_value(b)) <= 100)))
                return BAD("logit_bias", "%s (or a list of [id, bias] pairs, false to ban)", shape);
            g->bias_ids[g->n_bias] = (kvq_token)json_integer_value(id);
            g->bias_values[g->n_bias++] = json_is_false(b) ? -INFINITY : (float)json_number_value(b);
        }
    return 0;
}

/* The JSON types a field may have (null is always allowed: it means the default). */
enum { J_NUM = 1, J_INT = 2, J_BOOL = 4, J_STR = 8, J_ARR = 16, J_OBJ = 32 };

/* Fields of vLLM's and llama.cpp's APIs this server does not apply: checked for their
 * type, then ignored (and logged once). */
static const struct {
    const char *name;
    unsigned types;
} ignored_fields[] = {
    /* vLLM */
    {"use_beam_search", J_BOOL}, {"length_penalty", J_NUM}, {"include_stop_str_in_output", J_BOOL},
    {"skip_special_tokens", J_BOOL}, {"spaces_between_special_tokens", J_BOOL}, {"truncate_prompt_tokens", J_INT},
    {"prompt_logprobs", J_INT}, {"allowed_token_ids", J_ARR}, {"bad_words", J_ARR}, {"add_special_tokens", J_BOOL},
    {"add_generation_prompt", J_BOOL}, {"continue_final_message", J_BOOL}, {"documents", J_ARR},
    {"chat_template", J_STR}, {"chat_template_kwargs", J_OBJ}, {"mm_processor_kwargs", J_OBJ},
    {"guided_regex", J_STR}, {"guided_choice", J_ARR}, {"guided_grammar", J_STR},
    {"guided_decoding_backend", J_STR}, {"guided_whitespace_pattern", J_STR}, {"structured_outputs", J_OBJ},
    {"priority", J_INT}, {"request_id", J_STR}, {"return_tokens_as_token_ids", J_BOOL}, {"return_token_ids", J_BOOL},
    {"cache_salt", J_STR}, {"kv_transfer_params", J_OBJ}, {"vllm_xargs", J_OBJ}, {"logits_processors", J_ARR},
    {"echo", J_BOOL} /* chat's: prepend the last message */,
    /* llama.cpp */
    {"cache_prompt", J_BOOL}, {"n_keep", J_INT}, {"n_probs", J_INT}, {"min_keep", J_INT}, {"typical_p", J_NUM},
    {"tfs_z", J_NUM}, {"repeat_last_n", J_INT}, {"penalize_nl", J_BOOL}, {"mirostat", J_INT}, {"mirostat_tau", J_NUM},
    {"mirostat_eta", J_NUM}, {"dynatemp_range", J_NUM}, {"dynatemp_exponent", J_NUM}, {"dry_multiplier", J_NUM},
    {"dry_base", J_NUM}, {"dry_allowed_length", J_INT}, {"dry_penalty_last_n", J_INT},
    {"dry_sequence_breakers", J_ARR}, {"xtc_probability", J_NUM}, {"xtc_threshold", J_NUM}, {"top_n_sigma", J_NUM},
    {"samplers", J_ARR | J_STR}, {"grammar", J_STR}, {"id_slot", J_INT},
    {"t_max_predict_ms", J_INT}, {"t_max_prompt_ms", J_INT}, {"return_tokens", J_BOOL}, {"timings_per_token", J_BOOL},
    {"post_sampling_probs", J_BOOL}, {"response_fields", J_ARR}, {"lora", J_ARR}, {"n_indent", J_INT},
    {"n_cmpl", J_INT}, {"return_progress", J_BOOL}, {"reasoning_format", J_STR}, {"parse_tool_calls", J_BOOL},
    {"thinking_forced_open", J_BOOL}, {"image_data", J_ARR}, {"multimodal_data", J_ARR}, {"input_prefix", J_STR},
    {"input_suffix", J_STR},
    /* OpenAI's own that change nothing here */
    {"reasoning_effort", J_STR}, {"modalities", J_ARR}, {"audio", J_OBJ}, {"prediction", J_OBJ},
    {"web_search_options", J_OBJ}, {"verbosity", J_STR}, {"safety_identifier", J_STR}, {"functions", J_ARR},
    {"function_call", J_STR | J_OBJ},
};

/* Logs an ignored field's name once per process (at most 256 names are remembered:
 * a client sending random names cannot grow memory or the log without bound). */
static void note_ignored(const char *key, bool known) {
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static char *seen[256];
    static int n_seen;
    pthread_mutex_lock(&mu);
    bool found = false;
    for (int i = 0; i < n_seen && !found; i++) found = !strcmp(seen[i], key);
    if (!found && n_seen < (int)(sizeof seen / sizeof seen[0]) && (seen[n_seen] = strdup(key))) {
        n_seen++;
        struct strbuf name = {0};
        strbuf_add_utf8(&name, key, strlen(key) < 64 ? strlen(key) : 64);
        for (size_t i = 0; i < name.len; i++)
            if ((unsigned char)name.s[i] < 0x20) name.s[i] = '?';
        fprintf(stderr, "kvq serve: ignoring the request field '%s' (%s; logged once)\n", name.s ? name.s : "",
                known ? "not applied by this server" : "unknown");
        strbuf_free(&name);
    }
    pthread_mutex_unlock(&mu);
}

static int ignore_field(const char *key, json_t *v, bool strict, struct oai_error *e) {
    if (strict) return BAD(key, "Unrecognized request argument supplied: %s", key);
    for (size_t i = 0; i < sizeof ignored_fields / sizeof ignored_fields[0]; i++) {
        if (strcmp(key, ignored_fields[i].name)) continue;
        const unsigned t = ignored_fields[i].types;
        bool ok = json_is_null(v) || ((t & J_NUM) && json_is_number(v)) || ((t & J_INT) && json_is_integer(v)) ||
                  ((t & J_BOOL) && json_is_boolean(v)) || ((t & J_STR) && json_is_string(v)) ||
                  ((t & J_ARR) && json_is_array(v)) || ((t & J_OBJ) && json_is_object(v));
        if (!ok) return BAD(key, "'%s' has the wrong type", key);
        note_ignored(key, true);
        return 0;
    }
    note_ignored(key, false);
    return 0;
}

/* The schema the output must follow (NULL: any JSON object), from response_format or
 * an extension field: one of them per request. */
static int set_schema(struct oai_request *r, const char *key, json_t *schema, struct oai_error *e) {
    if (r->response_schema)
        return BAD(key, "give one schema: 'response_format', llama.cpp's 'json_schema' or vLLM's 'guided_json'");
    r->response_schema = schema ? json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY) : strdup("{\"type\":\"object\"}");
    return r->response_schema ? 0 : BAD(NULL, "out of memory");
}

/* vLLM's and llama.cpp's fields that are applied (a 400 with strict, as before them). */
static int parse_extension(const char *key, json_t *v, struct oai_request *r, bool strict, struct oai_error *e) {
    struct gen_params *g = &r->gen;
    long long x;
    if (!strcmp(key, "ignore_eos")) return strict ? ignore_field(key, v, strict, e) : get_bool(v, key, &g->ignore_eos, e);
    if (strict) return ignore_field(key, v, strict, e);
    if (!strcmp(key, "min_tokens")) {
        if (json_is_null(v)) return 0;
        if (get_int(v, key, 0, 1 << 24, &x, e)) return -1;
        g->min_tokens = (int)x;
        return 0;
    }
    if (!strcmp(key, "n_predict")) { /* llama.cpp's max_tokens; -1: no limit */
        if (json_is_null(v)) return 0;
        if (get_int(v, key, -1, 1 << 24, &x, e)) return -1;
        if (x == 0) return BAD(key, "'n_predict' must be -1 or from 1 to %d", 1 << 24);
        g->max_tokens = (int)x;
        return 0;
    }
    if (!strcmp(key, "stop_token_ids")) /* [] as vLLM's default */
        return json_is_null(v) || (json_is_array(v) && !json_array_size(v)) ? 0
                                                                            : get_ids(v, key, 256, &g->stop_ids, &g->n_stop_ids, e);
    if (!strcmp(key, "repetition_penalty")) return get_number(v, key, 0.01, 100, &g->sampling.repeat_penalty, e);
    if (!strcmp(key, "json_schema") || !strcmp(key, "guided_json")) { /* llama.cpp's, vLLM's: a schema or its text */
        if (json_is_null(v)) return 0;
        json_t *s = json_is_string(v) ? json_loads(json_string_value(v), JSON_DECODE_ANY, NULL) : json_incref(v);
        int rc = json_is_object(s) || json_is_boolean(s)
                     ? set_schema(r, key, s, e)
                     : BAD(key, "'%s' must be a JSON Schema (an object, or its JSON text)", key);
        json_decref(s);
        return rc;
    }
    return ignore_field(key, v, strict, e);
}

/* response_format: text, json_object, or json_schema {name, schema, strict}. */
static int get_response_format(json_t *v, struct oai_request *r, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    json_t *type = json_object_get(v, "type");
    if (!json_is_object(v) || !json_is_string(type))
        return BAD("response_format", "'response_format' must be an object with a 'type'");
    const char *t = json_string_value(type);
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_object")) return set_schema(r, "response_format", NULL, e);
    if (strcmp(t, "json_schema"))
        return BAD("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'");
    json_t *js = json_object_get(v, "json_schema"), *schema = json_object_get(js, "schema");
    if (!json_is_object(js)) return BAD("response_format", "'response_format.json_schema' must be an object");
    json_t *strict = json_object_get(js, "strict"), *name = json_object_get(js, "name");
    if (strict && !json_is_boolean(strict) && !json_is_null(strict))
        return BAD("response_format", "'response_format.json_schema.strict' must be a boolean");
    if (name && !json_is_string(name))
        return BAD("response_format", "'response_format.json_schema.name' must be a string");
    if (schema && !json_is_object(schema) && !json_is_boolean(schema))
        return BAD("response_format", "'response_format.json_schema.schema' must be a JSON Schema object");
    /* strict or not, the output follows the schema: the grammar is the only way to keep to it */
    return set_schema(r, "response_format", schema, e);
}

/* tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}] */
static int get_tools(json_t *v, struct oai_request *r, struct oai_error *e) {
    if (json_is_null(v) || (json_is_array(v) && json_array_size(v) == 0)) return 0;
    if (r->kind != OAI_CHAT) return BAD("tools", "'tools' is supported on /v1/chat/completions only");
    if (!json_is_array(v)) return BAD("tools", "'tools' must be a list of tools");
    size_t n = json_array_size(v);
    if (n > 1024) return BAD("tools", "too many tools");
    if (n && !(r->tools = calloc(n, sizeof *r->tools))) return BAD(NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i), *fn = json_object_get(t, "function");
        json_t *type = json_object_get(t, "type"), *name = json_object_get(fn, "name");
        json_t *params = json_object_get(fn, "parameters");
        if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function"))
            return BAD("tools", "tools[%zu] must be {\"type\": \"function\", \"function\": {...}}", i);
        if (!json_is_object(fn) || !json_is_string(name) || json_string_length(name) == 0)
            return BAD("tools", "tools[%zu].function must be an object with a 'name'", i);
        if (params && !json_is_object(params) && !json_is_null(params))
            return BAD("tools", "tools[%zu].function.parameters must be a JSON Schema object", i);
        struct tool_def *d = &r->tools[r->n_tools++];
        d->name = strdup(json_string_value(name));
        d->parameters = json_is_object(params) ? json_dumps(params, JSON_COMPACT) : strdup("{}");
        d->json = json_dumps(t, JSON_COMPACT);
        if (!d->name || !d->parameters || !d->json) return BAD(NULL, "out of memory");
    }
    return (r->tools_json = json_deep_copy(v)) ? 0 : BAD(NULL, "out of memory"); /* as the template takes them */
}

/* tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}}. */
static int get_tool_choice(json_t *v, struct oai_request *r, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    if (json_is_string(v)) {
        const char *c = json_string_value(v);
        if (!strcmp(c, "auto")) r->tool_choice = OAI_TOOLS_AUTO;
        else if (!strcmp(c, "none")) r->tool_choice = OAI_TOOLS_NONE;
        else if (!strcmp(c, "required")) r->tool_choice = OAI_TOOLS_REQUIRED;
        else return BAD("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or a named function");
        return 0;
    }
    json_t *name = json_object_get(json_object_get(v, "function"), "name");
    if (!json_is_string(name))
        return BAD("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    r->tool_choice = OAI_TOOLS_NAMED;
    return get_string(name, "tool_choice", &r->tool_name, e);
}

static int parse_field(const char *key, json_t *v, struct oai_request *r, bool strict, struct oai_error *e) {
    struct gen_params *g = &r->gen;
    struct kvq_sampler_params *sp = &g->sampling;
    long long x;
    if (!strcmp(key, "model") || !strcmp(key, "user"))
        return json_is_string(v) || json_is_null(v) ? 0 : BAD(key, "'%s' must be a string", key);
    if (!strcmp(key, "metadata") || !strcmp(key, "store") || !strcmp(key, "service_tier") ||
        !strcmp(key, "parallel_tool_calls"))
        return 0; /* bookkeeping fields of OpenAI's API, meaningless here */
    if (!strcmp(key, "response_format")) return get_response_format(v, r, e);
    if (!strcmp(key, "tools")) return get_tools(v, r, e);
    if (!strcmp(key, "tool_choice")) return get_tool_choice(v, r, e);
    if (!strcmp(key, "max_tokens") || !strcmp(key, "max_completion_tokens")) {
        if (json_is_null(v)) return 0;
        if (get_int(v, key, 1, 1 << 24, &x, e)) return -1;
        g->max_tokens = (int)x;
        return 0;
    }
    if (!strcmp(key, "temperature")) return get_number(v, key, 0, 2, &sp->temp, e);
    if (!strcmp(key, "top_p")) return get_number(v, key, 0, 1, &sp->top_p, e);
    if (!strcmp(key, "min_p")) return get_number(v, key, 0, 1, &sp->min_p, e);
    if (!strcmp(key, "repeat_penalty")) return get_number(v, key, 0.01, 100, &sp->repeat_penalty, e);
    if (!strcmp(key, "top_k")) {
        if (json_is_null(v)) return 0;
        if (get_int(v, key, -1, 1 << 30, &x, e)) return -1;
        sp->top_k = (int)x;
        return 0;
    }
    if (!strcmp(key, "seed")) {
        if (json_is_null(v)) return 0;
        if (!json_is_integer(v)) return BAD(key, "'seed' must be an integer");
        sp->seed = (uint64_t)json_integer_value(v);
        r->has_seed = true;
        return 0;
    }
    if (!strcmp(key, "n")) {
        if (json_is_null(v)) return 0;
        if (get_int(v, key, 1, OAI_MAX_N, &x, e)) return -1;
        r->n = (int)x;
        return 0;
    }
    if (!strcmp(key, "best_of")) { /* only as many as are returned */
        if (json_is_null(v)) return 0;
        if (get_int(v, key, 1, OAI_MAX_N, &x, e)) return -1;
        r->best_of = (int)x;
        return 0;
    }
    if (!strcmp(key, "frequency_penalty")) return get_number(v, key, -2, 2, &g->frequency_penalty, e);
    if (!strcmp(key, "presence_penalty")) return get_number(v, key, -2, 2, &g->presence_penalty, e);
    if (!strcmp(key, "logit_bias")) return get_logit_bias(v, g, e);
    if (!strcmp(key, "echo") && r->kind == OAI_COMPLETION) return get_bool(v, key, &r->echo, e);
    if (!strcmp(key, "echo") && (json_is_null(v) || json_is_false(v))) return 0; /* chat's, at its default */
    if (!strcmp(key, "stop")) return get_stop(v, g, e);
    /* chat: logprobs true/false and top_logprobs N; completions: logprobs N (the
     * legacy field; false is taken as off, as some clients send it) */
    if (!strcmp(key, "logprobs") && r->kind == OAI_CHAT) return get_bool(v, key, &r->logprobs, e);
    if (!strcmp(key, "logprobs")) {
        if (json_is_null(v) || json_is_false(v)) return 0;
        if (!json_is_integer(v))
            return BAD(key, "'logprobs' must be an integer from 0 to %d on /v1/completions", LP_MAX_TOP);
        if (get_int(v, key, 0, LP_MAX_TOP, &x, e)) return -1;
        g->logprobs = (int)x;
        return 0;
    }
    if (!strcmp(key, "top_logprobs") && r->kind == OAI_CHAT) {
        if (json_is_null(v)) return 0;
        if (get_int(v, key, 0, LP_MAX_TOP, &x, e)) return -1;
        r->top_logprobs = (int)x;
        return 0;
    }
    if (!strcmp(key, "stream")) return get_bool(v, key, &r->stream, e);
    if (!strcmp(key, "stream_options")) {
        if (json_is_null(v)) return 0;
        if (!json_is_object(v)) return BAD(key, "'stream_options' must be an object");
        const char *k;
        json_t *o;
        json_object_foreach(v, k, o) {
            if (strcmp(k, "include_usage")) return BAD(key, "unknown field '%s' in 'stream_options'", k);
            if (get_bool(o, "stream_options.include_usage", &r->include_usage, e)) return -1;
        }
        return 0;
    }
    if (!strcmp(key, "prompt_cache_key")) {
        if (json_is_null(v)) return 0;
        if (get_string(v, key, &r->cache_key, e)) return -1;
        return strlen(r->cache_key) <= 256 ? 0 : BAD(key, "'prompt_cache_key' is longer than 256 bytes");
    }
    if (r->kind == OAI_CHAT && !strcmp(key, "messages")) return get_messages(v, r, e);
    if (r->kind == OAI_CHAT && !strcmp(key, "chat_template_kwargs") && !strict) { /* extra template variables */
        if (json_is_null(v)) return 0;
        if (!json_is_object(v)) return BAD(key, "'chat_template_kwargs' must be an object");
        json_decref(r->template_kwargs);
        return (r->template_kwargs = json_deep_copy(v)) ? 0 : BAD(key, "out of memory");
    }
    if (r->kind == OAI_COMPLETION && !strcmp(key, "prompt")) return get_prompts(v, key, &r->prompts, &r->n_prompts, e);
    if (!strcmp(key, "suffix")) /* accepted at its default only */
        return json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0)
                   ? 0
                   : BAD(key, "'%s' is not supported by this server yet", key);
    if (!strcmp(key, "messages") || !strcmp(key, "prompt")) /* the other endpoint's */
        return BAD(key, "Unrecognized request argument supplied: %s", key);
    return parse_extension(key, v, r, strict, e);
}

int oai_parse_request(const char *body, size_t len, enum oai_kind kind, bool strict, struct oai_request *r,
                      struct oai_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->kind = kind;
    r->n = 1;
    r->gen.max_tokens = kind == OAI_COMPLETION ? 16 : -1; /* OpenAI's defaults */
    r->gen.logprobs = -1;
    r->top_logprobs = -1;
    kvq_sampler_params_default(&r->gen.sampling);
    /* OpenAI's sampling defaults: temperature 1, nothing truncated */
    r->gen.sampling.temp = 1.0f;
    r->gen.sampling.top_k = 0;
    r->gen.sampling.top_p = 1.0f;
    r->gen.sampling.min_p = 0.0f;
    r->gen.sampling.repeat_penalty = 1.0f;
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return BAD(NULL, "invalid JSON body: %s (line %d, column %d)", jerr.text, jerr.line, jerr.column);
    int rc = 0;
    if (!json_is_object(root)) rc = BAD(NULL, "the request body must be a JSON object");
    const char *key;
    json_t *v;
    if (rc == 0) json_object_foreach(root, key, v) {
            if ((rc = parse_field(key, v, r, strict, e)) != 0) break;
        }
    if (rc == 0 && kind == OAI_CHAT && !r->messages) rc = BAD("messages", "'messages' is required");
    if (rc == 0 && kind == OAI_COMPLETION && !r->n_prompts) rc = BAD("prompt", "'prompt' is required");
    if (rc == 0 && r->best_of && r->best_of != r->n)
        rc = BAD("best_of", "'best_of' must equal 'n' here (%d): extra choices are not ranked", r->n);
    if (rc == 0 && r->gen.max_tokens >= 0 && r->gen.min_tokens > r->gen.max_tokens)
        rc = BAD("min_tokens", "'min_tokens' (%d) must not exceed 'max_tokens' (%d)", r->gen.min_tokens, r->gen.max_tokens);
    if (rc == 0 && r->echo && r->gen.logprobs >= 0)
        rc = BAD("echo", "'echo' together with 'logprobs' (the prompt's log-probabilities) is not supported");
    if (rc == 0 && kind == OAI_CHAT && r->top_logprobs > 0 && !r->logprobs)
        rc = BAD("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (rc == 0 && kind == OAI_CHAT && r->logprobs) r->gen.logprobs = r->top_logprobs > 0 ? r->top_logprobs : 0;
    if (rc == 0 && (r->tool_choice == OAI_TOOLS_REQUIRED || r->tool_choice == OAI_TOOLS_NAMED) && r->n_tools == 0)
        rc = BAD("tool_choice", "'tool_choice' asks for a tool call but 'tools' lists none");
    for (int i = 0; rc == 0 && r->tool_choice == OAI_TOOLS_NAMED && i <= r->n_tools; i++)
        if (i == r->n_tools) rc = BAD("tool_choice", "'tool_choice' names '%s', which 'tools' does not list", r->tool_name);
        else if (!strcmp(r->tools[i].name, r->tool_name)) break;
    if (rc == 0 && r->include_usage && !r->stream)
        rc = BAD("stream_options", "'stream_options' is only allowed when 'stream' is true");
    json_decref(root);
    if (rc) oai_request_free(r);
    return rc;
}

void gen_params_free(struct gen_params *g) {
    for (int i = 0; i < g->n_stop; i++) free(g->stop[i]);
    g->n_stop = 0;
    free(g->stop_ids);
    free(g->bias_ids);
    free(g->bias_values);
    g->stop_ids = g->bias_ids = NULL;
    g->bias_values = NULL;
    g->n_stop_ids = g->n_bias = 0;
    kvq_grammar_free(g->grammar);
    g->grammar = NULL;
}

static void *dup_mem(const void *p, size_t bytes, bool *oom) {
    if (!p || !bytes) return NULL;
    void *d = malloc(bytes);
    if (!d) *oom = true;
    else memcpy(d, p, bytes);
    return d;
}

int gen_params_copy(struct gen_params *dst, const struct gen_params *src) {
    *dst = *src;
    bool oom = false;
    for (int i = 0; i < src->n_stop; i++) dst->stop[i] = dup_mem(src->stop[i], strlen(src->stop[i]) + 1, &oom);
    dst->stop_ids = dup_mem(src->stop_ids, sizeof *src->stop_ids * (size_t)src->n_stop_ids, &oom);
    dst->bias_ids = dup_mem(src->bias_ids, sizeof *src->bias_ids * (size_t)src->n_bias, &oom);
    dst->bias_values = dup_mem(src->bias_values, sizeof *src->bias_values * (size_t)src->n_bias, &oom);
    dst->grammar = NULL; /* a grammar holds one sequence's place: each gets its own */
    if (oom) gen_params_free(dst);
    return oom ? -1 : 0;
}

bool oai_tools_on(const struct oai_request *q) { return q->n_tools > 0 && q->tool_choice != OAI_TOOLS_NONE; }

void oai_request_free(struct oai_request *r) {
    json_decref(r->messages);
    json_decref(r->tools_json);
    json_decref(r->template_kwargs);
    for (int i = 0; i < r->n_tools; i++) {
        free(r->tools[i].name);
        free(r->tools[i].parameters);
        free(r->tools[i].json);
    }
    free(r->tools);
    free(r->tool_name);
    free(r->response_schema);
    prompts_free(r->prompts, r->n_prompts);
    free(r->cache_key);
    gen_params_free(&r->gen);
    memset(r, 0, sizeof *r);
}

/* ---- responses ---- */

static char *dump(json_t *root) {
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

/* Text cut at a byte limit (message, param) made valid UTF-8 again; malloc'd. */
static char *clean_utf8(const char *s) {
    struct strbuf b = {0};
    strbuf_add_utf8(&b, s, strlen(s));
    return strbuf_take(&b);
}

char *oai_error_json(const struct oai_error *e) {
    char *msg = clean_utf8(e->message), *param = e->param[0] ? clean_utf8(e->param) : NULL;
    char *s = dump(json_pack("{s:{s:s, s:s, s:s?, s:s?}}", "error", "message", msg ? msg : "", "type",
                             e->type ? e->type : "invalid_request_error", "param", param, "code", e->code));
    free(msg);
    free(param);
    return s;
}

static json_t *usage_json(const struct oai_usage *u) {
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", u->prompt_tokens, "completion_tokens",
                     u->completion_tokens, "total_tokens", u->prompt_tokens + u->completion_tokens,
                     "prompt_tokens_details", "cached_tokens", u->cached_tokens);
}

static json_t *envelope(enum oai_kind kind, const char *id, long created, const char *model, bool chunk) {
    const char *object = kind == OAI_CHAT ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
    return json_pack("{s:s, s:s, s:I, s:s, s:s}", "id", id, "object", object, "created", (json_int_t)created, "model",
                     model, "system_fingerprint", "kvq");
}

/* A token's text as a JSON string (bytes that are not valid UTF-8 become U+FFFD)
 * and, with bytes_out, its raw bytes as a list of integers (OpenAI's "bytes"). */
static json_t *token_text(const struct oai_logprobs *lp, kvq_token t, json_t **bytes_out) {
    char small[128], *buf = small;
    int n = lp->piece(lp->ctx, t, small, sizeof small);
    if (n > (int)sizeof small && (buf = malloc((size_t)n))) lp->piece(lp->ctx, t, buf, n);
    if (!buf) return NULL;
    if (n < 0) n = 0;
    struct strbuf b = {0};
    strbuf_add_utf8(&b, buf, (size_t)n);
    json_t *s = b.oom ? NULL : json_stringn(b.s ? b.s : "", b.len);
    strbuf_free(&b);
    if (bytes_out) {
        *bytes_out = json_array();
        for (int i = 0; i < n; i++) json_array_append_new(*bytes_out, json_integer((unsigned char)buf[i]));
    }
    if (buf != small) free(buf);
    return s;
}

/* Chat's {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}. */
static json_t *chat_logprobs(const struct oai_logprobs *lp) {
    json_t *content = json_array();
    for (int i = 0; i < lp->n; i++) {
        const struct lp_entry *e = &lp->v[i];
        json_t *bytes, *top = json_array();
        json_t *tok = token_text(lp, e->id, &bytes);
        for (int j = 0; j < e->n_top; j++) {
            json_t *tb, *tt = token_text(lp, e->top[j].id, &tb);
            json_array_append_new(top, json_pack("{s:o, s:f, s:o}", "token", tt, "logprob", (double)e->top[j].logprob,
                                                 "bytes", tb));
        }
        json_array_append_new(content, json_pack("{s:o, s:f, s:o, s:o}", "token", tok, "logprob", (double)e->logprob,
                                                 "bytes", bytes, "top_logprobs", top));
    }
    return json_pack("{s:o, s:n}", "content", content, "refusal");
}

/* The legacy completions shape: parallel lists, top_logprobs as {token: logprob}. */
static json_t *completion_logprobs(const struct oai_logprobs *lp) {
    json_t *tokens = json_array(), *values = json_array(), *tops = json_array(), *offsets = json_array();
    for (int i = 0; i < lp->n; i++) {
        const struct lp_entry *e = &lp->v[i];
        json_array_append_new(tokens, token_text(lp, e->id, NULL));
        json_array_append_new(values, json_real(e->logprob));
        json_t *top = json_object();
        for (int j = 0; j < e->n_top; j++) {
            json_t *t = token_text(lp, e->top[j].id, NULL);
            /* two tokens can share a text: the likelier one (listed first) stays */
            if (t && !json_object_get(top, json_string_value(t)))
                json_object_set_new(top, json_string_value(t), json_real(e->top[j].logprob));
            json_decref(t);
        }
        json_array_append_new(tops, top);
        json_array_append_new(offsets, json_integer((json_int_t)e->text_start));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", values, "top_logprobs", tops,
                     "text_offset", offsets);
}

/* *p, which becomes NULL (a list given up on). */
static json_t *exchange_null(json_t **p) {
    json_t *v = *p;
    *p = NULL;
    return v;
}

static json_t *logprobs_json(enum oai_kind kind, const struct oai_logprobs *lp) {
    if (!lp) return json_null();
    return kind == OAI_CHAT ? chat_logprobs(lp) : completion_logprobs(lp);
}

static json_t *tool_calls_json(const struct tool_call *calls, int n, bool indexed) {
    json_t *list = json_array();
    for (int i = 0; i < n; i++) {
        json_t *c = json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", calls[i].id, "type", "function", "function", "name",
                              calls[i].name, "arguments", calls[i].arguments);
        if (indexed && c) json_object_set_new(c, "index", json_integer(i));
        json_array_append_new(list, c);
    }
    return list;
}

char *oai_response_json_n(enum oai_kind kind, const char *id, long created, const char *model,
                          const struct oai_choice *ch, int n, const struct oai_usage *u) {
    json_t *root = envelope(kind, id, created, model, false), *choices = json_array();
    for (int i = 0; i < n && root && choices; i++) {
        const struct oai_choice *c = &ch[i];
        json_t *choice;
        if (kind == OAI_CHAT && c->n_calls > 0) /* content: the text before the calls, null for none */
            choice = json_pack("{s:i, s:{s:s, s:o, s:o}, s:o, s:s}", "index", i, "message", "role", "assistant",
                               "content", c->text_len ? json_stringn(c->text, c->text_len) : json_null(), "tool_calls",
                               tool_calls_json(c->calls, c->n_calls, false), "logprobs", logprobs_json(kind, c->lp),
                               "finish_reason", c->finish_reason);
        else if (kind == OAI_CHAT)
            choice = json_pack("{s:i, s:{s:s, s:s%}, s:o, s:s}", "index", i, "message", "role", "assistant", "content",
                               c->text, c->text_len, "logprobs", logprobs_json(kind, c->lp), "finish_reason",
                               c->finish_reason);
        else
            choice = json_pack("{s:i, s:s%, s:o, s:s}", "index", i, "text", c->text, c->text_len, "logprobs",
                               logprobs_json(kind, c->lp), "finish_reason", c->finish_reason);
        if (json_array_append_new(choices, choice) != 0) json_decref(exchange_null(&choices));
    }
    if (!root || !choices) {
        json_decref(root);
        json_decref(choices);
        return NULL;
    }
    json_object_set_new(root, "choices", choices);
    json_object_set_new(root, "usage", usage_json(u));
    return dump(root);
}

char *oai_response_json(enum oai_kind kind, const char *id, long created, const char *model, const char *text,
                        size_t text_len, const char *finish_reason, const struct oai_usage *u,
                        const struct oai_logprobs *lp) {
    const struct oai_choice c = {text, text_len, finish_reason, lp, NULL, 0};
    return oai_response_json_n(kind, id, created, model, &c, 1, u);
}

char *oai_chunk_json(enum oai_kind kind, const char *id, long created, const char *model, int index, bool first,
                     const char *text, size_t text_len, const char *finish_reason, const struct oai_logprobs *lp) {
    json_t *root = envelope(kind, id, created, model, true);
    json_t *choice = json_pack("{s:i, s:o}", "index", index, "logprobs", logprobs_json(kind, lp));
    if (!root || !choice) {
        json_decref(root);
        json_decref(choice);
        return NULL;
    }
    if (kind == OAI_CHAT) {
        json_t *delta = json_object();
        if (first) json_object_set_new(delta, "role", json_string("assistant"));
        if (text) json_object_set_new(delta, "content", json_stringn(text, text_len));
        json_object_set_new(choice, "delta", delta);
    } else {
        json_object_set_new(choice, "text", json_stringn(text ? text : "", text ? text_len : 0));
    }
    json_object_set_new(choice, "finish_reason", finish_reason ? json_string(finish_reason) : json_null());
    json_object_set_new(root, "choices", json_pack("[o]", choice));
    return dump(root);
}

char *oai_usage_chunk_json(enum oai_kind kind, const char *id, long created, const char *model,
                           const struct oai_usage *u) {
    json_t *root = envelope(kind, id, created, model, true);
    if (!root) return NULL;
    json_object_set_new(root, "choices", json_array());
    json_object_set_new(root, "usage", usage_json(u));
    return dump(root);
}

int oai_parse_embeddings(const char *body, size_t len, bool strict, struct oai_embed_request *r, struct oai_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) return BAD(NULL, "invalid JSON body: %s (line %d, column %d)", jerr.text, jerr.line, jerr.column);
    int rc = json_is_object(root) ? 0 : BAD(NULL, "the request body must be a JSON object");
    const char *key;
    json_t *v;
    if (rc == 0) json_object_foreach(root, key, v) {
            if (!strcmp(key, "input") || !strcmp(key, "content")) /* content: llama-server's /embedding */
                rc = r->inputs ? BAD(key, "give 'input' once") : get_prompts(v, key, &r->inputs, &r->n_inputs, e);
            else if (!strcmp(key, "model") || !strcmp(key, "user"))
                rc = json_is_string(v) || json_is_null(v) ? 0 : BAD(key, "'%s' must be a string", key);
            else if (!strcmp(key, "encoding_format")) {
                const char *f = json_string_value(v);
                if (json_is_null(v)) continue;
                if (!f || (strcmp(f, "float") && strcmp(f, "base64")))
                    rc = BAD(key, "'encoding_format' must be \"float\" or \"base64\"");
                else r->base64 = !strcmp(f, "base64");
            } else if (!strcmp(key, "dimensions")) {
                long long x;
                if (!json_is_null(v) && (rc = get_int(v, key, 1, 1 << 20, &x, e)) == 0) r->dimensions = (int)x;
            } else {
                rc = ignore_field(key, v, strict, e);
            }
            if (rc) break;
        }
    if (rc == 0 && !r->n_inputs) rc = BAD("input", "'input' is required");
    json_decref(root);
    if (rc) oai_embed_request_free(r);
    return rc;
}

void oai_embed_request_free(struct oai_embed_request *r) {
    prompts_free(r->inputs, r->n_inputs);
    memset(r, 0, sizeof *r);
}

/* Little-endian float32 bytes in base64 (what OpenAI's encoding_format "base64" sends). */
static json_t *base64_floats(const float *x, int n) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const size_t nb = (size_t)n * 4;
    unsigned char *b = malloc(nb);
    char *out = malloc((nb + 2) / 3 * 4 + 1);
    json_t *s = NULL;
    if (b && out) {
        for (int i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            for (int k = 0; k < 4; k++) b[i * 4 + k] = (unsigned char)(u >> (8 * k));
        }
        size_t o = 0;
        for (size_t i = 0; i < nb; i += 3) {
            const uint32_t v = (uint32_t)b[i] << 16 | (i + 1 < nb ? (uint32_t)b[i + 1] << 8 : 0) | (i + 2 < nb ? b[i + 2] : 0);
            out[o++] = tab[v >> 18 & 63];
            out[o++] = tab[v >> 12 & 63];
            out[o++] = i + 1 < nb ? tab[v >> 6 & 63] : '=';
            out[o++] = i + 2 < nb ? tab[v & 63] : '=';
        }
        out[o] = '\0';
        s = json_string(out);
    }
    free(b);
    free(out);
    return s;
}

char *oai_embeddings_json(const char *model, const float *vectors, int n, int dim, bool base64, int prompt_tokens) {
    json_t *data = json_array();
    for (int i = 0; i < n && data; i++) {
        const float *x = vectors + (size_t)i * dim;
        json_t *emb = base64 ? base64_floats(x, dim) : json_array();
        for (int k = 0; !base64 && emb && k < dim; k++) json_array_append_new(emb, json_real(x[k]));
        if (json_array_append_new(data, json_pack("{s:s, s:i, s:o}", "object", "embedding", "index", i, "embedding", emb)))
            json_decref(exchange_null(&data));
    }
    if (!data) return NULL;
    return dump(json_pack("{s:s, s:o, s:s, s:{s:i, s:i}}", "object", "list", "data", data, "model", model, "usage",
                          "prompt_tokens", prompt_tokens, "total_tokens", prompt_tokens));
}

char *oai_models_json(const char *model, long created) {
    return dump(json_pack("{s:s, s:[{s:s, s:s, s:I, s:s}]}", "object", "list", "data", "id", model, "object", "model",
                          "created", (json_int_t)created, "owned_by", "kvq"));
}

char *oai_tool_chunk_json(const char *id, long created, const char *model, int index, const struct tool_call *calls,
                          int n_calls) {
    json_t *root = envelope(OAI_CHAT, id, created, model, true);
    json_t *choice = json_pack("{s:i, s:{s:o}, s:n, s:n}", "index", index, "delta", "tool_calls",
                               tool_calls_json(calls, n_calls, true), "logprobs", "finish_reason");
    if (!root || !choice) {
        json_decref(root);
        json_decref(choice);
        return NULL;
    }
    json_object_set_new(root, "choices", json_pack("[o]", choice));
    return dump(root);
}
