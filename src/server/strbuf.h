/* A growable string for building prompts and responses. Out of memory is sticky:
 * later appends do nothing and strbuf_take() returns NULL. */
#ifndef KVQ_SERVER_STRBUF_H
#define KVQ_SERVER_STRBUF_H

#include <stdbool.h>
#include <stddef.h>

struct strbuf {
    char *s;
    size_t len, cap;
    bool oom;
};

void strbuf_addn(struct strbuf *b, const char *s, size_t n);
void strbuf_add(struct strbuf *b, const char *s);
/* Appends s with every byte that is not part of a valid UTF-8 sequence replaced by
 * U+FFFD (JSON text must be valid UTF-8; byte-fallback tokens need not be). */
void strbuf_add_utf8(struct strbuf *b, const char *s, size_t n);
void strbuf_printf(struct strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The string (NUL-terminated, caller frees; "" when empty), or NULL after out of memory. */
char *strbuf_take(struct strbuf *b);
void strbuf_free(struct strbuf *b);

#endif
