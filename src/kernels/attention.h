/* Attention of a group of query heads (that share one KV head) over keys/values
 * stored as f16 or f32 rows, with online softmax: one pass over the cache, no
 * score matrix. Pure function: the cache decides which rows are visible. */
#ifndef KVQ_KERNELS_ATTENTION_H
#define KVQ_KERNELS_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

/* Running state of an online softmax for n_q heads of dimension d. */
struct kern_attn_state {
    int n_q, d;
    float *m;   /* [n_q] running max of scores */
    float *l;   /* [n_q] running sum of exp(score - m) */
    float *acc; /* [n_q * d] running sum of exp(score - m) * v */
};

/* Initializes state over caller memory of kern_attn_state_floats(n_q, d) floats. */
size_t kern_attn_state_floats(int n_q, int d);
void kern_attn_state_init(struct kern_attn_state *s, int n_q, int d, float *mem);
/* Accumulates n rows: k and v are row-major with the given strides (in elements).
 * q: [n_q][d] f32, already multiplied by the softmax scale. elem: 16 (f16) or 32 (f32). */
void kern_attn_accumulate(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                          const void *v, size_t v_stride, int elem_bits, int n);
/* Writes out[n_q][d] = acc / l (zeros where no row was visible). */
void kern_attn_finish(const struct kern_attn_state *s, float *out);

#endif
