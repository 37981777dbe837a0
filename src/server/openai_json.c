#include "server/openai_json.h"

#include <jansson.h>
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
        if (calls && !json_is_null(calls) && !json_is_array(calls))
            return BAD("messages", "messages[%zu].tool_calls must be a list", i);
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

/* tools: a list of {"type": "function", "function": {"name": ..., ...}}, kept for the template. */
static int get_tools(json_t *v, struct oai_request *r, struct oai_error *e) {
    if (json_is_null(v)) return 0;
    if (!json_is_array(v)) return BAD("tools", "'tools' must be a list of tools");
    size_t i;
    json_t *t;
    json_array_foreach(v, i, t) {
        json_t *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
        if (!json_is_string(type) || strcmp(json_string_value(type), "function"))
            return BAD("tools", "tools[%zu].type must be \"function\"", i);
        if (!json_is_object(fn) || !json_is_string(json_object_get(fn, "name")))
            return BAD("tools", "tools[%zu].function must be an object with a name", i);
    }
    json_decref(r->tools);
    if (!(r->tools = json_deep_copy(v))) return BAD("tools", "out of memory");
    return 0;
}

/* Fields clients send that change nothing here when left at their defaults. */
static int check_default_only(const char *key, json_t *v, struct oai_error *e) {
    bool is_default = json_is_null(v);
    if (!strcmp(key, "frequency_penalty") || !strcmp(key, "presence_penalty"))
        is_default = is_default || (json_is_number(v) && json_number_value(v) == 0);
    else if (!strcmp(key, "echo"))
        is_default = is_default || json_is_false(v);
    else if (!strcmp(key, "best_of"))
        is_default = is_default || (json_is_integer(v) && json_integer_value(v) == 1);
    else if (!strcmp(key, "logit_bias"))
        is_default = is_default || (json_is_object(v) && json_object_size(v) == 0) ||
                     (json_is_array(v) && json_array_size(v) == 0);
    else if (!strcmp(key, "response_format")) {
        json_t *t = json_object_get(v, "type");
        is_default = is_default || (json_is_string(t) && !strcmp(json_string_value(t), "text"));
    } else if (!strcmp(key, "suffix"))
        is_default = is_default || (json_is_string(v) && json_string_length(v) == 0);
    if (!is_default) return BAD(key, "'%s' is not supported by this server yet", key);
    return 0;
}

static int parse_field(const char *key, json_t *v, struct oai_request *r, struct oai_error *e) {
    struct gen_params *g = &r->gen;
    struct kvq_sampler_params *sp = &g->sampling;
    long long x;
    if (!strcmp(key, "model") || !strcmp(key, "user"))
        return json_is_string(v) || json_is_null(v) ? 0 : BAD(key, "'%s' must be a string", key);
    if (!strcmp(key, "metadata") || !strcmp(key, "store") || !strcmp(key, "service_tier") ||
        !strcmp(key, "parallel_tool_calls") || !strcmp(key, "tool_choice"))
        return 0; /* bookkeeping fields of OpenAI's API, meaningless here */
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
        if (get_int(v, key, 1, 1 << 20, &x, e)) return -1;
        return x == 1 ? 0 : BAD("n", "only n = 1 is supported (got %lld)", x);
    }
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
    if (r->kind == OAI_CHAT && !strcmp(key, "tools")) return get_tools(v, r, e);
    if (r->kind == OAI_CHAT && !strcmp(key, "chat_template_kwargs")) { /* extra template variables */
        if (json_is_null(v)) return 0;
        if (!json_is_object(v)) return BAD(key, "'chat_template_kwargs' must be an object");
        json_decref(r->template_kwargs);
        return (r->template_kwargs = json_deep_copy(v)) ? 0 : BAD(key, "out of memory");
    }
    if (r->kind == OAI_COMPLETION && !strcmp(key, "prompt")) {
        if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
            v = json_array_get(v, 0);
        if (!json_is_string(v)) return BAD("prompt", "'prompt' must be a string (or a list of one string)");
        return get_string(v, key, &r->prompt, e);
    }
    static const char *const defaults_only[] = {"frequency_penalty", "presence_penalty", "logit_bias", "tools",
                                                "response_format", "echo", "best_of", "suffix", NULL};
    for (const char *const *d = defaults_only; *d; d++)
        if (!strcmp(key, *d)) return check_default_only(key, v, e);
    return BAD(key, "Unrecognized request argument supplied: %s", key);
}

int oai_parse_request(const char *body, size_t len, enum oai_kind kind, struct oai_request *r, struct oai_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->kind = kind;
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
            if ((rc = parse_field(key, v, r, e)) != 0) break;
        }
    if (rc == 0 && kind == OAI_CHAT && !r->messages) rc = BAD("messages", "'messages' is required");
    if (rc == 0 && kind == OAI_COMPLETION && !r->prompt) rc = BAD("prompt", "'prompt' is required");
    if (rc == 0 && kind == OAI_CHAT && r->top_logprobs > 0 && !r->logprobs)
        rc = BAD("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (rc == 0 && kind == OAI_CHAT && r->logprobs) r->gen.logprobs = r->top_logprobs > 0 ? r->top_logprobs : 0;
    if (rc == 0 && r->include_usage && !r->stream)
        rc = BAD("stream_options", "'stream_options' is only allowed when 'stream' is true");
    json_decref(root);
    if (rc) oai_request_free(r);
    return rc;
}

void gen_params_free(struct gen_params *g) {
    for (int i = 0; i < g->n_stop; i++) free(g->stop[i]);
    g->n_stop = 0;
}

void oai_request_free(struct oai_request *r) {
    json_decref(r->messages);
    json_decref(r->tools);
    json_decref(r->template_kwargs);
    free(r->prompt);
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

static json_t *logprobs_json(enum oai_kind kind, const struct oai_logprobs *lp) {
    if (!lp) return json_null();
    return kind == OAI_CHAT ? chat_logprobs(lp) : completion_logprobs(lp);
}

char *oai_response_json(enum oai_kind kind, const char *id, long created, const char *model, const char *text,
                        size_t text_len, const char *finish_reason, const struct oai_usage *u,
                        const struct oai_logprobs *lp) {
    json_t *root = envelope(kind, id, created, model, false);
    json_t *choice = kind == OAI_CHAT
                         ? json_pack("{s:i, s:{s:s, s:s%}, s:o, s:s}", "index", 0, "message", "role", "assistant",
                                     "content", text, text_len, "logprobs", logprobs_json(kind, lp), "finish_reason",
                                     finish_reason)
                         : json_pack("{s:i, s:s%, s:o, s:s}", "index", 0, "text", text, text_len, "logprobs",
                                     logprobs_json(kind, lp), "finish_reason", finish_reason);
    if (!root || !choice) {
        json_decref(root);
        json_decref(choice);
        return NULL;
    }
    json_object_set_new(root, "choices", json_pack("[o]", choice));
    json_object_set_new(root, "usage", usage_json(u));
    return dump(root);
}

char *oai_chunk_json(enum oai_kind kind, const char *id, long created, const char *model, bool first,
                     const char *text, size_t text_len, const char *finish_reason, const struct oai_logprobs *lp) {
    json_t *root = envelope(kind, id, created, model, true);
    json_t *choice = json_pack("{s:i, s:o}", "index", 0, "logprobs", logprobs_json(kind, lp));
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

char *oai_models_json(const char *model, long created) {
    return dump(json_pack("{s:s, s:[{s:s, s:s, s:I, s:s}]}", "object", "list", "data", "id", model, "object", "model",
                          "created", (json_int_t)created, "owned_by", "kvq"));
}
