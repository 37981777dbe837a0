/* The Jinja interpreter (src/server/jinja*.c) against Python's jinja2: the public
 * chat templates in tests/chat_templates (Llama 3.1/3.3 and 3.2, Qwen2.5, Qwen3,
 * Mistral v3 and Nemo, Gemma 3, Phi-3, Phi-4, DeepSeek-R1-distill; also Phi-4-mini,
 * Mistral Small 3.1 and Command R7B's tool_use variant, which use more of Jinja) over a set of
 * conversations (system, multi-turn, tools, tool calls and results, with and
 * without add_generation_prompt), and snippets of every feature, rendered byte for
 * byte as jinja2 renders them with transformers' settings (jinja2_reference.py
 * writes the expected outputs at test time; skipped with a message without
 * python3-jinja2). Also the error paths: malformed templates and failing renders
 * give one clear message, never a crash. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "check.h"
#include "server/jinja.h"

#define TEMPLATES KVQ_SOURCE_DIR "/tests/chat_templates"

static char *render_text(const char *src, const char *vars_json, char *err, size_t err_size) {
    struct jinja_template *t = jinja_parse(src, err, err_size);
    if (!t) return NULL;
    json_t *vars = vars_json ? json_loads(vars_json, 0, NULL) : NULL;
    char *out = jinja_render(t, vars, 0, err, err_size);
    json_decref(vars);
    jinja_free(t);
    return out;
}

/* A template that must fail to parse, with msg in the error. */
static void expect_parse_error(const char *src, const char *msg) {
    char err[256] = "";
    struct jinja_template *t = jinja_parse(src, err, sizeof err);
    CHECK(!t && strstr(err, msg), "parse of '%.80s': expected an error with '%s', got '%s'", src, msg, t ? "(parsed)" : err);
    jinja_free(t);
}

/* A template that parses but must fail to render, with msg in the error. */
static void expect_render_error(const char *src, const char *vars, const char *msg) {
    char err[256] = "";
    char *out = render_text(src, vars, err, sizeof err);
    CHECK(!out && strstr(err, msg), "render of '%.80s': expected an error with '%s', got '%s'", src, msg,
          out ? out : err);
    free(out);
}

static void test_errors(void) {
    char err[256], *s;
    expect_parse_error("abc {{ x ", "line 1: unterminated expression");
    expect_parse_error("a\nb {% if x %", "line 2: unterminated block tag");
    expect_parse_error("{# never closed", "unterminated comment");
    expect_parse_error("{{ 'abc }}", "unterminated string");
    expect_parse_error("{% if x %}yes", "missing {% endif %}");
    expect_parse_error("{% for x in y %}{% endif %}", "unexpected {% endif %}");
    expect_parse_error("{% endfor %}", "unexpected {% endfor %}");
    expect_parse_error("{% else %}", "outside an if or for");
    expect_parse_error("{% frobnicate %}", "unknown tag 'frobnicate'");
    expect_parse_error("{{ }}", "expected an expression");
    expect_parse_error("{{ a + }}", "expected an expression");
    expect_parse_error("{{ a b }}", "expected '}}'");
    expect_parse_error("{{ f(a=1, 2) }}", "positional ones come first");
    expect_parse_error("{{ [1, 2 }}", "unterminated expression");
    expect_parse_error("{{ [1, 2 3] }}", "expected ',' or ']'");
    expect_parse_error("{{ a[] }}", "expected an expression");
    expect_parse_error("{{ 'a' | }}", "expected a name");
    expect_parse_error("{{ 99999999999999999999 }}", "too large");
    char longnum[600] = "{{ 1";
    for (int i = 0; i < 500; i++) strcat(longnum, i == 200 ? "." : "5");
    strcat(longnum, " }}");
    s = render_text(longnum, NULL, err, sizeof err);
    CHECK(s && !strcmp(s, "1.5555555555555557e+200"), "a 500-digit float: %s", s ? s : err);
    free(s);
    expect_parse_error("{{ '\\u12' }}", "bad \\u escape");
    expect_parse_error("{% set %}", "expected a name");
    expect_parse_error("{% for in x %}{% endfor %}", "expected 'in'");
    expect_parse_error("{% for 1 in x %}{% endfor %}", "expected a name");
    expect_parse_error("{% macro m(1) %}{% endmacro %}", "expected a name");
    expect_parse_error("{{ a $ b }}", "unexpected character '$'");
    static const char *const chains[] = {"not ", "- ", "(", "[", "x.y("};
    for (size_t k = 0; k < sizeof chains / sizeof chains[0]; k++) {
        char deep[12000] = "{{ ";
        for (int i = 0; i < 2000; i++) strcat(deep, chains[k]);
        strcat(deep, "1 }}");
        expect_parse_error(deep, k < 2 ? "nests too deeply" : "unterminated expression");
    }
    char nested[8000] = "";
    for (int i = 0; i < 500; i++) strcat(nested, "{% if x %}");
    expect_parse_error(nested, "nests too deeply");

    expect_render_error("{{ x | frobnicate }}", "{\"x\": 1}", "no filter named 'frobnicate'");
    expect_render_error("{{ x is frobnicated }}", "{\"x\": 1}", "no test named 'frobnicated'");
    expect_render_error("{{ missing.attr }}", NULL, "'missing' is undefined");
    expect_render_error("{{ d.a.b }}", "{\"d\": {}}", "has no attribute 'a'");
    expect_render_error("{{ 'a' + 1 }}", NULL, "unsupported operand");
    expect_render_error("{{ 1 / 0 }}", NULL, "division by zero");
    expect_render_error("{{ 1 // 0 }}", NULL, "by zero");
    expect_render_error("{{ raise_exception('custom failure') }}", NULL, "custom failure");
    expect_render_error("{% for x in none %}{% endfor %}", NULL, "not iterable");
    expect_render_error("{% set x = 1 %}{% set x.y = 2 %}", NULL, "non-namespace");
    expect_render_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL, "takes 1 arguments");
    expect_render_error("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", NULL, "has no argument 'b'");
    expect_render_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", NULL, "too deeply");
    expect_render_error("{{ 1 < 'a' }}", NULL, "not supported between");
    expect_render_error("{{ undefined_fn() }}", NULL, "'undefined_fn' is undefined");
    expect_render_error("{{ 'abc'.nosuchmethod() }}", NULL, "has no attribute");
    expect_render_error("{{ x | tojson }}", NULL, "not JSON serializable");
    expect_render_error("{% set r = range(10000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", NULL,
                        "runs too long");
    expect_render_error("{{ 'x' * 1000000000 }}", NULL, "too long");
    expect_render_error("{% set a, b = [1] %}", NULL, "cannot unpack");
    expect_render_error("{{ '%5000d' % 1 }}", NULL, "over 400");
    expect_render_error("{{ '%q' % 1 }}", NULL, "unsupported format character 'q'");
    expect_render_error("{{ '%d' % 'x' }}", NULL, "a real number is required");
    expect_render_error("{{ '%(k)s' % 1 }}", NULL, "requires a mapping");
    expect_render_error("{{ 'abc %' % 1 }}", NULL, "incomplete format");
    expect_render_error("{{ 9223372036854775807 + 1 }}", NULL, "integer overflow");
    expect_render_error("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}"
                        "{{ ns.l }}", NULL, "nested too deeply");
    expect_render_error("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}"
                        "{{ ns.l | tojson }}", NULL, "nested too deeply");
    expect_render_error("{% set ns = namespace(a=[], b=[]) %}{% for i in range(100000) %}{% set ns.a = [ns.a] %}"
                        "{% set ns.b = [ns.b] %}{% endfor %}{{ ns.a < ns.b }}", NULL, "nested too deeply");

    /* the interpreter keeps working after errors, and renders what parses */
    s = render_text("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}",
                          "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", err, sizeof err);
    CHECK(s && !strcmp(s, "user:hi;"), "simple render: %s", s ? s : err);
    free(s);
    /* NUL-free but arbitrary bytes: never a crash */
    char junk[512];
    unsigned x = 12345;
    for (int round = 0; round < 2000; round++) {
        size_t n = 1 + (x % (sizeof junk - 1));
        static const char alphabet[] = "{}%#-+ 'a\"()[]|.,:=~*/\nifforendsetmacro0123456789x";
        for (size_t i = 0; i < n; i++) {
            x = x * 1103515245u + 12345u;
            junk[i] = alphabet[(x >> 16) % (sizeof alphabet - 1)];
        }
        junk[n] = 0;
        s = render_text(junk, "{\"x\": [1, {\"a\": \"b\"}]}", err, sizeof err);
        free(s);
    }
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
    if (buf) buf[n] = 0;
    fclose(f);
    return buf;
}

/* Where the strings first differ, for the failure message. */
static void show_difference(const char *name, const char *got, const char *want) {
    size_t i = 0;
    while (got[i] && got[i] == want[i]) i++;
    size_t from = i > 40 ? i - 40 : 0;
    fprintf(stderr, "%s: differs at byte %zu\n  got:  \"%.80s\"\n  want: \"%.80s\"\n", name, i, got + from, want + from);
}

static void test_against_jinja2(void) {
    FILE *p = popen("python3 " TEMPLATES "/jinja2_reference.py 2>&1", "r");
    if (!p) {
        printf("SKIP (jinja2 comparisons): cannot run python3\n");
        return;
    }
    size_t cap = 1 << 20, n = 0, r;
    char *text = malloc(cap);
    while (text && (r = fread(text + n, 1, cap - n - 1, p)) > 0)
        if ((n += r) == cap - 1 && !(text = realloc(text, cap *= 2))) break;
    int status = pclose(p);
    if (!text) return;
    text[n] = 0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("SKIP (jinja2 comparisons): python3 %s/jinja2_reference.py: %s\n", TEMPLATES,
               WIFEXITED(status) && WEXITSTATUS(status) == 77 ? "python3-jinja2 is not installed" : text);
        free(text);
        return;
    }
    json_error_t je;
    json_t *root = json_loads(text, 0, &je);
    free(text);
    CHECK(root, "reference output is not JSON: %s", je.text);
    json_t *cases = json_object_get(root, "cases");
    size_t i;
    json_t *c;
    int compared = 0;
    /* 2026-03-05 14:07:09 UTC, jinja2_reference.py's clock */
    time_t now = 1772719629;
    json_array_foreach(cases, i, c) {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *file = json_string_value(json_object_get(c, "file"));
        char path[512], err[512] = "";
        char *src = NULL;
        if (file) {
            snprintf(path, sizeof path, "%s/%s", TEMPLATES, file);
            src = read_file(path);
        } else
            src = strdup(json_string_value(json_object_get(c, "template")));
        CHECK(src, "%s: cannot read the template", name);
        if (!src) continue;
        struct jinja_template *t = jinja_parse(src, err, sizeof err);
        CHECK(t, "%s: parse error: %s", name, err);
        char *out = t ? jinja_render(t, json_object_get(c, "vars"), now, err, sizeof err) : NULL;
        json_t *want = json_object_get(c, "output");
        if (t && json_is_string(want)) {
            CHECK(out, "%s: render error: %s", name, err);
            if (out && strcmp(out, json_string_value(want))) {
                CHECK(false, "%s: output differs from jinja2's", name);
                show_difference(name, out, json_string_value(want));
            }
        } else if (t) {
            const char *werr = json_string_value(json_object_get(c, "error"));
            CHECK(!out, "%s: rendered '%.200s' where jinja2 fails with %s", name, out, werr);
            if (json_is_true(json_object_get(c, "raised")))
                CHECK(!out && strstr(err, werr), "%s: error '%s', jinja2 raised '%s'", name, err, werr);
        }
        compared++;
        free(out);
        jinja_free(t);
        free(src);
    }
    printf("%d renderings compared with jinja2\n", compared);
    CHECK(compared > 250, "only %d cases from jinja2_reference.py", compared);
    json_decref(root);
}

int main(void) {
    setenv("TZ", "UTC", 1);
    tzset();
    test_errors();
    test_against_jinja2();
    return check_finish();
}
