/* The prefix cache: finished sequences (and prompts as soon as they are prefilled)
 * held as KV prefixes together with their tokens, so a new request attaches the
 * longest cached prefix of its prompt and prefills only the rest. Entries of at
 * least min_tokens are stored in a smaller format when one is given (re-encoded on
 * store, converted back on attach; see prefix_cache_store for which); shorter ones
 * share the sequence's blocks, no copy. A byte budget with LRU eviction; optionally a
 * second budget of host memory that evicted entries move to (as their files' bytes: on
 * a GPU, out of GPU memory), attached again from there on a hit; optionally persisted to
 * a folder by a writer thread (so disk writes never stall the scheduler) and reloaded at start.
 * Called from the scheduler thread only. */
#ifndef KVQ_SERVER_PREFIX_CACHE_H
#define KVQ_SERVER_PREFIX_CACHE_H

#include <stdbool.h>
#include <stddef.h>

#include "kvq.h"

struct prefix_remote;

struct prefix_cache_params {
    const struct kvq_kv_config *kv;       /* the context's (live) config */
    const struct kvq_kv_config *store_kv; /* the format of long entries; NULL: the live one */
    int min_tokens;                       /* entries shorter than this stay in the live format */
    size_t budget;                        /* bytes of entries (estimated from their token counts) */
    size_t host_budget;                   /* bytes of evicted entries kept in host memory (0: none) */
    const char *dir; /* NULL, or a folder to persist entries in (its valid entries are loaded now, newest first) */
    struct prefix_remote *remote; /* NULL, or a store shared with other replicas (prefix_remote.h; not owned):
                                   * asked for the blocks past what the local entries give a request, and
                                   * given every finished entry's blocks in store_kv's format */
};

struct prefix_cache;

struct prefix_cache *prefix_cache_new(struct kvq_context *c, const struct kvq_model *m,
                                      const struct prefix_cache_params *p);
/* Writes what is still queued for the folder, then frees every entry. */
void prefix_cache_free(struct prefix_cache *pc);

/* Attaches to seq the longest cached prefix of toks in namespace ns (NULL: none),
 * at most max_use tokens; every candidate is compared token by token. Returns the
 * tokens reused (0: a miss, seq left empty). */
int prefix_cache_fetch(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int max_use);
/* Holds seq's state (it holds the n tokens toks) as an entry of namespace ns.
 * finished: the sequence is done. A running one's entry (its prompt) stays in the
 * live format, sharing its blocks for free, and is not written to the folder: the
 * finished sequence replaces it, converted and written once (held live until
 * prefix_cache_convert_one, where the live entry fits the budget). reused: the tokens
 * seq took from the cache; from min_tokens on the entry stays live (it shares that
 * hot prefix's blocks). A converted entry that gets a hit turns live again (the copy
 * the hit made), and so does one waiting to be converted: a hot prefix is shared by
 * reference, a cold one kept small. */
void prefix_cache_store(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int n, bool finished,
                        int reused);
/* Converts (then writes) the least recently used entry waiting for it: what the
 * scheduler does when it has nothing else to do, since a conversion holds it up (0.13
 * s for 272 tokens of a Llama-3-8B on the H100 machine), and what a store does before
 * it evicts anything. False when none waits. */
bool prefix_cache_convert_one(struct prefix_cache *pc);
/* Drops the least recently used entry (to give KV memory back; to host memory where
 * there is a host budget); false when empty. */
bool prefix_cache_evict_one(struct prefix_cache *pc);
void prefix_cache_usage(const struct prefix_cache *pc, int *entries, size_t *bytes);
/* The same for the entries in host memory (their files' bytes). */
void prefix_cache_host_usage(const struct prefix_cache *pc, int *entries, size_t *bytes);

/* Conversion and disk-write timings, for the log and tests. */
struct prefix_cache_stats {
    int converted_stores, converted_fetches, writes, host_stores, host_hits;
    double store_ms, fetch_ms, write_ms; /* summed */
    long converted_tokens_stored, converted_tokens_fetched;
};
void prefix_cache_stats(struct prefix_cache *pc, struct prefix_cache_stats *st);

#endif
