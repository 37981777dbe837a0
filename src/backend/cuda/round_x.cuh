/* Inputs of the repacked matrix-vector kernels rounded to int8 in blocks of 32, as
 * the CPU rounds its q8 activations: one warp rounds one block, a value per lane.
 * Shared by cuk_quantize_x and the kernels that write their output rounded too. */
#ifndef KVQ_BACKEND_CUDA_ROUND_X_CUH
#define KVQ_BACKEND_CUDA_ROUND_X_CUH

#include <cuda_fp16.h>

/* f16 of x, saturated: a value beyond f16's range becomes its largest, not inf. */
static __device__ __forceinline__ __half sat_half(float x) { return __float2half_rn(fminf(fmaxf(x, -65504.0f), 65504.0f)); }

/* Where column i of a row goes in an f16 copy for the products: in place, or (wide)
 * in the order the wide products' B tiles take each block of 32 columns (matmul_wide.cu):
 * its 16 pairs as a 4 x 4 transpose (pair 4i + j to 4j + i). */
static __device__ __forceinline__ int64_t half_at(int64_t i, bool wide) {
    const int64_t p = i % 32 / 2;
    return wide ? i - i % 32 + (p % 4 * 4 + p / 4) * 2 + i % 2 : i;
}

/* Value v at column i of x into the f16 copy h (plain) or hw (wide), where one is set. */
static __device__ __forceinline__ void store_half(float v, int64_t i, uint16_t *h, uint16_t *hw) {
    if (h) h[i] = __half_as_ushort(sat_half(v));
    else if (hw) hw[half_at(i, true)] = __half_as_ushort(sat_half(v));
}

/* A block's 1 / scale from its largest magnitude, and a value's code: one formula for
 * both roundings below, which must give the same codes. */
static __device__ __forceinline__ float inv_scale(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }
static __device__ __forceinline__ int code_of(float v, float id) {
    return __float2int_rn(fminf(fmaxf(v * id, -127.0f), 127.0f));
}

/* Lane i's value v becomes q[i]; lane 0 writes the block's (scale, sum of codes). */
static __device__ __forceinline__ void round_x32(float v, int8_t *q, float2 *dsum) {
    const int lane = threadIdx.x % 32;
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int c = code_of(v, inv_scale(amax));
    q[lane] = (int8_t)c;
    int sum = c;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) *dsum = make_float2(amax / 127.0f, (float)sum);
}

/* The same rounding with 8 lanes a block, 4 consecutive values v each: lane l's
 * values are codes 4 (l % 8) .. + 3 of the block at q; the group's first lane
 * writes (scale, sum). Every lane of the warp calls it (the shuffles); those with
 * store false write nothing. */
static __device__ __forceinline__ void round_x4(const float (&v)[4], bool store, int8_t *q, float2 *dsum) {
    const int sub = threadIdx.x % 8;
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = inv_scale(amax);
    int c[4], sum = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) sum += c[k] = code_of(v[k], id);
    for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (!store) return;
    *(uint32_t *)(q + 4 * sub) = (uint32_t)(c[0] & 0xFF) | (uint32_t)(c[1] & 0xFF) << 8 | (uint32_t)(c[2] & 0xFF) << 16 |
                                 (uint32_t)(c[3] & 0xFF) << 24;
    if (sub == 0) *dsum = make_float2(amax / 127.0f, (float)sum);
}

#endif
