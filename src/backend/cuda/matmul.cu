/* Products with weights in their GGUF types, read in place on the device.
 *
 * Decode (up to CUK_MATVEC_MAX tokens): one warp per output row, each lane decoding 8
 * consecutive weights at a time (consecutive lanes read consecutive bytes) and
 * multiplying them with every token's inputs, which stay in L1/L2; up to three
 * products of one type (Q/K/V, gate/up) share a launch. Q4_0/Q8_0 are repacked at
 * upload and multiplied with dp4a on int8 inputs. Wider batches dequantize a band of
 * rows to f32 for a GEMM (cuda_backend.c). Block layouts are ggml's (the GGUF types),
 * as in src/kernels/quant.c. */
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <string.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/round_x.cuh"
#include "core/dtype.h"

#define ROWS_PER_BLOCK 4

/* Calls CALL(T) with T the weight type as a compile-time constant. */
#define FOR_TYPE(type, CALL)                                                                                 \
    switch (type) {                                                                                          \
    case KVQ_F32: CALL(KVQ_F32); break;                                                                      \
    case KVQ_F16: CALL(KVQ_F16); break;                                                                      \
    case KVQ_BF16: CALL(KVQ_BF16); break;                                                                    \
    case KVQ_Q8_0: CALL(KVQ_Q8_0); break;                                                                    \
    case KVQ_Q4_0: CALL(KVQ_Q4_0); break;                                                                    \
    case KVQ_Q4_K: CALL(KVQ_Q4_K); break;                                                                    \
    case KVQ_Q6_K: CALL(KVQ_Q6_K); break;                                                                    \
    default: break; /* refused at upload */                                                                  \
    }

static __device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
static __device__ __forceinline__ uint16_t ld16(const uint8_t *p) { return *(const uint16_t *)p; }

/* 8 bytes at a 2-byte aligned address. */
static __device__ __forceinline__ uint64_t ld64_2(const uint8_t *p) {
    const uint16_t *h = (const uint16_t *)p;
    return (uint64_t)h[0] | (uint64_t)h[1] << 16 | (uint64_t)h[2] << 32 | (uint64_t)h[3] << 48;
}

/* Weights [8c, 8c + 8) of row r. */
template <uint32_t T>
static __device__ __forceinline__ void wload8(const cuk_weight &W, int64_t r, int64_t c, float w[8]) {
    const uint8_t *row = W.data + r * W.row_bytes;
    if (T == KVQ_Q8_0) { /* repacked: 32 codes per block, scales apart */
        const float d = h2f(W.scales[r * (W.cols / 32) + c / 4]);
        const uint2 q = *(const uint2 *)(row + c * 8);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = d * (float)(int8_t)(q.x >> (8 * i));
            w[4 + i] = d * (float)(int8_t)(q.y >> (8 * i));
        }
    } else if (T == KVQ_Q4_0) { /* repacked: 16 bytes per block; byte j: value j low, j + 16 high */
        const float d = h2f(W.scales[r * (W.cols / 32) + c / 4]);
        const int sub = (int)(c % 4);
        const uint2 q = *(const uint2 *)(row + (c / 4) * 16 + (sub % 2) * 8);
        const int sh = (sub / 2) * 4;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[i] = d * (float)((int)((q.x >> (8 * i + sh)) & 15) - 8);
            w[4 + i] = d * (float)((int)((q.y >> (8 * i + sh)) & 15) - 8);
        }
    } else if (T == KVQ_F32) {
        const float4 *p = (const float4 *)(row + c * 32);
        float4 a = p[0], b = p[1];
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else if (T == KVQ_F16) {
        uint4 u = *(const uint4 *)(row + c * 16);
        const __half2 *h = (const __half2 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            w[2 * i] = f.x, w[2 * i + 1] = f.y;
        }
    } else if (T == KVQ_BF16) {
        uint4 u = *(const uint4 *)(row + c * 16);
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __bfloat1622float2(h[i]);
            w[2 * i] = f.x, w[2 * i + 1] = f.y;
        }
    } else if (T == KVQ_Q4_K) { /* 144 bytes: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes */
        const uint8_t *b = row + (c / 32) * 144;
        const int e = (int)(c % 32) * 8, pair = e / 64, hi = (e % 64) / 32, l0 = e % 32, j = 2 * pair + hi;
        const uint8_t *sc = b + 4;
        int s, m;
        if (j < 4) {
            s = sc[j] & 63;
            m = sc[j + 4] & 63;
        } else {
            s = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
            m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        const float d = h2f(ld16(b)) * (float)s, mn = h2f(ld16(b + 2)) * (float)m;
        uint64_t q = ld64_2(b + 16 + pair * 32 + l0) >> (hi * 4);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * (float)((q >> (8 * i)) & 15) - mn;
    } else if (T == KVQ_Q6_K) { /* 210 bytes: ql[128], qh[64], int8 scales[16], f16 d */
        const uint8_t *b = row + (c / 32) * 210;
        const int e = (int)(c % 32) * 8, h = e / 128, quad = (e % 128) / 32, l0 = e % 32;
        const uint8_t *ql = b + h * 64 + (quad & 1) * 32 + l0, *qh = b + 128 + h * 32 + l0;
        const float d = h2f(ld16(b + 208)) * (float)(int8_t)b[192 + h * 8 + l0 / 16 + 2 * quad];
        uint64_t lo = ld64_2(ql) >> ((quad / 2) * 4), hb = ld64_2(qh) >> (2 * quad);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * (float)((int)(((lo >> (8 * i)) & 15) | (((hb >> (8 * i)) & 3) << 4)) - 32);
    }
}

/* Sums each token's partial dot products over the warp; lane 0 writes them. */
template <int NT>
static __device__ __forceinline__ void store_rows(const float (&acc)[NT], int lane, int n, float *y, int64_t rows,
                                                  int64_t row, const float *bias) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && t < n) y[(int64_t)t * rows + row] = v + (bias ? bias[row] : 0.0f);
    }
}

/* Launches KERNEL<..., NT> with NT the smallest of 1, 2, 4, 8, 16 that holds n tokens. */
#define BY_TOKENS(n, LAUNCH)  \
    if ((n) <= 1) LAUNCH(1);  \
    else if ((n) <= 2) LAUNCH(2); \
    else if ((n) <= 4) LAUNCH(4); \
    else if ((n) <= 8) LAUNCH(8); \
    else LAUNCH(16)

/* Up to CUK_MATVEC_JOBS products of one weight type in one launch: job j takes the
 * blocks from first[j] on (one launch fills the chip better than three small ones). */
struct mv_set {
    cuk_weight w[CUK_MATVEC_JOBS];
    float *y[CUK_MATVEC_JOBS];
    const float *bias[CUK_MATVEC_JOBS];
    unsigned first[CUK_MATVEC_JOBS];
};

/* The job of this block, and the row of this warp (-1: past the job's rows). */
static __device__ __forceinline__ int64_t mv_row(const mv_set &S, int &j) {
    j = 0;
#pragma unroll
    for (int i = 1; i < CUK_MATVEC_JOBS; i++)
        if (blockIdx.x >= S.first[i]) j = i;
    const int64_t row = (int64_t)(blockIdx.x - S.first[j]) * ROWS_PER_BLOCK + threadIdx.x / 32;
    return row < S.w[j].rows ? row : -1;
}

template <uint32_t T, int NT>
__global__ void __launch_bounds__(ROWS_PER_BLOCK * 32)
    matvec(const mv_set S, const float *x, int64_t x_stride, int n) {
    griddep_release();
    griddep_wait();
    int j;
    const int64_t row = mv_row(S, j);
    if (row < 0) return;
    const cuk_weight &W = S.w[j];
    const int lane = threadIdx.x % 32;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0;
    const int64_t chunks = W.cols / 8;
#pragma unroll 2
    for (int64_t c = lane; c < chunks; c += 32) {
        float w[8];
        wload8<T>(W, row, c, w);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= n) break;
            const float4 *xp = (const float4 *)(x + t * x_stride + c * 8);
            const float4 a = __ldg(xp), b = __ldg(xp + 1);
            acc[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z +
                      w[7] * b.w;
        }
    }
    store_rows<NT>(acc, lane, n, S.y[j], W.rows, row, S.bias[j]);
}

/* ---- repacked Q4_0 / Q8_0 on int8 inputs ----
 * A warp per row; lane l takes blocks l, l + 32, ...: 16 or 32 bytes of codes (one
 * or two 16-byte loads), the block's f16 scale, and per token the 32 int8 inputs
 * (two 16-byte loads) for dp4a: 8 instructions per block and token. */

extern "C" int cuk_repacked(uint32_t type) { return type == KVQ_Q4_0 || type == KVQ_Q8_0; }
extern "C" size_t cuk_repacked_row_bytes(uint32_t type, int64_t cols) {
    return (size_t)(cols / 32) * (type == KVQ_Q4_0 ? 16 : 32);
}
extern "C" void cuk_repack(uint32_t type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *codes,
                           uint16_t *scales) {
    const int64_t nb = cols / 32;
    const size_t bb = type == KVQ_Q4_0 ? 18 : 34, cb = bb - 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + ((size_t)r * nb + b) * bb;
            memcpy(scales + r * nb + b, blk, 2);
            memcpy(codes + ((size_t)r * nb + b) * cb, blk + 2, cb);
        }
}

__global__ void quantize_x(const float *x, int64_t x_stride, int64_t k, int8_t *q, float2 *dsum) {
    griddep_release();
    griddep_wait();
    const int64_t nb = k / 32, blk = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int t = blockIdx.y;
    if (blk >= nb) return;
    round_x32(x[t * x_stride + blk * 32 + threadIdx.x % 32], q + t * k + blk * 32, dsum + t * nb + blk);
}

extern "C" void cuk_quantize_x(cudaStream_t s, const float *x, int64_t x_stride, int n, int64_t k, const cuk_xq *xq) {
    const int64_t nb = k / 32;
    dim3 grid((unsigned)((nb * 32 + 255) / 256), (unsigned)n);
    pdl_launch(quantize_x, grid, dim3(256), s, x, x_stride, k, xq->q, xq->dsum);
}

/* A lane's block of 32 codes: Q4_0 in a, Q8_0 in a and b. */
struct qblock {
    uint4 a, b;
};

template <uint32_t T>
static __device__ __forceinline__ qblock load_qblock(const uint8_t *codes, int64_t b) {
    qblock q;
    if (T == KVQ_Q4_0) {
        q.a = *(const uint4 *)(codes + b * 16);
    } else {
        q.a = *(const uint4 *)(codes + b * 32);
        q.b = *(const uint4 *)(codes + b * 32 + 16);
    }
    return q;
}

/* acc[t] += block b of the row (scale d) . block b of token t's int8 inputs. */
template <uint32_t T, int NT>
static __device__ __forceinline__ void dot_qblock(const qblock &q, float d, int64_t b, const int8_t *xq,
                                                  const float2 *xd, int64_t cols, int n, float (&acc)[NT]) {
    int wq[8];
    if (T == KVQ_Q4_0) {
        const uint32_t w4[4] = {q.a.x, q.a.y, q.a.z, q.a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            wq[i] = (int)(w4[i] & 0x0F0F0F0Fu);            /* values 4i .. 4i+3 */
            wq[4 + i] = (int)((w4[i] >> 4) & 0x0F0F0F0Fu); /* values 16+4i .. */
        }
    } else {
        wq[0] = (int)q.a.x, wq[1] = (int)q.a.y, wq[2] = (int)q.a.z, wq[3] = (int)q.a.w;
        wq[4] = (int)q.b.x, wq[5] = (int)q.b.y, wq[6] = (int)q.b.z, wq[7] = (int)q.b.w;
    }
    const int64_t nb = cols / 32;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t >= n) break;
        const int4 *xp = (const int4 *)(xq + (int64_t)t * cols + b * 32);
        const int4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
        int isum = 0;
        isum = __dp4a(wq[0], x0.x, isum);
        isum = __dp4a(wq[1], x0.y, isum);
        isum = __dp4a(wq[2], x0.z, isum);
        isum = __dp4a(wq[3], x0.w, isum);
        isum = __dp4a(wq[4], x1.x, isum);
        isum = __dp4a(wq[5], x1.y, isum);
        isum = __dp4a(wq[6], x1.z, isum);
        isum = __dp4a(wq[7], x1.w, isum);
        const float2 ds = xd[(int64_t)t * nb + b];
        acc[t] += d * ds.x * (T == KVQ_Q4_0 ? (float)isum - 8.0f * ds.y : (float)isum);
    }
}

/* Blocks of weights each lane loads before waiting for the previous kernel. */
#define PREFETCH 4

template <uint32_t T, int NT>
__global__ void __launch_bounds__(ROWS_PER_BLOCK * 32)
    matvec_q(const mv_set S, const int8_t *xq, const float2 *xd, int n) {
    griddep_release();
    int j;
    const int64_t row = mv_row(S, j);
    if (row < 0) return;
    const cuk_weight &W = S.w[j];
    const int lane = threadIdx.x % 32;
    const int64_t nb = W.cols / 32;
    const uint8_t *codes = W.data + row * W.row_bytes;
    const uint16_t *sc = W.scales + row * nb;
    /* the weights depend on no earlier kernel: their first loads overlap its end */
    qblock pre[PREFETCH];
    float pre_d[PREFETCH];
#pragma unroll
    for (int i = 0; i < PREFETCH; i++) {
        const int64_t b = lane + 32 * i;
        if (b < nb) {
            pre[i] = load_qblock<T>(codes, b);
            pre_d[i] = h2f(sc[b]);
        }
    }
    griddep_wait();
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0;
#pragma unroll
    for (int i = 0; i < PREFETCH; i++)
        if (lane + 32 * i < nb) dot_qblock<T, NT>(pre[i], pre_d[i], lane + 32 * i, xq, xd, W.cols, n, acc);
#pragma unroll 4
    for (int64_t b = lane + 32 * PREFETCH; b < nb; b += 32)
        dot_qblock<T, NT>(load_qblock<T>(codes, b), h2f(sc[b]), b, xq, xd, W.cols, n, acc);
    store_rows<NT>(acc, lane, n, S.y[j], W.rows, row, S.bias[j]);
}

extern "C" int cuk_type_supported(uint32_t type) {
    return type == KVQ_F32 || type == KVQ_F16 || type == KVQ_BF16 || type == KVQ_Q8_0 || type == KVQ_Q4_0 ||
           type == KVQ_Q4_K || type == KVQ_Q6_K;
}

extern "C" void cuk_matvec(cudaStream_t s, const struct cuk_matvec_job *jobs, int n_jobs, const float *x,
                           int64_t x_stride, const struct cuk_xq *xq, int n) {
    const dim3 th(ROWS_PER_BLOCK * 32);
    for (int j0 = 0; j0 < n_jobs;) {
        /* one launch for this job and the next ones of its type */
        const uint32_t T = jobs[j0].w->type;
        mv_set S;
        unsigned blocks = 0;
        int nj = 0;
        for (; nj < CUK_MATVEC_JOBS && j0 + nj < n_jobs && jobs[j0 + nj].w->type == T; nj++) {
            S.w[nj] = *jobs[j0 + nj].w;
            S.y[nj] = jobs[j0 + nj].y;
            S.bias[nj] = jobs[j0 + nj].bias;
            S.first[nj] = blocks;
            blocks += (unsigned)((S.w[nj].rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK);
        }
        for (int i = nj; i < CUK_MATVEC_JOBS; i++) S.first[i] = ~0u;
        j0 += nj;
        if (T == KVQ_Q4_0 || T == KVQ_Q8_0) {
#define MQ4(NT) pdl_launch(matvec_q<KVQ_Q4_0, NT>, dim3(blocks), th, s, S, xq->q, xq->dsum, n)
#define MQ8(NT) pdl_launch(matvec_q<KVQ_Q8_0, NT>, dim3(blocks), th, s, S, xq->q, xq->dsum, n)
            if (T == KVQ_Q4_0) BY_TOKENS(n, MQ4);
            else BY_TOKENS(n, MQ8);
#undef MQ4
#undef MQ8
            continue;
        }
#define MV_NT(NT) pdl_launch(matvec<TT, NT>, dim3(blocks), th, s, S, x, x_stride, n)
#define MV(T_)                      \
    {                               \
        constexpr uint32_t TT = T_; \
        BY_TOKENS(n, MV_NT);        \
    }
        FOR_TYPE(T, MV)
#undef MV
#undef MV_NT
    }
}

/* ---- whole rows as f32 (GEMM inputs, embeddings) ---- */

template <uint32_t T>
__global__ void dequantize(const cuk_weight W, int64_t r0, int64_t n_rows, float *out) {
    const int64_t cols = W.cols, chunks = cols / 8, total = n_rows * chunks;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / chunks, c = i % chunks;
        float w[8];
        wload8<T>(W, r0 + r, c, w);
        float4 *o = (float4 *)(out + r * cols + c * 8);
        o[0] = make_float4(w[0], w[1], w[2], w[3]);
        o[1] = make_float4(w[4], w[5], w[6], w[7]);
    }
}

extern "C" void cuk_dequantize(cudaStream_t s, const cuk_weight *w, int64_t r0, int64_t r1, float *out) {
    const int64_t total = (r1 - r0) * (w->cols / 8);
    const unsigned blocks = (unsigned)(total / 256 + 1 < 65536 ? total / 256 + 1 : 65536);
#define DQ(T) dequantize<T><<<blocks, 256, 0, s>>>(*w, r0, r1 - r0, out)
    FOR_TYPE(w->type, DQ)
#undef DQ
}

template <uint32_t T>
__global__ void embed_rows(const cuk_weight E, const int32_t *tokens, float scale, float *x) {
    const int t = blockIdx.x;
    const int64_t cols = E.cols;
    for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
        float w[8];
        wload8<T>(E, tokens[t], c, w);
#pragma unroll
        for (int i = 0; i < 8; i++) x[(int64_t)t * cols + c * 8 + i] = w[i] * scale;
    }
}

extern "C" void cuk_embed(cudaStream_t s, const cuk_weight *e, const int32_t *tokens, int n, float scale, float *x) {
#define EM(T) embed_rows<T><<<(unsigned)n, 128, 0, s>>>(*e, tokens, scale, x)
    FOR_TYPE(e->type, EM)
#undef EM
}

__global__ void add_bias(float *y, const float *bias, int64_t rows, int64_t total) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += bias[i % rows];
}

extern "C" void cuk_add_bias(cudaStream_t s, float *y, const float *bias, int n, int64_t rows) {
    const int64_t total = (int64_t)n * rows;
    add_bias<<<(unsigned)(total / 256 + 1 < 4096 ? total / 256 + 1 : 4096), 256, 0, s>>>(y, bias, rows, total);
}
