/* Inputs of the repacked matrix-vector kernels rounded to int8 in blocks of 32, as
 * the CPU rounds its q8 activations: one warp rounds one block, a value per lane.
 * Shared by cuk_quantize_x and the kernels that write their output rounded too. */
#ifndef KVQ_BACKEND_CUDA_ROUND_X_CUH
#define KVQ_BACKEND_CUDA_ROUND_X_CUH

/* Lane i's value v becomes q[i]; lane 0 writes the block's (scale, sum of codes). */
static __device__ __forceinline__ void round_x32(float v, int8_t *q, float2 *dsum) {
    const int lane = threadIdx.x % 32;
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    const int c = __float2int_rn(fminf(fmaxf(v * id, -127.0f), 127.0f));
    q[lane] = (int8_t)c;
    int sum = c;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) *dsum = make_float2(amax / 127.0f, (float)sum);
}

#endif
