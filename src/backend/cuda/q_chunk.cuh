/* A repacked weight chunk (cuda_kernels.h) as a warp reads it: weight loads that L2
 * gives up first, a lane's share of a tile's chunk, and the float terms of its int8
 * dot products. Shared by the narrow (matmul.cu) and wide (matmul_wide.cu) products. */
#ifndef KVQ_BACKEND_CUDA_Q_CHUNK_CUH
#define KVQ_BACKEND_CUDA_Q_CHUNK_CUH

#include <cuda_fp16.h>
#include <stdint.h>

#include "backend/cuda/cuda_kernels.h"
#include "core/dtype.h"

/* Weights are read once a step, and a step reads far more of them than L2 holds:
 * their lines are the first L2 gives up (evict_first), so that what is read again
 * soon stays (inputs, KV rows, partial sums). One-token decode steps took 3-4% less
 * GPU time (H100, llama3-8b Q4_0, depth 512 and 4096), 1-2% since matvec_stream's
 * copies (which go without it) read most of the weights. */
static __device__ __forceinline__ uint64_t weight_policy() {
    uint64_t p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}

/* Loads of weight bytes (read-only while the kernel runs) with that policy; volatile,
 * so that they stay where they are issued (before griddep_wait). */
static __device__ __forceinline__ uint4 ldw16(const void *p, uint64_t pol) {
    uint4 v;
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(pol));
    return v;
}
static __device__ __forceinline__ uint2 ldw8(const void *p, uint64_t pol) {
    uint2 v;
    asm volatile("ld.global.nc.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;" : "=r"(v.x), "=r"(v.y) : "l"(p), "l"(pol));
    return v;
}
static __device__ __forceinline__ uint32_t ldw4(const void *p, uint64_t pol) {
    uint32_t v;
    asm volatile("ld.global.nc.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(v) : "l"(p), "l"(pol));
    return v;
}
static __device__ __forceinline__ uint16_t ldw2(const void *p, uint64_t pol) {
    uint16_t v;
    asm volatile("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(pol));
    return v;
}

/* How load_chunk reads a chunk: from device memory (weight loads), or from a copy in
 * shared memory (matvec_stream). */
struct from_global {
    uint64_t pol;
    __device__ __forceinline__ uint4 v16(const void *p) const { return ldw16(p, pol); }
    __device__ __forceinline__ uint2 v8(const void *p) const { return ldw8(p, pol); }
    __device__ __forceinline__ uint32_t v4(const void *p) const { return ldw4(p, pol); }
    __device__ __forceinline__ uint16_t v2(const void *p) const { return ldw2(p, pol); }
};
struct from_shared {
    __device__ __forceinline__ uint4 v16(const void *p) const { return *(const uint4 *)p; }
    __device__ __forceinline__ uint2 v8(const void *p) const { return *(const uint2 *)p; }
    __device__ __forceinline__ uint32_t v4(const void *p) const { return *(const uint32_t *)p; }
    __device__ __forceinline__ uint16_t v2(const void *p) const { return *(const uint16_t *)p; }
};

static __device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

/* Whether a repacked type's codes are nibbles (else int8). */
static __host__ __device__ constexpr bool nibbles(uint32_t T) { return T == KVQ_Q4_0 || T == KVQ_Q4_K; }

/* A repacked block's scale and bias: value = scale * code - bias (Q4_K), or scale and
 * 0 (Q4_0, Q8_0; Q4_0's codes are offset by 8 elsewhere; Q6_K: d, its two int8 scales
 * applied to the integer sums). s: the block's scale entry, dm: the row's Q4_K (d,
 * dmin) or Q6_K (d, 0) entries as one word. Exact: 11 by 6 bits. */
template <uint32_t T>
static __device__ __forceinline__ float2 block_scale(uint16_t s, uint32_t dm) {
    if (T == KVQ_Q6_K) return make_float2(h2f((uint16_t)dm), 0.0f);
    if (T != KVQ_Q4_K) return make_float2(h2f(s), 0.0f);
    const float2 d = __half22float2(*(const __half2 *)&dm);
    return make_float2(d.x * (float)(s & 63), d.y * (float)(s >> 8));
}

static __host__ __device__ __forceinline__ int64_t chunks_of(uint32_t T, int64_t cols) {
    const int64_t bpc = CUK_CHUNK_BLOCKS(T);
    return (cols / 32 + bpc - 1) / bpc;
}

/* Row strides of the staged inputs of n tokens (span codes each): a token's codes
 * take span + 32 bytes and its (scale, sum) pairs span / 32 + 1. Unpadded, token
 * rows lie a multiple of 128 bytes apart, so the 8 tokens' codes an mma's lanes read
 * at once sat in one pair of banks (4 deep within a half-warp), and the pairs of its
 * 4 token pairs in another: batch-16 products waited mostly on these loads. */
static __host__ __device__ constexpr int xs_stride(int span) { return span + 32; }
static __host__ __device__ constexpr int ds_stride(int span) { return span / 32 + 1; }

/* A lane's share of one chunk: its 16 bytes of rows g and g + 8, and the scales it
 * uses (loaded with the codes, not when they are needed). mma: both rows' scales of
 * every block; dp4a: those of its (row, block) pairs (dp4a_chunk). Q4_K: dm0, dm1
 * the rows' (d, dmin) words (dp4a: dm0 that of its row); Q6_K: both rows' scales and
 * d words, dp4a too (its lanes scale their own parts of both rows). */
template <uint32_t T>
struct chunk_frag {
    uint4 lo, hi;
    uint16_t s0[CUK_CHUNK_BLOCKS(T)], s1[CUK_CHUNK_BLOCKS(T)];
    uint32_t dm0, dm1;
};

/* A row's n consecutive scales (aligned to n halves), in one load. */
template <int N, class LD>
static __device__ __forceinline__ void load_scales(const uint16_t *p, uint16_t *s, const LD &ld) {
    if (N == 4) {
        const uint2 v = ld.v8(p);
        s[0] = (uint16_t)v.x, s[1] = (uint16_t)(v.x >> 16), s[2 % N] = (uint16_t)v.y, s[3 % N] = (uint16_t)(v.y >> 16);
    } else if (N == 2) {
        const uint32_t v = ld.v4(p);
        s[0] = (uint16_t)v, s[1 % N] = (uint16_t)(v >> 16);
    } else {
        s[0] = ld.v2(p);
    }
}

/* Chunk u of a warp's run: codes at w + 1024 u and scales at s + 16 SE u, w and s
 * this lane's first (matvec_q; dp4a: s at its first block's entry, dm at its row's
 * (d, dmin)), so that each address is a constant offset. Q4_K rows' entries are 12
 * bytes apart: 4-byte loads. */
template <uint32_t T, bool MMA, class LD>
static __device__ __forceinline__ chunk_frag<T> load_chunk(const uint8_t *w, const uint16_t *s, const uint16_t *dm,
                                                           int u, const LD &ld) {
    constexpr int BPC = CUK_CHUNK_BLOCKS(T), SE = CUK_SCALE_ENTRIES(T);
    chunk_frag<T> f;
    f.lo = ld.v16(w + u * 1024);
    f.hi = ld.v16(w + u * 1024 + 512);
    s += u * 16 * SE;
    if (T == KVQ_Q6_K) { /* s: row g's entries, 8-byte aligned */
        const uint2 a = ld.v8(s), b = ld.v8(s + 8 * SE);
        f.s0[0] = (uint16_t)a.x, f.s0[1 % BPC] = (uint16_t)(a.x >> 16), f.dm0 = a.y;
        f.s1[0] = (uint16_t)b.x, f.s1[1 % BPC] = (uint16_t)(b.x >> 16), f.dm1 = b.y;
    } else if (T == KVQ_Q4_K) {
        dm += u * 16 * SE;
        f.dm0 = ld.v4(dm);
        if (MMA) {
            f.dm1 = ld.v4(dm + 8 * SE);
            load_scales<2>(s, f.s0, ld), load_scales<2>(s + 2, f.s0 + 2, ld);
            load_scales<2>(s + 8 * SE, f.s1, ld), load_scales<2>(s + 8 * SE + 2, f.s1 + 2, ld);
        } else {
            load_scales<2>(s, f.s0, ld);
        }
    } else if (MMA) {
        load_scales<BPC>(s, f.s0, ld);
        load_scales<BPC>(s + 8 * SE, f.s1, ld);
    } else {
        load_scales<BPC / 2>(s, f.s0, ld);
    }
    return f;
}

#define Q_TERM_BIAS 0x4B400000 /* 1.5 * 2^23 as a float's bits */

/* c + d * xs * (the block's integer dot product r, less 8 times the inputs' code sum
 * xsum for Q4_0, whose codes are unsigned), d the block's scale sb.x (block_scale);
 * Q4_K then less sb.y xs xsum (its min). r - 8 xsum as float without the conversion
 * instruction (a quarter of the FMA rate): |r| < 2^22, so rb = Q_TERM_BIAS + r is
 * 1.5 * 2^23 + r exactly as a float. An mma whose sums start at Q_TERM_BIAS gives
 * rb for free. Not for Q6_K. */
template <uint32_t T>
static __device__ __forceinline__ float q_term_biased(float c, float2 sb, float xs, int rb, float xsum) {
    const float o = 12582912.0f + (T == KVQ_Q4_0 ? 8.0f * xsum : 0.0f);
    const float v = __fmaf_rn(__fmul_rn(sb.x, xs), __int_as_float(rb) - o, c);
    return T == KVQ_Q4_K ? __fmaf_rn(-__fmul_rn(sb.y, xs), xsum, v) : v;
}

/* The same from r, Q6_K too. */
template <uint32_t T>
static __device__ __forceinline__ float q_term(float c, float2 sb, float xs, int r, float xsum) {
    if (T == KVQ_Q6_K) return __fmaf_rn(__fmul_rn(sb.x, xs), __int2float_rn(r), c); /* |r| < 2^24 */
    return q_term_biased<T>(c, sb, xs, Q_TERM_BIAS + r, xsum);
}

#endif
