/* Per-layer KV bits (struct kvq_layer_bits): which bits a layer takes, whether two
 * configs store rows alike, the ranges as --kv-layer-bits writes them, and their check
 * against a model. */
#include <stdio.h>

#include "core/error.h"
#include "kernels/kv_quant.h"
#include "engine/engine_internal.h"

void kvq_kv_layer_bits(const struct kvq_kv_config *kv, int il, int *k_bits, int *v_bits) {
    *k_bits = kv->k_bits;
    *v_bits = kv->v_bits;
    for (int i = 0; i < kv->n_layer_bits && i < KVQ_MAX_LAYER_BITS; i++)
        if (il >= kv->layer_bits[i].first && il <= kv->layer_bits[i].last) {
            *k_bits = kv->layer_bits[i].k_bits;
            *v_bits = kv->layer_bits[i].v_bits;
            return;
        }
}

/* The last layer kv's ranges name (-1: none). */
static int last_named_layer(const struct kvq_kv_config *kv) {
    int last = -1;
    for (int i = 0; i < kv->n_layer_bits && i < KVQ_MAX_LAYER_BITS; i++)
        if (kv->layer_bits[i].last > last) last = kv->layer_bits[i].last;
    return last;
}

bool kvq_kv_same_format(const struct kvq_kv_config *a, const struct kvq_kv_config *b) {
    if (a->k_bits != b->k_bits || a->v_bits != b->v_bits || a->k_group != b->k_group || a->v_group != b->v_group)
        return false;
    const int la = last_named_layer(a), lb = last_named_layer(b);
    for (int il = 0; il <= (la > lb ? la : lb); il++) {
        int ak, av, bk, bv;
        kvq_kv_layer_bits(a, il, &ak, &av);
        kvq_kv_layer_bits(b, il, &bk, &bv);
        if (ak != bk || av != bv) return false;
    }
    return true;
}

int kvq_kv_layer_bits_name(const struct kvq_kv_config *kv, char *buf, size_t size) {
    const int n_ranges = kv->n_layer_bits < KVQ_MAX_LAYER_BITS ? kv->n_layer_bits : KVQ_MAX_LAYER_BITS;
    size_t n = 0;
    if (size) buf[0] = '\0';
    for (int i = 0; i < n_ranges; i++) {
        const struct kvq_layer_bits *g = &kv->layer_bits[i];
        bool seen = false; /* this width was written with an earlier range */
        for (int j = 0; j < i && !seen; j++) seen = kv->layer_bits[j].k_bits == g->k_bits && kv->layer_bits[j].v_bits == g->v_bits;
        for (int j = i, first = 1; j < n_ranges && !seen; j++) {
            const struct kvq_layer_bits *l = &kv->layer_bits[j];
            if (l->k_bits != g->k_bits || l->v_bits != g->v_bits) continue;
            const char *sep = first ? (n ? " " : "") : ",";
            int w = l->first == l->last ? snprintf(buf + n, size - n, "%s%d", sep, l->first)
                                        : snprintf(buf + n, size - n, "%s%d-%d", sep, l->first, l->last);
            if (w < 0 || (size_t)w >= size - n) return -1;
            n += (size_t)w;
            first = 0;
        }
        if (seen) continue;
        int w = snprintf(buf + n, size - n, "=%d,%d", g->k_bits, g->v_bits);
        if (w < 0 || (size_t)w >= size - n) return -1;
        n += (size_t)w;
    }
    return (int)n;
}

/* Per-layer bits as asked: 0, or -1 with an error (the caches check each layer's
 * bits against its row kind). */
int engine_check_layer_bits(const struct kvq_kv_config *kv, int n_layer) {
    if (kv->n_layer_bits < 0 || kv->n_layer_bits > KVQ_MAX_LAYER_BITS)
        return kvq_error("%d per-layer bit ranges: at most %d", kv->n_layer_bits, KVQ_MAX_LAYER_BITS);
    for (int i = 0; i < kv->n_layer_bits; i++) {
        const struct kvq_layer_bits *l = &kv->layer_bits[i];
        if (l->first < 0 || l->first > l->last || l->last >= n_layer)
            return kvq_error("per-layer KV bits for layers %d..%d: the model has layers 0..%d", l->first, l->last,
                             n_layer - 1);
        if ((kv->k_bits >= 16 ? l->k_bits != kv->k_bits : l->k_bits >= 16) ||
            (kv->v_bits >= 16 ? l->v_bits != kv->v_bits : l->v_bits >= 16))
            return kvq_error("per-layer KV bits (layers %d..%d: K%d/V%d) change only quantized sides, to quantized bits "
                             "(the cache is K%d/V%d)",
                             l->first, l->last, l->k_bits, l->v_bits, kv->k_bits, kv->v_bits);
    }
    return 0;
}

/* The CUDA backend copies a block's dirty rows in the layout of the layer it attends
 * whenever the block's size matches that layout's; so no two layers may share a head's
 * bytes a token while splitting them otherwise between keys and values. */
int engine_check_gpu_layouts(const struct kvq_kv_config *kv, int n_layer, int head_dim) {
    for (int a = 0; a < n_layer; a++)
        for (int b = 0; b < a; b++) {
            int ka, va, kb, vb;
            kvq_kv_layer_bits(kv, a, &ka, &va);
            kvq_kv_layer_bits(kv, b, &kb, &vb);
            const size_t rk = kern_kvq_row_bytes(ka, kv->k_group, head_dim), rv = kern_kvq_row_bytes(va, kv->v_group, head_dim);
            const size_t sk = kern_kvq_row_bytes(kb, kv->k_group, head_dim), sv = kern_kvq_row_bytes(vb, kv->v_group, head_dim);
            if (rk + rv == sk + sv && rk != sk)
                return kvq_error_code(KVQ_ERR_UNSUPPORTED,
                                      "--device cuda: layers %d (K%d/V%d) and %d (K%d/V%d) take as many KV bytes in "
                                      "another key/value split, which the GPU's row copies cannot tell apart: pick "
                                      "other bits for one of them",
                                      b, kb, vb, a, ka, va);
        }
    return 0;
}
