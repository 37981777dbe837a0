/* Chat templates: the common families recognised by marker strings in a GGUF's
 * tokenizer.chat_template (there is no C Jinja engine), rendered in C. */
#ifndef KVQ_SERVER_CHAT_TEMPLATE_H
#define KVQ_SERVER_CHAT_TEMPLATE_H

#include <stdbool.h>

enum chat_family {
    CHAT_CHATML, /* also Qwen */
    CHAT_LLAMA2,
    CHAT_LLAMA3,
    CHAT_MISTRAL,
    CHAT_GEMMA,
    CHAT_PHI3,
    CHAT_ZEPHYR,
    CHAT_UNKNOWN,
};

struct chat_message {
    const char *role; /* "system", "user", "assistant" (others are passed through as given) */
    const char *content;
};

/* The family whose markers the template text holds; CHAT_UNKNOWN when none match. */
enum chat_family chat_template_detect(const char *tmpl);
/* "chatml", "llama2", ... and back (CHAT_UNKNOWN for an unknown name). */
const char *chat_family_name(enum chat_family f);
enum chat_family chat_family_from_name(const char *name);
/* The text of the family's BOS / EOS tokens as its templates write them. */
const char *chat_family_bos(enum chat_family f);
const char *chat_family_eos(enum chat_family f);

/* Renders messages as the family's template does with add_generation_prompt = true,
 * bos/eos being the text of those tokens (""), e.g. "<s>". Returns a malloc'd
 * string, NULL when out of memory. */
char *chat_template_render(enum chat_family f, const struct chat_message *msgs, int n, const char *bos,
                           const char *eos);

#endif
