/* Each renderer follows its family's reference Jinja template (Hugging Face
 * tokenizer_config.json) with add_generation_prompt = true; where a template has
 * no system role (Mistral, Gemma) the system text is put in front of the first
 * user message, as the later versions of those templates do. */
#include "server/chat_template.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "server/strbuf.h"

static const char *const names[] = {"chatml", "llama2", "llama3", "mistral", "gemma", "phi3", "zephyr"};

const char *chat_family_name(enum chat_family f) { return f < CHAT_UNKNOWN ? names[f] : "unknown"; }

enum chat_family chat_family_from_name(const char *name) {
    for (int i = 0; i < CHAT_UNKNOWN; i++)
        if (strcmp(name, names[i]) == 0) return (enum chat_family)i;
    if (strcmp(name, "qwen") == 0) return CHAT_CHATML;
    if (strcmp(name, "llama-2") == 0) return CHAT_LLAMA2;
    if (strcmp(name, "llama-3") == 0) return CHAT_LLAMA3;
    if (strcmp(name, "phi-3") == 0) return CHAT_PHI3;
    return CHAT_UNKNOWN;
}

enum chat_family chat_template_detect(const char *t) {
    /* Order matters: Phi-3 and Zephyr share <|user|>; Llama 2 and Mistral share [INST]. */
    if (strstr(t, "<|im_start|>")) return CHAT_CHATML;
    if (strstr(t, "<|start_header_id|>")) return CHAT_LLAMA3;
    if (strstr(t, "<start_of_turn>")) return CHAT_GEMMA;
    if (strstr(t, "<|end|>") && strstr(t, "<|assistant|>")) return CHAT_PHI3;
    if (strstr(t, "<|user|>")) return CHAT_ZEPHYR;
    if (strstr(t, "[INST]") && strstr(t, "<<SYS>>")) return CHAT_LLAMA2;
    if (strstr(t, "[INST]")) return CHAT_MISTRAL;
    return CHAT_UNKNOWN;
}

const char *chat_family_bos(enum chat_family f) {
    switch (f) {
    case CHAT_LLAMA2:
    case CHAT_MISTRAL:
    case CHAT_PHI3:
    case CHAT_ZEPHYR: return "<s>";
    case CHAT_LLAMA3: return "<|begin_of_text|>";
    case CHAT_GEMMA: return "<bos>";
    default: return "";
    }
}

const char *chat_family_eos(enum chat_family f) {
    switch (f) {
    case CHAT_LLAMA2:
    case CHAT_MISTRAL:
    case CHAT_PHI3:
    case CHAT_ZEPHYR: return "</s>";
    case CHAT_LLAMA3: return "<|eot_id|>";
    case CHAT_GEMMA: return "<eos>";
    default: return "<|im_end|>";
    }
}

/* Appends s with surrounding whitespace removed (Jinja's trim, Python's strip). */
static void add_trimmed(struct strbuf *b, const char *s) {
    size_t n = strlen(s);
    while (n && isspace((unsigned char)*s)) s++, n--;
    while (n && isspace((unsigned char)s[n - 1])) n--;
    strbuf_addn(b, s, n);
}

static bool is_role(const struct chat_message *m, const char *role) { return strcmp(m->role, role) == 0; }

/* Llama 2: the system text goes inside the first [INST] between <<SYS>> markers;
 * every user turn opens with BOS; the whole content is stripped. */
static void render_llama2(struct strbuf *b, const struct chat_message *m, int n, const char *bos, const char *eos) {
    const char *sys = n > 0 && is_role(&m[0], "system") ? m[0].content : NULL;
    int first = sys ? 1 : 0;
    for (int i = first; i < n; i++) {
        struct strbuf content = {0};
        if (i == first && sys) strbuf_printf(&content, "<<SYS>>\n%s\n<</SYS>>\n\n", sys);
        strbuf_add(&content, m[i].content);
        const char *c = content.s ? content.s : "";
        if (is_role(&m[i], "user")) {
            strbuf_add(b, bos);
            strbuf_add(b, "[INST] ");
            add_trimmed(b, c);
            strbuf_add(b, " [/INST]");
        } else if (is_role(&m[i], "assistant")) {
            strbuf_add(b, " ");
            add_trimmed(b, c);
            strbuf_add(b, " ");
            strbuf_add(b, eos);
        }
        if (content.oom) b->oom = true;
        strbuf_free(&content);
    }
}

/* Mistral and Gemma have no system role: it becomes a paragraph in front of the first user turn. */
static const char *folded_system(const struct chat_message *m, int n, int *first) {
    *first = n > 0 && is_role(&m[0], "system") ? 1 : 0;
    return *first ? m[0].content : NULL;
}

static void render_mistral(struct strbuf *b, const struct chat_message *m, int n, const char *bos, const char *eos) {
    int first;
    const char *sys = folded_system(m, n, &first);
    strbuf_add(b, bos);
    for (int i = first; i < n; i++) {
        if (is_role(&m[i], "assistant")) {
            strbuf_add(b, m[i].content);
            strbuf_add(b, eos);
            continue;
        }
        strbuf_add(b, "[INST] ");
        if (sys && i == first) strbuf_printf(b, "%s\n\n", sys);
        strbuf_add(b, m[i].content);
        strbuf_add(b, " [/INST]");
    }
}

static void render_gemma(struct strbuf *b, const struct chat_message *m, int n, const char *bos) {
    int first;
    const char *sys = folded_system(m, n, &first);
    strbuf_add(b, bos);
    for (int i = first; i < n; i++) {
        strbuf_printf(b, "<start_of_turn>%s\n", is_role(&m[i], "assistant") ? "model" : m[i].role);
        if (sys && i == first) strbuf_printf(b, "%s\n\n", sys);
        add_trimmed(b, m[i].content);
        strbuf_add(b, "<end_of_turn>\n");
    }
    strbuf_add(b, "<start_of_turn>model\n");
}

char *chat_template_render(enum chat_family f, const struct chat_message *m, int n, const char *bos,
                           const char *eos) {
    struct strbuf b = {0};
    switch (f) {
    case CHAT_LLAMA2: render_llama2(&b, m, n, bos, eos); break;
    case CHAT_MISTRAL: render_mistral(&b, m, n, bos, eos); break;
    case CHAT_GEMMA: render_gemma(&b, m, n, bos); break;
    case CHAT_LLAMA3:
        strbuf_add(&b, bos);
        for (int i = 0; i < n; i++) {
            strbuf_printf(&b, "<|start_header_id|>%s<|end_header_id|>\n\n", m[i].role);
            add_trimmed(&b, m[i].content);
            strbuf_add(&b, "<|eot_id|>");
        }
        strbuf_add(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case CHAT_PHI3:
        for (int i = 0; i < n; i++) strbuf_printf(&b, "<|%s|>\n%s<|end|>\n", m[i].role, m[i].content);
        strbuf_add(&b, "<|assistant|>\n");
        break;
    case CHAT_ZEPHYR:
        for (int i = 0; i < n; i++) strbuf_printf(&b, "<|%s|>\n%s%s\n", m[i].role, m[i].content, eos);
        strbuf_add(&b, "<|assistant|>\n");
        break;
    default:
        for (int i = 0; i < n; i++) strbuf_printf(&b, "<|im_start|>%s\n%s<|im_end|>\n", m[i].role, m[i].content);
        strbuf_add(&b, "<|im_start|>assistant\n");
        break;
    }
    return strbuf_take(&b);
}
