/* A head vector of D values held by a block of D threads, one value each: its
 * per-head RMSNorm and RoPE (the CPU backend's qk_rope_token, same arithmetic), and a
 * query's preparation for the attention kernels (scaled, q.mu, rotated as the keys
 * are), for the append launch (kv_encode.cu), which does both for a layer's new
 * queries and keys. attn_prep_q (attention.cu) prepares the queries it did not see a
 * warp a head, with the same arithmetic in the same order. */
#ifndef KVQ_BACKEND_CUDA_QK_PREP_CUH
#define KVQ_BACKEND_CUDA_QK_PREP_CUH

#include "backend/cuda/hadamard.cuh"

/* Thread i's value of the head after RMSNorm (when norm) and RoPE of the token's
 * cos/sin table row; x is its value before; buf: D floats of shared memory. */
template <int D>
static __device__ float rope_head(float x, const float *norm, float eps, const float *cs, const float *sn, int half,
                                  int pairing, float *buf) {
    const int i = threadIdx.x;
    __shared__ float scale;
    /* the pair (i0, i1) this value belongs to (p == half: past the rotated values); its
     * table entries and norm weight are loaded with x, not after the barriers below */
    const int p = pairing == 0 ? i / 2 : i < 2 * half ? i % half : half;
    const int i0 = pairing == 0 ? 2 * p : p, i1 = pairing == 0 ? 2 * p + 1 : p + half;
    const float c = p < half ? cs[p] : 0.0f, s = p < half ? sn[p] : 0.0f, w = norm ? norm[i] : 0.0f;
    buf[i] = x;
    __syncthreads();
    if (norm) {
        if (i < 32) {
            float ss = 0;
            for (int j = i; j < D; j += 32) ss += buf[j] * buf[j];
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (i == 0) scale = rsqrtf(ss / (float)D + eps);
        }
        __syncthreads();
        x = buf[i] * scale * w;
        __syncthreads();
        buf[i] = x;
        __syncthreads();
    }
    float y = x;
    if (p < half) {
        const float a = buf[i0], b = buf[i1];
        y = i == i0 ? a * c - b * s : a * s + b * c;
    }
    __syncthreads(); /* buf is the caller's again */
    return y;
}

/* Thread d's constants of a query's preparation: its key offset (when the cache has
 * offsets; mu: those of the query's KV head) and Hadamard sign. They come by copies
 * or scatter_k before the kernels that read them, so they may be read before
 * griddep_wait (launch.cuh). */
struct prep_consts {
    float mu, sign;
    bool has_mu;
};
static __device__ prep_consts prep_consts_of(const float *mu, bool rot, const float *signs) {
    const int d = threadIdx.x;
    return {mu ? mu[d] : 0.0f, rot ? signs[d] : 1.0f, mu != nullptr};
}

/* Writes out[0] = q.mu and out[1 + i] = the query scaled and rotated (H diag(signs) q /
 * sqrt(D) when rot), given thread i's value q of the head and its constants c. buf: D
 * floats of shared memory. */
template <int D>
static __device__ void prep_head(float q, float scale, const prep_consts &c, bool rot, float *out, float *buf) {
    const int d = threadIdx.x;
    __shared__ float part[D / 32];
    float v = q * scale;
    float s = c.has_mu ? v * c.mu : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (d % 32 == 0) part[d / 32] = s;
    if (rot) v = hadamard_block<D>(v * c.sign, buf);
    __syncthreads();
    out[1 + d] = v;
    if (d == 0) {
        float q_mu = 0;
        for (int i = 0; i < D / 32; i++) q_mu += part[i];
        out[0] = q_mu;
    }
    __syncthreads(); /* part may be written again by the caller's next head */
}

/* The same three operations by one warp, lane l holding values [E l, E l + E) of the
 * head (E = D / 32), with the same arithmetic in the same order (so the same bits):
 * the norm's sum of squares as thread i of the block sums values i, i + 32, ...; the
 * rotation's pair partner from its lane. Partial rotations need half a multiple of E. */
template <int D>
static __device__ void rope_head_warp(float (&x)[D / 32], const float *norm, float eps, const float *cs,
                                      const float *sn, int half, int pairing) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32;
    if (norm) {
        float ss = 0;
#pragma unroll
        for (int m = 0; m < E; m++) { /* value lane + 32 m: element lane % E of lane (lane + 32 m) / E */
            float v = 0;
#pragma unroll
            for (int k = 0; k < E; k++) {
                const float o = __shfl_sync(0xffffffffu, x[k], (lane + 32 * m) / E);
                if (k == lane % E) v = o;
            }
            ss += v * v;
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float scale = rsqrtf(ss / (float)D + eps);
#pragma unroll
        for (int k = 0; k < E; k++) x[k] = x[k] * scale * norm[E * lane + k];
    }
    float y[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        const int i = E * lane + k;
        const int p = pairing == 0 ? i / 2 : i < 2 * half ? i % half : half;
        const int i0 = pairing == 0 ? 2 * p : p, i1 = pairing == 0 ? 2 * p + 1 : p + half;
        /* the partner: in this lane (pairs of neighbours), or E * (half / E) values away */
        const int other = i == i0 ? i1 : i0;
        const float xo = pairing == 0 ? x[k ^ 1] : __shfl_sync(0xffffffffu, x[k], p < half ? other / E : lane);
        y[k] = x[k];
        if (p < half) {
            const float c = cs[p], s = sn[p], a = i == i0 ? x[k] : xo, b = i == i0 ? xo : x[k];
            y[k] = i == i0 ? a * c - b * s : a * s + b * c;
        }
    }
#pragma unroll
    for (int k = 0; k < E; k++) x[k] = y[k];
}

/* prep_head by one warp: out[0] = q.mu and out[1 ..] the query scaled and rotated;
 * mu: the KV head's key offsets or NULL; signs: the rotation's or NULL (none). */
template <int D>
static __device__ void prep_head_warp(const float (&q)[D / 32], float scale, const float *mu, const float *signs,
                                      float *out) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32;
    float v[E], s[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        v[k] = q[k] * scale;
        s[k] = mu ? v[k] * mu[E * lane + k] : 0.0f;
    }
#pragma unroll
    for (int o = 16; o >= E; o >>= 1)
#pragma unroll
        for (int k = 0; k < E; k++) s[k] += __shfl_xor_sync(0xffffffffu, s[k], o / E);
#pragma unroll
    for (int o = E / 2; o >= 1; o >>= 1)
#pragma unroll
        for (int k = 0; k < o; k++) s[k] += s[k + o];
    float q_mu = 0;
#pragma unroll
    for (int w = 0; w < D / 32; w++) q_mu += __shfl_sync(0xffffffffu, s[0], w * 32 / E);
    if (signs) {
#pragma unroll
        for (int k = 0; k < E; k++) v[k] *= signs[E * lane + k];
        hadamard_warp<D>(v);
    }
#pragma unroll
    for (int k = 0; k < E; k++) out[1 + E * lane + k] = v[k];
    if (lane == 0) out[0] = q_mu;
}

#endif
