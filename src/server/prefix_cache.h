/* The prefix cache: finished sequences held with kvq_prefix_hold together with
 * their tokens, so a new request attaches the longest cached prefix of its prompt
 * by reference (no copy) and prefills only the rest. A byte budget with LRU
 * eviction; optionally persisted to a folder and reloaded at start. Entries are
 * kept in the live cache format. Used from the scheduler thread only. */
#ifndef KVQ_SERVER_PREFIX_CACHE_H
#define KVQ_SERVER_PREFIX_CACHE_H

#include <stdbool.h>
#include <stddef.h>

#include "kvq.h"

struct prefix_cache;

/* budget: bytes of entries (estimated from their token counts); dir: NULL or a
 * folder to persist entries in (its valid entries are loaded now, newest first). */
struct prefix_cache *prefix_cache_new(struct kvq_context *c, const struct kvq_model *m,
                                      const struct kvq_kv_config *kv, size_t budget, const char *dir);
void prefix_cache_free(struct prefix_cache *pc);

/* Attaches to seq the longest cached prefix of toks in namespace ns (NULL: none),
 * at most max_use tokens; every candidate is compared token by token. Returns the
 * tokens reused (0: a miss, seq left empty). */
int prefix_cache_fetch(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int max_use);
/* Holds seq's state (it holds the n tokens toks) as an entry of namespace ns. */
void prefix_cache_store(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int n);
/* Drops the least recently used entry (to give KV memory back); false when empty. */
bool prefix_cache_evict_one(struct prefix_cache *pc);
void prefix_cache_usage(const struct prefix_cache *pc, int *entries, size_t *bytes);

#endif
