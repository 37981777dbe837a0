/* Token sampling: repetition penalty, then top-k, top-p and min-p filters on the
 * temperature-scaled distribution (llama.cpp's order), then a seeded draw. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kvq.h"

struct candidate {
    float logit;
    kvq_token id;
};

struct kvq_sampler {
    struct kvq_sampler_params p;
    int n_vocab;
    struct candidate *cand;
    kvq_token *history; /* ring of the last repeat_last_n tokens */
    int n_history, history_pos;
    uint64_t rng;
};

void kvq_sampler_params_default(struct kvq_sampler_params *p) {
    p->temp = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->seed = 0x5eed;
}

struct kvq_sampler *kvq_sampler_new(const struct kvq_sampler_params *p, int n_vocab) {
    struct kvq_sampler *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->p = *p;
    if (s->p.repeat_last_n < 0) s->p.repeat_last_n = 0;
    s->n_vocab = n_vocab;
    s->cand = malloc(sizeof *s->cand * (size_t)n_vocab);
    s->history = malloc(sizeof *s->history * (size_t)(s->p.repeat_last_n + 1));
    if (!s->cand || !s->history) goto oom;
    s->rng = p->seed ^ 0x9e3779b97f4a7c15ull;
    return s;
oom:
    kvq_sampler_free(s);
    kvq_error("out of memory");
    return NULL;
}

void kvq_sampler_free(struct kvq_sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s->history);
    free(s);
}

void kvq_sampler_accept(struct kvq_sampler *s, kvq_token t) {
    if (s->p.repeat_last_n == 0) return;
    s->history[s->history_pos] = t;
    s->history_pos = (s->history_pos + 1) % s->p.repeat_last_n;
    if (s->n_history < s->p.repeat_last_n) s->n_history++;
}

/* splitmix64: small, fast, good enough for sampling. */
static uint64_t next_u64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int by_logit_desc(const void *a, const void *b) {
    float x = ((const struct candidate *)a)->logit, y = ((const struct candidate *)b)->logit;
    return (x < y) - (x > y);
}

/* Moves the k largest candidates to c[0..k) (quickselect, any order). */
static void select_top(struct candidate *c, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = c[(lo + hi) / 2].logit;
        int i = lo, j = hi;
        while (i <= j) {
            while (c[i].logit > pivot) i++;
            while (c[j].logit < pivot) j--;
            if (i <= j) {
                struct candidate t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

static kvq_token argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

kvq_token kvq_sampler_sample(struct kvq_sampler *s, const float *logits) {
    int n = s->n_vocab;
    struct candidate *c = s->cand;
    for (int i = 0; i < n; i++) c[i] = (struct candidate){logits[i], i};
    if (s->p.repeat_penalty != 1.0f) {
        for (int h = 0; h < s->n_history; h++) {
            kvq_token t = s->history[h];
            if (t < 0 || t >= n) continue;
            bool seen = false; /* penalize each token once */
            for (int j = 0; j < h; j++) seen |= s->history[j] == t;
            if (seen) continue;
            float *l = &c[t].logit;
            *l = *l > 0 ? *l / s->p.repeat_penalty : *l * s->p.repeat_penalty;
        }
    }
    if (s->p.temp <= 0) {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (c[i].logit > c[best].logit) best = i;
        return c[best].id;
    }
    /* With top-k on, only the k best need sorting: select them first. */
    int k = n;
    if (s->p.top_k > 0 && s->p.top_k < n) {
        k = s->p.top_k;
        select_top(c, n, k);
    }
    qsort(c, (size_t)k, sizeof *c, by_logit_desc);
    float maxl = c[0].logit;
    double sum = 0;
    float *prob = malloc(sizeof(float) * (size_t)k);
    if (!prob) return argmax(logits, n);
    for (int i = 0; i < k; i++) {
        prob[i] = expf((c[i].logit - maxl) / s->p.temp);
        sum += prob[i];
    }
    /* top-p: smallest prefix with cumulative probability >= top_p */
    if (s->p.top_p < 1.0f) {
        double cum = 0;
        for (int i = 0; i < k; i++) {
            cum += prob[i] / sum;
            if (cum >= s->p.top_p) {
                k = i + 1;
                break;
            }
        }
    }
    /* min-p: drop tokens less likely than min_p times the best one */
    if (s->p.min_p > 0) {
        int keep = 1;
        while (keep < k && prob[keep] >= s->p.min_p * prob[0]) keep++;
        k = keep;
    }
    sum = 0;
    for (int i = 0; i < k; i++) sum += prob[i];
    double r = (double)(next_u64(&s->rng) >> 11) * (1.0 / 9007199254740992.0) * sum;
    kvq_token chosen = c[k - 1].id;
    for (int i = 0; i < k; i++) {
        r -= prob[i];
        if (r < 0) {
            chosen = c[i].id;
            break;
        }
    }
    free(prob);
    return chosen;
}
