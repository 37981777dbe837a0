#include "cli/bench_prompts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Tokens of the vocabulary that are one whole lowercase word with its leading space
 * (" the", " kernel"): joined, they tokenize back into the same tokens, so a prompt's
 * size and a shared prefix's tokens are exact. */
struct words {
    char **w;
    int n;
};

static void words_free(struct words *ws) {
    for (int i = 0; i < ws->n; i++) free(ws->w[i]);
    free(ws->w);
}

static bool words_from_vocab(const struct kvq_model *m, struct words *ws) {
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    ws->w = calloc((size_t)info.n_vocab + 1, sizeof *ws->w);
    ws->n = 0;
    if (!ws->w) return cli_fail("out of memory"), false;
    for (kvq_token t = 0; t < info.n_vocab; t++) {
        char b[32];
        int n = kvq_token_bytes(m, t, b, (int)sizeof b - 1);
        if (n < 3 || n >= (int)sizeof b - 1 || b[0] != ' ' || kvq_token_is_eog(m, t)) continue;
        b[n] = '\0';
        if ((int)strspn(b + 1, "abcdefghijklmnopqrstuvwxyz") != n - 1) continue;
        if (!(ws->w[ws->n++] = strdup(b))) return cli_fail("out of memory"), false;
    }
    if (ws->n >= 64) return true;
    /* a placeholder vocabulary (kvq gen-model's) has single letters only: a text of
     * letters then has one token a letter */
    const int n_words = ws->n;
    for (kvq_token t = 0; t < info.n_vocab && ws->n < n_words + 26; t++) {
        char b[4];
        if (kvq_token_bytes(m, t, b, (int)sizeof b) != 1 || b[0] < 'a' || b[0] > 'z') continue;
        b[1] = '\0';
        if (!(ws->w[ws->n++] = strdup(b))) return cli_fail("out of memory"), false;
    }
    if (ws->n < n_words + 26)
        return cli_fail("the model's vocabulary has only %d whole-word tokens: too few to build prompts", n_words), false;
    for (int i = 0; i < n_words; i++) free(ws->w[i]);
    memmove(ws->w, ws->w + n_words, sizeof *ws->w * 26);
    ws->n = 26;
    return true;
}

/* prefix + k random words (seeded); the first word loses its space when there is no prefix. */
static char *word_text(const struct words *ws, const char *prefix, uint64_t seed, int k) {
    size_t plen = strlen(prefix), cap = plen + 1;
    uint64_t s = seed;
    for (int i = 0; i < k; i++) cap += strlen(ws->w[splitmix64(&s) % (uint64_t)ws->n]);
    char *t = malloc(cap), *p = t + plen;
    if (!t) return NULL;
    memcpy(t, prefix, plen);
    s = seed;
    for (int i = 0; i < k; i++) {
        const char *w = ws->w[splitmix64(&s) % (uint64_t)ws->n];
        if (i == 0 && plen == 0 && w[0] == ' ') w++;
        size_t n = strlen(w);
        memcpy(p, w, n);
        p += n;
    }
    *p = '\0';
    return t;
}

struct prompt_maker {
    const struct kvq_model *m;
    struct words ws;
    bool add_special; /* the server adds BOS to a completion's prompt, not to a chat message's text */
    int bos;          /* 1 when that adds a token */
};

/* A text of exactly `target` tokens that starts with prefix (n_prefix tokens, ids
 * prefix_ids) token for token; NULL with an error printed. */
static char *make_prompt(const struct prompt_maker *pm, const char *prefix, const kvq_token *prefix_ids, int n_prefix,
                         int target, uint64_t seed, kvq_token **ids_out) {
    int k0 = target - n_prefix - (n_prefix == 0 ? pm->bos : 0);
    for (uint64_t variant = 0; variant < 4; variant++) /* other words when the prefix's tokens change */
        for (int step = 0, k = k0; step < 8; step++) {
            if (k < 1) k = 1;
            char *text = word_text(&pm->ws, prefix, seed + variant, k);
            if (!text) return cli_fail("out of memory"), NULL;
            int n;
            kvq_token *ids = cli_tokenize(pm->m, text, strlen(text), pm->add_special, true, &n);
            if (!ids) {
                free(text);
                return NULL;
            }
            bool prefix_kept = n_prefix == 0 || (n >= n_prefix && !memcmp(ids, prefix_ids, sizeof *ids * (size_t)n_prefix));
            if (n == target && prefix_kept) {
                if (ids_out) *ids_out = ids;
                else free(ids);
                return text;
            }
            free(ids);
            free(text);
            if (!prefix_kept) break;
            k += target - n;
        }
    cli_fail("cannot build a prompt of exactly %d tokens from this vocabulary", target);
    return NULL;
}

char **bench_prompts(const struct kvq_model *m, int n, int n_tokens, int n_shared, bool add_special, uint64_t seed) {
    struct prompt_maker pm = {.m = m, .add_special = add_special, .bos = add_special && cli_model_adds_bos(m)};
    if (!words_from_vocab(m, &pm.ws)) {
        words_free(&pm.ws);
        return NULL;
    }
    int bos = pm.bos;
    if (n_tokens <= bos) {
        words_free(&pm.ws);
        return cli_fail("a prompt of %d token%s has no room for words after BOS", n_tokens, n_tokens == 1 ? "" : "s"), NULL;
    }
    char **prompts = calloc((size_t)n, sizeof *prompts), *prefix = NULL;
    kvq_token *prefix_ids = NULL;
    int n_prefix = n_shared > bos ? n_shared : 0; /* BOS alone is in every prompt anyway */
    bool ok = prompts != NULL;
    if (ok && n_prefix > 0)
        ok = (prefix = make_prompt(&pm, "", NULL, 0, n_prefix, seed * 0x100000001B3ULL, &prefix_ids)) != NULL;
    bool tty = isatty(STDERR_FILENO);
    double shown = cli_now();
    for (int i = 0; ok && i < n; i++) {
        uint64_t own = (seed * 0x100000001B3ULL) ^ ((uint64_t)(i + 1) << 32);
        ok = (prompts[i] = make_prompt(&pm, prefix ? prefix : "", prefix_ids, prefix ? n_prefix : 0, n_tokens,
                                       own, NULL)) != NULL;
        if (tty && cli_now() - shown > 0.2) {
            fprintf(stderr, "\rkvq bench-serve: building prompts %d/%d", i + 1, n);
            shown = cli_now();
        }
    }
    if (tty) fputs("\r\033[K", stderr);
    free(prefix);
    free(prefix_ids);
    words_free(&pm.ws);
    if (!ok && prompts) {
        for (int i = 0; i < n; i++) free(prompts[i]);
        free(prompts);
        return NULL;
    }
    if (!ok) cli_fail("out of memory");
    return prompts;
}
