/* The prefix cache's remote tier: entries shared by several replicas through a
 * Redis or Valkey store (hiredis). A value is an entry's file (kvq_prefix_encode's
 * bytes: checksum, model and KV-config identity, token ids) behind a short header
 * naming its namespace. Entries are found by their token prefixes: every 64-token
 * block boundary of an entry has an index key, a chain hash of the tokens up to it,
 * namespaced by the replica's space (model fingerprint and KV formats) and the
 * request's prompt_cache_key; a lookup asks for all of a prompt's boundaries in one
 * MGET and fetches the entry of the longest. Keys carry a TTL; the store's own
 * eviction bounds its memory.
 *
 * The store going away never fails a request: an error closes the connection, is
 * logged when the store turns unreachable (and again when it is back), and the next
 * attempt waits for a backoff (0.25 s doubling to 1 s); meanwhile lookups miss and
 * writes are dropped. Lookups run on one thread (the scheduler's) and writes on
 * another (the prefix cache's writer); each has its own connection. */
#ifndef KVQ_SERVER_PREFIX_REMOTE_H
#define KVQ_SERVER_PREFIX_REMOTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvq.h"

#define PREFIX_REMOTE_BLOCK 64 /* tokens per index key */

struct prefix_remote_params {
    const char *url;      /* redis://[USER@]HOST[:PORT][/DB] or unix:///PATH[?db=DB] */
    const char *auth_file; /* the password's file (its first line); NULL: $KVQ_PREFIX_CACHE_REMOTE_AUTH, if set */
    int ttl_s;            /* of every key written */
    size_t max_value;     /* larger values are refused unread */
};

struct prefix_remote;
/* Checks the URL (NULL and a message in err for a bad one) and tries the store once:
 * an unreachable store is logged, not an error. */
struct prefix_remote *prefix_remote_new(const struct prefix_remote_params *p, char *err, size_t err_size);
void prefix_remote_free(struct prefix_remote *r);

/* Called with an entry's file bytes: 1 when they were good and taken, 0 when they are
 * not a valid entry for the request, -1 when there is no room for them now. */
typedef int (*prefix_remote_accept)(void *ctx, const void *data, size_t len);

/* Lookup thread: finds the entry stored under (space, ns) holding the longest prefix
 * of toks that is longer than `have` tokens (whole blocks of the first n tokens), and
 * hands its bytes to accept. A value accept refuses, or whose header is not this
 * namespace's, is counted as rejected and deleted from the store. No further entry is
 * tried 0.3 s into the lookup, and each command times out after 0.3 s. True on a hit. */
bool prefix_remote_find(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n, int have,
                        prefix_remote_accept accept, void *ctx);
/* Writer thread: stores an entry (file bytes data) of n tokens under (space, ns),
 * unless the store holds it already. */
void prefix_remote_put(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n,
                       const void *data, size_t len);

struct prefix_remote_stats {
    uint64_t hits, misses, bytes_read, bytes_written, tokens_written, errors, rejected;
    bool up; /* the last command (either connection) reached the store */
};
/* Any thread. */
void prefix_remote_stats(const struct prefix_remote *r, struct prefix_remote_stats *st);

#endif
