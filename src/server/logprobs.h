/* Log-probabilities for the logprobs / top_logprobs request fields: log-softmax of
 * the model's raw logits (before temperature, penalties and truncation, as OpenAI
 * and llama.cpp report them), the sampled token's value and the k most likely. */
#ifndef KVQ_SERVER_LOGPROBS_H
#define KVQ_SERVER_LOGPROBS_H

#include <stdbool.h>
#include <stddef.h>

#include "kvq.h"

#define LP_MAX_TOP 20 /* OpenAI's limit for top_logprobs */
/* What OpenAI reports for a probability of 0 (JSON has no -Infinity). */
#define LP_FLOOR -9999.0f

struct lp_top {
    kvq_token id;
    float logprob;
};

/* One generated token: its log-probability, the n_top most likely tokens (most
 * likely first), and where its text starts and ends in the generated text. */
struct lp_entry {
    kvq_token id;
    float logprob;
    int n_top;
    struct lp_top top[LP_MAX_TOP];
    size_t text_start, text_end;
};

/* A growable list of entries; out of memory is sticky like strbuf's. */
struct lp_list {
    struct lp_entry *v;
    int n, cap;
    bool oom;
};
void lp_list_add(struct lp_list *l, const struct lp_entry *e);
void lp_list_free(struct lp_list *l);

/* Log-softmax of logits[n] at `chosen` (returned) and the k (<= LP_MAX_TOP, <= n) most
 * likely tokens into top, most likely first, equal values by lower id. Values that
 * are not finite (a logit of -inf) become LP_FLOOR. */
float lp_compute(const float *logits, int n, kvq_token chosen, int k, struct lp_top *top);
/* top[0..k) from ids and log-probabilities (kvq_get_logprobs), with lp_floor's values. */
void lp_top_fill(struct lp_top *top, const kvq_token *ids, const float *lps, int k);
/* x, or LP_FLOOR for what is not finite or below it. */
float lp_floor(double x);

#endif
