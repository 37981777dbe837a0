#include "server/prefix_cache.h"
#include "server/prefix_remote.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* A file to write and/or blocks to publish. The writer thread reads the entry's prefix
 * and tokens, which stay alive and unchanged until the job is done: drop() and
 * persist() take a queued job back or wait for the one being written; a conversion or
 * a hit that replaces the prefix waits until it is written. */
enum job_state { JOB_QUEUED, JOB_WRITING, JOB_DONE };
struct write_job {
    struct write_job *next;
    const struct kvq_prefix *p;
    const kvq_token *toks;
    int n;
    const char *path; /* the entry's file, or NULL */
    const char *ns;   /* the namespace to publish it in (NULL: not published) */
    enum job_state state;
};

struct entry {
    uint64_t ns;    /* hash of the namespace (prompt_cache_key) */
    kvq_token *tokens;
    int n;
    size_t bytes;
    uint64_t used;  /* LRU clock */
    struct kvq_prefix *prefix;
    bool converted; /* held in store_kv's format */
    bool pending;   /* held live until prefix_cache_convert_one converts (and writes) it */
    char *path;     /* its file, or NULL */
    bool written;   /* its file is written or queued */
    char *ns_name;  /* the namespace's name ("" for none); NULL when unknown (loaded from the folder) */
    bool published; /* its blocks are published or queued */
    struct write_job *job; /* its write, or NULL */
};

/* An entry evicted to host memory: its file's bytes (kvq_prefix_encode). */
struct host_entry {
    uint64_t ns;
    kvq_token *tokens;
    int n;
    void *data;
    size_t len;
    uint64_t used; /* LRU clock, the entries' */
};

struct prefix_cache {
    struct kvq_context *c;
    const struct kvq_model *m;
    struct kvq_kv_config kv, store_kv;
    bool convert;
    int min_tokens;
    size_t budget, bytes;
    char *dir;
    struct prefix_remote *remote;
    uint64_t space; /* the remote keys' namespace: the model and the KV formats */
    struct entry *e;
    int n, cap;
    uint64_t clock;
    struct host_entry *h; /* evicted entries in host memory, host_bytes of host_budget */
    int hn, hcap;
    size_t host_budget, host_bytes;
    /* the writer thread and its queue (under mu; cv: a job queued, a job done, stop) */
    pthread_t writer;
    bool writer_on, stopping;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct write_job *q_head, *q_tail;
    struct prefix_cache_stats st; /* writes and write_ms under mu */
};

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}
#define FNV_BASIS 0xcbf29ce484222325ULL

/* The config (per-layer bits as their text: configs without them hash as before). */
static uint64_t kv_hash(uint64_t h, const struct kvq_kv_config *kv) {
    int32_t v[] = {kv->k_bits, kv->v_bits, kv->k_group, kv->v_group, kv->max_size, kv->keep, kv->quantized_start,
                   kv->hadamard, kv->residual, kv->swa_full};
    char layers[512];
    const int n = kvq_kv_layer_bits_name(kv, layers, sizeof layers);
    return fnv1a(fnv1a(h, v, sizeof v), layers, n > 0 ? (size_t)n : 0);
}

static uint64_t ns_hash(const char *ns) { return ns && *ns ? fnv1a(FNV_BASIS, ns, strlen(ns)) : 0; }

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* Whole 64-token blocks of every layer plus the f16 window: what holding n tokens
 * in format kv pins. */
static size_t entry_bytes(const struct prefix_cache *pc, int n, const struct kvq_kv_config *kv) {
    return kvq_kv_token_bytes(pc->m, kv) * (((size_t)n + 63) / 64 * 64) + kvq_kv_window_bytes(pc->m, kv);
}

/* Ends the entry's write: takes it back from the queue when it has not started and
 * `cancel` (what it would have done is then still to do), else waits until it is
 * written. */
static void finish_job(struct prefix_cache *pc, struct entry *e, bool cancel) {
    struct write_job *j = e->job;
    if (!j) return;
    pthread_mutex_lock(&pc->mu);
    if (cancel && j->state == JOB_QUEUED) {
        struct write_job **pp = &pc->q_head, *prev = NULL;
        while (*pp != j) prev = *pp, pp = &(*pp)->next;
        *pp = j->next;
        if (pc->q_tail == j) pc->q_tail = prev;
        e->written &= !j->path;
        e->published &= !j->ns;
    } else {
        while (j->state != JOB_DONE) pthread_cond_wait(&pc->cv, &pc->mu);
    }
    pthread_mutex_unlock(&pc->mu);
    free(j);
    e->job = NULL;
}

static void drop(struct prefix_cache *pc, int i, bool unlink_file) {
    struct entry *e = &pc->e[i];
    finish_job(pc, e, true);
    if (unlink_file && e->path) remove(e->path);
    kvq_prefix_free(e->prefix);
    free(e->tokens);
    free(e->path);
    free(e->ns_name);
    pc->bytes -= e->bytes;
    pc->e[i] = pc->e[--pc->n];
}

/* Room for one more host entry; false when memory is out. */
static bool grow_host(struct prefix_cache *pc) {
    int cap = pc->hcap ? pc->hcap * 2 : 16;
    struct host_entry *v = realloc(pc->h, sizeof *v * (size_t)cap);
    if (!v) return false;
    pc->h = v;
    pc->hcap = cap;
    return true;
}

static int lru(const struct prefix_cache *pc) {
    int best = -1;
    for (int i = 0; i < pc->n; i++)
        if (best < 0 || pc->e[i].used < pc->e[best].used) best = i;
    return best;
}

static void host_drop(struct prefix_cache *pc, int k) {
    free(pc->h[k].tokens);
    free(pc->h[k].data);
    pc->host_bytes -= pc->h[k].len;
    pc->h[k] = pc->h[--pc->hn];
}

/* Entry i's bytes into host memory (its tokens taken), evicting older ones there to
 * make room; nothing where it does not fit or cannot be encoded. */
static void to_host(struct prefix_cache *pc, int i) {
    struct entry *e = &pc->e[i];
    void *data = NULL;
    size_t len = 0;
    double t0 = now_ms();
    if (kvq_prefix_encode(e->prefix, e->tokens, e->n, &data, &len) != 0) {
        fprintf(stderr, "kvq serve: cannot keep a prefix-cache entry in host memory: %s\n", kvq_last_error());
        return;
    }
    if (len > pc->host_budget || (pc->hn == pc->hcap && !grow_host(pc))) {
        free(data);
        return;
    }
    while (pc->host_bytes + len > pc->host_budget) {
        int old = 0;
        for (int k = 1; k < pc->hn; k++) old = pc->h[k].used < pc->h[old].used ? k : old;
        host_drop(pc, old);
    }
    pc->h[pc->hn++] = (struct host_entry){e->ns, e->tokens, e->n, data, len, e->used};
    pc->host_bytes += len;
    e->tokens = NULL; /* the host entry's now (drop frees NULL) */
    pc->st.host_stores++;
    fprintf(stderr, "kvq serve: cache_host_store tokens=%d bytes=%zu ms=%.2f\n", pc->h[pc->hn - 1].n, len,
            now_ms() - t0);
}

bool prefix_cache_evict_one(struct prefix_cache *pc) {
    int i = pc ? lru(pc) : -1;
    if (i < 0) return false;
    fprintf(stderr, "kvq serve: cache_evict tokens=%d bytes=%zu\n", pc->e[i].n, pc->e[i].bytes);
    if (pc->host_budget > 0) to_host(pc, i);
    drop(pc, i, true);
    return true;
}

/* Adds an entry (taking tokens, prefix and path), making room by converting entries
 * that wait for it, then by evicting LRU entries; returns its index or -1. */
static int add(struct prefix_cache *pc, struct entry e) {
    if (e.bytes > pc->budget) return -1;
    while (pc->bytes + e.bytes > pc->budget && (prefix_cache_convert_one(pc) || prefix_cache_evict_one(pc))) {
    }
    if (pc->n == pc->cap) {
        int cap = pc->cap ? pc->cap * 2 : 16;
        struct entry *v = realloc(pc->e, sizeof *v * (size_t)cap);
        if (!v) return -1;
        pc->e = v;
        pc->cap = cap;
    }
    e.used = ++pc->clock;
    pc->e[pc->n] = e;
    pc->bytes += e.bytes;
    return pc->n++;
}

static int common_prefix(const kvq_token *a, int na, const kvq_token *b, int nb) {
    int i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

static void persist(struct prefix_cache *pc, struct entry *e);

/* The entry's prefix becomes p, in store_kv's format when converted, else the live one. */
static void replace_prefix(struct prefix_cache *pc, struct entry *e, struct kvq_prefix *p, bool converted) {
    kvq_prefix_free(e->prefix);
    e->prefix = p;
    e->converted = converted;
    pc->bytes -= e->bytes;
    e->bytes = entry_bytes(pc, e->n, converted ? &pc->store_kv : &pc->kv);
    pc->bytes += e->bytes;
}

/* The entry of namespace h sharing the longest prefix with toks (-1: none), and its length. */
static int best_match(const struct prefix_cache *pc, uint64_t h, const kvq_token *toks, int max_use, int *best_len) {
    int best = -1;
    *best_len = 0;
    for (int i = 0; i < pc->n; i++) {
        if (pc->e[i].ns != h) continue;
        int len = common_prefix(pc->e[i].tokens, pc->e[i].n, toks, max_use);
        if (len > *best_len) best = i, *best_len = len;
    }
    return best;
}

/* Attaches entry `best` to seq, cut back to its first len tokens (converting a stored
 * format back to the live one); len, or 0 with seq cleared when a rotating window no
 * longer holds that shorter state (the request is then prefilled from scratch). */
static int attach_local(struct prefix_cache *pc, int seq, int best, int len) {
    double t0 = now_ms();
    if (kvq_prefix_attach(pc->c, seq, pc->e[best].prefix) != 0) {
        fprintf(stderr, "kvq serve: cannot attach a cached prefix: %s\n", kvq_last_error());
        kvq_seq_clear(pc->c, seq);
        return 0;
    }
    struct entry *e = &pc->e[best];
    if (e->pending) { /* hot: it stays live, as a converted entry turns live on a hit */
        e->pending = false;
        persist(pc, e);
    }
    if (e->converted) {
        double ms = now_ms() - t0;
        pc->st.converted_fetches++;
        pc->st.converted_tokens_fetched += e->n;
        pc->st.fetch_ms += ms;
        fprintf(stderr, "kvq serve: cache_convert fetch tokens=%d ms=%.2f\n", e->n, ms);
        /* a hit makes the entry hot: it keeps the live copy just made instead (before
         * the cut below), so later hits share its blocks again instead of converting
         * (the file keeps the small format; the budget is enforced at the next store) */
        struct kvq_prefix *live = kvq_seq_len(pc->c, seq) == e->n ? kvq_prefix_hold(pc->c, seq) : NULL;
        if (live) {
            /* the file keeps the converted prefix: its write finishes first (a wait of
             * the write's time when it has not run yet) */
            finish_job(pc, e, false);
            replace_prefix(pc, e, live, false);
        }
    }
    if (kvq_seq_keep_prefix(pc->c, seq, len) != 0 || kvq_seq_len(pc->c, seq) != len) {
        fprintf(stderr, "kvq serve: cannot attach a cached prefix: %s\n", kvq_last_error());
        kvq_seq_clear(pc->c, seq);
        return 0;
    }
    e->used = ++pc->clock;
    return len;
}

/* A remote lookup's request: the sequence its blocks extend. */
struct block_offer {
    struct prefix_cache *pc;
    int seq;
    const kvq_token *toks;
    size_t bytes;
};

/* prefix_remote_accept: a block another replica stored joins the sequence when it
 * decodes (checksum, model, KV format, position, tokens). */
static int take_block(void *ctx, int block, const void *data, size_t len) {
    struct block_offer *o = ctx;
    if (kvq_seq_append_block(o->pc->c, o->seq, &o->pc->store_kv, data, len, o->toks) == 0) {
        o->bytes += len;
        return 1;
    }
    enum kvq_err code = kvq_last_error_code();
    fprintf(stderr, "kvq serve: prefix cache remote: %s block %d: %s\n",
            code == KVQ_ERR_FORMAT || code == KVQ_ERR_INVALID ? "refusing" : "no room for", block, kvq_last_error());
    return code == KVQ_ERR_FORMAT || code == KVQ_ERR_INVALID ? 0 : -1;
}

/* Extends seq, which holds the first `have` tokens of toks, with the blocks the store
 * holds past the whole blocks of that local match (only those are fetched). Returns
 * the tokens seq holds then: fewer than `have` when the blocks fell short of the part
 * of a block cut off to take them (the caller attaches the local entry again). */
static int fetch_remote(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int max_use, int have) {
    const int B = PREFIX_REMOTE_BLOCK, first = have / B;
    if (max_use / B <= first) return have;
    double t0 = now_ms();
    int last = prefix_remote_probe(pc->remote, pc->space, ns, toks, max_use, first);
    if (last * B <= have || kvq_seq_keep_prefix(pc->c, seq, first * B) != 0) return have;
    struct block_offer o = {pc, seq, toks, 0};
    int taken = prefix_remote_fetch(pc->remote, pc->space, ns, toks, first, last, take_block, &o);
    int len = kvq_seq_len(pc->c, seq);
    if (taken)
        fprintf(stderr, "kvq serve: cache_remote_hit tokens=%d local=%d blocks=%d bytes=%zu ms=%.2f\n", len, first * B,
                taken, o.bytes, now_ms() - t0);
    return len;
}

/* Host entry k back among the entries (decoded into KV blocks; it leaves host memory):
 * the entry's index, or -1 (then dropped). */
static int from_host(struct prefix_cache *pc, int k) {
    struct host_entry x = pc->h[k];
    double t0 = now_ms();
    struct kvq_kv_config kv;
    struct kvq_prefix *p = kvq_prefix_decode(pc->c, x.data, x.len, "a prefix-cache entry in host memory", NULL);
    pc->h[k].tokens = NULL; /* the entry's from here, or freed below */
    host_drop(pc, k);
    if (!p) {
        fprintf(stderr, "kvq serve: cannot attach a prefix-cache entry from host memory: %s\n", kvq_last_error());
        free(x.tokens);
        return -1;
    }
    kvq_prefix_kv_config(p, &kv);
    const bool converted = !kvq_kv_same_format(&kv, &pc->kv);
    struct entry e = {.ns = x.ns, .tokens = x.tokens, .n = x.n, .bytes = entry_bytes(pc, x.n, converted ? &kv : &pc->kv),
                      .prefix = p, .converted = converted};
    const int i = add(pc, e);
    if (i < 0) {
        kvq_prefix_free(p);
        free(x.tokens);
        return -1;
    }
    pc->st.host_hits++;
    fprintf(stderr, "kvq serve: cache_host_hit tokens=%d ms=%.2f\n", x.n, now_ms() - t0);
    return i;
}

/* The host entry of namespace h sharing the longest prefix with toks (-1: none), and its length. */
static int host_match(const struct prefix_cache *pc, uint64_t h, const kvq_token *toks, int max_use, int *len) {
    int best = -1;
    *len = 0;
    for (int k = 0; k < pc->hn; k++) {
        int l = pc->h[k].ns == h ? common_prefix(pc->h[k].tokens, pc->h[k].n, toks, max_use) : 0;
        if (l > *len) best = k, *len = l;
    }
    return best;
}

int prefix_cache_fetch(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int max_use) {
    int best_len, best = best_match(pc, ns_hash(ns), toks, max_use, &best_len), host_len;
    /* a longer match in host memory by a block at least (what attaching it saves) */
    const int k = host_match(pc, ns_hash(ns), toks, max_use, &host_len);
    if (k >= 0 && host_len >= best_len + KVQ_BLOCK_TOKENS && from_host(pc, k) >= 0)
        best = best_match(pc, ns_hash(ns), toks, max_use, &best_len); /* its add may have moved entries */
    int got = best >= 0 ? attach_local(pc, seq, best, best_len) : 0;
    if (pc->remote) {
        int len = fetch_remote(pc, seq, ns, toks, max_use, got);
        if (len < got) {
            kvq_seq_clear(pc->c, seq);
            len = attach_local(pc, seq, best, best_len);
        }
        got = len;
    }
    return got;
}

/* Writes one entry: kvq_prefix_save writes a temporary file and renames it into
 * place, so a crash never leaves a half-written entry under a name the loader reads;
 * the file is checksummed and carries the model's fingerprint. Writer thread. */
static void write_file(struct prefix_cache *pc, const struct write_job *j) {
    double t0 = now_ms();
    if (kvq_prefix_save(j->p, j->path, j->toks, j->n, NULL) != 0) {
        fprintf(stderr, "kvq serve: cannot persist a prefix-cache entry: %s\n", kvq_last_error());
        return;
    }
    double ms = now_ms() - t0;
    struct stat sb;
    fprintf(stderr, "kvq serve: cache_write tokens=%d bytes=%lld ms=%.2f\n", j->n,
            stat(j->path, &sb) == 0 ? (long long)sb.st_size : -1LL, ms);
    pthread_mutex_lock(&pc->mu);
    pc->st.writes++;
    pc->st.write_ms += ms;
    pthread_mutex_unlock(&pc->mu);
}

struct publication {
    struct prefix_cache *pc;
    const struct write_job *j;
};

/* prefix_remote_encode: the entry's blocks in the stored format (re-encoded here, on
 * the writer thread, from a live entry). */
static int encode_blocks(void *ctx, int first, int count, void **data, size_t *lens) {
    const struct publication *x = ctx;
    double t0 = now_ms();
    if (kvq_prefix_encode_blocks(x->j->p, &x->pc->store_kv, x->j->toks, first, count, data, lens) != 0) {
        fprintf(stderr, "kvq serve: cannot publish a prefix-cache entry: %s\n", kvq_last_error());
        return -1;
    }
    fprintf(stderr, "kvq serve: cache_publish tokens=%d blocks=%d..%d ms=%.2f\n", x->j->n, first, first + count - 1,
            now_ms() - t0);
    return 0;
}

/* Sends the entry's blocks the store lacks. Writer thread. */
static void publish(struct prefix_cache *pc, const struct write_job *j) {
    struct publication x = {pc, j};
    prefix_remote_put(pc->remote, pc->space, j->ns, j->toks, j->n, encode_blocks, &x);
}

static void write_entry(struct prefix_cache *pc, const struct write_job *j) {
    if (j->path) write_file(pc, j);
    if (j->ns) publish(pc, j);
}

static void *writer_main(void *arg) {
    struct prefix_cache *pc = arg;
    pthread_mutex_lock(&pc->mu);
    for (;;) {
        while (!pc->q_head && !pc->stopping) pthread_cond_wait(&pc->cv, &pc->mu);
        struct write_job *j = pc->q_head;
        if (!j) break; /* stopping, and everything queued is written */
        pc->q_head = j->next;
        if (!pc->q_head) pc->q_tail = NULL;
        j->state = JOB_WRITING;
        pthread_mutex_unlock(&pc->mu);
        write_entry(pc, j);
        pthread_mutex_lock(&pc->mu);
        j->state = JOB_DONE;
        pthread_cond_broadcast(&pc->cv);
    }
    pthread_mutex_unlock(&pc->mu);
    return NULL;
}

/* Queues for the writer thread what the entry still lacks: its file where there is a
 * folder (in its final format: not while it waits to be converted; the name is fixed
 * now, so an eviction can remove the file) and its blocks' publication where there is
 * a store (in the stored format whatever the entry's; a live entry's blocks are
 * re-encoded by the writer). A job of the entry's that has not started is taken back
 * and redone with this one; one that has is waited for (only when there is more to do:
 * a hit on an entry being published does not wait for it). */
static bool lacks_file(const struct prefix_cache *pc, const struct entry *e) {
    return pc->dir && !e->pending && !e->written;
}

static bool lacks_publication(const struct prefix_cache *pc, const struct entry *e) {
    return pc->remote && !e->published && e->ns_name;
}

static void persist(struct prefix_cache *pc, struct entry *e) {
    if (!lacks_file(pc, e) && !lacks_publication(pc, e)) return; /* e.g. a hit while its publication runs */
    finish_job(pc, e, true);
    const bool file = lacks_file(pc, e);
    const char *ns = lacks_publication(pc, e) ? e->ns_name : NULL;
    struct write_job *j = calloc(1, sizeof *j);
    if (j && file && !e->path) {
        uint64_t th = fnv1a(FNV_BASIS, e->tokens, sizeof *e->tokens * (size_t)e->n);
        size_t len = strlen(pc->dir) + 64;
        if ((e->path = malloc(len)))
            snprintf(e->path, len, "%s/%016" PRIx64 "-%016" PRIx64 ".kvq", pc->dir, e->ns, th);
    }
    if (!j || (file && !e->path)) {
        free(j);
        fprintf(stderr, "kvq serve: cannot persist a prefix-cache entry: out of memory\n");
        return;
    }
    if (kvq_prefix_fetch(e->prefix) != 0) { /* the writer reads the rows: in host memory first */
        free(j);
        fprintf(stderr, "kvq serve: cannot persist a prefix-cache entry: %s\n", kvq_last_error());
        return;
    }
    *j = (struct write_job){NULL, e->prefix, e->tokens, e->n, file ? e->path : NULL, ns, JOB_QUEUED};
    e->written |= file;
    e->published |= ns != NULL;
    e->job = j;
    pthread_mutex_lock(&pc->mu);
    if (pc->q_tail) pc->q_tail->next = j;
    else pc->q_head = j;
    pc->q_tail = j;
    pthread_cond_broadcast(&pc->cv);
    pthread_mutex_unlock(&pc->mu);
}

/* Counts and logs an entry just converted to store_kv's format, in ms. */
static void log_converted(struct prefix_cache *pc, const struct entry *e, double ms) {
    pc->st.converted_stores++;
    pc->st.converted_tokens_stored += e->n;
    pc->st.store_ms += ms;
    fprintf(stderr,
            "kvq serve: cache_store tokens=%d bytes=%zu format=K%d/V%d convert_ms=%.2f (live format: %zu bytes)\n", e->n,
            e->bytes, pc->store_kv.k_bits, pc->store_kv.v_bits, ms, entry_bytes(pc, e->n, &pc->kv));
}

void prefix_cache_store(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int n, bool finished,
                        int reused) {
    uint64_t h = ns_hash(ns);
    /* a sequence built on a hot cached prefix shares that prefix's blocks: held live it
     * costs only its own tokens, converted it would be a private copy of all of them */
    bool convert = pc->convert && finished && n >= pc->min_tokens && reused < pc->min_tokens;
    if (n <= 0 || entry_bytes(pc, n, convert ? &pc->store_kv : &pc->kv) > pc->budget) return;
    for (int i = 0; i < pc->n; i++) {
        struct entry *e = &pc->e[i];
        if (e->ns != h) continue;
        int common = common_prefix(e->tokens, e->n, toks, n);
        if (common == n) { /* already covered by a longer (or equal) entry */
            e->used = ++pc->clock;
            return;
        }
        if (common == e->n) drop(pc, i--, true); /* the new entry covers this one */
    }
    kvq_token *copy = malloc(sizeof *copy * (size_t)n);
    char *ns_name = strdup(ns ? ns : "");
    if (!copy || !ns_name) {
        fprintf(stderr, "kvq serve: cannot hold a prefix: out of memory\n");
        free(copy);
        free(ns_name);
        return;
    }
    memcpy(copy, toks, sizeof *copy * (size_t)n);
    /* converting takes a while (0.13 s for 272 tokens of a Llama-3-8B): held live now
     * and converted when the server has nothing else to do, where the live entry fits */
    const bool later = convert && entry_bytes(pc, n, &pc->kv) <= pc->budget;
    if (later) convert = false;
    double t0 = now_ms();
    struct kvq_prefix *p = convert ? kvq_prefix_hold_as(pc->c, seq, &pc->store_kv) : NULL;
    if (convert && !p) { /* e.g. no room in the KV budget for the copy: share the live blocks */
        fprintf(stderr, "kvq serve: cannot convert a prefix (%s); keeping the live format\n", kvq_last_error());
        convert = false;
    }
    double ms = now_ms() - t0;
    if (!p) p = kvq_prefix_hold(pc->c, seq);
    if (!p) {
        fprintf(stderr, "kvq serve: cannot hold a prefix: %s\n", kvq_last_error());
        free(copy);
        free(ns_name);
        return;
    }
    struct entry e = {.ns = h, .tokens = copy, .n = n, .prefix = p, .converted = convert, .pending = later,
                      .ns_name = ns_name, .bytes = entry_bytes(pc, n, convert ? &pc->store_kv : &pc->kv)};
    int i = add(pc, e);
    if (i < 0) {
        kvq_prefix_free(p);
        free(copy);
        free(ns_name);
        return;
    }
    if (convert) log_converted(pc, &pc->e[i], ms);
    else
        fprintf(stderr, "kvq serve: cache_store tokens=%d bytes=%zu%s\n", n, pc->e[i].bytes, later ? " (to convert)" : "");
    if (finished) persist(pc, &pc->e[i]); /* waiting for its conversion: published now, its file later */
}

bool prefix_cache_convert_one(struct prefix_cache *pc) {
    struct entry *e = NULL;
    for (int i = 0; pc && i < pc->n; i++)
        if (pc->e[i].pending && (!e || pc->e[i].used < e->used)) e = &pc->e[i];
    if (!e) return false;
    e->pending = false;
    finish_job(pc, e, true); /* its publication reads the live prefix */
    double t0 = now_ms();
    struct kvq_prefix *p = kvq_prefix_convert(e->prefix, &pc->store_kv);
    if (!p) {
        fprintf(stderr, "kvq serve: cannot convert a prefix (%s); keeping the live format\n", kvq_last_error());
    } else {
        replace_prefix(pc, e, p, true);
        log_converted(pc, e, now_ms() - t0);
    }
    persist(pc, e);
    return true;
}

void prefix_cache_usage(const struct prefix_cache *pc, int *entries, size_t *bytes) {
    *entries = pc ? pc->n : 0;
    *bytes = pc ? pc->bytes : 0;
}

void prefix_cache_host_usage(const struct prefix_cache *pc, int *entries, size_t *bytes) {
    *entries = pc ? pc->hn : 0;
    *bytes = pc ? pc->host_bytes : 0;
}

void prefix_cache_stats(struct prefix_cache *pc, struct prefix_cache_stats *st) {
    pthread_mutex_lock(&pc->mu);
    *st = pc->st;
    pthread_mutex_unlock(&pc->mu);
}

struct found {
    char *path;
    uint64_t ns;
    time_t mtime;
};

static int newest_first(const void *a, const void *b) {
    time_t x = ((const struct found *)a)->mtime, y = ((const struct found *)b)->mtime;
    return x < y ? 1 : x > y ? -1 : 0;
}


/* Loads the folder's entries, newest first, while they fit the budget; a file that
 * does not load (corrupt, truncated, another model or KV config) is skipped with a
 * log line and left alone. Entries keep the format they were written in. */
static void load_dir(struct prefix_cache *pc) {
    DIR *d = opendir(pc->dir);
    if (!d) {
        fprintf(stderr, "kvq serve: prefix cache folder %s: %s\n", pc->dir, strerror(errno));
        return;
    }
    struct found *f = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        uint64_t ns, th;
        char tail[8];
        if (sscanf(de->d_name, "%16" SCNx64 "-%16" SCNx64 "%7s", &ns, &th, tail) != 3 || strcmp(tail, ".kvq")) continue;
        size_t len = strlen(pc->dir) + strlen(de->d_name) + 2;
        char *path = malloc(len);
        struct stat st;
        if (!path) break;
        snprintf(path, len, "%s/%s", pc->dir, de->d_name);
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(path);
            continue;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            struct found *g = realloc(f, sizeof *g * (size_t)cap);
            if (!g) {
                free(path);
                break;
            }
            f = g;
        }
        f[n++] = (struct found){path, ns, st.st_mtime};
    }
    closedir(d);
    if (n > 0) qsort(f, (size_t)n, sizeof *f, newest_first); /* f is NULL when the folder is empty */
    int loaded = 0;
    for (int i = 0; i < n; i++) {
        struct kvq_seq_extra extra = {0};
        struct kvq_kv_config fkv;
        struct kvq_prefix *p = kvq_seq_file_kv_config(f[i].path, &fkv) == 0 ? kvq_prefix_load(pc->c, f[i].path, &extra)
                                                                              : NULL;
        if (!p) {
            fprintf(stderr, "kvq serve: prefix cache: skipping %s: %s\n", f[i].path, kvq_last_error());
            free(f[i].path);
            continue;
        }
        bool converted = !kvq_kv_same_format(&fkv, &pc->kv);
        size_t bytes = entry_bytes(pc, extra.n_tokens, converted ? &fkv : &pc->kv);
        bool ok = extra.n_tokens > 0 && extra.n_tokens == kvq_prefix_len(p) && pc->bytes + bytes <= pc->budget;
        struct entry e = {.ns = f[i].ns, .tokens = extra.tokens, .n = extra.n_tokens, .bytes = bytes, .prefix = p,
                          .converted = converted, .path = f[i].path, .written = true};
        if (ok && add(pc, e) >= 0) {
            extra.tokens = NULL;
            loaded++;
        } else {
            fprintf(stderr, "kvq serve: prefix cache: skipping %s: %s\n", f[i].path,
                    ok ? "out of memory" : "no tokens, or over the prefix-cache budget");
            kvq_prefix_free(p);
            free(f[i].path);
        }
        kvq_seq_extra_free(&extra);
    }
    free(f);
    fprintf(stderr, "kvq serve: prefix cache: loaded %d entries (%zu bytes) from %s\n", loaded, pc->bytes, pc->dir);
}

struct prefix_cache *prefix_cache_new(struct kvq_context *c, const struct kvq_model *m,
                                      const struct prefix_cache_params *p) {
    struct prefix_cache *pc = calloc(1, sizeof *pc);
    if (!pc) return NULL;
    pc->c = c;
    pc->m = m;
    pc->budget = p->budget;
    pc->host_budget = p->host_budget;
    pc->kv = *p->kv;
    pc->store_kv = p->store_kv ? *p->store_kv : *p->kv;
    pc->convert = !kvq_kv_same_format(&pc->store_kv, &pc->kv);
    pc->min_tokens = p->min_tokens;
    pc->remote = p->remote;
    pc->space = kv_hash(kv_hash(fnv1a(FNV_BASIS, &(uint64_t){kvq_model_fingerprint(m)}, 8), &pc->kv), &pc->store_kv);
    pthread_mutex_init(&pc->mu, NULL);
    pthread_cond_init(&pc->cv, NULL);
    if (p->dir && !(pc->dir = strdup(p->dir))) {
        prefix_cache_free(pc);
        return NULL;
    }
    if (pc->dir) {
        if (mkdir(pc->dir, 0755) != 0 && errno != EEXIST)
            fprintf(stderr, "kvq serve: cannot create %s: %s\n", pc->dir, strerror(errno));
        load_dir(pc);
    }
    if (pc->dir || pc->remote) {
        if (pthread_create(&pc->writer, NULL, writer_main, pc) != 0) {
            prefix_cache_free(pc);
            return NULL;
        }
        pc->writer_on = true;
    }
    return pc;
}

void prefix_cache_free(struct prefix_cache *pc) {
    if (!pc) return;
    for (int i = 0; pc->writer_on && i < pc->n; i++) /* not converted yet: written as they are */
        if (pc->e[i].pending) {
            pc->e[i].pending = false;
            persist(pc, &pc->e[i]);
        }
    if (pc->writer_on) {
        pthread_mutex_lock(&pc->mu);
        pc->stopping = true;
        pthread_cond_broadcast(&pc->cv);
        pthread_mutex_unlock(&pc->mu);
        pthread_join(pc->writer, NULL);
    }
    while (pc->n) drop(pc, pc->n - 1, false);
    while (pc->hn) host_drop(pc, pc->hn - 1);
    free(pc->h);
    pthread_mutex_destroy(&pc->mu);
    pthread_cond_destroy(&pc->cv);
    free(pc->e);
    free(pc->dir);
    free(pc);
}
