/* Renders a parsed template: statements, expressions, and the filters, tests,
 * methods and globals chat templates call. Scoping as jinja2's: a for loop's body
 * and a macro's get a frame of their own (set inside them does not leak out; a
 * namespace() does), if does not. The default Undefined: printing it gives "",
 * its truth is false, iterating it gives nothing, reading an attribute of it fails. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/jinja.h"
#include "server/jinja_impl.h"

#define MAX_DEPTH 200            /* nested macro calls and expressions */
#define MAX_STEPS 10000000LL     /* statements and loop iterations in one render */
#define RENDER_MEMORY ((size_t)256 << 20)

struct frame {
    jv *vars; /* JV_DICT */
    struct frame *parent;
};

struct loop_state {
    jv **items;
    size_t n, i;
};

struct render {
    struct jctx c;
    struct jbuf *out;
    struct frame *globals;
    time_t now;
    int depth;
    long long steps;
};

enum flow { FLOW_NEXT, FLOW_BREAK, FLOW_CONTINUE };

static jv *eval(struct render *R, struct frame *f, const struct node *nd);
static enum flow exec_body(struct render *R, struct frame *f, struct node *const *v, int n);

#define C (&R->c)

static jv *lookup(struct render *R, struct frame *f, const char *name) {
    for (; f; f = f->parent) {
        jv *v = jv_get_cstr(f->vars, name);
        if (v) return v;
    }
    return jv_undef(C, name);
}

static void assign(struct render *R, struct frame *f, const char *name, jv *v) {
    jv *d = f->vars;
    for (size_t i = 0; i < d->d.n; i++) /* no allocation when rebinding: loops do it every iteration */
        if (d->d.k[i]->t == JV_STR && !strcmp(d->d.k[i]->s.s, name)) {
            d->d.v[i] = v;
            return;
        }
    jv_set(C, d, jv_cstr(C, name), v);
}

static struct frame *new_frame(struct render *R, struct frame *parent) {
    struct frame *f = jalloc(C, sizeof *f);
    f->vars = jv_dict(C);
    f->parent = parent;
    return f;
}

static _Noreturn void undefined_error(struct render *R, const jv *u) {
    if (u->s.s[0] == '\'') jfail(C, "%s", u->s.s);
    jfail(C, "'%s' is undefined", u->s.s);
}

static jv *no_attr(struct render *R, const jv *obj, const char *name) {
    char msg[200];
    snprintf(msg, sizeof msg, "'%s object' has no attribute '%.100s'", jv_type_name(obj), name);
    return jv_undef(C, jstrndup(C, msg, strlen(msg)));
}

static jv *str_of(struct render *R, const char *s, size_t n) { return jv_str(C, s, n); }

/* ---- whitespace and case, as Python's str methods see them ---- */

static unsigned long utf8_decode(const char *s, size_t n, size_t *len) {
    const unsigned char *u = (const unsigned char *)s;
    int k = u[0] < 0x80 ? 1 : u[0] < 0xE0 ? 2 : u[0] < 0xF0 ? 3 : 4;
    if ((size_t)k > n) k = 1;
    unsigned long cp = k == 1 ? u[0] : k == 2 ? u[0] & 0x1Fu : k == 3 ? u[0] & 0x0Fu : u[0] & 0x07u;
    for (int i = 1; i < k; i++) cp = cp << 6 | (u[i] & 0x3Fu);
    *len = (size_t)k;
    return cp;
}

static bool py_space(unsigned long cp) {
    return (cp >= 9 && cp <= 13) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

/* Length of the character at s[i] if it is in chars (or whitespace when chars is NULL), else 0. */
static size_t strip_char_at(const char *s, size_t n, size_t i, const jv *chars) {
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

static jv *strip(struct render *R, const jv *s, const jv *chars, bool left, bool right) {
    size_t a = 0, b = s->s.n, k;
    if (chars && chars->t == JV_NONE) chars = NULL;
    if (chars && chars->t != JV_STR) jfail(C, "strip arg must be None or str");
    while (left && a < b && (k = strip_char_at(s->s.s, b, a, chars))) a += k;
    while (right && b > a) {
        size_t st = b - 1;
        while (st > a && ((unsigned char)s->s.s[st] & 0xC0) == 0x80) st--;
        if (!strip_char_at(s->s.s, b, st, chars)) break;
        b = st;
    }
    return str_of(R, s->s.s + a, b - a);
}

enum case_mode { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_TITLE_PY, CASE_TITLE_JINJA };

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

static jv *change_case(struct render *R, const jv *s, enum case_mode m) {
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

static jv *replace(struct render *R, const jv *s, const jv *old, const jv *new_, long long count) {
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
static jv *split(struct render *R, const jv *s, const jv *sep, long long maxsplit, bool from_right) {
    jv *l = jv_list(C, 0);
    const char *str = s->s.s;
    size_t n = s->s.n;
    if (!sep || sep->t == JV_NONE) {
        /* whitespace: collect words, then join the tail beyond maxsplit back */
        size_t i = 0;
        if (!from_right) {
            while (i < n) {
                size_t k;
                while (i < n && (k = strip_char_at(str, n, i, NULL))) i += k;
                if (i >= n) break;
                if (maxsplit >= 0 && (long long)l->l.n >= maxsplit) {
                    size_t e = n;
                    while (e > i) {
                        size_t st = e - 1;
                        while (st > i && ((unsigned char)str[st] & 0xC0) == 0x80) st--;
                        if (!strip_char_at(str, n, st, NULL)) break;
                        e = st;
                    }
                    jv_push(C, l, str_of(R, str + i, e - i));
                    break;
                }
                size_t a = i;
                while (i < n && !strip_char_at(str, n, i, NULL)) {
                    size_t len;
                    utf8_decode(str + i, n - i, &len);
                    i += len;
                }
                jv_push(C, l, str_of(R, str + a, i - a));
            }
            return l;
        }
        jv *all = split(R, s, NULL, -1, false);
        if (maxsplit < 0 || (long long)all->l.n <= maxsplit + 1) return all;
        jv *stripped = strip(R, s, NULL, false, true);
        /* the head keeps its inner whitespace: cut at the start of the last maxsplit words */
        size_t keep = all->l.n - (size_t)maxsplit, pos = 0, e = stripped->s.n;
        for (size_t w = 0; w < keep; w++) {
            const char *q = memmem(stripped->s.s + pos, e - pos, all->l.v[w]->s.s, all->l.v[w]->s.n);
            pos = (size_t)(q - stripped->s.s) + all->l.v[w]->s.n;
        }
        size_t head = 0, k;
        while (head < pos && (k = strip_char_at(stripped->s.s, e, head, NULL))) head += k;
        jv_push(C, l, str_of(R, stripped->s.s + head, pos - head));
        for (size_t w = keep; w < all->l.n; w++) jv_push(C, l, all->l.v[w]);
        return l;
    }
    if (sep->t != JV_STR) jfail(C, "split() separator must be str or None");
    if (sep->s.n == 0) jfail(C, "empty separator");
    if (!from_right) {
        const char *p = str, *end = str + n, *q;
        while ((maxsplit < 0 || (long long)l->l.n < maxsplit) && (q = memmem(p, (size_t)(end - p), sep->s.s, sep->s.n))) {
            jv_push(C, l, str_of(R, p, (size_t)(q - p)));
            p = q + sep->s.n;
        }
        jv_push(C, l, str_of(R, p, (size_t)(end - p)));
        return l;
    }
    jv *parts = split(R, s, sep, -1, false);
    if (maxsplit < 0 || (long long)parts->l.n <= maxsplit + 1) return parts;
    size_t keep = parts->l.n - (size_t)maxsplit, head_len = 0;
    for (size_t w = 0; w < keep; w++) head_len += parts->l.v[w]->s.n + (w ? sep->s.n : 0);
    jv_push(C, l, str_of(R, str, head_len));
    for (size_t w = keep; w < parts->l.n; w++) jv_push(C, l, parts->l.v[w]);
    return l;
}

/* ---- sequences ---- */

/* What a for loop or a filter iterates: list items, dict keys, string characters. */
static jv *iterate(struct render *R, const jv *v) {
    switch (v->t) {
    case JV_UNDEF: return jv_list(C, 0);
    case JV_LIST: return (jv *)v;
    case JV_DICT: {
        jv *l = jv_list(C, v->d.n);
        for (size_t i = 0; i < v->d.n; i++) jv_push(C, l, v->d.k[i]);
        return l;
    }
    case JV_STR: {
        jv *l = jv_list(C, 0);
        for (size_t i = 0; i < v->s.n;) {
            size_t len;
            utf8_decode(v->s.s + i, v->s.n - i, &len);
            jv_push(C, l, str_of(R, v->s.s + i, len));
            i += len;
        }
        return l;
    }
    default: jfail(C, "'%s' object is not iterable", jv_type_name(v));
    }
}

static long long length(struct render *R, const jv *v) {
    switch (v->t) {
    case JV_UNDEF: return 0;
    case JV_STR: return (long long)utf8_len(v->s.s, v->s.n);
    case JV_LIST: return (long long)v->l.n;
    case JV_DICT:
    case JV_NS: return (long long)v->d.n;
    default: jfail(C, "object of type '%s' has no len()", jv_type_name(v));
    }
}

static long long to_index(struct render *R, const jv *v, const char *what) {
    if (v->t == JV_INT) return v->i;
    if (v->t == JV_BOOL) return v->b;
    jfail(C, "%s must be integers, not %s", what, jv_type_name(v));
}

static jv *slice(struct render *R, const jv *obj, const jv *a, const jv *b, const jv *step_v) {
    long long step = step_v && step_v->t != JV_NONE ? to_index(R, step_v, "slice indices") : 1;
    if (step == 0) jfail(C, "slice step cannot be zero");
    bool is_str = obj->t == JV_STR;
    if (!is_str && obj->t != JV_LIST) jfail(C, "'%s' object is not subscriptable", jv_type_name(obj));
    jv *items = is_str ? iterate(R, obj) : (jv *)obj;
    long long n = (long long)items->l.n;
    long long lo, hi;
    if (step > 0) {
        lo = a && a->t != JV_NONE ? to_index(R, a, "slice indices") : 0;
        hi = b && b->t != JV_NONE ? to_index(R, b, "slice indices") : n;
        if (lo < 0) lo += n;
        if (hi < 0) hi += n;
        lo = lo < 0 ? 0 : lo > n ? n : lo;
        hi = hi < 0 ? 0 : hi > n ? n : hi;
    } else {
        lo = a && a->t != JV_NONE ? to_index(R, a, "slice indices") : n - 1;
        hi = b && b->t != JV_NONE ? to_index(R, b, "slice indices") : -n - 1;
        if (lo < 0) lo += n;
        if (hi < 0) hi += n;
        lo = lo < -1 ? -1 : lo > n - 1 ? n - 1 : lo;
        hi = hi < -1 ? -1 : hi > n - 1 ? n - 1 : hi;
    }
    jv *out = jv_list(C, 0);
    out->tuple = obj->tuple;
    for (long long i = lo; step > 0 ? i < hi : i > hi; i += step) jv_push(C, out, items->l.v[i]);
    if (!is_str) return out;
    struct jbuf sb = {0};
    for (size_t i = 0; i < out->l.n; i++) jbuf_add(C, &sb, out->l.v[i]->s.s, out->l.v[i]->s.n);
    return jbuf_value(C, &sb);
}

/* ---- attribute and item access ---- */

static bool is_one_of(const char *name, const char *const *names) {
    for (; *names; names++)
        if (!strcmp(name, *names)) return true;
    return false;
}

static const char *const str_methods[] = {"startswith", "endswith", "strip", "lstrip", "rstrip", "split", "rsplit",
                                          "upper", "lower", "title", "capitalize", "replace", "find", "rfind",
                                          "count", "join", "splitlines", "isdigit", "isalpha", "isalnum",
                                          "isspace", "islower", "isupper", "format", NULL};
static const char *const dict_methods[] = {"items", "keys", "values", "get", NULL};
static const char *const list_methods[] = {"index", "count", NULL};

static jv *loop_attr(struct render *R, jv *lv, const char *name) {
    struct loop_state *L = lv->loop;
    long long i = (long long)L->i, n = (long long)L->n;
    if (!strcmp(name, "index")) return jv_int(C, i + 1);
    if (!strcmp(name, "index0")) return jv_int(C, i);
    if (!strcmp(name, "revindex")) return jv_int(C, n - i);
    if (!strcmp(name, "revindex0")) return jv_int(C, n - i - 1);
    if (!strcmp(name, "first")) return jv_bool(i == 0);
    if (!strcmp(name, "last")) return jv_bool(i == n - 1);
    if (!strcmp(name, "length")) return jv_int(C, n);
    if (!strcmp(name, "depth")) return jv_int(C, 1);
    if (!strcmp(name, "depth0")) return jv_int(C, 0);
    if (!strcmp(name, "previtem")) return i > 0 ? L->items[i - 1] : jv_undef(C, "there is no previous item");
    if (!strcmp(name, "nextitem")) return i + 1 < n ? L->items[i + 1] : jv_undef(C, "there is no next item");
    if (!strcmp(name, "cycle")) return jv_func(C, "cycle", lv);
    return no_attr(R, lv, name);
}

static jv *getattr(struct render *R, jv *obj, const char *name) {
    switch (obj->t) {
    case JV_UNDEF: undefined_error(R, obj);
    case JV_DICT:
        if (is_one_of(name, dict_methods)) return jv_func(C, name, obj);
        /* fall through */
    case JV_NS: {
        jv *v = jv_get_cstr(obj, name);
        return v ? v : no_attr(R, obj, name);
    }
    case JV_LOOP: return loop_attr(R, obj, name);
    case JV_STR: return is_one_of(name, str_methods) ? jv_func(C, name, obj) : no_attr(R, obj, name);
    case JV_LIST: return is_one_of(name, list_methods) ? jv_func(C, name, obj) : no_attr(R, obj, name);
    default: return no_attr(R, obj, name);
    }
}

static jv *getitem(struct render *R, jv *obj, jv *key) {
    switch (obj->t) {
    case JV_UNDEF: undefined_error(R, obj);
    case JV_DICT: {
        jv *v = jv_get(obj, key);
        if (v) return v;
        break;
    }
    case JV_LIST:
    case JV_STR:
        if (key->t == JV_INT || key->t == JV_BOOL) {
            long long i = to_index(R, key, "indices"), n = length(R, obj);
            if (i < 0) i += n;
            if (i < 0 || i >= n) return jv_undef(C, "index out of range");
            if (obj->t == JV_LIST) return obj->l.v[i];
            size_t a = utf8_offset(obj->s.s, obj->s.n, (size_t)i), len;
            utf8_decode(obj->s.s + a, obj->s.n - a, &len);
            return str_of(R, obj->s.s + a, len);
        }
        break;
    default: break;
    }
    if (key->t == JV_STR) return getattr(R, obj, key->s.s);
    char msg[64];
    snprintf(msg, sizeof msg, "'%s object' has no item of that type", jv_type_name(obj));
    return jv_undef(C, jstrndup(C, msg, strlen(msg)));
}

/* ---- calls ---- */

struct args {
    jv **pos;
    int npos;
    const char **kwn;
    jv **kwv;
    int nkw;
};

static jv *kwarg(const struct args *a, const char *name) {
    for (int i = 0; i < a->nkw; i++)
        if (!strcmp(a->kwn[i], name)) return a->kwv[i];
    return NULL;
}

/* Argument i, or the keyword name, or def. */
static jv *arg(const struct args *a, int i, const char *name, jv *def) {
    if (i >= 0 && i < a->npos) return a->pos[i];
    jv *k = name ? kwarg(a, name) : NULL;
    return k ? k : def;
}

static void eval_args(struct render *R, struct frame *f, const struct node *nd, struct args *a, jv *first) {
    int extra = first ? 1 : 0;
    a->pos = jalloc(C, (size_t)(nd->n + extra) * sizeof *a->pos);
    a->kwn = jalloc(C, (size_t)(nd->n + 1) * sizeof *a->kwn);
    a->kwv = jalloc(C, (size_t)(nd->n + 1) * sizeof *a->kwv);
    a->npos = a->nkw = 0;
    if (first) a->pos[a->npos++] = first;
    for (int i = 0; i < nd->n; i++) {
        jv *v = eval(R, f, nd->v[i]);
        if (nd->kw && nd->kw[i]) a->kwn[a->nkw] = nd->kw[i], a->kwv[a->nkw++] = v;
        else a->pos[a->npos++] = v;
    }
}

static jv *need_str(struct render *R, jv *v, const char *what) {
    if (v->t != JV_STR) jfail(C, "%s must be a string, not %s", what, jv_type_name(v));
    return v;
}

static long long need_int(struct render *R, jv *v, const char *what) {
    if (v->t == JV_INT) return v->i;
    if (v->t == JV_BOOL) return v->b;
    jfail(C, "%s must be an integer, not %s", what, jv_type_name(v));
}

static jv *call_macro(struct render *R, jv *m, const struct args *a, jv *caller);
static jv *apply_filter(struct render *R, struct frame *f, const char *name, const struct args *a);
static bool apply_test(struct render *R, struct frame *f, const char *name, const struct args *a);

static bool starts_ends(const jv *s, const jv *x, bool end) {
    if (x->s.n > s->s.n) return false;
    return !memcmp(s->s.s + (end ? s->s.n - x->s.n : 0), x->s.s, x->s.n);
}

static jv *str_method(struct render *R, const char *name, jv *s, const struct args *a) {
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        bool end = name[0] == 'e';
        jv *x = arg(a, 0, NULL, NULL);
        if (!x) jfail(C, "%s() takes at least 1 argument", name);
        if (x->t == JV_LIST) {
            for (size_t i = 0; i < x->l.n; i++)
                if (starts_ends(s, need_str(R, x->l.v[i], name), end)) return jv_bool(true);
            return jv_bool(false);
        }
        return jv_bool(starts_ends(s, need_str(R, x, name), end));
    }
    if (!strcmp(name, "strip")) return strip(R, s, arg(a, 0, NULL, NULL), true, true);
    if (!strcmp(name, "lstrip")) return strip(R, s, arg(a, 0, NULL, NULL), true, false);
    if (!strcmp(name, "rstrip")) return strip(R, s, arg(a, 0, NULL, NULL), false, true);
    if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
        jv *ms = arg(a, 1, "maxsplit", NULL);
        return split(R, s, arg(a, 0, "sep", NULL), ms ? need_int(R, ms, "maxsplit") : -1, name[0] == 'r');
    }
    if (!strcmp(name, "upper")) return change_case(R, s, CASE_UPPER);
    if (!strcmp(name, "lower")) return change_case(R, s, CASE_LOWER);
    if (!strcmp(name, "title")) return change_case(R, s, CASE_TITLE_PY);
    if (!strcmp(name, "capitalize")) return change_case(R, change_case(R, s, CASE_LOWER), CASE_CAPITALIZE);
    if (!strcmp(name, "replace")) {
        jv *cnt = arg(a, 2, "count", NULL);
        if (!arg(a, 1, NULL, NULL)) jfail(C, "replace() takes 2 arguments");
        return replace(R, s, a->pos[0], a->pos[1], cnt ? need_int(R, cnt, "count") : -1);
    }
    if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "count")) {
        jv *x = need_str(R, arg(a, 0, NULL, jv_none()), name);
        long long found = -1, count = 0;
        for (size_t i = 0; i + x->s.n <= s->s.n;) {
            if (!memcmp(s->s.s + i, x->s.s, x->s.n)) {
                if (found < 0 || name[0] == 'r') found = (long long)utf8_len(s->s.s, i);
                count++;
                i += x->s.n ? x->s.n : 1;
            } else
                i++;
        }
        return jv_int(C, name[0] == 'c' ? count : found);
    }
    if (!strcmp(name, "join")) {
        jv *items = iterate(R, arg(a, 0, NULL, jv_none()));
        struct jbuf b = {0};
        for (size_t i = 0; i < items->l.n; i++) {
            if (i) jbuf_add(C, &b, s->s.s, s->s.n);
            jv *x = need_str(R, items->l.v[i], "join() item");
            jbuf_add(C, &b, x->s.s, x->s.n);
        }
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "splitlines")) {
        jv *l = jv_list(C, 0);
        size_t st = 0;
        for (size_t i = 0; i < s->s.n; i++)
            if (s->s.s[i] == '\n' || s->s.s[i] == '\r') {
                jv_push(C, l, str_of(R, s->s.s + st, i - st));
                if (s->s.s[i] == '\r' && i + 1 < s->s.n && s->s.s[i + 1] == '\n') i++;
                st = i + 1;
            }
        if (st < s->s.n) jv_push(C, l, str_of(R, s->s.s + st, s->s.n - st));
        return l;
    }
    if (!strncmp(name, "is", 2)) {
        bool all = s->s.n > 0, any_cased = false;
        for (size_t i = 0; i < s->s.n; i++) {
            unsigned char ch = (unsigned char)s->s.s[i];
            bool lo = ch >= 'a' && ch <= 'z', up = ch >= 'A' && ch <= 'Z', dig = ch >= '0' && ch <= '9';
            any_cased = any_cased || lo || up;
            if (!strcmp(name, "isdigit")) all = all && dig;
            else if (!strcmp(name, "isalpha")) all = all && (lo || up);
            else if (!strcmp(name, "isalnum")) all = all && (lo || up || dig);
            else if (!strcmp(name, "isspace")) all = all && strip_char_at(s->s.s, s->s.n, i, NULL);
            else if (!strcmp(name, "islower")) all = all && !up;
            else if (!strcmp(name, "isupper")) all = all && !lo;
        }
        if (!strcmp(name, "islower") || !strcmp(name, "isupper")) all = all && any_cased;
        return jv_bool(all);
    }
    jfail(C, "str.%s() is not supported", name);
}

static jv *call_func(struct render *R, jv *fn, const struct args *a) {
    const char *name = fn->fn.name;
    jv *self = fn->fn.self;
    if (self && self->t == JV_STR) return str_method(R, name, self, a);
    if (self && self->t == JV_DICT) {
        if (!strcmp(name, "get")) {
            jv *v = jv_get(self, arg(a, 0, NULL, jv_none()));
            return v ? v : arg(a, 1, NULL, jv_none());
        }
        jv *l = jv_list(C, self->d.n);
        for (size_t i = 0; i < self->d.n; i++) {
            if (name[0] == 'k') jv_push(C, l, self->d.k[i]);
            else if (name[0] == 'v') jv_push(C, l, self->d.v[i]);
            else {
                jv *pair = jv_list(C, 2);
                pair->tuple = true;
                jv_push(C, pair, self->d.k[i]);
                jv_push(C, pair, self->d.v[i]);
                jv_push(C, l, pair);
            }
        }
        return l;
    }
    if (self && self->t == JV_LIST) {
        jv *x = arg(a, 0, NULL, jv_none());
        long long count = 0;
        for (size_t i = 0; i < self->l.n; i++)
            if (jv_equal(self->l.v[i], x)) {
                if (name[0] == 'i') return jv_int(C, (long long)i);
                count++;
            }
        if (name[0] == 'i') jfail(C, "list.index(x): x not in list");
        return jv_int(C, count);
    }
    if (self && self->t == JV_LOOP) { /* loop.cycle */
        if (a->npos == 0) jfail(C, "no items for cycling given");
        return a->pos[self->loop->i % (size_t)a->npos];
    }
    if (!strcmp(name, "raise_exception")) {
        jv *msg = jv_to_str(C, arg(a, 0, NULL, jv_cstr(C, "")));
        R->c.line = 0;
        jfail(C, "%s", msg->s.s);
    }
    if (!strcmp(name, "strftime_now")) {
        jv *fmt = need_str(R, arg(a, 0, NULL, jv_none()), "strftime_now's format");
        struct tm tm;
        localtime_r(&R->now, &tm);
        char buf[512];
        size_t n = fmt->s.n ? strftime(buf, sizeof buf, fmt->s.s, &tm) : 0;
        return str_of(R, buf, n);
    }
    if (!strcmp(name, "namespace") || !strcmp(name, "dict")) {
        jv *d = jv_dict(C);
        d->t = name[0] == 'n' ? JV_NS : JV_DICT;
        for (int i = 0; i < a->npos; i++) {
            if (a->pos[i]->t != JV_DICT) jfail(C, "%s() takes keyword arguments or a dict", name);
            for (size_t k = 0; k < a->pos[i]->d.n; k++) jv_set(C, d, a->pos[i]->d.k[k], a->pos[i]->d.v[k]);
        }
        for (int i = 0; i < a->nkw; i++) jv_set(C, d, jv_cstr(C, a->kwn[i]), a->kwv[i]);
        return d;
    }
    if (!strcmp(name, "range")) {
        long long lo = 0, hi, step = 1;
        if (a->npos == 1) hi = need_int(R, a->pos[0], "range()");
        else if (a->npos == 2 || a->npos == 3) {
            lo = need_int(R, a->pos[0], "range()");
            hi = need_int(R, a->pos[1], "range()");
            if (a->npos == 3) step = need_int(R, a->pos[2], "range()");
        } else
            jfail(C, "range() takes 1 to 3 arguments");
        if (step == 0) jfail(C, "range() arg 3 must not be zero");
        jv *l = jv_list(C, 0);
        for (long long i = lo; step > 0 ? i < hi : i > hi; i += step) jv_push(C, l, jv_int(C, i));
        return l;
    }
    jfail(C, "'%s' is not callable here", name);
}

static jv *call(struct render *R, jv *callee, const struct args *a) {
    if (callee->t == JV_MACRO) return call_macro(R, callee, a, NULL);
    if (callee->t == JV_FUNC) return call_func(R, callee, a);
    if (callee->t == JV_UNDEF) undefined_error(R, callee);
    jfail(C, "'%s' object is not callable", jv_type_name(callee));
}

/* ---- operators ---- */

static jv *arith(struct render *R, int op, jv *a, jv *b) {
    if (a->t == JV_UNDEF) undefined_error(R, a);
    if (b->t == JV_UNDEF) undefined_error(R, b);
    if (op == '~') {
        struct jbuf s = {0};
        jv_str_to(C, &s, a);
        jv_str_to(C, &s, b);
        return jbuf_value(C, &s);
    }
    if (op == OP_IN || op == OP_NOTIN) {
        bool in;
        if (b->t == JV_STR) in = a->t == JV_STR && memmem(b->s.s, b->s.n, a->s.s, a->s.n) != NULL;
        else if (b->t == JV_DICT || b->t == JV_NS) in = jv_get(b, a) != NULL;
        else if (b->t == JV_LIST) {
            in = false;
            for (size_t i = 0; i < b->l.n && !in; i++) in = jv_equal(a, b->l.v[i]);
        } else
            jfail(C, "argument of type '%s' is not iterable", jv_type_name(b));
        if (b->t == JV_STR && a->t != JV_STR) jfail(C, "'in <string>' requires string as left operand");
        return jv_bool(in == (op == OP_IN));
    }
    if (op == OP_EQ || op == OP_NE) return jv_bool(jv_equal(a, b) == (op == OP_EQ));
    if (op == '<' || op == '>' || op == OP_LE || op == OP_GE) {
        int r = jv_compare(C, a, b);
        return jv_bool(op == '<' ? r < 0 : op == '>' ? r > 0 : op == OP_LE ? r <= 0 : r >= 0);
    }
    if (op == '+' && a->t == JV_STR && b->t == JV_STR) {
        struct jbuf s = {0};
        jbuf_add(C, &s, a->s.s, a->s.n);
        jbuf_add(C, &s, b->s.s, b->s.n);
        return jbuf_value(C, &s);
    }
    if (op == '+' && a->t == JV_LIST && b->t == JV_LIST) {
        jv *l = jv_list(C, a->l.n + b->l.n);
        for (size_t i = 0; i < a->l.n; i++) jv_push(C, l, a->l.v[i]);
        for (size_t i = 0; i < b->l.n; i++) jv_push(C, l, b->l.v[i]);
        return l;
    }
    if (op == '*' && ((a->t == JV_STR || a->t == JV_LIST) && (b->t == JV_INT || b->t == JV_BOOL))) {
        long long k = need_int(R, b, "repeat count");
        if (k > 0 && (a->t == JV_STR ? a->s.n : a->l.n) * (unsigned long long)k > ((size_t)64 << 20))
            jfail(C, "repeated sequence too long");
        if (a->t == JV_STR) {
            struct jbuf s = {0};
            for (long long i = 0; i < k; i++) jbuf_add(C, &s, a->s.s, a->s.n);
            return jbuf_value(C, &s);
        }
        jv *l = jv_list(C, 0);
        for (long long i = 0; i < k; i++)
            for (size_t j = 0; j < a->l.n; j++) jv_push(C, l, a->l.v[j]);
        return l;
    }
    if (op == '*' && (b->t == JV_STR || b->t == JV_LIST) && (a->t == JV_INT || a->t == JV_BOOL))
        return arith(R, op, b, a);
    if (!jv_is_number(a) || !jv_is_number(b)) {
        const char *ops = op == '+' ? "+" : op == '-' ? "-" : op == '*' ? "*" : op == '/' ? "/" : op == '%' ? "%"
                        : op == OP_FLOORDIV ? "//" : "**";
        jfail(C, "unsupported operand type(s) for %s: '%s' and '%s'", ops, jv_type_name(a), jv_type_name(b));
    }
    bool ints = a->t != JV_FLOAT && b->t != JV_FLOAT;
    double x = jv_num(a), y = jv_num(b);
    long long i = a->t == JV_BOOL ? a->b : a->i, j = b->t == JV_BOOL ? b->b : b->i;
    long long r;
    switch (op) {
    case '+':
        if (!ints) return jv_float(C, x + y);
        if (__builtin_add_overflow(i, j, &r)) jfail(C, "integer overflow");
        return jv_int(C, r);
    case '-':
        if (!ints) return jv_float(C, x - y);
        if (__builtin_sub_overflow(i, j, &r)) jfail(C, "integer overflow");
        return jv_int(C, r);
    case '*':
        if (!ints) return jv_float(C, x * y);
        if (__builtin_mul_overflow(i, j, &r)) jfail(C, "integer overflow");
        return jv_int(C, r);
    case '/':
        if (y == 0) jfail(C, "division by zero");
        return jv_float(C, x / y);
    case OP_FLOORDIV:
    case '%':
        if (y == 0) jfail(C, "integer division or modulo by zero");
        if (ints) {
            if (i == (long long)(-9223372036854775807LL - 1) && j == -1) jfail(C, "integer overflow");
            long long q = i / j, r = i % j;
            if (r != 0 && ((r < 0) != (j < 0))) q--, r += j;
            return jv_int(C, op == '%' ? r : q);
        } else {
            double r = fmod(x, y);
            if (r != 0 && ((r < 0) != (y < 0))) r += y;
            return jv_float(C, op == '%' ? r : floor(x / y));
        }
    default: /* ** */
        if (ints && j >= 0) {
            r = 1;
            for (long long k = 0; k < j && r != 0 && (r != 1 || (i != 0 && i != 1 && i != -1) || k < 2); k++)
                if (__builtin_mul_overflow(r, i, &r)) jfail(C, "integer overflow");
            if (i == -1 && (j & 1)) r = -1;
            return jv_int(C, r);
        }
        return jv_float(C, pow(x, y));
    }
}

/* ---- expressions ---- */

static jv *eval(struct render *R, struct frame *f, const struct node *nd) {
    if (++R->depth > MAX_DEPTH * 4) jfail(C, "expression nested too deeply");
    R->c.line = nd->line;
    jv *v;
    struct args a;
    switch (nd->k) {
    case E_LIT: v = nd->lit; break;
    case E_NAME: v = lookup(R, f, nd->name); break;
    case E_ATTR: v = getattr(R, eval(R, f, nd->a), nd->name); break;
    case E_ITEM: {
        jv *obj = eval(R, f, nd->a);
        v = getitem(R, obj, eval(R, f, nd->b));
        break;
    }
    case E_SLICE: {
        jv *obj = eval(R, f, nd->a), *p[3];
        for (int i = 0; i < 3; i++) p[i] = nd->v[i] ? eval(R, f, nd->v[i]) : NULL;
        if (obj->t == JV_UNDEF) undefined_error(R, obj);
        v = slice(R, obj, p[0], p[1], p[2]);
        break;
    }
    case E_CALL: {
        jv *callee = eval(R, f, nd->a);
        eval_args(R, f, nd, &a, NULL);
        R->c.line = nd->line;
        v = call(R, callee, &a);
        break;
    }
    case E_FILTER:
        eval_args(R, f, nd, &a, eval(R, f, nd->a));
        R->c.line = nd->line;
        v = apply_filter(R, f, nd->name, &a);
        break;
    case E_TEST:
        eval_args(R, f, nd, &a, eval(R, f, nd->a));
        R->c.line = nd->line;
        v = jv_bool(apply_test(R, f, nd->name, &a) != nd->neg);
        break;
    case E_BIN: {
        jv *x = eval(R, f, nd->a);
        v = arith(R, nd->op, x, eval(R, f, nd->b));
        break;
    }
    case E_NEG: {
        jv *x = eval(R, f, nd->a);
        if (x->t == JV_INT || x->t == JV_BOOL) v = jv_int(C, -(x->t == JV_BOOL ? x->b : x->i));
        else if (x->t == JV_FLOAT) v = jv_float(C, -x->f);
        else if (x->t == JV_UNDEF) undefined_error(R, x);
        else jfail(C, "bad operand type for unary -: '%s'", jv_type_name(x));
        break;
    }
    case E_NOT: v = jv_bool(!jv_truthy(eval(R, f, nd->a))); break;
    case E_AND: {
        jv *x = eval(R, f, nd->a);
        v = jv_truthy(x) ? eval(R, f, nd->b) : x;
        break;
    }
    case E_OR: {
        jv *x = eval(R, f, nd->a);
        v = jv_truthy(x) ? x : eval(R, f, nd->b);
        break;
    }
    case E_COND:
        if (jv_truthy(eval(R, f, nd->b))) v = eval(R, f, nd->a);
        else v = nd->c ? eval(R, f, nd->c) : jv_undef(C, "the conditional expression's else");
        break;
    case E_LIST:
    case E_TUPLE:
        v = jv_list(C, (size_t)nd->n);
        v->tuple = nd->k == E_TUPLE;
        for (int i = 0; i < nd->n; i++) jv_push(C, v, eval(R, f, nd->v[i]));
        break;
    case E_DICT:
        v = jv_dict(C);
        for (int i = 0; i + 1 < nd->n; i += 2) {
            jv *k = eval(R, f, nd->v[i]);
            jv_set(C, v, k, eval(R, f, nd->v[i + 1]));
        }
        break;
    default: jfail(C, "not an expression");
    }
    R->depth--;
    return v;
}

/* ---- filters ---- */

/* The value at a dotted attribute path ("function.name", "0"), as jinja2's attrgetter. */
static jv *attr_path(struct render *R, jv *obj, jv *path) {
    if (path->t == JV_INT) return getitem(R, obj, path);
    need_str(R, path, "attribute");
    const char *p = path->s.s;
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        jv *key;
        bool digits = n > 0;
        for (size_t i = 0; i < n; i++) digits = digits && p[i] >= '0' && p[i] <= '9';
        key = digits ? jv_int(C, strtoll(p, NULL, 10)) : str_of(R, p, n);
        if (obj->t == JV_UNDEF) return obj;
        obj = getitem(R, obj, key);
        if (!dot) return obj;
        p = dot + 1;
    }
}

/* select / reject / selectattr / rejectattr */
static jv *select_items(struct render *R, struct frame *f, const struct args *a, bool by_attr, bool keep) {
    jv *items = iterate(R, a->pos[0]);
    int first_test_arg = by_attr ? 2 : 1;
    jv *attr = by_attr ? arg(a, 1, NULL, NULL) : NULL;
    if (by_attr && !attr) jfail(C, "selectattr/rejectattr need an attribute");
    jv *test = arg(a, first_test_arg, NULL, NULL);
    jv *out = jv_list(C, 0);
    for (size_t i = 0; i < items->l.n; i++) {
        jv *x = by_attr ? attr_path(R, items->l.v[i], attr) : items->l.v[i];
        bool ok;
        if (!test) ok = jv_truthy(x);
        else {
            struct args ta = {0};
            int n = a->npos - first_test_arg;
            ta.pos = jalloc(C, (size_t)n * sizeof *ta.pos);
            ta.pos[0] = x;
            for (int k = 1; k < n; k++) ta.pos[k] = a->pos[first_test_arg + k];
            ta.npos = n;
            ok = apply_test(R, f, need_str(R, test, "test name")->s.s, &ta);
        }
        if (ok == keep) jv_push(C, out, items->l.v[i]);
    }
    return out;
}

struct sort_ctx {
    struct render *R;
    bool reverse, case_sensitive;
    jv *attr;
};
static _Thread_local struct sort_ctx *sort_cur;

static jv *sort_key(jv *x) {
    struct sort_ctx *s = sort_cur;
    if (s->attr) x = attr_path(s->R, x, s->attr);
    if (!s->case_sensitive && x->t == JV_STR) x = change_case(s->R, x, CASE_LOWER);
    return x;
}

static int sort_cmp(const void *pa, const void *pb) {
    jv *a = sort_key(*(jv *const *)pa), *b = sort_key(*(jv *const *)pb);
    int r = jv_compare(&sort_cur->R->c, a, b);
    return sort_cur->reverse ? -r : r;
}

static jv *sort_filter(struct render *R, const struct args *a) {
    jv *items = iterate(R, a->pos[0]);
    jv *out = jv_list(C, items->l.n);
    for (size_t i = 0; i < items->l.n; i++) jv_push(C, out, items->l.v[i]);
    struct sort_ctx s = {R, jv_truthy(arg(a, 1, "reverse", jv_bool(false))),
                         jv_truthy(arg(a, 2, "case_sensitive", jv_bool(false))), arg(a, 3, "attribute", NULL)};
    if (s.attr && s.attr->t == JV_NONE) s.attr = NULL;
    struct sort_ctx *saved = sort_cur;
    sort_cur = &s;
    /* insertion sort: stable like Python's, and jfail may longjmp out of it safely */
    for (size_t i = 1; i < out->l.n; i++) {
        jv *x = out->l.v[i];
        size_t j = i;
        while (j > 0 && sort_cmp(&out->l.v[j - 1], &x) > 0) {
            out->l.v[j] = out->l.v[j - 1];
            j--;
        }
        out->l.v[j] = x;
    }
    sort_cur = saved;
    return out;
}

static jv *apply_filter(struct render *R, struct frame *f, const char *name, const struct args *a) {
    jv *x = a->pos[0];
    if (!strcmp(name, "tojson")) {
        /* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
        jv *ind = arg(a, 2, "indent", jv_none());
        if (arg(a, 3, "separators", jv_none())->t != JV_NONE) jfail(C, "tojson: separators are not supported");
        struct json_opts o = {ind->t == JV_NONE ? -1 : (int)need_int(R, ind, "indent"),
                              jv_truthy(arg(a, 1, "ensure_ascii", jv_bool(false))),
                              jv_truthy(arg(a, 4, "sort_keys", jv_bool(false)))};
        if (o.indent > 1000) jfail(C, "tojson: indent %d is too large", o.indent);
        struct jbuf b = {0};
        jv_json_to(C, &b, x, &o);
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        bool boolean = jv_truthy(arg(a, 2, "boolean", jv_bool(false)));
        if (x->t == JV_UNDEF || (boolean && !jv_truthy(x))) return arg(a, 1, "default_value", jv_cstr(C, ""));
        return x;
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) return jv_int(C, length(R, x));
    if (!strcmp(name, "safe")) return x;
    if (x->t == JV_UNDEF && strcmp(name, "list") && strcmp(name, "items") && strcmp(name, "join") &&
        strcmp(name, "string") && strcmp(name, "first") && strcmp(name, "last") && strcmp(name, "select") &&
        strcmp(name, "reject") && strcmp(name, "selectattr") && strcmp(name, "rejectattr") && strcmp(name, "map"))
        undefined_error(R, x);
    if (!strcmp(name, "string")) return jv_to_str(C, x);
    if (!strcmp(name, "trim")) return strip(R, jv_to_str(C, x), arg(a, 1, "chars", NULL), true, true);
    if (!strcmp(name, "upper")) return change_case(R, jv_to_str(C, x), CASE_UPPER);
    if (!strcmp(name, "lower")) return change_case(R, jv_to_str(C, x), CASE_LOWER);
    if (!strcmp(name, "capitalize")) return change_case(R, change_case(R, jv_to_str(C, x), CASE_LOWER), CASE_CAPITALIZE);
    if (!strcmp(name, "title")) return change_case(R, change_case(R, jv_to_str(C, x), CASE_LOWER), CASE_TITLE_JINJA);
    if (!strcmp(name, "replace")) {
        jv *cnt = arg(a, 3, "count", jv_none());
        return replace(R, jv_to_str(C, x), arg(a, 1, "old", jv_none()), arg(a, 2, "new", jv_none()),
                       cnt->t == JV_NONE ? -1 : need_int(R, cnt, "count"));
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jv *items = iterate(R, x);
        if (!items->l.n) return jv_undef(C, "no first item, sequence was empty");
        return items->l.v[name[0] == 'f' ? 0 : items->l.n - 1];
    }
    if (!strcmp(name, "list")) return iterate(R, x);
    if (!strcmp(name, "reverse")) {
        if (x->t == JV_STR) return slice(R, x, NULL, NULL, jv_int(C, -1));
        jv *items = iterate(R, x), *out = jv_list(C, items->l.n);
        for (size_t i = items->l.n; i-- > 0;) jv_push(C, out, items->l.v[i]);
        return out;
    }
    if (!strcmp(name, "items")) {
        if (x->t == JV_UNDEF) return jv_list(C, 0);
        if (x->t != JV_DICT) jfail(C, "items filter needs a mapping, got %s", jv_type_name(x));
        return call_func(R, jv_func(C, "items", x), &(struct args){0});
    }
    if (!strcmp(name, "join")) {
        jv *sep = jv_to_str(C, arg(a, 1, "d", jv_cstr(C, ""))), *attr = arg(a, 2, "attribute", NULL);
        jv *items = iterate(R, x);
        struct jbuf b = {0};
        for (size_t i = 0; i < items->l.n; i++) {
            if (i) jbuf_add(C, &b, sep->s.s, sep->s.n);
            jv_str_to(C, &b, attr && attr->t != JV_NONE ? attr_path(R, items->l.v[i], attr) : items->l.v[i]);
        }
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "select") || !strcmp(name, "reject")) return select_items(R, f, a, false, name[0] == 's');
    if (!strcmp(name, "selectattr") || !strcmp(name, "rejectattr")) return select_items(R, f, a, true, name[0] == 's');
    if (!strcmp(name, "map")) {
        jv *items = iterate(R, x), *out = jv_list(C, items->l.n);
        jv *attr = kwarg(a, "attribute");
        for (size_t i = 0; i < items->l.n; i++) {
            jv *y;
            if (attr) {
                y = attr_path(R, items->l.v[i], attr);
                jv *def = kwarg(a, "default");
                if (y->t == JV_UNDEF && def) y = def;
            } else {
                if (a->npos < 2) jfail(C, "map needs a filter name or attribute=");
                struct args fa = *a;
                fa.pos = jalloc(C, (size_t)(a->npos - 1) * sizeof *fa.pos);
                fa.pos[0] = items->l.v[i];
                for (int k = 2; k < a->npos; k++) fa.pos[k - 1] = a->pos[k];
                fa.npos = a->npos - 1;
                y = apply_filter(R, f, need_str(R, a->pos[1], "filter name")->s.s, &fa);
            }
            jv_push(C, out, y);
        }
        return out;
    }
    if (!strcmp(name, "int")) {
        jv *def = arg(a, 1, "default", jv_int(C, 0));
        if (x->t == JV_INT) return x;
        if (x->t == JV_BOOL) return jv_int(C, x->b);
        if (x->t == JV_FLOAT) return isfinite(x->f) ? jv_int(C, (long long)x->f) : def;
        if (x->t == JV_STR) {
            char *end;
            jv *t = strip(R, x, NULL, true, true);
            long long i = strtoll(t->s.s, &end, 10);
            if (t->s.n && !*end) return jv_int(C, i);
            double d = strtod(t->s.s, &end);
            return t->s.n && !*end && isfinite(d) ? jv_int(C, (long long)d) : def;
        }
        return def;
    }
    if (!strcmp(name, "float")) {
        jv *def = arg(a, 1, "default", jv_float(C, 0));
        if (jv_is_number(x)) return jv_float(C, jv_num(x));
        if (x->t == JV_STR) {
            char *end;
            jv *t = strip(R, x, NULL, true, true);
            double d = strtod(t->s.s, &end);
            return t->s.n && !*end ? jv_float(C, d) : def;
        }
        return def;
    }
    if (!strcmp(name, "abs")) {
        if (x->t == JV_FLOAT) return jv_float(C, fabs(x->f));
        long long i = need_int(R, x, "abs()");
        return jv_int(C, i < 0 ? -i : i);
    }
    if (!strcmp(name, "sort")) return sort_filter(R, a);
    if (!strcmp(name, "unique")) {
        jv *items = iterate(R, x), *out = jv_list(C, 0);
        for (size_t i = 0; i < items->l.n; i++) {
            bool seen = false;
            for (size_t j = 0; j < out->l.n && !seen; j++) seen = jv_equal(out->l.v[j], items->l.v[i]);
            if (!seen) jv_push(C, out, items->l.v[i]);
        }
        return out;
    }
    if (!strcmp(name, "sum")) {
        jv *items = iterate(R, x), *attr = arg(a, 1, "attribute", NULL), *acc = arg(a, 2, "start", jv_int(C, 0));
        for (size_t i = 0; i < items->l.n; i++)
            acc = arith(R, '+', acc, attr && attr->t != JV_NONE ? attr_path(R, items->l.v[i], attr) : items->l.v[i]);
        return acc;
    }
    if (!strcmp(name, "min") || !strcmp(name, "max")) {
        jv *items = iterate(R, x), *best = NULL;
        for (size_t i = 0; i < items->l.n; i++) {
            int r = best ? jv_compare(C, items->l.v[i], best) : 0;
            if (!best || (name[1] == 'i' ? r < 0 : r > 0)) best = items->l.v[i];
        }
        return best ? best : jv_undef(C, "no min/max of an empty sequence");
    }
    if (!strcmp(name, "indent")) {
        jv *w = arg(a, 1, "width", jv_int(C, 4));
        bool first = jv_truthy(arg(a, 2, "first", jv_bool(false))), blank = jv_truthy(arg(a, 3, "blank", jv_bool(false)));
        struct jbuf pad = {0};
        if (w->t == JV_STR) jbuf_add(C, &pad, w->s.s, w->s.n);
        else
            for (long long i = need_int(R, w, "width"); i > 0; i--) jbuf_adds(C, &pad, " ");
        jv *s = jv_to_str(C, x);
        struct jbuf b = {0};
        if (first) jbuf_add(C, &b, pad.s, pad.n);
        for (size_t i = 0; i < s->s.n; i++) {
            jbuf_add(C, &b, s->s.s + i, 1);
            if (s->s.s[i] == '\n' && i + 1 < s->s.n) {
                bool empty_line = s->s.s[i + 1] == '\n';
                if (blank || !empty_line) jbuf_add(C, &b, pad.s, pad.n);
            }
        }
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "dictsort")) {
        if (x->t != JV_DICT) jfail(C, "dictsort needs a mapping");
        jv *pairs = call_func(R, jv_func(C, "items", x), &(struct args){0});
        struct args sa = {.pos = (jv *[]){pairs, arg(a, 2, "reverse", jv_bool(false)),
                                          arg(a, 1, "case_sensitive", jv_bool(false)), jv_int(C, 0)},
                          .npos = 4};
        return sort_filter(R, &sa);
    }
    if (!strcmp(name, "escape") || !strcmp(name, "e")) {
        jv *s = jv_to_str(C, x);
        struct jbuf b = {0};
        for (size_t i = 0; i < s->s.n; i++) {
            char ch = s->s.s[i];
            const char *r = ch == '&' ? "&amp;" : ch == '<' ? "&lt;" : ch == '>' ? "&gt;" : ch == '"' ? "&#34;"
                          : ch == '\'' ? "&#39;" : NULL;
            if (r) jbuf_adds(C, &b, r);
            else jbuf_add(C, &b, &ch, 1);
        }
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "wordcount")) return jv_int(C, (long long)split(R, jv_to_str(C, x), NULL, -1, false)->l.n);
    jfail(C, "no filter named '%s'", name);
}

/* ---- tests ---- */

static bool apply_test(struct render *R, struct frame *f, const char *name, const struct args *a) {
    (void)f;
    jv *x = a->pos[0], *y = a->npos > 1 ? a->pos[1] : NULL;
    if (!strcmp(name, "defined")) return x->t != JV_UNDEF;
    if (!strcmp(name, "undefined")) return x->t == JV_UNDEF;
    if (!strcmp(name, "none")) return x->t == JV_NONE;
    if (!strcmp(name, "boolean")) return x->t == JV_BOOL;
    if (!strcmp(name, "true")) return x->t == JV_BOOL && x->b;
    if (!strcmp(name, "false")) return x->t == JV_BOOL && !x->b;
    if (!strcmp(name, "string")) return x->t == JV_STR;
    if (!strcmp(name, "number")) return jv_is_number(x);
    if (!strcmp(name, "integer")) return x->t == JV_INT;
    if (!strcmp(name, "float")) return x->t == JV_FLOAT;
    if (!strcmp(name, "mapping")) return x->t == JV_DICT;
    if (!strcmp(name, "iterable")) return x->t == JV_LIST || x->t == JV_DICT || x->t == JV_STR || x->t == JV_UNDEF;
    if (!strcmp(name, "sequence")) return x->t == JV_LIST || x->t == JV_DICT || x->t == JV_STR || x->t == JV_UNDEF;
    if (!strcmp(name, "callable")) return x->t == JV_MACRO || x->t == JV_FUNC;
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (x->t != JV_STR) return false;
        jv *s = change_case(R, x, name[0] == 'l' ? CASE_LOWER : CASE_UPPER);
        return jv_equal(s, x);
    }
    static const char *const binary[] = {"equalto", "eq", "==", "ne", "!=", "sameas", "lt", "lessthan", "le", "gt",
                                         "greaterthan", "ge", "in", "divisibleby", NULL};
    if (!is_one_of(name, binary) && strcmp(name, "odd") && strcmp(name, "even")) jfail(C, "no test named '%s'", name);
    if (!y && strcmp(name, "odd") && strcmp(name, "even")) jfail(C, "test '%s' needs an argument", name);
    if (!strcmp(name, "equalto") || !strcmp(name, "eq") || !strcmp(name, "==")) return jv_equal(x, y);
    if (!strcmp(name, "ne") || !strcmp(name, "!=")) return !jv_equal(x, y);
    if (!strcmp(name, "sameas")) return x == y || (x->t == y->t && (x->t == JV_NONE || (x->t == JV_BOOL && x->b == y->b)));
    if (!strcmp(name, "lt") || !strcmp(name, "lessthan")) return jv_compare(C, x, y) < 0;
    if (!strcmp(name, "le")) return jv_compare(C, x, y) <= 0;
    if (!strcmp(name, "gt") || !strcmp(name, "greaterthan")) return jv_compare(C, x, y) > 0;
    if (!strcmp(name, "ge")) return jv_compare(C, x, y) >= 0;
    if (!strcmp(name, "in")) return jv_truthy(arith(R, OP_IN, x, y));
    if (!strcmp(name, "odd") || !strcmp(name, "even")) return (need_int(R, x, name) & 1) == (name[0] == 'o');
    if (!strcmp(name, "divisibleby")) {
        long long d = need_int(R, y, "divisibleby");
        return d != 0 && need_int(R, x, "divisibleby") % d == 0;
    }
    jfail(C, "no test named '%s'", name);
}

/* ---- statements ---- */

static void emit(struct render *R, const jv *v) {
    if (v->t == JV_STR) jbuf_add(C, R->out, v->s.s, v->s.n);
    else jv_str_to(C, R->out, v);
}

/* Runs body into a string of its own (macros, set blocks, filter blocks). */
static jv *capture(struct render *R, struct frame *f, struct node *const *v, int n) {
    struct jbuf b = {0}, *saved = R->out;
    R->out = &b;
    enum flow fl = exec_body(R, f, v, n);
    R->out = saved;
    if (fl != FLOW_NEXT) jfail(C, "break or continue outside a loop");
    return jbuf_value(C, &b);
}

static void assign_target(struct render *R, struct frame *f, const struct node *t, jv *v) {
    if (t->k == E_NAME) {
        assign(R, f, t->name, v);
    } else if (t->k == E_ATTR) {
        jv *ns = eval(R, f, t->a);
        if (ns->t != JV_NS) jfail(C, "cannot assign attribute on non-namespace object");
        jv_set(C, ns, jv_cstr(C, t->name), v);
    } else { /* tuple unpacking */
        jv *items = iterate(R, v);
        if ((int)items->l.n != t->n)
            jfail(C, "cannot unpack %zu values into %d names", items->l.n, t->n);
        for (int i = 0; i < t->n; i++) assign_target(R, f, t->v[i], items->l.v[i]);
    }
}

static jv *call_macro(struct render *R, jv *m, const struct args *a, jv *caller) {
    const struct node *nd = m->m.node;
    if (R->depth > MAX_DEPTH) jfail(C, "macro calls nested too deeply");
    struct frame *f = new_frame(R, m->m.frame);
    if (a->npos > nd->n2) jfail(C, "macro '%s' takes %d arguments, got %d", nd->name ? nd->name : "caller", nd->n2, a->npos);
    for (int i = 0; i < a->nkw; i++) {
        bool known = false;
        for (int p = 0; p < nd->n2 && !known; p++) known = !strcmp(nd->v2[p]->name, a->kwn[i]);
        if (!known) jfail(C, "macro '%s' has no argument '%s'", nd->name ? nd->name : "caller", a->kwn[i]);
    }
    for (int p = 0; p < nd->n2; p++) {
        const struct node *param = nd->v2[p];
        jv *v = p < a->npos ? a->pos[p] : kwarg(a, param->name);
        if (!v) v = param->a ? eval(R, f, param->a) : jv_undef(C, param->name);
        assign(R, f, param->name, v);
    }
    if (caller) assign(R, f, "caller", caller);
    R->depth += 4;
    jv *out = capture(R, f, nd->v, nd->n);
    R->depth -= 4;
    return out;
}

static enum flow exec_for(struct render *R, struct frame *f, const struct node *nd) {
    jv *seq = eval(R, f, nd->b);
    if (seq->t == JV_NONE) jfail(C, "'NoneType' object is not iterable");
    jv *items = iterate(R, seq);
    struct frame *lf = new_frame(R, f);
    if (nd->c) { /* {% for x in xs if cond %}: the loop sees only the kept items */
        jv *kept = jv_list(C, 0);
        for (size_t i = 0; i < items->l.n; i++) {
            assign_target(R, lf, nd->a, items->l.v[i]);
            if (jv_truthy(eval(R, lf, nd->c))) jv_push(C, kept, items->l.v[i]);
        }
        items = kept;
    }
    if (items->l.n == 0) return exec_body(R, f, nd->v2, nd->n2);
    struct loop_state *L = jalloc(C, sizeof *L);
    L->items = items->l.v;
    L->n = items->l.n;
    jv *lv = jv_dict(C);
    lv->t = JV_LOOP;
    lv->loop = L;
    size_t loop_vars = 0;
    for (L->i = 0; L->i < L->n; L->i++) {
        if (++R->steps > MAX_STEPS) jfail(C, "the template runs too long");
        /* each iteration starts afresh: what the last one set is not seen (its
         * loop variables are the frame's first entries, rebound in place) */
        lf->vars->d.n = loop_vars;
        assign(R, lf, "loop", lv);
        assign_target(R, lf, nd->a, L->items[L->i]);
        loop_vars = lf->vars->d.n;
        if (exec_body(R, lf, nd->v, nd->n) == FLOW_BREAK) break;
    }
    return FLOW_NEXT;
}

static enum flow exec_body(struct render *R, struct frame *f, struct node *const *v, int n) {
    for (int i = 0; i < n; i++) {
        const struct node *nd = v[i];
        if (++R->steps > MAX_STEPS) jfail(C, "the template runs too long");
        R->c.line = nd->line;
        switch (nd->k) {
        case N_TEXT: emit(R, nd->lit); break;
        case N_OUT: emit(R, eval(R, f, nd->a)); break;
        case N_IF: {
            enum flow fl = jv_truthy(eval(R, f, nd->a)) ? exec_body(R, f, nd->v, nd->n) : exec_body(R, f, nd->v2, nd->n2);
            if (fl != FLOW_NEXT) return fl;
            break;
        }
        case N_FOR: exec_for(R, f, nd); break;
        case N_SET: assign_target(R, f, nd->a, eval(R, f, nd->b)); break;
        case N_SETBLOCK: assign_target(R, f, nd->a, capture(R, f, nd->v, nd->n)); break;
        case N_MACRO: {
            jv *m = jv_dict(C);
            m->t = JV_MACRO;
            m->m.node = nd;
            m->m.frame = f;
            assign(R, f, nd->name, m);
            break;
        }
        case N_CALLBLOCK: {
            jv *caller = jv_dict(C);
            caller->t = JV_MACRO;
            caller->m.node = nd;
            caller->m.frame = f;
            jv *callee = eval(R, f, nd->a->a);
            if (callee->t != JV_MACRO) jfail(C, "{%% call %%} needs a macro");
            struct args a;
            eval_args(R, f, nd->a, &a, NULL);
            emit(R, call_macro(R, callee, &a, caller));
            break;
        }
        case N_BREAK: return FLOW_BREAK;
        case N_CONTINUE: return FLOW_CONTINUE;
        case N_SCOPE:
            if (nd->a) {
                struct args a;
                eval_args(R, f, nd->a, &a, capture(R, f, nd->v, nd->n));
                emit(R, apply_filter(R, f, nd->a->name, &a));
            } else {
                enum flow fl = exec_body(R, f, nd->v, nd->n);
                if (fl != FLOW_NEXT) return fl;
            }
            break;
        default: jfail(C, "not a statement");
        }
    }
    return FLOW_NEXT;
}

/* The output, or NULL after an error (R's arena is the caller's to free). */
static char *render_into(struct render *R, const struct jinja_template *t, const json_t *vars) {
    if (setjmp(R->c.on_error)) return NULL;
    struct frame *g = new_frame(R, NULL);
    static const char *const globals[] = {"raise_exception", "strftime_now", "namespace", "range", "dict", NULL};
    for (int i = 0; globals[i]; i++) assign(R, g, globals[i], jv_func(C, globals[i], NULL));
    if (vars && json_is_object(vars)) {
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)vars, k, x) assign(R, g, k, jv_from_json(C, x));
    }
    R->globals = g;
    struct jbuf out = {0};
    R->out = &out;
    /* the template's own top-level sets go in a frame above the globals */
    exec_body(R, new_frame(R, g), t->root->v, t->root->n);
    char *result = malloc(out.n + 1);
    if (!result) {
        snprintf(R->c.err, R->c.err_size, "out of memory");
        return NULL;
    }
    if (out.n) memcpy(result, out.s, out.n);
    result[out.n] = 0;
    return result;
}

char *jinja_render(const struct jinja_template *t, const json_t *vars, time_t now, char *err, size_t err_size) {
    struct render *R = calloc(1, sizeof *R);
    if (!R) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    R->c.limit = RENDER_MEMORY;
    R->c.err = err;
    R->c.err_size = err_size;
    R->now = now;
    char *result = render_into(R, t, vars);
    jarena_free(&R->c);
    free(R);
    return result;
}
