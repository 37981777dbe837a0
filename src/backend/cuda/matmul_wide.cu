/* Products of repacked weights (Q4_0, Q8_0, Q4_K, Q6_K) with batches of 17 to a few
 * hundred tokens, from the packed codes: no f16 copy of the weights goes through
 * device memory (the GEMM path wrote and read 4x the weights' bytes a step).
 *
 * A block is WIDE_WARPS warps, each a tile of 16 rows (cuda_kernels.h), over NT tokens.
 * Chunk by chunk, the block stages the tokens' inputs as f16 in shared memory
 * (cp.async, the next chunk's in flight while this one is computed); each warp holds
 * its tile's chunk in registers (the next one loaded ahead), turns each block of 32
 * columns into f16 once and multiplies it with every 8 tokens on the tensor cores
 * (mma.m16n8k16, f32 sums). The f16 weights are those cuk_dequantize writes, and the
 * inputs those of cuk_to_half, so the results are the GEMM path's up to the order of
 * the sums. Where rows and token groups make too few blocks to fill the GPU, the
 * chunks are split over gridDim.z blocks whose partial sums wide_reduce adds up in
 * split order, so results do not depend on timing. */
#include <cuda_fp16.h>

#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/q_chunk.cuh"
#include "core/dtype.h"

#define WIDE_WARPS 8 /* tiles of a block: 128 rows */

/* Shared memory of one chunk's inputs for NT tokens: rows of span + 32 halves, so
 * that the 16-byte loads of a quarter warp (two tokens) fall in different banks. */
static __host__ __device__ constexpr int wide_xs(int span) { return span + 32; }
static __host__ __device__ constexpr int wide_stage_halves(int nt, int span) { return nt * wide_xs(span); }

/* Two f16 codes of a half2 word built by byte_perm from 0x64 bytes: 1024 + code. */
static __device__ __forceinline__ uint32_t h2_of_bytes(uint32_t v, uint32_t sel) { return __byte_perm(v, 0x64u, sel); }

/* Codes of half2 words (1024 + offset + code), less k, times scale d: exact integer
 * codes, one rounding in the product (as the CPU's dequantization rounded to f16). */
static __device__ __forceinline__ uint32_t h2_scaled(uint32_t v, __half2 k, __half2 d) {
    const __half2 r = __hmul2(__hsub2(*(const __half2 *)&v, k), d);
    return *(const uint32_t *)&r;
}

static __device__ __forceinline__ uint32_t h2_pack(float a, float b) {
    const __half2 r = __floats2half2_rn(a, b);
    return *(const uint32_t *)&r;
}

/* Block j of a lane's chunk as the A fragments of two m16n8k16 products: the lane
 * holds columns 8t..8t+7 of rows g and g + 8 (cuda_kernels.h), which go to the
 * products' k positions (2t, 2t+1, 8+2t, 9+2t): columns 8t..8t+3 to the first,
 * 8t+4..8t+7 to the second. The inputs are read in the same order. a[m]: product m's
 * a0 (row g), a1 (row g + 8), a2, a3. */
template <uint32_t T>
static __device__ __forceinline__ void a_frags(const chunk_frag<T> &f, int j, int t, uint32_t (&a)[2][4]) {
    const uint32_t w[4] = {f.lo.x, f.lo.y, f.lo.z, f.lo.w}, h[4] = {f.hi.x, f.hi.y, f.hi.z, f.hi.w};
    uint32_t c[2][2]; /* [row][first, second four columns]: four codes each */
    if (nibbles(T)) { /* byte i: column 8t + i low, 8t + 4 + i high */
        c[0][0] = w[j] & 0x0F0F0F0Fu, c[0][1] = (w[j] >> 4) & 0x0F0F0F0Fu;
        c[1][0] = h[j] & 0x0F0F0F0Fu, c[1][1] = (h[j] >> 4) & 0x0F0F0F0Fu;
    } else { /* int8: made unsigned (+128) */
        c[0][0] = w[2 * j] ^ 0x80808080u, c[0][1] = w[2 * j + 1] ^ 0x80808080u;
        c[1][0] = h[2 * j] ^ 0x80808080u, c[1][1] = h[2 * j + 1] ^ 0x80808080u;
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int m = 0; m < 2; m++) {
            const uint32_t lo = h2_of_bytes(c[r][m], 0x4140u), hi = h2_of_bytes(c[r][m], 0x4342u);
            if (T == KVQ_Q4_0 || T == KVQ_Q8_0) {
                const __half2 k = __float2half2_rn(T == KVQ_Q4_0 ? 1032.0f : 1152.0f);
                const __half2 d = __half2half2(__ushort_as_half(r ? f.s1[j] : f.s0[j]));
                a[m][r] = h2_scaled(lo, k, d), a[m][2 + r] = h2_scaled(hi, k, d);
            } else { /* Q4_K: (d s) code - dmin m; Q6_K: (d scale) code, a scale per 16 columns */
                const float base = T == KVQ_Q4_K ? 1024.0f : 1152.0f;
                const float2 ql = __half22float2(*(const __half2 *)&lo), qh = __half22float2(*(const __half2 *)&hi);
                float sc, mn = 0.0f;
                if (T == KVQ_Q4_K) {
                    const float2 sb = block_scale<T>(r ? f.s1[j] : f.s0[j], r ? f.dm1 : f.dm0);
                    sc = sb.x, mn = sb.y;
                } else {
                    const uint16_t s = r ? f.s1[j] : f.s0[j];
                    sc = __fmul_rn(h2f((uint16_t)(r ? f.dm1 : f.dm0)), (float)(int8_t)(s >> (t / 2 * 8)));
                }
                a[m][r] = h2_pack(__fsub_rn(__fmul_rn(sc, ql.x - base), mn), __fsub_rn(__fmul_rn(sc, ql.y - base), mn));
                a[m][2 + r] = h2_pack(__fsub_rn(__fmul_rn(sc, qh.x - base), mn), __fsub_rn(__fmul_rn(sc, qh.y - base), mn));
            }
        }
}

template <uint32_t T, int NT>
__global__ void __launch_bounds__(WIDE_WARPS * 32, 2)
    matmul_wide(const cuk_weight W, const __half *x16, int n, float *y, int64_t y_stride, const float *bias,
                float *part, int chunks_per_split) {
    constexpr int BPC = CUK_CHUNK_BLOCKS(T), SE = CUK_SCALE_ENTRIES(T), SPAN = BPC * 32;
    constexpr int XS = wide_xs(SPAN), STAGE = wide_stage_halves(NT, SPAN);
    griddep_release();
    extern __shared__ __align__(16) __half xsm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t K = W.cols, nb = K / 32, nch = chunks_of(T, K), tiles = (W.rows + 15) / 16;
    const int64_t tile = (int64_t)blockIdx.x * WIDE_WARPS + warp;
    const bool live = tile < tiles;
    const int tok0 = blockIdx.y * NT, nt_live = min(NT, n - tok0);
    const int64_t c0 = (int64_t)blockIdx.z * chunks_per_split, c1 = min(nch, c0 + chunks_per_split);

    const uint8_t *wl = W.data + (live ? tile : 0) * nch * 1024 + lane * 16;
    const uint16_t *sl = W.scales + ((live ? tile : 0) * nch * 16 + g) * SE, *dl = sl + BPC;
    const from_global ld = {weight_policy()};
    chunk_frag<T> f, fn;
    if (live && c0 < c1) f = load_chunk<T, true>(wl, sl, dl, (int)c0, ld);
    griddep_wait();

    /* chunk c's inputs into buffer c & 1; tokens past n are zeros (not stored) */
    auto stage_in = [&](int64_t c) {
        __half *xs = xsm + (c & 1) * STAGE;
        const int64_t k0 = c * SPAN;
        for (int e = threadIdx.x; e < NT * (SPAN / 8); e += WIDE_WARPS * 32) {
            const int tok = e / (SPAN / 8), k = (e % (SPAN / 8)) * 8;
            if (k0 + k >= K) continue;
            if (tok < nt_live) cp_async16(xs + tok * XS + k, x16 + (int64_t)(tok0 + tok) * K + k0 + k);
            else *(uint4 *)(xs + tok * XS + k) = make_uint4(0, 0, 0, 0);
        }
        cp_async_commit();
    };

    float acc[NT / 8][4];
#pragma unroll
    for (int i = 0; i < NT / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0;
    if (c0 < c1) stage_in(c0);
    for (int64_t c = c0; c < c1; c++) {
        const bool more = c + 1 < c1;
        if (more) {
            stage_in(c + 1);
            if (live) fn = load_chunk<T, true>(wl, sl, dl, (int)(c + 1), ld);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const __half *xs = xsm + (c & 1) * STAGE + g * XS + 8 * t;
        const int vb = (int)min((int64_t)BPC, nb - c * BPC); /* blocks that exist */
        if (live) {
#pragma unroll
            for (int j = 0; j < BPC; j++) {
                if (j >= vb) break;
                uint32_t a[2][4];
                a_frags<T>(f, j, t, a);
                /* four token tiles at a time, so that no product waits for the one before */
#pragma unroll
                for (int tq = 0; tq < NT / 8; tq += 4) {
                    if (tq * 8 >= nt_live) break;
                    uint4 b[4];
#pragma unroll
                    for (int i = 0; i < 4; i++) b[i] = *(const uint4 *)(xs + (tq + i) * 8 * XS + j * 32);
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        mma_f16_16816(acc[tq + i], a[0][0], a[0][1], a[0][2], a[0][3], b[i].x, b[i].y);
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        mma_f16_16816(acc[tq + i], a[1][0], a[1][1], a[1][2], a[1][3], b[i].z, b[i].w);
                }
            }
        }
        __syncthreads(); /* the buffer is staged again two chunks on */
        if (more) f = fn;
    }
    if (!live) return;
    const bool split = gridDim.z > 1;
#pragma unroll
    for (int tt = 0; tt < NT / 8; tt++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int tok = tt * 8 + 2 * t + (i & 1);
            const int64_t row = tile * 16 + g + 8 * (i >> 1);
            if (tok >= nt_live || row >= W.rows) continue;
            if (split) part[((int64_t)blockIdx.z * n + tok0 + tok) * W.rows + row] = acc[tt][i];
            else y[(int64_t)(tok0 + tok) * y_stride + row] = acc[tt][i] + (bias ? bias[row] : 0.0f);
        }
}

/* y[tok][row] = the splits' partial sums in split order (+ bias). */
__global__ void wide_reduce(const float *part, int splits, int n, int64_t rows, float *y, int64_t y_stride,
                            const float *bias) {
    griddep_release();
    griddep_wait();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * rows) return;
    const int64_t tok = i / rows, row = i % rows;
    float s = part[i];
    for (int z = 1; z < splits; z++) s += part[(int64_t)z * n * rows + i];
    y[tok * y_stride + row] = s + (bias ? bias[row] : 0.0f);
}

/* The tokens of a block's group (a warp's sums: 4 floats per 8 tokens). */
static int wide_tokens(int n) { return n <= 32 ? 32 : 64; }

/* Splits of the chunks for a product: enough blocks for about two a multiprocessor,
 * each split at least 2 chunks long. */
static int wide_splits(const cuk_weight *w, int n, int n_sm) {
    const int64_t tiles = (w->rows + 15) / 16, groups = (n + wide_tokens(n) - 1) / wide_tokens(n);
    const int64_t blocks = (tiles + WIDE_WARPS - 1) / WIDE_WARPS * groups;
    const int64_t nch = (w->cols / 32 + CUK_CHUNK_BLOCKS(w->type) - 1) / CUK_CHUNK_BLOCKS(w->type);
    int64_t splits = (2 * (int64_t)n_sm + blocks - 1) / blocks;
    if (splits > nch / 2) splits = nch / 2;
    return splits < 1 ? 1 : (int)splits;
}

extern "C" size_t cuk_matmul_wide_scratch(const cuk_weight *w, int n, int n_sm) {
    const int splits = wide_splits(w, n, n_sm);
    return splits > 1 ? (size_t)splits * (size_t)n * (size_t)w->rows : 0;
}

template <uint32_t T, int NT>
static void wide_launch(cuk_queue *qu, const cuk_weight *w, const void *x16, int n, float *y, int64_t y_stride,
                        const float *bias, float *part, int splits) {
    constexpr int SPAN = CUK_CHUNK_BLOCKS(T) * 32;
    const size_t smem = 2 * sizeof(__half) * (size_t)wide_stage_halves(NT, SPAN);
    static unsigned sized;
    if (cuk_first_on_device(&sized))
        cudaFuncSetAttribute(matmul_wide<T, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    const int64_t nch = (w->cols / 32 + CUK_CHUNK_BLOCKS(T) - 1) / CUK_CHUNK_BLOCKS(T);
    const int per = (int)((nch + splits - 1) / splits);
    const int64_t tiles = (w->rows + 15) / 16;
    dim3 grid((unsigned)((tiles + WIDE_WARPS - 1) / WIDE_WARPS), (unsigned)((n + NT - 1) / NT),
              (unsigned)((nch + per - 1) / per));
    pdl_launch_smem(matmul_wide<T, NT>, grid, dim3(WIDE_WARPS * 32), smem, qu, *w, (const __half *)x16, n, y,
                    y_stride, bias, part, per);
    if (grid.z > 1) {
        const int64_t total = (int64_t)n * w->rows;
        pdl_launch(wide_reduce, dim3((unsigned)((total + 255) / 256)), dim3(256), qu, (const float *)part,
                   (int)grid.z, n, w->rows, y, y_stride, bias);
    }
}

extern "C" void cuk_matmul_wide(cuk_queue *qu, const cuk_weight *w, const void *x16, int n, float *y,
                                int64_t y_stride, const float *bias, float *scratch, int n_sm) {
    const int splits = wide_splits(w, n, n_sm);
#define WIDE_BY_TOKENS(TT)                                                                                   \
    if (wide_tokens(n) == 32) wide_launch<TT, 32>(qu, w, x16, n, y, y_stride, bias, scratch, splits); \
    else wide_launch<TT, 64>(qu, w, x16, n, y, y_stride, bias, scratch, splits)
    switch (w->type) {
    case KVQ_Q4_0: WIDE_BY_TOKENS(KVQ_Q4_0); break;
    case KVQ_Q8_0: WIDE_BY_TOKENS(KVQ_Q8_0); break;
    case KVQ_Q4_K: WIDE_BY_TOKENS(KVQ_Q4_K); break;
    case KVQ_Q6_K: WIDE_BY_TOKENS(KVQ_Q6_K); break;
    default: break; /* callers take this path for cuk_repacked types only */
    }
#undef WIDE_BY_TOKENS
}
