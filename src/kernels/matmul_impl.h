/* Private to the kernels (and their tests/bench): prepared-activation layouts,
 * the per-ISA implementations and a way to pick one explicitly. */
#ifndef KVQ_KERNELS_MATMUL_IMPL_H
#define KVQ_KERNELS_MATMUL_IMPL_H

#include "core/cpu.h"
#include "kernels/attention.h"
#include "kernels/inline.h"
#include "kernels/matmul.h"

#include <stdint.h>
#include <string.h>

/* Prepared activations for Q8_0 and Q4_0 weights ("pair" format): blocks of 32
 * values quantized to int8 with d = amax/127, grouped in pairs of blocks (the
 * last pair is zero-padded when the row has an odd number of blocks):
 *   int8 q[64]; int32 c[2]; float d[2];            (80 bytes per 64 values)
 * Q8_0: q[0..31] = block 2p, q[32..63] = block 2p+1, c[i] = -128 * sum(block i)
 *       (the SIMD code multiplies (w ^ 0x80) as unsigned bytes by q).
 * Q4_0: q = [b0 x0..15 | b1 x0..15 | b0 x16..31 | b1 x16..31] (the order the
 *       nibbles of the two weight blocks unpack to), c[i] = -8 * sum(block i). */
#define KERN_PAIR_BYTES 80
struct kern_pair {
    int8_t q[64];
    int32_t c[2];
    float d[2];
};

/* Prepared activations for Q4_K and Q6_K weights (Q8_K-like), per 256 values:
 *   int8 q[256]; int16 bsums[16] (sum of each 16 values); float d; 4 bytes pad. */
#define KERN_Q8K_BYTES 296
struct kern_q8k {
    int8_t q[256];
    int16_t bsums[16];
    float d;
    int32_t pad;
};


/* Code bytes of one block of a 16-row tile (matmul.h): 16 rows x 32 int8 or 4-bit codes. */
static inline size_t kern_rows16_code_bytes(int q4) { return q4 ? 256 : 512; }

typedef void (*kern_matmul_fn)(const struct kern_matmul_args *a, int64_t r0, int64_t r1);
typedef void (*kern_attn_fn)(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                             const void *v, size_t v_stride, int elem_bits, int n);

void kern_matmul_scalar(const struct kern_matmul_args *a, int64_t r0, int64_t r1);
void kern_matmul_avx2(const struct kern_matmul_args *a, int64_t r0, int64_t r1);
void kern_matmul_avx2vnni(const struct kern_matmul_args *a, int64_t r0, int64_t r1); /* with AVX-VNNI */
void kern_matmul_avx512(const struct kern_matmul_args *a, int64_t r0, int64_t r1);

/* SIMD activation preparation (same bytes as the scalar one); returns 0 when it
 * does not handle the type. */
int kern_act_prepare_avx2(uint32_t wtype, const float *x, void *dst, int64_t k);
int kern_act_prepare_avx512(uint32_t wtype, const float *x, void *dst, int64_t k);

void kern_attn_accumulate_scalar(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                                 const void *v, size_t v_stride, int elem_bits, int n);
void kern_attn_accumulate_avx2(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                               const void *v, size_t v_stride, int elem_bits, int n); /* d % 8 == 0 */
void kern_attn_accumulate_avx512(struct kern_attn_state *s, const float *q, const void *k, size_t k_stride,
                                 const void *v, size_t v_stride, int elem_bits, int n); /* d % 16 == 0 */


/* Attention processes heads in groups of at most this many per pass over K/V. */
#define KERN_ATTN_MAX_GROUP 16
/* Rows per online-softmax block. */
#define KERN_ATTN_BLOCK 64

/* always inlined: a call from the SIMD loops would be one checked by ASan (kernels/asan.h) */
INLINE uint16_t kern_rd16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

INLINE int32_t kern_rd32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4_K: 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes. */
static inline void kern_q4k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#endif
