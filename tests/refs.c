#include "refs.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvq.h"

static char *slurp(const char *path, long *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)*size + 1);
    if (fread(buf, 1, (size_t)*size, f) != (size_t)*size) *size = 0;
    buf[*size] = '\0';
    fclose(f);
    return buf;
}

/* Parses the integer array that follows "key": at or after p (at most max values). */
static int parse_ids_max(const char *p, const char *key, int32_t *out, int max) {
    const char *k = strstr(p, key);
    if (!k) return 0;
    const char *s = strchr(k, '[');
    int n = 0;
    for (s++; *s && *s != ']';) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) { s++; continue; }
        if (n < max) out[n++] = (int32_t)v;
        s = end;
    }
    return n;
}
static int parse_ids(const char *p, const char *key, int32_t *out) {
    return parse_ids_max(p, key, out, REFS_MAX_IDS);
}

static void parse_string(const char *p, const char *key, char *out, size_t size) {
    const char *k = strstr(p, key);
    out[0] = '\0';
    if (!k) return;
    const char *s = strchr(k + strlen(key), '"') + 1;
    size_t n = 0;
    while (*s && *s != '"' && n + 1 < size) {
        if (*s == '\\') {
            s++;
            char c = *s == 'n' ? '\n' : *s == 't' ? '\t' : *s;
            out[n++] = c;
            s++;
        } else {
            out[n++] = *s++;
        }
    }
    out[n] = '\0';
}

void refs_load(struct ref_prompt out[REFS_PROMPTS]) { refs_load_dir("tinydoc", out); }

static char *load_json(const char *dir) {
    char rel[96];
    snprintf(rel, sizeof rel, "refs/%s/refs.json", dir);
    long size;
    return slurp(require_shared(rel), &size);
}

void refs_load_dir(const char *dir, struct ref_prompt out[REFS_PROMPTS]) {
    char *json = load_json(dir);
    const char *p = strstr(json, "\"prompts\"");
    memset(out, 0, sizeof(struct ref_prompt) * REFS_PROMPTS); /* ids past n_next read as 0, not stack garbage */
    for (int i = 0; i < REFS_PROMPTS; i++) {
        p = strstr(p, "\"text\"");
        parse_string(p, "\"text\":", out[i].text, sizeof out[i].text);
        out[i].n_ids = parse_ids(p, "\"token_ids_with_bos\"", out[i].ids);
        out[i].n_next = parse_ids(p, "\"greedy_next_ids\"", out[i].next);
        parse_string(p, "\"logits_file\":", out[i].logits_file, sizeof out[i].logits_file);
        snprintf(out[i].dir, sizeof out[i].dir, "%s", dir);
        p++;
    }
    free(json);
}

static float *read_logits(const char *dir, const char *file, long rows, int n_vocab) {
    char rel[128];
    snprintf(rel, sizeof rel, "refs/%s/%s", dir, file);
    long size;
    char *data = slurp(require_shared(rel), &size);
    if (size != (long)sizeof(float) * rows * n_vocab) {
        free(data);
        return NULL;
    }
    return (float *)data;
}

float *refs_logits(const struct ref_prompt *p, int n_vocab) {
    return read_logits(p->dir, p->logits_file, p->n_ids, n_vocab);
}

int refs_load_long(const char *dir, struct ref_long *out) {
    memset(out, 0, sizeof *out);
    char *json = load_json(dir);
    const char *p = strstr(json, "\"prompts\"");
    for (int i = 0; p && i <= REFS_PROMPTS; i++) p = strstr(p + 1, "\"token_ids_with_bos\"");
    if (!p) {
        free(json);
        return -1;
    }
    /* the arrays are bounded by the file's size */
    int max = (int)(strlen(p) / 2 + 1);
    out->ids = malloc(sizeof(int32_t) * (size_t)max);
    out->argmax = malloc(sizeof(int32_t) * (size_t)max);
    out->n_ids = parse_ids_max(p, "\"token_ids_with_bos\"", out->ids, max);
    out->n_argmax = parse_ids_max(p, "\"argmax_every_position\"", out->argmax, max);
    int32_t shape[2] = {0, 0};
    parse_ids_max(p, "\"logits_shape\"", shape, 2);
    out->n_logits = shape[0];
    parse_string(p, "\"logits_file\":", out->logits_file, sizeof out->logits_file);
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    free(json);
    return 0;
}

void refs_long_free(struct ref_long *r) {
    free(r->ids);
    free(r->argmax);
    memset(r, 0, sizeof *r);
}

float *refs_long_logits(const struct ref_long *r, int n_vocab) {
    return read_logits(r->dir, r->logits_file, r->n_logits, n_vocab);
}

static int argmax_of(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

int refs_check_logits(struct kvq_context *ctx, const struct ref_prompt *r, int n_vocab, const char *label) {
    float *want = refs_logits(r, n_vocab);
    CHECK(want != NULL, "%s: reference logits %s", label, r->logits_file);
    bool all[REFS_MAX_IDS];
    for (int t = 0; t < r->n_ids; t++) all[t] = true;
    struct kvq_batch b = {.n_tokens = r->n_ids, .tokens = r->ids, .logits = all};
    int rc = kvq_decode(ctx, &b);
    CHECK(rc == 0, "%s: decode: %s", label, kvq_last_error());
    double max_err = 0;
    int same = 0;
    for (int t = 0; t < r->n_ids && want && rc == 0; t++) {
        const float *got = kvq_get_logits(ctx, t), *ref = want + (size_t)t * n_vocab;
        for (int v = 0; v < n_vocab; v++) max_err = fmax(max_err, fabs(got[v] - ref[v]));
        same += argmax_of(got, n_vocab) == argmax_of(ref, n_vocab);
    }
    printf("%s: max |logit - HF| = %.2e over %d positions, argmax agrees at %d/%d\n", label, max_err, r->n_ids, same,
           r->n_ids);
    CHECK(max_err < 1e-2, "%s: logits differ from HF by %g", label, max_err);
    CHECK(same == r->n_ids, "%s: argmax differs at %d positions", label, r->n_ids - same);
    free(want);
    return rc;
}

void refs_top_k(const float *l, int n, int k, float *vals, int32_t *ids) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            bool taken = false;
            for (int t = 0; t < j && !taken; t++) taken = ids[t] == i;
            if (!taken && (best < 0 || l[i] > l[best])) best = i;
        }
        ids[j] = best;
        vals[j] = l[best];
    }
}
