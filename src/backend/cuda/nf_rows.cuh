/* Normal-float KV rows on the device (kernels/kv_quant.h): codes of 2 to 5 bits that
 * index level bytes u[code] symmetric about 127.5, one scale byte e a row,
 * x' = s (u[code] - 127.5) with s = 2^((e - 216) / 12). */
#ifndef KVQ_BACKEND_CUDA_NF_ROWS_CUH
#define KVQ_BACKEND_CUDA_NF_ROWS_CUH

#include <stdint.h>

extern "C" {
#include "kernels/kv_quant.h"
}

struct nf_level_tables {
    uint8_t l2[4], l3[8], l4[16], l5[32];
};
static __device__ const nf_level_tables nf_tables = {KERN_KVQ_NF_LEVELS2, KERN_KVQ_NF_LEVELS3, KERN_KVQ_NF_LEVELS4,
                                                     KERN_KVQ_NF_LEVELS5};

/* The level bytes of bits-bit rows (kern_kvq_nf_levels). */
static __device__ __forceinline__ const uint8_t *nf_levels(int bits) {
    return bits == 2 ? nf_tables.l2 : bits == 3 ? nf_tables.l3 : bits == 4 ? nf_tables.l4 : nf_tables.l5;
}

/* The scale of a row from its byte, as the host's kvq_nf_scale: exp2f of the same
 * float argument, here through the double exp2 rounded to float (every one of the 255
 * values lies at least 0.005 ulp from a rounding midpoint, so both round alike). */
static __device__ __forceinline__ float nf_scale(uint32_t e) {
    return e ? (float)exp2((double)__fdiv_rn((float)((int)e - 216), 12.0f)) : 0.0f;
}

static __device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

/* Four bytes of the level table from byte 4i on, as a word (a compile-time constant). */
template <int BITS>
static __host__ __device__ constexpr uint32_t nf_word(int i) {
    constexpr uint8_t l2[] = KERN_KVQ_NF_LEVELS2, l3[] = KERN_KVQ_NF_LEVELS3, l4[] = KERN_KVQ_NF_LEVELS4;
    const uint8_t *u = BITS == 2 ? l2 : BITS == 3 ? l3 : l4;
    return 4 * i >= (1 << BITS) ? 0u
                                : (uint32_t)u[4 * i] | (uint32_t)u[4 * i + 1] << 8 | (uint32_t)u[4 * i + 2] << 16 |
                                      (uint32_t)u[4 * i + 3] << 24;
}

/* The level bytes of 8 codes of BITS (2, 3 or 4; raw: the unit's bits, LSB first) in
 * two words, in order: byte permutations whose selector nibbles hold the codes (3 bits
 * a nibble index 8 table bytes; a 4-bit code's top bit picks between two such). */
template <int BITS>
static __device__ __forceinline__ uint2 nf_level_bytes(uint32_t raw) {
    constexpr uint32_t T0 = nf_word<BITS>(0), T1 = nf_word<BITS>(1), T2 = nf_word<BITS>(2), T3 = nf_word<BITS>(3);
    uint2 r;
    if constexpr (BITS == 2) { /* even codes' nibbles, odd codes', then interleaved */
        const uint32_t e = prmt(T0, 0, raw & 0x3333u), o = prmt(T0, 0, (raw >> 2) & 0x3333u);
        r = make_uint2(prmt(e, o, 0x5140), prmt(e, o, 0x7362));
    } else if constexpr (BITS == 3) { /* codes 3 bits apart to 4: pairs 6 bits apart to 8, then within each */
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const uint32_t x = raw >> (12 * half);
            const uint32_t t = (x & 0x3Fu) | ((x << 2) & 0x3F00u);
            const uint32_t s = (t & 0x0707u) | ((t << 1) & 0x7070u);
            (half ? r.y : r.x) = prmt(T0, T1, s);
        }
    } else {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const uint32_t x = raw >> (16 * half);
            const uint32_t lo = prmt(T0, T1, x & 0x7777u), hi = prmt(T2, T3, x & 0x7777u);
            (half ? r.y : r.x) = prmt(lo, hi, 0x3210u | ((x >> 1) & 0x4444u));
        }
    }
    return r;
}

#endif
