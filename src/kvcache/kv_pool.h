/* A pool of KV blocks with a byte budget. A block holds KV_BLOCK_TOKENS consecutive
 * tokens of one layer (for each KV head: its keys, then its values) in that layer's row format;
 * caches hold blocks by reference, so sequences that share a prefix share its blocks.
 *
 * Blocks are refcounted: kv_block_unref() returns a block to the pool when the last
 * holder lets go. Freed blocks are kept on a free list per size and handed out again,
 * so a steady decode loop allocates nothing. The pool is used from one thread at a
 * time (appends and forks run on the caller's thread, never inside pool tasks).
 *
 * A GPU backend mirrors the pool (kv_pool_new_mirrored): every block then also has a
 * device copy, and the pool lists the rows the host wrote since the backend last copied
 * them over. Where the mirror can fetch rows (kv_pool_mirror.fetch), the device's rows
 * are the authoritative ones: the rows the device writes stay there (the block's stale
 * range says which host rows are old), and whoever reads or writes a block's host rows
 * first makes them current (kv_blocks_fetch): the host writes rows only once they are,
 * and a block's dirty rows reach the device before the device writes to it again. A
 * fetch calls into the backend: only the thread that drives it fetches, and a reader on
 * another thread reads blocks that thread made current (kvq_prefix_fetch). */
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
    /* mirrored pools only */
    void *dev;                  /* the device copy */
    int32_t dirty_lo, dirty_hi; /* token rows [lo, hi) the host wrote since the last copy */
    int32_t stale_lo, stale_hi; /* token rows [lo, hi) the device wrote since the host's copy was current */
    bool listed;                /* on the pool's dirty list */
    bool host_used;             /* device rows authoritative: the host's copy holds pages (written or fetched) */
};

struct kv_pool;

/* budget: the most bytes of blocks in use at once (0: no limit). */
struct kv_pool *kv_pool_new(size_t budget);

/* Memory of a mirrored pool, from its backend. Both allocators hand out memory that
 * lives as long as the backend (arenas): a mirrored pool never frees block memory,
 * it keeps freed blocks for reuse. NULL from either: out of memory. */
struct kv_pool_mirror {
    void *ctx;
    void *(*host_alloc)(void *ctx, size_t bytes); /* host rows (pinned for fast copies, or mapped) */
    void *(*dev_alloc)(void *ctx, size_t bytes);
    /* Called when a cache whose kv_cache_mirror() is set is freed. */
    void (*cache_free)(void *ctx, void *mirror);
    /* Both or neither (the device's rows then authoritative): fetch copies n blocks'
     * device rows (`bytes` each) into their host copies once the device's work so far
     * is done, and waits (0, or -1 with an error); copy queues a copy of src's device
     * rows to dst's, before the device's next work (a shared block copied on write). */
    int (*fetch)(void *ctx, struct kv_block *const *b, int n, size_t bytes);
    void (*copy)(void *ctx, struct kv_block *dst, const struct kv_block *src, size_t bytes);
    /* With them, optional: a freed block's host copy, which the host wrote or fetched,
     * may give its pages back (its contents are undefined until written again); the
     * pool keeps up to a limit of such blocks' pages for reuse first. */
    void (*host_idle)(void *ctx, void *data, size_t bytes);
};
struct kv_pool *kv_pool_new_mirrored(size_t budget, const struct kv_pool_mirror *m);
/* The pool's mirror (NULL for a host-only pool). */
const struct kv_pool_mirror *kv_pool_get_mirror(const struct kv_pool *p);
/* Marks token rows [lo, hi) of b as written by the host (no-op for host-only pools);
 * its host rows must be current (kv_blocks_fetch). */
void kv_block_touch(struct kv_pool *p, struct kv_block *b, int32_t lo, int32_t hi);
/* Whether the device holds the authoritative rows (the mirror fetches). */
bool kv_pool_device_rows(const struct kv_pool *p);
/* Marks token rows [lo, hi) of b as written by the device alone (a pool whose device
 * holds the rows; else a no-op: the caller copies the rows to the host). */
void kv_block_device_wrote(struct kv_pool *p, struct kv_block *b, int32_t lo, int32_t hi);
/* Makes the host rows of the n blocks current (those with stale rows fetched in one
 * wait). 0, or -1 with an error. */
int kv_blocks_fetch(struct kv_pool *p, struct kv_block *const *b, int n);
/* Hands out the blocks written since the last call (*blocks: valid until the next
 * call). Entries with refs == 0 were freed since and need no copy; the caller copies
 * the others' dirty rows and resets dirty_lo = dirty_hi = 0. -1 with an error when
 * the list could not grow (some written rows are unknown). */
int kv_pool_take_dirty(struct kv_pool *p, struct kv_block ***blocks);
void kv_pool_free(struct kv_pool *p);

/* Memory for the f16 windows (kv_window.c), kept for reuse when given back (up to
 * WIN_SPARE_MAX bytes a pool): a window grown for a prompt and cut back after it then
 * takes pages already mapped instead of faulting fresh ones in, a fault every 4 KB
 * (a server's prompts spent more host time so than in everything else a step does).
 * *fresh: the memory was not used before. NULL when memory is out. */
void *kv_pool_win_alloc(struct kv_pool *p, size_t bytes, bool *fresh);
/* Gives back what kv_pool_win_alloc handed out for `bytes` (NULL is fine). */
void kv_pool_win_free(struct kv_pool *p, void *mem, size_t bytes);

/* A block of `bytes` with one reference; NULL with an error when the budget would be
 * exceeded or memory is out. Its contents are undefined, and none of its rows is dirty
 * or stale: whoever writes rows marks them (kv_block_touch, kv_block_device_wrote). */
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
