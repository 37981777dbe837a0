/* Per-token operations of the forward pass (norms, the RoPE tables, activations;
 * RoPE itself goes with the KV append, kv_encode.cu), the fetch of a step's staged
 * bytes, and the scatter that places host-staged rows at their device addresses.
 * The float math follows src/backend/cpu/cpu_backend.c. */
#include <math.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/round_x.cuh"
#include "backend/cuda/split_sum.cuh"

/* A block per token. Thread i holds PER groups of 4 consecutive values, group j at
 * 4 (j TH + i), in registers, so each row is read once (in 16-byte loads where
 * rows are whole float4s) and 8 lanes hold one block of 32 that round_x4 rounds.
 * 256 threads for rows up to 4096 values (1024 before, a value a lane): the block's
 * sums wait on 8 warps instead of 32, and it takes a quarter of the registers beside
 * the kernels running with it; one-token decode with a quantized cache measured
 * 1-2% faster (H100, llama3-8b Q4_0). */
#define FOR_G(j, e) for (int j = 0, e = 4 * (int)threadIdx.x; j < PER; j++, e += 4 * TH)

/* Sum over the block (TH threads): each warp's sum, then every warp sums the
 * warps' sums (a lane each), so no thread adds them up one by one. */
template <int TH>
static __device__ float block_sum(float v) {
    __shared__ float part[TH / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* part[] may still be read by a previous call */
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    float s = threadIdx.x % 32 < TH / 32 ? part[threadIdx.x % 32] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* This thread's groups of a row of dim values (zero past dim). */
template <int TH, int PER>
static __device__ void load_groups(const float *r, int dim, float (&v)[PER][4]) {
#pragma unroll
    FOR_G(j, e) {
        if (dim % 4 == 0) {
            const float4 f = r && e < dim ? *(const float4 *)(r + e) : make_float4(0, 0, 0, 0);
            v[j][0] = f.x, v[j][1] = f.y, v[j][2] = f.z, v[j][3] = f.w;
        } else {
#pragma unroll
            for (int c = 0; c < 4; c++) v[j][c] = r && e + c < dim ? r[e + c] : 0.0f;
        }
    }
}

template <int TH, int PER>
static __device__ void store_groups(float *r, int dim, const float (&v)[PER][4]) {
#pragma unroll
    FOR_G(j, e) {
        if (dim % 4 == 0) {
            if (e < dim) *(float4 *)(r + e) = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
        } else {
#pragma unroll
            for (int c = 0; c < 4; c++)
                if (e + c < dim) r[e + c] = v[j][c];
        }
    }
}

template <int TH, int PER>
static __device__ float rms_scale(const float (&v)[PER][4], int dim, float eps) {
    float ss = 0;
#pragma unroll
    for (int j = 0; j < PER; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) ss += v[j][c] * v[j][c];
    return rsqrtf(block_sum<TH>(ss) / (float)dim + eps);
}

/* out row t = v * s * w (unless out is NULL), and into xq's form where it has one (dim
 * a multiple of 32 then). */
static const cuk_xq no_xq = {NULL, NULL, NULL, NULL};

template <int TH, int PER>
static __device__ void norm_out(const float (&v)[PER][4], float s, const float (&w)[PER][4], int dim, int t,
                                float *out, const cuk_xq xq) {
    float o[PER][4];
#pragma unroll
    for (int j = 0; j < PER; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[j][c] = v[j][c] * s * w[j][c];
    if (out) store_groups<TH, PER>(out + (size_t)t * dim, dim, o);
    if (xq.h || xq.h_wide) {
#pragma unroll
        FOR_G(j, e) {
#pragma unroll
            for (int c = 0; c < 4; c++)
                if (e + c < dim) store_half(o[j][c], (int64_t)t * dim + e + c, xq.h, xq.h_wide);
        }
    }
    int8_t *q = xq.q;
    float2 *dsum = xq.dsum;
    if (!q) return;
#pragma unroll
    FOR_G(j, e) { /* every lane shuffles; those past the row store nothing */
        round_x4(o[j], e < dim, q + (size_t)t * dim + (e & ~31), dsum + (size_t)t * (dim / 32) + e / 32);
    }
}

template <int TH, int PER>
__global__ void __launch_bounds__(TH) rmsnorm_k(const float *x, const int32_t *rows, const float *w, int dim,
                                                float eps, float *out, const cuk_xq xq) {
    griddep_release();
    float wv[PER][4], v[PER][4];
    load_groups<TH, PER>(w, dim, wv); /* the norm weights depend on no earlier kernel */
    griddep_wait();
    const int t = blockIdx.x, r = rows ? rows[t] : t;
    load_groups<TH, PER>(x + (size_t)r * dim, dim, v);
    norm_out<TH, PER>(v, rms_scale<TH, PER>(v, dim, eps), wv, dim, t, out, xq);
}

/* Row t of a pending product's outputs (cuk_sum_in), as this thread's groups: the
 * splits' sums in split order, then the bias, as wide_reduce adds them; four splits'
 * loads in flight at a time. */
template <int TH, int PER>
static __device__ void load_sum_groups(const cuk_sum_in &s, int t, int dim, float (&v)[PER][4]) {
    const float *r = s.part + (int64_t)t * dim;
    load_groups<TH, PER>(r, dim, v);
    for (int z = 1; z < s.splits; z += 4) {
        float p[4][PER][4];
#pragma unroll
        for (int k = 0; k < 4; k++) load_groups<TH, PER>(z + k < s.splits ? r + (z + k) * s.zs : NULL, dim, p[k]);
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int j = 0; j < PER; j++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    if (z + k < s.splits) v[j][c] += p[k][j][c];
    }
    float b[PER][4];
    load_groups<TH, PER>(s.bias, dim, b); /* zeros without a bias */
#pragma unroll
    for (int j = 0; j < PER; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) v[j][c] += b[j][c];
}

template <int TH, int PER>
__global__ void __launch_bounds__(TH) add_norm_k(float *x, const float *add, const cuk_sum_in as, const float *post,
                                                 const float *w, int dim, float eps, float *out, const cuk_xq xq) {
    griddep_release();
    float wv[PER][4], pv[PER][4], v[PER][4], a[PER][4];
    load_groups<TH, PER>(w, dim, wv);
    load_groups<TH, PER>(post, dim, pv);
    griddep_wait();
    const int t = blockIdx.x;
    load_groups<TH, PER>(x + (size_t)t * dim, dim, v);
    if (as.splits) load_sum_groups<TH, PER>(as, t, dim, a);
    else load_groups<TH, PER>(add + (size_t)t * dim, dim, a);
    const float ps = post ? rms_scale<TH, PER>(a, dim, eps) : 1.0f;
#pragma unroll
    for (int j = 0; j < PER; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) v[j][c] += post ? a[j][c] * ps * pv[j][c] : a[j][c];
    store_groups<TH, PER>(x + (size_t)t * dim, dim, v);
    if (w) norm_out<TH, PER>(v, rms_scale<TH, PER>(v, dim, eps), wv, dim, t, out, xq);
}

static_assert(4 * 4 * 1024 == CUK_NORM_MAX, "BY_DIM's widest case is the documented limit");

/* Launches KERNEL<TH, PER> with the fewest threads, then values per thread, that
 * hold dim. */
#define BY_DIM(dim, LAUNCH)                     \
    if ((dim) <= 4 * 256) LAUNCH(256, 1);       \
    else if ((dim) <= 8 * 256) LAUNCH(256, 2);  \
    else if ((dim) <= 16 * 256) LAUNCH(256, 4); \
    else if ((dim) <= 16 * 512) LAUNCH(512, 4); \
    else LAUNCH(1024, 4)

extern "C" void cuk_rmsnorm(cuk_queue *qu, const float *x, const int32_t *rows, const float *w, int n, int dim,
                            float eps, float *out, const struct cuk_xq *xq) {
#define RN(TH, PER)                                                                                            \
    pdl_launch(rmsnorm_k<TH, PER>, dim3((unsigned)n), dim3(TH), qu, x, rows, w, dim, eps, out, xq ? *xq : no_xq)
    BY_DIM(dim, RN);
#undef RN
}

extern "C" void cuk_add_norm(cuk_queue *qu, float *x, float *add, const struct cuk_sum_in *add_sum, const float *post,
                             const float *w, int n, int dim, float eps, float *out, const struct cuk_xq *xq) {
    const cuk_sum_in as = add_sum ? *add_sum : cuk_sum_in{};
#define AN(TH, PER)                                                                                           \
    pdl_launch(add_norm_k<TH, PER>, dim3((unsigned)n), dim3(TH), qu, x, add, as, post, w, dim, eps, out, \
               xq ? *xq : no_xq)
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

static __device__ __forceinline__ float glu_of(int act, float g, float u) {
    const float a =
        act == 0 ? g / (1.0f + expf(-g)) : 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
    return a * u;
}

/* Value i of a pending product's outputs (cuk_sum_in), as wide_reduce adds it up. */
static __device__ __forceinline__ float sum_at(const cuk_sum_in &s, int64_t i) {
    return split_sum(s.part, s.zs, s.splits, i) + (s.bias ? s.bias[i % s.rows] : 0.0f);
}
static __device__ __forceinline__ float4 sum4_at(const cuk_sum_in &s, int64_t i4) {
    const int64_t i = 4 * i4;
    const float4 b = s.bias ? make_float4(s.bias[i % s.rows], s.bias[(i + 1) % s.rows], s.bias[(i + 2) % s.rows],
                                          s.bias[(i + 3) % s.rows])
                            : make_float4(0, 0, 0, 0);
    return split_sum((const float4 *)s.part, s.zs / 4, s.splits, i4) + b;
}

/* Elementwise; a warp's 32 values are one block of xq (n_ff a multiple of 32 then);
 * out NULL: xq's form only. gs, us: gate and up as pending sums (no splits: as they are). */
__global__ void glu_k(int act, const float *gate, const float *up, const cuk_sum_in gs, const cuk_sum_in us,
                      int64_t total, float *out, const cuk_xq xq) {
    griddep_release();
    griddep_wait();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const float o = glu_of(act, gs.splits ? sum_at(gs, i) : gate[i], us.splits ? sum_at(us, i) : up[i]);
        if (out) out[i] = o;
        if (xq.q) round_x32(o, xq.q + (i & ~(int64_t)31), xq.dsum + i / 32);
        store_half(o, i, xq.h, xq.h_wide);
    }
}

/* glu_k without the int8 rounding (steps past CUK_MATVEC_MAX tokens), four values a
 * thread by 16-byte loads and stores: single loads keep too few bytes in flight. */
__global__ void glu4_k(int act, const float4 *gate, const float4 *up, const cuk_sum_in gs, const cuk_sum_in us,
                       int64_t total4, float4 *out, const cuk_xq xq) {
    griddep_release();
    griddep_wait();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total4; i += (int64_t)gridDim.x * blockDim.x) {
        const float4 g = gs.splits ? sum4_at(gs, i) : gate[i], u = us.splits ? sum4_at(us, i) : up[i];
        const float o[4] = {glu_of(act, g.x, u.x), glu_of(act, g.y, u.y), glu_of(act, g.z, u.z), glu_of(act, g.w, u.w)};
        if (out) out[i] = make_float4(o[0], o[1], o[2], o[3]);
        if (xq.h) {
            uint32_t h[4];
#pragma unroll
            for (int k = 0; k < 4; k++) h[k] = __half_as_ushort(sat_half(o[k]));
            *(uint2 *)(xq.h + 4 * i) = make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16);
        } else {
#pragma unroll
            for (int k = 0; k < 4; k++) store_half(o[k], 4 * i + k, NULL, xq.h_wide);
        }
    }
}

extern "C" void cuk_glu(cuk_queue *qu, int act, const float *gate, const float *up, const struct cuk_sum_in *sums,
                        int n, int n_ff, float *out, const struct cuk_xq *xq) {
    const int64_t total = (int64_t)n * n_ff;
    const cuk_xq x = xq ? *xq : no_xq;
    const cuk_sum_in gs = sums ? sums[0] : cuk_sum_in{}, us = sums ? sums[1] : cuk_sum_in{};
    const bool v4 = !x.q && total % 4 == 0 &&
                    ((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out | (uintptr_t)gs.part | (uintptr_t)us.part |
                     (uintptr_t)(gs.zs * 4) | (uintptr_t)(us.zs * 4)) % 16 == 0;
    const int64_t items = v4 ? total / 4 : total;
    const dim3 grid((unsigned)(items / 256 + 1 < 4096 ? items / 256 + 1 : 4096));
    if (v4)
        pdl_launch(glu4_k, grid, dim3(256), qu, act, (const float4 *)gate, (const float4 *)up, gs, us, items,
                   (float4 *)out, x);
    else pdl_launch(glu_k, grid, dim3(256), qu, act, gate, up, gs, us, total, out, x);
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

/* Window rows of positions [lo, hi) from one ring to another of another size: rows
 * ring[plane][p % cap] of planes planes (a cache's KV heads, keys and values). */
__global__ void ring_move_k(uint4 *dst, int dst_cap, const uint4 *src, int src_cap, int row16, int lo) {
    const int p = lo + (int)blockIdx.x;
    const size_t plane = blockIdx.y;
    const uint4 *from = src + (plane * src_cap + p % src_cap) * row16;
    uint4 *to = dst + (plane * dst_cap + p % dst_cap) * row16;
    for (int i = threadIdx.x; i < row16; i += blockDim.x) to[i] = from[i];
}

extern "C" void cuk_ring_move(cuk_queue *qu, void *dst, int dst_cap, const void *src, int src_cap, int planes,
                              size_t row_bytes, int lo, int hi) {
    if (hi <= lo) return;
    queue_launch(ring_move_k, dim3((unsigned)(hi - lo), (unsigned)planes), dim3(32), qu, (uint4 *)dst, dst_cap,
                 (const uint4 *)src, src_cap, (int)(row_bytes / 16), lo);
    cuk_queue_launch_plain_next(qu); /* window rows are read before griddep_wait (launch.cuh) */
}

__global__ void idle_k() {}

extern "C" void cuk_idle_beside(cuk_queue *qu) {
    cuk_queue_launch_side_next(qu);
    queue_launch(idle_k, dim3(1), dim3(32), qu);
}

/* The host's staged bytes, read over the bus from its pinned memory (mapped), each
 * load fetched anew (ld.global.cv) rather than from a cache an earlier step filled.
 * Where a copy would go before the record, this runs at its head (cuda_backend.c). */
__global__ void stage_fetch_k(uint4 *dst, const uint4 *src, unsigned n16) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += gridDim.x * blockDim.x)
        dst[i] = __ldcv(src + i);
}

/* A block per 4 KB, at most one per multiprocessor of an H100: a one-token step stages
 * a few KB, more only after a cache's windows are copied in again. */
extern "C" void cuk_stage_fetch(cuk_queue *qu, void *dst, const void *src, size_t bytes) {
    const unsigned n16 = (unsigned)(bytes / 16), blocks = (n16 + 255) / 256;
    if (n16 == 0) return;
    queue_launch(stage_fetch_k, dim3(blocks < 132 ? blocks : 132), dim3(256), qu, (uint4 *)dst, (const uint4 *)src,
                 n16);
}
