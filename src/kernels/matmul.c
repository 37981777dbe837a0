/* Dispatch of the matrix kernels to the best SIMD level, and the scalar
 * reference implementation (used on CPUs without AVX2 and by the tests). */
#include "core/cpu.h"
#include "core/dtype.h"
#include "kernels/asan.h"
#include "kernels/f16.h"
#include "kernels/matmul_impl.h"

#include <string.h>

const char *kern_simd_level(void) { return kvq_simd_level_name(); }

#ifdef KERN_ASAN
/* What the SIMD kernels will touch of a's weights, activations and outputs (kernels/asan.h). */
static void matmul_ranges(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    if (a->w16 && (a->wtype == KVQ_Q4_0 || a->wtype == KVQ_Q8_0)) {
        const size_t tb = kern_rows16_tile_bytes(a->wtype, a->k);
        kern_asan_range((const uint8_t *)a->w16 + (size_t)(r0 / 16) * tb, (size_t)((r1 + 15) / 16 - r0 / 16) * tb);
    } else {
        kern_asan_rows((const uint8_t *)a->w + (size_t)r0 * a->w_row_bytes, (size_t)(r1 - r0), a->w_row_bytes,
                       a->w_row_bytes);
    }
    kern_asan_rows(a->xa, (size_t)a->n_tok, a->xa_row_bytes, a->xa_row_bytes);
    kern_asan_rows(a->y + r0, (size_t)a->n_tok, (size_t)(r1 - r0) * sizeof(float), (size_t)a->y_stride * sizeof(float));
}
#else
#define matmul_ranges(a, r0, r1) ((void)0)
#endif

void kern_matmul(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    if (r0 >= r1 || a->n_tok <= 0) return;
    const enum kvq_simd level = kvq_simd_level();
    if (level >= KVQ_SIMD_AVX2) matmul_ranges(a, r0, r1);
    switch (level) {
    case KVQ_SIMD_AVX512: kern_matmul_avx512(a, r0, r1); break;
    case KVQ_SIMD_AVX2:
        if (kvq_cpu_avx_vnni()) kern_matmul_avx2vnni(a, r0, r1);
        else kern_matmul_avx2(a, r0, r1);
        break;
    default: kern_matmul_scalar(a, r0, r1); break;
    }
}

/* ---- the 16-row form ------------------------------------------------------ */

int kern_rows16_wanted(uint32_t wtype) {
    const enum kvq_simd level = kvq_simd_level();
    return (wtype == KVQ_Q4_0 || wtype == KVQ_Q8_0) && level >= KVQ_SIMD_AVX2;
}

size_t kern_rows16_tile_bytes(uint32_t wtype, int64_t k) {
    return ((size_t)(k / 32) * (kern_rows16_code_bytes(wtype == KVQ_Q4_0) + 32) + 63) & ~(size_t)63;
}

size_t kern_rows16_bytes(uint32_t wtype, int64_t rows, int64_t k) {
    return (size_t)((rows + 15) / 16) * kern_rows16_tile_bytes(wtype, k);
}

void kern_rows16_pack(uint32_t wtype, const void *w, size_t w_row_bytes, int64_t rows, int64_t k, void *dst) {
    const int64_t nb = k / 32;
    const size_t cb = kern_rows16_code_bytes(wtype == KVQ_Q4_0), bb = kvq_dtype_row_bytes(wtype, 32),
                 tb = kern_rows16_tile_bytes(wtype, k);
    const uint32_t flip = wtype == KVQ_Q4_0 ? 0 : 0x80808080u;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        uint8_t *tile = (uint8_t *)dst + (size_t)(r0 / 16) * tb, *scales = tile + (size_t)nb * cb;
        const int nr = rows - r0 < 16 ? (int)(rows - r0) : 16;
        memset(tile, 0, tb); /* padding rows and bytes */
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *codes = tile + (size_t)b * cb;
            for (int r = 0; r < nr; r++) {
                const uint8_t *blk = (const uint8_t *)w + (size_t)(r0 + r) * w_row_bytes + (size_t)b * bb;
                for (size_t j = 0; j < cb / 64; j++) {
                    uint32_t v;
                    memcpy(&v, blk + 2 + 4 * j, 4);
                    v ^= flip;
                    memcpy(codes + 64 * j + 4 * (size_t)r, &v, 4);
                }
                memcpy(scales + 32 * (size_t)b + 2 * (size_t)r, blk, 2);
            }
        }
    }
}

void kern_rows16_row(uint32_t wtype, const void *w16, int64_t k, int64_t row, float *dst) {
    const int64_t nb = k / 32;
    const size_t cb = kern_rows16_code_bytes(wtype == KVQ_Q4_0);
    const uint32_t flip = wtype == KVQ_Q4_0 ? 0 : 0x80808080u;
    const uint8_t *tile = (const uint8_t *)w16 + (size_t)(row / 16) * kern_rows16_tile_bytes(wtype, k);
    const size_t r = (size_t)(row % 16);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t blk[34]; /* the block as the file has it: d, then the codes */
        memcpy(blk, tile + (size_t)nb * cb + 32 * (size_t)b + 2 * r, 2);
        for (size_t j = 0; j < cb / 64; j++) {
            uint32_t v;
            memcpy(&v, tile + (size_t)b * cb + 64 * j + 4 * r, 4);
            v ^= flip;
            memcpy(blk + 2 + 4 * j, &v, 4);
        }
        kern_dequantize_row(wtype, blk, dst + 32 * b, 32);
    }
}

/* ---- scalar reference ---------------------------------------------------- */

static float dot_pairs(uint32_t wtype, const uint8_t *w, const struct kern_pair *x, int64_t k) {
    int64_t nb = k / 32;
    float sum = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const struct kern_pair *p = &x[b / 2];
        int h = (int)(b & 1);
        int32_t s = 0;
        float dw;
        if (wtype == KVQ_Q8_0) {
            const uint8_t *blk = w + b * 34;
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int i = 0; i < 32; i++) s += q[i] * p->q[32 * h + i];
            dw = kvq_f16_to_f32(kern_rd16(blk));
        } else {
            const uint8_t *blk = w + b * 18;
            const uint8_t *q = blk + 2;
            for (int i = 0; i < 16; i++) {
                s += ((q[i] & 0x0F) - 8) * p->q[16 * h + i];
                s += ((q[i] >> 4) - 8) * p->q[32 + 16 * h + i];
            }
            dw = kvq_f16_to_f32(kern_rd16(blk));
        }
        sum += dw * p->d[h] * (float)s;
    }
    return sum;
}

static float dot_q4k(const uint8_t *w, const struct kern_q8k *x, int64_t k) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / 256; b++, w += 144) {
        const struct kern_q8k *xb = &x[b];
        const uint8_t *q = w + 16;
        int32_t sumi = 0, summ = 0;
        for (int c = 0; c < 4; c++, q += 32) {
            uint8_t s0, m0, s1, m1;
            kern_q4k_scale_min(2 * c, w + 4, &s0, &m0);
            kern_q4k_scale_min(2 * c + 1, w + 4, &s1, &m1);
            int32_t d0 = 0, d1 = 0;
            for (int l = 0; l < 32; l++) {
                d0 += (q[l] & 0x0F) * xb->q[64 * c + l];
                d1 += (q[l] >> 4) * xb->q[64 * c + 32 + l];
            }
            sumi += s0 * d0 + s1 * d1;
            summ += m0 * (xb->bsums[4 * c] + xb->bsums[4 * c + 1]) +
                    m1 * (xb->bsums[4 * c + 2] + xb->bsums[4 * c + 3]);
        }
        float d = kvq_f16_to_f32(kern_rd16(w));
        float dmin = kvq_f16_to_f32(kern_rd16(w + 2));
        sum += xb->d * (d * (float)sumi - dmin * (float)summ);
    }
    return sum;
}

static float dot_q6k(const uint8_t *w, const struct kern_q8k *x, int64_t k) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / 256; b++, w += 210) {
        const struct kern_q8k *xb = &x[b];
        const int8_t *sc = (const int8_t *)(w + 192);
        int32_t g[16] = {0};
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h;
            const uint8_t *qh = w + 128 + 32 * h;
            const int8_t *xq = xb->q + 128 * h;
            for (int l = 0; l < 32; l++) {
                int q1 = (ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4);
                int q2 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                int q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                int gi = 8 * h + l / 16;
                g[gi + 0] += q1 * xq[l];
                g[gi + 2] += q2 * xq[l + 32];
                g[gi + 4] += q3 * xq[l + 64];
                g[gi + 6] += q4 * xq[l + 96];
            }
        }
        int32_t sumi = 0;
        for (int j = 0; j < 16; j++) sumi += sc[j] * (g[j] - 32 * xb->bsums[j]);
        sum += xb->d * kvq_f16_to_f32(kern_rd16(w + 208)) * (float)sumi;
    }
    return sum;
}

static float dot_float(uint32_t wtype, const uint8_t *w, const float *x, int64_t k) {
    float sum = 0.0f;
    switch (wtype) {
    case KVQ_F32: {
        for (int64_t i = 0; i < k; i++) {
            float v;
            memcpy(&v, w + 4 * i, 4);
            sum += v * x[i];
        }
        break;
    }
    case KVQ_F16:
        for (int64_t i = 0; i < k; i++) sum += kvq_f16_to_f32(kern_rd16(w + 2 * i)) * x[i];
        break;
    case KVQ_BF16:
        for (int64_t i = 0; i < k; i++) sum += kvq_bf16_to_f32(kern_rd16(w + 2 * i)) * x[i];
        break;
    default:
        break;
    }
    return sum;
}

void kern_matmul_scalar(const struct kern_matmul_args *a, int64_t r0, int64_t r1) {
    for (int t = 0; t < a->n_tok; t++) {
        const void *x = (const uint8_t *)a->xa + (size_t)t * a->xa_row_bytes;
        float *y = a->y + (int64_t)t * a->y_stride;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *w = (const uint8_t *)a->w + (size_t)r * a->w_row_bytes;
            switch (a->wtype) {
            case KVQ_Q8_0:
            case KVQ_Q4_0: y[r] = dot_pairs(a->wtype, w, x, a->k); break;
            case KVQ_Q4_K: y[r] = dot_q4k(w, x, a->k); break;
            case KVQ_Q6_K: y[r] = dot_q6k(w, x, a->k); break;
            default: y[r] = dot_float(a->wtype, w, x, a->k); break;
            }
        }
    }
}
