/* Small containers used by the tokenizer: a string hash map (token text -> id,
 * merge pair -> rank), a growable id vector, and UTF-8 encoding. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

/* FNV-1a: simple and good enough for token strings. */
static uint32_t hash_bytes(const char *s, size_t len) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 16777619u;
    }
    return h;
}

int strmap_init(struct strmap *m, size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2) cap <<= 1; /* load factor <= 0.5 keeps probes short */
    m->slots = calloc(cap, sizeof *m->slots);
    m->cap = m->slots ? cap : 0;
    m->n = 0;
    return m->slots ? 0 : -1;
}

void strmap_free(struct strmap *m) {
    free(m->slots);
    m->slots = NULL;
    m->cap = m->n = 0;
}

static int strmap_grow(struct strmap *m) {
    struct strmap bigger;
    if (strmap_init(&bigger, m->cap) != 0) return -1; /* doubles the capacity */
    for (size_t i = 0; i < m->cap; i++) {
        const struct strmap_slot *s = &m->slots[i];
        if (!s->key) continue;
        size_t j = s->hash & (bigger.cap - 1);
        while (bigger.slots[j].key) j = (j + 1) & (bigger.cap - 1);
        bigger.slots[j] = *s;
        bigger.n++;
    }
    free(m->slots);
    *m = bigger;
    return 0;
}

int strmap_put(struct strmap *m, const char *key, uint32_t len, int32_t value, int32_t *existing) {
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m) != 0) return -1;
    uint32_t h = hash_bytes(key, len);
    size_t j = h & (m->cap - 1);
    while (m->slots[j].key) {
        const struct strmap_slot *s = &m->slots[j];
        if (s->hash == h && s->len == len && memcmp(s->key, key, len) == 0) {
            if (existing) *existing = s->value;
            return 0;
        }
        j = (j + 1) & (m->cap - 1);
    }
    m->slots[j] = (struct strmap_slot){.key = key, .len = len, .hash = h, .value = value};
    m->n++;
    return 1;
}

int32_t strmap_get(const struct strmap *m, const char *key, size_t len) {
    if (m->cap == 0 || len > UINT32_MAX) return -1;
    uint32_t h = hash_bytes(key, len);
    size_t j = h & (m->cap - 1);
    while (m->slots[j].key) {
        const struct strmap_slot *s = &m->slots[j];
        if (s->hash == h && s->len == len && memcmp(s->key, key, len) == 0) return s->value;
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}

int tok_vec_push(struct tok_vec *v, int32_t id) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->data, cap * sizeof *p);
        if (!p) return -1;
        v->data = p;
        v->cap = cap;
    }
    v->data[v->n++] = id;
    return 0;
}

int utf8_encode(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}
