/* Tokenizer tests: llama.cpp's tokenizer vectors (tokenize with add_special=false,
 * parse_special=false, as test-tokenizer-0 does), the tinydoc reference prompts,
 * the streaming detokenizer, round trips, and the wikitext encode time. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

static char *read_file(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    if (buf) buf[n] = '\0', *len = (size_t)n;
    return buf;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Encodes into a malloc'd array; returns the count (or -1). */
static int encode_all(const struct tokenizer *t, const char *s, size_t len, bool add_special, int32_t **ids) {
    int n = tokenizer_encode(t, s, len, add_special, false, NULL, 0);
    *ids = malloc(sizeof **ids * (size_t)(n > 0 ? n : 1));
    if (n > 0) tokenizer_encode(t, s, len, add_special, false, *ids, n);
    return n;
}

/* Concatenated bytes of ids (caller frees). */
static char *decode_all(const struct tokenizer *t, const int32_t *ids, int n, size_t *len) {
    size_t cap = 64, used = 0;
    char *out = malloc(cap);
    for (int i = 0; i < n; i++) {
        int k = tokenizer_token_bytes(t, ids[i], false, NULL, 0);
        while (used + (size_t)k + 1 > cap) out = realloc(out, cap *= 2);
        tokenizer_token_bytes(t, ids[i], false, out + used, k);
        used += (size_t)k;
    }
    out[used] = '\0';
    *len = used;
    return out;
}

/* --- llama.cpp vectors ------------------------------------------------------ */

static const char SEP[] = "\n__ggml_vocab_test__\n";

/* Splits .inp exactly like test-tokenizer-0: pieces between separators. */
static int split_inputs(char *raw, size_t len, char ***items, size_t **lens) {
    int n = 0, cap = 16;
    *items = malloc(sizeof **items * (size_t)cap);
    *lens = malloc(sizeof **lens * (size_t)cap);
    size_t pos = 0;
    const size_t sep_len = sizeof SEP - 1;
    while (pos < len) {
        if (n == cap) {
            cap *= 2;
            *items = realloc(*items, sizeof **items * (size_t)cap);
            *lens = realloc(*lens, sizeof **lens * (size_t)cap);
        }
        char *next = memmem(raw + pos, len - pos, SEP, sep_len);
        size_t end = next ? (size_t)(next - raw) : len;
        (*items)[n] = raw + pos;
        (*lens)[n] = end - pos;
        n++;
        if (!next) break;
        pos = end + sep_len;
    }
    return n;
}

struct vocab_case {
    const char *name;
    bool required; /* must pass 100% */
};

static void run_vocab(const struct vocab_case *vc) {
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizer-tests/ggml-vocab-%s.gguf", vc->name);
    const char *p = shared_path(rel);
    if (!p) {
        printf("vocab %-15s SKIP (missing)\n", vc->name);
        return;
    }
    char path[4096], inp_path[4200], out_path[4200];
    snprintf(path, sizeof path, "%s", p);
    snprintf(inp_path, sizeof inp_path, "%s.inp", path);
    snprintf(out_path, sizeof out_path, "%s.out", path);

    struct gguf_file *f = gguf_open(path);
    CHECK(f != NULL, "%s: %s", vc->name, kvq_last_error());
    if (!f) return;
    struct tokenizer *t = tokenizer_from_gguf(f);
    gguf_close(f);
    if (!t) {
        CHECK(!vc->required, "%s: %s", vc->name, kvq_last_error());
        printf("vocab %-15s SKIP (%s)\n", vc->name, kvq_last_error());
        return;
    }

    size_t inp_len = 0, out_len = 0;
    char *inp = read_file(inp_path, &inp_len), *outs = read_file(out_path, &out_len);
    CHECK(inp && outs, "%s: cannot read vectors", vc->name);
    if (!inp || !outs) {
        free(inp);
        free(outs);
        tokenizer_free(t);
        return;
    }
    char **items;
    size_t *lens;
    int n_items = split_inputs(inp, inp_len, &items, &lens);

    int pass = 0, total = 0;
    char *line = outs;
    for (int i = 0; i < n_items && line && *line; i++) {
        char *eol = strchr(line, '\n');
        if (eol) *eol = '\0';
        int32_t *ids;
        int n = encode_all(t, items[i], lens[i], false, &ids);
        /* compare against the space-separated expected ids */
        bool ok = n >= 0;
        int k = 0;
        for (char *q = line; ok;) {
            while (*q == ' ' || *q == '\r') q++;
            if (!*q) break;
            long want = strtol(q, &q, 10);
            ok = k < n && ids[k] == want;
            k++;
        }
        ok = ok && k == n;
        total++;
        pass += ok;
        if (!ok && vc->required) {
            fprintf(stderr, "%s: vector %d mismatch: '%.*s'\n  expected: %s\n  got:     ", vc->name, i, (int)lens[i], items[i], line);
            for (int j = 0; j < n; j++) fprintf(stderr, " %d", ids[j]);
            fputc('\n', stderr);
        }
        free(ids);
        line = eol ? eol + 1 : NULL;
    }
    printf("vocab %-15s %3d/%3d vectors pass\n", vc->name, pass, total);
    CHECK(total == n_items, "%s: %d inputs but %d expected lines", vc->name, n_items, total);
    if (vc->required) CHECK(pass == total && total > 0, "%s: %d/%d vectors pass", vc->name, pass, total);

    free(items);
    free(lens);
    free(inp);
    free(outs);
    tokenizer_free(t);
}

/* --- tinydoc reference prompts ---------------------------------------------- */

/* Reads a JSON string starting at the opening quote; returns a malloc'd copy. */
static char *json_string(const char *p, const char **end) {
    char *out = malloc(strlen(p) + 1);
    size_t n = 0;
    for (p++; *p && *p != '"'; p++) {
        if (*p != '\\') {
            out[n++] = *p;
            continue;
        }
        p++;
        switch (*p) {
        case 'n': out[n++] = '\n'; break;
        case 't': out[n++] = '\t'; break;
        case 'r': out[n++] = '\r'; break;
        case 'u': { /* BMP only: enough for these prompts */
            unsigned cp = (unsigned)strtoul((char[5]){p[1], p[2], p[3], p[4], 0}, NULL, 16);
            p += 4;
            if (cp < 0x80) out[n++] = (char)cp;
            else if (cp < 0x800) out[n++] = (char)(0xC0 | (cp >> 6)), out[n++] = (char)(0x80 | (cp & 0x3F));
            else out[n++] = (char)(0xE0 | (cp >> 12)), out[n++] = (char)(0x80 | ((cp >> 6) & 0x3F)), out[n++] = (char)(0x80 | (cp & 0x3F));
            break;
        }
        default: out[n++] = *p; break;
        }
    }
    out[n] = '\0';
    *end = p;
    return out;
}

static void test_tinydoc_prompts(const struct tokenizer *t) {
    const char *path = shared_path("refs/tinydoc/refs.json");
    if (!path) {
        printf("tinydoc refs SKIP (missing)\n");
        return;
    }
    size_t len;
    char *json = read_file(path, &len);
    CHECK(json != NULL, "cannot read refs.json");
    if (!json) return;
    int n_prompts = 0, n_ok = 0;
    for (const char *p = strstr(json, "\"prompts\""); p && (p = strstr(p, "\"text\"")); n_prompts++) {
        p = strchr(p + 6, '"');
        const char *end;
        char *text = json_string(p, &end);
        const char *ids_at = strstr(end, "\"token_ids_with_bos\"");
        ids_at = strchr(ids_at, '[') + 1;
        int32_t want[512];
        int n_want = 0;
        while (*ids_at && *ids_at != ']') {
            char *q;
            long v = strtol(ids_at, &q, 10);
            if (q == ids_at) {
                ids_at++;
                continue;
            }
            want[n_want++] = (int32_t)v;
            ids_at = q;
        }
        int32_t *ids;
        int n = encode_all(t, text, strlen(text), true, &ids);
        bool ok = n == n_want && memcmp(ids, want, sizeof *ids * (size_t)n) == 0;
        CHECK(ok, "tinydoc prompt %d '%s': %d tokens, expected %d", n_prompts, text, n, n_want);
        n_ok += ok;
        free(ids);
        free(text);
        p = ids_at;
    }
    printf("tinydoc prompts: %d/%d match token_ids_with_bos\n", n_ok, n_prompts);
    CHECK(n_prompts == 4, "expected 4 prompts, found %d", n_prompts);
    free(json);
}

/* --- streaming detokenizer -------------------------------------------------- */

static void test_stream(const struct tokenizer *t) {
    /* A llama emoji is not in the 8k vocabulary: it must come out as 4 byte tokens. */
    const char *text = "Hi \xF0\x9F\xA6\x99 there";
    int32_t *ids;
    int n = encode_all(t, text, strlen(text), true, &ids);
    CHECK(n > 4, "stream test: %d tokens", n);

    struct tokenizer_stream s;
    tokenizer_stream_init(&s, t, true);
    char out[256], buf[64];
    size_t used = 0;
    int held_back = 0;
    for (int i = 0; i < n; i++) {
        int k = tokenizer_stream_feed(&s, ids[i], buf, sizeof buf);
        CHECK(k >= 0, "stream feed: %s", kvq_last_error());
        if (k < 0) break;
        if (s.n_pending > 0) {
            held_back++;
            CHECK(k == 0, "bytes emitted while a sequence is incomplete");
        }
        memcpy(out + used, buf, (size_t)k);
        used += (size_t)k;
    }
    int k = tokenizer_stream_flush(&s, buf, sizeof buf);
    CHECK(k == 0, "flush after complete input emitted %d bytes", k);
    out[used] = '\0';
    CHECK(held_back >= 3, "the emoji's first 3 bytes were held back (%d)", held_back);
    CHECK(strcmp(out, text) == 0, "stream output '%s' != '%s'", out, text);

    /* an unfinished sequence is flushed as U+FFFD */
    int32_t byte_f0 = -1;
    for (int32_t id = 0; id < tokenizer_n_vocab(t); id++) {
        char b[8];
        int m = tokenizer_token_bytes(t, id, false, b, sizeof b);
        if (m == 1 && (unsigned char)b[0] == 0xF0) byte_f0 = id;
    }
    CHECK(byte_f0 >= 0, "no <0xF0> token");
    tokenizer_stream_init(&s, t, false);
    CHECK(tokenizer_stream_feed(&s, byte_f0, buf, sizeof buf) == 0, "lone lead byte emitted");
    k = tokenizer_stream_flush(&s, buf, sizeof buf);
    CHECK(k == 3 && memcmp(buf, "\xEF\xBF\xBD", 3) == 0, "flush of a lone lead byte: %d bytes", k);
    free(ids);
}

static void test_round_trip(const struct tokenizer *t, const char *label, bool strip_prefix) {
    static const char *const texts[] = {
        "Hello world",
        "  leading spaces and\ttabs\n\nnew lines",
        "Unicode: caf\xC3\xA9 \xE2\x82\xAC 100 \xF0\x9F\xA6\x99 \xE4\xBD\xA0\xE5\xA5\xBD",
        "code: if (x < 2) { return x * 3.14; }",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        int32_t *ids;
        int n = encode_all(t, texts[i], strlen(texts[i]), false, &ids);
        size_t len;
        char *back = decode_all(t, ids, n, &len);
        const char *cmp = back;
        if (strip_prefix && back[0] == ' ') cmp++; /* SentencePiece's dummy prefix */
        CHECK(strcmp(cmp, texts[i]) == 0, "%s round trip: '%s' -> '%s'", label, texts[i], cmp);
        free(back);
        free(ids);
    }
}

static void test_parse_special(const struct tokenizer *t) {
    const char *text = "a</s>b";
    int32_t ids[32];
    int n_plain = tokenizer_encode(t, text, strlen(text), false, false, ids, 32);
    int n_special = tokenizer_encode(t, text, strlen(text), false, true, ids, 32);
    CHECK(n_special > 0 && n_special < n_plain, "parse_special: %d vs %d tokens", n_special, n_plain);
    bool has_eos = false;
    for (int i = 0; i < n_special; i++) has_eos |= ids[i] == tokenizer_eos(t);
    CHECK(has_eos, "parse_special did not produce EOS");
    CHECK(tokenizer_is_eog(t, tokenizer_eos(t)), "EOS is not EOG");
    /* too-small buffer: returns the needed count, writes a prefix */
    int32_t two[2];
    CHECK(tokenizer_encode(t, "Hello world, again", 18, true, false, two, 2) > 2, "short buffer count");
}

static void test_wikitext_speed(const struct tokenizer *t) {
    const char *path = shared_path("data/wikitext2-test.txt");
    if (!path) {
        printf("wikitext SKIP (missing)\n");
        return;
    }
    size_t len;
    char *text = read_file(path, &len);
    double t0 = now_s();
    int n = tokenizer_encode(t, text, len, true, false, NULL, 0);
    double dt = now_s() - t0;
    printf("wikitext: %zu bytes -> %d tokens in %.3f s\n", len, n, dt);
    CHECK(n > 0, "wikitext encode failed: %s", kvq_last_error());
    CHECK(dt < 10.0, "wikitext encode too slow: %.2f s", dt);
    free(text);
}

int main(void) {
    require_shared("tokenizer-tests");
    static const struct vocab_case vocabs[] = {
        {"llama-spm", true},   {"phi-3", true},          {"gpt-2", true},
        {"falcon", true},      {"mpt", true},            {"starcoder", true},
        {"refact", true},      {"deepseek-coder", true}, {"deepseek-llm", true},
        {"bert-bge", false},
    };
    for (size_t i = 0; i < sizeof vocabs / sizeof vocabs[0]; i++) run_vocab(&vocabs[i]);

    const char *model = shared_path("models/tinydoc-f16.gguf");
    if (model) {
        struct gguf_file *f = gguf_open(model);
        CHECK(f != NULL, "tinydoc: %s", kvq_last_error());
        struct tokenizer *t = f ? tokenizer_from_gguf(f) : NULL;
        if (f) gguf_close(f);
        CHECK(t != NULL, "tinydoc tokenizer: %s", kvq_last_error());
        if (t) {
            CHECK(tokenizer_n_vocab(t) == 8192, "n_vocab %d", tokenizer_n_vocab(t));
            CHECK(tokenizer_bos(t) == 1 && tokenizer_eos(t) == 2, "bos/eos %d/%d", tokenizer_bos(t), tokenizer_eos(t));
            CHECK(tokenizer_add_bos(t) && !tokenizer_add_eos(t), "add_bos/add_eos");
            test_tinydoc_prompts(t);
            test_stream(t);
            test_round_trip(t, "tinydoc", true);
            test_parse_special(t);
            test_wikitext_speed(t);
            tokenizer_free(t);
        }
    } else {
        printf("tinydoc SKIP (missing)\n");
    }

    const char *gpt2 = shared_path("tokenizer-tests/ggml-vocab-gpt-2.gguf");
    if (gpt2) {
        struct gguf_file *f = gguf_open(gpt2);
        struct tokenizer *t = f ? tokenizer_from_gguf(f) : NULL;
        if (f) gguf_close(f);
        if (t) {
            test_round_trip(t, "gpt-2", false);
            tokenizer_free(t);
        }
    }
    return check_finish();
}
