/* Chat prompts: a conversation rendered through the model's own Jinja chat template
 * (tokenizer.chat_template in the GGUF, its tool_use variant when a request has
 * tools), or a built-in template by name, or a template file. */
#ifndef KVQ_SERVER_CHAT_TEMPLATE_H
#define KVQ_SERVER_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

struct json_t;
struct chat_template;

/* The Jinja text of a built-in template ("chatml", "llama2", "llama3", "mistral",
 * "gemma", "phi3", "zephyr"; also "qwen", "llama-2", "llama-3", "phi-3"), or NULL. */
const char *chat_template_builtin(const char *name);
extern const char chat_template_builtin_names[]; /* for messages: "chatml, llama2, ..." */

struct chat_template_params {
    const char *text;          /* the template */
    const char *tool_use_text; /* used when a request has tools; NULL: text */
    const char *bos, *eos;     /* the text of the model's BOS and EOS tokens ("" if none) */
    bool strip_bos;            /* drop a leading BOS text: the tokenizer adds BOS itself */
};

/* NULL with a message in err when a template does not parse. */
struct chat_template *chat_template_new(const struct chat_template_params *p, char *err, size_t err_size);
void chat_template_free(struct chat_template *t);
/* The template renders tools, tool calls and tool results itself (its text mentions
 * them); else they are written into the messages beforehand (tool_messages). */
bool chat_template_takes_tools(const struct chat_template *t);

/* What a prompt is rendered from: messages (a JSON array of OpenAI chat messages),
 * tools (a JSON array, or NULL) and extra variables (a JSON object such as
 * {"enable_thinking": false}, or NULL; they do not replace the ones above). */
struct chat_request {
    const struct json_t *messages, *tools, *extra;
    bool add_generation_prompt;
};

/* The prompt, malloc'd; NULL with the template's message in err when it refuses
 * the conversation (e.g. raise_exception on roles that do not alternate). */
char *chat_template_apply(const struct chat_template *t, const struct chat_request *q, char *err, size_t err_size);

#endif
