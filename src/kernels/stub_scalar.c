/* TEMPORARY scalar kernels until the kernels branch lands. */
#include <math.h>
#include <string.h>
#include "core/dtype.h"
#include "kernels/attention.h"
#include "kernels/f16.h"
#include "kernels/matmul.h"

void kern_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    switch (type) {
    case KVQ_F32: memcpy(dst, src, (size_t)n * 4); break;
    case KVQ_F16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, p + 2 * i, 2); dst[i] = kvq_f16_to_f32(h); } break;
    case KVQ_BF16: for (int64_t i = 0; i < n; i++) { uint16_t h; memcpy(&h, p + 2 * i, 2); dst[i] = kvq_bf16_to_f32(h); } break;
    case KVQ_Q8_0:
        for (int64_t b = 0; b < n / 32; b++) { uint16_t h; memcpy(&h, p + 34 * b, 2); float d = kvq_f16_to_f32(h);
            for (int i = 0; i < 32; i++) dst[b * 32 + i] = d * (int8_t)p[34 * b + 2 + i]; }
        break;
    default: memset(dst, 0, (size_t)n * 4);
    }
}
size_t kern_act_row_bytes(uint32_t wtype, int64_t k) { (void)wtype; return (size_t)k * 4; }
void kern_act_prepare(uint32_t wtype, const float *x, void *dst, int64_t k) { (void)wtype; memcpy(dst, x, (size_t)k * 4); }
void kern_matmul(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    float row[16384];
    for (int64_t r = r0; r < r1; r++) {
        kern_dequantize_row(a->wtype, (const uint8_t *)a->w + r * a->w_row_bytes, row, a->k);
        for (int t = 0; t < a->n_tok; t++) {
            const float *x = (const float *)((const uint8_t *)a->xa + t * a->xa_row_bytes);
            float s = 0; for (int64_t i = 0; i < a->k; i++) s += row[i] * x[i];
            a->y[t * a->y_stride + r] = s;
        }
    }
}
const char *kern_simd_level(void) { return "scalar"; }
size_t kern_attn_state_floats(int n_q, int d) { return (size_t)n_q * (d + 2); }
void kern_attn_state_init(struct kern_attn_state *s, int n_q, int d, float *mem) {
    s->n_q = n_q; s->d = d; s->m = mem; s->l = mem + n_q; s->acc = mem + 2 * n_q;
    for (int i = 0; i < n_q; i++) { s->m[i] = -INFINITY; s->l[i] = 0; }
    memset(s->acc, 0, sizeof(float) * n_q * d);
}
static float ld(const void *p, size_t i, int bits) { if (bits == 32) return ((const float *)p)[i]; return kvq_f16_to_f32(((const uint16_t *)p)[i]); }
void kern_attn_accumulate(struct kern_attn_state *s, const float *q, const void *k, size_t ks, const void *v, size_t vs, int bits, int n) {
    for (int j = 0; j < n; j++) for (int h = 0; h < s->n_q; h++) {
        float sc = 0; for (int i = 0; i < s->d; i++) sc += q[h * s->d + i] * ld(k, j * ks + i, bits);
        float mn = sc > s->m[h] ? sc : s->m[h];
        float a = expf(s->m[h] - mn), w = expf(sc - mn);
        s->l[h] = s->l[h] * a + w;
        for (int i = 0; i < s->d; i++) s->acc[h * s->d + i] = s->acc[h * s->d + i] * a + w * ld(v, j * vs + i, bits);
        s->m[h] = mn;
    }
}
void kern_attn_finish(const struct kern_attn_state *s, float *out) {
    for (int h = 0; h < s->n_q; h++) for (int i = 0; i < s->d; i++) out[h * s->d + i] = s->l[h] > 0 ? s->acc[h * s->d + i] / s->l[h] : 0;
}
