/* OpenAI request bodies to generation parameters, and the response, stream chunk
 * and error objects back to JSON text (jansson). Pure functions: no engine calls. */
#ifndef KVQ_SERVER_OPENAI_JSON_H
#define KVQ_SERVER_OPENAI_JSON_H

#include <stdbool.h>
#include <stddef.h>

#include "server/scheduler.h"

struct json_t;

enum oai_kind { OAI_CHAT, OAI_COMPLETION };

struct oai_request {
    enum oai_kind kind;
    struct json_t *messages; /* chat: the messages for the template (see get_messages) */
    struct json_t *tools;    /* chat: the tools list, or NULL */
    struct json_t *template_kwargs; /* chat: chat_template_kwargs (vLLM's and llama.cpp's), or NULL */
    char *prompt; /* completion */
    struct gen_params gen;
    bool stream, include_usage;
    bool has_seed; /* else the caller picks a fresh seed */
    bool logprobs;    /* chat's logprobs: true (gen.logprobs holds the count either way) */
    int top_logprobs; /* chat's top_logprobs, -1 when absent */
    char *cache_key; /* prompt_cache_key, or NULL */
};

/* An OpenAI error: HTTP status and the fields of {"error": {...}}. */
struct oai_error {
    int status;
    const char *type;  /* "invalid_request_error", "authentication_error", "server_error", ... */
    char param[64];    /* the offending field, or "" (a copy: keys die with their JSON) */
    const char *code;  /* e.g. "context_length_exceeded", or NULL */
    char message[256];
};
void oai_error_set(struct oai_error *e, int status, const char *type, const char *param, const char *code,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* Parses and checks a body; 0, or -1 with e filled (a 400 naming the field). */
int oai_parse_request(const char *body, size_t len, enum oai_kind kind, struct oai_request *r, struct oai_error *e);
void oai_request_free(struct oai_request *r);

struct oai_usage {
    int prompt_tokens, completion_tokens, cached_tokens;
};

/* Log-probabilities of generated tokens for a response or chunk; piece writes a
 * token's bytes as kvq_token_bytes does (ctx: its model). */
struct oai_logprobs {
    const struct lp_entry *v;
    int n;
    int (*piece)(const void *ctx, kvq_token t, char *buf, int size);
    const void *ctx;
};

/* The JSON texts (malloc'd; NULL when out of memory). lp NULL: "logprobs": null;
 * else chat's {"content": [...]} or the completions' {"tokens", "token_logprobs",
 * "top_logprobs", "text_offset"} (offsets into the generated text). */
char *oai_error_json(const struct oai_error *e);
char *oai_response_json(enum oai_kind kind, const char *id, long created, const char *model, const char *text,
                        size_t text_len, const char *finish_reason, const struct oai_usage *u,
                        const struct oai_logprobs *lp);
/* One stream chunk: chat chunks carry delta.role when first, delta.content when text
 * is non-NULL; finish_reason NULL while running. */
char *oai_chunk_json(enum oai_kind kind, const char *id, long created, const char *model, bool first,
                     const char *text, size_t text_len, const char *finish_reason, const struct oai_logprobs *lp);
/* The include_usage chunk: choices [] and usage. */
char *oai_usage_chunk_json(enum oai_kind kind, const char *id, long created, const char *model,
                           const struct oai_usage *u);
char *oai_models_json(const char *model, long created);

#endif
