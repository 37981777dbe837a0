/* Dense cache: keys and values as f16 or f32 rows, one contiguous block per KV
 * head ([n_kv_heads][capacity][head_dim]) so attention streams memory in order. */
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "kernels/attention.h"
#include "kernels/f16.h"
#include "kvcache/kv_cache_impl.h"

struct kv_dense {
    int elem_bytes_k, elem_bytes_v; /* 2 (f16) or 4 (f32) */
    int32_t capacity;               /* tokens allocated per head */
    uint8_t *k, *v;
};

static size_t head_stride(const struct kv_cache *c, int elem_bytes, int32_t capacity) {
    return (size_t)capacity * (size_t)c->shape.head_dim * (size_t)elem_bytes;
}

/* Grows storage to hold at least `need` tokens, doubling to amortize copies. */
static int dense_reserve(struct kv_cache *c, int32_t need) {
    struct kv_dense *d = c->impl;
    if (need <= d->capacity) return 0;
    int32_t cap = d->capacity ? d->capacity : 256;
    while (cap < need) cap *= 2;
    int H = c->shape.n_kv_heads;
    uint8_t *nk = malloc(head_stride(c, d->elem_bytes_k, cap) * (size_t)H);
    uint8_t *nv = malloc(head_stride(c, d->elem_bytes_v, cap) * (size_t)H);
    if (!nk || !nv) {
        free(nk);
        free(nv);
        return kvq_error("out of memory growing the KV cache to %d tokens", cap);
    }
    size_t used_k = (size_t)c->n_past * (size_t)c->shape.head_dim * (size_t)d->elem_bytes_k;
    size_t used_v = (size_t)c->n_past * (size_t)c->shape.head_dim * (size_t)d->elem_bytes_v;
    for (int h = 0; h < H && c->n_past > 0; h++) {
        memcpy(nk + h * head_stride(c, d->elem_bytes_k, cap), d->k + h * head_stride(c, d->elem_bytes_k, d->capacity), used_k);
        memcpy(nv + h * head_stride(c, d->elem_bytes_v, cap), d->v + h * head_stride(c, d->elem_bytes_v, d->capacity), used_v);
    }
    free(d->k);
    free(d->v);
    d->k = nk;
    d->v = nv;
    d->capacity = cap;
    return 0;
}

static void store_row(uint8_t *dst, const float *src, int n, int elem_bytes) {
    if (elem_bytes == 4) {
        memcpy(dst, src, (size_t)n * 4);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    for (int i = 0; i < n; i++) h[i] = kvq_f32_to_f16(src[i]);
}

static int dense_append(struct kv_cache *c, int n, const float *k, const float *v) {
    struct kv_dense *d = c->impl;
    if (dense_reserve(c, c->n_past + n) != 0) return -1;
    int H = c->shape.n_kv_heads, D = c->shape.head_dim;
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < H; h++) {
            size_t slot = (size_t)(c->n_past + t) * (size_t)D;
            store_row(d->k + h * head_stride(c, d->elem_bytes_k, d->capacity) + slot * d->elem_bytes_k,
                      k + ((size_t)t * H + h) * D, D, d->elem_bytes_k);
            store_row(d->v + h * head_stride(c, d->elem_bytes_v, d->capacity) + slot * d->elem_bytes_v,
                      v + ((size_t)t * H + h) * D, D, d->elem_bytes_v);
        }
    }
    c->n_past += n;
    return 0;
}

static void dense_attend(const struct kv_cache *c, int kv_head, const float *q, int32_t q_pos, float scale,
                         float *out, float *scratch) {
    const struct kv_dense *d = c->impl;
    int D = c->shape.head_dim, group = c->shape.n_heads / c->shape.n_kv_heads;
    int32_t hi = q_pos < c->n_past ? q_pos : c->n_past - 1;
    int32_t lo = 0;
    if (c->shape.window > 0 && q_pos - c->shape.window + 1 > 0) lo = q_pos - c->shape.window + 1;
    float *qs = scratch;
    for (int i = 0; i < group * D; i++) qs[i] = q[i] * scale;
    struct kern_attn_state st;
    kern_attn_state_init(&st, group, D, scratch + (size_t)group * D);
    if (hi >= lo) {
        const uint8_t *kb = d->k + kv_head * head_stride(c, d->elem_bytes_k, d->capacity) + (size_t)lo * D * d->elem_bytes_k;
        const uint8_t *vb = d->v + kv_head * head_stride(c, d->elem_bytes_v, d->capacity) + (size_t)lo * D * d->elem_bytes_v;
        kern_attn_accumulate(&st, qs, kb, (size_t)D, vb, (size_t)D, d->elem_bytes_k * 8, hi - lo + 1);
    }
    kern_attn_finish(&st, out);
}

static int dense_trim(struct kv_cache *c, int n) {
    if (n > c->n_past) n = c->n_past;
    c->n_past -= n;
    return n;
}

static void dense_clear(struct kv_cache *c) { c->n_past = 0; }

static size_t dense_bytes(const struct kv_cache *c) {
    return (size_t)c->n_past * kv_cache_token_bytes(&c->cfg, &c->shape);
}

static void dense_free(struct kv_cache *c) {
    struct kv_dense *d = c->impl;
    if (d) {
        free(d->k);
        free(d->v);
        free(d);
    }
    c->impl = NULL;
}

static const struct kv_cache_ops dense_ops = {
    .append = dense_append,
    .attend = dense_attend,
    .trim = dense_trim,
    .clear = dense_clear,
    .bytes = dense_bytes,
    .free = dense_free,
};

int kv_dense_init(struct kv_cache *c) {
    struct kv_dense *d = calloc(1, sizeof *d);
    if (!d) return kvq_error("out of memory");
    if (c->cfg.k_bits != c->cfg.v_bits)
        return free(d), kvq_error("dense KV cache needs the same float type for keys and values");
    d->elem_bytes_k = c->cfg.k_bits / 8;
    d->elem_bytes_v = c->cfg.v_bits / 8;
    c->impl = d;
    c->ops = &dense_ops;
    return 0;
}
