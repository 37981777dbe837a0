/* Renders a parsed template: statements and expressions (the filters, tests,
 * methods and globals are jinja_builtins.c's). Scoping as jinja2's: a for loop's body
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

_Noreturn void jundefined(struct render *R, const jv *u) {
    if (u->s.s[0] == '\'') jfail(C, "%s", u->s.s);
    jfail(C, "'%s' is undefined", u->s.s);
}

static jv *no_attr(struct render *R, const jv *obj, const char *name) {
    char msg[200];
    snprintf(msg, sizeof msg, "'%s object' has no attribute '%.100s'", jv_type_name(obj), name);
    return jv_undef(C, jstrndup(C, msg, strlen(msg)));
}

/* ---- sequences ---- */

/* What a for loop or a filter iterates: list items, dict keys, string characters. */
jv *jv_iterate(struct render *R, const jv *v) {
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
            jv_push(C, l, jv_str(C, v->s.s + i, len));
            i += len;
        }
        return l;
    }
    default: jfail(C, "'%s' object is not iterable", jv_type_name(v));
    }
}

long long jv_length(struct render *R, const jv *v) {
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

jv *jv_slice(struct render *R, const jv *obj, const jv *a, const jv *b, const jv *step_v) {
    long long step = step_v && step_v->t != JV_NONE ? to_index(R, step_v, "slice indices") : 1;
    if (step == 0) jfail(C, "slice step cannot be zero");
    bool is_str = obj->t == JV_STR;
    if (!is_str && obj->t != JV_LIST) jfail(C, "'%s' object is not subscriptable", jv_type_name(obj));
    jv *items = is_str ? jv_iterate(R, obj) : (jv *)obj;
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
    case JV_UNDEF: jundefined(R, obj);
    case JV_DICT:
        if (jbuiltin_has_method(obj, name)) return jv_func(C, name, obj);
        /* fall through */
    case JV_NS: {
        jv *v = jv_get_cstr(obj, name);
        return v ? v : no_attr(R, obj, name);
    }
    case JV_LOOP: return loop_attr(R, obj, name);
    case JV_STR:
    case JV_LIST: return jbuiltin_has_method(obj, name) ? jv_func(C, name, obj) : no_attr(R, obj, name);
    default: return no_attr(R, obj, name);
    }
}

jv *jv_getitem(struct render *R, jv *obj, jv *key) {
    switch (obj->t) {
    case JV_UNDEF: jundefined(R, obj);
    case JV_DICT: {
        jv *v = jv_get(obj, key);
        if (v) return v;
        break;
    }
    case JV_LIST:
    case JV_STR:
        if (key->t == JV_INT || key->t == JV_BOOL) {
            long long i = to_index(R, key, "indices"), n = jv_length(R, obj);
            if (i < 0) i += n;
            if (i < 0 || i >= n) return jv_undef(C, "index out of range");
            if (obj->t == JV_LIST) return obj->l.v[i];
            size_t a = utf8_offset(obj->s.s, obj->s.n, (size_t)i), len;
            utf8_decode(obj->s.s + a, obj->s.n - a, &len);
            return jv_str(C, obj->s.s + a, len);
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

static jv *call_macro(struct render *R, jv *m, const struct args *a, jv *caller);

static jv *call(struct render *R, jv *callee, const struct args *a) {
    if (callee->t == JV_MACRO) return call_macro(R, callee, a, NULL);
    if (callee->t == JV_FUNC) return jbuiltin_call(R, callee, a);
    if (callee->t == JV_UNDEF) jundefined(R, callee);
    jfail(C, "'%s' object is not callable", jv_type_name(callee));
}

/* ---- operators ---- */

jv *jv_binop(struct render *R, int op, jv *a, jv *b) {
    if (a->t == JV_UNDEF) jundefined(R, a);
    if (b->t == JV_UNDEF) jundefined(R, b);
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
        long long k = jneed_int(R, b, "repeat count");
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
        return jv_binop(R, op, b, a);
    if (op == '%' && a->t == JV_STR) return jstr_format(R, a, b);
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
        v = jv_getitem(R, obj, eval(R, f, nd->b));
        break;
    }
    case E_SLICE: {
        jv *obj = eval(R, f, nd->a), *p[3];
        for (int i = 0; i < 3; i++) p[i] = nd->v[i] ? eval(R, f, nd->v[i]) : NULL;
        if (obj->t == JV_UNDEF) jundefined(R, obj);
        v = jv_slice(R, obj, p[0], p[1], p[2]);
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
        v = jfilter(R, nd->name, &a);
        break;
    case E_TEST:
        eval_args(R, f, nd, &a, eval(R, f, nd->a));
        R->c.line = nd->line;
        v = jv_bool(jtest(R, nd->name, &a) != nd->neg);
        break;
    case E_BIN: {
        jv *x = eval(R, f, nd->a);
        v = jv_binop(R, nd->op, x, eval(R, f, nd->b));
        break;
    }
    case E_NEG: {
        jv *x = eval(R, f, nd->a);
        if (x->t == JV_INT || x->t == JV_BOOL) v = jv_int(C, -(x->t == JV_BOOL ? x->b : x->i));
        else if (x->t == JV_FLOAT) v = jv_float(C, -x->f);
        else if (x->t == JV_UNDEF) jundefined(R, x);
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
        jv *items = jv_iterate(R, v);
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
        jv *v = p < a->npos ? a->pos[p] : jargs_kw(a, param->name);
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
    jv *items = jv_iterate(R, seq);
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
                emit(R, jfilter(R, nd->a->name, &a));
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
