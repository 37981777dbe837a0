/* The prefix cache's remote tier: prefixes shared by several replicas through a
 * Redis or Valkey store (hiredis), block by block. A value is one block of 64 tokens
 * (kvq_prefix_encode_blocks's bytes: every layer's rows of those positions, the model
 * and KV-format identity, the block's tokens, a checksum) behind a short header naming
 * its namespace and key. Its key is a chain hash of the tokens up to the block's end,
 * namespaced by the replica's space (model fingerprint and KV formats) and the
 * request's prompt_cache_key, so a lookup asks for a prompt's blocks beyond what the
 * replica holds itself: one pipelined round trip finds the run the store holds, a
 * second fetches it. Keys carry a TTL; the store's own eviction bounds its memory.
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

#define PREFIX_REMOTE_BLOCK KVQ_BLOCK_TOKENS /* tokens per key */

struct prefix_remote_params {
    const char *url;      /* redis://[USER@]HOST[:PORT][/DB] or unix:///PATH[?db=DB] */
    const char *auth_file; /* the password's file (its first line); NULL: $KVQ_PREFIX_CACHE_REMOTE_AUTH, if set */
    int ttl_s;            /* of every key written */
};

struct prefix_remote;
/* Checks the URL (NULL and a message in err for a bad one) and tries the store once:
 * an unreachable store is logged, not an error. */
struct prefix_remote *prefix_remote_new(const struct prefix_remote_params *p, char *err, size_t err_size);
void prefix_remote_free(struct prefix_remote *r);
/* The largest value a lookup reads (a block's bound, known once the model is): set
 * before the first lookup (until then, none is read). */
void prefix_remote_set_max_value(struct prefix_remote *r, size_t bytes);

/* Lookup thread: the end of the run of toks's blocks (whole blocks of the first n
 * tokens) that the store holds under (space, ns) from block `first` on, without
 * reading them (one pipelined STRLEN each); `first` when it holds none (a miss). A
 * value over the bound is refused unread: counted as rejected and deleted. */
int prefix_remote_probe(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n,
                        int first);
/* Called with each fetched block's bytes, in order: 1 when taken, 0 when it is not a
 * valid block for the request (then counted as rejected and deleted from the store),
 * -1 when there is no room for it now. */
typedef int (*prefix_remote_accept)(void *ctx, int block, const void *data, size_t len);
/* Lookup thread: fetches blocks [first, last) of toks in one pipelined round trip and
 * hands them to accept in order, up to the first one missing, not taken, or whose
 * header does not name this namespace and key (rejected). Returns how many were taken
 * (a hit when any). Each command times out after 0.3 s. */
int prefix_remote_fetch(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int first,
                        int last, prefix_remote_accept accept, void *ctx);

/* Encodes blocks [first, first + count) of the entry being published into *data
 * (malloc'd), lens[i] bytes each; 0, or -1 (logged). */
typedef int (*prefix_remote_encode)(void *ctx, int first, int count, void **data, size_t *lens);
/* Writer thread: publishes the whole blocks of an entry of n tokens under (space, ns):
 * the TTL of the blocks the store holds starts again (one pipelined EXPIRE each), and
 * the blocks from the first one it lacks on are encoded and sent in one pipeline. */
void prefix_remote_put(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n,
                       prefix_remote_encode encode, void *ctx);

struct prefix_remote_stats {
    uint64_t hits, misses, bytes_read, bytes_written, tokens_written, errors, rejected;
    bool up; /* the last command (either connection) reached the store */
};
/* Any thread. */
void prefix_remote_stats(const struct prefix_remote *r, struct prefix_remote_stats *st);

#endif
