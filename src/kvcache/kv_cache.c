/* Front door of the KV cache: validates the config and the calls, and forwards them
 * to the block store (kv_store.h) that every cache kind is. */
#include "kvcache/kv_cache.h"

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/attention.h"
#include "kernels/kv_quant.h"
#include "kvcache/kv_pool.h"
#include "kvcache/kv_store.h"

static bool is_float_bits(int b) { return b == 16 || b == 32; }

struct kv_cache *kv_cache_new(const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    return kv_cache_new_in(NULL, cfg, shape);
}

struct kv_cache *kv_cache_new_in(struct kv_pool *pool, const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    if (shape->n_kv_heads <= 0 || shape->head_dim <= 0 || shape->n_heads % shape->n_kv_heads != 0) {
        kvq_error("invalid attention shape: %d heads, %d KV heads, head_dim %d", shape->n_heads, shape->n_kv_heads,
                  shape->head_dim);
        return NULL;
    }
    if (shape->head_dim > KERN_KVQ_MAX_DIM) {
        kvq_error("head_dim %d is larger than the KV cache supports (%d)", shape->head_dim, KERN_KVQ_MAX_DIM);
        return NULL;
    }
    for (int side = 0; side < 2; side++) {
        const char *name = side ? "value" : "key";
        int bits = side ? cfg->v_bits : cfg->k_bits, g = side ? cfg->v_group : cfg->k_group;
        if (!is_float_bits(bits) && !kern_kvq_bits_quantized(bits)) {
            kvq_error("invalid %s bits %d: expected 2, 3, 4, 5, 6, 8, 16 or 32", name, bits);
            return NULL;
        }
        if (is_float_bits(bits)) continue;
        if (g == KERN_KVQ_NF) {
            if (!kern_kvq_nf_bits(bits)) {
                kvq_error("invalid %s bits %d for a normal-float row: expected 2, 3, 4 or 5", name, bits);
                return NULL;
            }
            continue;
        }
        if (g != 8 && g != 16 && g != 32 && g != 64 && g != 128) {
            kvq_error("invalid %s group size %d: expected 32, 64 or 128 (8 or 16 for small heads)", name, g);
            return NULL;
        }
        if (shape->head_dim % g != 0) {
            kvq_error("%s group size %d does not divide head_dim %d", name, g, shape->head_dim);
            return NULL;
        }
    }
    /* keep is bounded like the window: residual + keep must not overflow */
    if (cfg->max_size < 0 || cfg->keep < 0 || cfg->keep > (1 << 30) || cfg->quantized_start < 0 ||
        (cfg->max_size > 0 && cfg->keep >= cfg->max_size)) {
        kvq_error("invalid rotating cache: max size %d, keep %d (keep must be smaller), quantized start %d",
                  cfg->max_size, cfg->keep, cfg->quantized_start);
        return NULL;
    }
    if (cfg->residual < 0 || cfg->residual > (1 << 20)) {
        kvq_error("invalid KV residual window %d: expected 0 .. %d tokens", cfg->residual, 1 << 20);
        return NULL;
    }
    struct kv_cache *c = calloc(1, sizeof *c);
    if (!c) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    c->cfg = *cfg;
    c->shape = *shape;
    if (kv_store_init(c, pool) != 0) {
        free(c);
        return NULL;
    }
    return c;
}

void kv_cache_free(struct kv_cache *c) {
    if (!c) return;
    const struct kv_pool_mirror *m = c->mirror ? kv_pool_get_mirror(kv_cache_pool(c)) : NULL;
    if (m) m->cache_free(m->ctx, c->mirror);
    kv_store_free(c);
    free(c);
}

int kv_cache_append(struct kv_cache *c, int n, const float *k, const float *v) { return kv_store_append(c, n, k, v); }

void kv_cache_attend(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale, float *out,
                     float *scratch) {
    kv_store_attend(c, kv_head, &q, &out, q_pos, 1, scale, scratch);
}

void kv_cache_attend_tokens(const struct kv_cache *c, int kv_head, const float *const *q, float *const *out,
                            int32_t q_pos, int n, float scale, float *scratch) {
    kv_store_attend(c, kv_head, q, out, q_pos, n, scale, scratch);
}

int kv_cache_attend_tokens_max(const struct kv_shape *shape) { return kv_store_attend_tokens_max(shape); }


size_t kv_cache_scratch_floats(const struct kv_shape *shape) {
    const size_t nq = (size_t)(shape->n_heads / shape->n_kv_heads) * (size_t)kv_store_attend_tokens_max(shape);
    /* the scaled (and possibly rotated) queries, the online-softmax state, a part's
     * state, and the state after the packed rows */
    return nq * shape->head_dim + 2 * kern_attn_state_floats((int)nq, shape->head_dim) + 2 * nq;
}

const struct kv_cache_config *kv_cache_get_config(const struct kv_cache *c) { return &c->cfg; }
const struct kv_shape *kv_cache_get_shape(const struct kv_cache *c) { return &c->shape; }
const char *kv_cache_kind(const struct kv_cache *c) { return kv_store_kind(c); }
int kv_cache_size(const struct kv_cache *c) { return kv_store_size(c); }
int kv_cache_to_quantized(struct kv_cache *c) {
    c->epoch++;
    return kv_store_to_quantized(c);
}
int kv_cache_read_rows(const struct kv_cache *c, int kv_head, int which, float *out, int32_t *pos, int max) {
    if (kv_head < 0 || kv_head >= c->shape.n_kv_heads || max <= 0) return 0;
    return kv_store_read_rows(c, kv_head, which, out, pos, max);
}
int kv_cache_fetch(const struct kv_cache *c) { return kv_store_fetch(c, 0, c->n_past); }
void kv_cache_save(const struct kv_cache *c, struct kv_buf *b) { kv_store_save(c, b); }
int kv_cache_save_rows(const struct kv_cache *c, int32_t first, int32_t n, struct kv_buf *b) {
    return kv_store_save_rows(c, first, n, b);
}
int kv_cache_append_rows_from(struct kv_cache *c, const struct kv_rows *x) {
    c->epoch++; /* rows no device encoded: a device copy of the windows and offsets is rebuilt */
    return kv_store_append_rows_from(c, x);
}
int kv_cache_load(struct kv_cache *c, struct kv_reader *r) {
    c->epoch++;
    return kv_store_load(c, r);
}

int32_t kv_cache_n_past(const struct kv_cache *c) { return c->n_past; }
int kv_cache_trim(struct kv_cache *c, int n) {
    c->epoch++;
    return n <= 0 ? 0 : kv_store_trim(c, n);
}
int kv_cache_keep_prefix(struct kv_cache *c, int n) {
    c->epoch++;
    return kv_store_keep_prefix(c, n);
}

int kv_cache_fork(struct kv_cache *dst, const struct kv_cache *src) {
    if (dst == src) return 0;
    const struct kv_cache_config *a = &dst->cfg, *b = &src->cfg;
    bool same = a->k_bits == b->k_bits && a->v_bits == b->v_bits && a->k_group == b->k_group &&
                a->v_group == b->v_group && a->max_size == b->max_size && a->keep == b->keep &&
                a->quantized_start == b->quantized_start && a->hadamard == b->hadamard && a->residual == b->residual &&
                dst->shape.n_heads == src->shape.n_heads && dst->shape.n_kv_heads == src->shape.n_kv_heads &&
                dst->shape.head_dim == src->shape.head_dim && dst->shape.window == src->shape.window;
    if (!same)
        return kvq_error("cannot share KV blocks between caches of different configs");
    dst->epoch++;
    return kv_store_fork(dst, src);
}
void kv_cache_clear(struct kv_cache *c) {
    c->epoch++;
    kv_store_clear(c);
}
size_t kv_cache_bytes(const struct kv_cache *c) { return kv_store_bytes(c); }

/* kv_heads x (head_dim x b/8 + 4 x head_dim/G) for K plus the same for V: the row
 * format of kernels/kv_quant.h, which the stores use. */
size_t kv_cache_token_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    size_t per_head_k = kern_kvq_row_bytes(cfg->k_bits, cfg->k_group, shape->head_dim);
    size_t per_head_v = kern_kvq_row_bytes(cfg->v_bits, cfg->v_group, shape->head_dim);
    return (size_t)shape->n_kv_heads * (per_head_k + per_head_v);
}

/* (R + keep) f16 rows of K and V per KV head, for quantized caches with R > 0: a
 * float side is copied in its own format so the window rows are self-contained. */
size_t kv_cache_window_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    if (cfg->residual <= 0 || (!kern_kvq_bits_quantized(cfg->k_bits) && !kern_kvq_bits_quantized(cfg->v_bits)))
        return 0;
    size_t k = (size_t)shape->head_dim * (kern_kvq_bits_quantized(cfg->k_bits) ? 16 : cfg->k_bits) / 8;
    size_t v = (size_t)shape->head_dim * (kern_kvq_bits_quantized(cfg->v_bits) ? 16 : cfg->v_bits) / 8;
    return ((size_t)cfg->residual + (size_t)cfg->keep) * (size_t)shape->n_kv_heads * (k + v);
}
