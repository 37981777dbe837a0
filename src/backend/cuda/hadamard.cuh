/* The Hadamard rotation of one vector of D values held by a block of D threads, one
 * value each: the butterflies in the host's order (kernels/kv_quant.c), a + b and
 * a - b rounded separately, then the scale 1/sqrt(D); so the device rotates keys
 * bit for bit as the host does. */
#ifndef KVQ_BACKEND_CUDA_HADAMARD_CUH
#define KVQ_BACKEND_CUDA_HADAMARD_CUH

/* Thread i's value of H x / sqrt(D), given its x_i; buf: D floats of shared memory. */
template <int D>
static __device__ float hadamard_block(float x, float *buf) {
    const int i = threadIdx.x;
    buf[i] = x;
    for (int len = 1; len < D; len <<= 1) {
        __syncthreads();
        const float a = buf[i], b = buf[i ^ len];
        __syncthreads();
        buf[i] = (i & len) ? __fsub_rn(b, a) : __fadd_rn(a, b);
    }
    __syncthreads();
    const float r = buf[i] * (1.0f / sqrtf((float)D));
    __syncthreads();
    return r;
}

#endif
