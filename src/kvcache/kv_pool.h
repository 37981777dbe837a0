/* A pool of KV blocks with a byte budget. A block holds KV_BLOCK_TOKENS consecutive
 * tokens of one layer (for each KV head: its keys, then its values) in that layer's row format;
 * caches hold blocks by reference, so sequences that share a prefix share its blocks.
 *
 * Blocks are refcounted: kv_block_unref() returns a block to the pool when the last
 * holder lets go. Freed blocks are kept on a free list per size and handed out again,
 * so a steady decode loop allocates nothing. The pool is used from one thread at a
 * time (appends and forks run on the caller's thread, never inside pool tasks).
 *
 * This is where a GPU backend plugs in: blocks of a CUDA context will live in device
 * memory, with the same budget and refcounts; only kv_block data pointers change. */
#ifndef KVQ_KVCACHE_POOL_H
#define KVQ_KVCACHE_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Tokens per block. 64: attention kernels stream 64 rows per call (4- and 16-row
 * tiles divide it), rotating and sliding windows give memory back a block at a time,
 * and a sequence wastes at most 63 rows per layer; smaller blocks would share
 * prefixes at a finer grain but pay more per-call overhead in the hot loop. */
#define KV_BLOCK_TOKENS 64

struct kv_block {
    int32_t refs;
    uint32_t cls;          /* size class in the pool */
    struct kv_block *next; /* free list link */
    uint8_t *data;         /* 64-byte aligned, pool-owned */
};

struct kv_pool;

/* budget: the most bytes of blocks in use at once (0: no limit). */
struct kv_pool *kv_pool_new(size_t budget);
void kv_pool_free(struct kv_pool *p);

/* A block of `bytes` with one reference; NULL with an error when the budget would be
 * exceeded or memory is out. Its contents are undefined. */
struct kv_block *kv_block_new(struct kv_pool *p, size_t bytes);
void kv_block_ref(struct kv_block *b);
/* Drops one reference (NULL is fine); the last one gives the block back. */
void kv_block_unref(struct kv_pool *p, struct kv_block *b);
/* Bytes of the block (its size class). */
size_t kv_block_bytes(const struct kv_pool *p, const struct kv_block *b);

size_t kv_pool_budget(const struct kv_pool *p);
/* Bytes of blocks held by someone now (each shared block once). */
size_t kv_pool_used(const struct kv_pool *p);
/* Blocks held by someone now. */
int64_t kv_pool_blocks(const struct kv_pool *p);
/* Whether `bytes` more can be held within the budget. */
bool kv_pool_fits(const struct kv_pool *p, size_t bytes);

#endif
