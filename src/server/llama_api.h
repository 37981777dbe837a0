/* The endpoints beside OpenAI's completions: llama-server's /tokenize, /detokenize and
 * /apply-template, and /v1/embeddings over a context of its own. Each takes a request
 * body and returns the JSON answer (malloc'd), or NULL with e set (a 4xx naming the
 * field, or a 500). */
#ifndef KVQ_SERVER_LLAMA_API_H
#define KVQ_SERVER_LLAMA_API_H

#include <stdbool.h>
#include <stddef.h>

#include "kvq.h"
#include "server/chat_template.h"
#include "server/openai_json.h"
#include "server/tool_calls.h"

/* {"content", "add_special" (false), "parse_special" (true), "with_pieces" (false)} ->
 * {"tokens": [ids]}, or [{"id", "piece"}] with pieces (a string, or a list of bytes
 * where the piece is not valid UTF-8 alone). */
char *api_tokenize(const struct kvq_model *m, const char *body, size_t len, struct oai_error *e);
/* {"tokens": [ids]} -> {"content": text}. */
char *api_detokenize(const struct kvq_model *m, const char *body, size_t len, struct oai_error *e);
/* {"messages": [...], "tools": ...} -> {"prompt": the text the chat template makes of them}. */
char *api_apply_template(const struct chat_template *chat, enum tool_syntax s, const char *body, size_t len,
                         bool strict, struct oai_error *e);
/* A chat request's prompt text through the chat template, with its tools (when they
 * may be called), earlier tool calls and tool results: given to the template, or
 * written into the messages in syntax s when the template has no word for them.
 * Malloc'd; NULL with e set (a 400 when the template refuses the conversation). */
char *api_render_chat(const struct chat_template *chat, enum tool_syntax s, const struct oai_request *q,
                      struct oai_error *e);

/* The tokens of text (kvq_tokenize's flags) in a malloc'd *out; their count, -1 on error. */
int api_tokenize_text(const struct kvq_model *m, const char *text, size_t len, bool add, bool parse, kvq_token **out);
/* The text of token ids, as valid UTF-8 (malloc'd; NULL when out of memory). */
char *api_detokenize_text(const struct kvq_model *m, const kvq_token *ids, int n);

/* Embeddings: one sequence of a context made for them, one request at a time. */
struct embedder;
struct embedder *embedder_new(struct kvq_model *m, int n_ctx, int n_threads, enum kvq_pooling pooling);
void embedder_free(struct embedder *em);
char *api_embeddings(struct embedder *em, const char *model_id, const char *body, size_t len, bool strict,
                     struct oai_error *e);

#endif
