/* The sampler against a plain reading of its rules (llama.cpp's order): every logit a
 * candidate, penalty, all sorted best first (equal logits by id), top-k, top-p, min-p,
 * then the same seeded draw. With nothing truncated the sampler draws over the ids in
 * order, unsorted, by blocks: that draw is checked against the distribution instead. The
 * sampler takes shortcuts over large vocabularies (a heap of the top candidates, blocks of
 * logits passed over; without top-k, only the candidates down to where a histogram of the
 * weights puts the cut, sorted by their bits); each must pick exactly the reference's
 * token. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "check.h"
#include "draw_cases.h"
#include "engine/engine_internal.h"
#include "kvq.h"

struct cand {
    float logit;
    int id;
};

static int best_first(const void *a, const void *b) {
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The sampler's generator (a splitmix64 seeded with seed ^ the golden ratio). */
static uint64_t draw(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int reference(const struct kvq_sampler_params *p, const float *logits, int n, const int *hist, int n_hist,
                     uint64_t *rng) {
    struct cand *c = malloc(sizeof *c * (size_t)n);
    float *prob = malloc(sizeof *prob * (size_t)n);
    for (int i = 0; i < n; i++) c[i] = (struct cand){logits[i], i};
    if (p->repeat_penalty != 1.0f)
        for (int h = 0; h < n_hist; h++) {
            bool seen = false;
            for (int j = 0; j < h; j++) seen |= hist[j] == hist[h];
            if (seen) continue;
            float *l = &c[hist[h]].logit;
            *l = *l > 0 ? *l / p->repeat_penalty : *l * p->repeat_penalty;
        }
    int chosen;
    if (p->temp <= 0) {
        chosen = 0;
        for (int i = 1; i < n; i++)
            if (c[i].logit > c[chosen].logit) chosen = i;
    } else {
        qsort(c, (size_t)n, sizeof *c, best_first);
        int k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
        double sum = 0;
        for (int i = 0; i < k; i++) sum += prob[i] = expf((c[i].logit - c[0].logit) / p->temp);
        if (p->top_p < 1.0f) {
            double cum = 0;
            for (int i = 0; i < k; i++)
                if ((cum += prob[i] / sum) >= p->top_p) {
                    k = i + 1;
                    break;
                }
        }
        if (p->min_p > 0) {
            int keep = 1;
            while (keep < k && prob[keep] >= p->min_p * prob[0]) keep++;
            k = keep;
        }
        sum = 0;
        for (int i = 0; i < k; i++) sum += prob[i];
        double r = (double)(draw(rng) >> 11) * (1.0 / 9007199254740992.0) * sum;
        chosen = c[k - 1].id;
        for (int i = 0; i < k; i++)
            if ((r -= prob[i]) < 0) {
                chosen = c[i].id;
                break;
            }
    }
    free(c);
    free(prob);
    return chosen;
}

static uint64_t rs = 12345;
static double uniform(void) { return (double)(draw(&rs) >> 11) * (1.0 / 9007199254740992.0); }

/* Logits like a model's (a few strong candidates over a long tail), flat ones, or
 * rounded to 0.5 (many ties). */
static void make_logits(float *l, int n, int kind) {
    for (int i = 0; i < n; i++) {
        double g = uniform() + uniform() + uniform() - 1.5;
        l[i] = kind == 1 ? (float)(0.3 * g) : (float)(3.0 * g);
        if (kind == 2) l[i] = roundf(l[i] * 2) / 2;
    }
    if (kind == 0)
        for (int j = 0; j < 5; j++) l[(int)(uniform() * n)] += (float)(6 + 4 * uniform());
}

/* The first largest of l over the tokens not skipped. */
static int argmax_skip(const float *l, int n, const bool *skip) {
    int b = -1;
    for (int i = 0; i < n; i++)
        if (!skip[i] && (b < 0 || l[i] > l[b])) b = i;
    return b;
}

/* logit_bias, bans and OpenAI's frequency/presence penalties against the adjusted
 * logits computed here: greedy picks their argmax; at temperature 1 with nothing
 * truncated the draws follow their softmax. */
static void test_adjustments(void) {
    struct kvq_sampler_params p;
    kvq_sampler_params_default(&p);
    p.temp = 0;
    const int n = 5000;
    float *l = malloc(sizeof *l * n), *adj = malloc(sizeof *adj * n);
    bool *skip = calloc((size_t)n, sizeof *skip);
    make_logits(l, n, 0);
    struct kvq_sampler *s = kvq_sampler_new(&p, n);
    const int best = argmax_skip(l, n, skip);
    skip[best] = true;
    const int second = argmax_skip(l, n, skip);
    skip[second] = true;
    const int third = argmax_skip(l, n, skip);
    const kvq_token ids[2] = {best, second};
    const float minus100[2] = {-100, -100};
    CHECK(kvq_sampler_sample(s, l) == best, "greedy");
    CHECK(kvq_sampler_set_logit_bias(s, ids, minus100, 1) == 0 && kvq_sampler_sample(s, l) == second,
          "logit_bias -100 on the best gives the second");
    CHECK(kvq_sampler_set_logit_bias(s, NULL, NULL, 0) == 0 && kvq_sampler_ban(s, ids, 2) == 0 &&
              kvq_sampler_sample(s, l) == third, "banning the two best gives the third");
    const float plus[1] = {l[best] - l[third] + 0.5f};
    const kvq_token t3[1] = {third};
    CHECK(kvq_sampler_ban(s, NULL, 0) == 0 && kvq_sampler_set_logit_bias(s, t3, plus, 1) == 0 &&
              kvq_sampler_sample(s, l) == third, "a positive bias lifts the third above the best");
    const kvq_token bad[1] = {n};
    CHECK(kvq_sampler_set_logit_bias(s, bad, plus, 1) == -1 && kvq_sampler_ban(s, bad, 1) == -1,
          "an id outside the vocabulary is refused");
    kvq_sampler_set_logit_bias(s, NULL, NULL, 0);
    /* penalties: the prompt's tokens do not count; generated ones c times lose c f + p */
    const float f = 0.7f, pr = 0.4f;
    kvq_sampler_set_penalties(s, f, pr);
    kvq_sampler_accept(s, best);
    CHECK(kvq_sampler_sample(s, l) == best, "a prompt token is not penalized");
    int counts[3] = {0}, order[7] = {0, 0, 1, 2, 0, 1, 0};
    for (int step = 0; step < 7; step++) {
        const int t = ((const int[]){best, second, third})[order[step]];
        kvq_sampler_accept_output(s, t);
        counts[order[step]]++;
        memcpy(adj, l, sizeof *adj * n);
        for (int j = 0; j < 3; j++) {
            const int id = ((const int[]){best, second, third})[j];
            if (counts[j]) adj[id] -= (float)counts[j] * f + pr;
        }
        memset(skip, 0, (size_t)n * sizeof *skip);
        const int want = argmax_skip(adj, n, skip);
        CHECK(kvq_sampler_sample(s, l) == want, "penalties after %d tokens: %d", step + 1, want);
    }
    kvq_sampler_free(s);
    /* temperature 1, nothing truncated: token frequencies follow the softmax of the
     * adjusted logits (a bias of -1 on the best, +1.5 on the third, a ban on the second) */
    for (int i = 0; i < n; i++) l[i] = -20;
    l[10] = 1.0f, l[20] = 0.5f, l[30] = 0.0f, l[40] = -0.5f;
    p.temp = 1;
    p.top_k = 0, p.top_p = 1, p.min_p = 0;
    s = kvq_sampler_new(&p, n);
    const kvq_token bids[2] = {10, 30};
    const float bvals[2] = {-1.0f, 1.5f};
    const kvq_token ban20[1] = {20};
    kvq_sampler_set_logit_bias(s, bids, bvals, 2);
    kvq_sampler_ban(s, ban20, 1);
    const double w10 = exp(0.0), w30 = exp(1.5), w40 = exp(-0.5);
    double rest = (n - 4) * exp(-20.0), z = w10 + w30 + w40 + rest;
    int c10 = 0, c20 = 0, c30 = 0, c40 = 0;
    const int N = 40000;
    for (int t = 0; t < N; t++) {
        const int got = kvq_sampler_sample(s, l);
        c10 += got == 10, c20 += got == 20, c30 += got == 30, c40 += got == 40;
    }
    CHECK(c20 == 0, "a banned token is never drawn (%d)", c20);
    CHECK(fabs(c10 / (double)N - w10 / z) < 0.01 && fabs(c30 / (double)N - w30 / z) < 0.01 &&
              fabs(c40 / (double)N - w40 / z) < 0.01,
          "draws follow the biased softmax: %.4f %.4f %.4f vs %.4f %.4f %.4f", c10 / (double)N, c30 / (double)N,
          c40 / (double)N, w10 / z, w30 / z, w40 / z);
    /* bans alone take another path (no copy): the same check, and greedy around them */
    kvq_sampler_set_logit_bias(s, NULL, NULL, 0);
    const kvq_token ban2[3] = {20, 10, 20};
    kvq_sampler_ban(s, ban2, 3);
    const double u30 = exp(0.0), u40 = exp(-0.5);
    z = u30 + u40 + rest;
    c10 = c20 = c30 = c40 = 0;
    for (int t = 0; t < N; t++) {
        const int got = kvq_sampler_sample(s, l);
        c10 += got == 10, c20 += got == 20, c30 += got == 30, c40 += got == 40;
    }
    CHECK(c10 == 0 && c20 == 0 && fabs(c30 / (double)N - u30 / z) < 0.01 && fabs(c40 / (double)N - u40 / z) < 0.01,
          "bans alone: %d %d %.4f %.4f vs %.4f %.4f", c10, c20, c30 / (double)N, c40 / (double)N, u30 / z, u40 / z);
    kvq_sampler_free(s);
    p.temp = 0;
    s = kvq_sampler_new(&p, n);
    kvq_sampler_ban(s, ban2, 3);
    CHECK(kvq_sampler_sample(s, l) == 30, "greedy around bans");
    const kvq_token ban_all_but_one[4] = {10, 20, 30, 40};
    kvq_sampler_ban(s, ban_all_but_one, 4);
    CHECK(kvq_sampler_sample(s, l) == 0, "greedy: the first of the equal rest (%d)", kvq_sampler_sample(s, l));
    kvq_sampler_free(s);
    free(l), free(adj), free(skip);
}

/* A greedy draw from the KVQ_TOP_N largest logits (what a top_only batch keeps) is the
 * draw from the whole row, with 0-7 tokens banned among the best and with many ties;
 * anything that changes logits other than bans needs the whole row. */
static void test_from_top(void) {
    struct kvq_sampler_params p;
    kvq_sampler_params_default(&p);
    p.temp = 0;
    const int n = 32000;
    float *l = malloc(sizeof *l * n);
    bool *skip = calloc((size_t)n, sizeof *skip);
    int same = 0, tried = 0;
    for (int round = 0; round < 48; round++) {
        make_logits(l, n, round % 3);
        kvq_token top[KVQ_TOP_N];
        memset(skip, 0, sizeof *skip * n);
        for (int k = 0; k < KVQ_TOP_N; k++) skip[top[k] = argmax_skip(l, n, skip)] = true;
        struct kvq_sampler *s = kvq_sampler_new(&p, n);
        const int n_ban = round % KVQ_TOP_N;
        kvq_token ban[KVQ_TOP_N];
        for (int j = 0; j < n_ban; j++) ban[j] = top[(j * 3 + round) % KVQ_TOP_N]; /* repeats too */
        kvq_sampler_ban(s, ban, n_ban);
        CHECK(kvq_sampler_top_enough(s, KVQ_TOP_N), "greedy with %d bans draws from the largest", n_ban);
        tried++;
        same += kvq_sampler_sample_top(s, top, KVQ_TOP_N) == kvq_sampler_sample(s, l);
        kvq_sampler_free(s);
    }
    CHECK(same == tried, "the draw from the largest logits is the row's in %d of %d", same, tried);
    struct kvq_sampler *s = kvq_sampler_new(&p, n);
    CHECK(!kvq_sampler_top_enough(s, 0), "no largest logits: the whole row");
    kvq_sampler_ban(s, (kvq_token[]){1, 2, 3, 4, 5, 6, 7, 8}, 8);
    CHECK(!kvq_sampler_top_enough(s, KVQ_TOP_N), "8 bans: the whole row");
    kvq_sampler_ban(s, NULL, 0);
    kvq_sampler_set_logit_bias(s, (kvq_token[]){5}, (float[]){2}, 1);
    CHECK(!kvq_sampler_top_enough(s, KVQ_TOP_N), "a logit bias: the whole row");
    kvq_sampler_set_logit_bias(s, NULL, NULL, 0);
    kvq_sampler_set_penalties(s, 0.5f, 0);
    CHECK(kvq_sampler_top_enough(s, KVQ_TOP_N), "a frequency penalty before any output changes nothing");
    kvq_sampler_accept_output(s, 9);
    CHECK(!kvq_sampler_top_enough(s, KVQ_TOP_N), "a frequency penalty in effect: the whole row");
    kvq_sampler_free(s);
    p.repeat_penalty = 1.2f;
    s = kvq_sampler_new(&p, n);
    kvq_sampler_accept(s, 3);
    CHECK(!kvq_sampler_top_enough(s, KVQ_TOP_N), "a repetition penalty in effect: the whole row");
    kvq_sampler_free(s);
    p.repeat_penalty = 1;
    p.temp = 0.7f;
    s = kvq_sampler_new(&p, n);
    CHECK(!kvq_sampler_top_enough(s, KVQ_TOP_N), "temperature: the whole row");
    kvq_sampler_free(s);
    free(l);
    free(skip);
}

/* A BE_ROW_CUT row's results as the device leaves them, from the adjusted row x[n]: the
 * weights' total (the host's own, in double here) and the 1,024 largest, in reverse
 * order; whether they settle the cut, and then its draw in *got (else -1). */
static bool cut_from_candidates(struct kvq_sampler *s, const struct be_draw *d, const float *x, int n,
                                kvq_token *got) {
    struct cand *c = malloc(sizeof *c * (size_t)n);
    for (int i = 0; i < n; i++) c[i] = (struct cand){x[i], i};
    qsort(c, (size_t)n, sizeof *c, best_first);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += expf((x[i] - c[0].logit) * d->scale);
    float vals[BE_CUT_MAX];
    int32_t ids[BE_CUT_MAX], n_cand = BE_CUT_MAX < n ? BE_CUT_MAX : n;
    for (int i = 0; i < n_cand; i++) vals[i] = c[n_cand - 1 - i].logit, ids[i] = c[n_cand - 1 - i].id;
    free(c);
    const struct be_draw_out out = {.sum = &sum, .n_cand = &n_cand, .cand_vals = vals, .cand_ids = ids};
    *got = sampler_cut_settles(s, &out, 0) ? sampler_finish(s, d, &out, 0) : -1;
    return *got >= 0;
}

/* The device's share of a draw (sampler_plan, sampler_finish) made on the host: the
 * adjustments applied one after another as backend.h says, the largest of the row
 * then found, give kvq_sampler_sample's token from the row; and a draw the device
 * made leaves the sampler where the host's leaves it (the twins draw alike after). */
static void test_device_plan(void) {
    enum { V = 3001, ROUNDS = 40 };
    float *x = malloc(sizeof *x * V), *adj = malloc(sizeof *adj * V);
    int kinds[4] = {0}, aside = 0, differ = 0, draws = 0, cut_settled = 0;
    for (int k = 0; k < DRAW_CASES; k++) {
        struct kvq_sampler *dev = draw_case_new(k, V, 100 + (uint64_t)k), *host = draw_case_new(k, V, 100 + (uint64_t)k);
        struct be_draw_op *ops = NULL;
        for (int round = 0; round < ROUNDS && dev && host; round++) {
            const float scale = round % 2 ? 12.0f : 3.0f; /* peaked, flat */
            for (int i = 0; i < V; i++) x[i] = scale * (float)rand() / (float)RAND_MAX;
            draw_case_round(dev, k, x, V);
            draw_case_round(host, k, x, V);
            ops = realloc(ops, sizeof *ops * (size_t)(sampler_draw_ops_max(dev) + 1));
            struct be_draw d;
            const int n_ops = sampler_plan(dev, -1, &d, ops);
            CHECK(n_ops == d.n_ops && n_ops <= sampler_draw_ops_max(dev), "case %d: %d adjustments", k, n_ops);
            kinds[d.row]++;
            aside += d.bans_aside;
            const kvq_token want = kvq_sampler_sample(host, x);
            kvq_token got = -1;
            if (d.row == BE_ROW_LOGITS) {
                got = kvq_sampler_sample(dev, x);
            } else if (d.row == BE_ROW_DRAW) {
                const struct be_draw_out out = {.drawn = (int32_t[]){want}}; /* the device's token: the twin's */
                got = sampler_finish(dev, &d, &out, 0);
            } else {
                memcpy(adj, x, sizeof *adj * V);
                for (int j = 0; j < n_ops; j++) {
                    float *l = &adj[ops[j].id];
                    const float a = ops[j].a;
                    *l = ops[j].kind == BE_ADD      ? *l + a
                         : ops[j].kind == BE_REPEAT ? (*l > 0 ? *l / a : *l * a)
                         : ops[j].kind == BE_SUB    ? *l - a
                                                    : -INFINITY;
                }
                float vals[BE_TOP_MAX];
                kvq_token ids[BE_TOP_MAX];
                sampler_top(adj, V, BE_TOP_MAX, vals, ids);
                if (d.row == BE_ROW_CUT) {
                    cut_settled += cut_from_candidates(dev, &d, adj, V, &got);
                    if (got < 0) got = sampler_draw_adjusted(dev, adj); /* the row read back */
                } else {
                    got = sampler_finish(dev, &d, &(struct be_draw_out){.vals = vals, .ids = ids}, 0);
                }
            }
            differ += got != want;
            draws++;
            kvq_sampler_accept_output(dev, want);
            kvq_sampler_accept_output(host, want);
        }
        free(ops);
        kvq_sampler_free(dev);
        kvq_sampler_free(host);
    }
    /* log-probabilities of the row as the model made it: only where nothing adjusts it */
    struct kvq_sampler *s0 = draw_case_new(0, V, 1), *s1 = draw_case_new(1, V, 1), *s2 = draw_case_new(2, V, 1);
    draw_case_round(s1, 1, x, V);
    draw_case_round(s2, 2, x, V);
    struct be_draw d;
    struct be_draw_op ops[64];
    sampler_plan(s0, 5, &d, ops);
    CHECK(d.row == BE_ROW_DRAW && d.logprobs, "a draw over the row with log-probabilities stays on the device");
    sampler_plan(s0, BE_TOP_MAX + 1, &d, ops);
    CHECK(d.row == BE_ROW_LOGITS, "more log-probabilities than the device keeps: the row");
    sampler_plan(s1, 0, &d, ops);
    CHECK(d.row == BE_ROW_DRAW && d.bans_aside && d.logprobs, "bans set aside leave the row for log-probabilities");
    sampler_plan(s2, 0, &d, ops);
    CHECK(d.row == BE_ROW_LOGITS, "log-probabilities of a row that adjustments change: the row");
    struct kvq_sampler *s6 = draw_case_new(6, V, 1);
    sampler_plan(s6, 3, &d, ops);
    CHECK(d.row == BE_ROW_CUT && d.logprobs, "a top-p cut with log-probabilities stays on the device");
    kvq_sampler_free(s6);
    kvq_sampler_free(s0), kvq_sampler_free(s1), kvq_sampler_free(s2);
    printf("draws planned for a device: %d on the host's row, %d from the largest, %d over the row (%d with bans "
           "aside), %d cut (%d from candidates): %d of %d differ from the row's\n",
           kinds[BE_ROW_LOGITS], kinds[BE_ROW_TOP], kinds[BE_ROW_DRAW], aside, kinds[BE_ROW_CUT], cut_settled, differ,
           draws);
    CHECK(differ == 0, "%d of %d draws differ from kvq_sampler_sample's", differ, draws);
    CHECK(cut_settled > 0 && cut_settled < kinds[BE_ROW_CUT], "cuts settled from candidates (%d of %d) and not",
          cut_settled, kinds[BE_ROW_CUT]);
    CHECK(kinds[BE_ROW_LOGITS] == 2 * ROUNDS && kinds[BE_ROW_TOP] == 4 * ROUNDS && kinds[BE_ROW_DRAW] == 3 * ROUNDS &&
              kinds[BE_ROW_CUT] == 4 * ROUNDS &&
              aside == 2 * ROUNDS,
          "each case settled as planned");
    free(x);
    free(adj);
}

int main(void) {
    test_adjustments();
    test_from_top();
    test_device_plan();
    const int sizes[] = {97, 512, 32000, 128256};
    const struct kvq_sampler_params configs[] = {
        /* temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed */
        {0, 40, 0.95f, 0.05f, 1.0f, 64, 1},       {0, 40, 0.95f, 0.05f, 1.3f, 64, 2},
        {0.8f, 40, 0.95f, 0.05f, 1.0f, 64, 3},    {0.8f, 40, 0.95f, 0.05f, 1.3f, 64, 4},
        {1.3f, 1, 1.0f, 0.0f, 1.0f, 64, 5},       {1.0f, 1000, 0.9f, 0.0f, 1.0f, 64, 6},
        {0.7f, 0, 0.9f, 0.0f, 1.0f, 64, 7},       {0.7f, 0, 1.0f, 0.05f, 1.1f, 64, 8},
        {0.5f, 0, 0.5f, 0.1f, 1.0f, 64, 10},
        {1.0f, 200000, 0.95f, 0.0f, 1.0f, 64, 11},
    };
    int hist[64];
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int n = sizes[si];
        float *l = malloc(sizeof *l * (size_t)n);
        for (size_t ci = 0; ci < sizeof configs / sizeof configs[0]; ci++) {
            const struct kvq_sampler_params *p = &configs[ci];
            for (int kind = 0; kind < 3; kind++) {
                struct kvq_sampler *s = kvq_sampler_new(p, n);
                CHECK(s != NULL, "sampler: %s", kvq_last_error());
                if (!s) continue;
                uint64_t rng = p->seed ^ 0x9e3779b97f4a7c15ull;
                int n_hist = 0, same = 0, steps = n > 32000 ? 4 : 12;
                for (int t = 0; t < steps; t++) {
                    make_logits(l, n, kind);
                    const int got = kvq_sampler_sample(s, l);
                    const int want = reference(p, l, n, hist, n_hist, &rng);
                    same += got == want;
                    if (n_hist < 64) hist[n_hist++] = want; /* the history the sampler keeps */
                    kvq_sampler_accept(s, want);
                    /* a repeated token, penalized once */
                    if (t == 2 && n_hist < 64) hist[n_hist++] = want, kvq_sampler_accept(s, want);
                }
                CHECK(same == steps, "vocabulary %d, config %zu, logits %d: %d of %d draws as the reference", n, ci,
                      kind, same, steps);
                kvq_sampler_free(s);
            }
        }
        free(l);
    }
    /* nothing truncated: four tokens in different blocks of 64 with probabilities 0.4,
     * 0.3, 0.2 and 0.1 (the rest e^-30 below), at temperature 1 and 2 (p^(1/2),
     * renormalized); 40000 draws each within 0.01 (4 standard deviations) */
    {
        const int n = 300, ids[4] = {3, 70, 130, 299};
        const double p[4] = {0.4, 0.3, 0.2, 0.1};
        float *l = malloc(sizeof *l * (size_t)n);
        for (int i = 0; i < n; i++) l[i] = -30;
        for (int j = 0; j < 4; j++) l[ids[j]] = (float)log(p[j]);
        for (int ti = 0; ti < 2; ti++) {
            struct kvq_sampler_params sp = {ti ? 2.0f : 1.0f, 0, 1.0f, 0.0f, 1.0f, 64, 77};
            struct kvq_sampler *s = kvq_sampler_new(&sp, n);
            int count[4] = {0}, other = 0;
            for (int t = 0; t < 40000; t++) {
                const int got = kvq_sampler_sample(s, l);
                int j = 0;
                while (j < 4 && ids[j] != got) j++;
                if (j < 4) count[j]++;
                else other++;
            }
            double z = 0;
            for (int j = 0; j < 4; j++) z += pow(p[j], 1.0 / sp.temp);
            for (int j = 0; j < 4; j++) {
                const double want = pow(p[j], 1.0 / sp.temp) / z, got = count[j] / 40000.0;
                CHECK(fabs(got - want) < 0.01, "temperature %g: token %d drawn %.4f of the time, not %.4f", sp.temp,
                      ids[j], got, want);
            }
            CHECK(other < 20, "temperature %g: %d draws of negligible tokens", sp.temp, other);
            kvq_sampler_free(s);
        }
        free(l);
    }
    /* greedy: the first of equal maxima, a NaN never chosen, a maximum in the last block */
    {
        struct kvq_sampler_params p;
        kvq_sampler_params_default(&p);
        p.temp = 0;
        const int n = 1000;
        float *l = calloc((size_t)n, sizeof *l);
        struct kvq_sampler *s = kvq_sampler_new(&p, n);
        l[700] = l[300] = 2.0f;
        l[5] = NAN;
        CHECK(kvq_sampler_sample(s, l) == 300, "the first of equal maxima");
        l[999] = 2.5f;
        CHECK(kvq_sampler_sample(s, l) == 999, "a maximum in the last values");
        l[0] = NAN;
        CHECK(kvq_sampler_sample(s, l) == 0, "a NaN first is kept, as a plain scan keeps it");
        kvq_sampler_free(s);
        free(l);
    }
    return check_finish();
}
