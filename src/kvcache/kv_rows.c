/* Row formats of a cache and the conversion of one head vector to and from them:
 * offsets removed, Hadamard rotation, then kernels/kv_quant.h's row format. */
#include <assert.h>
#include <string.h>

#include "kernels/kv_quant.h"
#include "kvcache/kv_store.h"

struct kv_fmt kv_fmt_make(const struct kv_cache *c, int bits, int group) {
    struct kv_fmt f = {bits, group, c->cfg.hadamard && kern_kvq_bits_quantized(bits), 0};
    f.row = kern_kvq_row_bytes(bits, group, c->shape.head_dim);
    return f;
}

struct kv_fmt kv_fmt_target(const struct kv_cache *c, int side) {
    return side ? kv_fmt_make(c, c->cfg.v_bits, c->cfg.v_group) : kv_fmt_make(c, c->cfg.k_bits, c->cfg.k_group);
}

/* Before conversion, a quantized side is held as f16. */
struct kv_fmt kv_fmt_initial(const struct kv_cache *c, int side) {
    struct kv_fmt f = kv_fmt_target(c, side);
    if (c->cfg.quantized_start > 0 && kern_kvq_bits_quantized(f.bits)) return kv_fmt_make(c, 16, f.group);
    return f;
}

/* The window format of a side: f16 where the side is quantized (same rotation). */
struct kv_fmt kv_fmt_window(const struct kv_cache *c, struct kv_fmt f) {
    if (kern_kvq_bits_quantized(f.bits)) f.bits = 16;
    f.row = kern_kvq_row_bytes(f.bits, f.group, c->shape.head_dim);
    return f;
}

bool kv_fmt_eq(struct kv_fmt a, struct kv_fmt b) {
    return a.bits == b.bits && a.rot == b.rot && (!kern_kvq_bits_quantized(a.bits) || a.group == b.group);
}

/* mu: the key offset of the row's head (NULL for values and float rows). Removing a
 * per-channel constant from every key shifts all scores of a query by the same
 * amount, which softmax ignores: attention needs no correction. */
void kv_encode_row(const struct kv_store *st, const struct kv_fmt *f, int d, const float *x, const float *mu,
                   uint8_t *dst) {
    float tmp[KERN_KVQ_MAX_DIM];
    if (mu || f->rot) {
        for (int i = 0; i < d; i++) tmp[i] = mu ? x[i] - mu[i] : x[i];
        if (f->rot) kern_kvq_hadamard(tmp, d, st->signs);
        x = tmp;
    }
    kern_kvq_quantize_row(x, d, f->bits, f->group, dst);
}

void kv_decode_row(const struct kv_store *st, const struct kv_fmt *f, int d, const uint8_t *src, const float *mu,
                   float *x) {
    kern_kvq_dequantize_row(src, d, f->bits, f->group, x);
    if (f->rot) kern_kvq_hadamard_inv(x, d, st->signs);
    if (mu)
        for (int i = 0; i < d; i++) x[i] += mu[i];
}

const float *kv_side_mu(const struct kv_store *st, const struct kv_fmt *f, int side, int h, int d, int H) {
    return kern_kvq_bits_quantized(f->bits) && st->mu_set ? st->mu + ((size_t)side * H + h) * d : NULL;
}

uint8_t *kv_win_row(const struct kv_win *w, const struct kv_fmt *f, int side, int h, int32_t j) {
    assert(w->start + j >= 0 && w->start + j < 2 * w->cap); /* within the ring's 2 cap slots */
    return (side ? w->v : w->k) + ((size_t)h * 2 * (size_t)w->cap + (size_t)(w->start + j)) * f->row;
}

void kv_win_mirror(const struct kv_store *st, const struct kv_win *w, int h, int32_t j) {
    if (w->start + j < w->cap) return; /* rows at slots below cap have no copy */
    memcpy(kv_win_row(w, &st->wkf, 0, h, j - w->cap), kv_win_row(w, &st->wkf, 0, h, j), st->wkf.row);
    memcpy(kv_win_row(w, &st->wvf, 1, h, j - w->cap), kv_win_row(w, &st->wvf, 1, h, j), st->wvf.row);
}
