/* Internals shared by the tokenizer's source files (not part of the public API). */
#ifndef KVQ_TOK_INTERNAL_H
#define KVQ_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* --- string -> int32 hash map (open addressing, keys not owned) ---------- */
struct strmap_slot {
    const char *key; /* NULL = empty */
    uint32_t len;
    uint32_t hash;
    int32_t value;
};

struct strmap {
    struct strmap_slot *slots;
    size_t cap; /* power of two */
    size_t n;
};

int strmap_init(struct strmap *m, size_t expected);
void strmap_free(struct strmap *m);
/* Inserts key -> value unless key is present. Returns 1 inserted, 0 present
 * (*existing set when non-NULL), -1 out of memory. The key must outlive the map. */
int strmap_put(struct strmap *m, const char *key, uint32_t len, int32_t value, int32_t *existing);
/* Value for key, or -1. */
int32_t strmap_get(const struct strmap *m, const char *key, size_t len);

/* --- growable token-id vector -------------------------------------------- */
struct tok_vec {
    int32_t *data;
    size_t n, cap;
};
int tok_vec_push(struct tok_vec *v, int32_t id);

/* --- UTF-8 helpers ------------------------------------------------------- */
/* Sequence length announced by a lead byte (1 for ASCII and stray bytes),
 * the same lenient rule llama.cpp uses to cut text into symbols. */
static inline size_t utf8_lead_len(unsigned char c) {
    static const unsigned char lookup[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lookup[c >> 4];
}
/* Encodes cp into out (at least 4 bytes); returns the byte count. */
int utf8_encode(uint32_t cp, char *out);

/* --- token metadata ------------------------------------------------------ */
enum tok_type {
    TOK_TYPE_UNDEFINED = 0,
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
};

enum { TOK_LSTRIP = 1, TOK_RSTRIP = 2 }; /* whitespace trimming around special tokens */

struct tok_entry {
    uint32_t off, len; /* text in tokenizer.text_blob */
    float score;
    uint8_t type;  /* enum tok_type */
    uint8_t strip; /* TOK_LSTRIP | TOK_RSTRIP */
};

enum tok_kind { TOK_KIND_SPM, TOK_KIND_BPE };

#define TOK_MAX_REGEX 8
#define TOK_MAX_EOG 16

struct pretokenizer {
    int n_regex;
    void *code[TOK_MAX_REGEX]; /* pcre2_code_8 * */
};

struct tokenizer {
    enum tok_kind kind;
    int32_t n_vocab;
    char *text_blob;
    struct tok_entry *tokens;
    struct strmap vocab; /* token text -> id */

    /* BPE merges: key "left right" -> rank */
    char *merge_blob;
    struct strmap merges;
    struct pretokenizer pre;
    bool ignore_merges; /* a whole pre-token that is in the vocab skips merging */

    int32_t bos, eos, unk;
    bool add_bos, add_eos, add_space_prefix;
    int32_t eog[TOK_MAX_EOG];
    int n_eog;

    /* control / user-defined / unknown tokens, longest text first */
    int32_t *special;
    int n_special;

    int32_t spm_byte_token[256]; /* SPM byte fallback ids (-1 when missing) */
    struct {
        char s[2];
        unsigned char n;
    } byte_enc[256]; /* BPE: byte -> UTF-8 of its GPT-2 code point */
};

static inline const char *tok_text(const struct tokenizer *t, int32_t id, size_t *len) {
    *len = t->tokens[id].len;
    return t->text_blob + t->tokens[id].off;
}
static inline int32_t tok_lookup(const struct tokenizer *t, const char *s, size_t len) {
    return strmap_get(&t->vocab, s, len);
}

/* spm.c: SentencePiece-style merge of text (already space-escaped). */
int spm_tokenize(const struct tokenizer *t, const char *text, size_t len, struct tok_vec *out);

/* bpe.c */
int bpe_tokenize(const struct tokenizer *t, const char *text, size_t len, struct tok_vec *out);
/* GPT-2 byte <-> unicode mapping */
int bpe_byte_to_utf8(unsigned char b, char *out);
int bpe_cp_to_byte(uint32_t cp); /* -1 if cp is not a mapped byte */
void bpe_fill_byte_table(struct tokenizer *t);

/* pretokenize.c: choose and compile the regex list for a tokenizer.ggml.pre name.
 * Sets *ignore_merges / *add_bos_default for families that need them. */
int pretok_init(struct pretokenizer *p, const char *pre_name, bool *ignore_merges, bool *add_bos_default);
void pretok_free(struct pretokenizer *p);
/* Splits text into pieces: offsets/lengths (byte units) appended to *pieces as pairs. */
struct piece {
    size_t off, len;
};
struct piece_vec {
    struct piece *data;
    size_t n, cap;
};
int pretok_split(const struct pretokenizer *p, const char *text, size_t len, struct piece_vec *out);

#endif
