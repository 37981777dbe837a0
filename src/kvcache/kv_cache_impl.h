/* What every cache kind implements; private to src/kvcache. */
#ifndef KVQ_KVCACHE_IMPL_H
#define KVQ_KVCACHE_IMPL_H

#include "kvcache/kv_cache.h"

struct kv_cache_ops {
    int (*append)(struct kv_cache *c, int n, const float *k, const float *v);
    void (*attend)(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale, float *out,
                   float *scratch);
    int (*trim)(struct kv_cache *c, int n);
    int (*keep_prefix)(struct kv_cache *c, int32_t n);
    int (*fork)(struct kv_cache *dst, const struct kv_cache *src);
    void (*clear)(struct kv_cache *c);
    size_t (*bytes)(const struct kv_cache *c);
    void (*free)(struct kv_cache *c);
    int (*to_quantized)(struct kv_cache *c);
    const char *(*kind)(const struct kv_cache *c);
    int (*size)(const struct kv_cache *c);
    int (*read_rows)(const struct kv_cache *c, int kv_head, int which, float *out, int32_t *pos, int max);
    void (*save)(const struct kv_cache *c, struct kv_buf *b);
    int (*load)(struct kv_cache *c, struct kv_reader *r);
};

struct kv_cache {
    const struct kv_cache_ops *ops;
    struct kv_cache_config cfg;
    struct kv_shape shape;
    int32_t n_past;
    void *impl;     /* the kind's own state */
    uint32_t epoch; /* kv_cache_epoch() */
    void *mirror;   /* a device backend's state (kv_cache_mirror()) */
};

/* Every kind (dense, quantized, rotating, quantized rotating, quantize-after-N) is
 * one block store (kv_store.h) whose row formats and windows vary. pool: NULL for a
 * private pool without a budget. */
struct kv_pool;
int kv_store_init(struct kv_cache *c, struct kv_pool *pool);

#endif
