/* The Hadamard rotation of one vector of D values held by a block of D threads, one
 * value each (or by a warp: hadamard_warp): the butterflies in the host's order
 * (kernels/kv_quant.c), a + b and a - b rounded separately, then the scale 1/sqrt(D);
 * so the device rotates keys bit for bit as the host does. */
#ifndef KVQ_BACKEND_CUDA_HADAMARD_CUH
#define KVQ_BACKEND_CUDA_HADAMARD_CUH

/* Thread i's values of H x / sqrt(D) for N vectors at once, given its x_i of each in
 * x[n] (replaced); buf: N * D floats of shared memory (free again on return). The
 * butterflies of pairs in one warp go by shuffles, the wider ones through buf: two
 * barriers each, shared by the N vectors. */
template <int D, int N>
static __device__ void hadamard_blocks(float (&x)[N], float *buf) {
    const int i = threadIdx.x;
    for (int len = 1; len < D && len < 32; len <<= 1)
#pragma unroll
        for (int n = 0; n < N; n++) {
            const float b = __shfl_xor_sync(0xffffffffu, x[n], len);
            x[n] = (i & len) ? __fsub_rn(b, x[n]) : __fadd_rn(x[n], b);
        }
    for (int len = 32; len < D; len <<= 1) {
        float b[N];
#pragma unroll
        for (int n = 0; n < N; n++) buf[n * D + i] = x[n];
        __syncthreads();
#pragma unroll
        for (int n = 0; n < N; n++) b[n] = buf[n * D + (i ^ len)];
        __syncthreads();
#pragma unroll
        for (int n = 0; n < N; n++) x[n] = (i & len) ? __fsub_rn(b[n], x[n]) : __fadd_rn(x[n], b[n]);
    }
#pragma unroll
    for (int n = 0; n < N; n++) x[n] = x[n] * (1.0f / sqrtf((float)D));
}

/* The same rotation of one vector held by a warp, lane l holding values [E l, E l + E)
 * (E = D / 32), replaced: the butterflies below E in registers, the others by shuffles,
 * in the same order, so the same bits. */
template <int D>
static __device__ void hadamard_warp(float (&v)[D / 32]) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int len = 1; len < E; len <<= 1) {
        float b[E];
#pragma unroll
        for (int k = 0; k < E; k++) b[k] = v[k ^ len];
#pragma unroll
        for (int k = 0; k < E; k++) v[k] = (k & len) ? __fsub_rn(b[k], v[k]) : __fadd_rn(v[k], b[k]);
    }
#pragma unroll
    for (int len = E; len < D; len <<= 1)
#pragma unroll
        for (int k = 0; k < E; k++) {
            const float b = __shfl_xor_sync(0xffffffffu, v[k], len / E);
            v[k] = ((E * lane) & len) ? __fsub_rn(b, v[k]) : __fadd_rn(v[k], b);
        }
#pragma unroll
    for (int k = 0; k < E; k++) v[k] = v[k] * (1.0f / sqrtf((float)D));
}

/* One vector: thread i's value of H x / sqrt(D); buf: D floats. */
template <int D>
static __device__ float hadamard_block(float x, float *buf) {
    float v[1] = {x};
    hadamard_blocks<D, 1>(v, buf);
    return v[0];
}

#endif
