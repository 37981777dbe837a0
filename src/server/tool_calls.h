/* Function calling in the model's own syntax: which syntax a chat template uses,
 * the tools and earlier calls and results written into the messages (a fallback
 * for templates that do not render them), the grammar that forces a call, and the calls
 * parsed back out of generated text. */
#ifndef KVQ_SERVER_TOOL_CALLS_H
#define KVQ_SERVER_TOOL_CALLS_H

#include <stdbool.h>
#include <stddef.h>

struct json_t;

enum tool_syntax {
    TOOL_SYNTAX_HERMES,  /* <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (Qwen, Hermes, ChatML) */
    TOOL_SYNTAX_LLAMA3,  /* {"name": ..., "parameters": {...}} (Llama 3.1+) */
    TOOL_SYNTAX_MISTRAL, /* [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] */
};

/* A tool of a request: a function. */
struct tool_def {
    char *name;
    char *parameters; /* JSON Schema text ("{}" when not given) */
    char *json;       /* the whole {"type": "function", "function": {...}} as sent */
};

struct tool_call {
    char *id;        /* "call_..." */
    char *name;
    char *arguments; /* JSON text of the arguments object */
};

/* The syntax the chat template's text shows (NULL: none): Hermes unless it shows another. */
enum tool_syntax tool_syntax_detect(const char *template_text);
const char *tool_syntax_name(enum tool_syntax s);

/* For a template that never mentions tools: the messages (a JSON array as
 * oai_request holds them) with the tools described in the system message (n_tools
 * may be 0), assistant tool_calls and tool results written as text in the syntax's
 * way. A new array; NULL when out of memory. */
struct json_t *tool_messages(enum tool_syntax s, const struct json_t *messages, const struct tool_def *tools,
                             int n_tools);

/* The grammar that makes the model call one of the tools (only the one named, when
 * only is not NULL): a JSON Schema text (malloc'd) and the literal text around it.
 * NULL with *err when a tool's parameters are not a JSON object. */
char *tool_call_schema(enum tool_syntax s, const struct tool_def *tools, int n_tools, const char *only,
                       const char **prefix, const char **suffix, const char **err);

/* The calls in generated text: 0 and *n_calls = 0 when it holds none (it is plain
 * content then), else the calls (malloc'd, free with tool_calls_free) and in
 * *content_len how much of the text before them is content. -1 out of memory. */
int tool_calls_parse(enum tool_syntax s, const char *text, size_t len, struct tool_call **calls, int *n_calls,
                     size_t *content_len);
void tool_calls_free(struct tool_call *calls, int n);

/* While streaming: how much of the text so far may go out as content, short of
 * what could be the start of a tool call. */
size_t tool_stream_safe(enum tool_syntax s, const char *text, size_t len);

#endif
