/* Attention on tensor cores over the paged cache, for the common row formats (keys
 * and values of 4, 8 or 16 bits, or normal-float K5V4, K4V4, K4V3 and K3V2, head size 64, 128 or
 * 256, up to 8 query heads per KV head); attention.cu's kernel takes the rest. A token's query heads take R =
 * cuk_attn_tile_rows() rows of the m16 tiles, those past the model's group idle.
 *
 * A block takes one group of query tokens (a decode token, or up to 32 consecutive
 * tokens of a prefill chunk) with the query heads of one KV head, and one split of the
 * rows they read, in tiles of 64 rows: a KV block of packed rows, or up to 64 f16
 * window and sink rows. Each tile is decoded once into shared memory as f16: packed
 * codes are small integers, exact in f16, with each row's group scales and biases
 * beside them, so Q K^T and P V run on mma.m16n8k16 and the affine parts are applied
 * per group in f32 (score = sum_g scale_g (q . codes_g) + bias_g sum(q_g)). Queries
 * and softmax weights enter the products split into an f16 high part and the f16 of
 * the remainder (rows 0-7 and 8-15 of the m16 tile), scaled by powers of two into
 * f16's normal range, so the results carry f32-like precision. The next tile's rows
 * are read from device memory while the current one is computed. A 4-bit side's
 * dimensions sit in shared memory in nibble_pos() order, which its codes convert to
 * in fewer instructions; queries (keys) and outputs (values) follow that order.
 *
 * Decode: the 4 warps share the token's rows (query heads) and split each tile's
 * keys, then merge. Prefill: each warp (8 a block, tile_threads) takes its own query
 * tokens and all keys, so a tile read serves the whole group. Head size 256: in both,
 * the 4 warps share the rows and split the dimensions (WD below), so a prefill chunk
 * holds one warp's tokens.
 * Masks (causality, the ranges of the plan, sliding and rotating windows) are per
 * query token. Results go out as attention.cu's partials. The kernels of head size
 * 256 are compiled in attention_tile_256.cu, the others in attention_tile.cu. */
#ifndef KVQ_BACKEND_CUDA_ATTENTION_TILE_CUH
#define KVQ_BACKEND_CUDA_ATTENTION_TILE_CUH

#include <cuda_fp16.h>
#include <math.h>

#include <type_traits>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/nf_rows.cuh"
extern "C" {
#include "kernels/kv_quant.h"
}

#define TILE 64
#define TILE_THREADS 128 /* a decode block's threads (and the fewest of any block) */
#define Q_SCALE 256.0f /* queries times this in f16 (back out of the scores) */
/* A row's running maximum moves only where a tile's scores pass it by more than
 * RESCALE_SLACK (or it is the first): most tiles then skip rescaling the outputs, and
 * the softmax weights stay below e^RESCALE_SLACK = 8, so P_SCALE is 8 times smaller than
 * with weights below 1: a weight times its value scale times P_SCALE stays as large. */
#define RESCALE_SLACK 2.0794415f /* ln 8 */
#define P_SCALE 512.0f           /* softmax weights times value scales times this in f16 */

static __device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

static __device__ __forceinline__ void ldsm4_t(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

static __device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *(const uint32_t *)&h; }

/* (x, y) as f16 pairs hi and lo with hi + lo = (x, y) to about 2^-22. */
static __device__ __forceinline__ void split_h2(float x, float y, uint32_t &hi, uint32_t &lo) {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 f = __half22float2(h);
    hi = h2_bits(h);
    lo = h2_bits(__floats2half2_rn(x - f.x, y - f.y));
}

/* Codes 0..255 in the bytes of w, two at a time, as f16 pairs: 0x64XX is 1024 + XX. */
static __device__ __forceinline__ uint32_t bytes_to_h2(uint32_t w, uint32_t sel) {
    const uint32_t v = __byte_perm(w, 0x64646464u, sel);
    return h2_bits(__hsub2(*(const __half2 *)&v, __half2half2(__ushort_as_half(0x6400))));
}

/* Where a 4-bit side keeps dimension d of a unit of 8 in shared memory: codes 0,4,1,5,
 * 2,6,3,7 of the unit, in that order (codes_to_h8), so position p holds dimension
 * p / 2 + 4 (p % 2). The order lies within each unit of 8, so groups and k-steps
 * keep their dimensions. */
static __device__ __forceinline__ int nibble_pos(int d) { return (d & ~7) | (d & 3) << 1 | (d >> 2 & 1); }

/* (x & mask) | 0x64006400: f16 pairs 1024 + the masked bits, one instruction. */
static __device__ __forceinline__ uint32_t f16_of_bits(uint32_t x, uint32_t mask) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, 0x64006400, 0xEA;" : "=r"(r) : "r"(x), "r"(mask));
    return r;
}

/* 8 codes of `BITS` (the raw bytes of one unit) as 4 f16 pairs: in order for 8 bits,
 * in nibble_pos order for 4 (nibbles low first, so bits 0-3 and 16-19 are codes 0
 * and 4, bits 4-7 and 20-23 codes 1 and 5 times 16). */
template <int BITS>
static __device__ __forceinline__ uint4 codes_to_h8(uint2 raw) {
    if (BITS == 8)
        return make_uint4(bytes_to_h2(raw.x, 0x5140), bytes_to_h2(raw.x, 0x5342), bytes_to_h2(raw.y, 0x5140),
                          bytes_to_h2(raw.y, 0x5342));
    const __half2 k1024 = __half2half2(__ushort_as_half(0x6400)), sixteenth = __half2half2(__ushort_as_half(0x2C00)),
                  minus64 = __half2half2(__ushort_as_half(0xD400)); /* (1024 + 16 c) / 16 - 64 = c */
    const uint32_t x = raw.x, y = x >> 8, a = f16_of_bits(x, 0x000F000Fu), b = f16_of_bits(x, 0x00F000F0u),
                   c = f16_of_bits(y, 0x000F000Fu), d = f16_of_bits(y, 0x00F000F0u);
    return make_uint4(h2_bits(__hsub2(*(const __half2 *)&a, k1024)), h2_bits(__hfma2(*(const __half2 *)&b, sixteenth, minus64)),
                      h2_bits(__hsub2(*(const __half2 *)&c, k1024)), h2_bits(__hfma2(*(const __half2 *)&d, sixteenth, minus64)));
}

/* 8 f16 values of a row put into nibble_pos order. */
static __device__ __forceinline__ void to_nibble_order(__half *p) {
    const uint4 w = *(const uint4 *)p;
    *(uint4 *)p = make_uint4(__byte_perm(w.x, w.z, 0x5410), __byte_perm(w.x, w.z, 0x7632), __byte_perm(w.y, w.w, 0x5410),
                             __byte_perm(w.y, w.w, 0x7632));
}

/* What the block's query tokens read, together: packed rows of positions [a1, b1]
 * and [a2, b2], f16 sink rows [0, sinks) and window rows [ws, q_max]; as tiles. */
struct tile_plan {
    int32_t a1, b1, a2, b2, sinks, ws, q_max;
    int t1, t2, tw; /* tiles of each part */
    int32_t fresh;  /* the step's first row (cuk_attn_tok) */
};

/* Where tile i of a plan comes from: kind 0, a packed block at hb (its rows p0 ..
 * p0 + TILE - 1, of which positions [lo, hi] are read); kind 1, window entries p0 ..
 * (entries [lo, hi] exist). */
struct tile_at {
    int kind;
    const uint8_t *hb;
    int32_t p0, lo, hi;
};

static __device__ __forceinline__ int tiles_of(int32_t a, int32_t b) { return a <= b ? b / TILE - a / TILE + 1 : 0; }

/* Threads of a block: a prefill chunk of head size up to 128 takes 8 warps, each of its
 * own query tokens, where the chunk stays within 32 tokens (query heads filling at least
 * 2 rows), so that each tile read and converted serves twice the tokens; the others 4. */
template <int D, int G, bool PREFILL>
static __host__ __device__ constexpr int tile_threads() {
    return PREFILL && D <= 128 && G != 1 ? 2 * TILE_THREADS : TILE_THREADS;
}

/* Shared memory of one stage: keys and values as f16 [TILE][D + 8] (the padding keeps
 * ldmatrix free of bank conflicts), then (scale, bias) per row and group. */
template <int D>
static __host__ __device__ constexpr size_t stage_halves() {
    return (size_t)2 * TILE * (D + 8);
}

/* Stages of shared memory a block cycles through: two, so that the next tile loads
 * while one is computed; for head size 256 one (the next tile's packed codes still
 * load into registers during the computation), so that two blocks fit a
 * multiprocessor; for normal-float rows (GS < 0) one too (their next tile's rows load
 * into shared memory of their own during the computation), so that three do. */
template <int D, int GS>
static __host__ __device__ constexpr int n_stages() {
    return D > 128 || GS < 0 ? 1 : 2;
}

/* kern_kvq_row_bytes at compile time (attn_tile_takes checks they agree); GS
 * KERN_KVQ_NF: a normal-float row, its scale byte after the codes. */
template <int D, int BITS, int GS>
static __host__ __device__ constexpr size_t row_bytes() {
    return (size_t)D * BITS / 8 + (BITS < 16 ? (GS < 0 ? 1 : 4 * (size_t)(D / GS)) : 0);
}

/* A packed side's groups a row: one for normal-float rows (scale s, bias -127.5 s over
 * the level bytes), none for f16. */
template <int D, int BITS, int GS>
static __host__ __device__ constexpr int groups_of() {
    return BITS < 16 ? D / (GS < 0 ? D : GS) : 1;
}

/* Raw blocks of normal-float rows in flight: tile i + nf_ring() - 1 is read while tile i
 * is computed. Three, not two, for head sizes up to 128: 4,3:nf decodes 1.5% faster at
 * 32K rows, four gain nothing more (docs/kv-formats.md); one more block of head size
 * 256 would leave one block a multiprocessor instead of two. */
template <int D>
static __host__ __device__ constexpr int nf_ring() {
    return D > 128 ? 2 : 3;
}
/* Shared memory of normal-float rows, after the stages and the partial scores: the
 * ring's blocks of rows as they are (HEAD bytes each, with room for the word after the
 * last row's codes), then the 256 scales of the scale bytes, then for 5-bit keys their
 * 32 level bytes as f16 (nf_level_h8_5). */
template <int D, int KB, int VB, int GS>
static __host__ __device__ constexpr size_t raw_bytes() {
    constexpr size_t block = (size_t)TILE * (row_bytes<D, KB, GS>() + row_bytes<D, VB, GS>());
    return GS < 0 ? nf_ring<D>() * block + 16 + 256 * sizeof(float) + (KB == 5 ? 32 * sizeof(__half) : 0) : 0;
}

/* 8 level bytes (nf_level_bytes) as 4 f16 pairs, in order. */
static __device__ __forceinline__ uint4 bytes8_to_h8(uint2 b) {
    return make_uint4(bytes_to_h2(b.x, 0x5140), bytes_to_h2(b.x, 0x5342), bytes_to_h2(b.y, 0x5140),
                      bytes_to_h2(b.y, 0x5342));
}

/* 8 codes of 5 bits (lo: bits 0-31 of the unit's 40, hi: bits 32-39) as the f16 of
 * their level bytes, in order, from the 32 levels in shared memory (16 words in 16
 * banks: a warp's lookups never conflict). */
static __device__ __forceinline__ uint4 nf_level_h8_5(uint32_t lo, uint32_t hi, const __half *levels) {
    const uint32_t c[8] = {lo & 31, lo >> 5 & 31, lo >> 10 & 31, lo >> 15 & 31, lo >> 20 & 31, lo >> 25 & 31,
                           (lo >> 30 | hi << 2) & 31, hi >> 3 & 31};
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = h2_bits(__halves2half2(levels[c[2 * i]], levels[c[2 * i + 1]]));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* GS: the group size of the packed sides (D for f16; KERN_KVQ_NF: normal-float rows,
 * whose level bytes go to shared memory as the codes of a group of D), so every index
 * into the per-thread arrays is a constant and they stay in registers. G: query heads a KV
 * head, 1, 2, 4 or 8 (R = G, no idle rows), or 0 for the others (3, 5, 6, 7:
 * R = 8, the group read from a). */
template <int D, int KB, int VB, int GS, int G, bool PREFILL>
__global__ void __launch_bounds__(tile_threads<D, G, PREFILL>()) attn_tile(const cuk_attn_args a, int n_splits, bool prepped) {
    griddep_release();
    extern __shared__ __align__(16) uint8_t smem[];
    /* WD: head size 256, whose accumulators would not fit a thread's registers: the
     * warps split the dimensions (DW each) instead of the keys or the query tokens.
     * Each warp's partial scores of all 64 keys are summed through shared memory, every
     * warp then runs the same softmax, and P V gives each warp its own DW outputs. */
    constexpr bool WD = D > 128;
    constexpr int TT = tile_threads<D, G, PREFILL>();
    static_assert(PREFILL || TT == TILE_THREADS, "a decode block's warps merge 4 ways");
    constexpr int DW = WD ? D / 4 : D, R = G > 0 ? G : 8, LD = D + 8, QW = 8 / R;
    constexpr int NTI = PREFILL || WD ? 8 : 2, KS = PREFILL || WD ? 4 : 1;
    constexpr bool NF = GS < 0;
    constexpr bool KN = KB == 4 && !NF, VN = VB == 4 && !NF; /* sides in nibble_pos order */
    constexpr int KU = TILE * D / 8 / TT; /* units of 8 values per thread and side */
    constexpr int NST = n_stages<D, GS>(), NR = nf_ring<D>();
    constexpr int nkg = groups_of<D, KB, GS>(), nvg = groups_of<D, VB, GS>(), KG = D / nkg, VG = D / nvg;
    /* a warp's dimensions [dw0, dw0 + DW) in groups of KGW (VGW), at most a group */
    constexpr int KGW = KG < DW ? KG : DW, VGW = VG < DW ? VG : DW;
    /* (scale, bias) words a thread stages per side */
    constexpr int NG = nkg > nvg ? nkg : nvg, NP = TILE * NG > 2 * TT ? TILE * NG / TT : 2;
    /* row bytes of a block's sides (kv_quant.h), so the tile's addressing is constant */
    constexpr size_t KROW = row_bytes<D, KB, GS>(), VROW = row_bytes<D, VB, GS>(), HEAD = TILE * (KROW + VROW);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, dw0 = WD ? warp * DW : 0;
    /* Row and column of a thread's k-th item of a tile whose rows hold n of them
     * (units of 8 packed values, n = D / 8; (scale, bias) words, n = groups). Head
     * size 256 steps the row by a constant from the thread's first item, so that
     * addresses are constant offsets: found per item by signed divisions, its packed
     * kernels took 255 registers with spills and 37% more instructions than f16's.
     * For 64 and 128 that freed registers (255 -> 210), K8V4 steps at 16K rows ran
     * 3% slower (the next kernels' blocks, probably, beside the decode tiles); they
     * keep the divisions (docs). */
    static_assert(!WD || (TT % (D / 8) == 0 && TT % NG == 0),
                  "a thread's items lie a constant row step apart");
    auto item_at = [&](int k, int n, int &r, int &c) {
        if (WD) {
            r = threadIdx.x / n + k * (TT / n), c = threadIdx.x % n;
        } else {
            const int u = threadIdx.x + k * TT;
            r = u / n, c = u % n;
        }
    };
    /* A prefill chunk's later groups read more rows (causality): they go first, so that
     * the longest blocks start in the first wave and the short ones fill the last */
    const int item = PREFILL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int kvh = item % a.n_kv;
    const cuk_attn_group grp = a.groups[item / a.n_kv];
    const size_t stage_bytes = stage_halves<D>() * 2 + (size_t)TILE * (nkg + nvg) * sizeof(float2);
    __shared__ tile_plan sp;
    __shared__ uint64_t s_table, s_fresh_block, s_ring, s_sink, s_blk[2];
    __shared__ int32_t s_nkb, s_base, s_ring_cap, s_sink_cap;

    /* the group's rows, together (warp 0: a lane per token). The plans are staged step
     * data, uploaded before any kernel of the step runs: read before the wait */
    if (warp == 0) {
        const bool on = lane < grp.nt;
        const cuk_attn_tok tk = a.toks[grp.t0 + (on ? lane : 0)];
        int32_t a1 = on && tk.a1 <= tk.b1 ? tk.a1 : INT32_MAX, b1 = on && tk.a1 <= tk.b1 ? tk.b1 : -1;
        int32_t a2 = on && tk.a2 <= tk.b2 ? tk.a2 : INT32_MAX, b2 = on && tk.a2 <= tk.b2 ? tk.b2 : -1;
        const bool win = on && tk.ws <= tk.q_pos; /* a token's window rows [ws, q] may be none */
        int32_t sn = on ? tk.sinks : 0, ws = win ? tk.ws : INT32_MAX, qm = win ? tk.q_pos : -1;
        int32_t fr = on ? tk.fresh : INT32_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            a1 = min(a1, __shfl_xor_sync(0xffffffffu, a1, o)), b1 = max(b1, __shfl_xor_sync(0xffffffffu, b1, o));
            a2 = min(a2, __shfl_xor_sync(0xffffffffu, a2, o)), b2 = max(b2, __shfl_xor_sync(0xffffffffu, b2, o));
            sn = max(sn, __shfl_xor_sync(0xffffffffu, sn, o)), ws = min(ws, __shfl_xor_sync(0xffffffffu, ws, o));
            qm = max(qm, __shfl_xor_sync(0xffffffffu, qm, o));
            fr = min(fr, __shfl_xor_sync(0xffffffffu, fr, o));
        }
        if (lane == 0) {
            if (qm < 0) ws = 0; /* no window rows */
            const int nw = sn + max(0, qm - ws + 1);
            sp = tile_plan{a1, b1, a2, b2, sn, ws, qm, tiles_of(a1, b1), tiles_of(a2, b2), (nw + TILE - 1) / TILE, fr};
            s_table = tk.table, s_fresh_block = tk.fresh_block, s_ring = tk.ring, s_sink = tk.sink;
            s_nkb = tk.nkb, s_base = tk.base, s_ring_cap = tk.ring_cap, s_sink_cap = tk.sink_cap;
        }
    }
    __syncthreads();
    const tile_plan P = sp;
    const int T = P.t1 + P.t2 + P.tw, per = (T + n_splits - 1) / n_splits, n_eff = (T + per - 1) / per;
    /* Decode where every split has rows: the blocks dispatched first take the last
     * tiles, the last split the fewest (the window's f16 rows). A K8V4 or K4V4 step at
     * 4096 rows took 0.5-0.9% less GPU time (H100, llama3-8b); probably because the
     * first blocks share their multiprocessors with more of the next launches' early
     * blocks (docs). Where some splits have none, those with rows stay first: reversed
     * there too, a step at 512 took 0.6-1.5% more. */
    const int split = !PREFILL && !WD && n_eff == n_splits ? n_splits - 1 - (int)blockIdx.y : (int)blockIdx.y;
    const int i0 = split * per, i1 = min(T, i0 + per);
    if (i0 >= i1) return;

    /* this thread's row: query qi of the warp, head hh (rows g hi, g + 8 lo) */
    const int group = G > 0 ? G : a.n_head / a.n_kv;
    const int qi = PREFILL && !WD ? warp * QW + g / R : g / R, hh = g % R, h = kvh * group + (hh < group ? hh : 0);
    const bool row_on = qi < grp.nt && hh < group;
    const int ti = grp.t0 + (row_on ? qi : 0);
    const cuk_attn_tok tk = a.toks[ti];
    /* q prepared (q.mu, then q scaled and rotated), or as it is (float keys without
     * rotation) */
    const float *prep = attn_qprep(a, ti, h);
    const float *qv = prepped ? prep + 1 : a.q + ((size_t)a.tok_index[ti] * a.n_head + h) * D;
    const float q_scale = prepped ? Q_SCALE : Q_SCALE * a.scale;
    float m = -INFINITY, l = 0, lp = 0, bsum[DW / 16], o_acc[DW / 8][4];
#pragma unroll
    for (int i = 0; i < DW / 16; i++) bsum[i] = 0;
#pragma unroll
    for (int i = 0; i < DW / 8; i++) o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0;

    /* staging of the next tile's packed rows (f16 rows go straight to shared memory) */
    uint2 rk[KU], rv[KU];
    uint32_t rkp[NP], rvp[NP]; /* (scale, bias) words */

    /* packed tile i's KV block (its index in the sequence) and that block's table entry */
    auto block_index = [&](int i) {
        const bool r1 = i < P.t1;
        return (r1 ? P.a1 : P.a2) / TILE + (r1 ? i : i - P.t1);
    };
    auto table_entry = [&](int32_t L) { return (const uint64_t *)s_table + (L < s_nkb ? L : L - s_base); };
    /* Thread 0 copies tile i's block address from the table into s_blk[i % 2] a tile
     * ahead: the copy completes at the loop's cp_async_wait_all and is seen after its
     * barrier, so no warp waits on a table read before it can ask for the tile's rows */
    auto prefetch_block = [&](int i) {
        if (threadIdx.x == 0 && i < i1 && i < P.t1 + P.t2 && block_index(i) != P.fresh / TILE)
            cp_async8(&s_blk[i % 2], table_entry(block_index(i)));
    };
    /* where tile i's rows are (tile_at): a packed tile's block read from the table
     * (FROM_TABLE) or from s_blk (FROM_PREFETCH), or left out (NO_BLOCK); the fresh
     * rows' block from the plan (its table entry may be the KV encode's, cuk_attn_tok) */
    enum { FROM_TABLE, FROM_PREFETCH, NO_BLOCK };
    auto tile_src = [&](int i, int block_from) {
        tile_at ts;
        if (i < P.t1 + P.t2) {
            const bool r1 = i < P.t1;
            const int32_t L = block_index(i);
            ts.lo = r1 ? P.a1 : P.a2, ts.hi = r1 ? P.b1 : P.b2;
            ts.kind = 0;
            ts.p0 = L * TILE;
            ts.hb = nullptr;
            if (block_from != NO_BLOCK) {
                const uint64_t blk = L == P.fresh / TILE ? s_fresh_block : block_from == FROM_TABLE ? *table_entry(L) : s_blk[i % 2];
                ts.hb = (const uint8_t *)blk + (size_t)kvh * HEAD;
            }
        } else {
            ts.kind = 1;
            ts.p0 = (i - P.t1 - P.t2) * TILE;
            ts.lo = 0, ts.hi = P.sinks + max(0, P.q_max - P.ws + 1) - 1; /* entries */
            ts.hb = nullptr;
        }
        return ts;
    };
    /* f16 rows (window entries, or a 16-bit side of a packed block) by cp.async; rows
     * outside [lo, hi] zeroed */
    auto load_f16 = [&](int kind, const uint8_t *hb, int32_t p0, int32_t lo, int32_t hi, __half *ks, __half *vs,
                        bool k16, bool v16) {
        for (int u = threadIdx.x; u < TILE * D / 8; u += TT) {
            const int r = u / (D / 8), c = u % (D / 8);
            const int32_t p = p0 + r;
            const bool in = p >= lo && p <= hi;
            const uint8_t *kr = nullptr, *vr = nullptr;
            if (in && kind == 1) {
                const bool sink = p < P.sinks;
                const int32_t pos = sink ? p : P.ws + (p - P.sinks);
                const int32_t cap = sink ? s_sink_cap : s_ring_cap, slot = sink ? pos : pos % cap;
                const uint8_t *base = (const uint8_t *)(sink ? s_sink : s_ring);
                kr = base + ((size_t)kvh * cap + slot) * a.win_row;
                vr = base + ((size_t)(a.n_kv + kvh) * cap + slot) * a.win_row;
            } else if (in) {
                kr = hb + (size_t)(p % TILE) * KROW;
                vr = hb + (size_t)TILE * KROW + (size_t)(p % TILE) * VROW;
            }
            if (k16) {
                if (in) cp_async16(ks + r * LD + c * 8, kr + c * 16);
                else *(uint4 *)(ks + r * LD + c * 8) = make_uint4(0, 0, 0, 0);
            }
            if (v16) {
                if (in) cp_async16(vs + r * LD + c * 8, vr + c * 16);
                else *(uint4 *)(vs + r * LD + c * 8) = make_uint4(0, 0, 0, 0);
            }
        }
    };
    /* packed sides of a block: raw codes and group words into registers (ALL: the tile
     * lies wholly in the range, as most of a long one do, so no row is checked) */
    auto fetch_uniform_rows = [&](auto all, const uint8_t *hb, int32_t p0, int32_t lo, int32_t hi) {
        constexpr bool ALL = decltype(all)::value;
        auto in_range = [&](int r) { return ALL || (p0 + r >= lo && p0 + r <= hi); };
#pragma unroll
        for (int k = 0; k < KU; k++) {
            int r, c;
            item_at(k, D / 8, r, c);
            const bool in = in_range(r);
            rk[k] = rv[k] = make_uint2(0, 0);
            if (KB == 8 && in) rk[k] = *(const uint2 *)(hb + (size_t)r * KROW + c * 8);
            if (KB == 4 && in) rk[k].x = *(const uint32_t *)(hb + (size_t)r * KROW + c * 4);
            const uint8_t *vrow = hb + (size_t)TILE * KROW + (size_t)r * VROW;
            if (VB == 8 && in) rv[k] = *(const uint2 *)(vrow + c * 8);
            if (VB == 4 && in) rv[k].x = *(const uint32_t *)(vrow + c * 4);
        }
#pragma unroll
        for (int k = 0; k < NP; k++) {
            const int u = threadIdx.x + k * TT;
            rkp[k] = rvp[k] = 0;
            if (KB < 16 && u < TILE * nkg) {
                int r, gk;
                item_at(k, nkg, r, gk);
                if (in_range(r)) rkp[k] = *(const uint32_t *)(hb + (size_t)r * KROW + D * KB / 8 + 4 * gk);
            }
            if (VB < 16 && u < TILE * nvg) {
                int r, gv;
                item_at(k, nvg, r, gv);
                if (in_range(r))
                    rvp[k] = *(const uint32_t *)(hb + (size_t)TILE * KROW + (size_t)r * VROW + D * VB / 8 + 4 * gv);
            }
        }
    };
    auto fetch_uniform = [&](const uint8_t *hb, int32_t p0, int32_t lo, int32_t hi) {
        if (lo <= p0 && p0 + TILE - 1 <= hi) fetch_uniform_rows(std::true_type{}, hb, p0, lo, hi);
        else fetch_uniform_rows(std::false_type{}, hb, p0, lo, hi);
    };
    auto store_uniform = [&](__half *ks, __half *vs, float2 *kp, float2 *vp) {
#pragma unroll
        for (int k = 0; k < KU; k++) {
            int r, c;
            item_at(k, D / 8, r, c);
            if (KB < 16) *(uint4 *)(ks + r * LD + c * 8) = codes_to_h8<KB>(rk[k]);
            if (VB < 16) *(uint4 *)(vs + r * LD + c * 8) = codes_to_h8<VB>(rv[k]);
        }
#pragma unroll
        for (int k = 0; k < NP; k++) {
            const int u = threadIdx.x + k * TT;
            const __half2 kw = *(const __half2 *)&rkp[k], vw = *(const __half2 *)&rvp[k];
            if (KB < 16 && u < TILE * nkg) kp[u] = __half22float2(kw);
            if (VB < 16 && u < TILE * nvg) vp[u] = __half22float2(vw);
        }
    };
    /* normal-float rows lie on any byte boundary: a block's rows as they are, by aligned
     * 16-byte copies into shared memory (raw), from where store_nf converts them */
    uint8_t *const raw = smem + NST * stage_bytes + (WD ? 4 * 8 * TILE * sizeof(float) : 0);
    auto fetch_nf = [&](const uint8_t *hb, int slot) {
        uint8_t *const to = raw + (size_t)slot * HEAD;
        for (int u = threadIdx.x; u < (int)(HEAD / 16); u += TT) cp_async16(to + 16 * u, hb + 16 * u);
    };
    float *const nf_scales = (float *)(raw + NR * HEAD + 16);
    __half *const nf_l5 = (__half *)(nf_scales + 256);
    /* every thread, after its copies and a barrier; rows outside the plan's range are
     * converted too (finite values, masked). Thread t takes units t % (D / 8) of rows
     * t / (D / 8) + k RS (as item_at): a row step of RS rows keeps each unit's offset
     * within its word, so one funnel shift serves every k. */
    auto store_nf = [&](__half *ks, __half *vs, float2 *kp, float2 *vp, int slot, bool all) {
        const uint8_t *const raw_s = raw + (size_t)slot * HEAD;
        constexpr int RS = TT / (D / 8);
        static_assert(RS * KROW % 4 == 0 && RS * VROW % 4 == 0 && KU * RS == TILE, "words a row step apart");
        const uint32_t c = threadIdx.x % (D / 8), r0 = threadIdx.x / (D / 8);
        const uint32_t ko = r0 * (uint32_t)KROW + c * KB, vo = (uint32_t)(TILE * KROW) + r0 * (uint32_t)VROW + c * VB;
        const uint32_t *kw = (const uint32_t *)(raw_s + (ko & ~3u)), *vw = (const uint32_t *)(raw_s + (vo & ~3u));
        if (all) cp_async_wait_all();
        else cp_async_wait<NR - 2>();
        __syncthreads();
#pragma unroll
        for (int k = 0; k < KU; k++) {
            const int r = r0 + k * RS, kk = k * RS * (int)KROW / 4, vk = k * RS * (int)VROW / 4;
            const uint32_t kx = __funnelshift_r(kw[kk], kw[kk + 1], 8 * (ko & 3u));
            const uint32_t vx = __funnelshift_r(vw[vk], vw[vk + 1], 8 * (vo & 3u));
            if constexpr (KB == 5) /* the unit's fifth byte lies in the second word (ko & 3 < 4) */
                *(uint4 *)(ks + r * LD + c * 8) = nf_level_h8_5(kx, kw[kk + 1] >> 8 * (ko & 3u) & 0xFFu, nf_l5);
            else *(uint4 *)(ks + r * LD + c * 8) = bytes8_to_h8(nf_level_bytes<KB>(kx));
            *(uint4 *)(vs + r * LD + c * 8) = bytes8_to_h8(nf_level_bytes<VB>(vx));
        }
        for (int r = threadIdx.x; r < TILE; r += TT) { /* (scale, bias) of each row's one group */
            const float sk = nf_scales[raw_s[r * KROW + D * KB / 8]];
            const float sv = nf_scales[raw_s[TILE * KROW + r * VROW + D * VB / 8]];
            kp[r] = make_float2(sk, -127.5f * sk);
            vp[r] = make_float2(sv, -127.5f * sv);
        }
    };
    auto fetch_packed = [&](const uint8_t *hb, int32_t p0, int32_t lo, int32_t hi, int slot) {
        if constexpr (NF) fetch_nf(hb, slot);
        else fetch_uniform(hb, p0, lo, hi);
    };
    /* called by every thread (store_nf has a barrier) */
    auto store_packed = [&](__half *ks, __half *vs, float2 *kp, float2 *vp, int slot, bool all) {
        if constexpr (NF) store_nf(ks, vs, kp, vp, slot, all);
        else store_uniform(ks, vs, kp, vp);
    };
    auto stage = [&](int s, __half *&ks, __half *&vs, float2 *&kp, float2 *&vp) {
        uint8_t *base = smem + (size_t)s * stage_bytes;
        ks = (__half *)base;
        vs = ks + TILE * LD;
        kp = (float2 *)(vs + TILE * LD);
        vp = kp + TILE * nkg;
    };
    /* tile ts into stage s: f16 parts by cp.async now; packed parts fetched (stored by
     * the caller with store_packed once the stage is free) */
    auto begin_tile = [&](int s, const tile_at &ts, int slot) {
        __half *ks, *vs;
        float2 *kp, *vp;
        stage(s, ks, vs, kp, vp);
        if (ts.kind == 1) {
            load_f16(1, ts.hb, ts.p0, ts.lo, ts.hi, ks, vs, true, true);
            return true; /* no packed part */
        }
        if (KB == 16 || VB == 16) load_f16(0, ts.hb, ts.p0, ts.lo, ts.hi, ks, vs, KB == 16, VB == 16);
        if (KB < 16 || VB < 16) fetch_packed(ts.hb, ts.p0, ts.lo, ts.hi, slot);
        return !(KB < 16 || VB < 16);
    };

    /* The first tile's block address before the wait too: block tables (and rows the
     * host placed) come by scatter_k, after which the next launch is a plain one
     * (launch.cuh). The queries and the rows kv_encode writes (the step's, from
     * P.fresh on, and window rows) come from the kernels just before; a first tile of
     * older block rows is fetched before the wait as well, its DRAM latency under
     * theirs (a decode step at depth 512 reads one tile a block). Another first tile
     * is found again after the wait: the encode may have written its table entry (a
     * prefill chunk's second block). A block of one tile (decode at depth 512 to about
     * 2048) also converts its packed codes into shared memory before the wait: a K8V4
     * or K4V4 step at 512 rows took 0.5-1.4% less GPU time (H100, llama3-8b). Blocks of
     * more tiles convert after it, beside the queries' loads: converted before it there
     * too, steps of 4096 rows and more took up to 0.9% longer (docs). */
    if (NF) /* the scales of normal-float rows, once (read after store_nf's barrier) */
        for (int e = threadIdx.x; e < 256; e += TT) nf_scales[e] = nf_scale((uint32_t)e);
    if (KB == 5) /* and 5-bit keys' levels */
        for (int e = threadIdx.x; e < 32; e += TT) nf_l5[e] = __ushort2half_rn(nf_tables.l5[e]);
    const tile_at first = tile_src(i0, FROM_TABLE);
    const bool early = first.kind == 0 && min(first.hi, first.p0 + TILE - 1) < P.fresh;
    /* Normal-float rows: tile i's block in raw slot i % NR, fetched NR - 1 tiles
     * ahead, one cp.async group a tile (empty where there is nothing to fetch), so that
     * waiting for tile i leaves the NR - 2 later ones in flight */
    bool done = early && begin_tile(0, first, i0 % NR);
    if (NF && early) cp_async_commit();
    auto store_first = [&](bool all) { /* the first tile's packed codes into stage 0 */
        __half *ks, *vs;
        float2 *kp, *vp;
        stage(0, ks, vs, kp, vp);
        store_packed(ks, vs, kp, vp, i0 % NR, all);
    };
    if (early && !done && i1 - i0 == 1) { /* the tile's codes are final: stored now */
        store_first(true);
        done = true;
    }
    griddep_wait();
    if (!early) /* its loads in flight while the queries are read */
        done = begin_tile(0, tile_src(i0, FROM_TABLE), i0 % NR);
    if (NF) {
        if (!early) cp_async_commit();
        for (int n = i0 + 1; n < i0 + NR - 1; n++) {
            if (n < i1 && n < P.t1 + P.t2) fetch_nf(tile_src(n, FROM_TABLE).hb, n % NR);
            cp_async_commit();
        }
    } else {
        prefetch_block(i0 + 1);
    }
    const float qmu = row_on && prepped ? prep[0] : 0.0f;
    uint32_t qa[DW / 16][4];
    float qsum[DW / 16];
#pragma unroll
    for (int kk = 0; kk < DW / 16; kk++) {
        /* dimensions of positions 2t, 2t + 1 and 8 on of the k-step */
        const int d0 = dw0 + kk * 16 + (KN ? t : 2 * t), d1 = d0 + (KN ? 4 : 1);
        float x0 = 0, x1 = 0, x2 = 0, x3 = 0;
        if (row_on) x0 = qv[d0], x1 = qv[d1], x2 = qv[d0 + 8], x3 = qv[d1 + 8];
        split_h2(x0 * q_scale, x1 * q_scale, qa[kk][0], qa[kk][1]);
        split_h2(x2 * q_scale, x3 * q_scale, qa[kk][2], qa[kk][3]);
        qsum[kk] = x0 + x1 + x2 + x3; /* per k-step; a key group's sum below (prepared q only) */
    }
#pragma unroll
    for (int kk = 0; kk < DW / 16; kk++)
        for (int o = 1; o < 4; o <<= 1) qsum[kk] += __shfl_xor_sync(0xffffffffu, qsum[kk], o);

    if (!done) store_first(false);
    for (int i = i0; i < i1; i++) {
        const int s = (i - i0) % NST;
        if (!NF || i >= P.t1 + P.t2) cp_async_wait_all(); /* normal-float tiles waited for in store_nf */
        if ((KN || VN) && i >= P.t1 + P.t2) { /* f16 rows of this thread's copies (load_f16) into nibble order */
            __half *ks, *vs;
            float2 *kp, *vp;
            stage(s, ks, vs, kp, vp);
            for (int u = threadIdx.x; u < TILE * D / 8; u += TT) {
                const int at = u / (D / 8) * LD + u % (D / 8) * 8;
                if (KN) to_nibble_order(ks + at);
                if (VN) to_nibble_order(vs + at);
            }
        }
        __syncthreads(); /* tile i is in stage s; stage s ^ 1 (of two) is free */
        /* next_done: the next tile is in its stage, or only a store_packed away (false);
         * next_later: one stage, the next tile's f16 rows load once this one is done */
        bool next_done = true, next_later = false;
        if (NF) { /* tile i + NR - 1 into its slot; the next, if packed, converted after this one */
            const int n = i + NR - 1;
            if (n < i1 && n < P.t1 + P.t2) fetch_nf(tile_src(n, FROM_TABLE).hb, n % NR);
            cp_async_commit();
            next_done = !(i + 1 < i1 && i + 1 < P.t1 + P.t2);
            next_later = i + 1 < i1 && next_done;
        } else if (NST == 2) {
            next_done = i + 1 < i1 ? begin_tile(s ^ 1, tile_src(i + 1, FROM_PREFETCH), 0) : true;
        } else if (i + 1 < i1 && KB < 16 && i + 1 < P.t1 + P.t2) { /* packed codes into registers now */
            const tile_at nt = tile_src(i + 1, FROM_PREFETCH);
            fetch_packed(nt.hb, nt.p0, nt.lo, nt.hi, 0);
            next_done = false;
        } else {
            next_later = i + 1 < i1; /* f16 rows once the stage is free */
        }
        if (!NF) prefetch_block(i + 2);
        __half *ks, *vs;
        float2 *kp, *vp;
        stage(s, ks, vs, kp, vp);
        /* found again, not kept from the last iteration: held across it, the prefill
         * kernels spill (ptxas) */
        const tile_at ts = tile_src(i, NO_BLOCK);
        const int32_t p0 = ts.p0, hi = ts.hi;
        const bool packed = ts.kind == 0, r1 = i < P.t1;
        const bool kq = packed && KB < 16, vq = packed && VB < 16; /* rows with groups */

        /* scores of this warp's keys: key0 + 8 n + 2t + j */
        const int key0 = PREFILL || WD ? 0 : warp * 16;
        float sc[NTI][2];
#pragma unroll
        for (int n = 0; n < NTI; n++) sc[n][0] = sc[n][1] = 0;
#pragma unroll
        for (int gw = 0; gw < DW / KGW; gw++) { /* the warp's k-steps [ks0, ks1) lie in key group gk */
            const int gk = (dw0 + gw * KGW) / KG;
            float c[NTI][4];
#pragma unroll
            for (int n = 0; n < NTI; n++) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0;
            const int ks0 = gw * KGW / 16, ks1 = ks0 + KGW / 16;
#pragma unroll
            for (int kk = ks0; kk < ks1; kk += 2) { /* two k-steps per ldmatrix */
#pragma unroll
                for (int n = 0; n < NTI; n++) {
                    uint32_t b[4];
                    const int key = key0 + n * 8 + lane % 8, dim = dw0 + kk * 16 + (lane / 8) * 8;
                    ldsm4(b, ks + key * LD + dim);
                    mma_f16_16816(c[n], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                    if (kk + 1 < ks1) mma_f16_16816(c[n], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3], b[2], b[3]);
                }
            }
            float qs = 0;
#pragma unroll
            for (int kk = ks0; kk < ks1; kk++) qs += qsum[kk];
#pragma unroll
            for (int n = 0; n < NTI; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const float dot = (c[n][j] + c[n][2 + j]) * (1.0f / Q_SCALE);
                    /* unprepared q carries the scale in q_scale: dot is the scaled score */
                    if (kq) {
                        const float2 sb = kp[(key0 + n * 8 + 2 * t + j) * nkg + gk];
                        sc[n][j] += sb.x * dot + sb.y * qs;
                    } else {
                        sc[n][j] += dot;
                    }
                }
        }
        if (WD) { /* the warps' partial scores summed, in one order, so every warp has the same */
            float *xs = (float *)(smem + NST * stage_bytes); /* [warp][row g][key] */
#pragma unroll
            for (int n = 0; n < NTI; n++)
                *(float2 *)(xs + (warp * 8 + g) * TILE + n * 8 + 2 * t) = make_float2(sc[n][0], sc[n][1]);
            __syncthreads();
#pragma unroll
            for (int n = 0; n < NTI; n++) {
                float2 sum = make_float2(0, 0);
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    const float2 v = *(const float2 *)(xs + (w * 8 + g) * TILE + n * 8 + 2 * t);
                    sum.x += v.x, sum.y += v.y;
                }
                sc[n][0] = sum.x, sc[n][1] = sum.y;
            }
        }
        /* masks, then the online softmax of this row over these keys; none where the
         * warp's keys all lie in the token's range of a packed tile (most of them) */
        float tmax = -INFINITY;
        const int32_t ta = r1 ? tk.a1 : tk.a2, tb = r1 ? tk.b1 : tk.b2; /* the token's packed rows */
        if (packed && ta <= p0 + key0 && p0 + key0 + 8 * NTI - 1 <= tb) {
#pragma unroll
            for (int n = 0; n < NTI; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    sc[n][j] = row_on ? sc[n][j] + qmu : -INFINITY;
                    tmax = fmaxf(tmax, sc[n][j]);
                }
        } else
#pragma unroll
            for (int n = 0; n < NTI; n++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int32_t p = p0 + key0 + n * 8 + 2 * t + j;
                    bool ok;
                    if (packed) {
                        ok = p >= ta && p <= tb;
                    } else {
                        const bool sink = p < P.sinks;
                        const int32_t pos = sink ? p : P.ws + (p - P.sinks);
                        ok = p <= hi && (sink ? pos < tk.sinks : pos >= tk.ws) && attn_visible(pos, tk.q_pos, tk);
                    }
                    ok &= row_on;
                    sc[n][j] = ok ? sc[n][j] + (packed ? qmu : 0.0f) : -INFINITY;
                    tmax = fmaxf(tmax, sc[n][j]);
                }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float mn = fmaxf(m, tmax);
        /* else every corr would be 1, or the weights stay below e^RESCALE_SLACK */
        if (__any_sync(0xffffffffu, mn > m + RESCALE_SLACK) && mn != -INFINITY) {
            const float corr = m == -INFINITY ? 0.0f : __expf(m - mn);
            m = mn;
            l *= corr, lp *= corr;
#pragma unroll
            for (int i2 = 0; i2 < DW / 16; i2++) bsum[i2] *= corr;
#pragma unroll
            for (int dn = 0; dn < DW / 8; dn++)
#pragma unroll
                for (int e = 0; e < 4; e++) o_acc[dn][e] *= corr;
        }
        float pr[NTI][2];
#pragma unroll
        for (int n = 0; n < NTI; n++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                pr[n][j] = sc[n][j] == -INFINITY ? 0.0f : __expf(sc[n][j] - m);
                l += pr[n][j];
                lp += packed ? pr[n][j] : 0.0f;
            }
        /* P V, a value group at a time: A = P x the rows' scales, in f16 hi + lo */
#pragma unroll
        for (int gw = 0; gw < DW / VGW; gw++) { /* the warp's dimensions [d0, d1) lie in value group gv */
            const int gv = (dw0 + gw * VGW) / VG;
            float bs = 0;
#pragma unroll
            for (int kk = 0; kk < KS; kk++) {
                float w[4]; /* keys 2t, 2t+1 of n-tile 2kk, then of 2kk + 1 */
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int n = 2 * kk + e / 2, key = key0 + n * 8 + 2 * t + e % 2;
                    float sv = 1.0f;
                    if (vq) {
                        const float2 sb = vp[key * nvg + gv];
                        sv = sb.x;
                        bs += pr[n][e % 2] * sb.y;
                    }
                    w[e] = pr[n][e % 2] * sv * P_SCALE;
                }
                uint32_t a0, a1, a2, a3;
                split_h2(w[0], w[1], a0, a1);
                split_h2(w[2], w[3], a2, a3);
                const int d0 = gw * VGW, d1 = d0 + VGW;
#pragma unroll
                for (int dn = d0 / 8; dn < d1 / 8; dn += 2) {
                    uint32_t b[4];
                    const int key = key0 + kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dim = dw0 + dn * 8 + (lane / 16) * 8;
                    ldsm4_t(b, vs + key * LD + dim);
                    mma_f16_16816(o_acc[dn], a0, a1, a2, a3, b[0], b[1]);
                    mma_f16_16816(o_acc[dn + 1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
            bsum[gw] += bs;
        }
        if (NST == 1 && i + 1 < i1) __syncthreads(); /* every warp is done with the stage */
        if (next_later) {
            const tile_at nt = tile_src(i + 1, FROM_PREFETCH);
            __half *nks, *nvs;
            float2 *nkp, *nvp;
            stage(0, nks, nvs, nkp, nvp);
            load_f16(nt.kind, nt.hb, nt.p0, nt.lo, nt.hi, nks, nvs, nt.kind == 1 || KB == 16, nt.kind == 1 || VB == 16);
        }
        if (!next_done) {
            __half *nks, *nvs;
            float2 *nkp, *nvp;
            stage(NST == 2 ? s ^ 1 : 0, nks, nvs, nkp, nvp);
            store_packed(nks, nvs, nkp, nvp, (i + 1) % NR, false);
        }
    }

    /* the row's sums over the quad's keys */
    for (int o = 1; o < 4; o <<= 1) {
        l += __shfl_xor_sync(0xffffffffu, l, o);
        lp += __shfl_xor_sync(0xffffffffu, lp, o);
#pragma unroll
        for (int gv = 0; gv < DW / 16; gv++) bsum[gv] += __shfl_xor_sync(0xffffffffu, bsum[gv], o);
    }
    /* out[d] = sum P v = (O_hi + O_lo) / P_SCALE + the group's bias sum */
    float out[DW / 8][2];
#pragma unroll
    for (int dn = 0; dn < DW / 8; dn++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            out[dn][j] = (o_acc[dn][j] + o_acc[dn][2 + j]) * (1.0f / P_SCALE) + bsum[dn * 8 / VGW]; /* VGW >= 16 */

    if (PREFILL || WD) { /* each warp its own rows (or dimensions) */
        if (!row_on) return;
        float *part = attn_part(a, ti, h, n_splits, split) + dw0;
#pragma unroll
        for (int dn = 0; dn < DW / 8; dn++) {
            if (VN) part[4 + dn * 8 + t] = out[dn][0], part[4 + dn * 8 + 4 + t] = out[dn][1];
            else *(float2 *)(part + 4 + dn * 8 + 2 * t) = make_float2(out[dn][0], out[dn][1]);
        }
        if (t == 0 && dw0 == 0) *(float4 *)part = make_float4(m, l, lp, split == 0 ? (float)n_eff : 0.0f);
        return;
    }
    /* decode: the 4 warps' sums of the same rows merged (in the stage memory) */
    __syncthreads();
    float *ml = (float *)smem;                  /* [warp][8 rows][3] */
    float *ob = ml + 4 * 8 * 3;                 /* [warp][8 rows][D] */
    if (t == 0) ml[(warp * 8 + g) * 3] = m, ml[(warp * 8 + g) * 3 + 1] = l, ml[(warp * 8 + g) * 3 + 2] = lp;
#pragma unroll
    for (int dn = 0; dn < D / 8; dn++)
        *(float2 *)(ob + (warp * 8 + g) * D + dn * 8 + 2 * t) = make_float2(out[dn][0], out[dn][1]);
    __syncthreads();
    for (int e = threadIdx.x; e < R * D; e += TT) { /* rows 0..group-1: the token's heads */
        const int r = e / D, d = e % D, dp = VN ? nibble_pos(d) : d; /* ob in the values' order */
        if (r >= group) break;
        float M = -INFINITY;
        for (int w = 0; w < 4; w++) M = fmaxf(M, ml[(w * 8 + r) * 3]);
        float L = 0, LP = 0, A = 0;
        for (int w = 0; w < 4; w++) {
            const float mw = ml[(w * 8 + r) * 3], f = mw == -INFINITY ? 0.0f : __expf(mw - M);
            L += ml[(w * 8 + r) * 3 + 1] * f;
            LP += ml[(w * 8 + r) * 3 + 2] * f;
            A += ob[(w * 8 + r) * D + dp] * f;
        }
        float *part = attn_part(a, grp.t0, kvh * group + r, n_splits, split);
        part[4 + d] = A;
        if (d == 0) *(float4 *)part = make_float4(M, L, LP, split == 0 ? (float)n_eff : 0.0f);
    }
}

template <int D, int KB, int VB, int GS, int G, bool PREFILL>
static int launch(cuk_queue *qu, const cuk_attn_args *a) {
    static int per_sm;
    constexpr int groups = groups_of<D, KB, GS>() + groups_of<D, VB, GS>(), threads = tile_threads<D, G, PREFILL>();
    /* the stages, then for head size 256 the warps' partial scores, then normal-float
     * rows' block and scales */
    const size_t smem = n_stages<D, GS>() * (stage_halves<D>() * 2 + (size_t)TILE * groups * sizeof(float2)) +
                        (D > 128 ? 4 * 8 * TILE * sizeof(float) : 0) + raw_bytes<D, KB, VB, GS>();
    static unsigned sized;
    if (cuk_first_on_device(&sized))
        cudaFuncSetAttribute(attn_tile<D, KB, VB, GS, G, PREFILL>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (per_sm == 0) {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attn_tile<D, KB, VB, GS, G, PREFILL>, threads,
                                                          smem) != cudaSuccess ||
            per_sm < 1)
            per_sm = 1;
    }
    const long items = (long)a->n_groups * a->n_kv;
    long s = (long)per_sm * a->n_sm / items;
    const long room = 32L * 8 * a->n_sm / ((long)a->n * a->n_head); /* cuk_attention_scratch_floats' bound */
    if (s > room) s = room;
    const int n_splits = s < 1 ? 1 : s > ATTN_MAX_SPLITS ? ATTN_MAX_SPLITS : (int)s;
    pdl_launch_smem(attn_tile<D, KB, VB, GS, G, PREFILL>, dim3((unsigned)items, (unsigned)n_splits),
                    dim3(threads), smem, qu, *a, n_splits, attn_tile_prepped(a));
    return n_splits;
}

template <int D, int KB, int VB, int GS>
static int launch_g(cuk_queue *qu, const cuk_attn_args *a) {
    const bool pre = a->max_group > 1;
    const int group = a->n_head / a->n_kv;
    switch (cuk_attn_tile_rows(group) == group ? group : 0) { /* 0: rows past the group idle */
    case 1: return pre ? launch<D, KB, VB, GS, 1, true>(qu, a) : launch<D, KB, VB, GS, 1, false>(qu, a);
    case 2: return pre ? launch<D, KB, VB, GS, 2, true>(qu, a) : launch<D, KB, VB, GS, 2, false>(qu, a);
    case 4: return pre ? launch<D, KB, VB, GS, 4, true>(qu, a) : launch<D, KB, VB, GS, 4, false>(qu, a);
    case 8: return pre ? launch<D, KB, VB, GS, 8, true>(qu, a) : launch<D, KB, VB, GS, 8, false>(qu, a);
    default: return pre ? launch<D, KB, VB, GS, 0, true>(qu, a) : launch<D, KB, VB, GS, 0, false>(qu, a);
    }
}

/* The packed formats with groups of 32 or 64 (the same for keys and values). */
template <int D, int KB, int VB>
static int launch_gs(cuk_queue *qu, const cuk_attn_args *a) {
    const int gs = KB < 16 ? a->k_group : a->v_group;
    return gs == 32 ? launch_g<D, KB, VB, 32>(qu, a) : launch_g<D, KB, VB, 64>(qu, a);
}

template <int D>
static int launch_formats(cuk_queue *qu, const cuk_attn_args *a) {
    const int kb = a->k_bits, vb = a->v_bits;
    if (a->k_group == KERN_KVQ_NF) /* K5V4, K4V4, K4V3 or K3V2 normal-float (attn_tile_takes) */
        return kb == 5   ? launch_g<D, 5, 4, KERN_KVQ_NF>(qu, a)
               : kb == 3 ? launch_g<D, 3, 2, KERN_KVQ_NF>(qu, a)
               : vb == 3 ? launch_g<D, 4, 3, KERN_KVQ_NF>(qu, a)
                         : launch_g<D, 4, 4, KERN_KVQ_NF>(qu, a);
    if (kb == 16 && vb == 16) return launch_g<D, 16, 16, D>(qu, a);
    if (kb == 8 && vb == 8) return launch_gs<D, 8, 8>(qu, a);
    if (kb == 8 && vb == 4) return launch_gs<D, 8, 4>(qu, a);
    return launch_gs<D, 4, 4>(qu, a);
}

/* head size 256's launches, in attention_tile_256.cu (compiled beside the others) */
int attn_tile_launch_256(cuk_queue *qu, const cuk_attn_args *a);

#endif
