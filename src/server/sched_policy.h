/* The batching policy of kvq serve's scheduler, free of threads and of the engine:
 * what a request may reserve of the KV budget, when a queued request is admitted
 * (or a held prefix evicted first, or the request waits), what one step's batch
 * holds (a token per decoding sequence, then prefill chunks), and which request
 * gives way when memory runs out. The scheduler (scheduler.c) feeds it numbers it
 * reads from the engine and carries out its decisions; tests/test_sched_policy.c
 * checks the decisions alone. */
#ifndef KVQ_SERVER_SCHED_POLICY_H
#define KVQ_SERVER_SCHED_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvq.h"

/* Limits, fixed when the scheduler starts. */
struct sched_policy {
    int max_seqs;                     /* sequences decoded together */
    int prefill_chunk;                /* prompt tokens per sequence per step */
    int step_tokens;                  /* tokens per step (decode tokens + prefill chunks) */
    int n_ctx;                        /* tokens per sequence */
    size_t budget;                    /* KV bytes in use at once */
    size_t token_bytes, window_bytes; /* kvq_kv_token_bytes, kvq_kv_window_bytes */
    size_t margin;                    /* KV bytes kept free: a quantized cache's f16 rows of a step */
    int offsets_at;                   /* prompt chunks end there (kvq_pass_split_tokens; 0: anywhere) */
};

/* What the policy knows of the request in a slot. */
struct sched_seq {
    const kvq_token *prompt;
    int n_prompt;
    bool follower;    /* one of n choices after the first: it forks the first's prompt */
    bool forked;      /* a follower that holds its leader's prompt now */
    int slot;         /* its sequence in the context */
    int prefilled;    /* prompt tokens in the KV cache */
    bool has_pending; /* pending was drawn and is fed next step */
    kvq_token pending;
    int len;              /* tokens the sequence holds (kvq_seq_len), for admission */
    size_t reserve;       /* KV bytes it may grow to (sched_policy_reserve) */
    uint64_t order;       /* admission order */
    int chunk, batch_pos; /* this step: prompt tokens in the batch; the batch row of its logits (-1: none) */
};

/* The limits for a scheduler of sched_params-like sizes (margin from the f16 bytes of
 * a token when the cache is quantized, else 0). */
void sched_policy_init(struct sched_policy *p, int max_seqs, int prefill_chunk, int step_tokens, int n_ctx,
                       size_t budget, size_t token_bytes, size_t window_bytes, size_t f16_token_bytes);

/* KV bytes of a sequence of n tokens (whole blocks of 64 tokens). */
size_t sched_policy_bytes(const struct sched_policy *p, int n_tokens);
/* A prompt of n_prompt tokens asked for as n choices: 0, or 400 with why in msg
 * (more choices than sequences, longer than the context, over the budget). */
int sched_policy_check(const struct sched_policy *p, int n_prompt, int n, char *msg, size_t msg_size);
/* The KV bytes a request may grow to: a follower only what it appends to the prompt
 * it shares (and the partly filled block it copies); at most the budget less the margin. */
size_t sched_policy_reserve(const struct sched_policy *p, int n_prompt, int max_tokens, bool follower);

enum sched_admit {
    SCHED_ADMIT_START, /* start the requests */
    SCHED_ADMIT_EVICT, /* evict a held prefix, then ask again */
    SCHED_ADMIT_WAIT,  /* leave them queued: no free slots */
    SCHED_ADMIT_WAIT_MEMORY, /* leave them queued: slots are free, KV memory is not (back-pressure) */
};
/* Whether g queued requests that may grow to want[0..g) KV bytes start now, with
 * kv_used bytes in use and slots[max_seqs] (NULL: free) running; may_evict: the
 * prefix cache holds an entry to evict. With nothing running, they always start. */
enum sched_admit sched_policy_admit(const struct sched_policy *p, size_t kv_used, struct sched_seq *const *slots,
                                    const size_t *want, int g, bool may_evict);

/* Composes one step's batch into tok/seq/logits (room for step_tokens + max_seqs +
 * prefill_chunk): a decode token per sequence with one pending, then whole prefill
 * chunks (min(left, prefill_chunk) tokens, and none across offsets_at, so a prompt is
 * cut the same way however many others run) while the step has room; at least one
 * chunk per step. Sets each
 * sequence's chunk and batch_pos; returns the batch's tokens. */
int sched_policy_step(const struct sched_policy *p, struct sched_seq *const *slots, kvq_token *tok, int32_t *seq,
                      bool *logits);

/* The running request that gives way when memory runs out: the youngest. NULL if none. */
struct sched_seq *sched_policy_youngest(const struct sched_policy *p, struct sched_seq *const *slots);

#endif
