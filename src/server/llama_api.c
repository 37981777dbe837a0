#include "server/llama_api.h"

#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/strbuf.h"

/* A 400 naming the field; NULL (the answer there is none of). */
static char *bad(struct oai_error *e, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static char *bad(struct oai_error *e, const char *param, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    oai_error_set(e, 400, "invalid_request_error", param, NULL, "%s", msg);
    return NULL;
}

static char *oom(struct oai_error *e) {
    oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return NULL;
}

static json_t *load(const char *body, size_t len, struct oai_error *e) {
    json_error_t jerr;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) bad(e, NULL, "invalid JSON body: %s (line %d, column %d)", jerr.text, jerr.line, jerr.column);
    else if (!json_is_object(root)) {
        json_decref(root);
        root = NULL;
        bad(e, NULL, "the request body must be a JSON object");
    }
    return root;
}

static char *dump(json_t *v, struct oai_error *e) {
    char *s = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
    return s ? s : oom(e);
}

/* A boolean field, def when absent or null; -1 when it is something else. */
static int flag(json_t *root, const char *key, bool def, struct oai_error *e) {
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return def;
    if (!json_is_boolean(v)) return bad(e, key, "'%s' must be a boolean", key) ? 0 : -1;
    return json_is_true(v);
}

int api_tokenize_text(const struct kvq_model *m, const char *text, size_t len, bool add, bool parse, kvq_token **out) {
    int cap = (int)(len < INT_MAX / 2 ? len : INT_MAX / 2) + 8;
    for (int attempt = 0; attempt < 2; attempt++) {
        kvq_token *t = malloc(sizeof *t * (size_t)cap);
        if (!t) return -1;
        int n = kvq_tokenize(m, text, len, add, parse, t, cap);
        if (n >= 0 && n <= cap) return *out = t, n;
        free(t);
        if (n < 0) return -1;
        cap = n;
    }
    return -1;
}

static json_t *piece_json(const struct kvq_model *m, kvq_token t) {
    char small[256], *buf = small;
    int n = kvq_token_bytes(m, t, small, sizeof small);
    if (n > (int)sizeof small && (buf = malloc((size_t)n))) kvq_token_bytes(m, t, buf, n);
    if (!buf || n < 0) return NULL;
    struct strbuf u = {0};
    strbuf_add_utf8(&u, buf, (size_t)n);
    json_t *v;
    if (u.len == (size_t)n && !memcmp(u.s ? u.s : "", buf, (size_t)n)) { /* valid UTF-8 as it is */
        v = json_stringn(buf, (size_t)n);
    } else {
        v = json_array();
        for (int i = 0; i < n; i++) json_array_append_new(v, json_integer((unsigned char)buf[i]));
    }
    strbuf_free(&u);
    if (buf != small) free(buf);
    return v;
}

char *api_tokenize(const struct kvq_model *m, const char *body, size_t len, struct oai_error *e) {
    json_t *root = load(body, len, e);
    if (!root) return NULL;
    json_t *content = json_object_get(root, "content");
    int add = flag(root, "add_special", false, e), parse = flag(root, "parse_special", true, e),
        pieces = flag(root, "with_pieces", false, e);
    char *out = NULL;
    kvq_token *t = NULL;
    int n = -1;
    if (!json_is_string(content)) bad(e, "content", "'content' must be a string");
    else if (add >= 0 && parse >= 0 && pieces >= 0 &&
             (n = api_tokenize_text(m, json_string_value(content), json_string_length(content), add, parse, &t)) < 0)
        oai_error_set(e, 400, "invalid_request_error", "content", NULL, "cannot tokenize: %s", kvq_last_error());
    if (n >= 0) {
        json_t *list = json_array();
        for (int i = 0; i < n; i++)
            json_array_append_new(list, pieces ? json_pack("{s:i, s:o}", "id", t[i], "piece", piece_json(m, t[i]))
                                               : json_integer(t[i]));
        out = dump(json_pack("{s:o}", "tokens", list), e);
    }
    free(t);
    json_decref(root);
    return out;
}

char *api_detokenize_text(const struct kvq_model *m, const kvq_token *ids, int n) {
    struct kvq_detok *d = kvq_detok_new(m);
    struct strbuf b = {0};
    char piece[256];
    for (int i = 0; d && i <= n; i++) {
        int w = i < n ? kvq_detok_feed(d, ids[i], piece, sizeof piece) : kvq_detok_flush(d, piece, sizeof piece);
        strbuf_add_utf8(&b, piece, (size_t)(w < (int)sizeof piece ? w : (int)sizeof piece));
    }
    if (!d) b.oom = true;
    kvq_detok_free(d);
    return strbuf_take(&b);
}

char *api_detokenize(const struct kvq_model *m, const char *body, size_t len, struct oai_error *e) {
    json_t *root = load(body, len, e);
    if (!root) return NULL;
    json_t *tokens = json_object_get(root, "tokens");
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    size_t n = json_array_size(tokens), i;
    kvq_token *ids = malloc(sizeof *ids * (n ? n : 1));
    char *out = NULL;
    json_t *x;
    bool ok = json_is_array(tokens) && ids;
    if (ok) json_array_foreach(tokens, i, x) {
            ok = ok && json_is_integer(x) && json_integer_value(x) >= 0 && json_integer_value(x) < info.n_vocab;
            if (ok) ids[i] = (kvq_token)json_integer_value(x);
        }
    if (!ids) oom(e);
    else if (!ok) bad(e, "tokens", "'tokens' must be a list of token ids (0..%d)", info.n_vocab - 1);
    else {
        char *text = api_detokenize_text(m, ids, (int)n);
        out = text ? dump(json_pack("{s:s}", "content", text), e) : oom(e);
        free(text);
    }
    free(ids);
    json_decref(root);
    return out;
}

char *api_render_chat(const struct chat_template *chat, enum tool_syntax s, const struct oai_request *q,
                      struct oai_error *e) {
    const bool tools = oai_tools_on(q);
    json_t *written = NULL;
    if (!chat_template_takes_tools(chat)) {
        bool tooled = tools;
        size_t i;
        json_t *m;
        json_array_foreach(q->messages, i, m) tooled |= json_array_size(json_object_get(m, "tool_calls")) > 0 ||
                                                        !strcmp(json_string_value(json_object_get(m, "role")), "tool");
        if (tooled && !(written = tool_messages(s, q->messages, q->tools, tools ? q->n_tools : 0))) return oom(e);
    }
    char err[256] = "out of memory";
    struct chat_request cr = {written ? written : q->messages, tools && !written ? q->tools_json : NULL,
                              q->template_kwargs, true};
    char *text = chat_template_apply(chat, &cr, err, sizeof err);
    json_decref(written);
    /* the template refuses the conversation (raise_exception, a missing field): the client's to fix */
    if (!text) oai_error_set(e, 400, "invalid_request_error", "messages", NULL, "chat template: %s", err);
    return text;
}

char *api_apply_template(const struct chat_template *chat, enum tool_syntax s, const char *body, size_t len,
                         bool strict, struct oai_error *e) {
    struct oai_request q;
    if (oai_parse_request(body, len, OAI_CHAT, strict, &q, e) != 0) return NULL;
    char *text = api_render_chat(chat, s, &q, e);
    oai_request_free(&q);
    char *out = text ? dump(json_pack("{s:s}", "prompt", text), e) : NULL;
    free(text);
    return out;
}

/* ---- embeddings ---- */

struct embedder {
    struct kvq_model *m;
    struct kvq_context *c;
    enum kvq_pooling pooling;
    int n_embd;
    pthread_mutex_t mu; /* one request at a time on the context */
};

struct embedder *embedder_new(struct kvq_model *m, int n_ctx, int n_threads, enum kvq_pooling pooling) {
    struct embedder *em = calloc(1, sizeof *em);
    if (!em) return NULL;
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = n_ctx;
    cp.n_seq = 1;
    cp.n_threads = n_threads;
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    em->m = m;
    em->pooling = pooling;
    em->n_embd = info.n_embd;
    if (!(em->c = kvq_context_new(m, &cp))) {
        free(em);
        return NULL;
    }
    pthread_mutex_init(&em->mu, NULL);
    return em;
}

void embedder_free(struct embedder *em) {
    if (!em) return;
    kvq_context_free(em->c);
    pthread_mutex_destroy(&em->mu);
    free(em);
}

char *api_embeddings(struct embedder *em, const char *model_id, const char *body, size_t len, bool strict,
                     struct oai_error *e) {
    struct oai_embed_request q;
    if (oai_parse_embeddings(body, len, strict, &q, e) != 0) return NULL;
    const int d = em->n_embd, n_ctx = kvq_context_n_ctx(em->c);
    struct kvq_model_info info;
    kvq_model_get_info(em->m, &info);
    float *v = malloc(sizeof *v * (size_t)d * (size_t)q.n_inputs);
    char *out = NULL;
    int total = 0;
    if (!v) oom(e);
    else if (q.dimensions && q.dimensions != d)
        bad(e, "dimensions", "this model's embeddings have %d dimensions (got 'dimensions': %d)", d, q.dimensions);
    for (int i = 0; v && i < q.n_inputs && !e->status; i++) {
        const struct oai_prompt *p = &q.inputs[i];
        kvq_token *t = NULL;
        int n = p->ids ? p->n_ids : api_tokenize_text(em->m, p->text, strlen(p->text), true, true, &t);
        const kvq_token *ids = p->ids ? p->ids : t;
        for (int j = 0; p->ids && j < n; j++)
            if (ids[j] >= info.n_vocab) n = -2;
        if (n == -2) bad(e, "input", "input %d: a token id is outside the vocabulary (0..%d)", i, info.n_vocab - 1);
        else if (n < 0) oai_error_set(e, 400, "invalid_request_error", "input", NULL, "cannot tokenize input %d", i);
        else if (n == 0) bad(e, "input", "input %d is empty", i);
        else if (n > n_ctx)
            oai_error_set(e, 400, "invalid_request_error", "input", "context_length_exceeded",
                          "input %d has %d tokens; this server embeds at most %d", i, n, n_ctx);
        else {
            pthread_mutex_lock(&em->mu);
            int rc = kvq_embed(em->c, 0, ids, n, em->pooling, v + (size_t)i * d);
            pthread_mutex_unlock(&em->mu);
            if (rc) oai_error_set(e, 500, "server_error", NULL, NULL, "%s", kvq_last_error());
            total += n;
        }
        free(t);
    }
    if (v && !e->status) out = oai_embeddings_json(model_id, v, q.n_inputs, d, q.base64, total);
    if (v && !e->status && !out) oom(e);
    free(v);
    oai_embed_request_free(&q);
    return out;
}
