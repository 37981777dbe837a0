/* The sum of a split product's partial sums at one output (cuk_wide_pending): split
 * 0's, then each later split's in order, four splits' loads in flight at a time, so that
 * every kernel that adds them up (wide_reduce, or the operation reading the product's
 * outputs) gets the same bits. T: float, or float4 for four outputs at once; zs: T's
 * from one split's sums to the next's. */
#ifndef KVQ_BACKEND_CUDA_SPLIT_SUM_CUH
#define KVQ_BACKEND_CUDA_SPLIT_SUM_CUH

#include <stdint.h>

static __device__ __forceinline__ float4 operator+(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

template <typename T>
static __device__ __forceinline__ T split_sum(const T *part, int64_t zs, int splits, int64_t i) {
    T v = part[i];
    for (int z = 1; z < splits; z += 4) {
        T p[4];
#pragma unroll
        for (int k = 0; k < 4; k++) p[k] = z + k < splits ? part[(z + k) * zs + i] : T{};
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (z + k < splits) v = v + p[k];
    }
    return v;
}

#endif
