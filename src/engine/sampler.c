/* Token sampling: repetition penalty, then top-k, top-p and min-p filters on the
 * temperature-scaled distribution (llama.cpp's order), then a seeded draw.
 * A step of a large model leaves the sampler 128K logits: it finds the few candidates
 * that can be drawn in one pass over them (sorting all of them took 13 ms a token,
 * selecting 40 by quickselect 0.65 ms, against a step of 2-3 ms on a GPU), and with
 * nothing truncated it draws over them in id order, unsorted. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/activation.h"
#include "kvq.h"

struct candidate {
    float logit;
    kvq_token id;
};

#define BLOCK 64 /* logits a pass skips or sums at once */

struct kvq_sampler {
    struct kvq_sampler_params p;
    int n_vocab;
    struct candidate *cand; /* the candidates that can be drawn, best first */
    float *prob, *work;     /* their weights; the logits after the penalty */
    double *block_sum;      /* with nothing truncated: the weights' sums by BLOCK ids */
    kvq_token *history; /* ring of the last repeat_last_n tokens */
    int n_history, history_pos;
    uint64_t rng;
    struct kvq_grammar *grammar; /* not owned */
    float *masked;               /* the logits with what the grammar forbids at -inf */
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
    s->prob = malloc(sizeof *s->prob * (size_t)n_vocab);
    s->work = malloc(sizeof *s->work * (size_t)n_vocab);
    s->block_sum = malloc(sizeof *s->block_sum * (size_t)(n_vocab / BLOCK + 1));
    s->history = malloc(sizeof *s->history * (size_t)(s->p.repeat_last_n + 1));
    if (!s->cand || !s->prob || !s->work || !s->block_sum || !s->history) goto oom;
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
    free(s->prob);
    free(s->work);
    free(s->block_sum);
    free(s->history);
    free(s->masked);
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

/* Best first; equal logits by id, so the order does not depend on how they were found. */
static int better_first(const void *a, const void *b) {
    const struct candidate *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Min-heap order: the root is the least (of equal logits, the latest id). */
static bool below(const struct candidate *x, const struct candidate *y) {
    return x->logit < y->logit || (x->logit == y->logit && x->id > y->id);
}

static void sift_down(struct candidate *h, int m, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, least = i;
        if (l < m && below(&h[l], &h[least])) least = l;
        if (r < m && below(&h[r], &h[least])) least = r;
        if (least == i) return;
        struct candidate t = h[i];
        h[i] = h[least];
        h[least] = t;
        i = least;
    }
}

/* The largest of x[0..BLOCK) above -inf (NaN never is): eight maxima side by side,
 * which the compiler keeps in vectors, so a pass over 128K logits skips whole blocks. */
static float block_max(const float *x) {
    float m[8];
    for (int j = 0; j < 8; j++) m[j] = -INFINITY;
    for (int i = 0; i < BLOCK; i += 8)
        for (int j = 0; j < 8; j++) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
    for (int w = 4; w > 0; w /= 2)
        for (int j = 0; j < w; j++) m[j] = m[j + w] > m[j] ? m[j + w] : m[j];
    return m[0];
}

/* The m largest of x[0..n) (0 < m <= n; of equal values the first ones) into c[0..m),
 * best first. One pass keeps them in a min-heap: a value enters only above its least,
 * and blocks with none above it are passed over (a few hundred of 128K random logits
 * enter a heap of 40). */
static void top_m(const float *x, int n, int m, struct candidate *c) {
    for (int i = 0; i < m; i++) c[i] = (struct candidate){x[i], i};
    for (int i = m / 2 - 1; i >= 0; i--) sift_down(c, m, i);
    float least = c[0].logit;
    for (int i = m; i < n; i++) {
        if (i % BLOCK == 0 && i + BLOCK <= n && !(block_max(x + i) > least)) {
            i += BLOCK - 1;
            continue;
        }
        if (!(x[i] > least)) continue;
        c[0] = (struct candidate){x[i], i};
        sift_down(c, m, 0);
        least = c[0].logit;
    }
    qsort(c, (size_t)m, sizeof *c, better_first);
}

/* The first of the largest, by the same pass (a running maximum through memory, as
 * greedy sampling had it, waited for each load: 0.46 ms over 128K logits). */
static kvq_token argmax(const float *x, int n) {
    struct candidate c;
    top_m(x, n, 1, &c);
    return c.id;
}

/* w[i] = e^((x[i] - max) / temp) in vectors (expf took 0.4 ms over 128K logits), the
 * sums of each BLOCK of them in bs (in floats, eight side by side), and their total. */
static double weights(const float *x, int n, float max, float temp, float *w, double *bs) {
    kern_exp_shifted(x, max, 1.0f / temp, w, n);
    double total = 0;
    for (int b = 0; b * BLOCK < n; b++) {
        const int e = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        float s[8] = {0};
        int i = b * BLOCK;
        for (; i + 8 <= e; i += 8)
            for (int j = 0; j < 8; j++) s[j] += w[i + j];
        for (; i < e; i++) s[0] += w[i];
        total += bs[b] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
    return total;
}

/* The id where r (0 <= r < the total) falls among the weights, a block at a time (one
 * subtraction after another over 128K weights took 60 us); none: fallback. */
static int draw_index(const float *w, const double *bs, int n, double r, int fallback) {
    for (int b = 0; b * BLOCK < n; b++) {
        if (r >= bs[b]) {
            r -= bs[b];
            continue;
        }
        const int e = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (int i = b * BLOCK; i < e; i++)
            if ((r -= w[i]) < 0) return i;
        r = 0; /* rounding left r past the block: the next id with a weight */
    }
    return fallback;
}

int kvq_sampler_set_grammar(struct kvq_sampler *s, struct kvq_grammar *g) {
    if (g && !s->masked && !(s->masked = malloc(sizeof *s->masked * (size_t)s->n_vocab)))
        return kvq_error("out of memory");
    s->grammar = g;
    return 0;
}

static kvq_token sample_logits(struct kvq_sampler *s, const float *logits);

kvq_token kvq_sampler_sample(struct kvq_sampler *s, const float *logits) {
    if (!s->grammar) return sample_logits(s, logits);
    memcpy(s->masked, logits, sizeof *s->masked * (size_t)s->n_vocab);
    kvq_grammar_apply(s->grammar, s->masked);
    const kvq_token t = sample_logits(s, s->masked);
    /* a draw among fewer allowed tokens than top-k keeps may land on a forbidden one
     * (weight 0) only by rounding: the best allowed one then */
    return s->masked[t] == -INFINITY ? argmax(s->masked, s->n_vocab) : t;
}

static kvq_token sample_logits(struct kvq_sampler *s, const float *logits) {
    const int n = s->n_vocab;
    const float *x = logits;
    if (s->p.repeat_penalty != 1.0f && s->n_history > 0) {
        memcpy(s->work, logits, sizeof *s->work * (size_t)n);
        for (int h = 0; h < s->n_history; h++) {
            kvq_token t = s->history[h];
            if (t < 0 || t >= n) continue;
            bool seen = false; /* penalize each token once */
            for (int j = 0; j < h; j++) seen |= s->history[j] == t;
            if (seen) continue;
            float *l = &s->work[t];
            *l = *l > 0 ? *l / s->p.repeat_penalty : *l * s->p.repeat_penalty;
        }
        x = s->work;
    }
    if (s->p.temp <= 0) return argmax(x, n);
    struct candidate *c = s->cand;
    float *prob = s->prob;
    const float temp = s->p.temp;
    int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    const bool cuts = s->p.top_p < 1.0f || s->p.min_p > 0;
    if (k == n && !cuts) { /* nothing truncated (OpenAI's default): a draw over all, in id order */
        const int best = argmax(x, n);
        const double sum = weights(x, n, x[best], temp, prob, s->block_sum);
        const double r = (double)(next_u64(&s->rng) >> 11) * (1.0 / 9007199254740992.0) * sum;
        return draw_index(prob, s->block_sum, n, r, best);
    }
    /* The candidates best first, k of them: the top k; without top-k, those up to where
     * top-p or min-p cuts (found by taking more until one does, then all), with their
     * weights against the best, and the sum over all the top-k candidates (without
     * top-k, over every logit). */
    double sum = 0;
    if (k < n) {
        top_m(x, n, k, c);
        for (int i = 0; i < k; i++) sum += prob[i] = expf((c[i].logit - c[0].logit) / temp);
    } else {
        const float maxl = x[argmax(x, n)];
        sum = weights(x, n, maxl, temp, prob, s->block_sum);
        /* a few thousand by the heap; beyond, all of them (then only sorted) */
        for (int m = n < 256 ? n : 256;; m = 4 * m > n / 8 ? n : 4 * m) {
            top_m(x, n, m, c);
            double cum = 0;
            bool cut = false;
            for (k = 0; k < m && !cut; k++) { /* the weights up to where a filter cuts */
                prob[k] = expf((c[k].logit - maxl) / temp);
                cum += prob[k] / sum;
                cut = (s->p.top_p < 1.0f && cum >= s->p.top_p) || (s->p.min_p > 0 && prob[k] < s->p.min_p * prob[0]);
            }
            if (cut || m == n) break;
        }
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
    return chosen;
}
