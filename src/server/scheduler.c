#include "server/scheduler.h"

#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/prefix_cache.h"
#include "server/sched_policy.h"

struct sched_req {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int refs;       /* not under mu: the scheduler takes one a step for each request it wakes */
    atomic_bool cancelled; /* checked each step for every running request */
    /* set before submit, read-only afterwards */
    kvq_token *tokens;
    int n_tokens;
    struct gen_params gp;
    char *cache_key;
    /* n choices of one prompt: the first (the leader, group = n) prefills it, the others
     * (leader set, holding a reference to it) then fork its sequence */
    struct sched_req *leader;
    int group;
    /* under mu: what the HTTP thread reads */
    struct strbuf text; /* generated text; bytes past `published` may still become a stop string */
    size_t published;
    struct lp_list lp; /* per generated token when asked for; the first lp_published are handed out */
    int lp_published;
    bool done;
    struct sched_result res;
    /* scheduler thread only */
    struct sched_seq q;     /* what the batching policy sees (q.prompt is tokens) */
    struct sched_req *next; /* queue link */
    int n_gen;
    kvq_token *fed; /* tokens the sequence holds: the prompt, then generated ones */
    int n_fed, fed_cap;
    /* this step's draw after batch token `row`: the engine's (by_engine: the step
     * passed smp), or made with the others' on the sampling threads from the logits */
    int row;
    bool by_engine;
    kvq_token drawn;
    struct lp_entry drawn_lp;
    struct kvq_sampler *smp;
    struct kvq_detok *dt;
};

struct sched {
    struct kvq_model *m;
    struct kvq_context *c;
    struct prefix_cache *pc;
    struct sched_params p;
    struct sched_policy pol;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu; /* queue, stop flag, stats */
    pthread_cond_t cv;
    bool stop;
    struct sched_req *head, *tail;
    int queued;
    struct sched_stats st;
    /* scheduler thread only */
    bool waiting_memory;      /* the queue's head waits for KV memory (wait_memory) */
    struct sched_req **slots; /* [max_seqs] */
    struct sched_seq **seqs;  /* [max_seqs]: the slots' policy views (NULL: free) */
    size_t *want;             /* [max_seqs]: the KV reserves of a group being admitted */
    int running, n_ctx, n_vocab;
    kvq_token *eog; /* the model's end-of-generation tokens */
    int n_eog;
    uint64_t admitted;
    kvq_token *b_tok;
    int32_t *b_seq;
    bool *b_logits;
    struct kvq_sampler **b_smp; /* the samplers the engine draws with, by batch token */
    int *b_lp;                  /* and the log-probabilities it reports with their draws */
    double rate_t0;
    double kv_bytes_t; /* when update_stats last counted the KV bytes in use */
    uint64_t rate_tokens;
    /* the step's draws, one request per slot of `draws`, on the engine's host threads
     * (16 sequences' draws over a 128K vocabulary on one thread took 2.7 ms of a 7.3 ms
     * step), taken one at a time so that a thread the OS holds back holds no others */
    struct sched_req **draws;
    int n_draws;
    atomic_int next_draw;
    /* The HTTP threads whose requests got text in a step are woken by a thread of its
     * own (holding a reference to each request until then), so that the scheduler
     * thread goes on to the next step: waking 128 of them took it 2-3 ms a step while
     * the GPU idled (docs/cuda-performance.md). */
    pthread_t waker;
    bool waker_on, stop_waker;
    pthread_mutex_t wmu;
    pthread_cond_t wcv;
    struct sched_req **to_wake, **waking; /* under wmu; the waker thread's batch */
    int n_to_wake, to_wake_cap, waking_cap;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- requests ---- */

struct sched_req *sched_req_new(kvq_token *tokens, int n_tokens, struct gen_params *gp, const char *cache_key) {
    struct sched_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    if (cache_key && !(r->cache_key = strdup(cache_key))) {
        free(r);
        return NULL;
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    atomic_init(&r->refs, 1);
    atomic_init(&r->cancelled, false);
    r->tokens = tokens;
    r->n_tokens = n_tokens;
    r->gp = *gp;
    memset(gp, 0, sizeof *gp); /* the request owns the stop strings now */
    r->q = (struct sched_seq){.prompt = tokens, .n_prompt = n_tokens, .slot = -1};
    r->res.prompt_tokens = n_tokens;
    return r;
}

void sched_req_release(struct sched_req *r) {
    if (!r || atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) != 1) return;
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->tokens);
    free(r->fed);
    free(r->cache_key);
    gen_params_free(&r->gp);
    strbuf_free(&r->text);
    lp_list_free(&r->lp);
    kvq_sampler_free(r->smp);
    kvq_detok_free(r->dt);
    sched_req_release(r->leader);
    free(r);
}

void sched_req_cancel(struct sched_req *r) { atomic_store_explicit(&r->cancelled, true, memory_order_relaxed); }

static bool is_cancelled(struct sched_req *r) { return atomic_load_explicit(&r->cancelled, memory_order_relaxed); }

static void take_ref(struct sched_req *r) { atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed); }

bool sched_req_wait(struct sched_req *r, int timeout_ms, struct sched_cursor *cur, struct strbuf *out,
                    struct lp_list *lp, struct sched_result *res) {
    size_t *offset = &cur->text;
    pthread_mutex_lock(&r->mu);
    if (r->published <= *offset && r->lp_published <= cur->lp && !r->done && timeout_ms > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        ts.tv_sec += timeout_ms / 1000 + ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    if (r->published > *offset) {
        strbuf_addn(out, r->text.s + *offset, r->published - *offset);
        *offset = r->published;
    }
    for (; cur->lp < r->lp_published; cur->lp++)
        if (lp) lp_list_add(lp, &r->lp.v[cur->lp]);
    *res = r->res;
    bool done = r->done && *offset == r->published && cur->lp == r->lp_published;
    pthread_mutex_unlock(&r->mu);
    return done;
}

/* Log-probabilities are handed out with their token's text: those whose text is
 * published; at the end also those whose text a stop string cut only in part. */
static void publish_lp(struct sched_req *r, bool end) {
    while (r->lp_published < r->lp.n) {
        const struct lp_entry *e = &r->lp.v[r->lp_published];
        if (!(e->text_end <= r->published || (end && e->text_start < r->published))) break;
        r->lp_published++;
    }
}

/* Appends generated text (and its token's log-probabilities, lp may be NULL) and
 * publishes what can no longer turn into a stop string; returns true when a stop
 * string appeared (the text is cut before it). */
static bool add_text(struct sched_req *r, const char *piece, int len, struct lp_entry *lp) {
    const struct gen_params *g = &r->gp;
    bool stopped = false;
    pthread_mutex_lock(&r->mu);
    struct strbuf *t = &r->text;
    size_t old = t->len;
    strbuf_add_utf8(t, piece, (size_t)len);
    if (lp) {
        lp->text_start = old;
        lp->text_end = t->len;
        lp_list_add(&r->lp, lp);
    }
    size_t hold = 0;
    const int n_stop = r->n_gen >= g->min_tokens ? g->n_stop : 0; /* none before min_tokens */
    for (int i = 0; i < n_stop && t->s; i++) {
        size_t sl = strlen(g->stop[i]);
        size_t from = old >= sl ? old - sl + 1 : 0; /* a match must end in the new text */
        if (from > t->len) from = t->len;
        char *hit = memmem(t->s + from, t->len - from, g->stop[i], sl);
        if (hit) { /* later stop strings search only the text before this cut */
            t->len = (size_t)(hit - t->s);
            t->s[t->len] = '\0';
            stopped = true;
        }
    }
    for (int i = 0; i < n_stop && !stopped && t->s; i++) {
        /* the longest tail of the text that starts this stop string stays unpublished */
        size_t sl = strlen(g->stop[i]);
        for (size_t k = sl - 1; k > hold; k--)
            if (k <= t->len && memcmp(t->s + t->len - k, g->stop[i], k) == 0) {
                hold = k;
                break;
            }
    }
    size_t pub = t->len - hold;
    if (pub > r->published || stopped) r->published = pub < t->len ? pub : t->len;
    publish_lp(r, false);
    pthread_mutex_unlock(&r->mu);
    return stopped;
}

/* Marks the request finished (reason, or an error) and publishes all its text. */
static void end_request(struct sched_req *r, const char *reason, int status, const char *msg) {
    pthread_mutex_lock(&r->mu);
    r->res.finish_reason = reason;
    r->res.completion_tokens = r->n_gen;
    if (status) {
        r->res.error_status = status;
        snprintf(r->res.error_msg, sizeof r->res.error_msg, "%s", msg);
    }
    r->published = r->text.len;
    publish_lp(r, true);
    r->done = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* ---- waking the HTTP threads ---- */

static void wake_now(struct sched_req *r) {
    pthread_mutex_lock(&r->mu);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

static void *waker_run(void *arg) {
    struct sched *s = arg;
    pthread_mutex_lock(&s->wmu);
    for (;;) {
        while (s->n_to_wake == 0 && !s->stop_waker) pthread_cond_wait(&s->wcv, &s->wmu);
        const int n = s->n_to_wake;
        if (n == 0) break; /* stopped, and nothing left */
        struct sched_req **batch = s->to_wake;
        const int cap = s->to_wake_cap;
        s->to_wake = s->waking, s->to_wake_cap = s->waking_cap, s->n_to_wake = 0;
        s->waking = batch, s->waking_cap = cap;
        pthread_mutex_unlock(&s->wmu);
        for (int i = 0; i < n; i++) {
            wake_now(batch[i]);
            sched_req_release(batch[i]);
        }
        pthread_mutex_lock(&s->wmu);
    }
    pthread_mutex_unlock(&s->wmu);
    return NULL;
}

/* The HTTP threads of the step's requests (those of draws) read their new text: woken
 * by the waker thread, or here where there is none or memory is short. */
static void wake_readers(struct sched *s, struct sched_req **rs, int n) {
    if (n == 0) return;
    pthread_mutex_lock(&s->wmu);
    if (s->waker_on && s->n_to_wake + n > s->to_wake_cap) {
        const int cap = 2 * (s->n_to_wake + n);
        struct sched_req **grown = realloc(s->to_wake, sizeof *grown * (size_t)cap);
        if (grown) s->to_wake = grown, s->to_wake_cap = cap;
    }
    const bool queue = s->waker_on && s->n_to_wake + n <= s->to_wake_cap;
    for (int i = 0; i < n && queue; i++) {
        take_ref(rs[i]);
        s->to_wake[s->n_to_wake++] = rs[i];
    }
    if (queue) pthread_cond_signal(&s->wcv);
    pthread_mutex_unlock(&s->wmu);
    for (int i = 0; i < n && !queue; i++) wake_now(rs[i]);
}

/* ---- the scheduler ---- */

int sched_n_ctx(const struct sched *s) { return s->n_ctx; }

int sched_submit(struct sched *s, struct sched_req *r, int *status, char *msg, size_t msg_size) {
    return sched_submit_group(s, &r, 1, status, msg, msg_size);
}

int sched_submit_group(struct sched *s, struct sched_req **rs, int n, int *status, char *msg, size_t msg_size) {
    struct sched_req *r = rs[0];
    if ((*status = sched_policy_check(&s->pol, r->n_tokens, n, msg, msg_size)) != 0) return -1;
    for (int i = 0; i < n; i++) {
        if (i > 0) {
            rs[i]->leader = r;
            rs[i]->q.follower = true;
            take_ref(r); /* the follower's */
        }
        rs[i]->group = i == 0 ? n : 0;
        rs[i]->q.reserve = sched_policy_reserve(&s->pol, rs[i]->n_tokens, rs[i]->gp.max_tokens, i > 0);
    }
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    /* max_queue counts requests that must wait: those beyond the free slots */
    if (s->stop || s->queued + n - 1 - (s->p.max_seqs - s->st.running) >= s->p.max_queue) {
        *status = 503;
        snprintf(msg, msg_size, s->stop ? "the server is shutting down"
                                        : "the server is busy: %d requests are waiting; retry later", s->queued);
        rc = -1;
    } else {
        for (int i = 0; i < n; i++) { /* one after another: admitted together */
            r = rs[i];
            take_ref(r); /* the scheduler's */
            r->next = NULL;
            if (s->tail) s->tail->next = r;
            else s->head = r;
            s->tail = r;
            s->queued++;
        }
        s->st.requests++;
        s->st.queued = s->queued;
        pthread_cond_signal(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static struct sched_req *queue_pop(struct sched *s) {
    struct sched_req *r = s->head;
    if (r) {
        s->head = r->next;
        if (!s->head) s->tail = NULL;
        s->queued--;
    }
    return r;
}

/* Frees the request's sequence (storing it in the prefix cache when it ended well). */
static void retire(struct sched *s, struct sched_req *r, bool store) {
    if (store && s->pc && !r->leader && r->n_fed == kvq_seq_len(s->c, r->q.slot))
        prefix_cache_store(s->pc, r->q.slot, r->cache_key, r->fed, r->n_fed, true, r->res.cached_tokens);
    kvq_seq_clear(s->c, r->q.slot);
    s->slots[r->q.slot] = NULL;
    s->seqs[r->q.slot] = NULL;
    s->running--;
    r->q.slot = -1;
    sched_req_release(r);
}

/* Answers r; step() frees its sequence once the step's other answers are out, since
 * storing it in the prefix cache may convert it (about 0.13 s for 272 tokens of a
 * Llama-3-8B on the H100 machine), which requests finishing in the same step used to
 * wait for in turn. */
static void finish(struct sched_req *r, const char *reason) {
    char piece[256];
    int w = kvq_detok_flush(r->dt, piece, sizeof piece);
    if (w > 0 && add_text(r, piece, w < (int)sizeof piece ? w : (int)sizeof piece, NULL)) reason = "stop";
    end_request(r, reason, 0, NULL);
}

static void fail(struct sched *s, struct sched_req *r, int status, const char *msg) {
    fprintf(stderr, "kvq serve: request failed: %s\n", msg);
    end_request(r, NULL, status, msg);
    retire(s, r, false);
}

static bool push_fed(struct sched_req *r, kvq_token t) {
    if (r->n_fed == r->fed_cap) {
        int cap = r->fed_cap ? r->fed_cap * 2 : 64;
        kvq_token *f = realloc(r->fed, sizeof *f * (size_t)cap);
        if (!f) return false;
        r->fed = f;
        r->fed_cap = cap;
    }
    r->fed[r->n_fed++] = t;
    return true;
}

/* What the request may not draw now: the end-of-generation tokens with ignore_eos, and
 * those and its stop tokens while it has fewer than min_tokens. */
static int update_bans(struct sched *s, struct sched_req *r) {
    const struct gen_params *g = &r->gp;
    const bool short_ = r->n_gen < g->min_tokens;
    if (!g->ignore_eos && !short_) return kvq_sampler_ban(r->smp, NULL, 0);
    int n = s->n_eog + (short_ ? g->n_stop_ids : 0);
    kvq_token *ban = malloc(sizeof *ban * (size_t)(n > 0 ? n : 1));
    if (!ban) return -1;
    memcpy(ban, s->eog, sizeof *ban * (size_t)s->n_eog);
    if (short_ && g->n_stop_ids) memcpy(ban + s->n_eog, g->stop_ids, sizeof *ban * (size_t)g->n_stop_ids);
    int rc = kvq_sampler_ban(r->smp, ban, n);
    free(ban);
    return rc;
}

static bool is_stop_id(const struct gen_params *g, kvq_token t) {
    for (int i = 0; i < g->n_stop_ids; i++)
        if (g->stop_ids[i] == t) return true;
    return false;
}

/* Puts a queued request into a free slot: sampler, detokenizer, prefix-cache lookup.
 * True when the request's sequence took KV memory (a prefix-cache hit). */
static bool start(struct sched *s, struct sched_req *r, int slot) {
    r->q.slot = slot;
    r->q.order = ++s->admitted;
    s->slots[slot] = r;
    s->seqs[slot] = &r->q;
    s->running++;
    pthread_mutex_lock(&s->mu);
    s->st.running = s->running;
    pthread_mutex_unlock(&s->mu);
    r->smp = kvq_sampler_new(&r->gp.sampling, s->n_vocab);
    r->dt = kvq_detok_new(s->m);
    r->fed_cap = r->n_tokens + 64;
    r->fed = malloc(sizeof *r->fed * (size_t)r->fed_cap);
    if (!r->smp || !r->dt || !r->fed || kvq_sampler_set_grammar(r->smp, r->gp.grammar) != 0) {
        fail(s, r, 500, "out of memory");
        return false;
    }
    kvq_sampler_set_penalties(r->smp, r->gp.frequency_penalty, r->gp.presence_penalty);
    if (kvq_sampler_set_logit_bias(r->smp, r->gp.bias_ids, r->gp.bias_values, r->gp.n_bias) != 0 ||
        update_bans(s, r) != 0) {
        fail(s, r, 400, kvq_last_error());
        return false;
    }
    memcpy(r->fed, r->tokens, sizeof *r->fed * (size_t)r->n_tokens);
    r->n_fed = r->n_tokens;
    for (int i = 0; i < r->n_tokens; i++) kvq_sampler_accept(r->smp, r->tokens[i]);
    int cached = 0;
    if (r->leader) return false; /* its prompt comes from the leader's sequence */
    if (s->pc) {
        /* the last prompt token is always computed: its logits give the first answer token */
        cached = prefix_cache_fetch(s->pc, slot, r->cache_key, r->tokens, r->n_tokens - 1);
        fprintf(stderr, "kvq serve: cache_fetch %s cached=%d new=%d\n", cached ? "HIT" : "MISS", cached,
                r->n_tokens - cached);
    }
    r->q.prefilled = cached;
    pthread_mutex_lock(&r->mu);
    r->res.cached_tokens = cached;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->mu);
    if (s->pc) (cached ? s->st.cache_hits++ : s->st.cache_misses++);
    s->st.cached_tokens += (uint64_t)cached;
    s->st.prompt_tokens += (uint64_t)r->n_tokens;
    pthread_mutex_unlock(&s->mu);
    return cached > 0;
}

static int free_slot(const struct sched *s) {
    for (int i = 0; i < s->p.max_seqs; i++)
        if (!s->slots[i]) return i;
    return -1;
}

/* The running sequences' lengths, as admission weighs them. */
static void update_lens(struct sched *s) {
    for (int i = 0; i < s->p.max_seqs; i++)
        if (s->seqs[i]) s->seqs[i]->len = kvq_seq_len(s->c, i);
}

/* The queue waits for KV memory with slots free: said on stderr once a wait (how many
 * run, what is in use) and in the stats until a request starts or the queue empties. */
static void wait_memory(struct sched *s) {
    pthread_mutex_lock(&s->mu);
    const int queued = s->queued;
    s->st.waiting_memory = queued;
    pthread_mutex_unlock(&s->mu);
    if (s->waiting_memory) return;
    s->waiting_memory = true;
    fprintf(stderr, "kvq serve: %d request%s wait for KV memory: %d sequences run in %.1f of %.1f MiB\n", queued,
            queued == 1 ? "" : "s", s->running, kvq_kv_bytes(s->c) / 1048576.0, kvq_kv_budget(s->c) / 1048576.0);
}

static void wait_over(struct sched *s) {
    if (!s->waiting_memory) return;
    s->waiting_memory = false;
    pthread_mutex_lock(&s->mu);
    s->st.waiting_memory = 0;
    pthread_mutex_unlock(&s->mu);
}

/* Moves queued requests into free slots while the policy admits them (evicting
 * prefix-cache entries first when it says so). */
static void admit(struct sched *s) {
    size_t *want = s->want;
    /* what is in use changes only with an eviction or a prefix-cache hit (its windows,
     * a converted entry's blocks); counting it visits every cache of every layer, so a
     * burst of new requests counts it once, not once each */
    bool count = true;
    size_t used = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        struct sched_req *r = s->head;
        /* a group (n choices) starts together; a follower at the head lost its leader */
        const int g = r && !r->leader ? r->group : 1;
        const struct sched_req *o = r;
        for (int i = 0; i < g && o; i++, o = o->next) want[i] = o->q.reserve;
        pthread_mutex_unlock(&s->mu);
        if (!r) return wait_over(s);
        const bool drop = is_cancelled(r) || r->leader;
        if (!drop) {
            bool may_evict = s->pc != NULL;
            enum sched_admit a;
            if (count) {
                update_lens(s);
                used = kvq_kv_bytes(s->c);
                count = false;
            }
            while ((a = sched_policy_admit(&s->pol, used, s->seqs, want, g, may_evict)) == SCHED_ADMIT_EVICT) {
                may_evict = prefix_cache_evict_one(s->pc);
                used = kvq_kv_bytes(s->c);
            }
            if (a == SCHED_ADMIT_WAIT_MEMORY) wait_memory(s);
            if (a == SCHED_ADMIT_WAIT || a == SCHED_ADMIT_WAIT_MEMORY) return;
        }
        wait_over(s);
        for (int i = 0; i < (drop ? 1 : g); i++) {
            pthread_mutex_lock(&s->mu);
            r = queue_pop(s);
            pthread_mutex_unlock(&s->mu);
            if (drop) {
                if (is_cancelled(r)) fprintf(stderr, "kvq serve: client went away; its queued request dropped\n");
                end_request(r, NULL, 499, "the client went away");
                sched_req_release(r);
                continue;
            }
            count = start(s, r, free_slot(s)) || count;
        }
    }
}

/* How many of the most likely tokens r reports with each token (its top_logprobs). */
static int n_logprobs(const struct sched *s, const struct sched_req *r) {
    return r->gp.logprobs < s->n_vocab ? r->gp.logprobs : s->n_vocab;
}

/* The token after batch token r->row, and its log-probabilities when asked for: what
 * only reads the step's logits and r's sampler, so the requests' draws run at once. */
static void draw(struct sched *s, struct sched_req *r) {
    const float *logits = r->by_engine ? NULL : kvq_get_logits(s->c, r->row);
    const kvq_token t = r->drawn = r->by_engine ? kvq_get_drawn(s->c, r->row) : kvq_sampler_sample(r->smp, logits);
    if (r->gp.logprobs < 0 || kvq_token_is_eog(s->m, t)) return;
    r->drawn_lp.id = t;
    r->drawn_lp.n_top = n_logprobs(s, r);
    if (logits) {
        r->drawn_lp.logprob = lp_compute(logits, s->n_vocab, t, r->drawn_lp.n_top, r->drawn_lp.top);
        return;
    }
    kvq_token ids[KVQ_LOGPROBS_MAX];
    float lps[KVQ_LOGPROBS_MAX], drawn;
    kvq_get_logprobs(s->c, r->row, &drawn, ids, lps);
    r->drawn_lp.logprob = lp_floor(drawn);
    lp_top_fill(r->drawn_lp.top, ids, lps, r->drawn_lp.n_top);
}

static void draw_task(void *arg, int ith, int nth) {
    (void)ith, (void)nth;
    struct sched *s = arg;
    for (int i; (i = atomic_fetch_add_explicit(&s->next_draw, 1, memory_order_relaxed)) < s->n_draws;)
        draw(s, s->draws[i]);
}

/* Feeds the drawn token's text out. */
static void next_token(struct sched *s, struct sched_req *r) {
    const kvq_token t = r->drawn;
    if (kvq_token_is_eog(s->m, t) || is_stop_id(&r->gp, t)) {
        finish(r, "stop");
        return;
    }
    /* the grammar only lets through what it allows: a refusal would be a bug, and ends the text */
    if (r->gp.grammar && kvq_grammar_accept(r->gp.grammar, t) != 0) {
        fprintf(stderr, "kvq serve: %s\n", kvq_last_error());
        finish(r, "stop");
        return;
    }
    kvq_sampler_accept_output(r->smp, t);
    r->n_gen++;
    if (r->n_gen == r->gp.min_tokens && update_bans(s, r) != 0) {
        end_request(r, NULL, 500, "out of memory"); /* step() frees the sequence */
        return;
    }
    char piece[256];
    int w = kvq_detok_feed(r->dt, t, piece, sizeof piece);
    /* a token with no text of its own yet (part of a UTF-8 sequence) still gets its entry */
    if ((w > 0 || r->gp.logprobs >= 0) &&
        add_text(r, piece, w > 0 ? (w < (int)sizeof piece ? w : (int)sizeof piece) : 0,
                 r->gp.logprobs >= 0 ? &r->drawn_lp : NULL)) {
        finish(r, "stop");
        return;
    }
    if (r->gp.grammar && kvq_grammar_done(r->gp.grammar)) { /* the value is complete: nothing may follow */
        finish(r, "stop");
        return;
    }
    if ((r->gp.max_tokens >= 0 && r->n_gen >= r->gp.max_tokens) || kvq_seq_len(s->c, r->q.slot) + 1 > s->n_ctx) {
        finish(r, "length");
        return;
    }
    r->q.pending = t;
    r->q.has_pending = true;
}

/* Followers whose leader read its prompt in this step take its sequence (sharing its
 * blocks) and draw from its logits. */
static void fork_followers(struct sched *s) {
    for (int i = 0; i < s->p.max_seqs; i++) {
        struct sched_req *r = s->slots[i], *l = r ? r->leader : NULL;
        if (!l || r->q.forked || l->q.slot < 0 || l->q.batch_pos < 0 || l->q.chunk == 0 || l->q.prefilled < l->n_tokens)
            continue;
        if (kvq_seq_fork(s->c, l->q.slot, r->q.slot) != 0) {
            fail(s, r, 500, kvq_last_error());
            continue;
        }
        r->q.forked = true;
        r->q.prefilled = r->n_tokens;
        pthread_mutex_lock(&r->mu);
        r->res.cached_tokens = l->res.cached_tokens;
        pthread_mutex_unlock(&r->mu);
        r->row = l->row;
        r->by_engine = false;
        s->draws[s->n_draws++] = r;
    }
}

static void step(struct sched *s) {
    for (int i = 0; i < s->p.max_seqs; i++)
        if (s->slots[i] && is_cancelled(s->slots[i])) {
            fprintf(stderr, "kvq serve: client went away; sequence %d freed\n", i);
            end_request(s->slots[i], NULL, 499, "the client went away");
            retire(s, s->slots[i], false);
        } else if (s->slots[i] && s->slots[i]->leader && !s->slots[i]->q.forked && s->slots[i]->leader->q.slot < 0) {
            fail(s, s->slots[i], 503, "the request's first choice failed before its prompt was read");
        }
    admit(s);
    if (s->running == 0) return;
    int n = sched_policy_step(&s->pol, s->seqs, s->b_tok, s->b_seq, s->b_logits);
    if (n == 0) return;
    /* the engine draws where the logits are (on a GPU, 128 rows of a 128K vocabulary are
     * 64 MB a step to copy and scan), but for leaders whose followers draw from the same
     * row (which then comes to the host) */
    for (int i = 0; i < n; i++) s->b_smp[i] = NULL;
    for (int i = 0; i < s->p.max_seqs; i++)
        if (s->slots[i]) s->slots[i]->by_engine = s->slots[i]->q.batch_pos >= 0;
    for (int i = 0; i < s->p.max_seqs; i++)
        if (s->slots[i] && s->slots[i]->leader && !s->slots[i]->q.forked) s->slots[i]->leader->by_engine = false;
    for (int i = 0; i < s->p.max_seqs; i++) {
        const struct sched_req *r = s->slots[i];
        if (!r || !r->by_engine) continue;
        s->b_smp[r->q.batch_pos] = r->smp;
        s->b_lp[r->q.batch_pos] = r->gp.logprobs < 0 ? -1 : n_logprobs(s, r);
    }
    struct kvq_batch b = {.n_tokens = n, .tokens = s->b_tok, .seq_ids = s->b_seq, .logits = s->b_logits,
                          .samplers = s->b_smp, .logprobs = s->b_lp};
    if (kvq_decode(s->c, &b) != 0) {
        /* nothing was written: give memory back (prefix cache first, then the youngest
         * request) and try again next step */
        char msg[256];
        snprintf(msg, sizeof msg, "%s", kvq_last_error());
        if (kvq_last_error_code() == KVQ_ERR_BUDGET) {
            if (!prefix_cache_evict_one(s->pc)) {
                struct sched_req *y = s->slots[sched_policy_youngest(&s->pol, s->seqs)->slot];
                fail(s, y, 503, "the KV cache budget is exhausted by other requests; retry later");
            }
            return;
        }
        for (int i = 0; i < s->p.max_seqs; i++)
            if (s->slots[i] && (s->slots[i]->q.chunk || s->slots[i]->q.has_pending)) fail(s, s->slots[i], 500, msg);
        return;
    }
    s->n_draws = 0;
    for (int i = 0; i < s->p.max_seqs; i++) {
        struct sched_req *r = s->slots[i];
        if (!r) continue;
        if (r->q.has_pending) {
            r->q.has_pending = false;
            if (!push_fed(r, r->q.pending)) {
                fail(s, r, 500, "out of memory");
                continue;
            }
        }
        r->q.prefilled += r->q.chunk;
        /* a prompt just done is held at once (sharing its blocks), so requests that
         * arrive while this one decodes reuse it; the whole sequence replaces it later */
        if (s->pc && r->q.chunk > 0 && r->q.prefilled == r->n_tokens && kvq_seq_len(s->c, r->q.slot) == r->n_tokens)
            prefix_cache_store(s->pc, r->q.slot, r->cache_key, r->tokens, r->n_tokens, false, r->res.cached_tokens);
        if (r->q.batch_pos >= 0) {
            r->row = r->q.batch_pos;
            s->draws[s->n_draws++] = r;
        }
    }
    fork_followers(s);
    atomic_store_explicit(&s->next_draw, 0, memory_order_relaxed);
    int on_host = 0;
    for (int i = 0; i < s->n_draws; i++) on_host += !s->draws[i]->by_engine;
    if (on_host > 1) kvq_run_parallel(s->c, draw_task, s);
    else draw_task(s, 0, 1);
    const int sampled = s->n_draws;
    for (int i = 0; i < sampled; i++) next_token(s, s->draws[i]);
    wake_readers(s, s->draws, sampled); /* before retire lets go of those that ended */
    for (int i = 0; i < sampled; i++) /* answered without a next token */
        if (!s->draws[i]->q.has_pending) retire(s, s->draws[i], true);
    double t = now_s();
    s->rate_tokens += (uint64_t)sampled;
    pthread_mutex_lock(&s->mu);
    s->st.generated_tokens += (uint64_t)sampled;
    if (t - s->rate_t0 >= 1.0) {
        s->st.decode_tok_s = s->rate_tokens / (t - s->rate_t0);
        s->rate_t0 = t;
        s->rate_tokens = 0;
    }
    pthread_mutex_unlock(&s->mu);
}

/* The KV bytes in use are counted over every cache of every layer (1-2 ms with 128
 * sequences of 32 layers): ten times a second while sequences run, not every step. */
#define KV_BYTES_EVERY_S 0.1

static void update_stats(struct sched *s) {
    int entries, host_entries;
    size_t bytes, host_bytes;
    prefix_cache_usage(s->pc, &entries, &bytes);
    prefix_cache_host_usage(s->pc, &host_entries, &host_bytes);
    const double t = now_s();
    const bool count = s->running == 0 || t - s->kv_bytes_t >= KV_BYTES_EVERY_S;
    const size_t kv_bytes = count ? kvq_kv_bytes(s->c) : 0;
    if (count) s->kv_bytes_t = t;
    pthread_mutex_lock(&s->mu);
    s->st.queued = s->queued;
    s->st.running = s->running;
    if (count) s->st.kv_bytes = kv_bytes;
    s->st.kv_budget = kvq_kv_budget(s->c);
    s->st.kv_blocks = kvq_kv_blocks(s->c);
    s->st.cache_entries = entries;
    s->st.cache_bytes = bytes;
    s->st.cache_host_entries = host_entries;
    s->st.cache_host_bytes = host_bytes;
    if (s->running == 0) s->st.decode_tok_s = 0;
    pthread_mutex_unlock(&s->mu);
}

static void *run(void *arg) {
    struct sched *s = arg;
    bool busy = false;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (busy && !s->stop && s->queued == 0 && s->running == 0) {
            /* going idle after a burst: hand the memory freed since (request buffers,
             * the connection threads' malloc arenas) back to the system, so the
             * server's RSS falls back instead of staying at its peak */
            pthread_mutex_unlock(&s->mu);
            malloc_trim(0);
            pthread_mutex_lock(&s->mu);
        }
        busy = true;
        /* nothing to run: long finished entries of the prefix cache are converted now,
         * one at a time, new work first */
        while (!s->stop && s->queued == 0 && s->running == 0 && s->pc) {
            pthread_mutex_unlock(&s->mu);
            const bool more = prefix_cache_convert_one(s->pc);
            if (more) update_stats(s);
            pthread_mutex_lock(&s->mu);
            if (!more) break;
        }
        while (!s->stop && s->queued == 0 && s->running == 0) {
            s->rate_t0 = now_s();
            s->rate_tokens = 0;
            pthread_cond_wait(&s->cv, &s->mu);
        }
        bool stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        step(s);
        update_stats(s);
    }
    return NULL;
}

struct sched *sched_start(struct kvq_model *m, struct kvq_context *c, struct prefix_cache *pc,
                          const struct sched_params *p) {
    struct sched *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->m = m;
    s->c = c;
    s->pc = pc;
    s->p = *p;
    s->n_ctx = kvq_context_n_ctx(c);
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    s->n_vocab = info.n_vocab;
    s->eog = malloc(sizeof *s->eog * (size_t)info.n_vocab);
    if (!s->eog) {
        free(s);
        return NULL;
    }
    for (kvq_token t = 0; t < info.n_vocab; t++)
        if (kvq_token_is_eog(m, t)) s->eog[s->n_eog++] = t;
    size_t f16_token_bytes = 0;
    if (p->kv.k_bits < 16 || p->kv.v_bits < 16) {
        struct kvq_kv_config f16;
        kvq_kv_config_default(&f16);
        f16_token_bytes = kvq_kv_token_bytes(m, &f16);
    }
    sched_policy_init(&s->pol, p->max_seqs, p->prefill_chunk, p->step_tokens, s->n_ctx, kvq_kv_budget(c),
                      kvq_kv_token_bytes(m, &p->kv), kvq_kv_window_bytes(m, &p->kv), f16_token_bytes);
    s->pol.offsets_at = kvq_pass_split_tokens(c);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->wmu, NULL);
    pthread_cond_init(&s->wcv, NULL);
    int cap = p->step_tokens + p->max_seqs + p->prefill_chunk;
    s->slots = calloc((size_t)p->max_seqs, sizeof *s->slots);
    s->seqs = calloc((size_t)p->max_seqs, sizeof *s->seqs);
    s->want = malloc(sizeof *s->want * (size_t)p->max_seqs);
    s->b_tok = malloc(sizeof *s->b_tok * (size_t)cap);
    s->b_seq = malloc(sizeof *s->b_seq * (size_t)cap);
    s->b_logits = malloc(sizeof *s->b_logits * (size_t)cap);
    s->b_smp = malloc(sizeof *s->b_smp * (size_t)cap);
    s->b_lp = malloc(sizeof *s->b_lp * (size_t)cap);
    s->draws = malloc(sizeof *s->draws * (size_t)p->max_seqs);
    if (!s->slots || !s->seqs || !s->want || !s->b_tok || !s->b_seq || !s->b_logits || !s->b_smp || !s->b_lp || !s->draws) {
        sched_free(s);
        return NULL;
    }
    update_stats(s);
    s->waker_on = pthread_create(&s->waker, NULL, waker_run, s) == 0; /* else the scheduler wakes them */
    if (pthread_create(&s->thread, NULL, run, s) != 0) {
        sched_free(s);
        return NULL;
    }
    s->started = true;
    return s;
}

static void waker_stop(struct sched *s) {
    if (!s->waker_on) return;
    pthread_mutex_lock(&s->wmu);
    s->stop_waker = true;
    pthread_cond_signal(&s->wcv);
    pthread_mutex_unlock(&s->wmu);
    pthread_join(s->waker, NULL); /* it wakes what is queued first */
    s->waker_on = false;
}

void sched_stop(struct sched *s) {
    if (!s || !s->started) return;
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    s->started = false;
    waker_stop(s);
    for (int i = 0; i < s->p.max_seqs; i++)
        if (s->slots[i]) fail(s, s->slots[i], 503, "the server is shutting down");
    struct sched_req *r;
    while ((r = queue_pop(s))) {
        end_request(r, NULL, 503, "the server is shutting down");
        sched_req_release(r);
    }
}

void sched_free(struct sched *s) {
    if (!s) return;
    sched_stop(s);
    waker_stop(s); /* started where the scheduler thread was not */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->wmu);
    pthread_cond_destroy(&s->wcv);
    free(s->to_wake);
    free(s->waking);
    free(s->slots);
    free(s->seqs);
    free(s->want);
    free(s->b_tok);
    free(s->b_seq);
    free(s->b_logits);
    free(s->b_smp);
    free(s->b_lp);
    free(s->draws);
    free(s->eog);
    free(s);
}

void sched_get_stats(struct sched *s, struct sched_stats *st) {
    pthread_mutex_lock(&s->mu);
    *st = s->st;
    pthread_mutex_unlock(&s->mu);
}
