/* Products of repacked weights (Q4_0, Q8_0, Q4_K, Q6_K) with batches of 9 to a few
 * hundred tokens, from the packed codes, on Hopper's warpgroup tensor cores (wgmma,
 * sm_90a; cuk_wide_available says whether the device runs them).
 *
 * A block is WG warpgroups, each warp a tile of 16 rows (cuda_kernels.h), over a group
 * of NT tokens; a launch's blocks cover the rows of up to three weights of one type
 * and width (Q, K and V; gate and up), one after the other. Chunk by chunk, the block
 * copies its tiles' codes and scales and the tokens' inputs into shared memory by
 * cp.async, two chunks ahead of the one it computes, so that enough bytes are in flight
 * to keep device memory busy. Each warp turns its tile's blocks of 32 columns into f16
 * in registers (as cuk_dequantize writes them: one rounding) and its warpgroup
 * multiplies 64 rows at a time with all the tokens (wgmma m64nNTk16, f32 sums, the
 * inputs read from shared memory), while the warp converts the next block. The inputs
 * are f16 in the order cuk_to_half_wide writes them, so the results are the GEMM
 * path's up to the order of the sums. Where the rows make too few blocks to fill the
 * GPU, the chunks are split over gridDim.z blocks whose partial sums wide_reduce adds
 * up in split order (cuk_wide_settle), or the operation that reads the outputs next as
 * it reads them (cuk_sum_in), so results depend neither on timing nor on the number of
 * tokens. */
#include <cuda_fp16.h>
#include <cudaTypedefs.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "backend/cuda/bulk_copy.cuh"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/q_chunk.cuh"
#include "backend/cuda/split_sum.cuh"
#include "backend/cuda/wgmma.cuh"
#include "core/dtype.h"

/* Blocks a multiprocessor holds with groups of nt tokens (the launch bounds; four
 * stages of 64 tokens' inputs leave shared memory for one). */
static __host__ __device__ constexpr int wide_per_sm(int nt) { return nt <= 32 ? 2 : 1; }

template <uint32_t T, int NT, int WG>
struct wide_shape {
    static constexpr int BPC = CUK_CHUNK_BLOCKS(T), SE = CUK_SCALE_ENTRIES(T), SPAN = BPC * 32;
    static constexpr int THREADS = WG * 128, TILES = WG * 4;
    static constexpr int CODES = TILES * 1024, SCALES = TILES * 16 * SE * 2, INPUTS = NT * SPAN * 2;
    static constexpr int STAGE = CODES + SCALES + INPUTS; /* bytes */
};

#if KVQ_WGMMA /* the kernel's body: empty where the build has no wgmma */
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

/* The words of a lane's chunk (codes at w, its rows' scale entries at s and s + 8 SE,
 * as load_chunk reads them) that block j's fragments use, loaded as they are needed:
 * the whole chunk held in registers beside two sets of fragments would leave too few
 * for the products to overlap the conversion. */
template <uint32_t T, int SE>
static __device__ __forceinline__ chunk_frag<T> block_frag(const uint8_t *w, const uint16_t *s, int j) {
    chunk_frag<T> f = {};
    uint32_t *lo = &f.lo.x, *hi = &f.hi.x;
    if (nibbles(T)) {
        lo[j] = *(const uint32_t *)(w + 4 * j), hi[j] = *(const uint32_t *)(w + 512 + 4 * j);
    } else {
        const uint2 l = *(const uint2 *)(w + 8 * j), h = *(const uint2 *)(w + 512 + 8 * j);
        lo[2 * j] = l.x, lo[2 * j + 1] = l.y, hi[2 * j] = h.x, hi[2 * j + 1] = h.y;
    }
    f.s0[j] = s[j], f.s1[j] = s[8 * SE + j];
    if (T == KVQ_Q4_K || T == KVQ_Q6_K) { /* the rows' (d, dmin) or d words, after the block entries */
        const int at = T == KVQ_Q4_K ? CUK_CHUNK_BLOCKS(T) : 2;
        f.dm0 = *(const uint32_t *)(s + at), f.dm1 = *(const uint32_t *)(s + 8 * SE + at);
    }
    return f;
}
#endif

/* A launch's products: up to CUK_MATVEC_JOBS weights of one type and width, their
 * blocks of rows one after the other along x (job j's from x0[j]). */
struct wide_set {
    const uint8_t *data[CUK_MATVEC_JOBS];
    const uint16_t *scales[CUK_MATVEC_JOBS];
    int64_t rows[CUK_MATVEC_JOBS], y_stride[CUK_MATVEC_JOBS], part_at[CUK_MATVEC_JOBS + 1];
    float *y[CUK_MATVEC_JOBS];
    const float *bias[CUK_MATVEC_JOBS];
    int x0[CUK_MATVEC_JOBS + 1];
    int64_t cols;
};

/* Job j's member m of the set, without indexing the parameters by a variable (which
 * would copy them to local memory). */
#define WIDE_OF(set, m, j) ((j) == 0 ? (set).m[0] : (j) == 1 ? (set).m[1] : (set).m[2])
static_assert(CUK_MATVEC_JOBS == 3, "WIDE_OF picks one of three jobs");

/* A warp's sums of its 16 rows from row0 (wgmma's accumulator layout, wgmma.cuh) for the
 * block's tokens from tok0: into job's outputs (+ bias), or as split blockIdx.z's
 * partial sums where the chunks were split. */
template <int NT>
static __device__ __forceinline__ void wide_store(const wide_set &js, int job, const float (&acc)[NT / 2],
                                                  int64_t row0, int tok0, int nt_live, int n, float *part) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int64_t rows = WIDE_OF(js, rows, job), y_stride = WIDE_OF(js, y_stride, job);
    float *y = WIDE_OF(js, y, job), *pj = part + WIDE_OF(js, part_at, job);
    const float *bias = WIDE_OF(js, bias, job);
#pragma unroll
    for (int i = 0; i < NT / 2; i++) {
        const int tok = 8 * (i / 4) + 2 * t + i % 2;
        const int64_t row = row0 + g + 8 * (i / 2 % 2);
        if (tok >= nt_live || row >= rows) continue;
        if (gridDim.z > 1) pj[((int64_t)blockIdx.z * n + tok0 + tok) * rows + row] = acc[i];
        else y[(int64_t)(tok0 + tok) * y_stride + row] = acc[i] + (bias ? bias[row] : 0.0f);
    }
}

template <uint32_t T, int NT, int WG, int S>
__global__ void __launch_bounds__(WG * 128, wide_per_sm(NT))
    matmul_wide(const wide_set js, const __half *xp, int n, float *part, int chunks_per_split) {
    griddep_release();
#if KVQ_WGMMA
    using SH = wide_shape<T, NT, WG>;
    constexpr int D = S - 2; /* chunks in flight: of the others one is computed, one still read */
    constexpr int WP = SH::TILES * 64 / SH::THREADS, SPIECES = SH::TILES * 2 * SH::SE; /* copies a thread */
    constexpr int SP = (SPIECES + SH::THREADS - 1) / SH::THREADS;
    constexpr int XP = (NT * SH::SPAN / 8 + SH::THREADS - 1) / SH::THREADS;
    extern __shared__ __align__(128) uint8_t sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int job = (int)blockIdx.x >= js.x0[1] ? ((int)blockIdx.x >= js.x0[2] ? 2 : 1) : 0;
    const struct {
        const uint8_t *data;
        const uint16_t *scales;
        int64_t rows;
    } W = {WIDE_OF(js, data, job), WIDE_OF(js, scales, job), WIDE_OF(js, rows, job)};
    const int64_t K = js.cols, nch = chunks_of(T, K), tiles = (W.rows + 15) / 16;
    const int64_t tile0 = (int64_t)((int)blockIdx.x - WIDE_OF(js, x0, job)) * SH::TILES;
    const int tok0 = blockIdx.y * NT, nt_live = min(NT, n - tok0);
    const int64_t c0 = (int64_t)blockIdx.z * chunks_per_split;
    const int nc = (int)(min(nch, c0 + chunks_per_split) - c0);

    /* each thread's copies, from chunk c0 on, each source a chunk further after each
     * copy: 1024 code bytes, 16 SE scales, SPAN inputs (tiles past the matrix: its
     * last tile again). The inputs as B's core matrices (8 tokens x 8 columns, 128
     * bytes): that of tokens 8 a.. and columns 8 kb.. at (a SPAN / 8 + kb) 128, so that
     * a warp's copies read 64 bytes of each of 8 rows and write 512 contiguous bytes. */
    const uint8_t *wsrc[WP];
    const uint16_t *ssrc[SP];
    const __half *xsrc[XP];
    int xfull[XP]; /* the copy's chunks that lie inside the row (later ones: zeros); -1: no token */
#pragma unroll
    for (int k = 0; k < WP; k++) {
        const int e = threadIdx.x + k * SH::THREADS;
        wsrc[k] = W.data + (min(tile0 + e / 64, tiles - 1) * nch + c0) * 1024 + e % 64 * 16;
    }
#pragma unroll
    for (int k = 0; k < SP; k++) {
        const int e = min((int)threadIdx.x + k * SH::THREADS, SPIECES - 1);
        ssrc[k] = W.scales + (min(tile0 + e / (2 * SH::SE), tiles - 1) * nch + c0) * 16 * SH::SE + e % (2 * SH::SE) * 8;
    }
#pragma unroll
    for (int k = 0; k < XP; k++) { /* copy e: token i, columns 8 kb.. */
        const int e = threadIdx.x + k * SH::THREADS, i = e / SH::SPAN * 8 + e % 8, kb = e / 8 % (SH::SPAN / 8);
        const int64_t left = K - c0 * SH::SPAN - kb * 8; /* columns of the row from the copy's first on */
        xfull[k] = i < nt_live ? (int)max((int64_t)0, (left + SH::SPAN - 1) / SH::SPAN) : -1;
        xsrc[k] = xp + (int64_t)(tok0 + min(i, nt_live - 1)) * K + c0 * SH::SPAN + kb * 8;
    }
    const uint32_t sm_at = smem_addr(sm);
    auto stage_weights = [&](int u) { /* chunk c0 + u into buffer u % S */
        const uint32_t b = sm_at + u % S * SH::STAGE;
#pragma unroll
        for (int k = 0; k < WP; k++) cp_async16(b + (threadIdx.x + k * SH::THREADS) * 16, wsrc[k]), wsrc[k] += 1024;
#pragma unroll
        for (int k = 0; k < SP; k++) {
            if (threadIdx.x + k * SH::THREADS < SPIECES)
                cp_async16(b + SH::CODES + (threadIdx.x + k * SH::THREADS) * 16, ssrc[k]);
            ssrc[k] += 16 * SH::SE;
        }
    };
    auto stage_inputs = [&](int u) { /* columns past the matrix are zeros (the source named is the first input) */
        const uint32_t b = sm_at + u % S * SH::STAGE + SH::CODES + SH::SCALES;
#pragma unroll
        for (int k = 0; k < XP; k++) {
            if (xfull[k] >= 0)
                cp_async16_fill(b + (threadIdx.x + k * SH::THREADS) * 16, u < xfull[k] ? xsrc[k] : xp, u < xfull[k] ? 16 : 0);
            xsrc[k] += SH::SPAN;
        }
    };

    /* the weights depend on no earlier kernel: their first chunks go before the wait */
    for (int u = 0; u < D; u++)
        if (u < nc) stage_weights(u);
    griddep_wait();
    for (int u = 0; u < D; u++) {
        if (u < nc) stage_inputs(u);
        cp_async_commit();
    }

    float acc[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; i++) acc[i] = 0.0f;
    /* Block by block, one block's products in flight while the next one's A fragments
     * are made, in the other of two sets; a set's registers are kept (wg_keep) until
     * the wait for the products that read them, so that nothing else is given them.
     * With no more than the two sets defined between a product and its wait, ptxas
     * need not serialize the products. */
    static_assert(SH::BPC % 2 == 0, "a chunk's blocks alternate between the two sets");
    uint32_t a[2][2][4] = {};
    const uint64_t desc0 = wg_desc(sm + SH::CODES + SH::SCALES, 128, SH::SPAN * 16); /* buffer 0's inputs */
    for (int u = 0; u < nc; u++) {
        cp_async_wait<D - 1>();
        fence_async_shared();
        __syncthreads(); /* chunk u is in; the products of chunk u - 2 are done (the waits below) */
        if (u + D < nc) stage_weights(u + D), stage_inputs(u + D);
        cp_async_commit();

        const uint8_t *b = sm + u % S * SH::STAGE;
        const uint16_t *sc = (const uint16_t *)(b + SH::CODES) + (warp * 16 + g) * SH::SE;
        const uint8_t *w = b + warp * 1024 + lane * 16;
        const uint64_t desc = desc0 + (uint64_t)(u % S * (SH::STAGE / 16)); /* 16-byte units, below bit 14 */
#pragma unroll
        for (int j = 0; j < SH::BPC; j++) {
            wg_wait<1>(); /* the products of block j - 2, which read set j % 2, are done */
#pragma unroll
            for (int r = 0; r < 8; r++) wg_keep(a[j % 2][r / 4][r % 4]);
            a_frags<T>(block_frag<T, SH::SE>(w, sc, j), j, t, a[j % 2]); /* padding blocks are zeros */
            wg_fence();
            wgmma_f16<NT>(acc, a[j % 2][0], desc + 4 * j * 8);
            wgmma_f16<NT>(acc, a[j % 2][1], desc + (4 * j + 2) * 8);
            wg_commit();
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < NT / 2; i++) wg_pin(acc[i]);
    cp_async_wait<0>(); /* nothing may be in flight into shared memory at exit */
    wide_store<NT>(js, job, acc, (tile0 + warp) * 16, tok0, nt_live, n, part);
#endif
}

/* Products of 65 to 256 tokens: groups of 128 tokens (wgmma m64n128k16), blocks of 4
 * warpgroups (256 rows). The copy engine brings each chunk, described by tensor maps: the 16 tiles' codes and scales (tiles
 * past the matrix: zeros) and the inputs, boxes of 64 columns x 128 tokens (tokens
 * past n: zeros) stored with the 128-byte swizzle that wgmma reads them by (boxes 16
 * bytes wide, unswizzled, left the copy engine the bottleneck). So no thread spends
 * instructions or registers on copies, and no block waits for all of its warps each
 * chunk: warps wait for a chunk's bytes on its stage's "full" barrier and hand the
 * stage back on its "empty" barrier once their products have read it; thread 0 starts
 * the copies D chunks ahead (clusters of two blocks sharing the inputs by multicast
 * were slower: docs/cuda-performance.md). */
#define W128_STAGES 4
#define W128_AHEAD 2 /* chunks copied ahead of the one computed */

struct wide_maps {
    CUtensorMap x, codes[CUK_MATVEC_JOBS], scales[CUK_MATVEC_JOBS];
};

/* A K-major B operand stored with the 128-byte swizzle: 8-token atoms of 1,024 bytes. */
static __device__ __forceinline__ uint64_t wg_desc_sw128(uint32_t smem) {
    return (uint64_t)((smem & 0x3FFFF) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

template <uint32_t T>
__global__ void __launch_bounds__(512, 1)
    matmul_wide128(const wide_set js, const __grid_constant__ wide_maps maps, int n, float *part,
                   int chunks_per_split) {
    griddep_release();
#if KVQ_WGMMA
    constexpr int NT = 128, S = W128_STAGES, D = W128_AHEAD;
    using SH = wide_shape<T, NT, 4>;
    constexpr uint32_t BYTES = SH::STAGE; /* a chunk's copies into a block: codes, scales, inputs */
    constexpr int BOXES = SH::SPAN / 64;  /* input boxes of a chunk */
    static_assert(SH::CODES % 1024 == 0 && SH::SCALES % 1024 == 0 && SH::STAGE % 1024 == 0, "swizzled boxes");
    extern __shared__ __align__(1024) uint8_t sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int job = (int)blockIdx.x >= js.x0[1] ? ((int)blockIdx.x >= js.x0[2] ? 2 : 1) : 0;
    const int64_t K = js.cols, nch = chunks_of(T, K);
    const int tile0 = ((int)blockIdx.x - WIDE_OF(js, x0, job)) * SH::TILES;
    const int tok0 = blockIdx.y * NT, nt_live = min(NT, n - tok0);
    const int c0 = (int)blockIdx.z * chunks_per_split;
    const int nc = (int)min(nch - c0, (int64_t)chunks_per_split);
    const uint32_t sm_at = smem_addr(sm), full0 = sm_at + S * SH::STAGE, empty0 = full0 + 8 * S;
    const CUtensorMap *cmap = job == 0 ? &maps.codes[0] : job == 1 ? &maps.codes[1] : &maps.codes[2];
    const CUtensorMap *smap = job == 0 ? &maps.scales[0] : job == 1 ? &maps.scales[1] : &maps.scales[2];

    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 16);
        mbar_init_fence();
    }
    __syncthreads();

    /* thread 0: chunk u's codes and scales (before griddep_wait: no kernel writes them), then its inputs */
    auto copy_weights = [&](int u) {
        const uint32_t b = sm_at + u % S * SH::STAGE, bar = full0 + 8 * (u % S);
        mbar_expect(bar, BYTES);
        bulk_box3(b, cmap, 0, c0 + u, tile0, bar);
        bulk_box3(b + SH::CODES, smap, 0, c0 + u, tile0, bar);
    };
    auto copy_inputs = [&](int u) {
        const uint32_t b = sm_at + u % S * SH::STAGE + SH::CODES + SH::SCALES, bar = full0 + 8 * (u % S);
#pragma unroll
        for (int h = 0; h < BOXES; h++)
            bulk_box(b + h * 16384, &maps.x, (c0 + u) * SH::SPAN + h * 64, tok0, bar);
    };
    if (threadIdx.x == 0)
        for (int u = 0; u < D && u < nc; u++) copy_weights(u);
    griddep_wait();
    if (threadIdx.x == 0)
        for (int u = 0; u < D && u < nc; u++) copy_inputs(u);

    float acc[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; i++) acc[i] = 0.0f;
    static_assert(SH::BPC % 2 == 0, "a chunk's blocks alternate between the two sets");
    uint32_t a[2][2][4] = {};
    for (int u = 0; u < nc; u++) {
        if (threadIdx.x == 0 && u + D < nc) { /* its stage, once every warp is done with chunk u + D - S */
            const int v = u + D;
            if (v >= S) mbar_wait(empty0 + 8 * (v % S), (uint32_t)(v / S + 1) & 1u);
            copy_weights(v);
            copy_inputs(v);
        }
        mbar_wait(full0 + 8 * (u % S), (uint32_t)(u / S) & 1u);
        const uint8_t *b = sm + u % S * SH::STAGE;
        const uint16_t *sc = (const uint16_t *)(b + SH::CODES) + (warp * 16 + g) * SH::SE;
        const uint8_t *w = b + warp * 1024 + lane * 16;
        const uint64_t desc = wg_desc_sw128(smem_addr(b + SH::CODES + SH::SCALES));
#pragma unroll
        for (int j = 0; j < SH::BPC; j++) {
            wg_wait<1>(); /* the products of block j - 2 are done */
            if (j == 1) { /* and so every product of chunk u - 1: its stage is free (lane 0 says so) */
                __syncwarp();
                const uint32_t bar = empty0 + 8 * ((u + S - 1) % S), on = (lane == 0) & (u > 0);
                mbar_arrive(bar, on);
            }
#pragma unroll
            for (int r = 0; r < 8; r++) wg_keep(a[j % 2][r / 4][r % 4]);
            a_frags<T>(block_frag<T, SH::SE>(w, sc, j), j, t, a[j % 2]);
            wg_fence();
            /* block j's columns: box j / 2, bytes 64 (j % 2).. of each token's 128 */
            const uint64_t dj = desc + (uint64_t)(j / 2 * (16384 >> 4) + j % 2 * (64 >> 4));
            wgmma_f16<NT>(acc, a[j % 2][0], dj);
            wgmma_f16<NT>(acc, a[j % 2][1], dj + (32 >> 4));
            wg_commit();
        }
    }
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < NT / 2; i++) wg_pin(acc[i]);
    wide_store<NT>(js, job, acc, (int64_t)(tile0 + warp) * 16, tok0, nt_live, n, part);
#endif
}

/* y[tok][row] = the splits' partial sums in split order (+ bias), each job's (jobs
 * past n_jobs have no rows). */
__global__ void wide_reduce(const cuk_wide_pending p) {
    griddep_release();
    griddep_wait();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t n0 = (int64_t)p.n * p.rows[0], n1 = (int64_t)p.n * p.rows[1];
    if (i >= n0 + n1 + (int64_t)p.n * p.rows[2]) return;
    const int j = i >= n0 + n1 ? 2 : i >= n0 ? 1 : 0;
    i -= j == 2 ? n0 + n1 : j == 1 ? n0 : 0;
    const int64_t rows = WIDE_OF(p, rows, j);
    const float *bias = WIDE_OF(p, bias, j);
    const float s = split_sum(WIDE_OF(p, part, j), (int64_t)p.n * rows, p.splits, i);
    WIDE_OF(p, y, j)[i / rows * WIDE_OF(p, y_stride, j) + i % rows] = s + (bias ? bias[i % rows] : 0.0f);
}

/* Token groups of a launch: 16, 32 or 64 tokens. */
static int wide_tokens(int n) { return n <= 16 ? 16 : n <= 32 ? 32 : n <= 64 ? 64 : 128; } /* 128: matmul_wide128 */


#define WIDE_WG 4     /* warpgroups a block: 256 rows */
#define WIDE_STAGES 4 /* chunks in shared memory: one computed, one still read, two in flight */

/* The chunks' splits of a launch of bx blocks of rows (rows in all, nch chunks a row)
 * with groups of nt tokens: the count whose time is least, estimated as the chunks of
 * the block slots that run the most (whole waves of resident blocks, wide_per_sm) plus
 * the partial sums that splits write and the next operation reads, 4 bytes a row and
 * token each way: at 64 tokens these can outweigh the weights (docs/cuda-performance.md).
 * Splits are at least 4 chunks long, so that the copies ahead have room, and equal.
 * They depend on the weights' shape and the token group, not on n: a token's sums are
 * the same bits whatever the step's tokens within one group size. */
static int wide_splits(int64_t bx, int64_t nch, int64_t rows, int nt, uint32_t type, int n_sm) {
    const int64_t resident = (int64_t)n_sm * wide_per_sm(nt);
    const double chunk = (double)(WIDE_WG * 4) * (1024 + 32 * CUK_SCALE_ENTRIES(type)); /* a block's chunk, bytes */
    int64_t splits = 1;
    double best = INFINITY;
    for (int64_t s = 1; s == 1 || s <= nch / 4; s++) {
        const int64_t per = (nch + s - 1) / s, waves = (bx * s + resident - 1) / resident;
        if ((nch + per - 1) / per != s) continue; /* the same splits as a smaller count */
        const double bytes = (double)(waves * per) * chunk * (double)resident + (s > 1 ? 8.0 * s * nt * rows : 0.0);
        if (bytes < best) best = bytes, splits = s;
    }
    return (int)splits;
}

/* The set of a launch's jobs (one type and width, at most CUK_MATVEC_JOBS), its
 * splits, and its scratch in floats. */
static wide_set wide_set_of(const cuk_matvec_job *jobs, int n_jobs, int n, int n_sm, int *splits, size_t *floats) {
    wide_set js = {};
    const int64_t cols = jobs[0].w->cols, nch = chunks_of(jobs[0].w->type, cols);
    int bx = 0;
    int64_t rows = 0;
    for (int j = 0; j < n_jobs; j++) {
        const cuk_weight *w = jobs[j].w;
        js.data[j] = w->data, js.scales[j] = w->scales, js.rows[j] = w->rows;
        js.y[j] = jobs[j].y, js.bias[j] = jobs[j].bias, js.y_stride[j] = jobs[j].y_stride ? jobs[j].y_stride : w->rows;
        js.x0[j] = bx;
        bx += (int)((w->rows + 16 * 4 * WIDE_WG - 1) / (16 * 4 * WIDE_WG));
        rows += w->rows;
    }
    for (int j = n_jobs; j < CUK_MATVEC_JOBS; j++) js.x0[j] = INT_MAX; /* no block's */
    js.x0[CUK_MATVEC_JOBS] = bx;
    js.cols = cols;
    *splits = wide_splits(bx, nch, rows, wide_tokens(n), jobs[0].w->type, n_sm);
    for (int j = 0, at = 0; j <= CUK_MATVEC_JOBS; j++) {
        js.part_at[j] = *splits > 1 ? (int64_t)*splits * n * at : 0;
        if (j < n_jobs) at += (int)js.rows[j];
    }
    *floats = *splits > 1 ? (size_t)*splits * (size_t)n * (size_t)rows : 0;
    return js;
}

template <uint32_t T, int NT>
static void wide_launch(cuk_queue *qu, const wide_set &js, int splits, const void *xp, int n, float *part) {
    using SH = wide_shape<T, NT, WIDE_WG>;
    const size_t smem = (size_t)WIDE_STAGES * SH::STAGE;
    static unsigned sized;
    if (cuk_first_on_device(&sized)) {
        cudaFuncSetAttribute(matmul_wide<T, NT, WIDE_WG, WIDE_STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)smem);
        cudaFuncSetAttribute(matmul_wide<T, NT, WIDE_WG, WIDE_STAGES>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
    }
    const int64_t nch = chunks_of(T, js.cols), per = (nch + splits - 1) / splits;
    const dim3 grid((unsigned)js.x0[CUK_MATVEC_JOBS], (unsigned)((n + NT - 1) / NT), (unsigned)splits);
    pdl_launch_smem(matmul_wide<T, NT, WIDE_WG, WIDE_STAGES>, grid, dim3(SH::THREADS), smem, qu, js,
                    (const __half *)xp, n, part, (int)per);
}

/* The driver's tensor-map encoder, looked up once (NULL: none). */
static PFN_cuTensorMapEncodeTiled_v12000 tmap_encoder(void) {
    static const PFN_cuTensorMapEncodeTiled_v12000 f = [] {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            p = NULL;
        return (PFN_cuTensorMapEncodeTiled_v12000)p;
    }();
    return f;
}

/* A tensor map of dims[0..rank) elements of `type` (strides in bytes from dimension 1
 * on), copied in boxes of box[]. */
static void tmap(CUtensorMap *m, CUtensorMapDataType type, int rank, const void *at, const cuuint64_t *dims,
                 const cuuint64_t *strides, const cuuint32_t *box, CUtensorMapSwizzle swizzle) {
    const cuuint32_t one[3] = {1, 1, 1};
    tmap_encoder()(m, type, (cuuint32_t)rank, (void *)at, dims, strides, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

template <uint32_t T>
static void wide128_launch(cuk_queue *qu, const wide_set &js, int splits, const void *xp, int n, float *part) {
    using SH = wide_shape<T, 128, 4>;
    const size_t smem = (size_t)W128_STAGES * SH::STAGE + 16 * W128_STAGES;
    static unsigned sized;
    if (cuk_first_on_device(&sized))
        cudaFuncSetAttribute(matmul_wide128<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    wide_maps maps;
    memset(&maps, 0, sizeof maps);
    const cuuint64_t K = (cuuint64_t)js.cols, nch = (cuuint64_t)chunks_of(T, js.cols);
    {
        const cuuint64_t dims[2] = {K, (cuuint64_t)n}, strides[1] = {K * 2};
        const cuuint32_t box[2] = {64, 128};
        tmap(&maps.x, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, xp, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
    }
    for (int j = 0; j < CUK_MATVEC_JOBS && js.x0[j] != INT_MAX; j++) {
        const cuuint64_t tiles = (cuuint64_t)(js.rows[j] + 15) / 16, se = (cuuint64_t)SH::SE;
        const cuuint64_t cd[3] = {128, nch, tiles}, cs[2] = {1024, nch * 1024};
        const cuuint64_t sd[3] = {16 * se, nch, tiles}, ss[2] = {32 * se, nch * 32 * se};
        const cuuint32_t cb[3] = {128, 1, 16}, sb[3] = {(cuuint32_t)(16 * se), 1, 16};
        tmap(&maps.codes[j], CU_TENSOR_MAP_DATA_TYPE_UINT64, 3, js.data[j], cd, cs, cb, CU_TENSOR_MAP_SWIZZLE_NONE);
        tmap(&maps.scales[j], CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, js.scales[j], sd, ss, sb, CU_TENSOR_MAP_SWIZZLE_NONE);
    }
    const int64_t per = ((int64_t)nch + splits - 1) / splits;
    const dim3 grid((unsigned)js.x0[CUK_MATVEC_JOBS], (unsigned)((n + 127) / 128), (unsigned)splits);
    pdl_launch_smem(matmul_wide128<T>, grid, dim3(512), smem, qu, js, maps, n, part, (int)per);
}

extern "C" size_t cuk_matmul_wide_scratch(const cuk_matvec_job *jobs, int n_jobs, int n, int n_sm) {
    int splits;
    size_t floats;
    wide_set_of(jobs, n_jobs, n, n_sm, &splits, &floats);
    return floats;
}

extern "C" void cuk_wide_settle(cuk_queue *qu, const cuk_wide_pending *p) {
    const int64_t total = (int64_t)p->n * (p->rows[0] + p->rows[1] + p->rows[2]);
    pdl_launch(wide_reduce, dim3((unsigned)((total + 255) / 256)), dim3(256), qu, *p);
}

extern "C" void cuk_matmul_wide(cuk_queue *qu, const cuk_matvec_job *jobs, int n_jobs, const void *xp, int n,
                                float *scratch, int n_sm, cuk_wide_pending *pend) {
    int splits;
    size_t floats;
    const wide_set js = wide_set_of(jobs, n_jobs, n, n_sm, &splits, &floats);
    cuk_wide_pending sums = {};
    if (splits > 1) {
        sums.n_jobs = n_jobs, sums.n = n, sums.splits = splits;
        for (int j = 0; j < n_jobs; j++) {
            sums.y[j] = js.y[j], sums.part[j] = scratch + js.part_at[j], sums.bias[j] = js.bias[j];
            sums.rows[j] = js.rows[j], sums.y_stride[j] = js.y_stride[j];
        }
    }
#define WIDE_BY_TOKENS(TT)                                                      \
    if (n > 64) wide128_launch<TT>(qu, js, splits, xp, n, scratch);                 \
    else if (wide_tokens(n) == 16) wide_launch<TT, 16>(qu, js, splits, xp, n, scratch);      \
    else if (wide_tokens(n) == 32) wide_launch<TT, 32>(qu, js, splits, xp, n, scratch); \
    else wide_launch<TT, 64>(qu, js, splits, xp, n, scratch)
    switch (jobs[0].w->type) {
    case KVQ_Q4_0: WIDE_BY_TOKENS(KVQ_Q4_0); break;
    case KVQ_Q8_0: WIDE_BY_TOKENS(KVQ_Q8_0); break;
    case KVQ_Q4_K: WIDE_BY_TOKENS(KVQ_Q4_K); break;
    case KVQ_Q6_K: WIDE_BY_TOKENS(KVQ_Q6_K); break;
    default: break; /* callers take this path for cuk_repacked types only */
    }
#undef WIDE_BY_TOKENS
    if (pend) *pend = sums;
    else if (sums.splits > 1) cuk_wide_settle(qu, &sums);
}

__global__ void wide_probe(int *has) { *has = KVQ_WGMMA; }

extern "C" int cuk_wide_available(void) {
    int *d = NULL, has = 0;
    if (cudaMalloc((void **)&d, sizeof(int)) != cudaSuccess) return 0;
    wide_probe<<<1, 1>>>(d);
    if (cudaMemcpy(&has, d, sizeof(int), cudaMemcpyDeviceToHost) != cudaSuccess) has = 0;
    cudaFree(d);
    cudaGetLastError(); /* a device without a kernel image for the probe says no */
    return has && tmap_encoder(); /* the 65-256-token kernel's copies need tensor maps */
}
