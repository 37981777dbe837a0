/* Dequantization of weight rows and preparation (quantization) of activation rows. */
#include "core/dtype.h"
#include "kernels/f16.h"
#include "kernels/matmul_impl.h"

#include <math.h>
#include <string.h>

/* Round to nearest, ties to even: the same as the SIMD conversions, so every
 * level prepares bit-identical activations. */
static inline int kern_round(float v) { return (int)rintf(v); }
/* An int8 code of v = x / d: NaN (a NaN or inf activation) gives 0 and the rest is
 * clamped, so no conversion is undefined and sums cannot overflow; in-range values
 * round exactly as before (the SIMD quantizers do the same). */
static inline int q8_code(float v) { return v != v ? 0 : kern_round(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v); }

size_t kern_act_row_bytes(uint32_t wtype, int64_t k) {
    switch (wtype) {
    case KVQ_Q8_0:
    case KVQ_Q4_0:
        return (size_t)((k / 32 + 1) / 2) * KERN_PAIR_BYTES;
    case KVQ_Q4_K:
    case KVQ_Q6_K:
        return (size_t)(k / 256) * KERN_Q8K_BYTES;
    default:
        return (size_t)k * sizeof(float);
    }
}

/* Quantizes 32 values to int8 with d = amax/127; returns d, writes the sum. */
static float quant_block32(const float *x, int8_t *q, int32_t *sum) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f;
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < 32; i++) {
        int v = q8_code(x[i] * id);
        q[i] = (int8_t)v;
        s += v;
    }
    *sum = s;
    return d;
}

static void prepare_pairs(uint32_t wtype, const float *x, struct kern_pair *dst, int64_t k) {
    int64_t nb = k / 32;
    int64_t np = (nb + 1) / 2;
    for (int64_t p = 0; p < np; p++) {
        struct kern_pair *o = &dst[p];
        memset(o, 0, sizeof *o);
        for (int h = 0; h < 2; h++) {
            int64_t b = 2 * p + h;
            if (b >= nb) break;
            int8_t tmp[32];
            int32_t sum;
            o->d[h] = quant_block32(x + b * 32, tmp, &sum);
            if (wtype == KVQ_Q8_0) {
                memcpy(o->q + 32 * h, tmp, 32);
                o->c[h] = -128 * sum;
            } else { /* Q4_0 order: [b0 lo | b1 lo | b0 hi | b1 hi] */
                memcpy(o->q + 16 * h, tmp, 16);
                memcpy(o->q + 32 + 16 * h, tmp + 16, 16);
                o->c[h] = -8 * sum;
            }
        }
    }
}

static void prepare_q8k(const float *x, struct kern_q8k *dst, int64_t k) {
    for (int64_t b = 0; b < k / 256; b++) {
        const float *xb = x + b * 256;
        struct kern_q8k *o = &dst[b];
        float amax = 0.0f;
        for (int i = 0; i < 256; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        o->d = amax / 127.0f;
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int i = 0; i < 16; i++) {
                int v = q8_code(xb[g * 16 + i] * id);
                o->q[g * 16 + i] = (int8_t)v;
                s += v;
            }
            o->bsums[g] = (int16_t)s;
        }
        o->pad = 0;
    }
}

void kern_act_prepare(uint32_t wtype, const float *x, void *dst, int64_t k) {
    const enum kvq_simd level = kvq_simd_level();
    if (level == KVQ_SIMD_AVX512 && kern_act_prepare_avx512(wtype, x, dst, k)) return;
    if (level == KVQ_SIMD_AVX2 && kern_act_prepare_avx2(wtype, x, dst, k)) return;
    switch (wtype) {
    case KVQ_Q8_0:
    case KVQ_Q4_0:
        prepare_pairs(wtype, x, dst, k);
        break;
    case KVQ_Q4_K:
    case KVQ_Q6_K:
        prepare_q8k(x, dst, k);
        break;
    default:
        memcpy(dst, x, (size_t)k * sizeof(float));
        break;
    }
}

static void deq_q8_0(const uint8_t *b, float *y, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++, b += 34, y += 32) {
        float d = kvq_f16_to_f32(kern_rd16(b));
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
    }
}

static void deq_q4_0(const uint8_t *b, float *y, int64_t n) {
    for (int64_t i = 0; i < n / 32; i++, b += 18, y += 32) {
        float d = kvq_f16_to_f32(kern_rd16(b));
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((q[j] & 0x0F) - 8);
            y[j + 16] = d * (float)((q[j] >> 4) - 8);
        }
    }
}

static void deq_q4_k(const uint8_t *b, float *y, int64_t n) {
    for (int64_t i = 0; i < n / 256; i++, b += 144) {
        float d = kvq_f16_to_f32(kern_rd16(b));
        float dmin = kvq_f16_to_f32(kern_rd16(b + 2));
        const uint8_t *sc = b + 4;
        const uint8_t *q = b + 16;
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t s0, m0, s1, m1;
            kern_q4k_scale_min(2 * c, sc, &s0, &m0);
            kern_q4k_scale_min(2 * c + 1, sc, &s1, &m1);
            float d0 = d * s0, mm0 = dmin * m0, d1 = d * s1, mm1 = dmin * m1;
            for (int l = 0; l < 32; l++) *y++ = d0 * (float)(q[l] & 0x0F) - mm0;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] >> 4) - mm1;
        }
    }
}

static void deq_q6_k(const uint8_t *b, float *y, int64_t n) {
    for (int64_t i = 0; i < n / 256; i++, b += 210) {
        const uint8_t *ql = b;
        const uint8_t *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = kvq_f16_to_f32(kern_rd16(b + 208));
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

void kern_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n) {
    const uint8_t *b = src;
    switch (type) {
    case KVQ_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case KVQ_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = kvq_f16_to_f32(kern_rd16(b + 2 * i));
        break;
    case KVQ_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = kvq_bf16_to_f32(kern_rd16(b + 2 * i));
        break;
    case KVQ_Q8_0: deq_q8_0(b, dst, n); break;
    case KVQ_Q4_0: deq_q4_0(b, dst, n); break;
    case KVQ_Q4_K: deq_q4_k(b, dst, n); break;
    case KVQ_Q6_K: deq_q6_k(b, dst, n); break;
    default:
        memset(dst, 0, (size_t)n * sizeof(float));
        break;
    }
}
