/* The filters, tests, methods and globals chat templates call, with jinja2's and
 * transformers' semantics: tojson is json.dumps(ensure_ascii=False), raise_exception
 * fails the render with its message, strftime_now formats the render's clock. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/jinja_impl.h"

#define C (&R->c)

/* ---- arguments ---- */

jv *jargs_kw(const struct args *a, const char *name) {
    for (int i = 0; i < a->nkw; i++)
        if (!strcmp(a->kwn[i], name)) return a->kwv[i];
    return NULL;
}

/* Argument i, or the keyword name, or def. */
jv *jarg(const struct args *a, int i, const char *name, jv *def) {
    if (i >= 0 && i < a->npos) return a->pos[i];
    jv *k = name ? jargs_kw(a, name) : NULL;
    return k ? k : def;
}

jv *jneed_str(struct render *R, jv *v, const char *what) {
    if (v->t != JV_STR) jfail(C, "%s must be a string, not %s", what, jv_type_name(v));
    return v;
}

long long jneed_int(struct render *R, jv *v, const char *what) {
    if (v->t == JV_INT) return v->i;
    if (v->t == JV_BOOL) return v->b;
    jfail(C, "%s must be an integer, not %s", what, jv_type_name(v));
}

/* ---- methods and globals ---- */

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

bool jbuiltin_has_method(const jv *obj, const char *name) {
    if (obj->t == JV_STR) return is_one_of(name, str_methods);
    if (obj->t == JV_DICT) return is_one_of(name, dict_methods);
    return obj->t == JV_LIST && is_one_of(name, list_methods);
}

static bool starts_ends(const jv *s, const jv *x, bool end) {
    if (x->s.n > s->s.n) return false;
    return !memcmp(s->s.s + (end ? s->s.n - x->s.n : 0), x->s.s, x->s.n);
}

static jv *str_method(struct render *R, const char *name, jv *s, const struct args *a) {
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        bool end = name[0] == 'e';
        jv *x = jarg(a, 0, NULL, NULL);
        if (!x) jfail(C, "%s() takes at least 1 argument", name);
        if (x->t == JV_LIST) {
            for (size_t i = 0; i < x->l.n; i++)
                if (starts_ends(s, jneed_str(R, x->l.v[i], name), end)) return jv_bool(true);
            return jv_bool(false);
        }
        return jv_bool(starts_ends(s, jneed_str(R, x, name), end));
    }
    if (!strcmp(name, "strip")) return jstr_strip(R, s, jarg(a, 0, NULL, NULL), true, true);
    if (!strcmp(name, "lstrip")) return jstr_strip(R, s, jarg(a, 0, NULL, NULL), true, false);
    if (!strcmp(name, "rstrip")) return jstr_strip(R, s, jarg(a, 0, NULL, NULL), false, true);
    if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
        jv *ms = jarg(a, 1, "maxsplit", NULL);
        return jstr_split(R, s, jarg(a, 0, "sep", NULL), ms ? jneed_int(R, ms, "maxsplit") : -1, name[0] == 'r');
    }
    if (!strcmp(name, "upper")) return jstr_case(R, s, CASE_UPPER);
    if (!strcmp(name, "lower")) return jstr_case(R, s, CASE_LOWER);
    if (!strcmp(name, "title")) return jstr_case(R, s, CASE_TITLE_PY);
    if (!strcmp(name, "capitalize")) return jstr_case(R, jstr_case(R, s, CASE_LOWER), CASE_CAPITALIZE);
    if (!strcmp(name, "replace")) {
        jv *cnt = jarg(a, 2, "count", NULL);
        if (!jarg(a, 1, NULL, NULL)) jfail(C, "replace() takes 2 arguments");
        return jstr_replace(R, s, a->pos[0], a->pos[1], cnt ? jneed_int(R, cnt, "count") : -1);
    }
    if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "count")) {
        jv *x = jneed_str(R, jarg(a, 0, NULL, jv_none()), name);
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
        jv *items = jv_iterate(R, jarg(a, 0, NULL, jv_none()));
        struct jbuf b = {0};
        for (size_t i = 0; i < items->l.n; i++) {
            if (i) jbuf_add(C, &b, s->s.s, s->s.n);
            jv *x = jneed_str(R, items->l.v[i], "join() item");
            jbuf_add(C, &b, x->s.s, x->s.n);
        }
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "splitlines")) {
        jv *l = jv_list(C, 0);
        size_t st = 0;
        for (size_t i = 0; i < s->s.n; i++)
            if (s->s.s[i] == '\n' || s->s.s[i] == '\r') {
                jv_push(C, l, jv_str(C, s->s.s + st, i - st));
                if (s->s.s[i] == '\r' && i + 1 < s->s.n && s->s.s[i + 1] == '\n') i++;
                st = i + 1;
            }
        if (st < s->s.n) jv_push(C, l, jv_str(C, s->s.s + st, s->s.n - st));
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
            else if (!strcmp(name, "isspace")) all = all && jstr_char_at(s->s.s, s->s.n, i, NULL);
            else if (!strcmp(name, "islower")) all = all && !up;
            else if (!strcmp(name, "isupper")) all = all && !lo;
        }
        if (!strcmp(name, "islower") || !strcmp(name, "isupper")) all = all && any_cased;
        return jv_bool(all);
    }
    jfail(C, "str.%s() is not supported", name);
}

jv *jbuiltin_call(struct render *R, jv *fn, const struct args *a) {
    const char *name = fn->fn.name;
    jv *self = fn->fn.self;
    if (self && self->t == JV_STR) return str_method(R, name, self, a);
    if (self && self->t == JV_DICT) {
        if (!strcmp(name, "get")) {
            jv *v = jv_get(self, jarg(a, 0, NULL, jv_none()));
            return v ? v : jarg(a, 1, NULL, jv_none());
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
        jv *x = jarg(a, 0, NULL, jv_none());
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
        jv *msg = jv_to_str(C, jarg(a, 0, NULL, jv_cstr(C, "")));
        R->c.line = 0;
        jfail(C, "%s", msg->s.s);
    }
    if (!strcmp(name, "strftime_now")) {
        jv *fmt = jneed_str(R, jarg(a, 0, NULL, jv_none()), "strftime_now's format");
        struct tm tm;
        localtime_r(&R->now, &tm);
        char buf[512];
        size_t n = fmt->s.n ? strftime(buf, sizeof buf, fmt->s.s, &tm) : 0;
        return jv_str(C, buf, n);
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
        if (a->npos == 1) hi = jneed_int(R, a->pos[0], "range()");
        else if (a->npos == 2 || a->npos == 3) {
            lo = jneed_int(R, a->pos[0], "range()");
            hi = jneed_int(R, a->pos[1], "range()");
            if (a->npos == 3) step = jneed_int(R, a->pos[2], "range()");
        } else
            jfail(C, "range() takes 1 to 3 arguments");
        if (step == 0) jfail(C, "range() arg 3 must not be zero");
        jv *l = jv_list(C, 0);
        for (long long i = lo; step > 0 ? i < hi : i > hi; i += step) jv_push(C, l, jv_int(C, i));
        return l;
    }
    jfail(C, "'%s' is not callable here", name);
}

/* ---- filters ---- */

/* The value at a dotted attribute path ("function.name", "0"), as jinja2's attrgetter. */
static jv *attr_path(struct render *R, jv *obj, jv *path) {
    if (path->t == JV_INT) return jv_getitem(R, obj, path);
    jneed_str(R, path, "attribute");
    const char *p = path->s.s;
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        jv *key;
        bool digits = n > 0;
        for (size_t i = 0; i < n; i++) digits = digits && p[i] >= '0' && p[i] <= '9';
        key = digits ? jv_int(C, strtoll(p, NULL, 10)) : jv_str(C, p, n);
        if (obj->t == JV_UNDEF) return obj;
        obj = jv_getitem(R, obj, key);
        if (!dot) return obj;
        p = dot + 1;
    }
}

/* select / reject / selectattr / rejectattr */
static jv *select_items(struct render *R, const struct args *a, bool by_attr, bool keep) {
    jv *items = jv_iterate(R, a->pos[0]);
    int first_test_arg = by_attr ? 2 : 1;
    jv *attr = by_attr ? jarg(a, 1, NULL, NULL) : NULL;
    if (by_attr && !attr) jfail(C, "selectattr/rejectattr need an attribute");
    jv *test = jarg(a, first_test_arg, NULL, NULL);
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
            ok = jtest(R, jneed_str(R, test, "test name")->s.s, &ta);
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
    if (!s->case_sensitive && x->t == JV_STR) x = jstr_case(s->R, x, CASE_LOWER);
    return x;
}

static int sort_cmp(const void *pa, const void *pb) {
    jv *a = sort_key(*(jv *const *)pa), *b = sort_key(*(jv *const *)pb);
    int r = jv_compare(&sort_cur->R->c, a, b);
    return sort_cur->reverse ? -r : r;
}

static jv *sort_filter(struct render *R, const struct args *a) {
    jv *items = jv_iterate(R, a->pos[0]);
    jv *out = jv_list(C, items->l.n);
    for (size_t i = 0; i < items->l.n; i++) jv_push(C, out, items->l.v[i]);
    struct sort_ctx s = {R, jv_truthy(jarg(a, 1, "reverse", jv_bool(false))),
                         jv_truthy(jarg(a, 2, "case_sensitive", jv_bool(false))), jarg(a, 3, "attribute", NULL)};
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

jv *jfilter(struct render *R, const char *name, const struct args *a) {
    jv *x = a->pos[0];
    if (!strcmp(name, "tojson")) {
        /* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
        jv *ind = jarg(a, 2, "indent", jv_none());
        if (jarg(a, 3, "separators", jv_none())->t != JV_NONE) jfail(C, "tojson: separators are not supported");
        struct json_opts o = {ind->t == JV_NONE ? -1 : (int)jneed_int(R, ind, "indent"),
                              jv_truthy(jarg(a, 1, "ensure_ascii", jv_bool(false))),
                              jv_truthy(jarg(a, 4, "sort_keys", jv_bool(false)))};
        if (o.indent > 1000) jfail(C, "tojson: indent %d is too large", o.indent);
        struct jbuf b = {0};
        jv_json_to(C, &b, x, &o);
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        bool boolean = jv_truthy(jarg(a, 2, "boolean", jv_bool(false)));
        if (x->t == JV_UNDEF || (boolean && !jv_truthy(x))) return jarg(a, 1, "default_value", jv_cstr(C, ""));
        return x;
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) return jv_int(C, jv_length(R, x));
    if (!strcmp(name, "safe")) return x;
    if (x->t == JV_UNDEF && strcmp(name, "list") && strcmp(name, "items") && strcmp(name, "join") &&
        strcmp(name, "string") && strcmp(name, "first") && strcmp(name, "last") && strcmp(name, "select") &&
        strcmp(name, "reject") && strcmp(name, "selectattr") && strcmp(name, "rejectattr") && strcmp(name, "map"))
        jundefined(R, x);
    if (!strcmp(name, "string")) return jv_to_str(C, x);
    if (!strcmp(name, "trim")) return jstr_strip(R, jv_to_str(C, x), jarg(a, 1, "chars", NULL), true, true);
    if (!strcmp(name, "upper")) return jstr_case(R, jv_to_str(C, x), CASE_UPPER);
    if (!strcmp(name, "lower")) return jstr_case(R, jv_to_str(C, x), CASE_LOWER);
    if (!strcmp(name, "capitalize")) return jstr_case(R, jstr_case(R, jv_to_str(C, x), CASE_LOWER), CASE_CAPITALIZE);
    if (!strcmp(name, "title")) return jstr_case(R, jstr_case(R, jv_to_str(C, x), CASE_LOWER), CASE_TITLE_JINJA);
    if (!strcmp(name, "replace")) {
        jv *cnt = jarg(a, 3, "count", jv_none());
        return jstr_replace(R, jv_to_str(C, x), jarg(a, 1, "old", jv_none()), jarg(a, 2, "new", jv_none()),
                       cnt->t == JV_NONE ? -1 : jneed_int(R, cnt, "count"));
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jv *items = jv_iterate(R, x);
        if (!items->l.n) return jv_undef(C, "no first item, sequence was empty");
        return items->l.v[name[0] == 'f' ? 0 : items->l.n - 1];
    }
    if (!strcmp(name, "list")) return jv_iterate(R, x);
    if (!strcmp(name, "reverse")) {
        if (x->t == JV_STR) return jv_slice(R, x, NULL, NULL, jv_int(C, -1));
        jv *items = jv_iterate(R, x), *out = jv_list(C, items->l.n);
        for (size_t i = items->l.n; i-- > 0;) jv_push(C, out, items->l.v[i]);
        return out;
    }
    if (!strcmp(name, "items")) {
        if (x->t == JV_UNDEF) return jv_list(C, 0);
        if (x->t != JV_DICT) jfail(C, "items filter needs a mapping, got %s", jv_type_name(x));
        return jbuiltin_call(R, jv_func(C, "items", x), &(struct args){0});
    }
    if (!strcmp(name, "join")) {
        jv *sep = jv_to_str(C, jarg(a, 1, "d", jv_cstr(C, ""))), *attr = jarg(a, 2, "attribute", NULL);
        jv *items = jv_iterate(R, x);
        struct jbuf b = {0};
        for (size_t i = 0; i < items->l.n; i++) {
            if (i) jbuf_add(C, &b, sep->s.s, sep->s.n);
            jv_str_to(C, &b, attr && attr->t != JV_NONE ? attr_path(R, items->l.v[i], attr) : items->l.v[i]);
        }
        return jbuf_value(C, &b);
    }
    if (!strcmp(name, "select") || !strcmp(name, "reject")) return select_items(R, a, false, name[0] == 's');
    if (!strcmp(name, "selectattr") || !strcmp(name, "rejectattr")) return select_items(R, a, true, name[0] == 's');
    if (!strcmp(name, "map")) {
        jv *items = jv_iterate(R, x), *out = jv_list(C, items->l.n);
        jv *attr = jargs_kw(a, "attribute");
        for (size_t i = 0; i < items->l.n; i++) {
            jv *y;
            if (attr) {
                y = attr_path(R, items->l.v[i], attr);
                jv *def = jargs_kw(a, "default");
                if (y->t == JV_UNDEF && def) y = def;
            } else {
                if (a->npos < 2) jfail(C, "map needs a filter name or attribute=");
                struct args fa = *a;
                fa.pos = jalloc(C, (size_t)(a->npos - 1) * sizeof *fa.pos);
                fa.pos[0] = items->l.v[i];
                for (int k = 2; k < a->npos; k++) fa.pos[k - 1] = a->pos[k];
                fa.npos = a->npos - 1;
                y = jfilter(R, jneed_str(R, a->pos[1], "filter name")->s.s, &fa);
            }
            jv_push(C, out, y);
        }
        return out;
    }
    if (!strcmp(name, "int")) {
        jv *def = jarg(a, 1, "default", jv_int(C, 0));
        if (x->t == JV_INT) return x;
        if (x->t == JV_BOOL) return jv_int(C, x->b);
        if (x->t == JV_FLOAT) return isfinite(x->f) ? jv_int(C, (long long)x->f) : def;
        if (x->t == JV_STR) {
            char *end;
            jv *t = jstr_strip(R, x, NULL, true, true);
            long long i = strtoll(t->s.s, &end, 10);
            if (t->s.n && !*end) return jv_int(C, i);
            double d = strtod(t->s.s, &end);
            return t->s.n && !*end && isfinite(d) ? jv_int(C, (long long)d) : def;
        }
        return def;
    }
    if (!strcmp(name, "float")) {
        jv *def = jarg(a, 1, "default", jv_float(C, 0));
        if (jv_is_number(x)) return jv_float(C, jv_num(x));
        if (x->t == JV_STR) {
            char *end;
            jv *t = jstr_strip(R, x, NULL, true, true);
            double d = strtod(t->s.s, &end);
            return t->s.n && !*end ? jv_float(C, d) : def;
        }
        return def;
    }
    if (!strcmp(name, "format")) { /* jinja2's: value % args */
        jv *args = jv_list(C, (size_t)a->npos);
        args->tuple = true;
        for (int i = 1; i < a->npos; i++) jv_push(C, args, a->pos[i]);
        return jstr_format(R, jneed_str(R, x, "format's value"), args);
    }
    if (!strcmp(name, "round")) { /* jinja2's: "common" is Python's round(), "floor"/"ceil" give floats */
        long long prec = jneed_int(R, jarg(a, 1, "precision", jv_int(C, 0)), "precision");
        jv *method = jneed_str(R, jarg(a, 2, "method", jv_cstr(C, "common")), "method");
        if (!jv_is_number(x)) jfail(C, "round: %s is not a number", jv_type_name(x));
        if (prec < -18 || prec > 300) jfail(C, "round: precision %lld is out of range", prec);
        double v = jv_num(x);
        if (!strcmp(method->s.s, "common")) {
            if (x->t != JV_FLOAT) { /* an int stays an int, halves to even */
                long long i = x->t == JV_BOOL ? x->b : x->i, p = 1;
                for (long long k = prec; k < 0; k++) p *= 10;
                long long q = i / p, r = i % p;
                if (r < 0) q--, r += p;
                if (r > p - r || (r == p - r && (q & 1))) q++;
                if (__builtin_mul_overflow(q, p, &i)) jfail(C, "integer overflow");
                return jv_int(C, i);
            }
            if (prec < 0) return jv_float(C, rint(v / pow(10, (double)-prec)) * pow(10, (double)-prec));
            char buf[700]; /* printf rounds the exact binary value, halves to even, as Python does */
            snprintf(buf, sizeof buf, "%.*f", (int)prec, v);
            return jv_float(C, strtod(buf, NULL));
        }
        double scale = pow(10, (double)prec);
        if (!strcmp(method->s.s, "floor")) return jv_float(C, floor(v * scale) / scale);
        if (!strcmp(method->s.s, "ceil")) return jv_float(C, ceil(v * scale) / scale);
        jfail(C, "round: method must be common, floor or ceil");
    }
    if (!strcmp(name, "abs")) {
        if (x->t == JV_FLOAT) return jv_float(C, fabs(x->f));
        long long i = jneed_int(R, x, "abs()");
        return jv_int(C, i < 0 ? -i : i);
    }
    if (!strcmp(name, "sort")) return sort_filter(R, a);
    if (!strcmp(name, "unique")) {
        jv *items = jv_iterate(R, x), *out = jv_list(C, 0);
        for (size_t i = 0; i < items->l.n; i++) {
            bool seen = false;
            for (size_t j = 0; j < out->l.n && !seen; j++) seen = jv_equal(out->l.v[j], items->l.v[i]);
            if (!seen) jv_push(C, out, items->l.v[i]);
        }
        return out;
    }
    if (!strcmp(name, "sum")) {
        jv *items = jv_iterate(R, x), *attr = jarg(a, 1, "attribute", NULL), *acc = jarg(a, 2, "start", jv_int(C, 0));
        for (size_t i = 0; i < items->l.n; i++)
            acc = jv_binop(R, '+', acc, attr && attr->t != JV_NONE ? attr_path(R, items->l.v[i], attr) : items->l.v[i]);
        return acc;
    }
    if (!strcmp(name, "min") || !strcmp(name, "max")) {
        jv *items = jv_iterate(R, x), *best = NULL;
        for (size_t i = 0; i < items->l.n; i++) {
            int r = best ? jv_compare(C, items->l.v[i], best) : 0;
            if (!best || (name[1] == 'i' ? r < 0 : r > 0)) best = items->l.v[i];
        }
        return best ? best : jv_undef(C, "no min/max of an empty sequence");
    }
    if (!strcmp(name, "indent")) {
        jv *w = jarg(a, 1, "width", jv_int(C, 4));
        bool first = jv_truthy(jarg(a, 2, "first", jv_bool(false))), blank = jv_truthy(jarg(a, 3, "blank", jv_bool(false)));
        struct jbuf pad = {0};
        if (w->t == JV_STR) jbuf_add(C, &pad, w->s.s, w->s.n);
        else
            for (long long i = jneed_int(R, w, "width"); i > 0; i--) jbuf_adds(C, &pad, " ");
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
        jv *pairs = jbuiltin_call(R, jv_func(C, "items", x), &(struct args){0});
        struct args sa = {.pos = (jv *[]){pairs, jarg(a, 2, "reverse", jv_bool(false)),
                                          jarg(a, 1, "case_sensitive", jv_bool(false)), jv_int(C, 0)},
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
    if (!strcmp(name, "wordcount")) return jv_int(C, (long long)jstr_split(R, jv_to_str(C, x), NULL, -1, false)->l.n);
    jfail(C, "no filter named '%s'", name);
}

/* ---- tests ---- */

bool jtest(struct render *R, const char *name, const struct args *a) {
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
        jv *s = jstr_case(R, x, name[0] == 'l' ? CASE_LOWER : CASE_UPPER);
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
    if (!strcmp(name, "in")) return jv_truthy(jv_binop(R, OP_IN, x, y));
    if (!strcmp(name, "odd") || !strcmp(name, "even")) return (jneed_int(R, x, name) & 1) == (name[0] == 'o');
    if (!strcmp(name, "divisibleby")) {
        long long d = jneed_int(R, y, "divisibleby");
        return d != 0 && jneed_int(R, x, "divisibleby") % d == 0;
    }
    jfail(C, "no test named '%s'", name);
}
