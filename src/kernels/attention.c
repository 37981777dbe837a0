/* Online-softmax attention: state handling, dispatch and the scalar version. */
#include "kernels/attention.h"
#include "kernels/asan.h"
#include "kernels/f16.h"
#include "kernels/matmul_impl.h"
#include "kernels/online_softmax.h"

#include <math.h>
#include <string.h>

size_t kern_attn_state_floats(int n_q, int d) { return (size_t)n_q * (size_t)(d + 2); }

void kern_attn_state_init(struct kern_attn_state *s, int n_q, int d, float *mem) {
    s->n_q = n_q;
    s->d = d;
    s->m = mem;
    s->l = mem + n_q;
    s->acc = mem + 2 * n_q;
    for (int h = 0; h < n_q; h++) {
        s->m[h] = -INFINITY;
        s->l[h] = 0.0f;
    }
    memset(s->acc, 0, (size_t)n_q * (size_t)d * sizeof(float));
}

void kern_attn_finish(const struct kern_attn_state *s, float *out) {
    for (int h = 0; h < s->n_q; h++) {
        const float *a = s->acc + (size_t)h * s->d;
        float *o = out + (size_t)h * s->d;
        if (s->l[h] > 0.0f) {
            float inv = 1.0f / s->l[h];
            for (int i = 0; i < s->d; i++) o[i] = a[i] * inv;
        } else {
            memset(o, 0, (size_t)s->d * sizeof(float));
        }
    }
}

#ifdef KERN_ASAN
/* What the SIMD kernels will touch: the queries, n rows of K and V, the state (kernels/asan.h). */
static void attn_ranges(const struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                        const void *v, size_t v_stride, int elem_bits, int n) {
    const size_t es = (size_t)elem_bits / 8, hd = (size_t)s->n_q * (size_t)s->d;
    kern_asan_range(q, hd * sizeof(float));
    kern_asan_rows(k, (size_t)n, (size_t)s->d * es, k_stride * es);
    kern_asan_rows(v, (size_t)n, (size_t)s->d * es, v_stride * es);
    kern_asan_range(s->acc, hd * sizeof(float));
    kern_asan_range(s->m, (size_t)s->n_q * sizeof(float));
    kern_asan_range(s->l, (size_t)s->n_q * sizeof(float));
}
#else
#define attn_ranges(s, q, k, k_stride, v, v_stride, elem_bits, n) ((void)0)
#endif

void kern_attn_accumulate(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                          const void *v, size_t v_stride, int elem_bits, int n) {
    if (n <= 0) return;
    /* the SIMD kernels take whole vectors of the head size */
    const enum kvq_simd level = kvq_simd_level();
    if (level >= KVQ_SIMD_AVX2) attn_ranges(s, q, k, k_stride, v, v_stride, elem_bits, n);
    if (level == KVQ_SIMD_AVX512 && s->d % 16 == 0)
        kern_attn_accumulate_avx512(s, q, k, k_stride, v, v_stride, elem_bits, n);
    else if (level >= KVQ_SIMD_AVX2 && s->d % 8 == 0)
        kern_attn_accumulate_avx2(s, q, k, k_stride, v, v_stride, elem_bits, n);
    else
        kern_attn_accumulate_scalar(s, q, k, k_stride, v, v_stride, elem_bits, n);
}

static inline float elem(const void *base, size_t idx, int f16) {
    if (f16) return kvq_f16_to_f32(((const uint16_t *)base)[idx]);
    return ((const float *)base)[idx];
}

void kern_attn_accumulate_scalar(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                                 const void *v, size_t v_stride, int elem_bits, int n) {
    const int d = s->d, f16 = elem_bits == 16;
    float sc[KERN_ATTN_MAX_GROUP][KERN_ATTN_BLOCK];
    for (int h0 = 0; h0 < s->n_q; h0 += KERN_ATTN_MAX_GROUP) {
        const int nh = s->n_q - h0 < KERN_ATTN_MAX_GROUP ? s->n_q - h0 : KERN_ATTN_MAX_GROUP;
        for (int j0 = 0; j0 < n; j0 += KERN_ATTN_BLOCK) {
            const int nj = n - j0 < KERN_ATTN_BLOCK ? n - j0 : KERN_ATTN_BLOCK;
            /* scores: each key row is read once for all heads of the group */
            for (int j = 0; j < nj; j++) {
                float acc[KERN_ATTN_MAX_GROUP] = {0};
                size_t base = (size_t)(j0 + j) * k_stride;
                for (int i = 0; i < d; i++) {
                    float kv = elem(k, base + (size_t)i, f16);
                    for (int h = 0; h < nh; h++) acc[h] += q[(size_t)(h0 + h) * d + i] * kv;
                }
                for (int h = 0; h < nh; h++) sc[h][j] = acc[h];
            }
            for (int h = 0; h < nh; h++)
                kern_softmax_step_scalar(sc[h], nj, &s->m[h0 + h], &s->l[h0 + h], s->acc + (size_t)(h0 + h) * d, d);
            /* values: each value row read once */
            for (int j = 0; j < nj; j++) {
                size_t base = (size_t)(j0 + j) * v_stride;
                for (int i = 0; i < d; i++) {
                    float vv = elem(v, base + (size_t)i, f16);
                    for (int h = 0; h < nh; h++) s->acc[(size_t)(h0 + h) * d + i] += sc[h][j] * vv;
                }
            }
        }
    }
}
