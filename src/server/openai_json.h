/* OpenAI request bodies to generation parameters, and the response, stream chunk
 * and error objects back to JSON text (jansson). Pure functions: no engine calls. */
#ifndef KVQ_SERVER_OPENAI_JSON_H
#define KVQ_SERVER_OPENAI_JSON_H

#include <stdbool.h>
#include <stddef.h>

#include "server/scheduler.h"
#include "server/tool_calls.h"

struct json_t;

enum oai_kind { OAI_CHAT, OAI_COMPLETION };
enum oai_tool_choice { OAI_TOOLS_AUTO, OAI_TOOLS_NONE, OAI_TOOLS_REQUIRED, OAI_TOOLS_NAMED };

#define OAI_MAX_PROMPTS 256 /* prompts in one completions request */
#define OAI_MAX_N 128       /* choices per prompt */

/* One prompt of a completions request: text, or token ids (used as they are). */
struct oai_prompt {
    char *text;
    kvq_token *ids;
    int n_ids;
};

struct oai_request {
    enum oai_kind kind;
    struct json_t *messages; /* chat: the messages for the template (see get_messages) */
    struct json_t *tools_json; /* chat: the tools list as sent, for the template, or NULL */
    struct json_t *template_kwargs; /* chat: chat_template_kwargs (vLLM's and llama.cpp's), or NULL */
    struct oai_prompt *prompts; /* completion: one or more */
    int n_prompts;
    int n;     /* choices per prompt */
    bool echo; /* completion: the prompt's text comes before each answer's */
    int best_of; /* 0 when absent; else it equals n */
    struct gen_params gen;
    bool stream, include_usage;
    bool has_seed; /* else the caller picks a fresh seed */
    bool logprobs;    /* chat's logprobs: true (gen.logprobs holds the count either way) */
    int top_logprobs; /* chat's top_logprobs, -1 when absent */
    char *cache_key; /* prompt_cache_key, or NULL */
    /* response_format's JSON Schema text ({"type":"object"} for json_object), or NULL */
    char *response_schema;
    struct tool_def *tools; /* chat's tools (functions) */
    int n_tools;
    enum oai_tool_choice tool_choice;
    char *tool_name; /* the function tool_choice names */
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

/* Parses and checks a body; 0, or -1 with e filled (a 400 naming the field). Fields
 * this server does not use (vLLM's and llama.cpp's extensions it does not apply, and
 * unknown ones) are ignored, each name logged once to stderr; strict: those are a 400
 * as OpenAI's server has it (only top_k, min_p and repeat_penalty are accepted). */
int oai_parse_request(const char *body, size_t len, enum oai_kind kind, bool strict, struct oai_request *r,
                      struct oai_error *e);
void oai_request_free(struct oai_request *r);
/* The request has tools that may be called (tool_choice is not "none"). */
bool oai_tools_on(const struct oai_request *q);

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
/* One choice of a response (index: its place in the list). With tool calls (chat),
 * text is the content before them (none: null) and finish_reason "tool_calls". */
struct oai_choice {
    const char *text;
    size_t text_len;
    const char *finish_reason;
    const struct oai_logprobs *lp;
    const struct tool_call *calls;
    int n_calls;
};
char *oai_response_json_n(enum oai_kind kind, const char *id, long created, const char *model,
                          const struct oai_choice *ch, int n, const struct oai_usage *u);
/* A response of one choice. */
char *oai_response_json(enum oai_kind kind, const char *id, long created, const char *model, const char *text,
                        size_t text_len, const char *finish_reason, const struct oai_usage *u,
                        const struct oai_logprobs *lp);
/* One stream chunk of choice `index`: chat chunks carry delta.role when first,
 * delta.content when text is non-NULL; finish_reason NULL while running. */
char *oai_chunk_json(enum oai_kind kind, const char *id, long created, const char *model, int index, bool first,
                     const char *text, size_t text_len, const char *finish_reason, const struct oai_logprobs *lp);
/* The include_usage chunk: choices [] and usage. */
char *oai_usage_chunk_json(enum oai_kind kind, const char *id, long created, const char *model,
                           const struct oai_usage *u);
char *oai_models_json(const char *model, long created);

/* /v1/embeddings: input as a string, strings, token ids or lists of them. */
struct oai_embed_request {
    struct oai_prompt *inputs;
    int n_inputs;
    bool base64;    /* encoding_format "base64" */
    int dimensions; /* 0 when absent */
};
int oai_parse_embeddings(const char *body, size_t len, bool strict, struct oai_embed_request *r, struct oai_error *e);
void oai_embed_request_free(struct oai_embed_request *r);
/* The list of n vectors [n][dim] (as floats or base64) with the usage. */
char *oai_embeddings_json(const char *model, const float *vectors, int n, int dim, bool base64, int prompt_tokens);

/* A chat stream chunk of choice `index` with delta.tool_calls (each with its index, id,
 * type, name and the whole arguments). */
char *oai_tool_chunk_json(const char *id, long created, const char *model, int index, const struct tool_call *calls,
                          int n_calls);

#endif
