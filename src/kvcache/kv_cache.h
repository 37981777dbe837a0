/* The KV cache of one layer of one sequence. The model appends the keys and values
 * of new tokens and asks for attention of a query; how the cache stores them
 * (f16, f32, packed low-bit groups, a rotating window) stays hidden here.
 *
 * Positions: a sequence starts at position 0 and grows by append(); trim() removes
 * the newest tokens. A query at position p sees every stored token with position
 * <= p (and > p - window when the model uses a sliding window). */
#ifndef KVQ_KVCACHE_H
#define KVQ_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvcache/kv_pool.h"

struct kv_cache_config {
    int k_bits, v_bits;     /* 16 or 32: dense float storage; 2..8: quantized */
    int k_group, v_group;   /* values per quantization group along head_dim, or
                             * KERN_KVQ_NF: normal-float rows (kernels/kv_quant.h) */
    int max_size;           /* rotating window in tokens; 0 = grows without bound */
    int keep;               /* first tokens always kept when rotating */
    int quantized_start;    /* dense until the sequence holds more than this many tokens */
    bool hadamard;          /* rotate head vectors before quantizing */
    int residual;           /* quantized caches: the newest R tokens are also held in f16
                             * and attention reads them from there (0: off); with R > 0
                             * the first `keep` tokens (attention sinks) are too */
};

struct kv_shape {
    int n_heads;    /* query heads */
    int n_kv_heads; /* n_heads is a multiple of it (GQA) */
    int head_dim;
    int window;     /* the model's sliding-window attention span; 0 = full attention */
};

struct kv_cache;
struct kv_pool;

/* Validates the config against the shape; NULL with kvq_last_error() if invalid.
 * The cache takes its blocks from pool (kv_pool.h), which must outlive it. */
struct kv_cache *kv_cache_new_in(struct kv_pool *pool, const struct kv_cache_config *cfg, const struct kv_shape *shape);
/* The same with a private pool without a budget. */
struct kv_cache *kv_cache_new(const struct kv_cache_config *cfg, const struct kv_shape *shape);
void kv_cache_free(struct kv_cache *c);
struct kv_pool *kv_cache_pool(const struct kv_cache *c);

/* dst becomes a copy of src (same pool, config and shape), sharing all its blocks and
 * windows: each side copies a shared block or window only when it first writes to
 * it. 0, or -1 with an error (dst then unchanged or empty). */
int kv_cache_fork(struct kv_cache *dst, const struct kv_cache *src);
/* dst (same pool, shape, rotating size and keep as src; its own bits and groups)
 * becomes a copy of src's tokens in the format dst's config gives a sequence of that
 * length: src's blocks are shared when the formats agree, else decoded and encoded
 * into new blocks (windows and offsets rebuilt as a quantize-after-N conversion
 * does). 0, or -1 with an error (dst then empty). */
int kv_cache_convert(struct kv_cache *dst, const struct kv_cache *src);
/* Keeps the first n tokens. Fails (nothing changed) when a rotating window no longer
 * holds a row that a query at n would see. */
int kv_cache_keep_prefix(struct kv_cache *c, int n);
/* 0 when keep_prefix(c, n) would succeed, else -1 with the reason. */
int kv_cache_can_keep_prefix(const struct kv_cache *c, int n);
/* Bytes of blocks a cache of n_tokens held tokens takes (whole blocks, plus the
 * f16 copy while a quantize-after-N cache converts). */
size_t kv_cache_budget_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape, int n_tokens);
/* At most how many bytes of new blocks appending n tokens, in appends of at most
 * `chunk` tokens, takes from the pool (a caller checks a whole batch against the
 * budget before writing anything). */
size_t kv_cache_append_bytes(const struct kv_cache *c, int n, int chunk);
/* What bounds kv_cache_append_bytes for every cache of one configuration, from the
 * configuration alone, so that a batch's check need not visit each cache: a block's
 * bytes and the offsets' point (0: none); exact_only where only the caches can tell
 * (quantize-after-N converts every block). */
struct kv_append_bound {
    size_t block;
    int32_t offsets_point;
    bool exact_only;
};
struct kv_append_bound kv_config_append_bound(const struct kv_cache_config *cfg, const struct kv_shape *shape);
/* At most the bytes appending n tokens after n_past takes: every block the tokens
 * touch new (or copied from a shared one), and where they reach the offsets' point
 * every block before it too (re-encoded, copied where shared). */
static inline size_t kv_append_bound_bytes(const struct kv_append_bound *b, int32_t n_past, int n) {
    if (n <= 0) return 0;
    size_t blocks = (size_t)((n_past + n - 1) / KV_BLOCK_TOKENS - n_past / KV_BLOCK_TOKENS + 1);
    const int32_t T = b->offsets_point;
    if (T > 0 && n_past < T && n_past + n >= T) blocks += (size_t)((T - 1) / KV_BLOCK_TOKENS + 1);
    return blocks * b->block;
}
/* Bytes of the f16 windows held outside the pool, shared ones split among holders. */
size_t kv_cache_window_memory(const struct kv_cache *c);

/* Appends n tokens at positions n_past .. n_past+n-1.
 * k, v: [n][n_kv_heads][head_dim] f32 (keys after RoPE). 0 or -1 on error. */
int kv_cache_append(struct kv_cache *c, int n, const float *k, const float *v);

/* Attention for one query token at position q_pos (< n_past) and one KV head:
 * q holds the n_heads/n_kv_heads query heads of that group, [group][head_dim];
 * out receives softmax(scale * q.K^T) V for each, [group][head_dim].
 * scratch: kv_cache_scratch_floats() floats owned by the calling thread. Thread-safe
 * for concurrent calls (no mutation). */
void kv_cache_attend(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale,
                     float *out, float *scratch);
/* The same for n tokens at positions q_pos .. q_pos + n - 1 (q[t], out[t] as above),
 * n <= kv_cache_attend_tokens_max(): the packed rows all of them see are read once
 * for all, and each result is what kv_cache_attend gives. */
void kv_cache_attend_tokens(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out,
                            int32_t q_pos, int n, float scale, float *scratch);
int kv_cache_attend_tokens_max(const struct kv_shape *shape);
/* The same split for threads: the packed rows go in kv_cache_attend_parts() parts of
 * positions, part i's online softmax into part_i (kv_cache_attend_part_floats() floats
 * each, part i at parts + i of them) by kv_cache_attend_part, in any order or thread;
 * then kv_cache_attend_merge gives out from them: the same bits as
 * kv_cache_attend_tokens. */
int kv_cache_attend_parts(const struct kv_cache *c, int32_t q_pos, int n);
size_t kv_cache_attend_part_floats(const struct kv_shape *shape);
void kv_cache_attend_part(const struct kv_cache *c, int kv_head, const float *const *q, int32_t q_pos, int n,
                          float scale, int i, float *part_i, float *scratch);
void kv_cache_attend_merge(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out,
                           int32_t q_pos, int n, float scale, const float *parts, float *scratch);
/* Scratch floats for any of them. */
size_t kv_cache_scratch_floats(const struct kv_shape *shape);

/* Number of tokens the sequence has seen (the next position). */
int32_t kv_cache_n_past(const struct kv_cache *c);
/* Removes the newest n tokens; returns how many were removed (0 when a rotating
 * window no longer holds what the shorter sequence needs). */
int kv_cache_trim(struct kv_cache *c, int n);
void kv_cache_clear(struct kv_cache *c);
/* Bytes of the held keys and values (kv_cache_size() rows, not whole blocks) plus
 * the f16 rows the windows hold. The memory taken is the pool's (kv_pool_used). */
size_t kv_cache_bytes(const struct kv_cache *c);
/* Bytes per stored token for this config (exact, per the packed storage format).
 * A quantized cache with residual R > 0 holds on top of that a constant overhead of
 * f16 rows: kv_cache_window_bytes() = (R + keep) x n_kv_heads x head_dim x 4 bytes
 * (K and V) once the sequence is longer than R + keep; after a multi-token append the
 * batch's own rows are also held in f16 until the next append. */
size_t kv_cache_token_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape);
/* That constant f16 window overhead in bytes (0 for float caches or R = 0). */
size_t kv_cache_window_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape);

/* The config and shape the cache was made with. */
const struct kv_cache_config *kv_cache_get_config(const struct kv_cache *c);
const struct kv_shape *kv_cache_get_shape(const struct kv_cache *c);
/* "dense", "quantized", "rotating" or "quantized-rotating": what the cache stores now
 * (a --quantized-kv-start cache reports dense until it converts). */
const char *kv_cache_kind(const struct kv_cache *c);
/* Tokens held now: those a query of the latest batch or after it can still see (a
 * rotating cache holds at most max_size - 1 + the latest batch's size of them). */
int kv_cache_size(const struct kv_cache *c);
/* Converts the stored tokens to the config's quantized format now, in place (the
 * handle stays the same; offset and rotation index are kept). Does nothing when
 * already quantized or when the config is not quantized. 0 or -1. */
int kv_cache_to_quantized(struct kv_cache *c);

/* Narrow read access for measurements and tests: the stored rows of one KV head in
 * temporal order, as the cache would reconstruct them (dequantized, un-rotated).
 * which: 0 keys, 1 values. out: [max][head_dim]; pos (may be NULL): [max] positions.
 * Returns the number of rows written. */
int kv_cache_read_rows(const struct kv_cache *c, int kv_head, int which, float *out, int32_t *pos, int max);

/* ---- for device backends (kv_view.c) ----
 * A GPU backend keeps a device copy of the cache's blocks (a mirrored pool, kv_pool.h)
 * and of its f16 windows, and attends there; the policy (positions, windows, block
 * tables, conversion, save/load) stays here, on the host rows, which the cache fetches
 * first where the device's rows are the authoritative ones. */

/* Makes the host's copy of the held block rows current where a device keeps the
 * rows (kv_pool.h); the cache's own reads and writes do this themselves, a reader of
 * kv_view's blocks calls it first. 0, or -1 with an error. */
int kv_cache_fetch(const struct kv_cache *c);

/* The layout a device needs to read a cache. Valid until the cache next changes. */
struct kv_view {
    int k_bits, k_group, v_bits, v_group; /* the blocks' row formats (kv_quant.h) */
    bool k_rot, v_rot;                    /* rows Hadamard-rotated (signs below) */
    size_t k_row, v_row;                  /* bytes of a key / value row in a block */
    size_t head_bytes;                    /* a head's stretch of a block: B key rows, then B value rows */
    /* block table: position p is in blk[kv_view_entry(v, p)] */
    struct kv_block *const *blk;
    int32_t n_blk, nkb, base;
    bool windows;      /* quantized: f16 rows of the sinks and the newest positions */
    size_t win_row;    /* bytes of an f16 window row */
    int32_t win_span;  /* at most how many positions below a query's own batch it reads from the window */
    int32_t sinks;     /* sink positions [0, sinks) held in f16 */
    const float *mu;   /* key and value offsets [2][n_kv_heads][head_dim], or NULL */
    const float *signs; /* [head_dim] */
};
void kv_cache_view(const struct kv_cache *c, struct kv_view *v);
/* The block-table entry of position p, in block L = p / KV_BLOCK_TOKENS: entries below
 * nkb are blocks 0.. (a rotating cache's kept first tokens), entry i >= nkb block i + base. */
static inline int32_t kv_view_entry(const struct kv_view *v, int32_t p) {
    const int32_t L = p / KV_BLOCK_TOKENS;
    return L < v->nkb ? L : L - v->base;
}

/* What a query at q reads, in this order: packed rows of positions [a1, b1] and
 * [a2, b2] (empty when a > b), the f16 sink rows [0, sinks) and the f16 window rows
 * [ws, q]; window rows count only where visible (kv_cache_visible). */
struct kv_query_plan {
    int32_t a1, b1, a2, b2, sinks, ws;
};
void kv_cache_query_plan(const struct kv_cache *c, int32_t q, struct kv_query_plan *p);
/* Whether a query at q sees position p (rotating window, sliding window, causality). */
bool kv_cache_visible(const struct kv_cache *c, int32_t p, int32_t q);
/* The f16 window row of position p (a sink, else the residual window), or NULL when
 * no window holds it. side 0 keys, 1 values. */
const uint8_t *kv_cache_window_row(const struct kv_cache *c, int side, int h, int32_t p);
/* Appending rows that a device encodes: kv_cache_append_begin() makes every change of
 * appending n tokens but writing their rows (blocks reserved or released, windows
 * moved, n_past advanced); the device writes the rows (kv_view's formats: block rows
 * with the offsets removed and rotated, f16 window rows rotated without offsets);
 * kv_cache_append_rows() copies them into the host rows (k, v: [n][n_kv_heads] block
 * rows, NULL where the device keeps them, kv_pool_device_rows: begin marked them
 * stale; wk, wv: window rows [p0 + n - w0][n_kv_heads] of positions w0.., ignored
 * without windows; rows of positions trimmed since are skipped) and touches nothing
 * but this cache's own rows,
 * so several caches of one pool may copy at once, on several threads. Then
 * kv_cache_append_end(), one cache at a time, before the cache is next used on the
 * host: when the batch reaches the offsets' point, it chooses them (the windows stay
 * as they were: a device copies the offsets alone) and the rows before it must be encoded again: end then returns how many parts that
 * work has, and the caller runs kv_cache_offsets_part() for each before the cache is
 * used again. Otherwise 0; -1 with an error. first: the position of the batch's first
 * token (its queries decide what may be released): kv_cache_n_past() but for the
 * second part of kv_cache_append_exact_part. */
int kv_cache_append_begin(struct kv_cache *c, int n, int32_t first, bool later_only);
void kv_cache_append_rows(struct kv_cache *c, int32_t p0, int n, const uint8_t *k, const uint8_t *v, const uint8_t *wk,
                          const uint8_t *wv, int32_t w0);
/* The same for KV heads [h0, h0 + nh) only (rows [n][nh], window rows [..][nh]): a
 * device that holds those heads (tensor parallelism). Calls for disjoint heads may
 * run at once. */
void kv_cache_append_heads(struct kv_cache *c, int32_t p0, int n, const uint8_t *k, const uint8_t *v,
                           const uint8_t *wk, const uint8_t *wv, int32_t w0, int h0, int nh);
/* After kv_cache_append_begin of positions [p0, n_past): the first of them whose f16
 * window rows kv_cache_append_rows keeps (n_past: none). The windows keep every row of
 * the batch but where begin's later_only (a device attends for the batch's queries
 * from its own copy of the windows) left the host only what later queries read. */
int32_t kv_cache_window_rows_from(const struct kv_cache *c, int32_t p0);
int kv_cache_append_end(struct kv_cache *c, int32_t p0, int n);
/* Part `part` of that work (a side and a head: an offsets vector and T rows). Parts of
 * this cache and of others may run at once on several threads, in any order. */
void kv_cache_offsets_part(struct kv_cache *c, int part);
/* The rows kv_cache_append_rows() takes for one new token (after kv_cache_append_begin)
 * from its keys and values k, v ([n_kv_heads][head_dim]): block rows kr, vr and, with
 * a residual window, f16 window rows wk, wv ([n_kv_heads] rows of kv_view's k_row,
 * v_row and win_row bytes). Part `part` of `parts` (1 <= parts <= 2 n_kv_heads): its
 * share of the token's 2 n_kv_heads (head, side) rows, the others left as they are.
 * Reads the cache only: calls may run at once on several threads (a backend encoding a
 * batch's rows, or one token's, in parallel). */
void kv_cache_encode_rows(const struct kv_cache *c, const float *k, const float *v, uint8_t *kr, uint8_t *vr, uint8_t *wk,
                          uint8_t *wv, int part, int parts);
/* How many of n tokens appended now through begin, kv_cache_encode_rows and end write
 * the bytes kv_cache_append writes: all n; or, where the append crosses the offsets'
 * point (end would encode the rows past it again from their f16 window rows), those
 * before it, and the rest then appends exactly as a second part (begin's first: the
 * first part's); 0 where neither (a conversion to quantized rows falls in the second
 * part): kv_cache_append then. */
int kv_cache_append_exact_part(const struct kv_cache *c, int n);
/* kv_cache_append_begin(c, n, first, true) for a device that chooses the offsets in
 * the append that reaches their point T: there it makes the blocks of the rows so far
 * private (a shared one copied: its rows reach the device before the append's encode),
 * leaves the host's window the rows later queries read, as after the point, and returns
 * T. The device takes the offsets from its f16 window rows as the host would, and
 * encodes the rows before T again from those rows and the append's later ones with the
 * offsets, as the host would; the caller copies its rows into the host's blocks
 * (kv_cache_append_rows for the append's, the earlier blocks as they are; where the
 * device keeps the rows, none: kv_cache_offsets_given marks the earlier ones stale),
 * then gives the offsets ([2][n_kv_heads][head_dim], as kv_view's mu) to
 * kv_cache_offsets_given() before kv_cache_append_end(), which then has nothing to do. 0 where the host chooses
 * them (kv_cache_append_end), -1 on error. */
int32_t kv_cache_append_begin_claim(struct kv_cache *c, int n, int32_t first);
void kv_cache_offsets_given(struct kv_cache *c, const float *mu);
/* The position at which the cache will choose its offsets (the rows from there on are
 * encoded with them), or 0 when it will not (chosen already, or no offsets). A device
 * backend that leaves the choice to the host ends a forward pass there: rows past it
 * in the same pass would be encoded again on the host. */
int32_t kv_cache_offsets_point(const struct kv_cache *c);
/* The length at which a cache of this config chooses its offsets (0: never). */
int32_t kv_cache_config_offsets_tokens(const struct kv_cache_config *cfg);
/* Changes whenever the windows or offsets change other than by appending or by
 * choosing the offsets (trim, fork, load, conversion): a device copy of them must then
 * be rebuilt. Offsets chosen since a copy: kv_view's mu is no longer NULL. */
uint32_t kv_cache_epoch(const struct kv_cache *c);
/* The backend's state for this cache (NULL at first); the pool's mirror frees it. */
void **kv_cache_mirror(struct kv_cache *c);

/* Serialization of one cache (self-describing section; see kv_store.c). */
struct kv_buf {
    uint8_t *data;
    size_t len, cap;
    bool oom;
};
struct kv_reader {
    const uint8_t *data;
    size_t len, off;
};
/* Appends the cache's state to b (b->oom set on allocation failure). */
void kv_cache_save(const struct kv_cache *c, struct kv_buf *b);
/* Replaces the cache's state with the section at r (the config must match the
 * cache's). 0, or -1 with a clear error (the cache is then empty). */
int kv_cache_load(struct kv_cache *c, struct kv_reader *r);

/* One layer's part of a shared prefix's block: the rows of positions [first, first + n)
 * of every head in the cache's formats, with its offsets (and from position 0 the f16
 * sink rows). -1 with an error when one of those positions is not held. */
int kv_cache_save_rows(const struct kv_cache *c, int32_t first, int32_t n, struct kv_buf *b);
/* Such a part of n rows at r, checked (formats of like's config, truncation, finite
 * values) and kept as pointers into r's bytes, which must outlive it; like (a cache of
 * the config the rows were written with) too. NULL with a clear error. */
struct kv_rows;
struct kv_rows *kv_rows_read(const struct kv_cache *like, struct kv_reader *r, int32_t n);
void kv_rows_free(struct kv_rows *x);
/* Appends the rows to c as its next positions: as they are where they are in c's
 * formats and were encoded with c's offsets (an empty cache takes the offsets and
 * sinks too), which gives the state of a held prefix cut back to that length; else
 * decoded and appended as new tokens. 0, or -1 with an error. */
int kv_cache_append_rows_from(struct kv_cache *c, const struct kv_rows *x);

void kv_buf_put(struct kv_buf *b, const void *p, size_t n);
void kv_buf_u32(struct kv_buf *b, uint32_t v);
void kv_buf_u64(struct kv_buf *b, uint64_t v);
bool kv_read(struct kv_reader *r, void *p, size_t n);
bool kv_read_u32(struct kv_reader *r, uint32_t *v);
bool kv_read_i32(struct kv_reader *r, int32_t *v);
bool kv_read_u64(struct kv_reader *r, uint64_t *v);

#endif
