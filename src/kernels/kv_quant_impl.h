/* Shared by the scalar and SIMD variants of the KV kernels; private to src/kernels. */
#ifndef KVQ_KERNELS_KV_QUANT_IMPL_H
#define KVQ_KERNELS_KV_QUANT_IMPL_H

#include <math.h>
#include <string.h>

#include "kernels/f16.h"
#include "kernels/kv_quant.h"

#define KVQ_ATTN_BLOCK 32 /* rows per online-softmax step */
#define KVQ_ATTN_MAXH KERN_KVQ_ATTN_HEADS /* query heads processed together */

static inline bool kvq_is_quant(int bits) { return bits < 16; }
static inline float kvq_load_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kvq_f16_to_f32(h);
}

/* A row's groups: group values each, or one of d for a normal-float row. */
static inline int kvq_gsize(int group, int d) { return group > 0 ? group : d; }
/* The scale of a normal-float row from its byte e. */
static inline float kvq_nf_scale(uint8_t e) { return e ? exp2f((float)((int)e - 216) / 12.0f) : 0.0f; }
/* Scale and bias of group gi whose parameters start at sb (kv_quant.h). */
static inline void kvq_gparams(const uint8_t *sb, int gi, int group, float *s, float *b) {
    if (group > 0) {
        *s = kvq_load_f16(sb + 4 * gi);
        *b = kvq_load_f16(sb + 4 * gi + 2);
    } else {
        *s = kvq_nf_scale(sb[0]);
        *b = -127.5f * *s;
    }
}
/* Codes of a row (n of them) as the bytes attention multiplies: the codes, or a
 * normal-float row's level bytes. */
void kern_kvq_row_codes(const uint8_t *src, int n, int bits, int group, uint8_t *out);
void kern_kvq_row_codes_scalar(const uint8_t *src, int n, int bits, int group, uint8_t *out);
/* The nf fit's thresholds at scale s: thr[k] the midpoint of levels k and k + 1, +inf
 * from nl - 1 on (never below a value, so a search over all 32 stops at nl - 1). */
static inline void kvq_nf_midpoints(const float *lv, int nl, float s, float thr[32]) {
    for (int k = 0; k < 32; k++) thr[k] = k + 1 < nl ? 0.5f * s * (lv[k] + lv[k + 1]) : INFINITY;
}
/* The squared error of x[n] (n % 16 == 0; n % 8 == 0 for AVX2) coded with nl centred
 * levels lv (padded to 32 floats) at scale s, and the codes to c when not NULL: the nf
 * encoder's inner loop (the same codes as the scalar one; the error summed in another
 * order). */
float kern_kvq_nf_fit_avx2(const float *x, int n, const float *lv, int nl, float s, uint8_t *c);
float kern_kvq_nf_fit_avx512(const float *x, int n, const float *lv, int nl, float s, uint8_t *c);
/* Maps n codes in place to the level bytes of bits-bit normal-float rows. */
void kern_kvq_nf_map_avx2(uint8_t *c, int n, int bits);
void kern_kvq_nf_map_avx512(uint8_t *c, int n, int bits);

/* kvq_nf_scale of every byte (the same floats), for the fast paths' row scales. */
const float *kern_kvq_nf_scales(void);

/* Where the SIMD unpackers of 3- and 5-bit codes find 16 codes (2 * bits bytes, LSB
 * first) in a 128-bit lane: code k is the 16-bit word of bytes w[2k], w[2k + 1]
 * shifted right by sh[k % 8] and masked (w: codes 0-7 in lo, 8-15 in hi). */
struct kvq_unpack_lut {
    uint8_t lo[16], hi[16];
    uint16_t sh[8];
};
static inline void kvq_unpack_lut(int bits, struct kvq_unpack_lut *t) {
    for (int k = 0; k < 16; k++) {
        uint8_t *w = k < 8 ? t->lo : t->hi;
        w[2 * (k % 8)] = (uint8_t)(k * bits / 8);
        w[2 * (k % 8) + 1] = (uint8_t)(k * bits / 8 + 1);
        t->sh[k % 8] = (uint16_t)(k * bits % 8);
    }
}

/* One side (K or V) the SIMD fast paths take: 4- or 8-bit uniform groups of a multiple
 * of 32, or normal-float rows (their level bytes scored as 8-bit codes). */
static inline bool kvq_fast_side(int d, const struct kern_kv_rows *r) {
    if (r->group == KERN_KVQ_NF) return kern_kvq_nf_bits(r->bits);
    return (r->bits == 4 || r->bits == 8) && r->group > 0 && r->group % 32 == 0 && d % r->group == 0;
}
/* The formats the SIMD fast paths take: both sides as above, d a multiple of 64. */
static inline bool kvq_fast_formats(int d, const struct kern_kv_rows *k, const struct kern_kv_rows *v) {
    return d % 64 == 0 && d <= KERN_KVQ_MAX_DIM && kvq_fast_side(d, k) && kvq_fast_side(d, v);
}

/* The rows of a run (K and V of the given strides) into L2: the next run lies elsewhere
 * in memory and the kernels prefetch only within a run. */
static inline void kvq_prefetch_run_l2(const struct kern_kv_run *r, size_t ks, size_t vs) {
    for (int j = 0; j < r->n; j++) {
        for (size_t b = 0; b < ks; b += 64) __builtin_prefetch(r->k + j * ks + b, 0, 2);
        for (size_t b = 0; b < vs; b += 64) __builtin_prefetch(r->v + j * vs + b, 0, 2);
    }
}

/* Variants: heads [h0, h0+nh) of the state, nh <= KVQ_ATTN_MAXH. */
void kern_kvq_attn_scalar(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                          const struct kern_kv_rows *v, int n);
void kern_kvq_attn_avx2(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                        const struct kern_kv_rows *v, int n);
void kern_kvq_attn_avx512(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                          const struct kern_kv_rows *v, int n);
/* 0 turns the fast paths (AVX-512: int8 query, int16 value weights; AVX2: int8/int16
 * query) off, leaving the generic float body for every format (tests that compare the
 * cache's logic with a float reference; not thread-safe with running kernels). */
void kern_kvq_use_fast(int on);
void kern_kvq_use_fast_avx2(int on);
void kern_kvq_use_fast_avx512(int on);
/* 0: the AVX-512 fast path unpacks normal-float rows without VBMI where the CPU has it
 * (tests of both variants on one machine). */
void kern_kvq_use_vbmi_avx512(int on);
/* Several runs with one setup, for the formats its fast path takes; false for others
 * (the caller then loops over the runs). */
bool kern_kvq_attn_avx2_runs(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                             const struct kern_kv_rows *v, const struct kern_kv_run *runs, int n_runs);
bool kern_kvq_attn_avx512_runs(struct kern_attn_state *s, int h0, int nh, const float *q, const struct kern_kv_rows *k,
                               const struct kern_kv_rows *v, const struct kern_kv_run *runs, int n_runs);
/* kern_kvq_attn_avx512_runs's fast path compiled with VBMI (kv_quant_avx512vbmi.c), for
 * the formats it takes with normal-float rows, on CPUs with VBMI. */
void kern_kvq_attn_avx512vbmi_runs(struct kern_attn_state *s, int h0, int nh, const float *q,
                                   const struct kern_kv_rows *k, const struct kern_kv_rows *v,
                                   const struct kern_kv_run *runs, int n_runs);
/* x[d] -> f16 row at dst (unaligned), rounding to nearest even like kvq_f32_to_f16
 * (F16C; a NaN stays a NaN, its payload may differ). */
void kern_kvq_to_f16_avx2(const float *x, int d, uint8_t *dst);
void kern_kvq_to_f16_avx512(const float *x, int d, uint8_t *dst);
/* The f16 row at src (unaligned) -> x[d], exactly (F16C). */
void kern_kvq_from_f16_avx2(const uint8_t *src, int d, float *x);
void kern_kvq_from_f16_avx512(const uint8_t *src, int d, float *x);
/* The Walsh-Hadamard butterflies of n values (n a power of two >= 16) in place, the
 * same float additions as the scalar ones (bit for bit). */
void kern_kvq_fwht_avx512(float *x, int n);
/* kern_kvq_hadamard (inverse: _inv) of x[d] in blocks of b (16 to 256, held in
 * registers), bit for bit. */
void kern_kvq_hadamard_avx512(float *x, int d, int b, const float *signs, float norm, bool inverse);
/* The same with b from 8 to 1024 (the butterflies of each stage in vectors of 8). */
void kern_kvq_hadamard_avx2(float *x, int d, int b, const float *signs, float norm, bool inverse);
/* The minimum and maximum of a group, in the scalar encoder's order (so which zero, -0
 * or +0, is the minimum: its sign is the bias's). */
void kern_kvq_group_range(const float *x, int n, float *mn, float *mx);
/* A group's [scale, bias] f16 words at sb (kv_quant.h) from its minimum and maximum,
 * and the bias and 1 / scale its codes are rounded with: every level's encoder. */
void kern_kvq_group_params(float mn, float mx, int qmax, uint8_t *sb, float *bias, float *inv);
/* kern_kvq_quantize_row of 4- and 8-bit rows, groups of a multiple of 16, byte for byte
 * (finite inputs; kv_quant_simd.inc). */
void kern_kvq_quantize_avx2g(const float *x, int d, int bits, int group, uint8_t *dst);
void kern_kvq_quantize_avx512g(const float *x, int d, int bits, int group, uint8_t *dst);
/* Fast unpackers for 2/3/4/5/8 bits (6 falls back to the scalar one). */
void kern_kvq_unpack_avx2(const uint8_t *src, int n, int bits, uint8_t *out);
void kern_kvq_unpack_avx512(const uint8_t *src, int n, int bits, uint8_t *out);
void kern_kvq_unpack_scalar(const uint8_t *src, int n, int bits, uint8_t *out);

#endif
