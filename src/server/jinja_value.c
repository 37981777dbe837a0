/* Jinja values with Python's semantics where templates can see them: equality and
 * ordering, truthiness, str() and repr() (what {{ }} prints for lists, dicts,
 * floats, None), and json.dumps for tojson. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/jinja_impl.h"

/* ---- arena ---- */

struct arena_block {
    struct arena_block *next;
    size_t used, size;
    _Alignas(16) unsigned char data[];
};

void *jalloc(struct jctx *c, size_t n) {
    n = (n + 15) & ~(size_t)15;
    struct arena_block *b = c->blocks;
    if (!b || b->size - b->used < n) {
        size_t size = n > ((size_t)64 << 10) ? n : (size_t)64 << 10;
        if (c->used + size > c->limit) jfail(c, "the template needs more than %zu MB of memory", c->limit >> 20);
        b = malloc(sizeof *b + size);
        if (!b) jfail(c, "out of memory");
        b->size = size;
        b->used = 0;
        c->used += size;
        /* a big block goes behind the current one, which keeps its free space */
        if (c->blocks && n > ((size_t)64 << 10)) {
            b->next = c->blocks->next;
            c->blocks->next = b;
        } else {
            b->next = c->blocks;
            c->blocks = b;
        }
    }
    void *p = b->data + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

char *jstrndup(struct jctx *c, const char *s, size_t n) {
    char *p = jalloc(c, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

void jarena_free(struct jctx *c) {
    while (c->blocks) {
        struct arena_block *b = c->blocks;
        c->blocks = b->next;
        free(b);
    }
    c->used = 0;
}

void jfail(struct jctx *c, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->err && c->err_size) {
        if (c->line > 0) snprintf(c->err, c->err_size, "line %d: %s", c->line, msg);
        else snprintf(c->err, c->err_size, "%s", msg);
    }
    longjmp(c->on_error, 1);
}

/* ---- construction ---- */

static jv none_v = {.t = JV_NONE}, true_v = {.t = JV_BOOL, .b = true}, false_v = {.t = JV_BOOL, .b = false};

jv *jv_none(void) { return &none_v; }
jv *jv_bool(bool b) { return b ? &true_v : &false_v; }

static jv *mkv(struct jctx *c, enum jv_type t) {
    jv *v = jalloc(c, sizeof *v);
    v->t = t;
    return v;
}

jv *jv_undef(struct jctx *c, const char *name) {
    jv *v = mkv(c, JV_UNDEF);
    v->s.s = name ? name : "";
    return v;
}

jv *jv_int(struct jctx *c, long long i) {
    jv *v = mkv(c, JV_INT);
    v->i = i;
    return v;
}

jv *jv_float(struct jctx *c, double f) {
    jv *v = mkv(c, JV_FLOAT);
    v->f = f;
    return v;
}

jv *jv_str(struct jctx *c, const char *s, size_t n) {
    jv *v = mkv(c, JV_STR);
    v->s.s = jstrndup(c, s, n);
    v->s.n = n;
    return v;
}

jv *jv_cstr(struct jctx *c, const char *s) { return jv_str(c, s, strlen(s)); }

jv *jv_list(struct jctx *c, size_t cap) {
    jv *v = mkv(c, JV_LIST);
    if (cap) {
        v->l.v = jalloc(c, cap * sizeof *v->l.v);
        v->l.cap = cap;
    }
    return v;
}

jv *jv_dict(struct jctx *c) { return mkv(c, JV_DICT); }

jv *jv_func(struct jctx *c, const char *name, jv *self) {
    jv *v = mkv(c, JV_FUNC);
    v->fn.name = name;
    v->fn.self = self;
    return v;
}

void jv_push(struct jctx *c, jv *l, jv *x) {
    if (l->l.n == l->l.cap) {
        size_t cap = l->l.cap ? l->l.cap * 2 : 4;
        jv **nv = jalloc(c, cap * sizeof *nv);
        if (l->l.n) memcpy(nv, l->l.v, l->l.n * sizeof *nv);
        l->l.v = nv;
        l->l.cap = cap;
    }
    l->l.v[l->l.n++] = x;
}

static long dict_index(const jv *d, const jv *key) {
    for (size_t i = 0; i < d->d.n; i++)
        if (jv_equal(d->d.k[i], key)) return (long)i;
    return -1;
}

/* Adds a key known to be new. */
static void dict_append(struct jctx *c, jv *d, jv *key, jv *x) {
    if (d->d.n == d->d.cap) {
        size_t cap = d->d.cap ? d->d.cap * 2 : 4;
        jv **nk = jalloc(c, cap * sizeof *nk), **nv = jalloc(c, cap * sizeof *nv);
        if (d->d.n) memcpy(nk, d->d.k, d->d.n * sizeof *nk), memcpy(nv, d->d.v, d->d.n * sizeof *nv);
        d->d.k = nk, d->d.v = nv, d->d.cap = cap;
    }
    d->d.k[d->d.n] = key;
    d->d.v[d->d.n++] = x;
}

void jv_set(struct jctx *c, jv *d, jv *key, jv *x) {
    long i = dict_index(d, key);
    if (i >= 0) d->d.v[i] = x;
    else dict_append(c, d, key, x);
}

jv *jv_get(const jv *d, const jv *key) {
    long i = dict_index(d, key);
    return i >= 0 ? d->d.v[i] : NULL;
}

jv *jv_get_cstr(const jv *d, const char *key) {
    size_t n = strlen(key);
    for (size_t i = 0; i < d->d.n; i++) {
        const jv *k = d->d.k[i];
        if (k->t == JV_STR && k->s.n == n && !memcmp(k->s.s, key, n)) return d->d.v[i];
    }
    return NULL;
}

/* ---- Python semantics ---- */

bool jv_truthy(const jv *v) {
    switch (v->t) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v->b;
    case JV_INT: return v->i != 0;
    case JV_FLOAT: return v->f != 0;
    case JV_STR: return v->s.n > 0;
    case JV_LIST: return v->l.n > 0;
    case JV_DICT: return v->d.n > 0;
    default: return true;
    }
}

bool jv_is_number(const jv *v) { return v->t == JV_INT || v->t == JV_FLOAT || v->t == JV_BOOL; }

double jv_num(const jv *v) {
    return v->t == JV_FLOAT ? v->f : v->t == JV_INT ? (double)v->i : v->t == JV_BOOL ? v->b : 0;
}

static bool equal(const jv *a, const jv *b, int depth);

bool jv_equal(const jv *a, const jv *b) { return equal(a, b, 0); }

/* Values nested deeper than any real data compare unequal rather than overflow the stack. */
static bool equal(const jv *a, const jv *b, int depth) {
    if (a == b) return true;
    if (depth > 1000) return false;
    if (jv_is_number(a) && jv_is_number(b)) {
        if (a->t != JV_FLOAT && b->t != JV_FLOAT) {
            long long x = a->t == JV_BOOL ? a->b : a->i, y = b->t == JV_BOOL ? b->b : b->i;
            return x == y;
        }
        return jv_num(a) == jv_num(b);
    }
    if (a->t != b->t) return false;
    switch (a->t) {
    case JV_UNDEF:
    case JV_NONE: return true;
    case JV_STR: return a->s.n == b->s.n && !memcmp(a->s.s, b->s.s, a->s.n);
    case JV_LIST:
        if (a->l.n != b->l.n) return false;
        for (size_t i = 0; i < a->l.n; i++)
            if (!equal(a->l.v[i], b->l.v[i], depth + 1)) return false;
        return true;
    case JV_DICT:
        if (a->d.n != b->d.n) return false;
        for (size_t i = 0; i < a->d.n; i++) {
            jv *o = jv_get(b, a->d.k[i]);
            if (!o || !equal(a->d.v[i], o, depth + 1)) return false;
        }
        return true;
    case JV_FUNC: return !strcmp(a->fn.name, b->fn.name) && a->fn.self == b->fn.self;
    default: return false;
    }
}

const char *jv_type_name(const jv *v) {
    static const char *const names[] = {"undefined", "NoneType", "bool",      "int",  "float",    "str",
                                        "list",      "dict",     "Namespace", "LoopContext", "Macro", "function"};
    if (v->t == JV_LIST && v->tuple) return "tuple";
    return names[v->t];
}

static int compare(struct jctx *c, const jv *a, const jv *b, int depth);

int jv_compare(struct jctx *c, const jv *a, const jv *b) { return compare(c, a, b, 0); }

static int compare(struct jctx *c, const jv *a, const jv *b, int depth) {
    if (depth > 512) jfail(c, "values nested too deeply to compare");
    if (jv_is_number(a) && jv_is_number(b)) {
        if (a->t != JV_FLOAT && b->t != JV_FLOAT) {
            long long x = a->t == JV_BOOL ? a->b : a->i, y = b->t == JV_BOOL ? b->b : b->i;
            return (x > y) - (x < y);
        }
        double x = jv_num(a), y = jv_num(b);
        return (x > y) - (x < y);
    }
    if (a->t == JV_STR && b->t == JV_STR) { /* UTF-8 byte order is code point order */
        size_t n = a->s.n < b->s.n ? a->s.n : b->s.n;
        int r = memcmp(a->s.s, b->s.s, n);
        return r ? (r > 0) - (r < 0) : (a->s.n > b->s.n) - (a->s.n < b->s.n);
    }
    if (a->t == JV_LIST && b->t == JV_LIST) {
        for (size_t i = 0; i < a->l.n && i < b->l.n; i++) {
            if (jv_equal(a->l.v[i], b->l.v[i])) continue;
            return compare(c, a->l.v[i], b->l.v[i], depth + 1);
        }
        return (a->l.n > b->l.n) - (a->l.n < b->l.n);
    }
    jfail(c, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
}

/* ---- strings ---- */

void jbuf_add(struct jctx *c, struct jbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *ns = jalloc(c, cap);
        if (b->n) memcpy(ns, b->s, b->n);
        b->s = ns;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

void jbuf_adds(struct jctx *c, struct jbuf *b, const char *s) { jbuf_add(c, b, s, strlen(s)); }

jv *jbuf_value(struct jctx *c, struct jbuf *b) {
    jv *v = mkv(c, JV_STR);
    v->s.s = b->s ? b->s : "";
    v->s.n = b->n;
    return v;
}

size_t utf8_len(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

unsigned long utf8_decode(const char *s, size_t n, size_t *len) {
    const unsigned char *u = (const unsigned char *)s;
    int k = u[0] < 0x80 ? 1 : u[0] < 0xE0 ? 2 : u[0] < 0xF0 ? 3 : 4;
    if ((size_t)k > n) k = 1;
    unsigned long cp = k == 1 ? u[0] : k == 2 ? u[0] & 0x1Fu : k == 3 ? u[0] & 0x0Fu : u[0] & 0x07u;
    for (int i = 1; i < k; i++) cp = cp << 6 | (u[i] & 0x3Fu);
    *len = (size_t)k;
    return cp;
}

size_t utf8_offset(const char *s, size_t n, size_t i) {
    size_t p = 0;
    while (p < n && i > 0) {
        p++;
        while (p < n && ((unsigned char)s[p] & 0xC0) == 0x80) p++;
        i--;
    }
    return p;
}

/* Python's repr of a float: the shortest digits that read back the same, in fixed
 * notation for exponents -4..15, else as 1e+16. */
static void float_repr(struct jctx *c, struct jbuf *b, double f) {
    if (isnan(f)) return jbuf_adds(c, b, "nan");
    if (isinf(f)) return jbuf_adds(c, b, f < 0 ? "-inf" : "inf");
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, f);
        if (strtod(e, NULL) == f) break;
    }
    /* e: [-]d[.ddd]e[+-]XX */
    char digits[32];
    int nd = 0, exp10;
    const char *p = e;
    bool neg = *p == '-';
    if (neg) p++;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char out[64];
    int o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= 16 || exp10 < -4) {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++) out[o++] = digits[i];
        }
        o += snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    } else if (exp10 < 0) {
        out[o++] = '0', out[o++] = '.';
        for (int i = -1; i > exp10; i--) out[o++] = '0';
        for (int i = 0; i < nd; i++) out[o++] = digits[i];
    } else {
        for (int i = 0; i <= exp10; i++) out[o++] = i < nd ? digits[i] : '0';
        out[o++] = '.';
        if (nd > exp10 + 1)
            for (int i = exp10 + 1; i < nd; i++) out[o++] = digits[i];
        else
            out[o++] = '0';
    }
    jbuf_add(c, b, out, (size_t)o);
}

static void str_repr(struct jctx *c, struct jbuf *b, const char *s, size_t n) {
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    jbuf_add(c, b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char esc[8];
        if (ch == '\\' || ch == (unsigned char)q) esc[0] = '\\', esc[1] = (char)ch, jbuf_add(c, b, esc, 2);
        else if (ch == '\n') jbuf_adds(c, b, "\\n");
        else if (ch == '\r') jbuf_adds(c, b, "\\r");
        else if (ch == '\t') jbuf_adds(c, b, "\\t");
        else if (ch < 0x20 || ch == 0x7f) snprintf(esc, sizeof esc, "\\x%02x", ch), jbuf_adds(c, b, esc);
        else jbuf_add(c, b, (const char *)&ch, 1);
    }
    jbuf_add(c, b, &q, 1);
}

static void repr_to(struct jctx *c, struct jbuf *b, const jv *v, int depth);

void jv_repr_to(struct jctx *c, struct jbuf *b, const jv *v) { repr_to(c, b, v, 0); }

static void repr_to(struct jctx *c, struct jbuf *b, const jv *v, int depth) {
    if (depth > 512) jfail(c, "value nested too deeply to print");
    switch (v->t) {
    case JV_STR: str_repr(c, b, v->s.s, v->s.n); return;
    case JV_LIST:
        jbuf_adds(c, b, v->tuple ? "(" : "[");
        for (size_t i = 0; i < v->l.n; i++) {
            if (i) jbuf_adds(c, b, ", ");
            repr_to(c, b, v->l.v[i], depth + 1);
        }
        jbuf_adds(c, b, v->tuple ? (v->l.n == 1 ? ",)" : ")") : "]");
        return;
    case JV_DICT:
        jbuf_adds(c, b, "{");
        for (size_t i = 0; i < v->d.n; i++) {
            if (i) jbuf_adds(c, b, ", ");
            repr_to(c, b, v->d.k[i], depth + 1);
            jbuf_adds(c, b, ": ");
            repr_to(c, b, v->d.v[i], depth + 1);
        }
        jbuf_adds(c, b, "}");
        return;
    case JV_UNDEF: jbuf_adds(c, b, "Undefined"); return;
    default: jv_str_to(c, b, v);
    }
}

void jv_str_to(struct jctx *c, struct jbuf *b, const jv *v) {
    char num[32];
    switch (v->t) {
    case JV_UNDEF: return;
    case JV_NONE: jbuf_adds(c, b, "None"); return;
    case JV_BOOL: jbuf_adds(c, b, v->b ? "True" : "False"); return;
    case JV_INT: snprintf(num, sizeof num, "%lld", v->i), jbuf_adds(c, b, num); return;
    case JV_FLOAT: float_repr(c, b, v->f); return;
    case JV_STR: jbuf_add(c, b, v->s.s, v->s.n); return;
    case JV_LIST:
    case JV_DICT: jv_repr_to(c, b, v); return;
    case JV_NS: jbuf_adds(c, b, "<Namespace>"); return;
    case JV_LOOP: jbuf_adds(c, b, "<LoopContext>"); return;
    case JV_MACRO: jbuf_adds(c, b, "<Macro>"); return;
    case JV_FUNC: jbuf_adds(c, b, "<function>"); return;
    }
}

jv *jv_to_str(struct jctx *c, const jv *v) {
    if (v->t == JV_STR) return (jv *)v;
    struct jbuf b = {0};
    jv_str_to(c, &b, v);
    return jbuf_value(c, &b);
}

/* ---- JSON ---- */

static void json_str(struct jctx *c, struct jbuf *b, const char *s, size_t n, bool ascii) {
    jbuf_adds(c, b, "\"");
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        const char *esc = NULL;
        char u[32];
        size_t len = 1;
        switch (ch) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (ch < 0x20) snprintf(u, sizeof u, "\\u%04x", ch), esc = u;
            else if (ch >= 0x80 && ascii) { /* \uXXXX, a surrogate pair above U+FFFF */
                unsigned long cp = ch < 0xE0 ? ch & 0x1Fu : ch < 0xF0 ? ch & 0x0Fu : ch & 0x07u;
                len = ch < 0xE0 ? 2 : ch < 0xF0 ? 3 : 4;
                if (i + len > n) len = 1;
                for (size_t k = 1; k < len; k++) cp = cp << 6 | ((unsigned char)s[i + k] & 0x3Fu);
                if (cp >= 0x10000)
                    snprintf(u, sizeof u, "\\u%04lx\\u%04lx", (0xD800 + ((cp - 0x10000) >> 10)) & 0xFFFF,
                             (0xDC00 + ((cp - 0x10000) & 0x3FF)) & 0xFFFF);
                else
                    snprintf(u, sizeof u, "\\u%04lx", cp);
                esc = u;
            }
        }
        if (!esc) continue;
        jbuf_add(c, b, s + run, i - run);
        jbuf_adds(c, b, esc);
        i += len - 1;
        run = i + 1;
    }
    jbuf_add(c, b, s + run, n - run);
    jbuf_adds(c, b, "\"");
}

static void json_newline(struct jctx *c, struct jbuf *b, int indent, int depth) {
    jbuf_adds(c, b, "\n");
    for (int i = 0; i < indent * depth; i++) jbuf_adds(c, b, " ");
}

static void json_to(struct jctx *c, struct jbuf *b, const jv *v, const struct json_opts *o, int depth) {
    if (depth > 512) jfail(c, "tojson: value nested too deeply");
    switch (v->t) {
    case JV_NONE: jbuf_adds(c, b, "null"); return;
    case JV_BOOL: jbuf_adds(c, b, v->b ? "true" : "false"); return;
    case JV_INT: jv_str_to(c, b, v); return;
    case JV_FLOAT:
        if (isnan(v->f)) jbuf_adds(c, b, "NaN");
        else if (isinf(v->f)) jbuf_adds(c, b, v->f < 0 ? "-Infinity" : "Infinity");
        else float_repr(c, b, v->f);
        return;
    case JV_STR: json_str(c, b, v->s.s, v->s.n, o->ascii); return;
    case JV_LIST:
    case JV_DICT: {
        bool dict = v->t == JV_DICT;
        size_t n = dict ? v->d.n : v->l.n;
        jbuf_adds(c, b, dict ? "{" : "[");
        if (n == 0) {
            jbuf_adds(c, b, dict ? "}" : "]");
            return;
        }
        size_t *order = jalloc(c, n * sizeof *order);
        for (size_t i = 0; i < n; i++) order[i] = i;
        for (size_t i = 1; dict && o->sort_keys && i < n; i++) /* insertion sort: stable, and may jfail */
            for (size_t j = i; j > 0 && jv_compare(c, v->d.k[order[j - 1]], v->d.k[order[j]]) > 0; j--) {
                size_t t = order[j];
                order[j] = order[j - 1], order[j - 1] = t;
            }
        bool pretty = o->indent >= 0;
        for (size_t i = 0; i < n; i++) {
            if (i) jbuf_adds(c, b, pretty ? "," : ", ");
            if (pretty) json_newline(c, b, o->indent, depth + 1);
            if (dict) {
                const jv *k = v->d.k[order[i]];
                if (k->t == JV_STR) json_str(c, b, k->s.s, k->s.n, o->ascii);
                else if (k->t == JV_NONE || k->t == JV_BOOL || k->t == JV_INT || k->t == JV_FLOAT) {
                    struct jbuf kb = {0};
                    json_to(c, &kb, k, o, depth + 1);
                    json_str(c, b, kb.s, kb.n, o->ascii);
                } else
                    jfail(c, "tojson: keys must be str, int, float, bool or None, not %s", jv_type_name(k));
                jbuf_adds(c, b, ": ");
                json_to(c, b, v->d.v[order[i]], o, depth + 1);
            } else
                json_to(c, b, v->l.v[i], o, depth + 1);
        }
        if (pretty) json_newline(c, b, o->indent, depth);
        jbuf_adds(c, b, dict ? "}" : "]");
        return;
    }
    default: jfail(c, "tojson: Object of type %s is not JSON serializable", jv_type_name(v));
    }
}

void jv_json_to(struct jctx *c, struct jbuf *b, const jv *v, const struct json_opts *o) { json_to(c, b, v, o, 0); }

jv *jv_from_json(struct jctx *c, const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_NULL: return jv_none();
    case JSON_TRUE: return jv_bool(true);
    case JSON_FALSE: return jv_bool(false);
    case JSON_INTEGER: return jv_int(c, (long long)json_integer_value(j));
    case JSON_REAL: return jv_float(c, json_real_value(j));
    case JSON_STRING: return jv_str(c, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        jv *l = jv_list(c, json_array_size(j));
        size_t i;
        json_t *x;
        json_array_foreach(j, i, x) jv_push(c, l, jv_from_json(c, x));
        return l;
    }
    case JSON_OBJECT: {
        jv *d = jv_dict(c);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)j, k, x) dict_append(c, d, jv_cstr(c, k), jv_from_json(c, x));
        return d;
    }
    }
    return jv_none();
}
