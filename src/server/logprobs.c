#include "server/logprobs.h"

#include <math.h>
#include <stdlib.h>

void lp_list_add(struct lp_list *l, const struct lp_entry *e) {
    if (l->oom) return;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 32;
        struct lp_entry *v = realloc(l->v, sizeof *v * (size_t)cap);
        if (!v) {
            l->oom = true;
            return;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = *e;
}

void lp_list_free(struct lp_list *l) {
    free(l->v);
    *l = (struct lp_list){0};
}

float lp_floor(double x) { return isfinite(x) && x > LP_FLOOR ? (float)x : LP_FLOOR; }

float lp_compute(const float *logits, int n, kvq_token chosen, int k, struct lp_top *top) {
    if (k > LP_MAX_TOP) k = LP_MAX_TOP;
    if (k > n) k = n;
    kvq_token ids[LP_MAX_TOP];
    float lps[LP_MAX_TOP];
    const double log_z = kvq_logprobs(logits, n, k, ids, lps);
    lp_top_fill(top, ids, lps, k);
    return chosen >= 0 && chosen < n ? lp_floor((double)logits[chosen] - log_z) : LP_FLOOR;
}

void lp_top_fill(struct lp_top *top, const kvq_token *ids, const float *lps, int k) {
    for (int j = 0; j < k; j++) top[j] = (struct lp_top){ids[j], lp_floor(lps[j])};
}
