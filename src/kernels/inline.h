/* Inlining helpers of the SIMD kernel files. */
#ifndef KVQ_KERNELS_INLINE_H
#define KVQ_KERNELS_INLINE_H

#define INLINE static inline __attribute__((always_inline))
/* Small loops over tile rows/tokens/heads must become straight-line code so that
 * the accumulators live in registers. */
#if defined(__clang__)
#define UNROLL _Pragma("unroll")
#else
#define UNROLL _Pragma("GCC unroll 16")
#endif

#endif
