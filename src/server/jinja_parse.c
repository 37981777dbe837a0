/* Jinja source to a syntax tree. The lexer follows jinja2's: newlines normalized
 * to \n and one trailing newline dropped (keep_trailing_newline off), "-" at a
 * tag's edge strips all whitespace on that side, trim_blocks drops the newline
 * after a block or comment tag, lstrip_blocks the indentation before one ("+"
 * turns either off). The parser follows jinja2's operator precedence: filters and
 * tests bind tighter than arithmetic, "not" looser than comparisons. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/jinja.h"
#include "server/jinja_impl.h"

enum tok_type { T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STR, T_INT, T_FLOAT, T_OP, T_EOF };

struct tok {
    enum tok_type t;
    int line, op;
    const char *s; /* T_DATA, T_NAME, T_STR: arena copies */
    size_t n;
    long long i;
    double f;
};

struct lexer {
    struct jctx *c;
    const char *src;
    size_t len, pos;
    int line;
    struct tok *toks;
    size_t n, cap;
};

static struct tok *push_tok(struct lexer *L, enum tok_type t) {
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        struct tok *nt = jalloc(L->c, cap * sizeof *nt);
        if (L->n) memcpy(nt, L->toks, L->n * sizeof *nt);
        L->toks = nt;
        L->cap = cap;
    }
    struct tok *k = &L->toks[L->n++];
    memset(k, 0, sizeof *k);
    k->t = t;
    k->line = L->line;
    return k;
}

static bool is_space(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v'; }

static void advance(struct lexer *L, size_t to) {
    for (; L->pos < to; L->pos++)
        if (L->src[L->pos] == '\n') L->line++;
}

static void skip_space(struct lexer *L) {
    size_t p = L->pos;
    while (p < L->len && is_space(L->src[p])) p++;
    advance(L, p);
}

static void emit_data(struct lexer *L, const char *s, size_t n, int line) {
    if (!n) return;
    struct tok *k = push_tok(L, T_DATA);
    k->s = jstrndup(L->c, s, n);
    k->n = n;
    k->line = line;
}

/* Appends code point cp as UTF-8. */
static size_t put_utf8(char *o, unsigned long cp) {
    if (cp < 0x80) return o[0] = (char)cp, 1;
    if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000)
        return o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 63)), o[2] = (char)(0x80 | (cp & 63)), 3;
    o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 63)), o[2] = (char)(0x80 | (cp >> 6 & 63));
    o[3] = (char)(0x80 | (cp & 63));
    return 4;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* A string literal with Python's escapes (what jinja2's unicode-escape decoding does). */
static void lex_string(struct lexer *L) {
    char q = L->src[L->pos];
    size_t p = L->pos + 1, start_line = (size_t)L->line;
    char *out = jalloc(L->c, L->len - L->pos + 1), *o = out;
    while (p < L->len && L->src[p] != q) {
        char ch = L->src[p++];
        if (ch != '\\' || p >= L->len) {
            *o++ = ch;
            continue;
        }
        ch = L->src[p++];
        int nhex = 0;
        switch (ch) {
        case 'n': *o++ = '\n'; break;
        case 't': *o++ = '\t'; break;
        case 'r': *o++ = '\r'; break;
        case 'a': *o++ = '\a'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'v': *o++ = '\v'; break;
        case '\\': *o++ = '\\'; break;
        case '\'': *o++ = '\''; break;
        case '"': *o++ = '"'; break;
        case '\n': break;
        case 'x': nhex = 2; break;
        case 'u': nhex = 4; break;
        case 'U': nhex = 8; break;
        default:
            if (ch >= '0' && ch <= '7') {
                unsigned long cp = (unsigned long)(ch - '0');
                for (int k = 0; k < 2 && p < L->len && L->src[p] >= '0' && L->src[p] <= '7'; k++)
                    cp = cp * 8 + (unsigned long)(L->src[p++] - '0');
                o += put_utf8(o, cp);
            } else {
                *o++ = '\\';
                *o++ = ch;
            }
        }
        if (nhex) {
            unsigned long cp = 0;
            for (int k = 0; k < nhex; k++) {
                int h = p < L->len ? hexval(L->src[p]) : -1;
                if (h < 0) jfail(L->c, "bad \\%c escape in a string", ch);
                cp = cp * 16 + (unsigned long)h;
                p++;
            }
            if (cp > 0x10FFFF) jfail(L->c, "bad \\%c escape in a string", ch);
            o += put_utf8(o, cp);
        }
    }
    if (p >= L->len) {
        L->c->line = (int)start_line;
        jfail(L->c, "unterminated string");
    }
    struct tok *k = push_tok(L, T_STR);
    k->s = out;
    k->n = (size_t)(o - out);
    advance(L, p + 1);
}

static void lex_number(struct lexer *L) {
    const char *s = L->src;
    size_t p = L->pos;
    bool is_float = false;
    while (p < L->len && (isdigit((unsigned char)s[p]) || s[p] == '_')) p++;
    if (p + 1 < L->len && s[p] == '.' && isdigit((unsigned char)s[p + 1])) {
        is_float = true;
        for (p++; p < L->len && (isdigit((unsigned char)s[p]) || s[p] == '_'); p++) {}
    }
    if (p < L->len && (s[p] == 'e' || s[p] == 'E')) {
        size_t q = p + 1;
        if (q < L->len && (s[q] == '+' || s[q] == '-')) q++;
        if (q < L->len && isdigit((unsigned char)s[q])) {
            is_float = true;
            for (p = q; p < L->len && isdigit((unsigned char)s[p]); p++) {}
        }
    }
    char *buf = jalloc(L->c, p - L->pos + 1), *w = buf; /* the digits without their '_' separators */
    for (size_t i = L->pos; i < p; i++)
        if (s[i] != '_') *w++ = s[i];
    *w = 0;
    struct tok *k = push_tok(L, is_float ? T_FLOAT : T_INT);
    errno = 0;
    if (is_float) k->f = strtod(buf, NULL);
    else {
        k->i = strtoll(buf, NULL, 10);
        if (errno) jfail(L->c, "integer literal %.40s is too large", buf);
    }
    advance(L, p);
}

/* The inside of {{ }} or {% %} up to its end; returns after the end and the
 * whitespace control that goes with it. */
static void lex_tag(struct lexer *L, bool block) {
    const char *s = L->src;
    int depth = 0, start_line = L->line;
    for (;;) {
        skip_space(L);
        size_t p = L->pos;
        if (p >= L->len) {
            L->c->line = start_line;
            jfail(L->c, "unterminated %s (no '%s')", block ? "block tag" : "expression", block ? "%}" : "}}");
        }
        const char *end = block ? "%}" : "}}";
        if (depth == 0) {
            bool minus = s[p] == '-' && p + 2 < L->len + 0 && !strncmp(s + p + 1, end, 2);
            bool plus = block && s[p] == '+' && !strncmp(s + p + 1, end, 2);
            if (minus || plus || !strncmp(s + p, end, 2)) {
                push_tok(L, block ? T_BLOCK_END : T_VAR_END);
                advance(L, p + 2 + (minus || plus));
                if (minus) skip_space(L);
                else if (block && !plus && L->pos < L->len && s[L->pos] == '\n') advance(L, L->pos + 1);
                return;
            }
        }
        char ch = s[p];
        if (isalpha((unsigned char)ch) || ch == '_') {
            size_t q = p;
            while (q < L->len && (isalnum((unsigned char)s[q]) || s[q] == '_')) q++;
            struct tok *k = push_tok(L, T_NAME);
            k->s = jstrndup(L->c, s + p, q - p);
            k->n = q - p;
            advance(L, q);
            continue;
        }
        if (isdigit((unsigned char)ch)) {
            lex_number(L);
            continue;
        }
        if (ch == '\'' || ch == '"') {
            lex_string(L);
            continue;
        }
        static const struct {
            const char *s;
            int op;
        } two[] = {{"//", OP_FLOORDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {"<=", OP_LE}, {">=", OP_GE}};
        int op = 0, w = 1;
        for (size_t i = 0; i < sizeof two / sizeof two[0]; i++)
            if (p + 1 < L->len && s[p] == two[i].s[0] && s[p + 1] == two[i].s[1]) op = two[i].op, w = 2;
        if (!op && strchr("+-*/%~<>=()[]{}.,:|", ch) && ch) op = ch;
        if (!op) jfail(L->c, "unexpected character '%c' in a tag", ch);
        if (op == '(' || op == '[' || op == '{') depth++;
        if ((op == ')' || op == ']' || op == '}') && depth > 0) depth--;
        push_tok(L, T_OP)->op = op;
        advance(L, p + (size_t)w);
    }
}

/* Normalized newlines, one trailing newline dropped. */
static char *normalize(struct jctx *c, const char *src, size_t *len) {
    size_t n = strlen(src);
    char *o = jalloc(c, n + 1), *w = o;
    for (size_t i = 0; i < n; i++) {
        if (src[i] == '\r') {
            *w++ = '\n';
            if (i + 1 < n && src[i + 1] == '\n') i++;
        } else
            *w++ = src[i];
    }
    if (w > o && w[-1] == '\n') w--;
    *w = 0;
    *len = (size_t)(w - o);
    return o;
}

static void lex(struct lexer *L) {
    const char *s = L->src;
    bool line_starting = true;
    while (L->pos < L->len) {
        size_t p = L->pos;
        char *hit = NULL;
        for (const char *q = s + p; (q = strchr(q, '{')) != NULL; q++)
            if (q[1] == '{' || q[1] == '%' || q[1] == '#') {
                hit = (char *)q;
                break;
            }
        size_t start = hit ? (size_t)(hit - s) : L->len;
        size_t tlen = start - p;
        int text_line = L->line;
        if (!hit) {
            emit_data(L, s + p, tlen, text_line);
            advance(L, L->len);
            break;
        }
        char kind = s[start + 1], mod = s[start + 2];
        if (mod != '-' && mod != '+') mod = 0;
        if (mod == '-') {
            while (tlen && is_space(s[p + tlen - 1])) tlen--;
        } else if ((kind == '%' || kind == '#') && mod != '+') {
            size_t l = tlen;
            while (l && s[p + l - 1] != '\n') l--;
            bool blank = l < tlen;
            for (size_t i = l; i < tlen; i++) blank = blank && is_space(s[p + i]);
            if ((l > 0 || line_starting) && blank) tlen = l;
        }
        emit_data(L, s + p, tlen, text_line);
        advance(L, start + 2 + (mod ? 1 : 0));
        if (kind == '#') {
            const char *e = strstr(s + L->pos, "#}");
            if (!e) {
                L->c->line = L->line;
                jfail(L->c, "unterminated comment (no '#}')");
            }
            size_t end = (size_t)(e - s);
            bool minus = end > L->pos && s[end - 1] == '-', plus = end > L->pos && s[end - 1] == '+';
            advance(L, end + 2);
            if (minus) skip_space(L);
            else if (!plus && L->pos < L->len && s[L->pos] == '\n') advance(L, L->pos + 1);
        } else {
            struct tok *b = push_tok(L, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN);
            b->line = L->line;
            lex_tag(L, kind == '%');
        }
        line_starting = L->pos > 0 && s[L->pos - 1] == '\n';
    }
    push_tok(L, T_EOF);
}

/* ---- parser ---- */

struct parser {
    struct jctx *c;
    struct tok *t;
    size_t i, n;
    int depth; /* nesting of expressions and statements: bounded, the parser recurses */
};

static void enter(struct parser *P) {
    if (++P->depth > 256) jfail(P->c, "the template nests too deeply");
}

static struct tok *cur(struct parser *P) { return &P->t[P->i]; }
static struct tok *next(struct parser *P) {
    struct tok *k = &P->t[P->i];
    if (k->t != T_EOF) P->i++;
    P->c->line = P->t[P->i].line;
    return k;
}

static const char *tok_desc(struct tok *k) {
    static _Thread_local char buf[64];
    switch (k->t) {
    case T_NAME: snprintf(buf, sizeof buf, "'%.40s'", k->s); return buf;
    case T_STR: return "a string";
    case T_INT:
    case T_FLOAT: return "a number";
    case T_OP:
        if (k->op < 256) snprintf(buf, sizeof buf, "'%c'", k->op);
        else snprintf(buf, sizeof buf, "an operator");
        return buf;
    case T_VAR_END: return "'}}'";
    case T_BLOCK_END: return "'%}'";
    case T_EOF: return "the end of the template";
    default: return "text";
    }
}

static _Noreturn void unexpected(struct parser *P, const char *wanted) {
    P->c->line = cur(P)->line;
    jfail(P->c, "expected %s, got %s", wanted, tok_desc(cur(P)));
}

static bool is_op(struct parser *P, int op) { return cur(P)->t == T_OP && cur(P)->op == op; }
static bool is_name(struct parser *P, const char *name) { return cur(P)->t == T_NAME && !strcmp(cur(P)->s, name); }
static bool accept_op(struct parser *P, int op) { return is_op(P, op) ? (next(P), true) : false; }
static bool accept_name(struct parser *P, const char *name) { return is_name(P, name) ? (next(P), true) : false; }
static void expect_op(struct parser *P, int op) {
    if (!accept_op(P, op)) {
        char w[8] = {'\'', (char)op, '\'', 0};
        unexpected(P, w);
    }
}
static const char *expect_name(struct parser *P) {
    if (cur(P)->t != T_NAME) unexpected(P, "a name");
    return next(P)->s;
}
static void expect_block_end(struct parser *P) {
    if (cur(P)->t != T_BLOCK_END) unexpected(P, "'%}'");
    next(P);
}

static struct node *mk(struct parser *P, enum node_kind k) {
    struct node *nd = jalloc(P->c, sizeof *nd);
    nd->k = k;
    nd->line = cur(P)->line;
    return nd;
}

/* A growable node list. */
struct nlist {
    struct node **v;
    const char **kw;
    int n, cap;
};
static void nl_add(struct parser *P, struct nlist *l, struct node *nd, const char *kw) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 4;
        struct node **v = jalloc(P->c, (size_t)cap * sizeof *v);
        const char **k = jalloc(P->c, (size_t)cap * sizeof *k);
        if (l->n) memcpy(v, l->v, (size_t)l->n * sizeof *v), memcpy(k, l->kw, (size_t)l->n * sizeof *k);
        l->v = v, l->kw = k, l->cap = cap;
    }
    l->kw[l->n] = kw;
    l->v[l->n++] = nd;
}

static struct node *parse_expr(struct parser *P, bool with_cond);
static struct node *parse_unary(struct parser *P, bool with_filter);
static struct node *parse_or(struct parser *P);

static struct node *lit(struct parser *P, jv *v) {
    struct node *nd = mk(P, E_LIT);
    nd->lit = v;
    return nd;
}

/* ( args ) after the '(' is consumed: positional then name=value. */
static void parse_call_args(struct parser *P, struct node *nd) {
    struct nlist l = {0};
    while (!is_op(P, ')')) {
        if (l.n && !accept_op(P, ',')) unexpected(P, "',' or ')'");
        if (is_op(P, ')')) break;
        const char *kw = NULL;
        if (cur(P)->t == T_NAME && P->t[P->i + 1].t == T_OP && P->t[P->i + 1].op == '=') {
            kw = next(P)->s;
            next(P);
        } else if (l.n && l.kw[l.n - 1]) {
            unexpected(P, "a keyword argument (positional ones come first)");
        }
        nl_add(P, &l, parse_expr(P, true), kw);
    }
    next(P);
    nd->v = l.v, nd->kw = l.kw, nd->n = l.n;
}


/* A list literal's items, or a dict literal's key: value pairs (kind E_DICT), up to
 * the closing bracket (a trailing comma allowed). */
static struct node *parse_items(struct parser *P, char close, int kind) {
    const char *want = close == ']' ? "',' or ']'" : "',' or '}'";
    struct nlist l = {0};
    while (!is_op(P, close)) {
        if (l.n && !accept_op(P, ',')) unexpected(P, want);
        if (is_op(P, close)) break;
        nl_add(P, &l, parse_expr(P, true), NULL);
        if (kind == E_DICT) {
            expect_op(P, ':');
            nl_add(P, &l, parse_expr(P, true), NULL);
        }
    }
    next(P);
    struct node *nd = mk(P, kind);
    nd->v = l.v, nd->n = l.n;
    return nd;
}

static struct node *parse_primary(struct parser *P) {
    struct tok *k = cur(P);
    struct node *nd;
    switch (k->t) {
    case T_NAME:
        next(P);
        if (!strcmp(k->s, "true") || !strcmp(k->s, "True")) return lit(P, jv_bool(true));
        if (!strcmp(k->s, "false") || !strcmp(k->s, "False")) return lit(P, jv_bool(false));
        if (!strcmp(k->s, "none") || !strcmp(k->s, "None")) return lit(P, jv_none());
        nd = mk(P, E_NAME);
        nd->name = k->s;
        nd->line = k->line;
        return nd;
    case T_STR: {
        struct jbuf b = {0};
        while (cur(P)->t == T_STR) { /* adjacent literals concatenate */
            jbuf_add(P->c, &b, cur(P)->s, cur(P)->n);
            next(P);
        }
        return lit(P, jbuf_value(P->c, &b));
    }
    case T_INT: next(P); return lit(P, jv_int(P->c, k->i));
    case T_FLOAT: next(P); return lit(P, jv_float(P->c, k->f));
    case T_OP:
        if (accept_op(P, '(')) {
            if (accept_op(P, ')')) return mk(P, E_TUPLE);
            struct node *e = parse_expr(P, true);
            if (is_op(P, ',')) {
                struct nlist l = {0};
                nl_add(P, &l, e, NULL);
                while (accept_op(P, ',') && !is_op(P, ')')) nl_add(P, &l, parse_expr(P, true), NULL);
                e = mk(P, E_TUPLE);
                e->v = l.v, e->n = l.n;
            }
            expect_op(P, ')');
            return e;
        }
        if (accept_op(P, '[')) return parse_items(P, ']', E_LIST);
        if (accept_op(P, '{')) return parse_items(P, '}', E_DICT);
        break;
    default: break;
    }
    unexpected(P, "an expression");
}

static struct node *parse_subscript(struct parser *P, struct node *obj) {
    struct node *parts[3] = {0};
    int np = 0;
    bool slice = false;
    for (;;) {
        if (!is_op(P, ':') && !is_op(P, ']')) parts[np] = parse_expr(P, true);
        if (is_op(P, ':') && np < 2) {
            next(P);
            slice = true;
            np++;
            continue;
        }
        break;
    }
    if (!slice && !parts[0]) unexpected(P, "an expression");
    expect_op(P, ']');
    struct node *nd = mk(P, slice ? E_SLICE : E_ITEM);
    nd->a = obj;
    if (slice) {
        nd->v = jalloc(P->c, 3 * sizeof *nd->v);
        memcpy(nd->v, parts, sizeof parts);
        nd->n = 3;
    } else
        nd->b = parts[0];
    return nd;
}

static struct node *parse_postfix(struct parser *P, struct node *nd) {
    for (;;) {
        if (accept_op(P, '.')) {
            struct node *a;
            if (cur(P)->t == T_INT) {
                a = mk(P, E_ITEM);
                a->b = lit(P, jv_int(P->c, next(P)->i));
            } else {
                a = mk(P, E_ATTR);
                a->name = expect_name(P);
            }
            a->a = nd;
            nd = a;
        } else if (accept_op(P, '[')) {
            nd = parse_subscript(P, nd);
        } else if (accept_op(P, '(')) {
            struct node *call = mk(P, E_CALL);
            call->a = nd;
            parse_call_args(P, call);
            nd = call;
        } else
            return nd;
    }
}

static const char *dotted_name(struct parser *P) {
    const char *name = expect_name(P);
    while (is_op(P, '.') && P->t[P->i + 1].t == T_NAME) {
        next(P);
        struct jbuf b = {0};
        jbuf_adds(P->c, &b, name);
        jbuf_adds(P->c, &b, ".");
        jbuf_adds(P->c, &b, next(P)->s);
        name = jbuf_value(P->c, &b)->s.s;
    }
    return name;
}

static struct node *parse_filters_tests(struct parser *P, struct node *nd) {
    for (;;) {
        if (accept_op(P, '|')) {
            struct node *f = mk(P, E_FILTER);
            f->name = dotted_name(P);
            f->a = nd;
            if (accept_op(P, '(')) parse_call_args(P, f);
            nd = f;
        } else if (accept_name(P, "is")) {
            struct node *t = mk(P, E_TEST);
            t->neg = accept_name(P, "not");
            t->name = dotted_name(P);
            t->a = nd;
            struct tok *k = cur(P);
            if (accept_op(P, '(')) {
                parse_call_args(P, t);
            } else if ((k->t == T_NAME || k->t == T_STR || k->t == T_INT || k->t == T_FLOAT ||
                        (k->t == T_OP && (k->op == '[' || k->op == '{'))) &&
                       !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
                t->v = jalloc(P->c, sizeof *t->v);
                t->v[0] = parse_postfix(P, parse_primary(P));
                t->n = 1;
            }
            nd = t;
        } else if (accept_op(P, '(')) {
            struct node *call = mk(P, E_CALL);
            call->a = nd;
            parse_call_args(P, call);
            nd = call;
        } else
            return nd;
    }
}

static struct node *parse_unary(struct parser *P, bool with_filter) {
    struct node *nd;
    enter(P);
    if (is_op(P, '-') || is_op(P, '+')) {
        bool neg = next(P)->op == '-';
        struct node *operand = parse_unary(P, false);
        if (neg) {
            nd = mk(P, E_NEG);
            nd->a = operand;
        } else
            nd = operand;
    } else
        nd = parse_primary(P);
    nd = parse_postfix(P, nd);
    P->depth--;
    return with_filter ? parse_filters_tests(P, nd) : nd;
}

static struct node *bin(struct parser *P, int op, struct node *a, struct node *b) {
    struct node *nd = mk(P, E_BIN);
    nd->op = op, nd->a = a, nd->b = b;
    return nd;
}

static struct node *parse_pow(struct parser *P) {
    struct node *nd = parse_unary(P, true);
    while (accept_op(P, OP_POW)) nd = bin(P, OP_POW, nd, parse_unary(P, true));
    return nd;
}

static struct node *parse_math2(struct parser *P) {
    struct node *nd = parse_pow(P);
    while (is_op(P, '*') || is_op(P, '/') || is_op(P, OP_FLOORDIV) || is_op(P, '%')) {
        int op = next(P)->op;
        nd = bin(P, op, nd, parse_pow(P));
    }
    return nd;
}

static struct node *parse_concat(struct parser *P) {
    struct node *nd = parse_math2(P);
    while (accept_op(P, '~')) nd = bin(P, '~', nd, parse_math2(P));
    return nd;
}

static struct node *parse_math1(struct parser *P) {
    struct node *nd = parse_concat(P);
    while (is_op(P, '+') || is_op(P, '-')) {
        int op = next(P)->op;
        nd = bin(P, op, nd, parse_concat(P));
    }
    return nd;
}

static struct node *parse_compare(struct parser *P) {
    struct node *nd = parse_math1(P);
    for (;;) {
        int op = 0;
        if (cur(P)->t == T_OP && (cur(P)->op == OP_EQ || cur(P)->op == OP_NE || cur(P)->op == '<' ||
                                  cur(P)->op == '>' || cur(P)->op == OP_LE || cur(P)->op == OP_GE))
            op = next(P)->op;
        else if (accept_name(P, "in"))
            op = OP_IN;
        else if (is_name(P, "not") && P->t[P->i + 1].t == T_NAME && !strcmp(P->t[P->i + 1].s, "in")) {
            next(P), next(P);
            op = OP_NOTIN;
        } else
            return nd;
        nd = bin(P, op, nd, parse_math1(P));
    }
}

static struct node *parse_not(struct parser *P) {
    if (accept_name(P, "not")) {
        struct node *nd = mk(P, E_NOT);
        enter(P);
        nd->a = parse_not(P);
        P->depth--;
        return nd;
    }
    return parse_compare(P);
}

static struct node *parse_and(struct parser *P) {
    struct node *nd = parse_not(P);
    while (accept_name(P, "and")) {
        struct node *a = mk(P, E_AND);
        a->a = nd, a->b = parse_not(P);
        nd = a;
    }
    return nd;
}

static struct node *parse_or(struct parser *P) {
    struct node *nd = parse_and(P);
    while (accept_name(P, "or")) {
        struct node *a = mk(P, E_OR);
        a->a = nd, a->b = parse_and(P);
        nd = a;
    }
    return nd;
}

static struct node *parse_expr(struct parser *P, bool with_cond) {
    enter(P);
    struct node *nd = parse_or(P);
    while (with_cond && accept_name(P, "if")) {
        struct node *c = mk(P, E_COND);
        c->a = nd;
        c->b = parse_or(P);
        if (accept_name(P, "else")) c->c = parse_expr(P, true);
        nd = c;
    }
    P->depth--;
    return nd;
}

/* An expression, or several separated by commas (a tuple), as {{ }} and set take. */
static struct node *parse_tuple(struct parser *P, bool with_cond) {
    struct node *nd = parse_expr(P, with_cond);
    if (!is_op(P, ',')) return nd;
    struct nlist l = {0};
    nl_add(P, &l, nd, NULL);
    while (accept_op(P, ',')) {
        if (cur(P)->t == T_BLOCK_END || cur(P)->t == T_VAR_END) break;
        nl_add(P, &l, parse_expr(P, with_cond), NULL);
    }
    nd = mk(P, E_TUPLE);
    nd->v = l.v, nd->n = l.n;
    return nd;
}

/* for and set targets: a name, ns.attr, or names separated by commas. */
static struct node *parse_target(struct parser *P, bool allow_attr) {
    struct nlist l = {0};
    do {
        struct node *nd = mk(P, E_NAME);
        nd->name = expect_name(P);
        if (allow_attr && accept_op(P, '.')) {
            struct node *a = mk(P, E_ATTR);
            a->a = nd;
            a->name = expect_name(P);
            nd = a;
        }
        nl_add(P, &l, nd, NULL);
    } while (accept_op(P, ','));
    if (l.n == 1) return l.v[0];
    struct node *t = mk(P, E_TUPLE);
    t->v = l.v, t->n = l.n;
    return t;
}

static struct nlist parse_body(struct parser *P, const char *const *ends, const char **which);

static void parse_statement(struct parser *P, struct nlist *out) {
    struct tok *kw = cur(P);
    enter(P);
    if (kw->t != T_NAME) unexpected(P, "a statement name");
    const char *name = next(P)->s;
    struct node *nd;
    const char *which;
    if (!strcmp(name, "if") || !strcmp(name, "elif")) {
        nd = mk(P, N_IF);
        nd->line = kw->line;
        nd->a = parse_tuple(P, true);
        expect_block_end(P);
        static const char *const ends[] = {"elif", "else", "endif", NULL};
        struct nlist body = parse_body(P, ends, &which);
        nd->v = body.v, nd->n = body.n;
        if (!strcmp(which, "elif")) {
            P->i--; /* the nested if reads "elif" as its keyword */
            struct nlist e = {0};
            parse_statement(P, &e);
            nd->v2 = e.v, nd->n2 = e.n;
            nl_add(P, out, nd, NULL);
            P->depth--;
            return;
        }
        if (!strcmp(which, "else")) {
            expect_block_end(P);
            static const char *const endif[] = {"endif", NULL};
            struct nlist e = parse_body(P, endif, &which);
            nd->v2 = e.v, nd->n2 = e.n;
        }
        expect_block_end(P);
    } else if (!strcmp(name, "for")) {
        nd = mk(P, N_FOR);
        nd->line = kw->line;
        nd->a = parse_target(P, false);
        if (!accept_name(P, "in")) unexpected(P, "'in'");
        nd->b = parse_tuple(P, false);
        if (accept_name(P, "if")) nd->c = parse_expr(P, true);
        if (accept_name(P, "recursive")) jfail(P->c, "recursive loops are not supported");
        expect_block_end(P);
        static const char *const ends[] = {"else", "endfor", NULL};
        struct nlist body = parse_body(P, ends, &which);
        nd->v = body.v, nd->n = body.n;
        if (!strcmp(which, "else")) {
            expect_block_end(P);
            static const char *const endfor[] = {"endfor", NULL};
            struct nlist e = parse_body(P, endfor, &which);
            nd->v2 = e.v, nd->n2 = e.n;
        }
        expect_block_end(P);
    } else if (!strcmp(name, "set")) {
        struct node *target = parse_target(P, true);
        if (accept_op(P, '=')) {
            nd = mk(P, N_SET);
            nd->b = parse_tuple(P, true);
            expect_block_end(P);
        } else {
            nd = mk(P, N_SETBLOCK);
            expect_block_end(P);
            static const char *const ends[] = {"endset", NULL};
            struct nlist body = parse_body(P, ends, &which);
            nd->v = body.v, nd->n = body.n;
            expect_block_end(P);
        }
        nd->line = kw->line;
        nd->a = target;
    } else if (!strcmp(name, "macro") || !strcmp(name, "call")) {
        bool call = name[0] == 'c';
        nd = mk(P, call ? N_CALLBLOCK : N_MACRO);
        nd->line = kw->line;
        if (!call) nd->name = expect_name(P);
        struct nlist params = {0};
        if (accept_op(P, '(')) {
            while (!accept_op(P, ')')) {
                if (params.n) expect_op(P, ',');
                if (accept_op(P, ')')) break;
                struct node *p = mk(P, E_NAME);
                p->name = expect_name(P);
                if (accept_op(P, '=')) p->a = parse_expr(P, true);
                nl_add(P, &params, p, NULL);
            }
        } else if (!call)
            unexpected(P, "'('");
        nd->v2 = params.v, nd->n2 = params.n;
        if (call) {
            nd->a = parse_expr(P, true);
            if (nd->a->k != E_CALL) jfail(P->c, "{%% call %%} needs a macro call");
        }
        expect_block_end(P);
        static const char *const mends[] = {"endmacro", NULL}, *const cends[] = {"endcall", NULL};
        struct nlist body = parse_body(P, call ? cends : mends, &which);
        nd->v = body.v, nd->n = body.n;
        if (!call && cur(P)->t == T_NAME) next(P); /* {% endmacro name %} */
        expect_block_end(P);
    } else if (!strcmp(name, "break") || !strcmp(name, "continue")) {
        nd = mk(P, name[0] == 'b' ? N_BREAK : N_CONTINUE);
        nd->line = kw->line;
        expect_block_end(P);
    } else if (!strcmp(name, "generation") || !strcmp(name, "filter")) {
        /* {% generation %}: transformers' marker of assistant text, rendered as is */
        nd = mk(P, N_SCOPE);
        nd->line = kw->line;
        bool filter = name[0] == 'f';
        if (filter) {
            struct node *f = mk(P, E_FILTER);
            f->name = dotted_name(P);
            if (accept_op(P, '(')) parse_call_args(P, f);
            nd->a = f;
        }
        expect_block_end(P);
        static const char *const gends[] = {"endgeneration", NULL}, *const fends[] = {"endfilter", NULL};
        struct nlist body = parse_body(P, filter ? fends : gends, &which);
        nd->v = body.v, nd->n = body.n;
        expect_block_end(P);
    } else {
        P->c->line = kw->line;
        jfail(P->c, "unknown tag '%s'", name);
    }
    nl_add(P, out, nd, NULL);
    P->depth--;
}

/* Statements up to a {% NAME %} with NAME in ends (its name consumed, *which set)
 * or the end of the template when ends is NULL. */
static struct nlist parse_body(struct parser *P, const char *const *ends, const char **which) {
    struct nlist l = {0};
    int start_line = cur(P)->line;
    for (;;) {
        struct tok *k = cur(P);
        if (k->t == T_EOF) {
            if (!ends) return l;
            const char *end = ends[0];
            for (int i = 0; ends[i]; i++)
                if (!strncmp(ends[i], "end", 3)) end = ends[i];
            P->c->line = start_line;
            jfail(P->c, "missing {%% %s %%} before the end of the template", end);
        }
        if (k->t == T_DATA) {
            struct node *nd = mk(P, N_TEXT);
            nd->lit = jv_str(P->c, k->s, k->n);
            nl_add(P, &l, nd, NULL);
            next(P);
        } else if (k->t == T_VAR_BEGIN) {
            next(P);
            struct node *nd = mk(P, N_OUT);
            nd->a = parse_tuple(P, true);
            if (cur(P)->t != T_VAR_END) unexpected(P, "'}}'");
            next(P);
            nl_add(P, &l, nd, NULL);
        } else if (k->t == T_BLOCK_BEGIN) {
            next(P);
            for (int i = 0; ends && ends[i]; i++)
                if (is_name(P, ends[i])) {
                    *which = ends[i];
                    next(P);
                    return l;
                }
            if (cur(P)->t == T_NAME && !strncmp(cur(P)->s, "end", 3)) {
                P->c->line = cur(P)->line;
                jfail(P->c, "unexpected {%% %s %%}", cur(P)->s);
            }
            if (cur(P)->t == T_NAME && (is_name(P, "else") || is_name(P, "elif"))) {
                P->c->line = cur(P)->line;
                jfail(P->c, "{%% %s %%} outside an if or for", cur(P)->s);
            }
            parse_statement(P, &l);
        } else
            unexpected(P, "text or a tag");
    }
}

/* 0, or -1 after an error (the arena is the caller's to free). */
static int parse_into(struct jinja_template *t, const char *src) {
    struct jctx *c = &t->ctx;
    if (setjmp(c->on_error)) return -1;
    struct lexer L = {.c = c, .line = 1};
    L.src = normalize(c, src, &L.len);
    lex(&L);
    struct parser P = {.c = c, .t = L.toks, .n = L.n};
    c->line = P.t[0].line;
    struct nlist body = parse_body(&P, NULL, NULL);
    t->root = jalloc(c, sizeof *t->root);
    t->root->k = N_SCOPE;
    t->root->v = body.v, t->root->n = body.n;
    return 0;
}

struct jinja_template *jinja_parse(const char *src, char *err, size_t err_size) {
    struct jinja_template *t = calloc(1, sizeof *t);
    if (!t) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    t->ctx.limit = (size_t)64 << 20;
    t->ctx.err = err;
    t->ctx.err_size = err_size;
    if (parse_into(t, src) != 0) {
        jarena_free(&t->ctx);
        free(t);
        return NULL;
    }
    t->ctx.err = NULL; /* renders have contexts of their own */
    return t;
}

void jinja_free(struct jinja_template *t) {
    if (!t) return;
    jarena_free(&t->ctx);
    free(t);
}
