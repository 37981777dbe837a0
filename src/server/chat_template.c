/* Chat templates rendered as written, with the variables transformers'
 * apply_chat_template passes: messages, tools (None when absent), documents
 * (None), add_generation_prompt, bos_token, eos_token; strftime_now reads the
 * clock. The built-in templates are the public templates of their families, for
 * models whose GGUF has none. */
#include "server/chat_template.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/jinja.h"

static const struct {
    const char *name, *text;
} builtins[] = {
    {"chatml", "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"},
    {"llama2", "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
               "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
               "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0)"
               " %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + "
               "system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = "
               "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
               "content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + "
               "' ' + eos_token }}{% endif %}{% endfor %}"},
    {"llama3", "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"},
    {"mistral", "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
                "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
                "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
                "{%- if loop.first and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + "
                "message['content'] + ' [/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
                "{%- endif %}{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
                "{%- endif %}{%- endfor %}"},
    {"gemma", "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = "
              "messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}"
              "{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}"
              "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
              "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
              "{%- endif -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
              "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\\n' + "
              "(first_user_prefix if loop.first else \"\") }}{{ message['content'] | trim }}"
              "{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}"
              "{%- endif -%}"},
    {"phi3", "{% for message in messages %}{{'<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n'}}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"},
    {"zephyr", "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + "
               "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"},
};

const char chat_template_builtin_names[] = "chatml, llama2, llama3, mistral, gemma, phi3, zephyr";

const char *chat_template_builtin(const char *name) {
    static const struct {
        const char *alias, *name;
    } aliases[] = {{"qwen", "chatml"}, {"llama-2", "llama2"}, {"llama-3", "llama3"}, {"phi-3", "phi3"}};
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (!strcmp(name, aliases[i].alias)) name = aliases[i].name;
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++)
        if (!strcmp(name, builtins[i].name)) return builtins[i].text;
    return NULL;
}

struct chat_template {
    struct jinja_template *main, *tool_use;
    char *bos, *eos;
    bool strip_bos;
    bool takes_tools; /* the template text mentions tools (or has a tool_use variant) */
};

struct chat_template *chat_template_new(const struct chat_template_params *p, char *err, size_t err_size) {
    struct chat_template *t = calloc(1, sizeof *t);
    if (!t || !(t->bos = strdup(p->bos ? p->bos : "")) || !(t->eos = strdup(p->eos ? p->eos : ""))) {
        snprintf(err, err_size, "out of memory");
        chat_template_free(t);
        return NULL;
    }
    t->strip_bos = p->strip_bos;
    t->takes_tools = p->tool_use_text || strstr(p->text, "tool");
    if (!p->text[strspn(p->text, " \t\r\n")]) {
        snprintf(err, err_size, "the chat template is empty");
        chat_template_free(t);
        return NULL;
    }
    char msg[256] = "";
    if (!(t->main = jinja_parse(p->text, msg, sizeof msg))) {
        snprintf(err, err_size, "the chat template does not parse: %s", msg);
        chat_template_free(t);
        return NULL;
    }
    if (p->tool_use_text) {
        if (!(t->tool_use = jinja_parse(p->tool_use_text, msg, sizeof msg))) {
            snprintf(err, err_size, "the tool_use chat template does not parse: %s", msg);
            chat_template_free(t);
            return NULL;
        }
    }
    return t;
}

void chat_template_free(struct chat_template *t) {
    if (!t) return;
    jinja_free(t->main);
    jinja_free(t->tool_use);
    free(t->bos);
    free(t->eos);
    free(t);
}

bool chat_template_takes_tools(const struct chat_template *t) { return t->takes_tools; }

/* messages with each tool call's string arguments that hold a JSON object replaced
 * by that object (a new reference), or NULL when there are none. */
static json_t *object_arguments(const json_t *messages) {
    size_t i, k;
    json_t *m, *call;
    bool any = false;
    json_array_foreach(messages, i, m) any = any || json_array_size(json_object_get(m, "tool_calls")) > 0;
    json_t *copy = any ? json_deep_copy(messages) : NULL;
    bool changed = false;
    json_array_foreach(copy, i, m) {
        json_array_foreach(json_object_get(m, "tool_calls"), k, call) {
            json_t *fn = json_object_get(call, "function"), *args = json_object_get(fn, "arguments");
            json_t *parsed = json_is_string(args) ? json_loads(json_string_value(args), JSON_DECODE_ANY, NULL) : NULL;
            if (json_is_object(parsed)) changed = json_object_set(fn, "arguments", parsed) == 0 || changed;
            json_decref(parsed);
        }
    }
    if (!changed) json_decref(copy);
    return changed ? copy : NULL;
}

static char *render(const struct chat_template *t, const struct jinja_template *tmpl, const struct chat_request *q,
                    const json_t *messages, bool with_tools, char *err, size_t err_size) {
    json_t *vars = json_is_object(q->extra) ? json_deep_copy(q->extra) : json_object();
    if (!vars) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    json_object_set_new(vars, "messages", json_deep_copy(messages));
    json_object_set_new(vars, "tools", with_tools ? json_deep_copy(q->tools) : json_null());
    json_object_set_new(vars, "documents", json_null());
    json_object_set_new(vars, "add_generation_prompt", json_boolean(q->add_generation_prompt));
    json_object_set_new(vars, "bos_token", json_string(t->bos));
    json_object_set_new(vars, "eos_token", json_string(t->eos));
    char *text = jinja_render(tmpl, vars, time(NULL), err, err_size);
    json_decref(vars);
    return text;
}

char *chat_template_apply(const struct chat_template *t, const struct chat_request *q, char *err, size_t err_size) {
    bool with_tools = json_is_array(q->tools) && json_array_size(q->tools) > 0;
    const struct jinja_template *tmpl = with_tools && t->tool_use ? t->tool_use : t->main;
    /* Tool-call arguments go in as objects first, as Hugging Face's examples pass
     * them and templates that print them with tojson or .items() need (Llama 3.x,
     * Qwen2.5, Mistral, GLM); OpenAI clients send a JSON string, which templates
     * that concatenate it (DeepSeek-R1) need: they get it when objects fail. */
    json_t *objects = object_arguments(q->messages);
    char *text = objects ? render(t, tmpl, q, objects, with_tools, err, err_size) : NULL;
    if (!text) text = render(t, tmpl, q, q->messages, with_tools, err, err_size);
    json_decref(objects);
    size_t nb = strlen(t->bos);
    if (text && t->strip_bos && nb && !strncmp(text, t->bos, nb)) memmove(text, text + nb, strlen(text + nb) + 1);
    return text;
}
