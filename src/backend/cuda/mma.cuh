/* Warp-level tensor-core products (mma.sync, sm_80 and later) with the fragment
 * layouts of the PTX manual: groupID g = lane / 4, t = lane % 4; A rows g and g + 8,
 * B column g, accumulator rows g and g + 8 at columns 2t and 2t + 1. */
#ifndef KVQ_BACKEND_CUDA_MMA_CUH
#define KVQ_BACKEND_CUDA_MMA_CUH

#include <stdint.h>

/* d (16 x 8, int32) += a (16 x 32, int8) . b (32 x 8, int8): a0/a2 row g, a1/a3 row
 * g + 8, each 4 values from column 4t (a2, a3: 16 + 4t); b0/b1 rows 4t, 16 + 4t. */
static __device__ __forceinline__ void mma_s8_16832(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                    uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

/* c (16 x 8, f32) += a (16 x 16, f16) . b (16 x 8, f16): a0/a2 row g, a1/a3 row g + 8,
 * each 2 values from column 2t (a2, a3: 8 + 2t); b0/b1 rows 2t, 8 + 2t. */
static __device__ __forceinline__ void mma_f16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                     uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

#endif
