/* The Jinja interpreter's insides, shared by its parser (jinja_parse.c), values
 * (jinja_value.c), evaluator (jinja_eval.c), builtins (jinja_builtins.c) and string
 * methods (jinja_str.c). Everything a parse or a render allocates lives in one
 * arena freed at the end, and errors longjmp back to the entry point with a
 * message, so no path leaks or needs cleanup. */
#ifndef KVQ_SERVER_JINJA_IMPL_H
#define KVQ_SERVER_JINJA_IMPL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <time.h>

/* ---- arena and errors ---- */

struct arena_block;
struct jctx {
    struct arena_block *blocks;
    size_t used, limit; /* bytes allocated, and the most allowed */
    jmp_buf on_error;
    char *err;
    size_t err_size;
    int line; /* where the error is, 0 when unknown */
};

void *jalloc(struct jctx *c, size_t n); /* zeroed */
char *jstrndup(struct jctx *c, const char *s, size_t n);
void jarena_free(struct jctx *c);
_Noreturn void jfail(struct jctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- values ---- */

enum jv_type { JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_DICT, JV_NS, JV_LOOP, JV_MACRO, JV_FUNC };

typedef struct jv jv;
struct loop_state;
struct node;
struct jv {
    enum jv_type t;
    bool tuple; /* a list that Python would hold as a tuple (prints with parentheses) */
    union {
        bool b;
        long long i;
        double f;
        struct {
            const char *s; /* UTF-8, NUL-terminated; for JV_UNDEF the missing name */
            size_t n;
        } s;
        struct {
            jv **v;
            size_t n, cap;
        } l;
        struct { /* JV_DICT and JV_NS: insertion order, as Python's dicts */
            jv **k, **v;
            size_t n, cap;
        } d;
        struct loop_state *loop;
        struct { /* JV_MACRO: a macro, or a call block's caller() */
            const struct node *node;
            void *frame; /* where it was defined: a caller() sees the call site */
        } m;
        struct {
            const char *name;
            jv *self; /* bound methods: the object; NULL for globals */
        } fn;
    };
};

jv *jv_undef(struct jctx *c, const char *name);
jv *jv_none(void);
jv *jv_bool(bool b);
jv *jv_int(struct jctx *c, long long i);
jv *jv_float(struct jctx *c, double f);
jv *jv_str(struct jctx *c, const char *s, size_t n);
jv *jv_cstr(struct jctx *c, const char *s);
jv *jv_list(struct jctx *c, size_t cap);
jv *jv_dict(struct jctx *c);
jv *jv_func(struct jctx *c, const char *name, jv *self);
void jv_push(struct jctx *c, jv *list, jv *v);
void jv_set(struct jctx *c, jv *dict, jv *key, jv *v);
jv *jv_get(const jv *dict, const jv *key); /* NULL when absent */
jv *jv_get_cstr(const jv *dict, const char *key);

bool jv_truthy(const jv *v);
bool jv_equal(const jv *a, const jv *b);
/* <0, 0, >0; fails for values Python cannot order */
int jv_compare(struct jctx *c, const jv *a, const jv *b);
const char *jv_type_name(const jv *v);
bool jv_is_number(const jv *v); /* bool counts, as in Python */
double jv_num(const jv *v);

/* A growable byte string in the arena. */
struct jbuf {
    char *s;
    size_t n, cap;
};
void jbuf_add(struct jctx *c, struct jbuf *b, const char *s, size_t n);
void jbuf_adds(struct jctx *c, struct jbuf *b, const char *s);
jv *jbuf_value(struct jctx *c, struct jbuf *b);

/* str(v) and repr(v) as Python writes them, appended to b. */
void jv_str_to(struct jctx *c, struct jbuf *b, const jv *v);
void jv_repr_to(struct jctx *c, struct jbuf *b, const jv *v);
jv *jv_to_str(struct jctx *c, const jv *v); /* the value itself when already a string */
/* json.dumps(v, indent=, ensure_ascii=, sort_keys=) as transformers' tojson calls it. */
struct json_opts {
    int indent; /* < 0: none (", " between items); else a newline and this many spaces a level */
    bool ascii, sort_keys;
};
void jv_json_to(struct jctx *c, struct jbuf *b, const jv *v, const struct json_opts *o);
struct json_t;
jv *jv_from_json(struct jctx *c, const struct json_t *j);

/* UTF-8 code points: how many, the byte offset of code point i (clamped), and the
 * one at s (its byte length in *len; a bad byte reads as itself). */
size_t utf8_len(const char *s, size_t n);
size_t utf8_offset(const char *s, size_t n, size_t i);
unsigned long utf8_decode(const char *s, size_t n, size_t *len);

/* ---- syntax tree ---- */

enum node_kind {
    /* statements */
    N_TEXT,     /* lit */
    N_OUT,      /* a */
    N_IF,       /* a cond, v body, v2 else */
    N_FOR,      /* a target, b iterable, c filter, v body, v2 else */
    N_SET,      /* a target, b value */
    N_SETBLOCK, /* a target, v body */
    N_MACRO,    /* name, v body, v2 params (E_NAME, default in a) */
    N_CALLBLOCK,/* a the call, v body (caller()), v2 caller's params */
    N_BREAK,
    N_CONTINUE,
    N_SCOPE,    /* v body: {% generation %} and {% filter %} bodies (name: the filter) */
    /* expressions */
    E_LIT,  /* lit */
    E_NAME, /* name */
    E_ATTR, /* a . name */
    E_ITEM, /* a [ b ] */
    E_SLICE,/* a [ v[0] : v[1] : v[2] ] (NULL parts) */
    E_CALL, /* a ( v, kw ) */
    E_FILTER, /* a | name ( v, kw ) */
    E_TEST, /* a is [not] name ( v ) */
    E_BIN,  /* a op b */
    E_NEG,
    E_NOT,
    E_AND,
    E_OR,
    E_COND, /* a if b else c */
    E_LIST,
    E_TUPLE,
    E_DICT, /* v: key, value, key, value... */
};

/* Operators of E_BIN: the character itself, or one of these. */
enum { OP_EQ = 256, OP_NE, OP_LE, OP_GE, OP_FLOORDIV, OP_POW, OP_IN, OP_NOTIN };

struct node {
    enum node_kind k;
    int line, op;
    bool neg;
    const char *name;
    jv *lit;
    struct node *a, *b, *c;
    struct node **v;  /* children: statements, arguments, items */
    const char **kw;  /* keyword names parallel to v (NULL: positional); NULL when none */
    int n;
    struct node **v2;
    int n2;
};

/* ---- rendering (jinja_eval.c), its builtins (jinja_builtins.c) and string
 * methods (jinja_str.c) ---- */

struct frame;
struct loop_state {
    jv **items;
    size_t n, i;
};

struct render {
    struct jctx c; /* the render's arena and error */
    struct jbuf *out;
    struct frame *globals;
    time_t now; /* strftime_now's clock */
    int depth;
    long long steps;
};

_Noreturn void jundefined(struct render *R, const jv *u); /* fails naming what is undefined */
jv *jv_iterate(struct render *R, const jv *v); /* list items, dict keys, string characters */
long long jv_length(struct render *R, const jv *v);
jv *jv_slice(struct render *R, const jv *obj, const jv *a, const jv *b, const jv *step);
jv *jv_getitem(struct render *R, jv *obj, jv *key);
jv *jv_binop(struct render *R, int op, jv *a, jv *b); /* E_BIN's operators */

/* A call's arguments: positional (a filter's or test's operand first), then keywords. */
struct args {
    jv **pos;
    int npos;
    const char **kwn;
    jv **kwv;
    int nkw;
};
jv *jargs_kw(const struct args *a, const char *name);
jv *jarg(const struct args *a, int i, const char *name, jv *def); /* argument i, or keyword name, or def */
jv *jneed_str(struct render *R, jv *v, const char *what);
long long jneed_int(struct render *R, jv *v, const char *what);

bool jbuiltin_has_method(const jv *obj, const char *name);
jv *jbuiltin_call(struct render *R, jv *fn, const struct args *a); /* a JV_FUNC: a method or global */
jv *jfilter(struct render *R, const char *name, const struct args *a);
bool jtest(struct render *R, const char *name, const struct args *a);

enum case_mode { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_TITLE_PY, CASE_TITLE_JINJA };
jv *jstr_case(struct render *R, const jv *s, enum case_mode m);
jv *jstr_strip(struct render *R, const jv *s, const jv *chars, bool left, bool right); /* chars NULL: whitespace */
jv *jstr_replace(struct render *R, const jv *s, const jv *old, const jv *new_, long long count);
jv *jstr_split(struct render *R, const jv *s, const jv *sep, long long maxsplit, bool from_right);
jv *jstr_format(struct render *R, const jv *fmt, const jv *args); /* fmt % args */
/* The length of the character at s[i] when it is in chars (whitespace when NULL), else 0. */
size_t jstr_char_at(const char *s, size_t n, size_t i, const jv *chars);

struct jinja_template {
    struct jctx ctx; /* owns the nodes */
    struct node *root; /* N_SCOPE */
};

#endif
