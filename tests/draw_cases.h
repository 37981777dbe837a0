/* Sampler settings that reach each way sampler_plan settles a draw where the logits
 * are (a draw over the whole row, with bans aside or with adjustments; a draw from
 * the largest logits; a top-k, top-p or min-p cut from candidates; the row read by
 * the host), for tests that draw with twins: two samplers made and fed alike, one
 * drawing through the plan, one from the row. */
#ifndef KVQ_TESTS_DRAW_CASES_H
#define KVQ_TESTS_DRAW_CASES_H

#include "kvq.h"

#define DRAW_CASES 13

static inline struct kvq_sampler *draw_case_new(int k, int n_vocab, uint64_t seed) {
    struct kvq_sampler_params p;
    kvq_sampler_params_default(&p);
    p.temp = 1, p.top_k = 0, p.top_p = 1, p.min_p = 0, p.repeat_penalty = 1, p.seed = seed;
    if (k == 1) p.temp = 0.7f;                                  /* bans alone */
    if (k == 2) p.temp = 1.3f, p.repeat_penalty = 1.1f;         /* every adjustment */
    if (k == 3) p.temp = 0.8f, p.top_k = 5, p.top_p = 0.9f, p.min_p = 0.05f, p.repeat_penalty = 1.2f;
    if (k == 4 || k == 5 || k == 9) p.temp = 0;                  /* greedy: bans; adjustments; none */
    if (k == 5) p.repeat_penalty = 1.3f;
    if (k == 6) p.top_p = 0.9f;                                  /* cuts */
    if (k == 10) p.temp = 0.8f, p.min_p = 0.1f;
    if (k == 11) p.temp = 1.1f, p.top_p = 0.95f, p.min_p = 0.02f, p.repeat_penalty = 1.1f;
    if (k == 7) p.temp = 0.9f, p.top_k = 40;                     /* top-k past the largest */
    if (k == 12) p.temp = 0.9f, p.top_k = 1500;                  /* the row on the host (of 3001 ids) */
    struct kvq_sampler *s = kvq_sampler_new(&p, n_vocab);
    if (!s) return NULL;
    const kvq_token hist[] = {20, 21, 20, 22}, bias_ids[] = {10, 11, 20};
    for (int i = 0; i < 4; i++) kvq_sampler_accept(s, hist[i]);
    if (k == 2 || k == 5) kvq_sampler_set_logit_bias(s, bias_ids, (const float[]){5.0f, -3.0f, 1.5f}, 3);
    if (k == 2) kvq_sampler_set_penalties(s, 0.5f, 0.3f);
    return s;
}

/* Before each draw: bans of the row's best token (x given: the row) and two more
 * (cases 1, 2, 4), or of nine tokens (case 8: too many to set aside). */
static inline void draw_case_round(struct kvq_sampler *s, int k, const float *x, int n_vocab) {
    kvq_token ban[9] = {0, 3, 7, 8, 9, 12, 13, 14, 15};
    for (int i = 1; x && i < n_vocab; i++)
        if (x[i] > x[ban[0]]) ban[0] = i;
    if (k == 1 || k == 2 || k == 4) kvq_sampler_ban(s, ban, 3);
    if (k == 8) kvq_sampler_ban(s, ban, 9);
}

#endif
