/* Quantized KV rows: pure functions over buffers.
 *
 * Row format (one head vector of d values, "bits" in 2,3,4,5,6,8, group size g):
 *   [codes: d*bits/8 bytes][per group: scale f16, bias f16]   (row_bytes = d*bits/8 + 4*d/g)
 * Codes are packed densely, LSB first, in value order. Each group of g values is
 * affine-quantized: scale = (max-min)/(2^bits-1), bias = min (both stored as f16),
 * code = clamp(round((x - bias)/scale), 0, 2^bits-1), x' = scale*code + bias.
 * bits 16 and 32 describe plain f16 / f32 rows (row_bytes = d*bits/8).
 *
 * Normal-float rows (group == KERN_KVQ_NF, bits 2..5): the rotated coordinates of a row
 * are close to normal, so the codes index the Lloyd-Max levels of N(0,1) (optimal for
 * that distribution), held as bytes u[code] symmetric about 127.5 (kern_kvq_nf_levels),
 * with one scale for the whole row:
 *   [codes: d*bits/8 bytes][scale: 1 byte e]                  (row_bytes = d*bits/8 + 1)
 * x' = s*(u[code] - 127.5), s = 2^((e-216)/12) (e = 0: s = 0). The encoder picks the
 * scale that minimizes the row's squared error (clipping the tails where that pays),
 * not the one its maximum gives. Attention treats such a row as one group of scale s
 * and bias -127.5*s over the bytes u[code].
 *
 * Attention reads the packed codes directly: per group, score += scale*dot(q, codes)
 * + bias*sum(q); values accumulate p*scale*codes + p*bias the same way. Rows are
 * unpacked to 8-bit codes a block at a time (in L1), never to a float copy. */
#ifndef KVQ_KERNELS_KV_QUANT_H
#define KVQ_KERNELS_KV_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/attention.h"

#define KERN_KVQ_MAX_DIM 1024 /* largest head_dim the kernels accept */
#define KERN_KVQ_NF (-1)       /* group of a normal-float row (see above) */
/* The level bytes of normal-float rows of 2..5 bits, round(127.5 + l * 127.5 / l_max)
 * for the Lloyd-Max levels l of N(0,1) (kern_kvq_nf_levels; the CUDA kernels' too). */
#define KERN_KVQ_NF_LEVELS2 {0, 89, 166, 255}
#define KERN_KVQ_NF_LEVELS3 {0, 48, 83, 113, 142, 172, 207, 255}
#define KERN_KVQ_NF_LEVELS4 {0, 31, 52, 69, 84, 97, 109, 122, 133, 146, 158, 171, 186, 203, 224, 255}
#define KERN_KVQ_NF_LEVELS5                                                                                          \
    {0, 22, 37, 48, 57, 66, 73, 80, 86, 92, 98, 104, 109, 114, 120, 125,                                              \
     130, 135, 141, 146, 151, 157, 163, 169, 175, 182, 189, 198, 207, 218, 233, 255}

/* True for a quantized bit width (2,3,4,5,6,8). */
bool kern_kvq_bits_quantized(int bits);
/* True for bits a normal-float row may have (2..5). */
bool kern_kvq_nf_bits(int bits);
/* The level bytes u[code] of a normal-float row of `bits` bits (2^bits of them). */
const uint8_t *kern_kvq_nf_levels(int bits);
/* Bytes of one row of d values (see the format above). */
size_t kern_kvq_row_bytes(int bits, int group, int d);

/* Quantizes one row x[d] into dst (row_bytes). bits 16/32 store floats. */
void kern_kvq_quantize_row(const float *x, int d, int bits, int group, uint8_t *dst);
/* Reconstructs one row into x[d]. */
void kern_kvq_dequantize_row(const uint8_t *src, int d, int bits, int group, float *x);
/* Unpacks n codes (n*bits a multiple of 8) of `bits` bits each into bytes. */
void kern_kvq_unpack_codes(const uint8_t *src, int n, int bits, uint8_t *out);

/* Randomized Walsh-Hadamard rotation of a head vector, in place: x <- H diag(signs) x
 * / sqrt(b), applied to each block of b values, b the largest power of two dividing d
 * (at most 1024). Orthogonal, so dot products are unchanged when both sides rotate. */
void kern_kvq_hadamard(float *x, int d, const float *signs);
/* The inverse: x <- diag(signs) H x / sqrt(b). */
void kern_kvq_hadamard_inv(float *x, int d, const float *signs);
/* Fills signs[d] with +-1 from a fixed generator seeded by seed. */
void kern_kvq_hadamard_signs(float *signs, int d, uint64_t seed);

/* n rows of one KV head: row j starts at data + j*stride. */
struct kern_kv_rows {
    const uint8_t *data;
    size_t stride; /* bytes */
    int bits, group;
};

/* Online-softmax attention over n key/value rows in any mix of formats, for the
 * s->n_q query heads that share the KV head (each row is read once for all of them).
 * q: [n_q][d] f32, already scaled (and rotated like the keys). */
void kern_kvq_attn_accumulate(struct kern_attn_state *s, const float *q, const struct kern_kv_rows *k,
                              const struct kern_kv_rows *v, int n);

/* n rows of keys and values of one KV head at k and v (strides and formats given
 * separately): one block of a paged cache. */
struct kern_kv_run {
    const uint8_t *k, *v;
    int n;
};
/* The same attention over several runs in order, as if their rows were one sequence:
 * the per-call setup (query layout, sums) is paid once. kf, vf give the strides and
 * formats (their data is ignored). f16/f32 keys and values of equal width, too. Up to
 * KERN_KVQ_ATTN_HEADS query heads share each row's loading and unpacking. */
#define KERN_KVQ_ATTN_HEADS 8
void kern_kvq_attn_accumulate_runs(struct kern_attn_state *s, const float *q, const struct kern_kv_rows *kf,
                                   const struct kern_kv_rows *vf, const struct kern_kv_run *runs, int n_runs);

/* "avx512", "avx2" or "scalar": the variant the KV kernels use (KVQ_SIMD forces one). */
const char *kern_kvq_simd_level(void);

#endif
