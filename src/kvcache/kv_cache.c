/* Front door of the KV cache: validates the config, picks the kind, forwards. */
#include "kvcache/kv_cache.h"

#include <stdlib.h>

#include "core/error.h"
#include "kernels/attention.h"
#include "kvcache/kv_cache_impl.h"

static bool is_float_bits(int b) { return b == 16 || b == 32; }

struct kv_cache *kv_cache_new(const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    if (shape->n_kv_heads <= 0 || shape->head_dim <= 0 || shape->n_heads % shape->n_kv_heads != 0) {
        kvq_error("invalid attention shape: %d heads, %d KV heads, head_dim %d", shape->n_heads, shape->n_kv_heads,
                  shape->head_dim);
        return NULL;
    }
    if (!is_float_bits(cfg->k_bits) || !is_float_bits(cfg->v_bits)) {
        kvq_error("quantized KV cache (%d/%d bits) is not available yet", cfg->k_bits, cfg->v_bits);
        return NULL;
    }
    struct kv_cache *c = calloc(1, sizeof *c);
    if (!c) {
        kvq_error("out of memory");
        return NULL;
    }
    c->cfg = *cfg;
    c->shape = *shape;
    if (kv_dense_init(c) != 0) {
        free(c);
        return NULL;
    }
    return c;
}

void kv_cache_free(struct kv_cache *c) {
    if (!c) return;
    c->ops->free(c);
    free(c);
}

int kv_cache_append(struct kv_cache *c, int n, const float *k, const float *v) { return c->ops->append(c, n, k, v); }

void kv_cache_attend(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale, float *out,
                     float *scratch) {
    c->ops->attend(c, kv_head, q, q_pos, scale, out, scratch);
}

size_t kv_cache_scratch_floats(const struct kv_shape *shape) {
    int group = shape->n_heads / shape->n_kv_heads;
    /* scaled (and possibly rotated) query, online-softmax state, per-group sums */
    return (size_t)group * shape->head_dim * 2 + kern_attn_state_floats(group, shape->head_dim) + 64;
}

int32_t kv_cache_n_past(const struct kv_cache *c) { return c->n_past; }
int kv_cache_trim(struct kv_cache *c, int n) { return n <= 0 ? 0 : c->ops->trim(c, n); }
void kv_cache_clear(struct kv_cache *c) { c->ops->clear(c); }
size_t kv_cache_bytes(const struct kv_cache *c) { return c->ops->bytes(c); }

size_t kv_cache_token_bytes(const struct kv_cache_config *cfg, const struct kv_shape *shape) {
    size_t per_head_k = is_float_bits(cfg->k_bits) ? (size_t)shape->head_dim * cfg->k_bits / 8
                                                   : (size_t)shape->head_dim * cfg->k_bits / 8 + 4 * (size_t)shape->head_dim / cfg->k_group;
    size_t per_head_v = is_float_bits(cfg->v_bits) ? (size_t)shape->head_dim * cfg->v_bits / 8
                                                   : (size_t)shape->head_dim * cfg->v_bits / 8 + 4 * (size_t)shape->head_dim / cfg->v_group;
    return (size_t)shape->n_kv_heads * (per_head_k + per_head_v);
}
