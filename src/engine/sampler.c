/* Token sampling: logit bias, repetition, frequency and presence penalties and banned
 * tokens on a copy of the logits, then top-k, top-p and min-p filters on the
 * temperature-scaled distribution (llama.cpp's order), then a seeded draw.
 * A step of a large model leaves the sampler 128K logits: it finds the few candidates
 * that can be drawn in one pass over them (sorting all of them took 13 ms a token,
 * selecting 40 by quickselect 0.65 ms, against a step of 2-3 ms on a GPU), and with
 * nothing truncated it draws over them in id order, unsorted. */
#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/engine_internal.h"
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
    /* OpenAI's penalties: counts[id] of the generated tokens, the distinct ones in `seen` */
    float frequency, presence;
    int *counts;
    kvq_token *seen;
    int n_seen;
    kvq_token *bias_ids, *banned;
    float *bias;
    int n_bias, n_banned;
    struct kvq_grammar *grammar; /* not owned */
    float *masked;               /* the logits with what the grammar forbids at -inf */
    int cut_k; /* sampler_cut_settles: the draw is among cand[0..cut_k), weights in prob (top-k: made later) */
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
    kvq_error_code(KVQ_ERR_OOM, "out of memory");
    return NULL;
}

void kvq_sampler_free(struct kvq_sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s->prob);
    free(s->work);
    free(s->block_sum);
    free(s->history);
    free(s->counts);
    free(s->seen);
    free(s->bias_ids);
    free(s->bias);
    free(s->banned);
    free(s->masked);
    free(s);
}

void kvq_sampler_accept(struct kvq_sampler *s, kvq_token t) {
    if (s->p.repeat_last_n == 0) return;
    s->history[s->history_pos] = t;
    s->history_pos = (s->history_pos + 1) % s->p.repeat_last_n;
    if (s->n_history < s->p.repeat_last_n) s->n_history++;
}

void kvq_sampler_accept_output(struct kvq_sampler *s, kvq_token t) {
    kvq_sampler_accept(s, t);
    /* the counts (two vocabulary-sized arrays) only where a penalty reads them */
    if (t < 0 || t >= s->n_vocab || (s->frequency == 0 && s->presence == 0)) return;
    if (!s->counts) {
        s->counts = calloc((size_t)s->n_vocab, sizeof *s->counts);
        s->seen = malloc(sizeof *s->seen * (size_t)s->n_vocab);
        if (!s->counts || !s->seen) {
            free(s->counts);
            free(s->seen);
            s->counts = NULL, s->seen = NULL;
            return;
        }
    }
    if (s->counts[t]++ == 0) s->seen[s->n_seen++] = t;
}

void kvq_sampler_set_penalties(struct kvq_sampler *s, float frequency, float presence) {
    s->frequency = frequency;
    s->presence = presence;
}

/* Copies n ids (checked against the vocabulary) into *dst. */
static int copy_ids(const struct kvq_sampler *s, const kvq_token *ids, int n, kvq_token **dst) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->n_vocab)
            return kvq_error("token id %d is outside the vocabulary (0..%d)", ids[i], s->n_vocab - 1);
    kvq_token *d = n > 0 ? malloc(sizeof *d * (size_t)n) : NULL;
    if (n > 0 && !d) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    if (n > 0) memcpy(d, ids, sizeof *d * (size_t)n);
    free(*dst);
    *dst = d;
    return 0;
}

int kvq_sampler_set_logit_bias(struct kvq_sampler *s, const kvq_token *ids, const float *bias, int n) {
    float *b = n > 0 ? malloc(sizeof *b * (size_t)n) : NULL;
    if (n > 0 && !b) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    if (copy_ids(s, ids, n, &s->bias_ids) != 0) {
        free(b);
        return -1;
    }
    if (n > 0) memcpy(b, bias, sizeof *b * (size_t)n);
    free(s->bias);
    s->bias = b;
    s->n_bias = n;
    return 0;
}

int kvq_sampler_ban(struct kvq_sampler *s, const kvq_token *ids, int n) {
    if (copy_ids(s, ids, n, &s->banned) != 0) return -1;
    s->n_banned = n;
    return 0;
}

static bool repeat_in_effect(const struct kvq_sampler *s) { return s->p.repeat_penalty != 1.0f && s->n_history > 0; }
static bool openai_in_effect(const struct kvq_sampler *s) {
    return (s->frequency != 0 || s->presence != 0) && s->n_seen > 0;
}

/* What OpenAI's penalties take from token t's logit (one expression for the host's
 * adjustment and the device's, so both round alike). */
static float openai_penalty(const struct kvq_sampler *s, kvq_token t) {
    return (float)s->counts[t] * s->frequency + s->presence;
}

/* Whether history entry h repeats an earlier one (the penalty applies once a token). */
static bool repeated_before(const struct kvq_sampler *s, int h) {
    for (int j = 0; j < h; j++)
        if (s->history[j] == s->history[h]) return true;
    return false;
}

/* The logits with bias, penalties and bans applied (in s->work), or logits as they are
 * when none applies. */
static const float *adjust(struct kvq_sampler *s, const float *logits) {
    const int n = s->n_vocab;
    const bool repeat = repeat_in_effect(s), openai = openai_in_effect(s);
    if (!repeat && !openai && s->n_bias == 0 && s->n_banned == 0) return logits;
    memcpy(s->work, logits, sizeof *s->work * (size_t)n);
    for (int i = 0; i < s->n_bias; i++) s->work[s->bias_ids[i]] += s->bias[i];
    if (repeat) {
        for (int h = 0; h < s->n_history; h++) {
            kvq_token t = s->history[h];
            if (t < 0 || t >= n || repeated_before(s, h)) continue;
            float *l = &s->work[t];
            *l = *l > 0 ? *l / s->p.repeat_penalty : *l * s->p.repeat_penalty;
        }
    }
    if (openai)
        for (int i = 0; i < s->n_seen; i++) s->work[s->seen[i]] -= openai_penalty(s, s->seen[i]);
    for (int i = 0; i < s->n_banned; i++) s->work[s->banned[i]] = -INFINITY;
    return s->work;
}

/* splitmix64: small, fast, good enough for sampling. */
static uint64_t next_u64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* In [0, 1), of 53 random bits. */
static double uniform(uint64_t *state) { return (double)(next_u64(state) >> 11) * (1.0 / 9007199254740992.0); }

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

void sampler_top(const float *x, int n, int k, float *vals, kvq_token *ids) {
    struct candidate c[KVQ_TOP_N];
    assert(k > 0 && k <= KVQ_TOP_N && k <= n);
    top_m(x, n, k, c);
    for (int i = 0; i < k; i++) vals[i] = c[i].logit, ids[i] = c[i].id;
}

bool kvq_sampler_top_enough(const struct kvq_sampler *s, int k) {
    return s->p.temp <= 0 && !s->grammar && s->n_bias == 0 && !repeat_in_effect(s) && !openai_in_effect(s) &&
           s->n_banned < k;
}

/* As argmax_allowed picks from the n_banned + 1 largest, and argmax with no bans. */
kvq_token kvq_sampler_sample_top(struct kvq_sampler *s, const kvq_token *ids, int k) {
    assert(kvq_sampler_top_enough(s, k));
    for (int i = 0; i <= s->n_banned && i < k; i++) {
        bool banned = false;
        for (int j = 0; j < s->n_banned && !banned; j++) banned = s->banned[j] == ids[i];
        if (!banned) return ids[i];
    }
    return ids[0]; /* everything is banned */
}

/* The first largest logit that is not banned (of the n_banned + 1 largest). */
static kvq_token argmax_allowed(struct kvq_sampler *s, const float *x, int n) {
    const int m = s->n_banned < n ? s->n_banned + 1 : n;
    top_m(x, n, m, s->cand);
    for (int i = 0; i < m; i++) {
        bool banned = false;
        for (int j = 0; j < s->n_banned && !banned; j++) banned = s->banned[j] == s->cand[i].id;
        if (!banned) return s->cand[i].id;
    }
    return s->cand[0].id; /* everything is banned */
}

/* Takes the banned tokens' weights out of w and their blocks' sums; returns their total. */
static double drop_banned(struct kvq_sampler *s, float *w) {
    double dropped = 0;
    for (int j = 0; j < s->n_banned; j++) {
        const kvq_token t = s->banned[j];
        s->block_sum[t / BLOCK] -= w[t];
        dropped += w[t];
        w[t] = 0; /* a repeated id then drops nothing more */
    }
    return dropped;
}

int kvq_sampler_set_grammar(struct kvq_sampler *s, struct kvq_grammar *g) {
    if (g && !s->masked && !(s->masked = malloc(sizeof *s->masked * (size_t)s->n_vocab)))
        return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    s->grammar = g;
    return 0;
}

static kvq_token sample_logits(struct kvq_sampler *s, const float *logits);

/* Bans are all that applies to the next draw, and it needs no copy of the logits:
 * greedy, or (whole) a draw over the whole row. */
static bool only_bans(const struct kvq_sampler *s, bool whole) {
    return s->n_banned > 0 && s->n_bias == 0 && !repeat_in_effect(s) && !openai_in_effect(s) &&
           (s->p.temp <= 0 || whole);
}

kvq_token kvq_sampler_sample(struct kvq_sampler *s, const float *logits) {
    if (!s->grammar) return sample_logits(s, logits);
    /* bias, penalties and bans apply to the masked logits (the bans-only path draws
     * from them as they are): a forbidden token stays at -inf whatever else applies */
    memcpy(s->masked, logits, sizeof *s->masked * (size_t)s->n_vocab);
    kvq_grammar_apply(s->grammar, s->masked);
    const kvq_token t = sample_logits(s, s->masked);
    /* a draw among fewer allowed tokens than top-k keeps may land on a forbidden one
     * (weight 0) only by rounding: the best allowed one then */
    return s->masked[t] == -INFINITY ? argmax(s->masked, s->n_vocab) : t;
}

static kvq_token cut_and_draw(struct kvq_sampler *s, const struct candidate *c, float *prob, int k, double sum);

/* The draw among the top k (< the vocabulary) candidates, best first. */
static kvq_token draw_top_k(struct kvq_sampler *s, const struct candidate *c, int k) {
    double sum = 0;
    for (int i = 0; i < k; i++) sum += s->prob[i] = expf((c[i].logit - c[0].logit) / s->p.temp);
    return cut_and_draw(s, c, s->prob, k, sum);
}

static kvq_token draw_from(struct kvq_sampler *s, const float *x, bool bans_only);

static kvq_token sample_logits(struct kvq_sampler *s, const float *logits) {
    const int n = s->n_vocab, k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    const bool cuts = s->p.top_p < 1.0f || s->p.min_p > 0;
    /* bans alone (ignore_eos, min_tokens) need no copy of the logits where nothing is
     * truncated: greedy takes the best allowed token, a draw gives banned ones no weight
     * (a copy of 128K logits cost about what a greedy draw does) */
    const bool bans_only = only_bans(s, k == n && !cuts);
    return draw_from(s, bans_only ? logits : adjust(s, logits), bans_only);
}

/* Where top-p or min-p cuts the candidates c[0..m) (best first, c[0] the row's largest)
 * with weights against sum over the whole row: how many to draw among, their weights in
 * prob; -1 where neither cuts within them. */
static int cut_point(const struct kvq_sampler *s, const struct candidate *c, int m, double sum, float *prob) {
    double cum = 0;
    for (int k = 0; k < m; k++) {
        prob[k] = expf((c[k].logit - c[0].logit) / s->p.temp);
        cum += prob[k] / sum;
        if ((s->p.top_p < 1.0f && cum >= s->p.top_p) || (s->p.min_p > 0 && prob[k] < s->p.min_p * prob[0]))
            return k + 1;
    }
    return -1;
}

/* A logit's bits as a key that orders best first (-0 as +0, so equal logits tie). */
static uint32_t best_first_key(float logit) {
    uint32_t u;
    memcpy(&u, &logit, sizeof u);
    if (u == 0x80000000u) u = 0;
    return (u & 0x80000000u) ? u : ~(u | 0x80000000u);
}

/* c[0..m), in id order, best first as better_first orders them: four stable passes of
 * a byte of the key each, so equal logits keep their id order (qsort of 100K
 * candidates took about 15 ms). tmp: room for m more. */
static void sort_best_first(struct candidate *c, struct candidate *tmp, int m) {
    for (int shift = 0; shift < 32; shift += 8) {
        int at[257] = {0};
        for (int i = 0; i < m; i++) at[(best_first_key(c[i].logit) >> shift & 255) + 1]++;
        for (int d = 0; d < 256; d++) at[d + 1] += at[d];
        for (int i = 0; i < m; i++) tmp[at[best_first_key(c[i].logit) >> shift & 255]++] = c[i];
        struct candidate *t = c;
        c = tmp, tmp = t;
    }
}

#define CUT_BUCKETS 1024
#define CUT_RANGE 40.0f /* weights below e^-40 of the best are not counted */

/* Without top-k: the candidates down to a point the cut surely lies above, best first
 * in c, found from a histogram of the weights by exponent (prob: the weights by id,
 * sum their total) rather than by sorting the row: where it first holds top_p of the
 * total and a thousandth more, or where min-p cuts with a margin for expf, whichever
 * comes first (*all_kept: min-p's, so they are every token min-p keeps). How many; 0
 * where neither point is within the histogram. */
static int cut_prefix(struct kvq_sampler *s, const float *x, int n, float max, double sum, bool *all_kept) {
    const float per = CUT_BUCKETS / CUT_RANGE / s->p.temp; /* buckets an exponent's unit */
    double w[CUT_BUCKETS + 1] = {0}; /* and the rest, past the range, in the last */
    for (int i = 0; i < n; i++) {
        const float v = (max - x[i]) * per;
        w[v < CUT_BUCKETS ? (int)v : CUT_BUCKETS] += s->prob[i]; /* no branch: half of a peaked row's fall past */
    }
    int last = CUT_BUCKETS, m = 0;
    double acc = 0;
    for (int b = 0; b < CUT_BUCKETS && s->p.top_p < 1.0f && last == CUT_BUCKETS; b++)
        if ((acc += w[b]) >= (double)s->p.top_p * sum * 1.001) last = b;
    const float min_p_at = s->p.min_p > 0 ? (-logf(s->p.min_p) * 1.0001f + 1e-4f) * (CUT_BUCKETS / CUT_RANGE) : INFINITY;
    *all_kept = min_p_at < (float)last;
    if (*all_kept) last = (int)min_p_at;
    if (last >= CUT_BUCKETS) return 0;
    struct candidate *c = s->cand;
    for (int i = 0; i < n; i++)
        if ((max - x[i]) * per < (float)(last + 1)) c[m++] = (struct candidate){x[i], i};
    struct candidate *tmp = m > 1024 ? malloc(sizeof *tmp * (size_t)m) : NULL;
    if (tmp) sort_best_first(c, tmp, m);
    else qsort(c, (size_t)m, sizeof *c, better_first);
    free(tmp);
    return m;
}

/* The draw from x, the logits with the sampler's adjustments applied (bans_only: with
 * its bans alone, not applied). */
static kvq_token draw_from(struct kvq_sampler *s, const float *x, bool bans_only) {
    const int n = s->n_vocab;
    int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    const bool cuts = s->p.top_p < 1.0f || s->p.min_p > 0;
    if (s->p.temp <= 0) return bans_only ? argmax_allowed(s, x, n) : argmax(x, n);
    struct candidate *c = s->cand;
    float *prob = s->prob;
    const float temp = s->p.temp;
    if (k == n && !cuts) { /* nothing truncated (OpenAI's default): a draw over all, in id order */
        const int best = bans_only ? argmax_allowed(s, x, n) : argmax(x, n);
        double sum = weights(x, n, x[best], temp, prob, s->block_sum);
        if (bans_only) sum -= drop_banned(s, prob);
        const double r = uniform(&s->rng) * sum;
        return draw_index(prob, s->block_sum, n, r, best);
    }
    /* The candidates best first, k of them: the top k; without top-k, those up to where
     * top-p or min-p cuts (found by taking more until one does, then all), with their
     * weights against the best, and the sum over all the top-k candidates (without
     * top-k, over every logit). */
    if (k < n) {
        top_m(x, n, k, c);
        return draw_top_k(s, c, k);
    }
    const float max = x[argmax(x, n)];
    const double sum = weights(x, n, max, temp, prob, s->block_sum);
    /* a peaked row's cut lies among its few largest, which the heap finds fastest */
    float first[256];
    const int m0 = n < 256 ? n : 256;
    top_m(x, n, m0, c);
    if ((k = cut_point(s, c, m0, sum, first)) > 0 || m0 == n) {
        memcpy(prob, first, sizeof *prob * (size_t)(k > 0 ? k : n));
        return cut_and_draw(s, c, prob, k > 0 ? k : n, sum);
    }
    bool all_kept;
    const int m = cut_prefix(s, x, n, max, sum, &all_kept);
    if (m > 0 && ((k = cut_point(s, c, m, sum, prob)) > 0 || all_kept)) return cut_and_draw(s, c, prob, k > 0 ? k : m, sum);
    top_m(x, n, n, c); /* no point found (top_p within a thousandth of 1): all of them */
    k = cut_point(s, c, n, sum, prob);
    return cut_and_draw(s, c, prob, k > 0 ? k : n, sum);
}

/* The draw among candidates c[0..k), best first, of weights prob against a total of
 * sum: top-p and min-p cut them first. */
static kvq_token cut_and_draw(struct kvq_sampler *s, const struct candidate *c, float *prob, int k, double sum) {
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
    double r = uniform(&s->rng) * sum;
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

/* ---- draws settled where the logits are (a GPU's), engine_internal.h ---- */

int sampler_draw_ops_max(const struct kvq_sampler *s) {
    return s->n_bias + (repeat_in_effect(s) ? s->n_history : 0) + (openai_in_effect(s) ? s->n_seen : 0) + s->n_banned;
}

int sampler_plan(const struct kvq_sampler *s, int logprobs, struct be_draw *d, struct be_draw_op *ops) {
    const int n = s->n_vocab, k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    const bool cuts = s->p.top_p < 1.0f || s->p.min_p > 0, whole = k == n && !cuts;
    *d = (struct be_draw){.row = BE_ROW_LOGITS};
    if (s->grammar || n < BE_TOP_MAX || logprobs > BE_TOP_MAX) return 0;
    if (s->p.temp <= 0 || (k < n && k <= BE_TOP_MAX)) d->row = BE_ROW_TOP; /* drawn from those: sampler_finish */
    else if ((k == n || k <= BE_CUT_MAX) && n <= BE_DRAW_MAX_COLS) d->row = whole ? BE_ROW_DRAW : BE_ROW_CUT;
    else return 0;
    /* bans alone stay out of the logits where the best allowed is among the largest */
    d->bans_aside = only_bans(s, whole) && s->n_banned < BE_TOP_MAX;
    const bool adjusted = s->n_bias > 0 || repeat_in_effect(s) || openai_in_effect(s) ||
                          (s->n_banned > 0 && !d->bans_aside);
    if ((d->row == BE_ROW_DRAW && only_bans(s, whole) && !d->bans_aside) || (logprobs >= 0 && adjusted)) {
        *d = (struct be_draw){.row = BE_ROW_LOGITS}; /* the draw, or the log-probabilities, need the row as it is */
        return 0;
    }
    d->logprobs = logprobs >= 0;
    if (d->row == BE_ROW_DRAW || d->row == BE_ROW_CUT) d->scale = 1.0f / s->p.temp;
    if (d->row == BE_ROW_DRAW) {
        uint64_t rng = s->rng; /* sampler_finish takes it */
        d->u = uniform(&rng);
    }
    d->top_p = s->p.top_p;
    d->min_p = s->p.min_p;
    if (d->row == BE_ROW_CUT && k < n) d->top_k = k;
    /* adjust's order: the device applies them one after another */
    int m = 0;
    if (!d->bans_aside) {
        for (int i = 0; i < s->n_bias; i++) ops[m++] = (struct be_draw_op){s->bias_ids[i], BE_ADD, s->bias[i]};
        for (int h = 0; repeat_in_effect(s) && h < s->n_history; h++)
            if (s->history[h] >= 0 && s->history[h] < n && !repeated_before(s, h))
                ops[m++] = (struct be_draw_op){s->history[h], BE_REPEAT, s->p.repeat_penalty};
        for (int i = 0; openai_in_effect(s) && i < s->n_seen; i++)
            ops[m++] = (struct be_draw_op){s->seen[i], BE_SUB, openai_penalty(s, s->seen[i])};
    }
    for (int i = 0; i < s->n_banned; i++) ops[m++] = (struct be_draw_op){s->banned[i], BE_BAN, 0};
    d->n_ops = m;
    return m;
}

/* A BE_ROW_CUT row's candidates into s->cand, best first; how many. */
static int cut_candidates(struct kvq_sampler *s, const struct be_draw_out *out, int r) {
    const int m = be_cut_count(out, r);
    for (int i = 0; i < m; i++) {
        const size_t at = (size_t)r * BE_CUT_MAX + (size_t)i;
        s->cand[i] = (struct candidate){out->cand_vals[at], out->cand_ids[at]};
    }
    qsort(s->cand, (size_t)m, sizeof *s->cand, better_first);
    return m;
}

bool sampler_cut_settles(struct kvq_sampler *s, const struct be_draw_out *out, int r) {
    s->cut_k = 0;
    const int m = cut_candidates(s, out, r), top_k = s->p.top_k;
    if (top_k > 0 && top_k < s->n_vocab) { /* the top k among them, as top_m finds them */
        s->cut_k = m >= top_k ? top_k : 0;
        return s->cut_k > 0;
    }
    const int k = m > 0 ? cut_point(s, s->cand, m, out->sum[r], s->prob) : 0;
    /* the cut among them, or (BE_CUT_ALL) they are every token min-p keeps */
    if (k > 0 || (m > 0 && (out->n_cand[r] & BE_CUT_ALL))) s->cut_k = k > 0 ? k : m;
    return s->cut_k > 0;
}

kvq_token sampler_draw_adjusted(struct kvq_sampler *s, const float *x) { return draw_from(s, x, false); }

kvq_token sampler_finish(struct kvq_sampler *s, const struct be_draw *d, const struct be_draw_out *out, int r) {
    if (d->row == BE_ROW_DRAW) {
        next_u64(&s->rng); /* the uniform sampler_plan read */
        return out->drawn[r];
    }
    if (d->row == BE_ROW_CUT) { /* from what sampler_cut_settles left */
        assert(s->cut_k > 0);
        const int k = s->cut_k;
        s->cut_k = 0;
        return d->top_k ? draw_top_k(s, s->cand, k) : cut_and_draw(s, s->cand, s->prob, k, out->sum[r]);
    }
    assert(d->row == BE_ROW_TOP);
    const float *vals = out->vals + (size_t)r * BE_TOP_MAX;
    const kvq_token *ids = out->ids + (size_t)r * BE_TOP_MAX;
    if (s->p.temp <= 0) return d->bans_aside ? kvq_sampler_sample_top(s, ids, BE_TOP_MAX) : ids[0];
    const int k = s->p.top_k;
    assert(k > 0 && k <= BE_TOP_MAX);
    for (int i = 0; i < k; i++) s->cand[i] = (struct candidate){vals[i], ids[i]};
    return draw_top_k(s, s->cand, k);
}
