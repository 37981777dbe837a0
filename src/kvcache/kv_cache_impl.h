/* The cache object; private to src/kvcache. */
#ifndef KVQ_KVCACHE_IMPL_H
#define KVQ_KVCACHE_IMPL_H

#include "kvcache/kv_cache.h"

struct kv_cache {
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
