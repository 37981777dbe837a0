/* Per-token operations of the forward pass (norms, the RoPE tables, activations;
 * RoPE itself goes with the KV append, kv_encode.cu) and the scatter that places
 * host-staged rows at their device addresses. The float math follows
 * src/backend/cpu/cpu_backend.c. */
#include <math.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/round_x.cuh"

#define NORM_THREADS 1024

/* A block per token; thread i holds values i + j NORM_THREADS, j < PER, in registers,
 * so each row is read once. A warp's values at one j are 32 consecutive ones: the
 * block of 32 that round_x32 rounds. */
#define FOR_PER(j, i) for (int j = 0, i = threadIdx.x; j < PER; j++, i += NORM_THREADS)

/* Sum over the block (NORM_THREADS threads): each warp's sum, then every warp
 * sums the warps' sums (a lane each), so no thread adds them up one by one. */
static __device__ float block_sum(float v) {
    __shared__ float part[NORM_THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* part[] may still be read by a previous call */
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    float s = threadIdx.x % 32 < NORM_THREADS / 32 ? part[threadIdx.x % 32] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* The norm weights depend on no earlier kernel: read before griddep_wait. */
template <int PER>
static __device__ void load_weights(const float *w, int dim, float (&wv)[PER]) {
#pragma unroll
    FOR_PER(j, i) wv[j] = w && i < dim ? w[i] : 0.0f;
}


template <int PER>
static __device__ float rms_scale(const float (&v)[PER], int dim, float eps) {
    float ss = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) ss += v[j] * v[j];
    return rsqrtf(block_sum(ss) / (float)dim + eps);
}

/* out row t = v * s * w (v zero past dim), rounded into xq too when q. */
template <int PER>
static __device__ void norm_out(const float (&v)[PER], float s, const float (&w)[PER], int dim, int t, float *out,
                                int8_t *q, float2 *dsum) {
#pragma unroll
    FOR_PER(j, i) {
        const float o = i < dim ? v[j] * s * w[j] : 0.0f;
        if (i < dim) out[(size_t)t * dim + i] = o;
        if (q && i - (int)threadIdx.x % 32 < dim) /* the warp's block is in the row */
            round_x32(o, q + (size_t)t * dim + (i & ~31), dsum + (size_t)t * (dim / 32) + i / 32);
    }
}

template <int PER>
__global__ void __launch_bounds__(NORM_THREADS) rmsnorm_k(const float *x, const int32_t *rows, const float *w, int dim,
                                                          float eps, float *out, int8_t *q, float2 *dsum) {
    griddep_release();
    float wv[PER];
    load_weights<PER>(w, dim, wv);
    griddep_wait();
    const int t = blockIdx.x, r = rows ? rows[t] : t;
    const float *xr = x + (size_t)r * dim;
    float v[PER];
#pragma unroll
    FOR_PER(j, i) v[j] = i < dim ? xr[i] : 0.0f;
    norm_out<PER>(v, rms_scale<PER>(v, dim, eps), wv, dim, t, out, q, dsum);
}

template <int PER>
__global__ void __launch_bounds__(NORM_THREADS) add_norm_k(float *x, const float *add, const float *post, const float *w,
                                                           int dim, float eps, float *out, int8_t *q, float2 *dsum) {
    griddep_release();
    float wv[PER], pv[PER];
    load_weights<PER>(w, dim, wv);
    load_weights<PER>(post, dim, pv);
    griddep_wait();
    const int t = blockIdx.x;
    float *xr = x + (size_t)t * dim;
    const float *ar = add + (size_t)t * dim;
    float v[PER], a[PER];
#pragma unroll
    FOR_PER(j, i) {
        v[j] = i < dim ? xr[i] : 0.0f;
        a[j] = i < dim ? ar[i] : 0.0f;
    }
    const float ps = post ? rms_scale<PER>(a, dim, eps) : 1.0f;
#pragma unroll
    FOR_PER(j, i) {
        if (i >= dim) continue;
        v[j] += post ? a[j] * ps * pv[j] : a[j];
        xr[i] = v[j];
    }
    if (w) norm_out<PER>(v, rms_scale<PER>(v, dim, eps), wv, dim, t, out, q, dsum);
}

static_assert(16 * NORM_THREADS == CUK_NORM_MAX, "BY_DIM's widest case is the documented limit");

/* Launches KERNEL<PER> with the fewest values per thread that hold dim. */
#define BY_DIM(dim, LAUNCH)                           \
    if ((dim) <= NORM_THREADS) LAUNCH(1);             \
    else if ((dim) <= 2 * NORM_THREADS) LAUNCH(2);    \
    else if ((dim) <= 4 * NORM_THREADS) LAUNCH(4);    \
    else if ((dim) <= 8 * NORM_THREADS) LAUNCH(8);    \
    else LAUNCH(16)

extern "C" void cuk_rmsnorm(cuk_queue *qu, const float *x, const int32_t *rows, const float *w, int n, int dim,
                            float eps, float *out, const struct cuk_xq *xq) {
#define RN(PER)                                                                                                 \
    pdl_launch(rmsnorm_k<PER>, dim3((unsigned)n), dim3(NORM_THREADS), qu, x, rows, w, dim, eps, out, xq ? xq->q : NULL, \
               xq ? xq->dsum : NULL)
    BY_DIM(dim, RN);
#undef RN
}

extern "C" void cuk_add_norm(cuk_queue *qu, float *x, float *add, const float *post, const float *w, int n, int dim,
                             float eps, float *out, const struct cuk_xq *xq) {
#define AN(PER)                                                                                          \
    pdl_launch(add_norm_k<PER>, dim3((unsigned)n), dim3(NORM_THREADS), qu, x, add, post, w, dim, eps, out, \
               xq ? xq->q : NULL, xq ? xq->dsum : NULL)
    BY_DIM(dim, AN);
#undef AN
}

__global__ void rope_table_k(const int32_t *pos, const float *inv_freq, float linear, int half, float *cs, float *sn) {
    const int t = blockIdx.x;
    const float p = (float)pos[t] / linear;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float c, s;
        sincosf(p * inv_freq[i], &s, &c);
        cs[(size_t)t * half + i] = c;
        sn[(size_t)t * half + i] = s;
    }
}

extern "C" void cuk_rope_table(cuk_queue *qu, const int32_t *pos, int n, const float *inv_freq, float linear,
                               int half, float *cos, float *sin) {
    queue_launch(rope_table_k, dim3((unsigned)n), dim3(64), qu, pos, inv_freq, linear, half, cos, sin);
}

/* Elementwise; a warp's 32 values are one block of xq (n_ff a multiple of 32 then). */
__global__ void glu_k(int act, const float *gate, const float *up, int64_t total, float *out, int8_t *q,
                      float2 *dsum) {
    griddep_release();
    griddep_wait();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const float g = gate[i];
        float a;
        if (act == 0) a = g / (1.0f + expf(-g));
        else a = 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
        const float o = a * up[i];
        out[i] = o;
        if (q) round_x32(o, q + (i & ~(int64_t)31), dsum + i / 32);
    }
}

extern "C" void cuk_glu(cuk_queue *qu, int act, const float *gate, const float *up, int n, int n_ff, float *out,
                        const struct cuk_xq *xq) {
    const int64_t total = (int64_t)n * n_ff;
    pdl_launch(glu_k, dim3((unsigned)(total / 256 + 1 < 4096 ? total / 256 + 1 : 4096)), dim3(256), qu, act, gate, up,
               total, out, xq ? xq->q : NULL, xq ? xq->dsum : NULL);
}

__global__ void scatter_k(const cuk_copy *copies, const uint8_t *staging) {
    const cuk_copy c = copies[blockIdx.x];
    uint8_t *dst = (uint8_t *)c.dst;
    const uint8_t *src = staging + c.src;
    if ((c.dst | c.src | c.bytes) % 4 == 0) {
        for (uint32_t i = threadIdx.x; i < c.bytes / 4; i += blockDim.x)
            ((uint32_t *)dst)[i] = ((const uint32_t *)src)[i];
    } else {
        for (uint32_t i = threadIdx.x; i < c.bytes; i += blockDim.x) dst[i] = src[i];
    }
}

extern "C" void cuk_scatter(cuk_queue *qu, const cuk_copy *copies, int n, const uint8_t *staging) {
    if (n <= 0) return;
    queue_launch(scatter_k, dim3((unsigned)n), dim3(128), qu, copies, staging);
    cuk_queue_launch_plain_next(qu); /* what it placed is read before griddep_wait */
}
