/* The scheduler: one thread that owns the kvq_context and runs continuous batching.
 * Each step is ONE kvq_decode with a decode token for every running sequence plus
 * bounded chunks of prompts being prefilled; requests join and leave between steps.
 * HTTP threads hand requests over through a small locked queue and read the text
 * back from the request; every engine call happens on the scheduler thread. What
 * to admit and what a step holds is the policy's (sched_policy.h, free of threads);
 * this is the request channel around it and the thread that carries it out. */
#ifndef KVQ_SERVER_SCHEDULER_H
#define KVQ_SERVER_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvq.h"
#include "server/logprobs.h"
#include "server/strbuf.h"

#define GEN_MAX_STOP 4

/* What a request asks the generator for (parsed from the JSON body). */
struct gen_params {
    int max_tokens; /* -1: until end of text or context */
    struct kvq_sampler_params sampling;
    char *stop[GEN_MAX_STOP];
    int n_stop;
    int logprobs; /* -1: none; else log-probabilities with this many alternatives (0..LP_MAX_TOP) */
    bool ignore_eos;  /* end-of-generation tokens are never drawn (llama.cpp's ignore_eos) */
    int min_tokens;   /* before this many tokens, neither those nor stop_ids are drawn and stop
                       * strings do not apply (vLLM's min_tokens) */
    kvq_token *stop_ids; /* tokens that end the answer, left out of its text (malloc'd) */
    int n_stop_ids;
    float frequency_penalty, presence_penalty; /* OpenAI's, over the generated tokens */
    kvq_token *bias_ids; /* logit_bias: bias_values[i] added to token bias_ids[i] (malloc'd) */
    float *bias_values;
    int n_bias;
    struct kvq_grammar *grammar; /* the text must follow it (owned), or NULL */
};

struct prefix_cache;

struct sched_params {
    int max_seqs;       /* sequences decoded together */
    int max_queue;      /* requests that may wait for a slot or memory (then 503) */
    int prefill_chunk;  /* prompt tokens per sequence per step */
    int step_tokens;    /* tokens per step (decode tokens + prefill chunks) */
    struct kvq_kv_config kv; /* the context's, to estimate what requests will take */
};

struct sched_stats {
    uint64_t requests, prompt_tokens, generated_tokens, cached_tokens;
    uint64_t cache_hits, cache_misses;
    int queued, running, cache_entries, cache_host_entries;
    int waiting_memory; /* of the queued: those waiting for KV memory while slots are free */
    size_t kv_bytes, kv_budget, cache_bytes, cache_host_bytes;
    int64_t kv_blocks;
    double decode_tok_s; /* over the last busy second */
};

struct sched;
struct sched_req;

/* The context must have n_seq >= p->max_seqs; pc may be NULL (no prefix cache). The
 * scheduler uses both from its own thread until sched_stop(). */
struct sched *sched_start(struct kvq_model *m, struct kvq_context *c, struct prefix_cache *pc,
                          const struct sched_params *p);
/* Stops the thread; requests still queued or running end with an error (503), and
 * later submits are refused. sched_free() then frees it (after the HTTP threads end). */
void sched_stop(struct sched *s);
void sched_free(struct sched *s);
int sched_n_ctx(const struct sched *s);
void sched_get_stats(struct sched *s, struct sched_stats *st);

/* A request takes ownership of tokens (malloc'd) and of the strings in gp; the
 * caller holds one reference. cache_key namespaces prefix-cache entries (may be NULL). */
struct sched_req *sched_req_new(kvq_token *tokens, int n_tokens, struct gen_params *gp, const char *cache_key);
/* 0, or -1 with *status / msg (503: queue full or stopping; 400: can never fit). */
int sched_submit(struct sched *s, struct sched_req *r, int *status, char *msg, size_t msg_size);
/* n requests for the same prompt (n choices), submitted and started together: the first
 * reads the prompt, the others then share its KV blocks (kvq_seq_fork) and draw their
 * first token from the same logits. Each is answered as a request of its own. */
int sched_submit_group(struct sched *s, struct sched_req **rs, int n, int *status, char *msg, size_t msg_size);

struct sched_result {
    const char *finish_reason; /* "stop", "length", or NULL while running */
    int prompt_tokens, cached_tokens, completion_tokens;
    int error_status; /* non-zero: the request failed with error_msg */
    char error_msg[256];
};
/* Where a reader is in a request's output. */
struct sched_cursor {
    size_t text;
    int lp;
};
/* Waits up to timeout_ms for new text; appends what arrived since the cursor to out,
 * and the log-probabilities of the tokens whose text that completes to lp (may be
 * NULL), advancing the cursor; fills res. True once the request has ended (all its
 * output has then been handed out). */
bool sched_req_wait(struct sched_req *r, int timeout_ms, struct sched_cursor *cur, struct strbuf *out,
                    struct lp_list *lp, struct sched_result *res);
/* The client is gone: the scheduler frees the sequence at its next step. */
void sched_req_cancel(struct sched_req *r);
void sched_req_release(struct sched_req *r);

/* Frees what gp owns. */
void gen_params_free(struct gen_params *gp);
/* dst becomes a deep copy of src, less its grammar (NULL: one per sequence); 0, or -1 when out of memory (dst then owns nothing). */
int gen_params_copy(struct gen_params *dst, const struct gen_params *src);

#endif
