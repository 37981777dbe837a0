#include "refs.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

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

/* Parses the integer array that follows "key": at or after p. */
static int parse_ids(const char *p, const char *key, int32_t *out) {
    const char *k = strstr(p, key);
    if (!k) return 0;
    const char *s = strchr(k, '[');
    int n = 0;
    for (s++; *s && *s != ']';) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) { s++; continue; }
        if (n < REFS_MAX_IDS) out[n++] = (int32_t)v;
        s = end;
    }
    return n;
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

void refs_load(struct ref_prompt out[REFS_PROMPTS]) {
    const char *path = require_shared("refs/tinydoc/refs.json");
    long size;
    char *json = slurp(path, &size);
    const char *p = strstr(json, "\"prompts\"");
    for (int i = 0; i < REFS_PROMPTS; i++) {
        p = strstr(p, "\"text\"");
        parse_string(p, "\"text\":", out[i].text, sizeof out[i].text);
        out[i].n_ids = parse_ids(p, "\"token_ids_with_bos\"", out[i].ids);
        out[i].n_next = parse_ids(p, "\"greedy_next_ids\"", out[i].next);
        parse_string(p, "\"logits_file\":", out[i].logits_file, sizeof out[i].logits_file);
        p++;
    }
    free(json);
}

float *refs_logits(const struct ref_prompt *p, int n_vocab) {
    char rel[128];
    snprintf(rel, sizeof rel, "refs/tinydoc/%s", p->logits_file);
    const char *path = require_shared(rel);
    long size;
    char *data = slurp(path, &size);
    if (size != (long)sizeof(float) * p->n_ids * n_vocab) {
        free(data);
        return NULL;
    }
    return (float *)data;
}
