/* SentencePiece-style BPE as llama.cpp does it: start from UTF-8 characters,
 * repeatedly merge the adjacent pair whose concatenation is a vocabulary token
 * with the highest score (ties: leftmost), then emit each remaining symbol as its
 * token or, when it is not in the vocabulary, as byte-fallback tokens. */
#include <stdlib.h>

#include "core/error.h"
#include "tokenizer/tok_internal.h"

struct spm_symbol {
    int prev, next; /* linked list over the symbols still alive */
    size_t off, n;  /* bytes of the text; n == 0 once merged into the left neighbour */
};

struct spm_bigram {
    int left, right;
    float score;
    size_t size; /* byte length of the pair when queued: detects stale entries */
};

struct spm_heap {
    struct spm_bigram *data;
    size_t n, cap;
};

/* Higher score first; equal scores: the leftmost pair first. */
static bool bigram_before(const struct spm_bigram *a, const struct spm_bigram *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static int heap_push(struct spm_heap *h, struct spm_bigram b) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 256;
        struct spm_bigram *p = realloc(h->data, cap * sizeof *p);
        if (!p) return -1;
        h->data = p;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!bigram_before(&b, &h->data[parent])) break;
        h->data[i] = h->data[parent];
        i = parent;
    }
    h->data[i] = b;
    return 0;
}

static struct spm_bigram heap_pop(struct spm_heap *h) {
    struct spm_bigram top = h->data[0];
    struct spm_bigram last = h->data[--h->n];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && bigram_before(&h->data[child + 1], &h->data[child])) child++;
        if (!bigram_before(&h->data[child], &last)) break;
        h->data[i] = h->data[child];
        i = child;
    }
    if (h->n > 0) h->data[i] = last;
    return top;
}

struct spm_session {
    const struct tokenizer *t;
    const char *text;
    struct spm_symbol *sym;
    struct spm_heap heap;
};

static int try_add_bigram(struct spm_session *s, int left, int right) {
    if (left < 0 || right < 0) return 0;
    size_t size = s->sym[left].n + s->sym[right].n;
    int32_t id = tok_lookup(s->t, s->text + s->sym[left].off, size);
    if (id < 0) return 0;
    struct spm_bigram b = {left, right, s->t->tokens[id].score, size};
    return heap_push(&s->heap, b);
}

/* Byte fallback: <0xXX>, else the byte as a one-character token, else unknown. */
static int emit_bytes(const struct tokenizer *t, const char *p, size_t n, struct tok_vec *out) {
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->spm_byte_token[(unsigned char)p[i]];
        if (id < 0) id = t->unk;
        if (id >= 0 && tok_vec_push(out, id) != 0) return -1;
    }
    return 0;
}

static int spm_merge_all(struct spm_session *s) {
    while (s->heap.n > 0) {
        struct spm_bigram b = heap_pop(&s->heap);
        struct spm_symbol *l = &s->sym[b.left], *r = &s->sym[b.right];
        /* Sizes only grow through merges, so an unchanged sum means both symbols
         * are untouched and still adjacent. */
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) s->sym[r->next].prev = b.left;
        if (try_add_bigram(s, l->prev, b.left) != 0) return -1;
        if (try_add_bigram(s, b.left, l->next) != 0) return -1;
    }
    return 0;
}

int spm_tokenize(const struct tokenizer *t, const char *text, size_t len, struct tok_vec *out) {
    if (len == 0) return 0;
    if (len > (size_t)INT32_MAX) return kvq_error("tokenizer: text too long");
    struct spm_session s = {.t = t, .text = text};
    s.sym = malloc(len * sizeof *s.sym);
    if (!s.sym) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");

    int n_sym = 0;
    for (size_t off = 0; off < len;) {
        size_t n = utf8_lead_len((unsigned char)text[off]);
        if (n > len - off) n = len - off;
        s.sym[n_sym] = (struct spm_symbol){n_sym - 1, off + n == len ? -1 : n_sym + 1, off, n};
        off += n;
        n_sym++;
    }

    int rc = 0;
    for (int i = 1; i < n_sym && rc == 0; i++) rc = try_add_bigram(&s, i - 1, i);
    if (rc == 0) rc = spm_merge_all(&s);

    for (int i = 0; i != -1 && rc == 0; i = s.sym[i].next) {
        const char *p = text + s.sym[i].off;
        int32_t id = tok_lookup(t, p, s.sym[i].n);
        rc = id >= 0 ? tok_vec_push(out, id) : emit_bytes(t, p, s.sym[i].n, out);
    }
    free(s.heap.data);
    free(s.sym);
    return rc == 0 ? 0 : kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
}
