#include "server/strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool reserve(struct strbuf *b, size_t extra) {
    if (b->oom) return false;
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *s = realloc(b->s, cap);
    if (!s) {
        b->oom = true;
        return false;
    }
    b->s = s;
    b->cap = cap;
    return true;
}

void strbuf_addn(struct strbuf *b, const char *s, size_t n) {
    if (!reserve(b, n)) return;
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

void strbuf_add(struct strbuf *b, const char *s) { strbuf_addn(b, s, strlen(s)); }

/* Length of the valid UTF-8 sequence at s (0: invalid), as RFC 3629 defines it. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (len == 0 || len > n) return 0;
    unsigned cp = len == 1 ? c : c & (0x7F >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    static const unsigned min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

void strbuf_add_utf8(struct strbuf *b, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t start = 0, i = 0;
    while (i < n) {
        size_t len = utf8_seq(u + i, n - i);
        if (len) {
            i += len;
            continue;
        }
        strbuf_addn(b, s + start, i - start);
        strbuf_add(b, "\xEF\xBF\xBD");
        start = ++i;
    }
    strbuf_addn(b, s + start, n - start);
}

void strbuf_printf(struct strbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

char *strbuf_take(struct strbuf *b) {
    if (!b->oom && !b->s && reserve(b, 0)) b->s[0] = '\0';
    char *s = b->oom ? NULL : b->s;
    if (b->oom) free(b->s);
    *b = (struct strbuf){0};
    return s;
}

void strbuf_free(struct strbuf *b) {
    free(b->s);
    *b = (struct strbuf){0};
}
