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

static float finite_or_floor(double x) { return isfinite(x) && x > LP_FLOOR ? (float)x : LP_FLOOR; }

float lp_compute(const float *logits, int n, kvq_token chosen, int k, struct lp_top *top) {
    if (k > LP_MAX_TOP) k = LP_MAX_TOP;
    if (k > n) k = n;
    /* one pass for the maximum and the k largest (insertion into a short sorted list:
     * k <= 20, so this costs about one comparison per token) */
    float mx = -INFINITY;
    int have = 0;
    for (int i = 0; i < n; i++) {
        float x = logits[i];
        if (x > mx) mx = x;
        if (k == 0 || (have == k && !(x > top[k - 1].logprob))) continue;
        int j = have < k ? have++ : k - 1;
        while (j > 0 && x > top[j - 1].logprob) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = (struct lp_top){i, x};
    }
    /* the sum in double: 150k terms in float would lose digits */
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    double log_z = (double)mx + log(sum);
    for (int j = 0; j < have; j++) top[j].logprob = finite_or_floor((double)top[j].logprob - log_z);
    return chosen >= 0 && chosen < n ? finite_or_floor((double)logits[chosen] - log_z) : LP_FLOOR;
}
