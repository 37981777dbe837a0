/* Each schema becomes a rule. JSON is written compactly or with a little whitespace
 * (a space, or a newline and up to 20 spaces, after a bracket, comma or colon and
 * before a closing bracket), numbers have
 * at most 16 integer and 15 fraction digits: a model cannot run away in whitespace or
 * digits. Object properties come in the schema's order, required ones always, optional
 * ones may be left out; other properties are generated only for schemas that declare
 * no properties (any object, or additionalProperties as a schema). */
#include "engine/json_schema.h"

#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "engine/grammar.h"

#define MAX_DEPTH 64
#define MAX_REPEAT 4096

struct ref {
    char *path;
    int rule;
};

struct jsc {
    struct grammar *g;
    json_t *root;
    int depth;
    struct ref *refs;
    int n_refs;
    /* shared rules, made when first needed (-1) */
    int ws, sep, colon, value, string, chars, number, integer, boolean, null;
};

static int compile(struct jsc *c, json_t *s);

static int add(struct jsc *c, int rule, struct gseq *s) { return grammar_add_alt(c->g, rule, s) ? -1 : rule; }

/* A rule of one alternative: the literal text. */
static int lit_rule(struct jsc *c, const char *text) {
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    struct gseq s = {0};
    gseq_lit(&s, c->g, text, strlen(text));
    return add(c, r, &s);
}

static struct gclass range(unsigned lo, unsigned hi) {
    struct gclass k = {{0}};
    gclass_add_range(&k, lo, hi);
    return k;
}

/* (sep item) repeated lo to hi times (hi < 0: any number); sep may be -1. */
static int repeat(struct jsc *c, int sep, int item, int lo, int hi) {
    if (lo > MAX_REPEAT || hi > MAX_REPEAT) return kvq_error("json schema: repetition counts above %d are not supported", MAX_REPEAT);
    int tail = grammar_rule(c->g);
    if (tail < 0) return -1;
    struct gseq s = {0};
    if (hi < 0) { /* tail ::= sep item tail | "" */
        if (sep >= 0) gseq_ref(&s, sep);
        gseq_ref(&s, item);
        gseq_ref(&s, tail);
        if (add(c, tail, &s) < 0 || add(c, tail, &s) < 0) return -1;
    } else { /* tail_k ::= sep item tail_(k-1) | "" */
        if (add(c, tail, &s) < 0) return -1;
        for (int k = lo; k < hi; k++) {
            int t = grammar_rule(c->g);
            if (t < 0) return -1;
            if (sep >= 0) gseq_ref(&s, sep);
            gseq_ref(&s, item);
            gseq_ref(&s, tail);
            if (add(c, t, &s) < 0 || add(c, t, &s) < 0) return -1;
            tail = t;
        }
    }
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    for (int k = 0; k < lo; k++) {
        if (sep >= 0) gseq_ref(&s, sep);
        gseq_ref(&s, item);
    }
    gseq_ref(&s, tail);
    return add(c, r, &s);
}

/* ws ::= "" | " " | "\n" " "{0,20} */
static int ws_rule(struct jsc *c) {
    if (c->ws >= 0) return c->ws;
    struct gclass ind = range(' ', ' ');
    int one = grammar_rule(c->g), r = grammar_rule(c->g);
    struct gseq s = {0};
    gseq_class(&s, c->g, &ind);
    if (one < 0 || r < 0 || add(c, one, &s) < 0) return -1;
    int indent = repeat(c, -1, one, 0, 20);
    if (indent < 0 || add(c, r, &s) < 0) return -1;
    gseq_lit(&s, c->g, " ", 1);
    if (add(c, r, &s) < 0) return -1;
    gseq_lit(&s, c->g, "\n", 1);
    gseq_ref(&s, indent);
    return c->ws = add(c, r, &s);
}

/* LIT ws (no space before a comma or colon, as JSON is written) */
static int punct(struct jsc *c, const char *p) {
    int ws = ws_rule(c), r = grammar_rule(c->g);
    if (ws < 0 || r < 0) return -1;
    struct gseq s = {0};
    gseq_lit(&s, c->g, p, strlen(p));
    gseq_ref(&s, ws);
    return add(c, r, &s);
}

static int sep_rule(struct jsc *c) { return c->sep >= 0 ? c->sep : (c->sep = punct(c, ",")); }
static int colon_rule(struct jsc *c) { return c->colon >= 0 ? c->colon : (c->colon = punct(c, ":")); }

/* What follows a backslash in a string. */
static int escape_rule(struct jsc *c) {
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    struct gseq s = {0};
    struct gclass k = {{0}};
    for (const char *p = "\"\\/bfnrt"; *p; p++) gclass_add_range(&k, (unsigned char)*p, (unsigned char)*p);
    gseq_class(&s, c->g, &k);
    if (add(c, r, &s) < 0) return -1;
    struct gclass hex = range('0', '9');
    gclass_add_range(&hex, 'a', 'f');
    gclass_add_range(&hex, 'A', 'F');
    gseq_lit(&s, c->g, "u", 1);
    for (int i = 0; i < 4; i++) gseq_class(&s, c->g, &hex);
    return add(c, r, &s);
}

/* Bytes a string holds as they are: not '"', '\\' or a control character. */
static struct gclass plain_class(void) {
    struct gclass k = range(0x20, 0xff);
    k.bits['"' >> 6] &= ~(1ull << ('"' & 63));
    k.bits['\\' >> 6] &= ~(1ull << ('\\' & 63));
    return k;
}

/* A string's contents: chars ::= plain* ( "\\" escape chars )? */
static int chars_rule(struct jsc *c) {
    if (c->chars >= 0) return c->chars;
    int r = grammar_rule(c->g), tail = grammar_rule(c->g), esc = escape_rule(c);
    if (r < 0 || tail < 0 || esc < 0) return -1;
    struct gseq s = {0};
    const struct gclass plain = plain_class();
    gseq_star(&s, c->g, &plain);
    gseq_ref(&s, tail);
    if (add(c, r, &s) < 0) return -1;
    gseq_lit(&s, c->g, "\\", 1);
    gseq_ref(&s, esc);
    gseq_ref(&s, r);
    if (add(c, tail, &s) < 0 || add(c, tail, &s) < 0) return -1;
    return c->chars = r;
}

static int string_rule(struct jsc *c) {
    if (c->string >= 0) return c->string;
    int chars = chars_rule(c), r = grammar_rule(c->g);
    if (chars < 0 || r < 0) return -1;
    struct gseq s = {0};
    gseq_lit(&s, c->g, "\"", 1);
    gseq_ref(&s, chars);
    gseq_lit(&s, c->g, "\"", 1);
    return c->string = add(c, r, &s);
}

/* A string of lo to hi characters: printable ASCII without escapes (one byte a
 * character, as JSON Schema counts them), a run the masks count by bytes; with no
 * upper bound, up to 1024 more than lo. */
static int sized_string(struct jsc *c, int lo, int hi) {
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    if (hi < 0) hi = lo + 1024;
    struct gclass ascii = plain_class();
    ascii.bits[1] &= ~(1ull << 63); /* DEL */
    ascii.bits[2] = ascii.bits[3] = 0;
    struct gseq s = {0};
    gseq_lit(&s, c->g, "\"", 1);
    if (hi != 0) gseq_run(&s, c->g, &ascii, lo, hi);
    gseq_lit(&s, c->g, "\"", 1);
    return add(c, r, &s);
}

/* digits{lo,hi} as a rule */
static int digits(struct jsc *c, int lo, int hi) {
    int d = grammar_rule(c->g);
    struct gseq s = {0};
    struct gclass k = range('0', '9');
    gseq_class(&s, c->g, &k);
    if (d < 0 || add(c, d, &s) < 0) return -1;
    return repeat(c, -1, d, lo, hi);
}

/* integer ::= "-"? ( "0" | [1-9] [0-9]{0,15} ) */
static int integer_rule(struct jsc *c) {
    if (c->integer >= 0) return c->integer;
    int mag = grammar_rule(c->g), rest = digits(c, 0, 15), r = grammar_rule(c->g);
    if (mag < 0 || rest < 0 || r < 0) return -1;
    struct gseq s = {0};
    gseq_lit(&s, c->g, "0", 1);
    if (add(c, mag, &s) < 0) return -1;
    struct gclass nz = range('1', '9');
    gseq_class(&s, c->g, &nz);
    gseq_ref(&s, rest);
    if (add(c, mag, &s) < 0) return -1;
    gseq_ref(&s, mag);
    if (add(c, r, &s) < 0) return -1;
    gseq_lit(&s, c->g, "-", 1);
    gseq_ref(&s, mag);
    return c->integer = add(c, r, &s);
}

/* number ::= integer ( "." [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,3} )?, the integer part
 * of rule in. */
static int number_with(struct jsc *c, int in) {
    int frac = grammar_rule(c->g), fd = digits(c, 1, 15), ex = grammar_rule(c->g),
        ed = digits(c, 1, 3), sign = grammar_rule(c->g), r = grammar_rule(c->g);
    if (in < 0 || frac < 0 || fd < 0 || ex < 0 || ed < 0 || sign < 0 || r < 0) return -1;
    struct gseq s = {0};
    if (add(c, frac, &s) < 0 || add(c, ex, &s) < 0 || add(c, sign, &s) < 0) return -1;
    gseq_lit(&s, c->g, ".", 1);
    gseq_ref(&s, fd);
    if (add(c, frac, &s) < 0) return -1;
    struct gclass pm = range('+', '+'), e = range('e', 'e');
    gclass_add_range(&pm, '-', '-');
    gclass_add_range(&e, 'E', 'E');
    gseq_class(&s, c->g, &pm);
    if (add(c, sign, &s) < 0) return -1;
    gseq_class(&s, c->g, &e);
    gseq_ref(&s, sign);
    gseq_ref(&s, ed);
    if (add(c, ex, &s) < 0) return -1;
    gseq_ref(&s, in);
    gseq_ref(&s, frac);
    gseq_ref(&s, ex);
    return add(c, r, &s);
}

static int number_rule(struct jsc *c) {
    return c->number >= 0 ? c->number : (c->number = number_with(c, integer_rule(c)));
}

/* The L-digit decimal strings from a to b (a <= b): per leading digit, the rest from
 * a's or to b's, or anything between. */
static int digits_between(struct jsc *c, const char *a, const char *b, int L) {
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    struct gseq s = {0};
    const struct gclass any = range('0', '9');
    bool full = true;
    for (int i = 0; i < L; i++) full &= a[i] == '0' && b[i] == '9';
    if (full || L == 1) {
        struct gclass first = range((unsigned char)a[0], (unsigned char)b[0]);
        gseq_class(&s, c->g, &first);
        for (int i = 1; i < L; i++) gseq_class(&s, c->g, &any);
        return add(c, r, &s);
    }
    if (a[0] == b[0]) {
        int rest = digits_between(c, a + 1, b + 1, L - 1);
        if (rest < 0) return -1;
        gseq_lit(&s, c->g, a, 1);
        gseq_ref(&s, rest);
        return add(c, r, &s);
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    int low = digits_between(c, a + 1, nines, L - 1), high = digits_between(c, zeros, b + 1, L - 1);
    if (low < 0 || high < 0) return -1;
    gseq_lit(&s, c->g, a, 1);
    gseq_ref(&s, low);
    if (add(c, r, &s) < 0) return -1;
    if (a[0] + 1 <= b[0] - 1) {
        struct gclass mid = range((unsigned char)a[0] + 1, (unsigned char)b[0] - 1);
        gseq_class(&s, c->g, &mid);
        for (int i = 1; i < L; i++) gseq_class(&s, c->g, &any);
        if (add(c, r, &s) < 0) return -1;
    }
    gseq_lit(&s, c->g, b, 1);
    gseq_ref(&s, high);
    return add(c, r, &s);
}

#define MAX_DIGITS 16

/* The integers from lo to hi written without sign (0 <= lo; hi < 0: up to 16 digits). */
static int nonneg_range(struct jsc *c, long long lo, long long hi) {
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    long long p = 1;
    for (int L = 1; L <= MAX_DIGITS; L++, p *= 10) {
        const long long first = L == 1 ? 0 : p, last = p * 10 - 1;
        const long long a = lo > first ? lo : first, b = hi >= 0 && hi < last ? hi : last;
        if (a > b) continue;
        char as[24], bs[24];
        snprintf(as, sizeof as, "%lld", a);
        snprintf(bs, sizeof bs, "%lld", b);
        int d = digits_between(c, as, bs, L);
        struct gseq s = {0};
        gseq_ref(&s, d);
        if (d < 0 || add(c, r, &s) < 0) return -1;
    }
    return r;
}

/* The bounds an integer or number schema sets (minimum, exclusiveMinimum, ...), as the
 * integers they allow; false with an error for bounds not numbers or too large. */
static bool int_bounds(json_t *sch, bool *has_lo, long long *lo, bool *has_hi, long long *hi) {
    static const char *const names[] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    *has_lo = *has_hi = false;
    *lo = *hi = 0;
    for (int i = 0; i < 4; i++) {
        json_t *v = json_object_get(sch, names[i]);
        if (!v) continue;
        if (!json_is_number(v)) return kvq_error("json schema: '%s' must be a number", names[i]), false;
        double x = json_number_value(v);
        if (!(fabs(x) < 1e15)) return kvq_error("json schema: '%s' beyond 1e15 is not supported", names[i]), false;
        /* the integers allowed: >= ceil(minimum), > floor(exclusiveMinimum), ... */
        long long k = i == 0 ? (long long)ceil(x) : i == 1 ? (long long)floor(x) + 1 : i == 2 ? (long long)floor(x)
                                                                                                   : (long long)ceil(x) - 1;
        if (i < 2 && (!*has_lo || k > *lo)) *lo = k, *has_lo = true;
        if (i >= 2 && (!*has_hi || k < *hi)) *hi = k, *has_hi = true;
    }
    return true;
}

/* An integer within the schema's bounds: a sign and digit ranges. */
static int integer_schema(struct jsc *c, json_t *sch) {
    bool has_lo, has_hi;
    long long lo = 0, hi = 0;
    if (!int_bounds(sch, &has_lo, &lo, &has_hi, &hi)) return -1;
    if (!has_lo && !has_hi) return integer_rule(c);
    if (has_lo && has_hi && lo > hi) return kvq_error("json schema: no integer lies within the bounds");
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    struct gseq s = {0};
    if (!has_lo || lo < 0) { /* "-" and the magnitudes from |min(hi, -1)| to |lo| */
        int neg = nonneg_range(c, has_hi && hi < 0 ? -hi : 1, has_lo ? -lo : -1);
        gseq_lit(&s, c->g, "-", 1);
        gseq_ref(&s, neg);
        if (neg < 0 || add(c, r, &s) < 0) return -1;
    }
    if (!has_hi || hi >= 0) {
        int pos = nonneg_range(c, has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1);
        gseq_ref(&s, pos);
        if (pos < 0 || add(c, r, &s) < 0) return -1;
    }
    return r;
}

/* A number: bounds only as minimum 0 (or exclusiveMinimum below it): no minus sign. */
static int number_schema(struct jsc *c, json_t *sch) {
    json_t *min = json_object_get(sch, "minimum"), *xmin = json_object_get(sch, "exclusiveMinimum");
    if (json_object_get(sch, "maximum") || json_object_get(sch, "exclusiveMaximum") ||
        (min && !(json_is_number(min) && json_number_value(min) == 0)) ||
        (xmin && !(json_is_number(xmin) && json_number_value(xmin) < 0)))
        return kvq_error("json schema: bounds on numbers are supported only as 'minimum': 0 (integers take any)");
    return min || xmin ? number_with(c, nonneg_range(c, 0, -1)) : number_rule(c);
}

static int boolean_rule(struct jsc *c) {
    if (c->boolean >= 0) return c->boolean;
    int r = lit_rule(c, "true");
    struct gseq s = {0};
    gseq_lit(&s, c->g, "false", 5);
    return c->boolean = r < 0 ? -1 : add(c, r, &s);
}

static int null_rule(struct jsc *c) { return c->null >= 0 ? c->null : (c->null = lit_rule(c, "null")); }

/* "[" ws "]" | "[" ws item (sep item){lo-1,hi-1} ws "]" */
static int array_of(struct jsc *c, int item, int lo, int hi) {
    int ws = ws_rule(c), sep = sep_rule(c), r = grammar_rule(c->g);
    if (ws < 0 || sep < 0 || r < 0) return -1;
    struct gseq s = {0};
    if (lo == 0) {
        gseq_lit(&s, c->g, "[", 1);
        gseq_ref(&s, ws);
        gseq_lit(&s, c->g, "]", 1);
        if (add(c, r, &s) < 0) return -1;
    }
    if (hi != 0) {
        int more = repeat(c, sep, item, lo > 0 ? lo - 1 : 0, hi < 0 ? -1 : hi - 1);
        if (more < 0) return -1;
        gseq_lit(&s, c->g, "[", 1);
        gseq_ref(&s, ws);
        gseq_ref(&s, item);
        gseq_ref(&s, more);
        gseq_ref(&s, ws);
        gseq_lit(&s, c->g, "]", 1);
        if (add(c, r, &s) < 0) return -1;
    }
    return r;
}

/* A member: "key" : value, the key any string (key < 0) or a given one. */
static int member(struct jsc *c, const char *key, int value) {
    int colon = colon_rule(c), str = key ? 0 : string_rule(c), r = grammar_rule(c->g);
    if (colon < 0 || str < 0 || r < 0) return -1;
    struct gseq s = {0};
    if (key) {
        json_t *k = json_string(key);
        char *text = k ? json_dumps(k, JSON_ENCODE_ANY) : NULL;
        json_decref(k);
        if (!text) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        gseq_lit(&s, c->g, text, strlen(text));
        free(text);
    } else {
        gseq_ref(&s, str);
    }
    gseq_ref(&s, colon);
    gseq_ref(&s, value);
    return add(c, r, &s);
}

/* "{" ws ( m (sep m)* )? ws "}" for members m of any key with values of rule value. */
static int open_object(struct jsc *c, int value) {
    int m = member(c, NULL, value), ws = ws_rule(c), sep = sep_rule(c), r = grammar_rule(c->g);
    int more = m < 0 || sep < 0 ? -1 : repeat(c, sep, m, 0, -1);
    if (more < 0 || ws < 0 || r < 0) return -1;
    struct gseq s = {0};
    gseq_lit(&s, c->g, "{", 1);
    gseq_ref(&s, ws);
    gseq_lit(&s, c->g, "}", 1);
    if (add(c, r, &s) < 0) return -1;
    gseq_lit(&s, c->g, "{", 1);
    gseq_ref(&s, ws);
    gseq_ref(&s, m);
    gseq_ref(&s, more);
    gseq_ref(&s, ws);
    gseq_lit(&s, c->g, "}", 1);
    return add(c, r, &s);
}

static int any_value(struct jsc *c) {
    if (c->value >= 0) return c->value;
    int r = c->value = grammar_rule(c->g);
    if (r < 0) return -1;
    int alts[6] = {open_object(c, r), array_of(c, r, 0, -1), string_rule(c), number_rule(c), boolean_rule(c),
                   null_rule(c)};
    struct gseq s = {0};
    for (int i = 0; i < 6; i++) {
        if (alts[i] < 0) return -1;
        gseq_ref(&s, alts[i]);
        if (add(c, r, &s) < 0) return -1;
    }
    return r;
}

/* The members of a declared object, in order: first[i] / after[i] are the members from
 * property i on when none / some came before (required ones must come, others may). */
static int declared_object(struct jsc *c, const char **keys, const int *values, const bool *required, int n) {
    int sep = sep_rule(c), ws = ws_rule(c);
    if (sep < 0 || ws < 0) return -1;
    int first = grammar_rule(c->g), after = grammar_rule(c->g); /* from n: nothing */
    struct gseq s = {0};
    if (first < 0 || after < 0 || add(c, first, &s) < 0 || add(c, after, &s) < 0) return -1;
    for (int i = n - 1; i >= 0; i--) {
        int m = member(c, keys[i], values[i]), f = grammar_rule(c->g), a = grammar_rule(c->g);
        if (m < 0 || f < 0 || a < 0) return -1;
        gseq_ref(&s, m);
        gseq_ref(&s, after);
        if (add(c, f, &s) < 0) return -1;
        gseq_ref(&s, sep);
        gseq_ref(&s, m);
        gseq_ref(&s, after);
        if (add(c, a, &s) < 0) return -1;
        if (!required[i]) {
            gseq_ref(&s, first);
            if (add(c, f, &s) < 0) return -1;
            gseq_ref(&s, after);
            if (add(c, a, &s) < 0) return -1;
        }
        first = f;
        after = a;
    }
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    gseq_lit(&s, c->g, "{", 1);
    gseq_ref(&s, ws);
    gseq_ref(&s, first);
    gseq_ref(&s, ws);
    gseq_lit(&s, c->g, "}", 1);
    return add(c, r, &s);
}

static int object_schema(struct jsc *c, json_t *sch) {
    json_t *props = json_object_get(sch, "properties"), *req = json_object_get(sch, "required");
    json_t *extra = json_object_get(sch, "additionalProperties");
    if (props && !json_is_object(props)) return kvq_error("json schema: 'properties' must be an object");
    if (req && !json_is_array(req)) return kvq_error("json schema: 'required' must be a list");
    size_t n_req = json_array_size(req);
    for (size_t i = 0; i < n_req; i++)
        if (!json_is_string(json_array_get(req, i))) return kvq_error("json schema: 'required' must list strings");
    size_t n = json_object_size(props);
    for (size_t i = 0; i < n_req; i++)
        if (!json_object_get(props, json_string_value(json_array_get(req, i)))) n++;
    if (n == 0) { /* any object, its values under additionalProperties */
        if (json_is_false(extra)) return lit_rule(c, "{}");
        int v = json_is_object(extra) ? compile(c, extra) : any_value(c);
        return v < 0 ? -1 : open_object(c, v);
    }
    const char **keys = calloc(n, sizeof *keys);
    int *values = calloc(n, sizeof *values);
    bool *required = calloc(n, sizeof *required);
    int rc = -1, k = 0;
    if (!keys || !values || !required) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach(props, key, v) {
        keys[k] = key;
        if ((values[k] = compile(c, v)) < 0) goto done;
        for (size_t i = 0; i < n_req; i++) required[k] |= !strcmp(key, json_string_value(json_array_get(req, i)));
        k++;
    }
    for (size_t i = 0; i < n_req; i++) { /* required but not described: any value */
        const char *rk = json_string_value(json_array_get(req, i));
        bool seen = false;
        for (int j = 0; j < k; j++) seen |= !strcmp(keys[j], rk);
        if (seen) continue;
        keys[k] = rk;
        required[k] = true;
        if ((values[k++] = any_value(c)) < 0) goto done;
    }
    rc = declared_object(c, keys, values, required, k);
done:
    free(keys);
    free(values);
    free(required);
    return rc;
}

static int get_count(json_t *sch, const char *name, int dflt, int *out) {
    json_t *v = json_object_get(sch, name);
    if (!v) return *out = dflt, 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > MAX_REPEAT)
        return kvq_error("json schema: '%s' must be an integer from 0 to %d", name, MAX_REPEAT);
    *out = (int)json_integer_value(v);
    return 0;
}

static int array_schema(struct jsc *c, json_t *sch) {
    int lo, hi;
    if (get_count(sch, "minItems", 0, &lo) || get_count(sch, "maxItems", -1, &hi)) return -1;
    if (hi >= 0 && hi < lo) return kvq_error("json schema: maxItems is below minItems");
    json_t *items = json_object_get(sch, "items");
    int item = items && !json_is_true(items) ? compile(c, items) : any_value(c);
    return item < 0 ? -1 : array_of(c, item, lo, hi);
}

static int string_schema(struct jsc *c, json_t *sch) {
    int lo, hi;
    if (get_count(sch, "minLength", 0, &lo) || get_count(sch, "maxLength", -1, &hi)) return -1;
    if (hi >= 0 && hi < lo) return kvq_error("json schema: maxLength is below minLength");
    return lo == 0 && hi < 0 ? string_rule(c) : sized_string(c, lo, hi);
}

static int typed(struct jsc *c, json_t *sch, const char *type) {
    if (!strcmp(type, "object")) return object_schema(c, sch);
    if (!strcmp(type, "array")) return array_schema(c, sch);
    if (!strcmp(type, "string")) return string_schema(c, sch);
    if (!strcmp(type, "number")) return number_schema(c, sch);
    if (!strcmp(type, "integer")) return integer_schema(c, sch);
    if (!strcmp(type, "boolean")) return boolean_rule(c);
    if (!strcmp(type, "null")) return null_rule(c);
    return kvq_error("json schema: unknown type '%s'", type);
}

/* One alternative per value, each written compactly. */
static int literals(struct jsc *c, json_t *values, bool one) {
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    size_t n = one ? 1 : json_array_size(values);
    if (n == 0) return kvq_error("json schema: 'enum' must list at least one value");
    for (size_t i = 0; i < n; i++) {
        char *text = json_dumps(one ? values : json_array_get(values, i), JSON_ENCODE_ANY | JSON_COMPACT);
        if (!text) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        struct gseq s = {0};
        gseq_lit(&s, c->g, text, strlen(text));
        free(text);
        if (add(c, r, &s) < 0) return -1;
    }
    return r;
}

/* The target of a local reference ("#", "#/$defs/name", any JSON pointer). */
static json_t *resolve(struct jsc *c, const char *ref) {
    if (ref[0] != '#') return NULL;
    json_t *at = c->root;
    for (const char *p = ref + 1; at && *p == '/';) {
        const char *end = strchr(p + 1, '/');
        size_t len = end ? (size_t)(end - p - 1) : strlen(p + 1);
        char tok[256];
        size_t n = 0;
        for (size_t i = 0; i < len && n + 1 < sizeof tok; i++) {
            char ch = p[1 + i];
            if (ch == '~' && i + 1 < len && (p[2 + i] == '0' || p[2 + i] == '1')) ch = p[2 + i++] == '0' ? '~' : '/';
            tok[n++] = ch;
        }
        tok[n] = '\0';
        if (json_is_array(at)) at = json_array_get(at, (size_t)strtoul(tok, NULL, 10));
        else at = json_object_get(at, tok);
        p += 1 + len;
    }
    return at;
}

static int ref_schema(struct jsc *c, const char *ref) {
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i].path, ref)) return c->refs[i].rule;
    json_t *target = resolve(c, ref);
    if (!target) return kvq_error("json schema: cannot resolve $ref '%.200s' (only local references: #/...)", ref);
    struct ref *rs = realloc(c->refs, sizeof *rs * (size_t)(c->n_refs + 1));
    if (!rs) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    c->refs = rs;
    int r = grammar_rule(c->g);
    if (r < 0 || !(rs[c->n_refs].path = strdup(ref))) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    rs[c->n_refs++].rule = r; /* known before compiling: recursive schemas refer to it */
    int t = compile(c, target);
    if (t < 0) return -1;
    struct gseq s = {0};
    gseq_ref(&s, t);
    return add(c, r, &s);
}

/* Keywords that only describe, or that the grammar already satisfies. */
static bool ignored_keyword(const char *k) {
    static const char *const names[] = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                                        "$defs", "definitions", "format", "deprecated", "readOnly", "writeOnly",
                                        "strict", "name", "nullable", NULL};
    for (const char *const *n = names; *n; n++)
        if (!strcmp(k, *n)) return true;
    return false;
}

static bool known_keyword(const char *k) {
    static const char *const names[] = {"type", "properties", "required", "additionalProperties", "items", "minItems",
                                        "maxItems", "minLength", "maxLength", "enum", "const", "anyOf", "oneOf",
                                        "allOf", "$ref", "minimum", "maximum", "exclusiveMinimum",
                                        "exclusiveMaximum", NULL};
    for (const char *const *n = names; *n; n++)
        if (!strcmp(k, *n)) return true;
    return ignored_keyword(k);
}

static int compile_any_of(struct jsc *c, json_t *list, const char *kw) {
    if (!json_is_array(list) || json_array_size(list) == 0)
        return kvq_error("json schema: '%s' must be a non-empty list of schemas", kw);
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    for (size_t i = 0; i < json_array_size(list); i++) {
        int a = compile(c, json_array_get(list, i));
        if (a < 0) return -1;
        struct gseq s = {0};
        gseq_ref(&s, a);
        if (add(c, r, &s) < 0) return -1;
    }
    return r;
}

static int compile_object(struct jsc *c, json_t *sch) {
    const char *k;
    json_t *v;
    int assertions = 0;
    json_object_foreach(sch, k, v) {
        if (!known_keyword(k)) return kvq_error("json schema: '%.100s' is not supported", k);
        assertions += !ignored_keyword(k);
    }
    if ((v = json_object_get(sch, "$ref"))) {
        if (!json_is_string(v)) return kvq_error("json schema: '$ref' must be a string");
        if (assertions > 1) return kvq_error("json schema: '$ref' with other keywords beside it is not supported");
        return ref_schema(c, json_string_value(v));
    }
    static const char *const combos[] = {"anyOf", "oneOf", "allOf"};
    for (int i = 0; i < 3; i++) {
        if (!(v = json_object_get(sch, combos[i]))) continue;
        if (assertions > 1)
            return kvq_error("json schema: '%s' with other keywords beside it is not supported", combos[i]);
        /* oneOf as anyOf: the alternatives of schemas clients send rarely overlap */
        if (i < 2) return compile_any_of(c, v, combos[i]);
        if (!json_is_array(v) || json_array_size(v) != 1)
            return kvq_error("json schema: 'allOf' is supported with one schema only");
        return compile(c, json_array_get(v, 0));
    }
    if ((v = json_object_get(sch, "const"))) return literals(c, v, true);
    if ((v = json_object_get(sch, "enum"))) {
        if (!json_is_array(v)) return kvq_error("json schema: 'enum' must be a list");
        return literals(c, v, false);
    }
    json_t *type = json_object_get(sch, "type");
    if (!type) {
        /* no type: what the other keywords imply, else any value */
        if (json_object_get(sch, "properties") || json_object_get(sch, "required") ||
            json_object_get(sch, "additionalProperties"))
            return object_schema(c, sch);
        if (json_object_get(sch, "items")) return array_schema(c, sch);
        return any_value(c);
    }
    if (json_is_string(type)) return typed(c, sch, json_string_value(type));
    if (!json_is_array(type) || json_array_size(type) == 0)
        return kvq_error("json schema: 'type' must be a string or a non-empty list of strings");
    int r = grammar_rule(c->g);
    if (r < 0) return -1;
    for (size_t i = 0; i < json_array_size(type); i++) {
        json_t *t = json_array_get(type, i);
        if (!json_is_string(t)) return kvq_error("json schema: 'type' must list strings");
        int a = typed(c, sch, json_string_value(t));
        if (a < 0) return -1;
        struct gseq s = {0};
        gseq_ref(&s, a);
        if (add(c, r, &s) < 0) return -1;
    }
    return r;
}

static int compile(struct jsc *c, json_t *sch) {
    if (json_is_true(sch)) return any_value(c);
    if (json_is_false(sch)) return kvq_error("json schema: the schema 'false' accepts nothing");
    if (!json_is_object(sch)) return kvq_error("json schema: a schema must be an object or a boolean");
    if (++c->depth > MAX_DEPTH) return kvq_error("json schema: nested deeper than %d", MAX_DEPTH);
    int r = compile_object(c, sch);
    c->depth--;
    return r;
}

int json_schema_compile(struct grammar *g, const char *schema, size_t len, const char *prefix, const char *suffix) {
    json_error_t err;
    json_t *root = json_loadb(schema, len, JSON_DECODE_ANY, &err);
    if (!root) return kvq_error("json schema: invalid JSON: %s (line %d, column %d)", err.text, err.line, err.column);
    struct jsc c = {.g = g, .root = root, .ws = -1, .sep = -1, .colon = -1, .value = -1, .string = -1, .chars = -1,
                    .number = -1, .integer = -1, .boolean = -1, .null = -1};
    int value = compile(&c, root), ws = ws_rule(&c), r = -1;
    if (value >= 0 && ws >= 0 && (r = grammar_rule(g)) >= 0) {
        struct gseq s = {0};
        if (prefix) gseq_lit(&s, g, prefix, strlen(prefix));
        gseq_ref(&s, ws); /* SentencePiece models like to start with a space */
        gseq_ref(&s, value);
        if (suffix) gseq_lit(&s, g, suffix, strlen(suffix));
        r = add(&c, r, &s);
    }
    for (int i = 0; i < c.n_refs; i++) free(c.refs[i].path);
    free(c.refs);
    json_decref(root);
    return r;
}
