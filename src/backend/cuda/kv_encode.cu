/* New keys and values into the paged cache, encoded on the device exactly as the
 * host encodes them (kvcache/kv_rows.c, kernels/kv_quant.c): the offset removed, the
 * Hadamard rotation (signs, the butterflies in the same order, 1/sqrt(D)), per group
 * scale = f16((max - min) / (2^bits - 1)), bias = f16(min), code = floor((x - bias)
 * / scale + 0.5) clamped, codes packed LSB first. Arithmetic that the host does in
 * separate roundings is written with _rn intrinsics so nvcc does not fuse it.
 * A block of D threads per (token, KV head, side), one value per thread; with RoPE,
 * then a block per (token, query head) for the queries (qk_prep.cuh). Where a step's
 * attention reads its new rows from the f16 windows (a decode step), the packing of
 * the quantized sides is left to kv_pack, which runs beside the attention rather than
 * before it: the barriers, divisions and stores of the packing took 3 of the launch's
 * 5.4 us a layer, in the chain of launches every decode token waits for. Rows packed
 * apart from their encode (kv_pack, kv_offsets_rows) take a warp a row where both sides
 * are uniform 4- or 8-bit codes or floats (store_row_warp: no barriers). */
#include <cuda_fp16.h>

#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/nf_rows.cuh"
#include "backend/cuda/qk_prep.cuh"

#define BT 64 /* tokens per KV block (kv_pool.h) */

/* f16 bits of x, rounded to nearest even, in integer arithmetic as kernels/f16.h does
 * (the same bits as the host, whatever the compiler does with half intrinsics). */
static __device__ uint16_t f16_bits(float f) {
    const uint32_t x = __float_as_uint(f), sign = (x >> 16) & 0x8000, absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);
    if (absx < 0x38800000u) {
        if (absx < 0x33000000u) return (uint16_t)sign;
        const uint32_t e = absx >> 23, m = (absx & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t half = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t h = (absx - 0x38000000u) >> 13;
    const uint32_t rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static __device__ uint16_t f16_sat(float x) { return f16_bits(fminf(fmaxf(x, -65504.0f), 65504.0f)); }

/* The N sums of v over the warp, side by side (their shuffles in flight together). */
template <int N, typename T>
static __device__ __forceinline__ void warp_sums(T (&v)[N]) {
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int n = 0; n < N; n++) v[n] += __shfl_xor_sync(0xffffffffu, v[n], o);
}

/* A normal-float row of BITS coded by one warp, V values a lane (x: those of lane +
 * 32 j), with the level table lv and the sums of neighbouring levels l2. */
template <int V, int BITS>
struct nf_warp_row {
    const float *x, *lv, *l2;
    /* the code of x at scale s: the number of level midpoints (s / 2) l2[t] below it,
     * each found as the host finds it, by a binary search (they ascend) */
    __device__ int code(float x, float s) const {
        const float hs = __fmul_rn(0.5f, s);
        int k = 0;
#pragma unroll
        for (int step = 1 << (BITS - 1); step > 0; step >>= 1)
            if (x > __fmul_rn(hs, l2[k + step - 1])) k += step;
        return k;
    }
    /* this lane's share of the row's squared error at scale s */
    __device__ float error(float s) const {
        float e = 0;
#pragma unroll
        for (int j = 0; j < V; j++) {
            const float d = __fsub_rn(x[j], __fmul_rn(s, lv[code(x[j], s)]));
            e = __fadd_rn(e, __fmul_rn(d, d));
        }
        return e;
    }
};

/* The codes (to c, value lane + 32 j at j) and the scale byte of a normal-float row of
 * 32 V values (x: this lane's) as the host's encoder chooses them (kernels/kv_quant.c:
 * the best of 11 clipping points, two least-squares refits, the best of three stored
 * scales; the first of equal errors each time), by one warp. The errors are summed in
 * another order than the host's, so where two candidates tie to float precision either
 * may win. */
template <int V, int BITS>
static __device__ uint32_t nf_encode_warp(const float (&x)[V], uint8_t *c) {
    constexpr int NL = 1 << BITS;
    __shared__ float lv[NL], l2[NL];
    const int lane = threadIdx.x % 32;
    if (lane < NL) lv[lane] = (float)nf_levels(BITS)[lane] - 127.5f;
    __syncwarp();
    if (lane + 1 < NL) l2[lane] = lv[lane] + lv[lane + 1]; /* exact: halves of small integers */
    __syncwarp();
    const nf_warp_row<V, BITS> row = {x, lv, l2};
    float amax = 0;
#pragma unroll
    for (int j = 0; j < V; j++) amax = fmaxf(amax, fabsf(x[j]));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float top = lv[NL - 1];
    auto clip = [&](int a) { return __fdiv_rn(__fmul_rn(amax, __fsub_rn(1.0f, __fmul_rn(0.05f, (float)a))), top); };
    float e[11];
#pragma unroll
    for (int a = 0; a < 11; a++) e[a] = row.error(clip(a));
    warp_sums(e);
    float bs = __fdiv_rn(amax, top), best = INFINITY;
#pragma unroll
    for (int a = 0; a < 11; a++)
        if (e[a] < best) best = e[a], bs = clip(a);
    for (int it = 0; it < 2 && amax > 0; it++) {
        double p[2] = {0, 0}; /* sum x l, sum l l */
#pragma unroll
        for (int j = 0; j < V; j++) {
            const double l = lv[row.code(x[j], bs)];
            p[0] += (double)x[j] * l, p[1] += l * l;
        }
        warp_sums(p);
        const float s = p[1] > 0 ? (float)(p[0] / p[1]) : bs;
        float es[1] = {row.error(s)};
        warp_sums(es);
        if (!(es[0] < best)) break;
        best = es[0], bs = s;
    }
    int e0 = 0; /* the stored scale nearest bs (log2f as the double log2 rounded) */
    if (bs > 0) {
        const float f = __fadd_rn(__fmul_rn(12.0f, (float)log2((double)bs)), 216.0f);
        e0 = f < 1 ? 1 : f > 255 ? 255 : __float2int_rn(f);
    }
    float et[3]; /* the stored scales e0 - 1 .. e0 + 1 that exist */
#pragma unroll
    for (int t = 0; t < 3; t++) {
        const int b = e0 - 1 + t;
        et[t] = e0 && b >= 1 && b <= 255 ? row.error(nf_scale((uint32_t)b)) : 0.0f;
    }
    warp_sums(et);
    uint32_t eb = (uint32_t)e0;
    best = INFINITY;
#pragma unroll
    for (int t = 0; t < 3; t++) {
        const int b = e0 - 1 + t;
        if (e0 && b >= 1 && b <= 255 && et[t] < best) best = et[t], eb = (uint32_t)b;
    }
    const float s = nf_scale(eb);
#pragma unroll
    for (int j = 0; j < V; j++) c[lane + 32 * j] = (uint8_t)row.code(x[j], s);
    return eb;
}

/* The same for a row of `bits` bits (2..5). */
template <int V>
static __device__ uint32_t nf_encode_warp(const float (&x)[V], int bits, uint8_t *c) {
    switch (bits) {
    case 2: return nf_encode_warp<V, 2>(x, c);
    case 3: return nf_encode_warp<V, 3>(x, c);
    case 4: return nf_encode_warp<V, 4>(x, c);
    default: return nf_encode_warp<V, 5>(x, c);
    }
}

/* Query head h of token tk: norm and RoPE in place, then prepared (qk_prep.cuh) with
 * its constants c. */
template <int D>
static __device__ void rope_query(const cuk_enc_args &a, const cuk_enc_tok &tk, int h, const prep_consts &c,
                                  float *buf) {
    const cuk_qk_rope &r = a.rope;
    const int i = threadIdx.x, t = tk.t;
    const size_t at = ((size_t)t * r.n_head + h) * D;
    const float q = rope_head<D>(r.q[at + i], r.q_norm, r.eps, r.cos + (size_t)t * r.half, r.sin + (size_t)t * r.half,
                                 r.half, r.pairing, buf);
    r.q[at + i] = q;
    if (r.qprep) prep_head<D>(q, r.scale, c, a.k_rot, r.qprep + ((size_t)t * r.n_head + h) * (D + 1), buf);
}

/* Where row (token tk, KV head h, side) goes: its place in the token's block, and in
 * the read-back buffer (NULL: not read back). */
struct row_dst {
    uint8_t *block, *rb;
};
static __device__ __forceinline__ row_dst row_dst_of(const cuk_enc_args &a, const cuk_enc_tok &tk, int side, int h) {
    const size_t row = side ? a.v_row : a.k_row;
    const uint32_t rb_at = side ? tk.rb_v : tk.rb_k;
    return {(uint8_t *)tk.block + (size_t)h * a.head_bytes + (side ? (size_t)BT * a.k_row : 0) +
                (size_t)(tk.p % BT) * row,
            rb_at == CUK_NO_ROW ? nullptr : a.readback + rb_at + (size_t)h * row};
}

/* Value i of a row's f16 window copy (y: rotated, without the offset): into the ring,
 * the sinks and the read-back buffer, where the token has them. */
static __device__ __forceinline__ void store_window(const cuk_enc_args &a, const cuk_enc_tok &tk, int side, int h,
                                                    int i, float y) {
    const __half hy = __ushort_as_half(f16_bits(y));
    const size_t hs = (size_t)side * a.n_kv + h;
    if (tk.ring) ((__half *)((uint8_t *)tk.ring + (hs * tk.ring_cap + tk.p % tk.ring_cap) * a.win_row))[i] = hy;
    if (tk.sink && tk.p < tk.sinks) ((__half *)((uint8_t *)tk.sink + (hs * tk.sink_cap + tk.p) * a.win_row))[i] = hy;
    if (tk.rb_wk != CUK_NO_ROW) ((__half *)(a.readback + (side ? tk.rb_wv : tk.rb_wk) + h * a.win_row))[i] = hy;
}

/* Value i of a 32- or 16-bit row into its block and the read-back buffer (rb, or NULL). */
static __device__ __forceinline__ void store_float(uint8_t *dst, uint8_t *rb, bool f32, int i, float z) {
    if (f32) {
        ((float *)dst)[i] = z;
        if (rb) ((float *)rb)[i] = z;
        return;
    }
    const __half hz = __ushort_as_half(f16_bits(z));
    ((__half *)dst)[i] = hz;
    if (rb) ((__half *)rb)[i] = hz;
}

/* Thread i's value z (offset and rotated) of row (token tk, KV head h, side) into the
 * block and the read-back buffer (unless its offset there is CUK_NO_ROW): as it is for
 * 32 and 16 bits, else packed. */
template <int D>
static __device__ void store_row(const cuk_enc_args &a, const cuk_enc_tok &tk, int side, int h, float z) {
    const int i = threadIdx.x;
    const int bits = side ? a.v_bits : a.k_bits, group = side ? a.v_group : a.k_group;
    const size_t row = side ? a.v_row : a.k_row;
    const row_dst to = row_dst_of(a, tk, side, h);
    uint8_t *const dst = to.block, *const rb = to.rb;
    if (bits >= 16) {
        store_float(dst, rb, bits == 32, i, z);
        return;
    }
    /* uniform 4- and 8-bit rows are stored as their values are found; others are
     * assembled in shared memory, then copied out byte by byte */
    const bool nf = group == KERN_KVQ_NF, direct = !nf && (bits == 8 || bits == 4);
    const int code_bytes = D * bits / 8;
    __shared__ __align__(4) uint8_t out[D + 4 * (D / 8)];
    __shared__ uint8_t codes[D];
    if (nf) { /* the row through shared memory to one warp */
        __shared__ float zs[D];
        zs[i] = z;
        __syncthreads();
        if (i < 32) {
            float x[D / 32];
#pragma unroll
            for (int j = 0; j < D / 32; j++) x[j] = zs[i + 32 * j];
            const uint32_t e = nf_encode_warp<D / 32>(x, bits, codes);
            if (i == 0) out[code_bytes] = (uint8_t)e;
        }
    } else {
        const int qmax = (1 << bits) - 1, n_groups = D / group;
        __shared__ float gsc[D], gbi[D];
        /* each group's min and max as the host's scan finds them (the first of equal
         * values: -0 and 0 differ in f16): by shuffles over pieces of up to 32 values,
         * then over the group's pieces in order (groups of 8 or more, so D / 8 pieces) */
        const int piece = group < 32 ? group : 32;
        __shared__ float pmn[D / 8], pmx[D / 8];
        float mn = z, mx = z;
        int imn = i, imx = i;
        for (int o = 1; o < piece; o <<= 1) {
            const float a = __shfl_xor_sync(0xffffffffu, mn, o), b = __shfl_xor_sync(0xffffffffu, mx, o);
            const int ia = __shfl_xor_sync(0xffffffffu, imn, o), ib = __shfl_xor_sync(0xffffffffu, imx, o);
            if (a < mn || (a == mn && ia < imn)) mn = a, imn = ia;
            if (b > mx || (b == mx && ib < imx)) mx = b, imx = ib;
        }
        if (i % piece == 0) pmn[i / piece] = mn, pmx[i / piece] = mx;
        __syncthreads();
        if (i < n_groups) {
            const int p0 = i * (group / piece);
            mn = pmn[p0], mx = pmx[p0];
            for (int p = p0 + 1; p < p0 + group / piece; p++) { /* a later piece wins only when beyond */
                mn = pmn[p] < mn ? pmn[p] : mn;
                mx = pmx[p] > mx ? pmx[p] : mx;
            }
            const uint16_t sh = f16_sat(__fdiv_rn(__fsub_rn(mx, mn), (float)qmax)), bh = f16_sat(mn);
            gsc[i] = __half2float(__ushort_as_half(sh));
            gbi[i] = __half2float(__ushort_as_half(bh));
            /* code_bytes is even, and so are the rows' addresses */
            uint16_t *const sb = (uint16_t *)((direct ? dst : out) + code_bytes);
            sb[2 * i] = sh;
            sb[2 * i + 1] = bh;
            if (direct && rb) {
                ((uint16_t *)(rb + code_bytes))[2 * i] = sh;
                ((uint16_t *)(rb + code_bytes))[2 * i + 1] = bh;
            }
        }
        __syncthreads();
        const float sf = gsc[i / group], bf = gbi[i / group], inv = sf > 0 ? __fdiv_rn(1.0f, sf) : 0.0f;
        const float t = floorf(__fadd_rn(__fmul_rn(__fsub_rn(z, bf), inv), 0.5f));
        const uint32_t c = (uint32_t)(t < 0 ? 0 : t > (float)qmax ? qmax : (int)t);
        if (direct) { /* a code a byte, or two (the odd value's in the high nibble) */
            const uint32_t hi = __shfl_down_sync(0xffffffffu, c, 1);
            const int at = bits == 8 ? i : i / 2;
            const uint8_t byte = (uint8_t)(bits == 8 ? c : c | hi << 4);
            if (bits == 8 || i % 2 == 0) {
                dst[at] = byte;
                if (rb) rb[at] = byte;
            }
            return;
        }
        codes[i] = (uint8_t)c;
    }
    __syncthreads();
    for (int j = i; j < code_bytes; j += D) { /* byte j holds bits [8j, 8j + 8) of the codes, LSB first */
        uint32_t byte = 0;
        for (int b = 0; b < 8; b++) {
            const int bit = 8 * j + b;
            byte |= (uint32_t)((codes[bit / bits] >> (bit % bits)) & 1) << b;
        }
        out[j] = (uint8_t)byte;
    }
    __syncthreads();
    for (int j = i; j < (int)row; j += D) {
        dst[j] = out[j];
        if (rb) rb[j] = out[j];
    }
}

/* Whether a side's rows are stored by store_row_warp: uniform 4- and 8-bit codes in
 * groups of at least a lane's values, or kept in float (stored by nobody here). */
static __host__ __device__ bool warp_packs(int bits, int group, int D) {
    return bits >= 16 || ((bits == 4 || bits == 8) && group != KERN_KVQ_NF && group >= D / 32);
}

/* store_row by one warp, for the sides warp_packs takes: lane l holds values [E l,
 * E l + E) of z. Each group's min and max (the first of equal values, as the host's scan
 * and store_row find them), scale, bias and codes as store_row makes them: the same
 * bytes, without a block's barriers, so that four rows take what one took. */
template <int D>
static __device__ void store_row_warp(const cuk_enc_args &a, const cuk_enc_tok &tk, int side, int h,
                                      const float (&z)[D / 32]) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32, bits = side ? a.v_bits : a.k_bits, group = side ? a.v_group : a.k_group;
    const row_dst to = row_dst_of(a, tk, side, h);
    uint8_t *const dst = to.block, *const rb = to.rb;
    float mn = z[0], mx = z[0];
    int imn = 0, imx = 0;
#pragma unroll
    for (int k = 1; k < E; k++) {
        if (z[k] < mn) mn = z[k], imn = k;
        if (z[k] > mx) mx = z[k], imx = k;
    }
    imn += E * lane, imx += E * lane;
    for (int o = 1; o < group / E; o <<= 1) {
        const float x = __shfl_xor_sync(0xffffffffu, mn, o), y = __shfl_xor_sync(0xffffffffu, mx, o);
        const int ix = __shfl_xor_sync(0xffffffffu, imn, o), iy = __shfl_xor_sync(0xffffffffu, imx, o);
        if (x < mn || (x == mn && ix < imn)) mn = x, imn = ix;
        if (y > mx || (y == mx && iy < imx)) mx = y, imx = iy;
    }
    const int qmax = (1 << bits) - 1;
    const uint16_t sh = f16_sat(__fdiv_rn(__fsub_rn(mx, mn), (float)qmax)), bh = f16_sat(mn);
    const float sf = __half2float(__ushort_as_half(sh)), bf = __half2float(__ushort_as_half(bh));
    const float inv = sf > 0 ? __fdiv_rn(1.0f, sf) : 0.0f;
    uint32_t c[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        const float t = floorf(__fadd_rn(__fmul_rn(__fsub_rn(z[k], bf), inv), 0.5f));
        c[k] = (uint32_t)(t < 0 ? 0 : t > (float)qmax ? qmax : (int)t);
    }
    /* the lane's code bytes as 32-bit words (rows and their code bytes are multiples of
     * 4 bytes long), or one shorter store */
    constexpr int NB8 = E, NB4 = E / 2;
    const int nb = bits == 8 ? NB8 : NB4;
    uint32_t w[(NB8 + 3) / 4] = {};
#pragma unroll
    for (int k = 0; k < E; k++) {
        if (bits == 8) w[k / 4] |= c[k] << (8 * (k % 4));
        else w[k / 8] |= c[k] << (4 * (k % 8));
    }
    uint8_t *const targets[2] = {dst, rb};
#pragma unroll
    for (int d = 0; d < 2; d++) {
        uint8_t *const o = targets[d];
        if (!o) continue;
        uint8_t *const at = o + (size_t)lane * nb;
        if (nb >= 4)
            for (int k = 0; k < nb / 4; k++) ((uint32_t *)at)[k] = w[k];
        else if (nb == 2) *(uint16_t *)at = (uint16_t)w[0];
        else *at = (uint8_t)w[0];
        if ((E * lane) % group == 0) /* the group's scale and bias */
            ((uint32_t *)(o + D * bits / 8))[E * lane / group] = (uint32_t)sh | (uint32_t)bh << 16;
    }
}

template <int D>
__global__ void kv_encode(const cuk_enc_args a) {
    griddep_release();
    __shared__ float buf[2 * D];
    const int n_rows = a.n * a.n_kv * 2, qb = blockIdx.x - n_rows; /* qb >= 0: a query head */
    /* the token's plan is staged step data (uploaded before the step's kernels): read
     * before the wait */
    const cuk_enc_tok tk = a.toks[qb >= 0 ? qb / a.rope.n_head : blockIdx.x / (2 * a.n_kv)];
    const float *const mu = (const float *)tk.mu;
    if (qb >= 0) { /* so are the query's offsets and signs */
        const int h = qb % a.rope.n_head, kvh = h / (a.rope.n_head / a.n_kv);
        const prep_consts c = prep_consts_of(mu && a.k_bits < 16 ? mu + (size_t)kvh * D : nullptr, a.k_rot, a.signs);
        griddep_wait();
        rope_query<D>(a, tk, h, c, buf);
        return;
    }
    const int side = blockIdx.x % 2, h = (blockIdx.x / 2) % a.n_kv, i = threadIdx.x;
    const int rot = side ? a.v_rot : a.k_rot;
    const bool quant = (side ? a.v_bits : a.k_bits) < 16;
    /* and the row's offset and sign */
    const float mu_i = quant && mu ? mu[((size_t)side * a.n_kv + h) * D + i] : 0.0f, sign = rot ? a.signs[i] : 1.0f;
    griddep_wait();
    if (tk.table_at && blockIdx.x % (2 * a.n_kv) == 0 && i == 0) /* a block the step begins: its table entry */
        *(uint64_t *)tk.table_at = tk.block;
    const size_t at = ((size_t)tk.t * a.n_kv + h) * D + i;
    float x = (side ? a.v : a.k)[at];
    if (!side && a.rope.q) {
        const cuk_qk_rope &r = a.rope;
        x = rope_head<D>(x, r.k_norm, r.eps, r.cos + (size_t)tk.t * r.half, r.sin + (size_t)tk.t * r.half, r.half,
                         r.pairing, buf);
        r.k[at] = x;
    }

    float z = x, y = x; /* y: the window's value, rotated without the offset */
    if (quant && mu) z = __fsub_rn(x, mu_i);
    if (rot && a.windows) { /* both rotations through the same barriers */
        float v[2] = {x * sign, z * sign};
        hadamard_blocks<D, 2>(v, buf);
        y = v[0], z = v[1];
    } else if (rot) {
        z = hadamard_block<D>(z * sign, buf);
    }
    if (a.windows) store_window(a, tk, side, h, i, y);
    if (quant && tk.repack) return; /* packed with the offsets this pass chooses */
    if (quant && a.defer) { /* packed by kv_pack, beside the step's attention */
        a.defer[(size_t)blockIdx.x * D + i] = z;
        return;
    }
    store_row<D>(a, tk, side, h, z);
}

/* A block of D threads per (token, KV head, side), as kv_encode's rows: the packed
 * sides' rows it left in a.defer. Launched beside the stream once the encode is done
 * (a plain dependency, not PDL: no griddep_wait). */
template <int D>
__global__ void kv_pack(const cuk_enc_args a) {
    const int side = blockIdx.x % 2, h = (blockIdx.x / 2) % a.n_kv;
    if ((side ? a.v_bits : a.k_bits) >= 16) return; /* stored by the encode */
    store_row<D>(a, a.toks[blockIdx.x / (2 * a.n_kv)], side, h, a.defer[(size_t)blockIdx.x * D + threadIdx.x]);
}

/* The same, a warp a row (ROW_WARPS rows a block), where both sides warp_packs. */
#define ROW_WARPS 4
template <int D>
__global__ void __launch_bounds__(32 * ROW_WARPS) kv_pack_warp(const cuk_enc_args a) {
    const int r = blockIdx.x * ROW_WARPS + threadIdx.x / 32, side = r % 2, h = (r / 2) % a.n_kv;
    if (r >= a.n * 2 * a.n_kv || (side ? a.v_bits : a.k_bits) >= 16) return;
    float z[D / 32];
    const float *const x = a.defer + (size_t)r * D + D / 32 * (threadIdx.x % 32);
#pragma unroll
    for (int k = 0; k < D / 32; k++) z[k] = x[k];
    store_row_warp<D>(a, a.toks[r / (2 * a.n_kv)], side, h, z);
}

/* kv_encode a warp an item (a row, then the query heads), where both sides warp_packs
 * and a partial rotation's half is a multiple of a lane's values: the same operations
 * in the same order (qk_prep.cuh's warp forms, hadamard_warp, store_row_warp), so the
 * same bytes, without a block's barriers: a 512-token pass has 24,576 items, whose
 * blocks of D threads spent their time in barriers, not in their work. */
template <int D>
__global__ void __launch_bounds__(32 * ROW_WARPS) kv_encode_warp(const cuk_enc_args a) {
    griddep_release();
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32, item = blockIdx.x * ROW_WARPS + threadIdx.x / 32, d0 = E * lane;
    const int n_rows = a.n * a.n_kv * 2, qb = item - n_rows;
    if (qb >= (a.rope.q ? a.n * a.rope.n_head : 0)) return;
    const cuk_qk_rope &r = a.rope;
    const cuk_enc_tok tk = a.toks[qb >= 0 ? qb / r.n_head : item / (2 * a.n_kv)];
    const float *const mu = (const float *)tk.mu;
    if (qb >= 0) {
        const int h = qb % r.n_head, kvh = h / (r.n_head / a.n_kv);
        const size_t at = ((size_t)tk.t * r.n_head + h) * D + d0;
        griddep_wait();
        float q[E];
#pragma unroll
        for (int k = 0; k < E; k++) q[k] = r.q[at + k];
        rope_head_warp<D>(q, r.q_norm, r.eps, r.cos + (size_t)tk.t * r.half, r.sin + (size_t)tk.t * r.half, r.half,
                          r.pairing);
#pragma unroll
        for (int k = 0; k < E; k++) r.q[at + k] = q[k];
        if (r.qprep)
            prep_head_warp<D>(q, r.scale, mu && a.k_bits < 16 ? mu + (size_t)kvh * D : nullptr,
                              a.k_rot ? a.signs : nullptr, r.qprep + ((size_t)tk.t * r.n_head + h) * (D + 1));
        return;
    }
    const int side = item % 2, h = (item / 2) % a.n_kv;
    const int rot = side ? a.v_rot : a.k_rot;
    const bool quant = (side ? a.v_bits : a.k_bits) < 16;
    float mu_i[E], sign[E];
#pragma unroll
    for (int k = 0; k < E; k++) {
        mu_i[k] = quant && mu ? mu[((size_t)side * a.n_kv + h) * D + d0 + k] : 0.0f;
        sign[k] = rot ? a.signs[d0 + k] : 1.0f;
    }
    griddep_wait();
    if (tk.table_at && item % (2 * a.n_kv) == 0 && lane == 0) /* a block the step begins: its table entry */
        *(uint64_t *)tk.table_at = tk.block;
    const size_t at = ((size_t)tk.t * a.n_kv + h) * D + d0;
    float x[E];
#pragma unroll
    for (int k = 0; k < E; k++) x[k] = (side ? a.v : a.k)[at + k];
    if (!side && r.q) {
        rope_head_warp<D>(x, r.k_norm, r.eps, r.cos + (size_t)tk.t * r.half, r.sin + (size_t)tk.t * r.half, r.half,
                          r.pairing);
#pragma unroll
        for (int k = 0; k < E; k++) r.k[at + k] = x[k];
    }
    float z[E], y[E]; /* y: the window's value, rotated without the offset */
#pragma unroll
    for (int k = 0; k < E; k++) y[k] = x[k], z[k] = quant && mu ? __fsub_rn(x[k], mu_i[k]) : x[k];
    if (rot) {
#pragma unroll
        for (int k = 0; k < E; k++) y[k] = x[k] * sign[k], z[k] = z[k] * sign[k];
        if (a.windows) hadamard_warp<D>(y);
        hadamard_warp<D>(z);
    }
    if (a.windows)
#pragma unroll
        for (int k = 0; k < E; k++) store_window(a, tk, side, h, d0 + k, y[k]);
    if (quant && tk.repack) return; /* packed with the offsets this pass chooses */
    if (quant && a.defer) { /* packed by kv_pack, beside the step's attention */
#pragma unroll
        for (int k = 0; k < E; k++) a.defer[(size_t)item * D + d0 + k] = z[k];
        return;
    }
    if (quant) {
        store_row_warp<D>(a, tk, side, h, z);
        return;
    }
    const row_dst to = row_dst_of(a, tk, side, h);
#pragma unroll
    for (int k = 0; k < E; k++) store_float(to.block, to.rb, (side ? a.v_bits : a.k_bits) == 32, d0 + k, z[k]);
}

/* x / n rounded as __fdiv_rn, for the f16 values x of window rows and n <= 8192 (every
 * finite f16 and n was checked against the division on a CPU): the product by the
 * reciprocal corrected once (Markstein), without the division's branch to its slow
 * path, so that a batch's divisions overlap. Infinities and NaN stay as the product. */
#define DIV_BY_MAX 8192
static __device__ __forceinline__ float div_by(float x, float n, float r) {
    const float q = __fmul_rn(x, r), e = __fmaf_rn(-q, n, x);
    return isfinite(e) ? __fmaf_rn(e, r, q) : q;
}

/* An item's side and head a block, a dimension a thread: the mean of window rows
 * 1..T-1 summed in the host's order, each term divided first (the same bits); then
 * rotated back (the host's inverse: the butterflies, then the scale and sign) into the
 * cache's device offsets. The ring holds positions 0..T-1 in place (it holds the whole
 * pass, offsets_plan). A batch of rows is loaded and divided before its sums, so that
 * only the sums wait on each other. */
template <int D>
__global__ void kv_offsets_mean(const cuk_enc_args a, const cuk_offs_item *items) {
    __shared__ float buf[D];
    constexpr int BATCH = 64;
    const cuk_offs_item it = items[blockIdx.x / (2 * a.n_kv)];
    const size_t hs = blockIdx.x % (2 * a.n_kv); /* side * n_kv + head, as the ring's rows */
    const int i = threadIdx.x, rot = hs >= (size_t)a.n_kv ? a.v_rot : a.k_rot;
    const float n = (float)(it.T - 1), r = __frcp_rn(n);
    const bool fast = it.T - 1 <= DIV_BY_MAX;
    const __half *const plane = (const __half *)((const uint8_t *)it.ring + hs * it.ring_cap * a.win_row) + i;
    const size_t row_halves = a.win_row / sizeof(__half);
    float mu = 0;
    for (int32_t p0 = 1; p0 < it.T; p0 += BATCH) {
        float x[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; j++) /* (past T - 1: row T - 1 again, not summed) */
            x[j] = __half2float(plane[(size_t)min(p0 + j, it.T - 1) * row_halves]);
        if (fast) {
#pragma unroll
            for (int j = 0; j < BATCH; j++) x[j] = div_by(x[j], n, r);
        } else {
            for (int j = 0; j < BATCH; j++) x[j] = __fdiv_rn(x[j], n);
        }
#pragma unroll
        for (int j = 0; j < BATCH; j++)
            if (p0 + j < it.T) mu = __fadd_rn(mu, x[j]);
    }
    float *const out = (float *)it.mu;
    out[(2 * a.n_kv + hs) * D + i] = mu;
    out[hs * D + i] = rot ? hadamard_block<D>(mu, buf) * a.signs[i] : mu;
}

/* The item whose rows hold row r of the arguments' toks (cuk_kv_offsets). */
static __device__ cuk_offs_item offs_item_of(const cuk_offs_item *items, int n_items, int r) {
    int j = 0;
    while (j + 1 < n_items && r >= items[j + 1].first) j++;
    return items[j];
}

/* A block per (row, KV head, side) as kv_encode's: a position before T from its window
 * row less the rotated offsets, a later one from its keys or values (the pass's, RoPE'd
 * in place) as kv_encode encodes them with the offsets; packed again (float sides keep
 * their rows). */
template <int D>
__global__ void kv_offsets_rows(const cuk_enc_args a, const cuk_offs_item *items, int n_items) {
    __shared__ float buf[D];
    const int r = blockIdx.x / (2 * a.n_kv), side = blockIdx.x % 2, h = (blockIdx.x / 2) % a.n_kv, i = threadIdx.x;
    const cuk_enc_tok tk = a.toks[r];
    if ((side ? a.v_bits : a.k_bits) >= 16 || !tk.block) return; /* (no block: a row released) */
    const cuk_offs_item it = offs_item_of(items, n_items, r);
    const size_t hs = (size_t)side * a.n_kv + h;
    const float *const mu = (const float *)it.mu;
    float z;
    if (tk.p < it.T) {
        const __half *row = (const __half *)((const uint8_t *)it.ring + (hs * it.ring_cap + tk.p % it.ring_cap) * a.win_row);
        z = __fsub_rn(__half2float(row[i]), mu[(2 * a.n_kv + hs) * D + i]);
    } else {
        z = __fsub_rn((side ? a.v : a.k)[((size_t)tk.t * a.n_kv + h) * D + i], mu[hs * D + i]);
        if (side ? a.v_rot : a.k_rot) z = hadamard_block<D>(z * a.signs[i], buf);
    }
    store_row<D>(a, tk, side, h, z);
}

/* The same, a warp a row (ROW_WARPS rows a block), where both sides warp_packs. */
template <int D>
__global__ void __launch_bounds__(32 * ROW_WARPS) kv_offsets_rows_warp(const cuk_enc_args a, const cuk_offs_item *items,
                                                                       int n_items) {
    constexpr int E = D / 32;
    const int w = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (w >= a.n * 2 * a.n_kv) return;
    const int r = w / (2 * a.n_kv), side = w % 2, h = (w / 2) % a.n_kv;
    const cuk_enc_tok tk = a.toks[r];
    if ((side ? a.v_bits : a.k_bits) >= 16 || !tk.block) return;
    const cuk_offs_item it = offs_item_of(items, n_items, r);
    const size_t hs = (size_t)side * a.n_kv + h;
    const float *const mu = (const float *)it.mu;
    const int i0 = E * lane;
    float z[E];
    if (tk.p < it.T) {
        const __half *row =
            (const __half *)((const uint8_t *)it.ring + (hs * it.ring_cap + tk.p % it.ring_cap) * a.win_row);
#pragma unroll
        for (int k = 0; k < E; k++) z[k] = __fsub_rn(__half2float(row[i0 + k]), mu[(2 * a.n_kv + hs) * D + i0 + k]);
    } else {
        const float *const x = (side ? a.v : a.k) + ((size_t)tk.t * a.n_kv + h) * D + i0;
#pragma unroll
        for (int k = 0; k < E; k++) z[k] = __fsub_rn(x[k], mu[hs * D + i0 + k]);
        if (side ? a.v_rot : a.k_rot) {
#pragma unroll
            for (int k = 0; k < E; k++) z[k] = z[k] * a.signs[i0 + k];
            hadamard_warp<D>(z);
        }
    }
    store_row_warp<D>(a, tk, side, h, z);
}

static bool rows_by_warps(const cuk_enc_args &a) {
    return warp_packs(a.k_bits, a.k_group, a.head_dim) && warp_packs(a.v_bits, a.v_group, a.head_dim);
}

static dim3 warp_rows_grid(const cuk_enc_args &a) {
    return dim3((unsigned)((a.n * 2 * a.n_kv + ROW_WARPS - 1) / ROW_WARPS));
}

template <int D>
static void launch_offsets(cuk_queue *qu, const cuk_enc_args &a, const cuk_offs_item *items, int n_items) {
    queue_launch(kv_offsets_mean<D>, dim3((unsigned)(n_items * 2 * a.n_kv)), dim3(D), qu, a, items);
    if (rows_by_warps(a))
        queue_launch(kv_offsets_rows_warp<D>, warp_rows_grid(a), dim3(32 * ROW_WARPS), qu, a, items, n_items);
    else queue_launch(kv_offsets_rows<D>, dim3((unsigned)(a.n * 2 * a.n_kv)), dim3(D), qu, a, items, n_items);
}

extern "C" void cuk_kv_offsets(cuk_queue *qu, const cuk_enc_args *a, const cuk_offs_item *items, int n_items) {
    if (n_items <= 0 || a->n <= 0) return;
    switch (a->head_dim) {
    case 64: launch_offsets<64>(qu, *a, items, n_items); break;
    case 128: launch_offsets<128>(qu, *a, items, n_items); break;
    case 256: launch_offsets<256>(qu, *a, items, n_items); break;
    default: break;
    }
}

template <int D>
static void launch_pack(cuk_queue *qu, const cuk_enc_args &a) {
    if (rows_by_warps(a)) queue_launch(kv_pack_warp<D>, warp_rows_grid(a), dim3(32 * ROW_WARPS), qu, a);
    else queue_launch(kv_pack<D>, dim3((unsigned)(a.n * a.n_kv * 2)), dim3(D), qu, a);
}

extern "C" void cuk_kv_pack(cuk_queue *qu, const cuk_enc_args *a) {
    if (a->n <= 0 || !a->defer) return;
    cuk_queue_launch_side_next(qu);
    switch (a->head_dim) {
    case 64: launch_pack<64>(qu, *a); break;
    case 128: launch_pack<128>(qu, *a); break;
    case 256: launch_pack<256>(qu, *a); break;
    default: break;
    }
}

extern "C" void cuk_kv_encode(cuk_queue *qu, const cuk_enc_args *a) {
    if (a->n <= 0) return;
    const unsigned blocks = (unsigned)(a->n * (a->n_kv * 2 + (a->rope.q ? a->rope.n_head : 0)));
    if ((int)blocks >= cuk_warp_items() && rows_by_warps(*a) &&
        (!a->rope.q || a->rope.pairing == 0 || a->rope.half % (a->head_dim / 32) == 0)) {
        const dim3 grid((blocks + ROW_WARPS - 1) / ROW_WARPS), block(32 * ROW_WARPS);
        switch (a->head_dim) {
        case 64: pdl_launch(kv_encode_warp<64>, grid, block, qu, *a); return;
        case 128: pdl_launch(kv_encode_warp<128>, grid, block, qu, *a); return;
        case 256: pdl_launch(kv_encode_warp<256>, grid, block, qu, *a); return;
        default: return; /* refused by the backend */
        }
    }
    switch (a->head_dim) {
    case 64: pdl_launch(kv_encode<64>, dim3(blocks), dim3(64), qu, *a); break;
    case 128: pdl_launch(kv_encode<128>, dim3(blocks), dim3(128), qu, *a); break;
    case 256: pdl_launch(kv_encode<256>, dim3(blocks), dim3(256), qu, *a); break;
    default: break; /* refused by the backend */
    }
}
