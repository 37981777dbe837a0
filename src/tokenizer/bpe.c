/* Byte-level BPE (GPT-2 style), as llama.cpp does it: the text is cut into
 * pre-tokens by the regex list, each pre-token's bytes are mapped to printable
 * code points (GPT-2's byte<->unicode table), then adjacent symbols are merged
 * by rank from tokenizer.ggml.merges (lowest rank first, ties: leftmost). */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "tokenizer/tok_internal.h"

/* --- GPT-2 byte <-> unicode ---------------------------------------------- */

/* Printable Latin-1 bytes map to themselves; the other 68 bytes are given the
 * code points 256, 257, ... in byte order. */
static bool byte_is_printable(int b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static uint32_t byte_to_cp(int b) {
    if (byte_is_printable(b)) return (uint32_t)b;
    uint32_t n = 0;
    for (int c = 0; c < b; c++) n += !byte_is_printable(c);
    return 256 + n;
}

int bpe_byte_to_utf8(unsigned char b, char *out) { return utf8_encode(byte_to_cp(b), out); }

int bpe_cp_to_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable((int)cp) ? (int)cp : -1;
    uint32_t n = 256;
    for (int c = 0; c < 256; c++) {
        if (byte_is_printable(c)) continue;
        if (n == cp) return c;
        n++;
    }
    return -1;
}

void bpe_fill_byte_table(struct tokenizer *t) {
    for (int b = 0; b < 256; b++) {
        char buf[4];
        int n = bpe_byte_to_utf8((unsigned char)b, buf);
        memcpy(t->byte_enc[b].s, buf, (size_t)n); /* code points < 0x800: at most 2 bytes */
        t->byte_enc[b].n = (unsigned char)n;
    }
}

/* --- merging ------------------------------------------------------------- */

struct bpe_symbol {
    int prev, next;
    size_t off, n;
};

struct bpe_bigram {
    int left, right;
    int32_t rank;
    size_t size;
};

struct bpe_session {
    const struct tokenizer *t;
    const char *word; /* byte-encoded pre-token */
    struct bpe_symbol *sym;
    size_t sym_cap;
    struct bpe_bigram *heap;
    size_t heap_n, heap_cap;
    char *key; /* scratch for "left right" */
    size_t key_cap;
    char *enc; /* scratch for the byte-encoded pre-token */
    size_t enc_cap;
};

/* Lower rank first; equal ranks: leftmost first. */
static bool bigram_before(const struct bpe_bigram *a, const struct bpe_bigram *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static int heap_push(struct bpe_session *s, struct bpe_bigram b) {
    if (s->heap_n == s->heap_cap) {
        size_t cap = s->heap_cap ? s->heap_cap * 2 : 64;
        struct bpe_bigram *p = realloc(s->heap, cap * sizeof *p);
        if (!p) return -1;
        s->heap = p;
        s->heap_cap = cap;
    }
    size_t i = s->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_before(&b, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = b;
    return 0;
}

static struct bpe_bigram heap_pop(struct bpe_session *s) {
    struct bpe_bigram top = s->heap[0];
    struct bpe_bigram last = s->heap[--s->heap_n];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= s->heap_n) break;
        if (child + 1 < s->heap_n && bigram_before(&s->heap[child + 1], &s->heap[child])) child++;
        if (!bigram_before(&s->heap[child], &last)) break;
        s->heap[i] = s->heap[child];
        i = child;
    }
    if (s->heap_n > 0) s->heap[i] = last;
    return top;
}

static int ensure(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *p = realloc(*buf, c * elem);
    if (!p) return -1;
    *buf = p;
    *cap = c;
    return 0;
}

static int add_bigram(struct bpe_session *s, int left, int right) {
    if (left < 0 || right < 0) return 0;
    const struct bpe_symbol *l = &s->sym[left], *r = &s->sym[right];
    /* merges split at their first space after index 0: a left side containing
     * such a space can never be the first half of a merge */
    if (l->n > 1 && memchr(s->word + l->off + 1, ' ', l->n - 1)) return 0;
    size_t klen = l->n + 1 + r->n;
    if (ensure((void **)&s->key, &s->key_cap, klen, 1) != 0) return -1;
    memcpy(s->key, s->word + l->off, l->n);
    s->key[l->n] = ' ';
    memcpy(s->key + l->n + 1, s->word + r->off, r->n);
    int32_t rank = strmap_get(&s->t->merges, s->key, klen);
    if (rank < 0) return 0;
    return heap_push(s, (struct bpe_bigram){left, right, rank, l->n + r->n});
}

/* Unknown symbol: llama.cpp looks up each of its bytes as a one-byte token and
 * drops the ones that are missing. */
static int emit_symbol(const struct tokenizer *t, const char *p, size_t n, struct tok_vec *out) {
    int32_t id = tok_lookup(t, p, n);
    if (id >= 0) return tok_vec_push(out, id);
    for (size_t i = 0; i < n; i++) {
        id = tok_lookup(t, p + i, 1);
        if (id >= 0 && tok_vec_push(out, id) != 0) return -1;
    }
    return 0;
}

static int bpe_word(struct bpe_session *s, size_t len, struct tok_vec *out) {
    const struct tokenizer *t = s->t;
    if (t->ignore_merges) {
        int32_t id = tok_lookup(t, s->word, len);
        if (id >= 0) return tok_vec_push(out, id);
    }
    if (ensure((void **)&s->sym, &s->sym_cap, len, sizeof *s->sym) != 0) return -1;
    int n_sym = 0;
    for (size_t off = 0; off < len;) {
        size_t n = utf8_lead_len((unsigned char)s->word[off]);
        if (n > len - off) n = len - off;
        s->sym[n_sym] = (struct bpe_symbol){n_sym - 1, off + n == len ? -1 : n_sym + 1, off, n};
        off += n;
        n_sym++;
    }
    s->heap_n = 0;
    for (int i = 1; i < n_sym; i++)
        if (add_bigram(s, i - 1, i) != 0) return -1;

    while (s->heap_n > 0) {
        struct bpe_bigram b = heap_pop(s);
        struct bpe_symbol *l = &s->sym[b.left], *r = &s->sym[b.right];
        /* stale entry: one side was merged since (sizes only grow) */
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) s->sym[r->next].prev = b.left;
        if (add_bigram(s, l->prev, b.left) != 0 || add_bigram(s, b.left, l->next) != 0) return -1;
    }
    for (int i = 0; i != -1 && n_sym > 0; i = s->sym[i].next)
        if (emit_symbol(t, s->word + s->sym[i].off, s->sym[i].n, out) != 0) return -1;
    return 0;
}

/* Byte-encodes text[off..off+len) into s->enc; returns the encoded length or -1. */
static long encode_piece(struct bpe_session *s, const char *p, size_t len) {
    const struct tokenizer *t = s->t;
    if (ensure((void **)&s->enc, &s->enc_cap, len * 2 + 1, 1) != 0) return -1;
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char b = (unsigned char)p[i];
        memcpy(s->enc + n, t->byte_enc[b].s, t->byte_enc[b].n);
        n += t->byte_enc[b].n;
    }
    return (long)n;
}

/* Decodes one code point with llama.cpp's lenient rules (overlong forms and
 * surrogates pass; a bad lead or missing continuation byte is invalid).
 * Returns the bytes consumed, or 0 when invalid. */
static size_t decode_lenient(const unsigned char *p, size_t left, uint32_t *cp) {
    unsigned char c = p[0];
    size_t n;
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    if (c < 0xC0) return 0;
    if (c < 0xE0) n = 2, *cp = c & 0x1Fu;
    else if (c < 0xF0) n = 3, *cp = c & 0x0Fu;
    else if (c < 0xF8) n = 4, *cp = c & 0x07u;
    else return 0;
    if (n > left) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        *cp = (*cp << 6) | (p[i] & 0x3Fu);
    }
    return *cp > 0x10FFFF ? 0 : n;
}

/* llama.cpp's pre-tokenizer works on code points: invalid bytes become U+FFFD and
 * overlong forms are re-encoded. Returns a cleaned copy, or NULL with *clean set
 * when the text needs no change (the common case). */
static char *sanitize_utf8(const char *text, size_t len, size_t *out_len, bool *clean) {
    const unsigned char *p = (const unsigned char *)text;
    size_t i = 0;
    for (uint32_t cp; i < len;) {
        size_t n = decode_lenient(p + i, len - i, &cp);
        if (n == 0 || (n > 1 && cp < 0x80) || (n > 2 && cp < 0x800) || (n > 3 && cp < 0x10000)) break;
        i += n;
    }
    *clean = i == len;
    if (*clean) return NULL;
    char *buf = malloc(len * 3 + 1); /* each invalid byte grows to 3 bytes at most */
    if (!buf) return NULL;
    size_t o = 0;
    for (i = 0; i < len;) {
        uint32_t cp;
        size_t n = decode_lenient(p + i, len - i, &cp);
        if (n == 0) {
            cp = 0xFFFD;
            n = 1;
        }
        o += (size_t)utf8_encode(cp, buf + o);
        i += n;
    }
    *out_len = o;
    return buf;
}

int bpe_tokenize(const struct tokenizer *t, const char *text, size_t len, struct tok_vec *out) {
    bool clean;
    size_t clean_len = len;
    char *cleaned = sanitize_utf8(text, len, &clean_len, &clean);
    if (!clean && !cleaned) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
    if (cleaned) text = cleaned, len = clean_len;

    struct piece_vec pieces = {0};
    if (pretok_split(&t->pre, text, len, &pieces) != 0) {
        free(pieces.data);
        free(cleaned);
        return -1;
    }
    struct bpe_session s = {.t = t};
    int rc = 0;
    for (size_t i = 0; i < pieces.n && rc == 0; i++) {
        long n = encode_piece(&s, text + pieces.data[i].off, pieces.data[i].len);
        if (n < 0) {
            rc = -1;
            break;
        }
        s.word = s.enc;
        rc = bpe_word(&s, (size_t)n, out);
    }
    free(pieces.data);
    free(s.sym);
    free(s.heap);
    free(s.key);
    free(s.enc);
    free(cleaned);
    return rc == 0 ? 0 : kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
}
