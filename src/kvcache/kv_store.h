/* The store behind every cache kind; private to src/kvcache.
 *
 * A cache is a table of KV blocks from a pool (kv_pool.h): slot == position, block
 * L holds positions [L*B, (L+1)*B). Blocks no query can see any more (rotating cache,
 * sliding window) go back to the pool; the others may be shared with other caches
 * (fork, held prefixes) and are copied before a write while shared.
 *
 *   dense / quantized: every position is kept.
 *   rotating (max_size M, keep K): a query at p sees the first K positions and the
 *     last M-K positions <= p, like mlx-lm's RotatingKVCache; blocks older than the
 *     first query of a batch can see are released. (A sliding-window layer is a
 *     rotating cache of its window; the model's window alone, shape.window, only
 *     masks: with --swa-full every row stays.)
 *   quantize after N: rows are f16 until the sequence exceeds N tokens, then every
 *     block is re-encoded into new blocks of the quantized format.
 * Quantized caches also hold f16 copies of the first `keep` positions (sinks) and of
 * the newest R (the residual window) in small per-cache windows (kv_window.c), and
 * per-channel key/value offsets chosen at T tokens (kv_convert.c).
 *
 * Files: kv_rows.c (row formats), kv_window.c (f16 windows), kv_store.c (blocks,
 * append, trim, fork), kv_convert.c (format conversion, offsets), kv_attend.c (what a
 * query sees, attention), kv_serialize.c (save/load and the little-endian buffers). */
#ifndef KVQ_KVCACHE_STORE_H
#define KVQ_KVCACHE_STORE_H

#include "kvcache/kv_cache_impl.h"
#include "kvcache/kv_pool.h"

#define HADAMARD_SEED 0x6b7671726f74ull /* "kvqrot": fixed so saved caches stay valid */

struct kv_fmt {
    int bits, group;
    bool rot;
    size_t row; /* bytes per row */
};

/* f16 copies of the rows of positions [p0, p0 + n) in a ring of cap slots per head:
 * row j lies at slot start + j of 2 cap (start < cap, n <= cap), so the rows are one run
 * however the ring has turned, and the residual window drops its oldest rows by moving
 * start on, moving no rows. A row written at a slot s >= cap is copied to s - cap too,
 * where it is read once start has come round below it. Shared by forks until one
 * writes. */
struct kv_win {
    int32_t refs;
    int32_t p0, n, cap, start;
    uint8_t *k, *v; /* [H][2 cap][row] */
    size_t k_bytes, v_bytes;
    struct kv_pool *pool; /* where k and v go back to (forks share a pool) */
};

struct kv_store {
    struct kv_pool *pool;
    bool own_pool;
    struct kv_fmt kf, vf;   /* the blocks' row formats */
    struct kv_fmt wkf, wvf; /* window rows: f16 in the packed rows' space (rotated, not centered) */
    struct kv_win *rec;     /* the newest positions (the residual window) */
    struct kv_win *sink;    /* positions [0, sinks) */
    /* Block table: entries [0, nkb) are logical blocks [0, nkb) (those holding the
     * rotating cache's kept first tokens); entry i >= nkb is logical block i + base. */
    struct kv_block **blk;
    int32_t n_blk, cap_blk, nkb, base;
    int32_t last_first; /* first position of the latest append: what is still held */
    float *signs;       /* [head_dim] Hadamard signs */
    float *mu;          /* [2][n_kv_heads][head_dim] key and value offsets removed before quantizing */
    bool mu_set;
    /* From a later_only append's begin to its end: the batch's queries see f16 window
     * rows from batch_lo on, as without later_only (the device holds those rows; the
     * host's window starts later) */
    bool batch_view;
    int32_t batch_lo;
};

static inline struct kv_store *store_of(const struct kv_cache *c) { return c->impl; }

/* ---- kv_rows.c ---- */
struct kv_fmt kv_fmt_make(const struct kv_cache *c, int bits, int group);
struct kv_fmt kv_fmt_target(const struct kv_cache *c, int side);  /* 0 keys, 1 values */
struct kv_fmt kv_fmt_initial(const struct kv_cache *c, int side); /* f16 first with quantize-after-N */
struct kv_fmt kv_fmt_window(const struct kv_cache *c, struct kv_fmt f);
bool kv_fmt_eq(struct kv_fmt a, struct kv_fmt b);
void kv_encode_row(const struct kv_store *st, const struct kv_fmt *f, int d, const float *x, const float *mu,
                   uint8_t *dst);
void kv_decode_row(const struct kv_store *st, const struct kv_fmt *f, int d, const uint8_t *src, const float *mu,
                   float *x);
/* The offset of a quantized side (NULL for float rows or before it is chosen). */
const float *kv_side_mu(const struct kv_store *st, const struct kv_fmt *f, int side, int h, int d, int H);
uint8_t *kv_win_row(const struct kv_win *w, const struct kv_fmt *f, int side, int h, int32_t j);
/* After head h's key and value of row j were written at kv_win_row: their copies
 * below slot cap, where the row lies at or past it. */
void kv_win_mirror(const struct kv_store *st, const struct kv_win *w, int h, int32_t j);

/* ---- kv_store.c ---- */
size_t kv_block_size(const struct kv_cache *c, const struct kv_fmt *kf, const struct kv_fmt *vf);
/* The block holding position p (NULL if released or beyond the table). */
struct kv_block *kv_store_block(const struct kv_store *st, int32_t p);
/* Row of position p of head h in its block; side 0 keys, 1 values. */
uint8_t *kv_block_row(const struct kv_cache *c, const struct kv_block *b, int side, int h, int32_t p);
/* Whether a query at q sees position p (rotating window, sliding-window attention). */
bool kv_visible(const struct kv_cache *c, int32_t p, int32_t q);
/* Whether some query at >= first or a held query position still needs position p. */
bool kv_held(const struct kv_cache *c, int32_t p);
/* Makes the block of logical index L exist and belong to this cache alone. */
int kv_store_block_private(struct kv_cache *c, int32_t L);
/* Makes room for n rows at n_past (new blocks, private copies of shared ones). */
int kv_store_reserve_rows(struct kv_cache *c, int32_t n);
/* Makes the host rows of the blocks holding positions [lo, hi) current, before the
 * host reads or writes them (kv_pool.h: a device's rows may be newer). 0 or -1. */
int kv_store_fetch(const struct kv_cache *c, int32_t lo, int32_t hi);
void kv_store_write_row(struct kv_cache *c, int32_t p, const float *k, const float *v);
void kv_store_release_before(struct kv_cache *c, int32_t first);
void kv_store_drop_blocks(struct kv_cache *c);

/* ---- kv_window.c ---- */
bool kv_win_on(const struct kv_store *st);
int32_t kv_sink_target(const struct kv_cache *c);
struct kv_win *kv_win_new(struct kv_pool *pool);
void kv_win_unref(struct kv_win *w);
/* Makes *w private to this cache before a write (copies it while shared). */
int kv_win_own(struct kv_cache *c, struct kv_win **w);
int kv_win_reserve(struct kv_cache *c, struct kv_win **w, int32_t need);
void kv_win_put(struct kv_cache *c, struct kv_win *w, const float *k, const float *v);
int kv_windows_make_room(struct kv_cache *c, int n, int32_t first, bool later_only, bool claimed, int32_t *n_sink,
                         int32_t *n_rec);
int kv_windows_append(struct kv_cache *c, int n, const float *k, const float *v, size_t tok, int32_t first);
size_t kv_win_bytes(const struct kv_cache *c, const struct kv_win *w);

/* ---- kv_attend.c ---- */
#define KV_ATTEND_PART 1024 /* positions a part (a multiple of KV_BLOCK_TOKENS) */
void kv_store_attend(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out, int32_t q_pos,
                     int n, float scale, float *scratch);
int kv_store_attend_tokens_max(const struct kv_shape *shape);

/* ---- kv_serialize.c ---- */
void kv_store_save(const struct kv_cache *c, struct kv_buf *b);
int kv_store_load(struct kv_cache *c, struct kv_reader *r);
int kv_store_save_rows(const struct kv_cache *c, int32_t first, int32_t n, struct kv_buf *b);
int kv_store_append_rows_from(struct kv_cache *c, const struct kv_rows *x);

/* ---- kv_store.c: the cache operations (kv_cache.h says what each does) ---- */
int kv_store_append(struct kv_cache *c, int n, const float *k, const float *v);
int kv_store_trim(struct kv_cache *c, int n);
int kv_store_keep_prefix(struct kv_cache *c, int32_t n);
int kv_store_fork(struct kv_cache *dst, const struct kv_cache *src);
void kv_store_clear(struct kv_cache *c);
size_t kv_store_bytes(const struct kv_cache *c);
int kv_store_size(const struct kv_cache *c);
int kv_store_read_rows(const struct kv_cache *c, int kv_head, int which, float *out, int32_t *pos, int max);
const char *kv_store_kind(const struct kv_cache *c);
void kv_store_free(struct kv_cache *c);

/* ---- kv_convert.c ---- */
/* Re-encodes the cache's blocks and windows into formats nkf/nvf (all or nothing). */
int kv_convert(struct kv_cache *c, struct kv_fmt nkf, struct kv_fmt nvf);
/* Into the target formats (quantize-after-N past N tokens). */
int kv_store_to_quantized(struct kv_cache *c);
/* T: the offsets are chosen when the sequence reaches T tokens (0: none). */
int32_t mu_tokens(const struct kv_cache *c);
/* Chooses the offsets from the residual window and encodes positions 0..T-1 again
 * with them. */
int kv_offsets_from_window(struct kv_cache *c);
/* Where an append of n tokens, not yet begun, reaches T and a device can choose the
 * offsets from its window rows (the window holds every row so far): the blocks so far
 * made private, and T; else 0; -1 on error (kv_cache_append_begin_claim). */
int32_t kv_offsets_claim(struct kv_cache *c, int n);

#endif
