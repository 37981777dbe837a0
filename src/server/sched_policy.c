#include "server/sched_policy.h"

#include <stdio.h>

void sched_policy_init(struct sched_policy *p, int max_seqs, int prefill_chunk, int step_tokens, int n_ctx,
                       size_t budget, size_t token_bytes, size_t window_bytes, size_t f16_token_bytes) {
    *p = (struct sched_policy){max_seqs, prefill_chunk, step_tokens, n_ctx, budget, token_bytes, window_bytes, 0, 0};
    /* a quantized cache holds a step's new rows in f16 too until the next step */
    if (f16_token_bytes) p->margin = f16_token_bytes * (size_t)(step_tokens + max_seqs);
}

size_t sched_policy_bytes(const struct sched_policy *p, int n_tokens) {
    return p->token_bytes * (((size_t)n_tokens + 63) / 64 * 64) + p->window_bytes;
}

int sched_policy_check(const struct sched_policy *p, int n_prompt, int n, char *msg, size_t msg_size) {
    if (n > p->max_seqs) {
        snprintf(msg, msg_size, "%d choices of one prompt run as %d sequences at once; this server runs at most %d", n,
                 n, p->max_seqs);
        return 400;
    }
    if (n_prompt >= p->n_ctx) {
        snprintf(msg, msg_size, "the prompt has %d tokens; this server's context holds %d (prompt and answer)",
                 n_prompt, p->n_ctx);
        return 400;
    }
    size_t need = sched_policy_bytes(p, n_prompt + 1) + p->margin;
    if (need > p->budget) {
        snprintf(msg, msg_size, "the prompt of %d tokens needs %zu bytes of KV cache, more than the budget of %zu",
                 n_prompt, need, p->budget);
        return 400;
    }
    return 0;
}

/* The most tokens a request's sequence can reach. */
static int final_len(const struct sched_policy *p, int n_prompt, int max_tokens) {
    long n = max_tokens < 0 ? p->n_ctx : (long)n_prompt + max_tokens;
    return n > p->n_ctx ? p->n_ctx : (int)n;
}

size_t sched_policy_reserve(const struct sched_policy *p, int n_prompt, int max_tokens, bool follower) {
    const int len = final_len(p, n_prompt, max_tokens);
    size_t r = follower ? sched_policy_bytes(p, len - n_prompt + 64) : sched_policy_bytes(p, len);
    if (r + p->margin > p->budget) r = p->budget - p->margin;
    return r;
}

/* True when the KV bytes in use plus what running requests may still grow by plus
 * what the g requests may take stay within the budget. */
static bool fits(const struct sched_policy *p, size_t kv_used, struct sched_seq *const *slots, const size_t *want,
                 int g) {
    size_t need = kv_used + p->margin;
    for (int i = 0; i < g; i++) need += want[i];
    for (int i = 0; i < p->max_seqs; i++) {
        const struct sched_seq *o = slots[i];
        if (!o) continue;
        int len = o->len;
        if (o->follower) len = o->forked ? len - o->n_prompt : 0;
        /* an empty sequence holds nothing yet, not even its window: all of its reserve
         * is still to come (counting the window as held let a burst of new requests
         * past the budget by a window each) */
        size_t now = len > 0 ? sched_policy_bytes(p, len) : 0;
        if (o->reserve > now) need += o->reserve - now;
    }
    return need <= p->budget;
}

enum sched_admit sched_policy_admit(const struct sched_policy *p, size_t kv_used, struct sched_seq *const *slots,
                                    const size_t *want, int g, bool may_evict) {
    int running = 0;
    for (int i = 0; i < p->max_seqs; i++) running += slots[i] != NULL;
    if (p->max_seqs - running < g) return SCHED_ADMIT_WAIT;
    if (fits(p, kv_used, slots, want, g)) return SCHED_ADMIT_START;
    if (may_evict) return SCHED_ADMIT_EVICT;
    return running > 0 ? SCHED_ADMIT_WAIT_MEMORY : SCHED_ADMIT_START;
}

int sched_policy_step(const struct sched_policy *p, struct sched_seq *const *slots, kvq_token *tok, int32_t *seq,
                      bool *logits) {
    int n = 0;
    for (int i = 0; i < p->max_seqs; i++) {
        struct sched_seq *r = slots[i];
        if (!r) continue;
        r->batch_pos = -1;
        r->chunk = 0;
        if (!r->has_pending) continue;
        tok[n] = r->pending;
        seq[n] = r->slot;
        logits[n] = true;
        r->batch_pos = n++;
    }
    bool any_prefill = false;
    for (int i = 0; i < p->max_seqs; i++) {
        struct sched_seq *r = slots[i];
        if (!r || r->has_pending || r->prefilled >= r->n_prompt || (r->follower && !r->forked)) continue;
        int left = r->n_prompt - r->prefilled;
        int chunk = left < p->prefill_chunk ? left : p->prefill_chunk;
        if (r->prefilled < p->offsets_at && r->prefilled + chunk > p->offsets_at) chunk = p->offsets_at - r->prefilled;
        if (any_prefill && n + chunk > p->step_tokens) continue;
        for (int j = 0; j < chunk; j++) {
            tok[n + j] = r->prompt[r->prefilled + j];
            seq[n + j] = r->slot;
            logits[n + j] = false;
        }
        n += chunk;
        r->chunk = chunk;
        if (chunk == left) {
            logits[n - 1] = true;
            r->batch_pos = n - 1;
        }
        any_prefill = true;
    }
    return n;
}

struct sched_seq *sched_policy_youngest(const struct sched_policy *p, struct sched_seq *const *slots) {
    struct sched_seq *y = NULL;
    for (int i = 0; i < p->max_seqs; i++)
        if (slots[i] && (!y || slots[i]->order > y->order)) y = slots[i];
    return y;
}
