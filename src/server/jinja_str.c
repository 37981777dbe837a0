/* Python's str methods where their results show in a prompt: strip and split on
 * Unicode whitespace, replace, case mappings (Latin, Greek and Cyrillic), and
 * printf-style % formatting. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/jinja_impl.h"

#define C (&R->c)

static bool py_space(unsigned long cp) {
    return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

/* Length of the character at s[i] if it is in chars (or whitespace when chars is NULL), else 0. */
size_t jstr_char_at(const char *s, size_t n, size_t i, const jv *chars) {
    size_t len;
    unsigned long cp = utf8_decode(s + i, n - i, &len);
    if (!chars) return py_space(cp) ? len : 0;
    for (size_t j = 0; j < chars->s.n;) {
        size_t l2;
        if (utf8_decode(chars->s.s + j, chars->s.n - j, &l2) == cp) return len;
        j += l2;
    }
    return 0;
}

jv *jstr_strip(struct render *R, const jv *s, const jv *chars, bool left, bool right) {
    size_t a = 0, b = s->s.n, k;
    if (chars && chars->t == JV_NONE) chars = NULL;
    if (chars && chars->t != JV_STR) jfail(C, "strip arg must be None or str");
    while (left && a < b && (k = jstr_char_at(s->s.s, b, a, chars))) a += k;
    while (right && b > a) {
        size_t st = b - 1;
        while (st > a && ((unsigned char)s->s.s[st] & 0xC0) == 0x80) st--;
        if (!jstr_char_at(s->s.s, b, st, chars)) break;
        b = st;
    }
    return jv_str(C, s->s.s + a, b - a);
}

/* Simple case mappings of the Latin, Greek and Cyrillic letters (others: none).
 * Returns cp unchanged when it has no mapping that way. */
static unsigned long cp_case(unsigned long cp, bool up) {
    if (cp < 0x80) {
        if (up && cp >= 'a' && cp <= 'z') return cp - 32;
        if (!up && cp >= 'A' && cp <= 'Z') return cp + 32;
        return cp;
    }
    if (cp >= 0xE0 && cp <= 0xFE && cp != 0xF7) return up ? cp - 32 : cp;
    if (cp >= 0xC0 && cp <= 0xDE && cp != 0xD7) return up ? cp : cp + 32;
    if (cp == 0xFF) return up ? 0x178 : cp;
    if (cp == 0x178) return up ? cp : 0xFF;
    if ((cp >= 0x100 && cp <= 0x12F) || (cp >= 0x132 && cp <= 0x137) || (cp >= 0x14A && cp <= 0x177))
        return up ? cp & ~1ul : cp | 1ul;
    if ((cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E)) return up ? (cp & 1 ? cp : cp - 1) : (cp & 1 ? cp + 1 : cp);
    if (cp >= 0x3B1 && cp <= 0x3C9 && cp != 0x3C2) return up ? cp - 32 : cp;
    if (cp == 0x3C2) return up ? 0x3A3 : cp;
    if (cp >= 0x391 && cp <= 0x3A9 && cp != 0x3A2) return up ? cp : cp + 32;
    if (cp >= 0x430 && cp <= 0x44F) return up ? cp - 32 : cp;
    if (cp >= 0x410 && cp <= 0x42F) return up ? cp : cp + 32;
    if (cp >= 0x450 && cp <= 0x45F) return up ? cp - 80 : cp;
    if (cp >= 0x400 && cp <= 0x40F) return up ? cp : cp + 80;
    return cp;
}

static bool cp_cased(unsigned long cp) { return cp_case(cp, true) != cp || cp_case(cp, false) != cp; }

static size_t put_cp(char *o, unsigned long cp) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63)), o[2] = (char)(0x80 | (cp & 63));
    return 3;
}

jv *jstr_case(struct render *R, const jv *s, enum case_mode m) {
    char *o = jalloc(C, s->s.n + 1), *w = o;
    bool prev_cased = false;
    for (size_t i = 0; i < s->s.n;) {
        size_t len;
        unsigned long cp = utf8_decode(s->s.s + i, s->s.n - i, &len);
        bool up;
        switch (m) {
        case CASE_UPPER: up = true; break;
        case CASE_LOWER: up = false; break;
        case CASE_CAPITALIZE: up = i == 0; break;
        case CASE_TITLE_PY: up = !prev_cased; break;
        default: { /* jinja's title: words start after whitespace, '-', and opening brackets */
            char p = i ? s->s.s[i - 1] : ' ';
            up = i == 0 || p == ' ' || p == '\t' || p == '\n' || p == '\r' || p == '\f' || p == '\v' || p == '-' ||
                 p == '(' || p == '{' || p == '[' || p == '<';
        }
        }
        unsigned long mapped = cp_case(cp, up);
        if (mapped != cp && cp < 0x10000) w += put_cp(w, mapped);
        else memcpy(w, s->s.s + i, len), w += len;
        prev_cased = cp_cased(cp);
        i += len;
    }
    return jv_str(C, o, (size_t)(w - o));
}

jv *jstr_replace(struct render *R, const jv *s, const jv *old, const jv *new_, long long count) {
    if (old->t != JV_STR || new_->t != JV_STR) jfail(C, "replace() arguments must be str");
    struct jbuf b = {0};
    const char *p = s->s.s, *end = s->s.s + s->s.n;
    if (old->s.n == 0) { /* Python inserts between characters */
        for (size_t i = 0; i <= s->s.n;) {
            if (count < 0 || count-- > 0) jbuf_add(C, &b, new_->s.s, new_->s.n);
            if (i == s->s.n) break;
            size_t len;
            utf8_decode(s->s.s + i, s->s.n - i, &len);
            jbuf_add(C, &b, s->s.s + i, len);
            i += len;
        }
        return jbuf_value(C, &b);
    }
    while (count != 0) {
        const char *q = memmem(p, (size_t)(end - p), old->s.s, old->s.n);
        if (!q) break;
        jbuf_add(C, &b, p, (size_t)(q - p));
        jbuf_add(C, &b, new_->s.s, new_->s.n);
        p = q + old->s.n;
        if (count > 0) count--;
    }
    jbuf_add(C, &b, p, (size_t)(end - p));
    return jbuf_value(C, &b);
}

/* str.split / rsplit: sep NULL or None splits on whitespace runs. */
jv *jstr_split(struct render *R, const jv *s, const jv *sep, long long maxsplit, bool from_right) {
    jv *l = jv_list(C, 0);
    const char *str = s->s.s;
    size_t n = s->s.n;
    if (!sep || sep->t == JV_NONE) {
        /* whitespace: collect words, then join the tail beyond maxsplit back */
        size_t i = 0;
        if (!from_right) {
            while (i < n) {
                size_t k;
                while (i < n && (k = jstr_char_at(str, n, i, NULL))) i += k;
                if (i >= n) break;
                if (maxsplit >= 0 && (long long)l->l.n >= maxsplit) {
                    size_t e = n;
                    while (e > i) {
                        size_t st = e - 1;
                        while (st > i && ((unsigned char)str[st] & 0xC0) == 0x80) st--;
                        if (!jstr_char_at(str, n, st, NULL)) break;
                        e = st;
                    }
                    jv_push(C, l, jv_str(C, str + i, e - i));
                    break;
                }
                size_t a = i;
                while (i < n && !jstr_char_at(str, n, i, NULL)) {
                    size_t len;
                    utf8_decode(str + i, n - i, &len);
                    i += len;
                }
                jv_push(C, l, jv_str(C, str + a, i - a));
            }
            return l;
        }
        jv *all = jstr_split(R, s, NULL, -1, false);
        if (maxsplit < 0 || (long long)all->l.n <= maxsplit + 1) return all;
        jv *stripped = jstr_strip(R, s, NULL, false, true);
        /* the head keeps its inner whitespace: cut at the start of the last maxsplit words */
        size_t keep = all->l.n - (size_t)maxsplit, pos = 0, e = stripped->s.n;
        for (size_t w = 0; w < keep; w++) {
            const char *q = memmem(stripped->s.s + pos, e - pos, all->l.v[w]->s.s, all->l.v[w]->s.n);
            pos = (size_t)(q - stripped->s.s) + all->l.v[w]->s.n;
        }
        size_t head = 0, k;
        while (head < pos && (k = jstr_char_at(stripped->s.s, e, head, NULL))) head += k;
        jv_push(C, l, jv_str(C, stripped->s.s + head, pos - head));
        for (size_t w = keep; w < all->l.n; w++) jv_push(C, l, all->l.v[w]);
        return l;
    }
    if (sep->t != JV_STR) jfail(C, "split() separator must be str or None");
    if (sep->s.n == 0) jfail(C, "empty separator");
    if (!from_right) {
        const char *p = str, *end = str + n, *q;
        while ((maxsplit < 0 || (long long)l->l.n < maxsplit) && (q = memmem(p, (size_t)(end - p), sep->s.s, sep->s.n))) {
            jv_push(C, l, jv_str(C, p, (size_t)(q - p)));
            p = q + sep->s.n;
        }
        jv_push(C, l, jv_str(C, p, (size_t)(end - p)));
        return l;
    }
    jv *parts = jstr_split(R, s, sep, -1, false);
    if (maxsplit < 0 || (long long)parts->l.n <= maxsplit + 1) return parts;
    size_t keep = parts->l.n - (size_t)maxsplit, head_len = 0;
    for (size_t w = 0; w < keep; w++) head_len += parts->l.v[w]->s.n + (w ? sep->s.n : 0);
    jv_push(C, l, jv_str(C, str, head_len));
    for (size_t w = keep; w < parts->l.n; w++) jv_push(C, l, parts->l.v[w]);
    return l;
}

/* Python's printf-style fmt % args: args a tuple (or list) of values, a dict for
 * %(name)s, or one value; flags - + space 0 #, a width and a precision. */
jv *jstr_format(struct render *R, const jv *fmt, const jv *args) {
    struct jbuf b = {0};
    const char *s = fmt->s.s, *end = s + fmt->s.n;
    bool tuple = args->t == JV_LIST && args->tuple; /* a list is one value, as in Python */
    size_t next = 0, nargs = tuple ? args->l.n : 1;
    while (s < end) {
        const char *pct = memchr(s, '%', (size_t)(end - s));
        if (!pct) pct = end;
        jbuf_add(C, &b, s, (size_t)(pct - s));
        if (pct == end) break;
        s = pct + 1;
        if (s < end && *s == '%') {
            jbuf_adds(C, &b, "%");
            s++;
            continue;
        }
        const jv *v = NULL;
        if (s < end && *s == '(') { /* %(name)s */
            const char *close = memchr(s, ')', (size_t)(end - s));
            if (!close || args->t != JV_DICT) jfail(C, "format requires a mapping");
            v = jv_get(args, jv_str(C, s + 1, (size_t)(close - s - 1)));
            if (!v) jfail(C, "format: no key '%.*s'", (int)(close - s - 1), s + 1);
            s = close + 1;
        }
        char spec[32] = "%";
        size_t n = 1;
        while (s < end && strchr("-+ 0#", *s) && n < 8) spec[n++] = *s++;
        int width = 0, prec = -1;
        while (s < end && *s >= '0' && *s <= '9' && width < 10000) width = width * 10 + (*s++ - '0');
        if (s < end && *s == '.')
            for (prec = 0, s++; s < end && *s >= '0' && *s <= '9' && prec < 10000;) prec = prec * 10 + (*s++ - '0');
        if (s >= end) jfail(C, "incomplete format");
        if (width > 400 || prec > 400) jfail(C, "format width or precision over 400");
        char conv = *s++;
        if (!v) {
            if (args->t == JV_DICT && nargs == 1 && !strchr("sr", conv)) jfail(C, "format requires a mapping");
            if (next >= nargs) jfail(C, "not enough arguments for format string");
            v = tuple ? args->l.v[next] : args;
            next++;
        }
        char out[1024]; /* width and precision at most 400, a double's %f at most 309 digits */
        if (strchr("diuxXo", conv)) {
            if (!jv_is_number(v) || (v->t == JV_FLOAT && strchr("xXo", conv)))
                jfail(C, "%%%c format: a%s number is required, not %s", conv, strchr("xXo", conv) ? "n integer" : " real",
                      jv_type_name(v));
            long long i = v->t == JV_FLOAT ? (long long)v->f : v->t == JV_BOOL ? v->b : v->i;
            /* a precision turns C's 0 flag off: give one only when the format has it */
            n += (size_t)snprintf(spec + n, sizeof spec - n, prec < 0 ? "*ll%c" : "*.*ll%c",
                                  conv == 'i' || conv == 'u' ? 'd' : conv);
            if (prec < 0) snprintf(out, sizeof out, spec, width, i);
            else snprintf(out, sizeof out, spec, width, prec, i);
            jbuf_adds(C, &b, out);
        } else if (strchr("eEfFgG", conv)) {
            if (!jv_is_number(v)) jfail(C, "%%%c format: a real number is required, not %s", conv, jv_type_name(v));
            n += (size_t)snprintf(spec + n, sizeof spec - n, "*.*%c", conv);
            snprintf(out, sizeof out, spec, width, prec < 0 ? 6 : prec, jv_num(v));
            jbuf_adds(C, &b, out);
        } else if (strchr("sra", conv)) {
            struct jbuf t = {0};
            if (conv == 's') jv_str_to(C, &t, v);
            else jv_repr_to(C, &t, v);
            size_t len = t.n, chars = utf8_len(t.s ? t.s : "", t.n);
            if (prec >= 0 && (size_t)prec < chars) len = utf8_offset(t.s, t.n, (size_t)prec), chars = (size_t)prec;
            bool left = strchr(spec, '-') != NULL;
            for (size_t k = chars; !left && (int)k < width; k++) jbuf_adds(C, &b, " ");
            jbuf_add(C, &b, t.s ? t.s : "", len);
            for (size_t k = chars; left && (int)k < width; k++) jbuf_adds(C, &b, " ");
        } else
            jfail(C, "unsupported format character '%c'", conv);
    }
    if (tuple && next < nargs) jfail(C, "not all arguments converted during string formatting");
    return jbuf_value(C, &b);
}
