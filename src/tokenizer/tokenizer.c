/* Tokenizer: loading from GGUF metadata, special-token splitting, the encode
 * driver (SPM or BPE per text fragment), token -> bytes, and the streaming
 * detokenizer. Behaviour follows llama.cpp's llama-vocab so that ids match. */
#include "tokenizer/tokenizer.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tok_internal.h"

#define KEY_MODEL "tokenizer.ggml.model"
#define KEY_PRE "tokenizer.ggml.pre"
#define KEY_TOKENS "tokenizer.ggml.tokens"
#define KEY_SCORES "tokenizer.ggml.scores"
#define KEY_TYPES "tokenizer.ggml.token_type"
#define KEY_MERGES "tokenizer.ggml.merges"

/* ------------------------------------------------------------------------ */
/* Loading                                                                  */
/* ------------------------------------------------------------------------ */

/* An optional per-token array: absent (*out NULL), or of the element type llama.cpp
 * writes with one entry per token. */
static int token_array(const struct gguf_file *f, const char *key, enum gguf_type type, uint64_t n,
                       const struct gguf_value **out) {
    const struct gguf_value *v = *out = gguf_find(f, key);
    if (!v) return 0;
    if (v->type != GGUF_TYPE_ARRAY || v->arr.elem_type != type)
        return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: %s must be an array of %s, not %s%s", key,
                              gguf_type_name(type), v->type == GGUF_TYPE_ARRAY ? "an array of " : "",
                              gguf_type_name(v->type == GGUF_TYPE_ARRAY ? v->arr.elem_type : v->type));
    if (v->arr.n != n)
        return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: %s has %llu entries for %llu tokens", key,
                              (unsigned long long)v->arr.n, (unsigned long long)n);
    return 0;
}

static int load_tokens(struct tokenizer *t, const struct gguf_file *f) {
    const struct gguf_value *toks = gguf_get_arr(f, KEY_TOKENS, GGUF_TYPE_STRING);
    if (!toks) return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: missing string array %s", KEY_TOKENS);
    if (toks->arr.n == 0 || toks->arr.n > INT32_MAX / 2)
        return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: bad vocabulary size %llu", (unsigned long long)toks->arr.n);
    t->n_vocab = (int32_t)toks->arr.n;

    const struct gguf_value *scores, *types;
    if (token_array(f, KEY_SCORES, GGUF_TYPE_FLOAT32, toks->arr.n, &scores) ||
        token_array(f, KEY_TYPES, GGUF_TYPE_INT32, toks->arr.n, &types))
        return -1;
    for (uint64_t i = 0; i < toks->arr.n; i++) {
        double score = scores ? gguf_arr_f64(scores, i) : 0;
        int64_t type = types ? gguf_arr_i64(types, i) : TOK_TYPE_NORMAL;
        if (!isfinite(score))
            return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: %s of token %llu is not finite", KEY_SCORES,
                                  (unsigned long long)i);
        /* llama.cpp's writers use 1 (normal) .. 6 (byte); 0 (undefined) is never written */
        if (type < TOK_TYPE_NORMAL || type > TOK_TYPE_BYTE)
            return kvq_error_code(KVQ_ERR_FORMAT,
                                  "tokenizer: %s of token %llu is %lld, not one of llama.cpp's types 1..6", KEY_TYPES,
                                  (unsigned long long)i, (long long)type);
    }

    /* Empty token texts get a placeholder name, as llama.cpp does. */
    size_t blob = 0;
    for (uint64_t i = 0; i < toks->arr.n; i++) blob += toks->arr.strs[i].len ? toks->arr.strs[i].len : 24;
    if (blob > UINT32_MAX) return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: vocabulary text too large");
    t->text_blob = malloc(blob ? blob : 1);
    t->tokens = calloc((size_t)t->n_vocab, sizeof *t->tokens);
    if (!t->text_blob || !t->tokens || strmap_init(&t->vocab, (size_t)t->n_vocab) != 0)
        return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");

    uint32_t off = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        struct gguf_str s = toks->arr.strs[i];
        struct tok_entry *e = &t->tokens[i];
        e->off = off;
        if (s.len) {
            memcpy(t->text_blob + off, s.ptr, s.len);
            e->len = (uint32_t)s.len;
        } else {
            e->len = (uint32_t)snprintf(t->text_blob + off, 24, "[EMPTY_%d]", (int)i);
        }
        off += e->len;
        e->score = scores ? (float)gguf_arr_f64(scores, (uint64_t)i) : 0.0f;
        e->type = types ? (uint8_t)gguf_arr_i64(types, (uint64_t)i) : TOK_TYPE_NORMAL;
        int32_t dup;
        int rc = strmap_put(&t->vocab, t->text_blob + e->off, e->len, i, &dup);
        if (rc < 0) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
        if (rc == 0)
            return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: duplicate token '%.*s' (ids %d and %d)", (int)e->len,
                                  t->text_blob + e->off, (int)dup, (int)i);
    }
    return 0;
}

/* Merges "left right" are stored verbatim: the lookup key left+' '+right is the
 * same string (llama.cpp splits each merge at its first space after index 0). */
static int load_merges(struct tokenizer *t, const struct gguf_file *f) {
    const struct gguf_value *m = gguf_get_arr(f, KEY_MERGES, GGUF_TYPE_STRING);
    if (!m) return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: missing string array %s", KEY_MERGES);
    if (m->arr.n > INT32_MAX) return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: too many merges");
    size_t blob = 0;
    for (uint64_t i = 0; i < m->arr.n; i++) blob += m->arr.strs[i].len;
    t->merge_blob = malloc(blob ? blob : 1);
    if (!t->merge_blob || strmap_init(&t->merges, (size_t)m->arr.n) != 0)
        return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
    size_t off = 0;
    for (uint64_t i = 0; i < m->arr.n; i++) {
        struct gguf_str s = m->arr.strs[i];
        if (s.len < 2 || s.len > UINT32_MAX || !memchr(s.ptr + 1, ' ', s.len - 1)) continue; /* no pair */
        memcpy(t->merge_blob + off, s.ptr, s.len);
        if (strmap_put(&t->merges, t->merge_blob + off, (uint32_t)s.len, (int32_t)i, NULL) < 0)
            return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
        off += s.len; /* a duplicate keeps its first (best) rank */
    }
    return 0;
}

static int32_t get_id(const struct gguf_file *f, const char *key, int32_t fallback, int32_t n_vocab) {
    uint32_t v;
    if (gguf_get_u32(f, key, &v) && v < (uint32_t)n_vocab) return (int32_t)v;
    return fallback >= 0 && fallback < n_vocab ? fallback : -1;
}

static bool get_bool(const struct gguf_file *f, const char *key, bool fallback) {
    bool v;
    return gguf_get_bool(f, key, &v) ? v : fallback;
}

static int32_t find_text(const struct tokenizer *t, const char *s) { return tok_lookup(t, s, strlen(s)); }

static void add_eog(struct tokenizer *t, int32_t id) {
    if (id < 0 || t->n_eog == TOK_MAX_EOG) return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return;
    t->eog[t->n_eog++] = id;
}

/* llama.cpp recognises end-of-turn tokens by their text and forces them to be
 * control tokens (which also keeps them from being split out of plain text). */
static void detect_eog(struct tokenizer *t, const struct gguf_file *f) {
    static const char *const eot_texts[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                            "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>",
                                            "<end_of_utterance>"};
    int32_t eot = get_id(f, "tokenizer.ggml.eot_token_id", -1, t->n_vocab);
    int32_t eom = get_id(f, "tokenizer.ggml.eom_token_id", -1, t->n_vocab);
    add_eog(t, t->eos);
    add_eog(t, eot);
    add_eog(t, eom);
    if (eom < 0) {
        int32_t id = find_text(t, "<|eom_id|>");
        if (id >= 0) t->tokens[id].type = TOK_TYPE_CONTROL, add_eog(t, id);
    }
    for (size_t i = 0; i < sizeof eot_texts / sizeof eot_texts[0]; i++) {
        int32_t id = find_text(t, eot_texts[i]);
        if (id < 0) continue;
        t->tokens[id].type = TOK_TYPE_CONTROL;
        add_eog(t, id);
    }
}

/* Control / user-defined / unknown tokens, longest text first: the order in
 * which their occurrences are split out of the input. */
static int build_special_list(struct tokenizer *t) {
    t->special = malloc((size_t)t->n_vocab * sizeof *t->special);
    if (!t->special) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
    for (int32_t i = 0; i < t->n_vocab; i++) {
        uint8_t ty = t->tokens[i].type;
        if (ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_USER_DEFINED || ty == TOK_TYPE_UNKNOWN) t->special[t->n_special++] = i;
    }
    /* insertion sort keeps equal lengths in id order; the list is short */
    for (int i = 1; i < t->n_special; i++) {
        int32_t id = t->special[i];
        int j = i;
        while (j > 0 && t->tokens[t->special[j - 1]].len < t->tokens[id].len) {
            t->special[j] = t->special[j - 1];
            j--;
        }
        t->special[j] = id;
    }
    return 0;
}

/* Per-model whitespace trimming that llama.cpp hard-codes (Phi-3's chat tokens
 * swallow the whitespace after them). */
static void apply_strip_rules(struct tokenizer *t, const struct gguf_file *f) {
    char name[256];
    if (!gguf_get_str(f, "general.name", name, sizeof name)) return;
    for (char *p = name; *p; p++) *p = (char)tolower((unsigned char)*p);
    if (!strstr(name, "phi-3") && !strstr(name, "phi3")) return;
    for (int i = 0; i < t->n_special; i++) t->tokens[t->special[i]].strip |= TOK_RSTRIP;
    int32_t id = find_text(t, "</s>");
    if (id >= 0) t->tokens[id].strip |= TOK_RSTRIP;
    static const char *const keep[] = {"<unk>", "<s>", "<|endoftext|>"};
    for (size_t i = 0; i < 3; i++)
        if ((id = find_text(t, keep[i])) >= 0) t->tokens[id].strip &= (uint8_t)~TOK_RSTRIP;
}

static void fill_spm_bytes(struct tokenizer *t) {
    for (int b = 0; b < 256; b++) {
        char hex[8];
        snprintf(hex, sizeof hex, "<0x%02X>", b);
        int32_t id = find_text(t, hex);
        if (id < 0) {
            char c = (char)b;
            id = tok_lookup(t, &c, 1);
        }
        t->spm_byte_token[b] = id;
    }
}

static int setup_kind(struct tokenizer *t, const struct gguf_file *f, bool *add_bos_default) {
    char model[64];
    if (!gguf_get_str(f, KEY_MODEL, model, sizeof model))
        return kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: missing %s", KEY_MODEL);
    if (strcmp(model, "llama") == 0) {
        t->kind = TOK_KIND_SPM;
        *add_bos_default = true;
        t->add_space_prefix = true;
        t->bos = 1, t->eos = 2, t->unk = 0;
        return 0;
    }
    if (strcmp(model, "gpt2") == 0) {
        t->kind = TOK_KIND_BPE;
        t->bos = 11, t->eos = 11, t->unk = -1; /* llama.cpp's defaults */
        char pre[128] = "";
        gguf_get_str(f, KEY_PRE, pre, sizeof pre);
        return pretok_init(&t->pre, pre, &t->ignore_merges, add_bos_default);
    }
    return kvq_error_code(KVQ_ERR_UNSUPPORTED, "tokenizer: unsupported tokenizer model '%s'", model);
}

struct tokenizer *tokenizer_from_gguf(const struct gguf_file *f) {
    struct tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
        return NULL;
    }
    bool add_bos_default = false;
    if (setup_kind(t, f, &add_bos_default) != 0 || load_tokens(t, f) != 0) goto fail;
    if (t->kind == TOK_KIND_BPE && load_merges(t, f) != 0) goto fail;
    bpe_fill_byte_table(t);
    fill_spm_bytes(t);

    t->bos = get_id(f, "tokenizer.ggml.bos_token_id", t->bos, t->n_vocab);
    t->eos = get_id(f, "tokenizer.ggml.eos_token_id", t->eos, t->n_vocab);
    t->unk = get_id(f, "tokenizer.ggml.unknown_token_id", t->unk, t->n_vocab);
    t->add_bos = get_bool(f, "tokenizer.ggml.add_bos_token", add_bos_default);
    t->add_eos = get_bool(f, "tokenizer.ggml.add_eos_token", false);
    t->add_space_prefix = get_bool(f, "tokenizer.ggml.add_space_prefix", t->add_space_prefix);
    if (t->add_bos && t->bos < 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: add_bos_token is set but there is no BOS token");
        goto fail;
    }
    if (t->add_eos && t->eos < 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "tokenizer: add_eos_token is set but there is no EOS token");
        goto fail;
    }
    detect_eog(t, f);
    if (build_special_list(t) != 0) goto fail;
    apply_strip_rules(t, f);
    return t;
fail:
    tokenizer_free(t);
    return NULL;
}

void tokenizer_free(struct tokenizer *t) {
    if (!t) return;
    pretok_free(&t->pre);
    strmap_free(&t->vocab);
    strmap_free(&t->merges);
    free(t->text_blob);
    free(t->merge_blob);
    free(t->tokens);
    free(t->special);
    free(t);
}

int32_t tokenizer_n_vocab(const struct tokenizer *t) { return t->n_vocab; }
int32_t tokenizer_bos(const struct tokenizer *t) { return t->bos; }
int32_t tokenizer_eos(const struct tokenizer *t) { return t->eos; }
bool tokenizer_add_bos(const struct tokenizer *t) { return t->add_bos; }
bool tokenizer_add_eos(const struct tokenizer *t) { return t->add_eos; }

bool tokenizer_is_eog(const struct tokenizer *t, int32_t id) {
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return true;
    return false;
}

/* ------------------------------------------------------------------------ */
/* Special-token splitting                                                  */
/* ------------------------------------------------------------------------ */

struct fragment {
    int32_t id; /* >= 0: a special token; -1: text [off, off+len) */
    size_t off, len;
};

struct frag_vec {
    struct fragment *data;
    size_t n, cap;
};

static int frag_push(struct frag_vec *v, int32_t id, size_t off, size_t len) {
    if (id < 0 && len == 0) return 0;
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 16;
        struct fragment *p = realloc(v->data, cap * sizeof *p);
        if (!p) return -1;
        v->data = p;
        v->cap = cap;
    }
    v->data[v->n++] = (struct fragment){id, off, len};
    return 0;
}

/* Splits every occurrence of one special token out of one text fragment. */
static int split_fragment(const struct tokenizer *t, int32_t id, const char *text, struct fragment fr, struct frag_vec *out) {
    size_t tlen;
    const char *tok = tok_text(t, id, &tlen);
    uint8_t strip = t->tokens[id].strip;
    size_t off = fr.off, len = fr.len;
    while (len > 0) {
        const char *m = memmem(text + off, len, tok, tlen);
        if (!m) break;
        size_t pos = (size_t)(m - text);
        size_t left = pos - off;
        if (strip & TOK_LSTRIP)
            while (left > 0 && isspace((unsigned char)text[off + left - 1])) left--;
        if (frag_push(out, -1, off, left) || frag_push(out, id, 0, 0)) return -1;
        size_t end = off + len;
        off = pos + tlen;
        if (strip & TOK_RSTRIP)
            while (off < end && isspace((unsigned char)text[off])) off++;
        len = end - off;
    }
    return frag_push(out, -1, off, len);
}

static int partition_special(const struct tokenizer *t, const char *text, size_t len, bool parse_special, struct frag_vec *frags) {
    struct frag_vec next = {0};
    if (frag_push(frags, -1, 0, len) != 0) return -1;
    for (int s = 0; s < t->n_special; s++) {
        int32_t id = t->special[s];
        uint8_t ty = t->tokens[id].type;
        /* user-defined tokens are always split out; control ones only on request */
        if (!parse_special && (ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_UNKNOWN)) continue;
        next.n = 0;
        for (size_t i = 0; i < frags->n; i++) {
            struct fragment fr = frags->data[i];
            int rc = fr.id >= 0 ? frag_push(&next, fr.id, 0, 0) : split_fragment(t, id, text, fr, &next);
            if (rc != 0) {
                free(next.data);
                return -1;
            }
        }
        struct frag_vec tmp = *frags;
        *frags = next;
        next = tmp;
    }
    free(next.data);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                 */
/* ------------------------------------------------------------------------ */

/* SentencePiece input: optional leading space, every space as U+2581. */
static int spm_fragment(const struct tokenizer *t, const char *p, size_t len, bool prefix_space, struct tok_vec *out) {
    char *buf = malloc((len + 1) * 3);
    if (!buf) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
    size_t n = 0;
    if (prefix_space) memcpy(buf, "\xE2\x96\x81", 3), n = 3;
    for (size_t i = 0; i < len; i++) {
        if (p[i] == ' ') {
            memcpy(buf + n, "\xE2\x96\x81", 3);
            n += 3;
        } else {
            buf[n++] = p[i];
        }
    }
    int rc = spm_tokenize(t, buf, n, out);
    free(buf);
    return rc;
}

static int encode_fragments(const struct tokenizer *t, const char *text, const struct frag_vec *frags, struct tok_vec *out) {
    bool prev_special = true; /* the first text fragment gets SentencePiece's dummy prefix */
    for (size_t i = 0; i < frags->n; i++) {
        const struct fragment *fr = &frags->data[i];
        if (fr->id >= 0) {
            if (tok_vec_push(out, fr->id) != 0) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
            prev_special = true;
            continue;
        }
        int rc = t->kind == TOK_KIND_SPM
                     ? spm_fragment(t, text + fr->off, fr->len, t->add_space_prefix && prev_special, out)
                     : bpe_tokenize(t, text + fr->off, fr->len, out);
        if (rc != 0) return -1;
        prev_special = false;
    }
    return 0;
}

int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool add_special, bool parse_special,
                     int32_t *out, int max_tokens) {
    if (!text && len) return kvq_error("tokenizer: NULL text");
    struct tok_vec v = {0};
    struct frag_vec frags = {0};
    int rc = 0;
    if (add_special && t->add_bos) rc = tok_vec_push(&v, t->bos);
    if (rc == 0 && len > 0) {
        rc = partition_special(t, text, len, parse_special, &frags);
        if (rc != 0) kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
        else rc = encode_fragments(t, text, &frags, &v);
    }
    if (rc == 0 && add_special && t->add_eos) rc = tok_vec_push(&v, t->eos);
    free(frags.data);
    if (rc != 0) {
        free(v.data);
        return -1;
    }
    if (v.n > INT_MAX) {
        free(v.data);
        return kvq_error("tokenizer: text needs more than INT_MAX tokens");
    }
    size_t n_copy = max_tokens > 0 && out ? (v.n < (size_t)max_tokens ? v.n : (size_t)max_tokens) : 0;
    if (n_copy) memcpy(out, v.data, n_copy * sizeof *out);
    free(v.data);
    return (int)v.n;
}

/* ------------------------------------------------------------------------ */
/* Decoding                                                                 */
/* ------------------------------------------------------------------------ */

/* Bounded writer: counts every byte, stores those that fit. */
struct bytes_out {
    char *buf;
    int cap, n;
};

static void put(struct bytes_out *o, const char *p, size_t len) {
    for (size_t i = 0; i < len; i++, o->n++)
        if (o->n < o->cap) o->buf[o->n] = p[i];
}

static void put_spm_text(struct bytes_out *o, const char *p, size_t len) {
    for (size_t i = 0; i < len;) {
        if (len - i >= 3 && memcmp(p + i, "\xE2\x96\x81", 3) == 0) {
            put(o, " ", 1);
            i += 3;
        } else {
            put(o, p + i, 1);
            i++;
        }
    }
}

/* Byte-level BPE text: every code point stands for one byte. */
static void put_bpe_text(struct bytes_out *o, const char *p, size_t len) {
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)p[i];
        size_t n = utf8_lead_len(c);
        if (n > len - i) n = len - i;
        uint32_t cp = n == 1 ? c : (uint32_t)(c & (0xFF >> (n + 1)));
        for (size_t k = 1; k < n; k++) cp = (cp << 6) | ((unsigned char)p[i + k] & 0x3Fu);
        int b = bpe_cp_to_byte(cp);
        if (b >= 0) {
            char ch = (char)b;
            put(o, &ch, 1);
        } else {
            put(o, p + i, n); /* not a mapped byte: keep it as it is */
        }
        i += n;
    }
}

/* "<0xAB>" -> 0xAB, or -1. */
static int parse_byte_token(const char *p, size_t len) {
    if (len != 6 || memcmp(p, "<0x", 3) != 0 || p[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        int c = (unsigned char)p[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else return -1;
        v = v * 16 + d;
    }
    return v;
}

int tokenizer_token_bytes(const struct tokenizer *t, int32_t id, bool render_special, char *buf, int buf_size) {
    if (id < 0 || id >= t->n_vocab) return kvq_error("tokenizer: token id %d out of range", (int)id);
    struct bytes_out o = {buf, buf_size > 0 ? buf_size : 0, 0};
    size_t len;
    const char *p = tok_text(t, id, &len);
    switch (t->tokens[id].type) {
    case TOK_TYPE_CONTROL:
    case TOK_TYPE_UNKNOWN:
        if (render_special) put(&o, p, len);
        break;
    case TOK_TYPE_USER_DEFINED:
        put(&o, p, len);
        break;
    case TOK_TYPE_BYTE: {
        int b = parse_byte_token(p, len);
        char ch = (char)b;
        if (b >= 0) put(&o, &ch, 1);
        else if (t->kind == TOK_KIND_BPE) put_bpe_text(&o, p, len);
        else put(&o, p, len);
        break;
    }
    case TOK_TYPE_NORMAL:
        if (t->kind == TOK_KIND_SPM) put_spm_text(&o, p, len);
        else put_bpe_text(&o, p, len);
        break;
    default: /* unused / undefined: nothing, like llama.cpp */
        break;
    }
    return o.n;
}

/* ------------------------------------------------------------------------ */
/* Streaming detokenizer                                                    */
/* ------------------------------------------------------------------------ */

void tokenizer_stream_init(struct tokenizer_stream *s, const struct tokenizer *t, bool strip_leading_space) {
    memset(s, 0, sizeof *s);
    s->t = t;
    s->strip_leading_space = strip_leading_space;
}

/* Length of the UTF-8 sequence a lead byte starts (0: not a valid lead). */
static int seq_len(unsigned char c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
}

static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Copies the complete sequences of in[0..n) to o; an incomplete but so far
 * valid tail is returned through tail/n_tail; broken bytes become U+FFFD. */
static void emit_complete(const unsigned char *in, int n, struct bytes_out *o, const unsigned char **tail, int *n_tail) {
    *n_tail = 0;
    for (int i = 0; i < n;) {
        int need = seq_len(in[i]);
        if (need == 0) {
            put(o, REPLACEMENT, 3);
            i++;
            continue;
        }
        int k = 1;
        while (k < need && i + k < n && (in[i + k] & 0xC0) == 0x80) k++;
        if (k == need) {
            put(o, (const char *)in + i, (size_t)need);
            i += need;
        } else if (i + k == n) { /* ran out of input: wait for the rest */
            *tail = in + i;
            *n_tail = k;
            return;
        } else {
            put(o, REPLACEMENT, 3);
            i++;
        }
    }
}

int tokenizer_stream_feed(struct tokenizer_stream *s, int32_t id, char *out, int out_size) {
    char small[256];
    int n = tokenizer_token_bytes(s->t, id, false, small, sizeof small);
    if (n < 0) return -1;
    int total = s->n_pending + n;
    unsigned char *in = malloc((size_t)total + 1);
    if (!in) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
    memcpy(in, s->pending, (size_t)s->n_pending);
    if (n > (int)sizeof small) tokenizer_token_bytes(s->t, id, false, (char *)in + s->n_pending, n);
    else memcpy(in + s->n_pending, small, (size_t)n);

    bool strip = s->strip_leading_space && n > 0;
    if (strip && in[s->n_pending] == ' ') { /* the pending bytes come first, but are never a space */
        memmove(in + s->n_pending, in + s->n_pending + 1, (size_t)n - 1);
        total--;
    }
    struct bytes_out o = {out, out_size > 0 ? out_size : 0, 0};
    const unsigned char *tail = NULL;
    int n_tail;
    emit_complete(in, total, &o, &tail, &n_tail);
    if (o.n > o.cap) {
        free(in);
        return kvq_error("tokenizer: stream output buffer too small (%d bytes, need %d)", out_size, o.n);
    }
    if (n_tail) memmove(s->pending, tail, (size_t)n_tail);
    s->n_pending = n_tail;
    if (n > 0) s->strip_leading_space = false;
    free(in);
    return o.n;
}

int tokenizer_stream_flush(struct tokenizer_stream *s, char *out, int out_size) {
    if (s->n_pending == 0) return 0;
    if (out_size < 3) return kvq_error("tokenizer: stream output buffer too small");
    memcpy(out, REPLACEMENT, 3); /* an unfinished sequence stands for one bad character */
    s->n_pending = 0;
    return 3;
}
