/* The Hadamard rotation of one vector of D values held by a block of D threads, one
 * value each: the butterflies in the host's order (kernels/kv_quant.c), a + b and
 * a - b rounded separately, then the scale 1/sqrt(D); so the device rotates keys
 * bit for bit as the host does. */
#ifndef KVQ_BACKEND_CUDA_HADAMARD_CUH
#define KVQ_BACKEND_CUDA_HADAMARD_CUH

/* Thread i's value of H x / sqrt(D), given its x_i; buf: D floats of shared memory
 * (free again on return). Butterflies of pairs in one warp by shuffles, the wider
 * ones through buf: two barriers each instead of two for every one. */
template <int D>
static __device__ float hadamard_block(float x, float *buf) {
    const int i = threadIdx.x;
    for (int len = 1; len < D && len < 32; len <<= 1) {
        const float b = __shfl_xor_sync(0xffffffffu, x, len);
        x = (i & len) ? __fsub_rn(b, x) : __fadd_rn(x, b);
    }
    for (int len = 32; len < D; len <<= 1) {
        buf[i] = x;
        __syncthreads();
        const float b = buf[i ^ len];
        __syncthreads();
        x = (i & len) ? __fsub_rn(b, x) : __fadd_rn(x, b);
    }
    return x * (1.0f / sqrtf((float)D));
}

#endif
