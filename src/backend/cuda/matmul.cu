/* Products with weights in their GGUF types, read in place on the device.
 *
 * Decode (up to CUK_MATVEC_MAX tokens): Q4_0, Q8_0, Q4_K and Q6_K are repacked at
 * upload into tiles for tensor-core (1-2 tokens: dp4a, streamed where a product has
 * more tiles than fit the GPU at once) products on int8 inputs (below); the other
 * types go one warp per output row, each lane decoding 8
 * consecutive weights at a time (consecutive lanes read consecutive bytes) and
 * multiplying them with every token's inputs, which stay in L1/L2. Up to three
 * products of one type (Q/K/V, gate/up) share a launch. Wider batches of repacked
 * types go to matmul_wide.cu; other wide products dequantize a band of rows for a
 * GEMM (cuda_backend.c). Block layouts are ggml's (the GGUF
 * types), as in src/kernels/quant.c. */
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdlib.h>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
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

#include "backend/cuda/q_chunk.cuh"

/* Q4_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
 * (kern_q4k_scale_min's, on the device). */
static __device__ __forceinline__ void q4k_scale_min(int j, const uint8_t *sc, int &s, int &m) {
    if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        s = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* Weights [8c, 8c + 8) of row r. */
template <uint32_t T>
static __device__ __forceinline__ void wload8(const cuk_weight &W, int64_t r, int64_t c, float w[8]) {
    const uint8_t *row = W.data + r * W.row_bytes;
    if (T == KVQ_Q8_0 || T == KVQ_Q4_0 || T == KVQ_Q4_K || T == KVQ_Q6_K) { /* repacked (cuda_kernels.h): lane t of the tile holds these 8 */
        constexpr int64_t BPC = CUK_CHUNK_BLOCKS(T), SE = CUK_SCALE_ENTRIES(T);
        const int64_t b = c / 4, nch = (W.cols / 32 + BPC - 1) / BPC, rr = r % 16, unit = (r / 16) * nch + b / BPC;
        const uint8_t *p = W.data + unit * 1024 + (rr / 8) * 512 + ((rr % 8) * 4 + c % 4) * 16 + (b % BPC) * (nibbles(T) ? 4 : 8);
        const uint16_t *se = W.scales + (unit * 16 + rr) * SE;
        if (T == KVQ_Q6_K) { /* as the CPU's dequantization: (d scale) code; values 8t.. are in half t / 2 */
            const float ds = __fmul_rn(h2f(se[BPC]), (float)(int8_t)(se[b % BPC] >> (c % 4 / 2 * 8)));
            const uint2 q = *(const uint2 *)p;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                w[i] = __fmul_rn(ds, (float)(int8_t)(q.x >> (8 * i)));
                w[4 + i] = __fmul_rn(ds, (float)(int8_t)(q.y >> (8 * i)));
            }
        } else if (T == KVQ_Q4_K) { /* as the CPU's dequantization: (d s) code - dmin m */
            const float2 sb = block_scale<T>(se[b % BPC], (uint32_t)se[BPC] | (uint32_t)se[BPC + 1] << 16);
            const uint32_t q = *(const uint32_t *)p;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                w[i] = __fsub_rn(__fmul_rn(sb.x, (float)((q >> (8 * i)) & 15)), sb.y);
                w[4 + i] = __fsub_rn(__fmul_rn(sb.x, (float)((q >> (8 * i + 4)) & 15)), sb.y);
            }
        } else if (T == KVQ_Q8_0) {
            const float d = h2f(se[b % BPC]);
            const uint2 q = *(const uint2 *)p;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                w[i] = d * (float)(int8_t)(q.x >> (8 * i));
                w[4 + i] = d * (float)(int8_t)(q.y >> (8 * i));
            }
        } else {
            const float d = h2f(se[b % BPC]);
            const uint32_t q = *(const uint32_t *)p;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                w[i] = d * (float)((int)((q >> (8 * i)) & 15) - 8);
                w[4 + i] = d * (float)((int)((q >> (8 * i + 4)) & 15) - 8);
            }
        }
    } else if (T == KVQ_F32) {
        const uint4 a = ldw16(row + c * 32, weight_policy()), b = ldw16(row + c * 32 + 16, weight_policy());
        const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = __uint_as_float(u[i]);
    } else if (T == KVQ_F16) {
        uint4 u = ldw16(row + c * 16, weight_policy());
        const __half2 *h = (const __half2 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            w[2 * i] = f.x, w[2 * i + 1] = f.y;
        }
    } else if (T == KVQ_BF16) {
        uint4 u = ldw16(row + c * 16, weight_policy());
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __bfloat1622float2(h[i]);
            w[2 * i] = f.x, w[2 * i + 1] = f.y;
        }
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

/* ---- repacked Q4_0, Q8_0, Q4_K, Q6_K on int8 inputs ----
 * A tile's columns go in slices of U chunks (U from the shapes alone, below), a
 * warp each; each warp loads its U chunks before it waits for the previous kernel,
 * so all weights are in flight at once. Where a tile's slices fit one block (whole
 * layout), that block's warps are those slices: it stages the tokens' int8 inputs
 * in shared memory and adds the slices' sums up there. Otherwise (split) a block's
 * 4 warps take 4 tiles over one slice, stage the inputs of that slice, and the last
 * block of a tile group's slices to finish adds their sums up (scratch and a
 * counter). Whole warps have fewer inputs to wait for and no fence or counter: with
 * the loops below free of bounds checks where a run is whole (FULL), batch-1 decode
 * went 377 -> 403 tok/s on the H200 (llama3-8b Q4_0), and each alone did nothing.
 * The products, two ways to the same bits:
 * - mma (3 tokens and more): one mma.m16n8k32 of a block's codes with 8 tokens'
 *   inputs gives the 16 x 8 integer dot products.
 * - dp4a (1 or 2 tokens, where an mma would be mostly wasted work): each lane dots
 *   its 8 values of a block with dp4a and the 4 lanes of a row group trade partial
 *   sums so that each ends with whole blocks' sums of a quarter of the (row, block)
 *   pairs: a quarter of the float work. (One wave of warps, each streaming a tile 4
 *   or 8 chunks ahead in registers, measured 2x slower: too few bytes in flight;
 *   matvec_stream streams through shared memory instead.)
 * Both add the same float terms in the same order, so a token's result does not
 * depend on how many tokens share the launch: the terms of block position j of a
 * slice's chunks (q_term) add up in chunk order, those BPC sums in j order, and the
 * slices' sums in slice order. */
/* Warps a product aims at (chunks_per_warp). 1536 gives the 7-8B shapes 8 chunks a
 * warp: 16-token products then take fewer slices and add fewer partial sums, and
 * batch 16 decodes 10-22% faster than with 6144 (2 chunks for Q/K/V and O) at equal
 * batch-1 speed (H100, llama3-8b Q4_0, depth 512; KVQ_MV_WARPS alternating). */
#define MV_WARPS 1536
#define MV_TILES 4 /* tiles (warps) of a block */
#define MV_DP4A_MAX 2 /* tokens the dp4a kernel takes */

extern "C" int cuk_repacked(uint32_t type) {
    return type == KVQ_Q4_0 || type == KVQ_Q8_0 || type == KVQ_Q4_K || type == KVQ_Q6_K;
}

extern "C" size_t cuk_repacked_code_bytes(uint32_t type, int64_t rows, int64_t cols) {
    return (size_t)((rows + 15) / 16) * (size_t)chunks_of(type, cols) * 1024;
}

extern "C" size_t cuk_repacked_bytes(uint32_t type, int64_t rows, int64_t cols) {
    const size_t codes = cuk_repacked_code_bytes(type, rows, cols);
    return codes + codes / 1024 * 16 * (size_t)CUK_SCALE_ENTRIES(type) * sizeof(uint16_t);
}

/* One thread per (tile, chunk, row of the tile, block j of the chunk): that block's
 * codes into the 4 lanes' bytes that hold them, and its scale; rows and blocks past
 * the matrix become zeros (the padding). */
template <uint32_t T>
__global__ void repack_k(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *codes, uint16_t *scales) {
    constexpr int BPC = CUK_CHUNK_BLOCKS(T), SE = CUK_SCALE_ENTRIES(T);
    const int64_t nb = cols / 32, nch = chunks_of(T, cols), i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (rows + 15) / 16 * nch * 16 * BPC) return;
    const int j = (int)(i % BPC), rr = (int)(i / BPC % 16);
    const int64_t unit = i / (BPC * 16), r = unit / nch * 16 + rr, b = unit % nch * BPC + j;
    const bool in = r < rows && b < nb;
    uint16_t *se = scales + (unit * 16 + rr) * SE;
    /* the block's 32 codes: code(e) */
    const uint8_t *blk, *qs;
    int shift = 0;
    if (T == KVQ_Q4_K) { /* 144-byte super-blocks of 8 blocks: d, dmin, 12 bytes of 6-bit scales and
                          * mins, then 4 x 32 bytes whose low nibbles are block 2i, high ones 2i + 1 */
        blk = src + (in ? r * (nb / 8) + b / 8 : 0) * 144;
        qs = blk + 16 + (b % 8 / 2) * 32;
        shift = (int)(b % 2) * 4;
        int sc = 0, m = 0;
        if (in) q4k_scale_min((int)(b % 8), blk + 4, sc, m);
        se[j] = (uint16_t)(sc | m << 8);
        if (j == 0) se[BPC] = in ? (uint16_t)(blk[0] | blk[1] << 8) : 0, se[BPC + 1] = in ? (uint16_t)(blk[2] | blk[3] << 8) : 0;
    } else if (T == KVQ_Q6_K) { /* 210-byte super-blocks: ql[128], qh[64], int8 scales[16], f16 d;
                                 * block h * 4 + quad: low bits in ql[64h + 32 (quad & 1) + l], the low
                                 * nibble for quad < 2, high bits 2 quad.. of qh[32h + l], scales 8h +
                                 * 2 quad + l / 16 */
        blk = src + (in ? r * (nb / 8) + b / 8 : 0) * 210;
        const int h = (int)(b % 8 / 4), quad = (int)(b % 4);
        qs = blk + 64 * h + 32 * (quad & 1);
        const uint8_t *sc = blk + 192 + 8 * h + 2 * quad;
        se[j] = in ? (uint16_t)(sc[0] | sc[1] << 8) : 0;
        if (j == 0) se[BPC] = in ? (uint16_t)(blk[208] | blk[209] << 8) : 0, se[BPC + 1] = 0;
    } else {
        blk = src + (in ? r * nb + b : 0) * (T == KVQ_Q4_0 ? 18 : 34);
        qs = blk + 2;
        se[j] = in ? (uint16_t)(blk[0] | blk[1] << 8) : 0;
    }
    /* Q6_K's code e: 6 bits less 32, as int8 */
    auto q6 = [&](int e) {
        const int quad = (int)(b % 4), lo = qs[e] >> (quad >= 2 ? 4 : 0) & 15, hi = blk[128 + 32 * (b % 8 / 4) + e] >> (2 * quad) & 3;
        return (uint32_t)(uint8_t)(int8_t)((lo | hi << 4) - 32);
    };
    for (int t = 0; t < 4; t++) {
        uint8_t *dst = codes + unit * 1024 + (rr / 8) * 512 + ((rr % 8) * 4 + t) * 16;
        if (nibbles(T)) { /* byte k: code(8t + k) | code(8t + 4 + k) << 4; Q4_0's code(e) is the low
                              * nibble of byte e for e < 16, else the high one of byte e - 16 */
            uint32_t v = 0;
            for (int k = 0; k < 4 && in; k++) {
                const int e0 = 8 * t + k, e1 = e0 + 4;
                int c0, c1;
                if (T == KVQ_Q4_K) {
                    c0 = qs[e0] >> shift & 15, c1 = qs[e1] >> shift & 15;
                } else {
                    c0 = e0 < 16 ? qs[e0] & 15 : qs[e0 - 16] >> 4;
                    c1 = e1 < 16 ? qs[e1] & 15 : qs[e1 - 16] >> 4;
                }
                v |= (uint32_t)(c0 | c1 << 4) << (8 * k);
            }
            *(uint32_t *)(dst + j * 4) = v;
        } else {
            uint2 v = make_uint2(0, 0);
            for (int k = 0; k < 4 && in; k++) {
                v.x |= (T == KVQ_Q6_K ? q6(8 * t + k) : qs[8 * t + k]) << (8 * k);
                v.y |= (T == KVQ_Q6_K ? q6(8 * t + 4 + k) : qs[8 * t + 4 + k]) << (8 * k);
            }
            *(uint2 *)(dst + j * 8) = v;
        }
    }
}

extern "C" void cuk_repack(cuk_queue *qu, uint32_t type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *codes,
                           uint16_t *scales) {
    const int64_t n = (rows + 15) / 16 * chunks_of(type, cols) * 16 * CUK_CHUNK_BLOCKS(type);
    const dim3 grid((unsigned)((n + 255) / 256)), block(256);
    if (type == KVQ_Q4_0) queue_launch(repack_k<KVQ_Q4_0>, grid, block, qu, src, rows, cols, codes, scales);
    else if (type == KVQ_Q4_K) queue_launch(repack_k<KVQ_Q4_K>, grid, block, qu, src, rows, cols, codes, scales);
    else if (type == KVQ_Q6_K) queue_launch(repack_k<KVQ_Q6_K>, grid, block, qu, src, rows, cols, codes, scales);
    else queue_launch(repack_k<KVQ_Q8_0>, grid, block, qu, src, rows, cols, codes, scales);
}

__global__ void quantize_x(const float *x, int64_t x_stride, int64_t k, int8_t *q, float2 *dsum) {
    griddep_release();
    griddep_wait();
    const int64_t nb = k / 32, blk = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int t = blockIdx.y;
    if (blk >= nb) return;
    round_x32(x[t * x_stride + blk * 32 + threadIdx.x % 32], q + t * k + blk * 32, dsum + t * nb + blk);
}

extern "C" void cuk_quantize_x(cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, const cuk_xq *xq) {
    const int64_t nb = k / 32;
    dim3 grid((unsigned)((nb * 32 + 255) / 256), (unsigned)n);
    pdl_launch(quantize_x, grid, dim3(256), qu, x, x_stride, k, xq->q, xq->dsum);
}


/* mma: the sums of the warp's chunks f for the NT tokens from 0 on, from the inputs
 * staged in shared memory (xs: n rows of span codes, xs_stride apart, from the
 * warp's first block on; ds: n rows of span / 32 scales and code sums, likewise);
 * vb: the valid blocks of the warp's run (FULL: all U BPC); acc[4 nt + i]: c_i of
 * token tile nt. */
template <uint32_t T, int NT, int U, bool FULL>
static __device__ __forceinline__ void tile_sums_mma(const chunk_frag<T> (&f)[U], int vb, const int8_t *xs,
                                                     const float2 *ds, int span, int n, int lane,
                                                     float (&acc)[NT / 8 * 4]) {
    constexpr int BPC = CUK_CHUNK_BLOCKS(T);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BPC; j++) {
        float c[NT / 8][4];
#pragma unroll
        for (int nt = 0; nt < NT / 8; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0;
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int lb = u * BPC + j; /* the block within the warp's run */
            if (!FULL && lb >= vb) break;
            const uint32_t w[4] = {f[u].lo.x, f[u].lo.y, f[u].lo.z, f[u].lo.w}, h[4] = {f[u].hi.x, f[u].hi.y, f[u].hi.z, f[u].hi.w};
            uint32_t a0, a1, a2, a3;
            if (nibbles(T)) {
                a0 = w[j] & 0x0F0F0F0Fu, a2 = (w[j] >> 4) & 0x0F0F0F0Fu;
                a1 = h[j] & 0x0F0F0F0Fu, a3 = (h[j] >> 4) & 0x0F0F0F0Fu;
            } else {
                a0 = w[2 * j], a2 = w[2 * j + 1], a1 = h[2 * j], a3 = h[2 * j + 1];
            }
            const float2 d0 = block_scale<T>(f[u].s0[j], f[u].dm0), d1 = block_scale<T>(f[u].s1[j], f[u].dm1);
#pragma unroll
            for (int nt = 0; nt < NT / 8; nt++) {
                /* tokens past n read token n - 1's inputs: only their own sums, which
                 * are not stored, take them (no branch a product) */
                const int tb = min(nt * 8 + g, n - 1), t0 = min(nt * 8 + 2 * t, n - 1), t1 = min(nt * 8 + 2 * t + 1, n - 1);
                const uint2 xb = *(const uint2 *)(xs + tb * xs_stride(span) + lb * 32 + 8 * t);
                const float2 x0 = ds[t0 * ds_stride(span) + lb], x1 = ds[t1 * ds_stride(span) + lb];
                if (T == KVQ_Q6_K) { /* each half's sum (lanes t < 2, t >= 2) times its scale */
                    const bool h0 = t < 2;
                    int r[4] = {0, 0, 0, 0}, r1[4] = {0, 0, 0, 0};
                    mma_s8_16832(r, h0 ? a0 : 0u, h0 ? a1 : 0u, h0 ? a2 : 0u, h0 ? a3 : 0u, xb.x, xb.y);
                    mma_s8_16832(r1, h0 ? 0u : a0, h0 ? 0u : a1, h0 ? 0u : a2, h0 ? 0u : a3, xb.x, xb.y);
                    const int g0 = (int8_t)f[u].s0[j], g1 = (int8_t)(f[u].s0[j] >> 8);
                    const int e0 = (int8_t)f[u].s1[j], e1 = (int8_t)(f[u].s1[j] >> 8);
                    r[0] = g0 * r[0] + g1 * r1[0], r[1] = g0 * r[1] + g1 * r1[1];
                    r[2] = e0 * r[2] + e1 * r1[2], r[3] = e0 * r[3] + e1 * r1[3];
                    c[nt][0] = q_term<T>(c[nt][0], d0, x0.x, r[0], x0.y);
                    c[nt][1] = q_term<T>(c[nt][1], d0, x1.x, r[1], x1.y);
                    c[nt][2] = q_term<T>(c[nt][2], d1, x0.x, r[2], x0.y);
                    c[nt][3] = q_term<T>(c[nt][3], d1, x1.x, r[3], x1.y);
                } else { /* the sums start at the bias q_term_biased takes */
                    int r[4] = {Q_TERM_BIAS, Q_TERM_BIAS, Q_TERM_BIAS, Q_TERM_BIAS};
                    mma_s8_16832(r, a0, a1, a2, a3, xb.x, xb.y);
                    c[nt][0] = q_term_biased<T>(c[nt][0], d0, x0.x, r[0], x0.y);
                    c[nt][1] = q_term_biased<T>(c[nt][1], d0, x1.x, r[1], x1.y);
                    c[nt][2] = q_term_biased<T>(c[nt][2], d1, x0.x, r[2], x0.y);
                    c[nt][3] = q_term_biased<T>(c[nt][3], d1, x1.x, r[3], x1.y);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT / 8; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[nt * 4 + i] = j == 0 ? c[nt][i] : acc[nt * 4 + i] + c[nt][i];
    }
}

/* dp4a: adds chunk u of the warp's run to lane t's chains c[tok][i] (blocks
 * (t & 1) KL + i of row g + 8 (t >> 1), KL = BPC / 2), the inputs as for mma. */
template <uint32_t T, int NT, bool FULL>
static __device__ __forceinline__ void dp4a_chunk(const chunk_frag<T> &f, int u, int vb, const int8_t *xs,
                                                  const float2 *ds, int span, int n, int t,
                                                  float (&c)[NT][CUK_CHUNK_BLOCKS(T) / 2]) {
    constexpr int BPC = CUK_CHUNK_BLOCKS(T), K = 2 * BPC, KL = K / 4;
    const uint32_t w[8] = {f.lo.x, f.lo.y, f.lo.z, f.lo.w, f.hi.x, f.hi.y, f.hi.z, f.hi.w};
    const int bc = u * BPC; /* the chunk's first block within the run */
#pragma unroll
    for (int tok = 0; tok < NT; tok++) {
        if (tok >= n) break;
        int p[K]; /* this lane's part of (row k / BPC, block k % BPC) */
#pragma unroll
        for (int j = 0; j < BPC; j++) {
            uint2 xv = make_uint2(0, 0);
            if (FULL || bc + j < vb) xv = *(const uint2 *)(xs + tok * xs_stride(span) + (bc + j) * 32 + 8 * t);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const uint32_t *q = w + 4 * h;
                if (nibbles(T))
                    p[h * BPC + j] = __dp4a((int)(q[j] & 0x0F0F0F0Fu), (int)xv.x, __dp4a((int)((q[j] >> 4) & 0x0F0F0F0Fu), (int)xv.y, 0));
                else
                    p[h * BPC + j] = __dp4a((int)q[2 * j], (int)xv.x, __dp4a((int)q[2 * j + 1], (int)xv.y, 0));
                if (T == KVQ_Q6_K) /* times the scale of this lane's half of the block */
                    p[h * BPC + j] *= (int)(int8_t)((h ? f.s1[j] : f.s0[j]) >> (t >> 1) * 8);
            }
        }
        /* halve twice: lanes t ^ 2, then t ^ 1, trade the halves they do not keep */
#pragma unroll
        for (int o = 2, half = K / 2; o >= 1; o /= 2, half /= 2) {
            const bool up = t & o;
#pragma unroll
            for (int k = 0; k < half; k++) {
                const int mine = up ? p[half + k] : p[k], other = up ? p[k] : p[half + k];
                p[k] = mine + __shfl_xor_sync(0xffffffffu, other, o);
            }
        }
#pragma unroll
        for (int i = 0; i < KL; i++) {
            const int b = bc + (t & 1) * KL + i;
            if (FULL || b < vb) {
                const float2 x = ds[tok * ds_stride(span) + b];
                const uint32_t dm = T == KVQ_Q6_K && t >> 1 ? f.dm1 : f.dm0; /* Q6_K: both rows' */
                c[tok][i] = q_term<T>(c[tok][i], block_scale<T>(f.s0[i], dm), x.x, p[i], x.y);
            }
        }
    }
}

/* A slice's sum of a row (even lanes): its chains in block order, this lane's
 * then its odd neighbour's. */
template <int KL>
static __device__ __forceinline__ float chains_sum(const float (&c)[KL]) {
    float o[KL];
#pragma unroll
    for (int i = 0; i < KL; i++) o[i] = __shfl_xor_sync(0xffffffffu, c[i], 1);
    float s = c[0];
#pragma unroll
    for (int i = 1; i < KL; i++) s += c[i];
#pragma unroll
    for (int i = 0; i < KL; i++) s += o[i];
    return s;
}

/* dp4a: the sums of the warp's chunks as tile_sums_mma gives them, for NT <=
 * MV_DP4A_MAX tokens; acc[tok] of row g + 8 (t >> 1), in the even lanes t. */
template <uint32_t T, int NT, int U, bool FULL>
static __device__ __forceinline__ void tile_sums_dp4a(const chunk_frag<T> (&f)[U], int vb, const int8_t *xs,
                                                      const float2 *ds, int span, int n, int lane,
                                                      float (&acc)[NT]) {
    constexpr int BPC = CUK_CHUNK_BLOCKS(T), KL = BPC / 2;
    float c[NT][KL];
#pragma unroll
    for (int tok = 0; tok < NT; tok++)
#pragma unroll
        for (int i = 0; i < KL; i++) c[tok][i] = 0;
#pragma unroll
    for (int u = 0; u < U; u++)
        if (FULL || u * BPC < vb) dp4a_chunk<T, NT, FULL>(f[u], u, vb, xs, ds, span, n, lane % 4, c);
#pragma unroll
    for (int tok = 0; tok < NT; tok++) acc[tok] = chains_sum<KL>(c[tok]);
}

/* acc[v] = the sum of the slices' values v in slice order, slice i's VALS values of
 * this thread at part + (i * stride + me) * VALS (L2: scratch in device memory). A
 * slice's loads go out together, not one load and add at a time (16 slices of 8
 * values were a chain of 128 L2 round trips in a group's last block): batch 8 and
 * 16 decode 2-3% faster (H200, llama3-8b Q4_0). */
template <int VALS, bool L2>
static __device__ __forceinline__ void sum_slices(const float *part, unsigned slices, int stride, int me,
                                                  float (&acc)[VALS]) {
#pragma unroll
    for (int v = 0; v < VALS; v++) acc[v] = 0;
#pragma unroll 2
    for (unsigned i = 0; i < slices; i++) {
        const float *q = part + ((size_t)i * stride + me) * VALS;
        float p[VALS];
#pragma unroll
        for (int v = 0; v < VALS; v++) p[v] = L2 ? __ldcg(q + v) : q[v];
#pragma unroll
        for (int v = 0; v < VALS; v++) acc[v] += p[v];
    }
}

/* The jobs of one launch (q_plan): job j's blocks start at first[j]. Two layouts of
 * the same sums:
 * - split: `slices` blocks a group of MV_TILES tiles (U chunks a block); job j's
 *   scratch starts at scratch[j] floats, its groups' counters at group0[j].
 * - whole (a tile's slices fit one block): one block a tile, a warp a slice, the
 *   slices added in shared memory: no scratch, fence or counter. */
struct q_set {
    cuk_weight w[CUK_MATVEC_JOBS];
    float *y[CUK_MATVEC_JOBS];
    int64_t ys[CUK_MATVEC_JOBS]; /* y's floats a token */
    const float *bias[CUK_MATVEC_JOBS];
    unsigned first[CUK_MATVEC_JOBS], slices[CUK_MATVEC_JOBS], group0[CUK_MATVEC_JOBS];
    size_t scratch[CUK_MATVEC_JOBS];
};

#define MV_THREADS (MV_TILES * 32)
#define MV_WHOLE_THREADS 512 /* the most a whole-layout block takes */

/* Sums a lane holds: NT tokens (dp4a), or 4 per tile of 8 tokens (mma). */
#define MV_VALS(NT) ((NT) <= MV_DP4A_MAX ? (NT) : (NT) / 8 * 4)

template <uint32_t T, int NT, int U, bool WHOLE>
__global__ void __launch_bounds__(WHOLE ? MV_WHOLE_THREADS : MV_THREADS)
    matvec_q(const q_set set, const int8_t *xq, const float2 *xd, int n, float *scratch, unsigned *counters) {
    constexpr bool MMA = NT > MV_DP4A_MAX;
    griddep_release();
    extern __shared__ __align__(16) uint8_t xsm[];
    constexpr int BPC = CUK_CHUNK_BLOCKS(T);
    int j = 0;
#pragma unroll
    for (int i = 1; i < CUK_MATVEC_JOBS; i++)
        if (blockIdx.x >= set.first[i]) j = i;
    const cuk_weight &W = set.w[j];
    const unsigned slices = set.slices[j], local = blockIdx.x - set.first[j];
    const int64_t nb = W.cols / 32, nch = chunks_of(T, W.cols), tiles = (W.rows + 15) / 16;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned slice = WHOLE ? warp : local % slices, grp = local / slices;
    const int64_t tile = WHOLE ? local : (int64_t)grp * MV_TILES + warp, c0 = (int64_t)slice * U;
    /* the block's columns: a slice's, or (whole) all of them */
    const int64_t b0 = WHOLE ? 0 : c0 * BPC, SPAN = WHOLE ? nch * BPC * 32 : U * BPC * 32;
    const bool live = tile < tiles;
    /* the blocks of the warp's run that exist (FULL: all, the common case, with no
     * checks), and this lane's first codes and scales (a dp4a lane's own scales) */
    const int vb = live ? (int)min((int64_t)U * BPC, nb - c0 * BPC) : 0, t = lane % 4;
    const bool full = vb == U * BPC;
    const uint8_t *wl = W.data + (tile * nch + c0) * 1024 + lane * 16;
    constexpr int SE = CUK_SCALE_ENTRIES(T);
    /* row g's scales (dp4a: its row's, but Q6_K's lanes read both rows) */
    const uint16_t *rs = W.scales + ((tile * nch + c0) * 16 + lane / 4 + (MMA || T == KVQ_Q6_K ? 0 : (t >> 1) * 8)) * SE;
    const uint16_t *sl = rs + (MMA || T == KVQ_Q6_K ? 0 : (t & 1) * (BPC / 2)), *dl = rs + BPC;
    /* the weights depend on no earlier kernel: all of this warp's are loaded first */
    chunk_frag<T> f[U];
    const from_global ld = {weight_policy()};
    if (full) {
#pragma unroll
        for (int u = 0; u < U; u++) f[u] = load_chunk<T, MMA>(wl, sl, dl, u, ld);
    } else {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (u * BPC < vb) f[u] = load_chunk<T, MMA>(wl, sl, dl, u, ld);
    }
    griddep_wait();
    /* the inputs of these columns, once for the block: codes, then (scale, sum) pairs */
    const int64_t cols0 = b0 * 32, ncols = min(SPAN, W.cols - cols0);
    const int span = (int)SPAN;
    int8_t *xs = (int8_t *)xsm;
    float2 *ds = (float2 *)(xsm + (size_t)n * xs_stride(span));
    const int threads = WHOLE ? blockDim.x : MV_THREADS;
    for (int e = threadIdx.x; e < n * span / 16; e += threads) { /* all in flight at once (cp_async.cuh) */
        const int tok = e / (span / 16), k = (e % (span / 16)) * 16;
        if (k < ncols) cp_async16(xs + tok * xs_stride(span) + k, xq + tok * W.cols + cols0 + k);
    }
    for (int e = threadIdx.x; e < n * (span / 32); e += threads) {
        const int tok = e / (span / 32), k = e % (span / 32);
        if (k < ncols / 32) cp_async8(ds + tok * ds_stride(span) + k, xd + tok * nb + b0 + k);
    }
    cp_async_wait_all();
    __syncthreads();
    constexpr int VALS = MV_VALS(NT);
    float acc[VALS] = {};
    if (live) {
        const int first = (int)(c0 * BPC - b0); /* the warp's first block among the staged */
        const int8_t *xw = xs + first * 32;
        const float2 *dw = ds + first;
        if constexpr (MMA) {
            if (full) tile_sums_mma<T, NT, U, true>(f, vb, xw, dw, span, n, lane, acc);
            else tile_sums_mma<T, NT, U, false>(f, vb, xw, dw, span, n, lane, acc);
        } else {
            if (full) tile_sums_dp4a<T, NT, U, true>(f, vb, xw, dw, span, n, lane, acc);
            else tile_sums_dp4a<T, NT, U, false>(f, vb, xw, dw, span, n, lane, acc);
        }
    }

    if (WHOLE && slices > 1) { /* warp 0 adds the slices up, in order, as below */
        /* mma: the sums go where the inputs were (once all are read), which keeps
         * 8 tokens' Q/K/V and O launches whole within 48 KB */
        float *part = MMA ? (float *)xsm : (float *)(ds + n * ds_stride(span));
        if (MMA) __syncthreads();
#pragma unroll
        for (int v = 0; v < VALS; v++) part[(slice * 32 + lane) * VALS + v] = acc[v];
        __syncthreads();
        if (warp > 0) return;
        sum_slices<VALS, false>(part, slices, 32, lane, acc);
    } else if (WHOLE) {
        if (warp > 0) return;
    } else if (slices > 1) { /* the last block of the group adds the slices up, in order */
        float *part = scratch + set.scratch[j] + (size_t)grp * slices * MV_THREADS * VALS;
#pragma unroll
        for (int v = 0; v < VALS; v++) part[(slice * MV_THREADS + threadIdx.x) * VALS + v] = acc[v];
        __shared__ bool last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(&counters[set.group0[j] + grp], 1u) == slices - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        sum_slices<VALS, true>(part, slices, MV_THREADS, threadIdx.x, acc);
        if (threadIdx.x == 0) counters[set.group0[j] + grp] = 0; /* ready for the next launch */
    }
    if (!live) return;
    const int g = lane / 4;
#pragma unroll
    for (int v = 0; v < VALS; v++) {
        /* mma: c_i of token tile v / 4; dp4a: token v of row g + 8 (t >> 1), even lanes */
        const int tok = MMA ? v / 4 * 8 + 2 * t + (v & 1) : t & 1 ? n : v;
        const int64_t row = tile * 16 + g + 8 * (MMA ? (v & 3) >> 1 : t >> 1);
        if (tok < n && row < W.rows) set.y[j][(int64_t)tok * set.ys[j] + row] = acc[v] + (set.bias[j] ? set.bias[j][row] : 0.0f);
    }
}

/* ---- one or two tokens, streamed ----
 * matvec_q's warps load all of their weights, compute, and leave, and a launch runs
 * in waves of such blocks: between one wave's loads and the next's, the DRAM idles
 * while warps compute (down at one token: 1.7 waves, 47% of the DRAM's peak, Nsight
 * Compute). Here a block stays for several tiles, each warp one slice of every tile
 * (as the whole layout), and each warp keeps MV_RING chunks of its slices in flight
 * into shared memory (cp.async): the next tile's arrive while it computes this one's.
 * The same terms add up in the same order, so the outputs are matvec_q's bit for bit. */
#define MV_RING 8
/* The attention rows (cuk_queue.attn_rows) from which a step's attention chain counts
 * as long for its products' launches (KVQ_MV_LONG_ATTN_ROWS=N moves it, a measurement
 * aid): from there gate/up stashes chunks (below), and under it the product after the
 * attention streams a tile a block (stream_launch) and the KV rows are packed beside
 * the products after it (cuda_backend.c). */
#define MV_LONG_ATTN_ROWS 2048

extern "C" int cuk_long_attn_rows(void) { return MV_LONG_ATTN_ROWS; }

static cuk_tuning tuning;
extern "C" void cuk_set_tuning(const cuk_tuning *t) { tuning = *t; }
int cuk_warp_items(void) { return tuning.warp_items > 0 ? tuning.warp_items : CUK_WARP_ITEMS_MIN; }

/* Chunks a warp of a 4-warp block (gate/up of the 7-8B shapes) also holds in
 * registers (ST: as many as keep 5 blocks a multiprocessor without spills) after a
 * long attention chain. Asked for before the wait, they
 * stream while the step's attention chain leaves the DRAM idle rather than after it,
 * when the product's own weights are all it reads: llama3-8b Q4_0 on an H100 decodes
 * 1.6-2.8% faster with f16 KV from 2K rows on, 0.4-2% with K8V4 and K4V4. With less
 * attention the chain is short, and the registers, which leave fewer of these blocks
 * resident beside the O product's, cost more: 2% at 512 rows. */
static __host__ __device__ constexpr int stash_chunks(int NT) { return NT == 1 ? 3 : 2; }
#define MV_STASH_THREADS 128

/* A chunk in shared memory: its 1024 bytes of codes, then its 16 rows' scales. */
static __host__ __device__ constexpr int slot_bytes(uint32_t T) { return 1024 + 32 * CUK_SCALE_ENTRIES(T); }

/* Job of a tile of the launch (first[j]: job j's first tile; ~0u past the jobs). */
static __device__ __forceinline__ int job_of(const unsigned (&first)[CUK_MATVEC_JOBS], unsigned tile) {
    int j = 0;
#pragma unroll
    for (int i = 1; i < CUK_MATVEC_JOBS; i++)
        if (tile >= first[i]) j = i;
    return j;
}

/* ST > 0: 4 warps, 5 blocks a multiprocessor; else no minimum (1 took 56 registers, not 40) */
template <uint32_t T, int NT, int U, int ST>
__global__ void __launch_bounds__(ST > 0 ? MV_STASH_THREADS : MV_WHOLE_THREADS, ST > 0 ? 5 : 0)
    matvec_stream(const q_set set, const int8_t *xq, const float2 *xd, int n, unsigned tiles_all) {
    griddep_release();
    extern __shared__ __align__(16) uint8_t xsm[];
    constexpr int BPC = CUK_CHUNK_BLOCKS(T), SE = CUK_SCALE_ENTRIES(T), SLOT = slot_bytes(T), KL = BPC / 2;
    const int64_t cols = set.w[0].cols, nb = cols / 32, nch = chunks_of(T, cols); /* all jobs alike */
    const int slices = (int)set.slices[0], warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int vb = (int)min((int64_t)U * BPC, nb - (int64_t)warp * U * BPC), nu = (vb + BPC - 1) / BPC;
    const int span = (int)(nch * BPC * 32);
    /* shared memory: each warp's ring of slots, the inputs, two tiles' slice sums */
    uint8_t *ring = xsm + (size_t)warp * MV_RING * SLOT;
    int8_t *xs = (int8_t *)(xsm + (size_t)slices * MV_RING * SLOT);
    float2 *ds = (float2 *)((uint8_t *)xs + (size_t)n * xs_stride(span));
    float *part = (float *)(ds + n * ds_stride(span));
    const unsigned my_tiles = (tiles_all - blockIdx.x + gridDim.x - 1) / gridDim.x;
    const int nq = (int)my_tiles * nu; /* the warp's chunks: nu of each of its tiles */
    /* ST > 0: the first ST chunks of the warp's second tile come into registers before
     * the wait, beside the ring (a warp whose slice is a whole ring of whole chunks) */
    const int sw = ST > 0 && U == MV_RING && vb == U * BPC ? ST : 0;
    /* this lane's scales within a chunk's (load_chunk's, as matvec_q's dp4a) */
    const int lane_sc = (lane / 4 + (T == KVQ_Q6_K ? 0 : (t >> 1) * 8)) * SE;
    /* chunk q of the warp: its tile's job j and its unit of codes and scales */
    auto unit_of = [&](int q, int &j) {
        const unsigned tile = blockIdx.x + (unsigned)(q / nu) * gridDim.x;
        j = job_of(set.first, tile);
        return (int64_t)(tile - set.first[j]) * nch + (int64_t)warp * U + q % nu;
    };
    /* chunk q of the warp into its slot, as one group (empty past the last, so that
     * each wait below counts alike). Without weight_policy(): with an L2 cache hint,
     * ptxas (CUDA 13.0) gave some instantiations' copies an odd uniform register pair
     * for the policy, an illegal instruction when run. */
#define MV_ISSUE(r_)                                                                                                   \
    do {                                                                                                               \
        const int ri = (r_), qi = ri < MV_RING ? ri : ri + sw;                                                         \
        if (qi < nq) {                                                                                                 \
            int j;                                                                                                     \
            const int64_t unit = unit_of(qi, j);                                                                       \
            uint8_t *slot = ring + (ri % MV_RING) * SLOT;                                                              \
            const uint8_t *codes = set.w[j].data + unit * 1024;                                                        \
            cp_async16(slot + lane * 16, codes + lane * 16);                                                           \
            cp_async16(slot + 512 + lane * 16, codes + 512 + lane * 16);                                               \
            if (lane < 2 * SE)                                                                                         \
                cp_async16(slot + 1024 + lane * 16, (const uint8_t *)(set.w[j].scales + unit * 16 * SE) + lane * 16); \
        }                                                                                                              \
        cp_async_commit();                                                                                             \
    } while (0)
    /* the weights depend on no earlier kernel: the first ring is asked for first */
    for (int q = 0; q < MV_RING; q++) MV_ISSUE(q);
    chunk_frag<T> st[ST > 0 ? ST : 1];
    if (sw > 0) {
#pragma unroll
        for (int k = 0; k < ST; k++) {
            const int qi = MV_RING + k;
            if (qi < nq) {
                int j;
                const int64_t unit = unit_of(qi, j);
                const uint16_t *rs = set.w[j].scales + unit * 16 * SE + lane_sc;
                st[k] = load_chunk<T, false>(set.w[j].data + unit * 1024 + lane * 16,
                                             rs + (T == KVQ_Q6_K ? 0 : (t & 1) * KL), rs + BPC, 0,
                                             from_global{weight_policy()});
            }
        }
    }
    griddep_wait();
    for (int e = threadIdx.x; e < n * span / 16; e += blockDim.x) {
        const int tok = e / (span / 16), k = (e % (span / 16)) * 16;
        if (k < cols) cp_async16(xs + tok * xs_stride(span) + k, xq + tok * cols + k);
    }
    for (int e = threadIdx.x; e < n * (span / 32); e += blockDim.x) {
        const int tok = e / (span / 32), k = e % (span / 32);
        if (k < nb) cp_async8(ds + tok * ds_stride(span) + k, xd + tok * nb + k);
    }
    cp_async_wait_all();
    __syncthreads();
    const int sc_off = 1024 + 2 * lane_sc; /* this lane's scales within a slot */
    const int8_t *xw = xs + warp * U * BPC * 32;
    const float2 *dw = ds + warp * U * BPC;
    for (unsigned i = 0; i < my_tiles; i++) {
        float c[NT][KL];
#pragma unroll
        for (int tok = 0; tok < NT; tok++)
#pragma unroll
            for (int k = 0; k < KL; k++) c[tok][k] = 0;
        if constexpr (ST == 0) { /* written out: from_ring took 48 registers here, not 40 */
            for (int u = 0; u < nu; u++) {
                const int q = (int)i * nu + u;
                cp_async_wait<MV_RING - 1>();
                __syncwarp(); /* the scales came by other lanes */
                const uint8_t *slot = ring + (q % MV_RING) * SLOT;
                const uint16_t *rs = (const uint16_t *)(slot + sc_off);
                const chunk_frag<T> f = load_chunk<T, false>(slot + lane * 16, rs + (T == KVQ_Q6_K ? 0 : (t & 1) * KL),
                                                             rs + BPC, 0, from_shared{});
                __syncwarp(); /* the slot is read: its next chunk may come */
                MV_ISSUE(q + MV_RING);
                if (vb == U * BPC) dp4a_chunk<T, NT, true>(f, u, vb, xw, dw, span, n, t, c);
                else dp4a_chunk<T, NT, false>(f, u, vb, xw, dw, span, n, t, c);
            }
        } else {
            /* ring entry r; the next one asked for into its slot */
            auto from_ring = [&](int r) {
                cp_async_wait<MV_RING - 1>();
                __syncwarp();
                const uint8_t *slot = ring + (r % MV_RING) * SLOT;
                const uint16_t *rs = (const uint16_t *)(slot + sc_off);
                const chunk_frag<T> f = load_chunk<T, false>(slot + lane * 16, rs + (T == KVQ_Q6_K ? 0 : (t & 1) * KL),
                                                             rs + BPC, 0, from_shared{});
                __syncwarp();
                MV_ISSUE(r + MV_RING);
                return f;
            };
            if (sw > 0 && i == 1) { /* nu == MV_RING: indices known, st in registers */
#pragma unroll
                for (int u = 0; u < MV_RING; u++) {
                    const chunk_frag<T> f = u < ST ? st[u < ST ? u : 0] : from_ring(MV_RING + u - ST);
                    dp4a_chunk<T, NT, true>(f, u, vb, xw, dw, span, n, t, c);
                }
            } else {
                for (int u = 0; u < nu; u++) {
                    const int q = (int)i * nu + u;
                    const chunk_frag<T> f = from_ring(q < MV_RING ? q : q - sw);
                    if (vb == U * BPC) dp4a_chunk<T, NT, true>(f, u, vb, xw, dw, span, n, t, c);
                    else dp4a_chunk<T, NT, false>(f, u, vb, xw, dw, span, n, t, c);
                }
            }
        }
        /* the tile's slices' sums add up in order (warp 0) */
        float acc[NT];
#pragma unroll
        for (int tok = 0; tok < NT; tok++) acc[tok] = chains_sum<KL>(c[tok]);
        if (slices > 1) {
            float *p = part + (size_t)(i % 2) * slices * 32 * NT;
#pragma unroll
            for (int v = 0; v < NT; v++) p[(warp * 32 + lane) * NT + v] = acc[v];
            __syncthreads();
            if (warp == 0) sum_slices<NT, false>(p, (unsigned)slices, 32, lane, acc);
        }
        const unsigned tile = blockIdx.x + i * gridDim.x;
        const int j = job_of(set.first, tile);
        const int64_t rows = set.w[j].rows, row = (int64_t)(tile - set.first[j]) * 16 + lane / 4 + 8 * (t >> 1);
        if (warp == 0 && !(t & 1) && row < rows)
#pragma unroll
            for (int v = 0; v < NT; v++)
                if (v < n) set.y[j][(int64_t)v * set.ys[j] + row] = acc[v] + (set.bias[j] ? set.bias[j][row] : 0.0f);
    }
#undef MV_ISSUE
}

/* Chunks a block's warps take (U): about MV_WARPS warps in all, up to 8 chunks each.
 * The shapes alone choose it: the slices decide how a token's sums add up. */
static int chunks_per_warp(const struct cuk_weight *w, int n_jobs) {
    const int64_t aim = MV_WARPS;
    int64_t units = 0;
    for (int j = 0; j < n_jobs; j++) units += (w[j].rows + 15) / 16 * chunks_of(w[j].type, w[j].cols);
    int u = 1;
    while (u < 8 && units > aim * u) u *= 2;
    return u;
}

/* Shared memory of a block: n tokens' inputs of its columns. */
static size_t staged_smem(uint32_t T, int U, int n) {
    const int span = U * CUK_CHUNK_BLOCKS(T) * 32;
    return (size_t)n * ((size_t)xs_stride(span) + (size_t)ds_stride(span) * sizeof(float2));
}

extern "C" int cuk_type_supported(uint32_t type) {
    return type == KVQ_F32 || type == KVQ_F16 || type == KVQ_BF16 || type == KVQ_Q8_0 || type == KVQ_Q4_0 ||
           type == KVQ_Q4_K || type == KVQ_Q6_K;
}

/* The tokens a repacked kernel is compiled for: 1 or 2 (dp4a), 8 or 16 (mma). */
static int mv_tokens(int n) { return n <= MV_DP4A_MAX ? n : n <= 8 ? 8 : 16; }

/* How a launch of repacked jobs runs (S may be NULL), U chunks a warp and whole or
 * split (q_set): the blocks it takes, and the scratch floats and counters it needs. */
static void q_plan(const cuk_weight *w, int nj, int n, int U, bool whole, q_set *S, unsigned *blocks,
                   size_t *floats, unsigned *counters) {
    const size_t vals = (size_t)MV_THREADS * MV_VALS(mv_tokens(n));
    *blocks = 0, *floats = 0, *counters = 0;
    for (int j = 0; j < CUK_MATVEC_JOBS; j++) {
        if (j >= nj) {
            if (S) S->first[j] = ~0u, S->slices[j] = 1, S->group0[j] = 0, S->scratch[j] = 0;
            continue;
        }
        const int64_t tiles = (w[j].rows + 15) / 16, grp = (tiles + MV_TILES - 1) / MV_TILES;
        const unsigned slices = (unsigned)((chunks_of(w[j].type, w[j].cols) + U - 1) / U);
        if (S) S->first[j] = *blocks, S->slices[j] = slices, S->group0[j] = *counters, S->scratch[j] = *floats;
        if (whole) {
            *blocks += (unsigned)tiles;
            continue;
        }
        *blocks += (unsigned)grp * slices;
        *counters += (unsigned)grp;
        if (slices > 1) *floats += (size_t)grp * slices * vals;
    }
}

extern "C" void cuk_matvec_scratch(const struct cuk_matvec_job *jobs, int n_jobs, int n, size_t *floats,
                                   size_t *counters) {
    *floats = *counters = 0;
    for (int j0 = 0; j0 < n_jobs;) {
        cuk_weight w[CUK_MATVEC_JOBS];
        int nj = 0;
        for (; nj < CUK_MATVEC_JOBS && j0 + nj < n_jobs && jobs[j0 + nj].w->type == jobs[j0].w->type; nj++)
            w[nj] = *jobs[j0 + nj].w;
        j0 += nj;
        if (!cuk_repacked(w[0].type)) continue;
        unsigned blocks, cnt;
        size_t f;
        q_plan(w, nj, n, chunks_per_warp(w, nj), false, NULL, &blocks, &f, &cnt); /* split needs the most */
        if (f > *floats) *floats = f;
        if (cnt > *counters) *counters = cnt;
    }
}

/* Shared memory of a whole-layout block (0: the split layout instead): its warps
 * are the `slices` of one tile, all jobs' tiles cut alike, at least 2 blocks an SM
 * (regs: the kernel's registers a thread). Over 48 KB (16 tokens) it splits: a whole
 * layout there, given more shared memory, was slower (docs/cuda-attempts.md). */
static size_t whole_smem(const cuk_weight *w, int nj, int U, int n, bool mma, int vals, int regs) {
    const int64_t nch = chunks_of(w[0].type, w[0].cols), slices = (nch + U - 1) / U;
    for (int j = 1; j < nj; j++)
        if (chunks_of(w[j].type, w[j].cols) != nch) return 0;
    /* all the columns' inputs (a "slice" of nch chunks), then (mma: in their place)
     * the slices' sums */
    const size_t staged = staged_smem(w[0].type, (int)nch, n), sums = (size_t)slices * 32 * vals * sizeof(float);
    const size_t smem = mma ? (staged > sums ? staged : sums) : staged + sums;
    if (slices < 2 || slices * 32 > MV_WHOLE_THREADS || 2 * slices * 32 * regs > 65536 || smem > 48 * 1024)
        return 0;
    return smem;
}

/* matvec_stream<T, NT, U, ST>'s registers a thread (0: not usable), its shared memory
 * limit raised once. */
template <uint32_t T, int NT, int U, int ST>
static int stream_regs(int optin) {
    static int regs = -1;
    static unsigned seen;
    if (cuk_first_on_device(&seen)) {
        cudaFuncAttributes fa;
        const bool ok = cudaFuncGetAttributes(&fa, matvec_stream<T, NT, U, ST>) == cudaSuccess &&
                        cudaFuncSetAttribute(matvec_stream<T, NT, U, ST>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             optin) == cudaSuccess;
        if (regs != 0) regs = ok ? (fa.numRegs + 7) & ~7 : 0;
    }
    return regs;
}

/* Launches matvec_stream for these jobs when it takes them (one or two tokens, the
 * jobs alike in columns, up to 16 slices, shared memory enough, more tiles than
 * blocks fit the GPU at once): as many blocks as fit, tiles dealt round to them, so
 * that each multiprocessor gets about as many (with fewer blocks, each taking the
 * same number of tiles, the multiprocessors that hold one block less idled at the
 * end: gate/up at 70% of the DRAM's peak). With no more tiles than that, matvec_q
 * starts on its first chunk sooner; but the product after a short attention chain
 * (after_attn: the O product) streams a tile a block. Its blocks take 40 registers
 * where matvec_q's take 116 (they hold the weights), so more of them are resident
 * beside the attention's blocks and load their whole tile while the chain leaves the
 * DRAM idle; from 2048 rows, where two tile blocks fill a multiprocessor, matvec_q
 * is faster (docs/cuda-performance.md). cuk_tuning's stream_grid caps the blocks
 * (the tests: many tiles a block, on any GPU). */
template <uint32_t T, int NT, int U>
static bool stream_launch(cuk_queue *qu, q_set &S, const cuk_weight *w, int nj, const cuk_xq *xq, int n,
                          bool after_attn) {
    if constexpr (NT > MV_DP4A_MAX) {
        return false;
    } else {
        static int off = -1, optin, per_sm_smem, n_sm;
        const int cap = tuning.stream_grid;
        if (off < 0) {
            off = 0;
            int dev = 0;
            if (cudaGetDevice(&dev) != cudaSuccess ||
                cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
                cudaDeviceGetAttribute(&per_sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
                cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
                off = 1;
        }
        if (off) return false;
        const int64_t nch = chunks_of(T, w[0].cols);
        for (int j = 1; j < nj; j++)
            if (chunks_of(T, w[j].cols) != nch) return false;
        const int slices = (int)((nch + U - 1) / U), threads = slices * 32, span = (int)(nch * CUK_CHUNK_BLOCKS(T) * 32);
        const size_t smem = (size_t)slices * MV_RING * slot_bytes(T) +
                            (size_t)n * ((size_t)xs_stride(span) + (size_t)ds_stride(span) * sizeof(float2)) +
                            (size_t)2 * slices * 32 * NT * sizeof(float);
        if (threads > MV_WHOLE_THREADS || smem > (size_t)optin) return false;
        auto per_sm_of = [&](int regs) {
            return regs ? min(per_sm_smem / (int)(smem + 1024), min(2048 / threads, 65536 / (regs * threads))) : 0;
        };
        const int per_sm = per_sm_of(stream_regs<T, NT, U, 0>(optin));
        if (per_sm < 1) return false;
        const bool long_chain = qu->attn_rows >= cuk_long_attn_rows();
        unsigned tiles, cnt;
        size_t floats;
        q_plan(w, nj, n, U, true, &S, &tiles, &floats, &cnt); /* first[j]: job j's first tile */
        unsigned grid = (unsigned)(cap > 0 && cap < per_sm * n_sm ? cap : per_sm * n_sm);
        if (tiles <= grid) {
            if (!after_attn || long_chain) return false;
            grid = tiles;
        }
        if constexpr (U == MV_RING) /* chunks stashed in registers too, where as many blocks fit */
            if (long_chain && threads <= MV_STASH_THREADS &&
                per_sm_of(stream_regs<T, NT, U, stash_chunks(NT)>(optin)) >= per_sm) {
                pdl_launch_smem(matvec_stream<T, NT, U, stash_chunks(NT)>, dim3(grid), dim3(threads), smem, qu, S, xq->q, xq->dsum,
                                n, tiles);
                return true;
            }
        pdl_launch_smem(matvec_stream<T, NT, U, 0>, dim3(grid), dim3(threads), smem, qu, S, xq->q, xq->dsum, n, tiles);
        return true;
    }
}

extern "C" void cuk_matvec(cuk_queue *qu, const struct cuk_matvec_job *jobs, int n_jobs, const float *x,
                           int64_t x_stride, const struct cuk_xq *xq, int n, const struct cuk_mv_scratch *scr) {
    const bool after_attn = qu->after_attn;
    qu->after_attn = false;
    for (int j0 = 0; j0 < n_jobs;) {
        /* one launch for this job and the next ones of its type */
        const uint32_t T = jobs[j0].w->type;
        int nj = 0;
        while (nj < CUK_MATVEC_JOBS && j0 + nj < n_jobs && jobs[j0 + nj].w->type == T) nj++;
        if (cuk_repacked(T)) {
            q_set S = {};
            cuk_weight w[CUK_MATVEC_JOBS];
            for (int i = 0; i < nj; i++) {
                w[i] = S.w[i] = *jobs[j0 + i].w;
                S.y[i] = jobs[j0 + i].y;
                S.ys[i] = jobs[j0 + i].y_stride ? jobs[j0 + i].y_stride : w[i].rows;
                S.bias[i] = jobs[j0 + i].bias;
            }
            j0 += nj;
            const int U = chunks_per_warp(w, nj), nt = mv_tokens(n);
#define MM_LAUNCH(TT, NT, UU, WH, threads, smem)                                                                      \
    pdl_launch_smem(matvec_q<TT, NT, UU, WH>, dim3(blocks), dim3(threads), smem, qu, S, xq->q, xq->dsum, n,            \
                    scr->partial, scr->counters)
#define MM(TT, NT, UU)                                                                                                 \
    do {                                                                                                               \
        if (stream_launch<TT, NT, UU>(qu, S, w, nj, xq, n, after_attn)) break;                                         \
        static int regs;                                                                                               \
        static unsigned big;                                                                                           \
        if (!regs) {                                                                                                   \
            cudaFuncAttributes fa;                                                                                     \
            regs = cudaFuncGetAttributes(&fa, matvec_q<TT, NT, UU, true>) == cudaSuccess ? fa.numRegs : 255;          \
        }                                                                                                              \
        const size_t whole = whole_smem(w, nj, UU, n, NT > MV_DP4A_MAX, MV_VALS(NT), regs);                                             \
        unsigned blocks, cnt;                                                                                          \
        size_t floats;                                                                                                 \
        q_plan(w, nj, n, UU, whole != 0, &S, &blocks, &floats, &cnt);                                                  \
        if (whole) {                                                                                                   \
            MM_LAUNCH(TT, NT, UU, true, S.slices[0] * 32, whole);                                                      \
            break;                                                                                                     \
        }                                                                                                              \
        const size_t smem = staged_smem(TT, UU, n);                                                                    \
        if (smem > 48 * 1024 && cuk_first_on_device(&big))                                                            \
            cudaFuncSetAttribute(matvec_q<TT, NT, UU, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,             \
                                 (int)staged_smem(TT, UU, 16));                                                        \
        MM_LAUNCH(TT, NT, UU, false, MV_THREADS, smem);                                                                \
    } while (0)
#define MM_U(TT, NT)              \
    switch (U) {                  \
    case 1: MM(TT, NT, 1); break; \
    case 2: MM(TT, NT, 2); break; \
    case 4: MM(TT, NT, 4); break; \
    default: MM(TT, NT, 8); break; \
    }
#define Q(TT)                           \
    do {                                \
        switch (nt) {                   \
        case 1: MM_U(TT, 1); break;     \
        case 2: MM_U(TT, 2); break;     \
        case 8: MM_U(TT, 8); break;     \
        default: MM_U(TT, 16); break;   \
        }                               \
    } while (0)
            if (T == KVQ_Q4_0) Q(KVQ_Q4_0);
            else if (T == KVQ_Q4_K) Q(KVQ_Q4_K);
            else if (T == KVQ_Q6_K) Q(KVQ_Q6_K);
            else Q(KVQ_Q8_0);
#undef Q
#undef MM_U
#undef MM
#undef MM_LAUNCH
            continue;
        }
        mv_set S;
        unsigned blocks = 0;
        for (int i = 0; i < nj; i++) {
            S.w[i] = *jobs[j0 + i].w;
            S.y[i] = jobs[j0 + i].y;
            S.bias[i] = jobs[j0 + i].bias;
            S.first[i] = blocks;
            blocks += (unsigned)((S.w[i].rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK);
        }
        for (int i = nj; i < CUK_MATVEC_JOBS; i++) S.first[i] = ~0u;
        j0 += nj;
        const dim3 th(ROWS_PER_BLOCK * 32);
#define MV_NT(NT) pdl_launch(matvec<TT, NT>, dim3(blocks), th, qu, S, x, x_stride, n)
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

extern "C" cuk_weight cuk_weight_rows(const cuk_weight *w, int64_t r0, int64_t r1) {
    cuk_weight v = *w;
    const int64_t at = r0 / 16 * chunks_of(w->type, w->cols); /* the first tile's first chunk */
    v.data += at * 1024;
    v.scales += at * 16 * CUK_SCALE_ENTRIES(w->type);
    v.rows = r1 - r0;
    return v;
}

/* ---- whole rows as f32 or f16 (GEMM inputs, embeddings) ---- */


template <uint32_t T, typename O>
__global__ void dequantize(const cuk_weight W, int64_t r0, int64_t n_rows, O *out) {
    const int64_t cols = W.cols, chunks = cols / 8, total = n_rows * chunks;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / chunks, c = i % chunks;
        float w[8];
        wload8<T>(W, r0 + r, c, w);
        if (sizeof(O) == 4) {
            float4 *o = (float4 *)(out + r * cols + c * 8);
            o[0] = make_float4(w[0], w[1], w[2], w[3]);
            o[1] = make_float4(w[4], w[5], w[6], w[7]);
        } else {
            __half2 h[4];
#pragma unroll
            for (int k = 0; k < 4; k++) h[k] = __halves2half2(sat_half(w[2 * k]), sat_half(w[2 * k + 1]));
            *(uint4 *)(out + r * cols + c * 8) = *(const uint4 *)h;
        }
    }
}

extern "C" void cuk_dequantize(cuk_queue *qu, const cuk_weight *w, int64_t r0, int64_t r1, void *out, int f16) {
    const int64_t total = (r1 - r0) * (w->cols / 8);
    const unsigned blocks = (unsigned)(total / 256 + 1 < 65536 ? total / 256 + 1 : 65536);
#define DQ(T)                                                                                    \
    if (f16) queue_launch(dequantize<T, __half>, dim3(blocks), dim3(256), qu, *w, r0, r1 - r0, (__half *)out); \
    else queue_launch(dequantize<T, float>, dim3(blocks), dim3(256), qu, *w, r0, r1 - r0, (float *)out)
    FOR_TYPE(w->type, DQ)
#undef DQ
}

/* WIDE: each block of 32 columns in the order the wide products' B tiles take it
 * (half_at: pairs (0, 4, 8, 12, 1, 5, 9, 13) feed the block's first k16 product and the
 * rest the second, matching the lanes' A fragments). */
template <bool WIDE>
__global__ void to_half(const float *x, int64_t x_stride, int64_t k, __half *out) {
    const int64_t t = blockIdx.y;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < k; i += (int64_t)gridDim.x * blockDim.x)
        out[t * k + half_at(i, WIDE)] = sat_half(x[t * x_stride + i]);
}

template <bool WIDE>
static void to_half_launch(cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, void *out) {
    const dim3 grid((unsigned)(k / 256 + 1 < 64 ? k / 256 + 1 : 64), (unsigned)n);
    queue_launch(to_half<WIDE>, grid, dim3(256), qu, x, x_stride, k, (__half *)out);
}

extern "C" void cuk_to_half(cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, void *out) {
    to_half_launch<false>(qu, x, x_stride, n, k, out);
}

extern "C" void cuk_to_half_wide(cuk_queue *qu, const float *x, int64_t x_stride, int n, int64_t k, void *out) {
    to_half_launch<true>(qu, x, x_stride, n, k, out);
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

extern "C" void cuk_embed(cuk_queue *qu, const cuk_weight *e, const int32_t *tokens, int n, float scale, float *x) {
#define EM(T) queue_launch(embed_rows<T>, dim3((unsigned)n), dim3(128), qu, *e, tokens, scale, x)
    FOR_TYPE(e->type, EM)
#undef EM
}

__global__ void add_bias(float *y, const float *bias, int64_t rows, int64_t total) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += bias[i % rows];
}

extern "C" void cuk_add_bias(cuk_queue *qu, float *y, const float *bias, int n, int64_t rows) {
    const int64_t total = (int64_t)n * rows;
    queue_launch(add_bias, dim3((unsigned)(total / 256 + 1 < 4096 ? total / 256 + 1 : 4096)), dim3(256), qu, y, bias,
                 rows, total);
}
