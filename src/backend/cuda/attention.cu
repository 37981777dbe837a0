/* Split-K attention over a paged KV cache whose rows may be packed (kv_quant.h's row
 * format), for query tokens of different sequences and lengths in one launch.
 *
 * Each query head is first scaled, rotated as the keys are and its q.mu computed,
 * once (not in every split): by the KV append's launch (kv_encode.cu), or else by
 * attn_prep_q. A block then takes one (token, KV head, up to 8
 * query heads of its group) and one split of the rows that token reads (as many
 * splits as fill one wave of resident blocks), so each K/V row is read once for all
 * the query heads that share it. Lanes work in subgroups of D/8: a subgroup holds one
 * row, each lane 8 of its values, decoded straight from the packed codes (scale *
 * code + bias per group). Every subgroup keeps its own online softmax; the block
 * merges its subgroups, and attn_combine merges the splits with a log-sum-exp, applies
 * the inverse rotation of the values and adds the value offset weighted by the packed
 * rows' share of the softmax mass (the float path of kv_attend.c, exactly). */
#include <cuda_fp16.h>
#include <math.h>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/hadamard.cuh"
#include "backend/cuda/nf_rows.cuh"
#include "backend/cuda/qk_prep.cuh"
#include "backend/cuda/round_x.cuh"

#define WARPS 4
#define HEADS_MAX 8 /* query heads per block */
#define MAX_SPLITS ATTN_MAX_SPLITS
#define BT ATTN_BT

static __device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

/* Values [e0, e0 + 8) of a row of D values in `bits` (BITS when known at compile time);
 * group KERN_KVQ_NF: a normal-float row (its codes index the level bytes). */
template <int BITS>
static __device__ __forceinline__ void load8(const uint8_t *row, int e0, int D, int bits, int group, float v[8]) {
    const int b = BITS ? BITS : bits;
    if (b == 16) {
        uint4 u = *(const uint4 *)(row + e0 * 2);
        const __half2 *h = (const __half2 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            v[2 * i] = f.x;
            v[2 * i + 1] = f.y;
        }
        return;
    }
    if (b == 32) {
        float4 x = *(const float4 *)(row + e0 * 4), y = *(const float4 *)(row + e0 * 4 + 16);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
        return;
    }
    const uint8_t *c = row + (e0 / 8) * b; /* 8 codes take `b` bytes, LSB first */
    uint64_t w = 0;
    if (BITS == 4) {
        w = *(const uint32_t *)c;
    } else if (BITS == 8) {
        w = (uint64_t)*(const uint32_t *)c | (uint64_t)*(const uint32_t *)(c + 4) << 32;
    } else {
        for (int i = 0; i < b; i++) w |= (uint64_t)c[i] << (8 * i);
    }
    const uint32_t mask = (1u << b) - 1;
    if (!BITS && group == KERN_KVQ_NF) {
        const uint8_t *u = nf_levels(b);
        const float sc = nf_scale(row[D * b / 8]), bias = -127.5f * sc;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = sc * (float)u[(uint32_t)(w >> (b * i)) & mask] + bias;
        return;
    }
    const uint8_t *sb = row + D * b / 8 + 4 * (e0 / group);
    const float sc = h2f(*(const uint16_t *)sb), bias = h2f(*(const uint16_t *)(sb + 2));
    /* code as float without the conversion instruction (an eighth of the FMA rate):
     * the code in the mantissa of 2^23, then 2^23 subtracted, exactly */
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = sc * (__uint_as_float(0x4B000000u | ((uint32_t)(w >> (b * i)) & mask)) - 8388608.0f) + bias;
}

/* The rows a token reads (N), and the rows of each split: a multiple of the block
 * size, so splits past the rows have nothing to do. The grid does not depend on the
 * depth (a recorded decode step replays as it is while the cache grows). */
static __device__ __forceinline__ void split_rows(const cuk_attn_tok &tk, int n_splits, int &N, int &chunk) {
    const int n1 = max(0, tk.b1 - tk.a1 + 1), n2 = max(0, tk.b2 - tk.a2 + 1);
    N = n1 + n2 + tk.sinks + max(0, tk.q_pos - tk.ws + 1);
    chunk = ((N + n_splits - 1) / n_splits + BT - 1) / BT * BT;
}

#define visible attn_visible

/* The queries' preparation where the KV append did not make it: once per (token, query
 * head), not in every split. A warp a head (a block a head waited on barriers), lane l
 * holding values [E l, E l + E), with prep_head's arithmetic in its order (qk_prep.cuh),
 * so the same bits: q.mu summed in the pairs prep_head's 32-value warps sum, then
 * their parts in order; the rotation by hadamard_warp. */
#define PREP_WARPS 4
template <int D>
__global__ void attn_prep_q(const cuk_attn_args a) {
    griddep_release();
    griddep_wait();
    constexpr int E = D / 32;
    const int lane = threadIdx.x % 32, at = blockIdx.x * PREP_WARPS + threadIdx.x / 32;
    if (at >= a.n * a.n_head) return;
    const int ti = at / a.n_head, h = at % a.n_head, t = a.tok_index[ti], kvh = h / (a.n_head / a.n_kv);
    const float *const mu = a.k_bits < 16 && a.toks[ti].mu ? (const float *)a.toks[ti].mu + (size_t)kvh * D : nullptr;
    const float *const q = a.q + ((size_t)t * a.n_head + h) * D + E * lane;
    float v[E];
#pragma unroll
    for (int k = 0; k < E; k++) v[k] = q[k];
    prep_head_warp<D>(v, a.scale, mu, a.k_rot ? a.signs : nullptr, a.qprep + ((size_t)t * a.n_head + h) * (D + 1));
}

static void launch_prep(cuk_queue *qu, const cuk_attn_args *a, int D) {
    if (a->q_prepped) return;
    const dim3 grid((unsigned)((a->n * a->n_head + PREP_WARPS - 1) / PREP_WARPS)), block(32 * PREP_WARPS);
    if (D == 64) pdl_launch(attn_prep_q<64>, grid, block, qu, *a);
    else if (D == 128) pdl_launch(attn_prep_q<128>, grid, block, qu, *a);
    else pdl_launch(attn_prep_q<256>, grid, block, qu, *a);
}

/* HMAX: query heads per block (the group's, rounded up to a power of two, at most 8). */
template <int D, int KB, int VB, int HMAX>
__global__ void __launch_bounds__(WARPS * 32, HMAX <= 4 ? 4 : 2) attn_split(const cuk_attn_args a, int n_splits, int n_hch, bool prepped) {
    griddep_release();
    griddep_wait();
    constexpr int LPR = D / 8, RPW = 32 / LPR, SUBS = WARPS * RPW;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / LPR, e0 = (lane % LPR) * 8;
    int item = blockIdx.x;
    const int hc = item % n_hch;
    item /= n_hch;
    const int kvh = item % a.n_kv, ti = item / a.n_kv, split = blockIdx.y;
    const int group = a.n_head / a.n_kv, h0 = kvh * group + hc * HMAX;
    const int G = min(HMAX, group - hc * HMAX);
    const cuk_attn_tok tk = a.toks[ti];

    __shared__ float sm_m[SUBS][HMAX], sm_l[SUBS][HMAX], sm_lp[SUBS][HMAX];
    __shared__ float sm_acc[SUBS][HMAX][D];
    /* q prepared (scaled, rotated like the keys, and q.mu), or as it is for unrotated
     * float keys */
    const float *qp = prepped ? attn_qprep(a, ti, 0) : a.q + (size_t)a.tok_index[ti] * a.n_head * D;
    const int q_stride = prepped ? D + 1 : D, q0 = prepped ? 1 : 0;
    const float q_scale = prepped ? 1.0f : a.scale;
    float qmu[HMAX];
    float qr[HMAX][8], m[HMAX], l[HMAX], lp[HMAX], acc[HMAX][8];
#pragma unroll
    for (int g = 0; g < HMAX; g++) {
        const float *qg = qp + (size_t)(h0 + (g < G ? g : 0)) * q_stride;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qr[g][i] = g < G ? qg[q0 + e0 + i] * q_scale : 0.0f;
            acc[g][i] = 0;
        }
        qmu[g] = g < G && prepped ? qg[0] : 0.0f;
        m[g] = -INFINITY;
        l[g] = lp[g] = 0;
    }
    const int n1 = max(0, tk.b1 - tk.a1 + 1), n2 = max(0, tk.b2 - tk.a2 + 1), ns = tk.sinks, np = n1 + n2;
    int N, chunk;
    split_rows(tk, n_splits, N, chunk);
    const int v0 = split * chunk, v1 = min(N, v0 + chunk);
    if (v0 >= N) return; /* attn_combine reads only the splits with rows */
    const uint64_t *table = (const uint64_t *)tk.table;

    /* RB rows per subgroup per step: their loads are in flight together, and one
     * rescale of the running sums serves them all */
    constexpr int RB = 2;
    for (int vb = v0; vb < v1; vb += SUBS * RB) {
        bool valid[RB], packed[RB];
        float kv[RB][8], vv[RB][8];
#pragma unroll
        for (int r = 0; r < RB; r++) {
            const int v = vb + r * SUBS + warp * RPW + sub;
            valid[r] = v < v1;
            packed[r] = v < np;
            const uint8_t *kp = nullptr, *vp = nullptr;
            if (valid[r]) {
                if (packed[r]) {
                    const int p = v < n1 ? tk.a1 + v : tk.a2 + v - n1;
                    const int L = p / BT, e = L < tk.nkb ? L : L - tk.base;
                    const uint8_t *hb = (const uint8_t *)table[e] + (size_t)kvh * a.head_bytes;
                    kp = hb + (size_t)(p % BT) * a.k_row;
                    vp = hb + (size_t)BT * a.k_row + (size_t)(p % BT) * a.v_row;
                } else {
                    const bool sink = v < np + ns;
                    const int p = sink ? v - np : tk.ws + (v - np - ns);
                    valid[r] = visible(p, tk.q_pos, tk);
                    const int cap = sink ? tk.sink_cap : tk.ring_cap, slot = sink ? p : p % cap;
                    const uint8_t *base = (const uint8_t *)(sink ? tk.sink : tk.ring);
                    kp = base + ((size_t)kvh * cap + slot) * a.win_row;
                    vp = base + ((size_t)(a.n_kv + kvh) * cap + slot) * a.win_row;
                }
            }
#pragma unroll
            for (int i = 0; i < 8; i++) kv[r][i] = vv[r][i] = 0;
            if (valid[r]) {
                if (packed[r]) {
                    load8<KB>(kp, e0, D, a.k_bits, a.k_group, kv[r]);
                    load8<VB>(vp, e0, D, a.v_bits, a.v_group, vv[r]);
                } else {
                    load8<16>(kp, e0, D, 16, 0, kv[r]);
                    load8<16>(vp, e0, D, 16, 0, vv[r]);
                }
            }
        }
        float s[RB][HMAX];
#pragma unroll
        for (int r = 0; r < RB; r++)
#pragma unroll
            for (int g = 0; g < HMAX; g++) {
                float x = 0;
#pragma unroll
                for (int i = 0; i < 8; i++) x += qr[g][i] * kv[r][i];
                s[r][g] = x;
            }
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1)
#pragma unroll
            for (int r = 0; r < RB; r++)
#pragma unroll
                for (int g = 0; g < HMAX; g++) s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], o);
#pragma unroll
        for (int g = 0; g < HMAX; g++) {
            if (g >= G) break;
            float mx = m[g];
#pragma unroll
            for (int r = 0; r < RB; r++) {
                s[r][g] = valid[r] ? s[r][g] + (packed[r] ? qmu[g] : 0.0f) : -INFINITY;
                mx = fmaxf(mx, s[r][g]);
            }
            if (mx == -INFINITY) continue; /* nothing seen yet */
            const float c = __expf(m[g] - mx);
            l[g] *= c;
            lp[g] *= c;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] *= c;
#pragma unroll
            for (int r = 0; r < RB; r++) {
                const float pr = __expf(s[r][g] - mx); /* 0 for rows not seen */
                l[g] += pr;
                lp[g] += packed[r] ? pr : 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] += pr * vv[r][i];
            }
            m[g] = mx;
        }
    }

    const int sid = warp * RPW + sub;
#pragma unroll
    for (int g = 0; g < HMAX; g++) {
        if (lane % LPR == 0) {
            sm_m[sid][g] = m[g];
            sm_l[sid][g] = l[g];
            sm_lp[sid][g] = lp[g];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) sm_acc[sid][g][e0 + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float M = -INFINITY;
        for (int j = 0; j < SUBS; j++) M = fmaxf(M, sm_m[j][g]);
        float L = 0, LP = 0, A = 0;
        for (int j = 0; j < SUBS; j++) {
            const float w = sm_m[j][g] == -INFINITY ? 0.0f : __expf(sm_m[j][g] - M);
            L += sm_l[j][g] * w;
            LP += sm_lp[j][g] * w;
            A += sm_acc[j][g][d] * w;
        }
        float *part = attn_part(a, ti, h0 + g, n_splits, split);
        part[4 + d] = A;
        if (d == 0) {
            part[0] = M;
            part[1] = L;
            part[2] = LP;
            part[3] = (float)((N + chunk - 1) / chunk);
        }
    }
}

/* A block of D threads per (launch token, query head). Warp 0 takes a split a lane
 * (their maxima, weights and sums at once); then each thread sums four values over
 * a quarter of the splits, with SB loads in flight, the first SB of them issued
 * with warp 0's: one round trip to L2 where there are up to 4 SB splits (decode
 * at depth 4096 and 16384 has 32 with rows), not two. */
template <int D>
__global__ void attn_combine(const cuk_attn_args a, int n_splits) {
    griddep_release();
    constexpr int SB = 8;
    const int ti = blockIdx.x / a.n_head, h = blockIdx.x % a.n_head, d = threadIdx.x, lane = d % 32;
    /* staged step data (uploaded before the step's kernels): read before the wait */
    const int t = a.tok_index[ti], kvh = h / (a.n_head / a.n_kv);
    const float *mu = (const float *)a.toks[ti].mu;
    /* and so are the value offsets and signs (scatter_k, copies), so their loads are
     * not a round trip at the end */
    const float vmu = mu && a.v_bits < 16 ? mu[(size_t)(a.n_kv + kvh) * D + d] : 0.0f;
    const float sign = a.v_rot ? a.signs[d] : 1.0f;
    __shared__ __align__(16) float o4[4 * D]; /* four partial sums of each value */
    __shared__ float wt[MAX_SPLITS], ll[2];
    griddep_wait();
    const float *part = attn_part(a, ti, h, n_splits, 0);
    /* thread d: values 4 (d % (D / 4)) .. + 3 of every fourth split from d / (D / 4);
     * those of splits without rows are loaded here too, and left out below */
    const int c = d % (D / 4), s1 = d / (D / 4);
    float4 v[SB];
#pragma unroll
    for (int k = 0; k < SB; k++)
        v[k] = s1 + 4 * k < n_splits ? *(const float4 *)(part + (size_t)(s1 + 4 * k) * (D + 4) + 4 + 4 * c)
                                     : make_float4(0, 0, 0, 0);
    __shared__ int ns; /* the splits that had rows (split 0 says) */
    if (d < 32) {
        /* every split's (M, L, LP, n) at once, then those past the ones with rows
         * (left from earlier launches) dropped */
        float4 ps[MAX_SPLITS / 32];
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; k++)
            ps[k] = lane + 32 * k < n_splits ? *(const float4 *)(part + (size_t)(lane + 32 * k) * (D + 4))
                                            : make_float4(-INFINITY, 0, 0, 0);
        const int n = (int)__shfl_sync(0xffffffffu, ps[0].w, 0);
        float m = -INFINITY;
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; k++) {
            if (lane + 32 * k >= n) ps[k] = make_float4(-INFINITY, 0, 0, 0);
            m = fmaxf(m, ps[k].x);
        }
        if (lane == 0) ns = n;
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        float L = 0, LP = 0;
#pragma unroll
        for (int k = 0; k < MAX_SPLITS / 32; k++) {
            const float f = ps[k].x == -INFINITY ? 0.0f : __expf(ps[k].x - m);
            if (lane + 32 * k < n) wt[lane + 32 * k] = f;
            L += ps[k].y * f;
            LP += ps[k].z * f;
        }
        for (int off = 16; off > 0; off >>= 1) {
            L += __shfl_xor_sync(0xffffffffu, L, off);
            LP += __shfl_xor_sync(0xffffffffu, LP, off);
        }
        if (lane == 0) ll[0] = L, ll[1] = LP;
    }
    __syncthreads();
    {
        float4 acc = make_float4(0, 0, 0, 0);
        for (int s0 = s1; s0 < ns; s0 += 4 * SB) {
            if (s0 > s1)
#pragma unroll
                for (int k = 0; k < SB; k++)
                    if (s0 + 4 * k < ns) v[k] = *(const float4 *)(part + (size_t)(s0 + 4 * k) * (D + 4) + 4 + 4 * c);
#pragma unroll
            for (int k = 0; k < SB; k++)
                if (s0 + 4 * k < ns) {
                    const float f = wt[s0 + 4 * k];
                    acc.x += v[k].x * f, acc.y += v[k].y * f, acc.z += v[k].z * f, acc.w += v[k].w * f;
                }
        }
        *(float4 *)(o4 + s1 * D + 4 * c) = acc;
    }
    __syncthreads();
    const float L = ll[0];
    float r = L > 0 ? (o4[d] + o4[D + d] + o4[2 * D + d] + o4[3 * D + d]) / L : 0.0f;
    if (a.v_rot) { /* r <- diag(signs) H r / sqrt(D) */
        __shared__ float x[D];
        r = hadamard_block<D>(r, x) * sign;
    }
    if (mu && a.v_bits < 16 && L > 0) r += ll[1] / L * vmu;
    const size_t at = ((size_t)t * a.n_head + h) * D + d;
    if (a.out) a.out[at] = r;
    if (a.xq.q) round_x32(r, a.xq.q + (at & ~(size_t)31), a.xq.dsum + at / 32); /* D threads: whole warps */
    store_half(r, (int64_t)at, a.xq.h, a.xq.h_wide);
}

/* attn_combine for launches of at most COMBINE_WARP_SPLITS splits with head size 128
 * and at least cuk_warp_items() (token, head) items (prefill passes and wide decode
 * steps, where the splits are few and the items many): a warp an item, lane l holding
 * values 4 l .. 4 l + 3, so no barrier and four times the items a multiprocessor. The
 * same operations in the same order as attn_combine (the products rounded, then summed
 * in split order; the rotation by hadamard_warp), so the same bits. */
#define COMBINE_WARP_SPLITS 4
__global__ void attn_combine_warp(const cuk_attn_args a, int n_splits) {
    griddep_release();
    constexpr int D = 128;
    const int item = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (item >= a.n * a.n_head) return;
    const int ti = item / a.n_head, h = item % a.n_head, d0 = 4 * lane;
    const int t = a.tok_index[ti], kvh = h / (a.n_head / a.n_kv);
    const float *mu = (const float *)a.toks[ti].mu;
    float vmu[4], sign[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        vmu[k] = mu && a.v_bits < 16 ? mu[(size_t)(a.n_kv + kvh) * D + d0 + k] : 0.0f;
        sign[k] = a.v_rot ? a.signs[d0 + k] : 1.0f;
    }
    griddep_wait();
    const float *part = attn_part(a, ti, h, n_splits, 0);
    const float4 ps =
        lane < n_splits ? *(const float4 *)(part + (size_t)lane * (D + 4)) : make_float4(-INFINITY, 0, 0, 0);
    float4 v[COMBINE_WARP_SPLITS];
#pragma unroll
    for (int s = 0; s < COMBINE_WARP_SPLITS; s++)
        v[s] = s < n_splits ? *(const float4 *)(part + (size_t)s * (D + 4) + 4 + d0) : make_float4(0, 0, 0, 0);
    const int n = (int)__shfl_sync(0xffffffffu, ps.w, 0); /* the splits that had rows */
    const float ms = lane < n ? ps.x : -INFINITY;
    float m = ms;
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float f = ms == -INFINITY ? 0.0f : __expf(ms - m);
    float L = lane < n ? ps.y * f : 0.0f, LP = lane < n ? ps.z * f : 0.0f;
    for (int off = 16; off > 0; off >>= 1) {
        L += __shfl_xor_sync(0xffffffffu, L, off);
        LP += __shfl_xor_sync(0xffffffffu, LP, off);
    }
    float r[4]; /* ((t0 + t1) + t2) + t3, t_s = v_s f_s rounded, +0 for splits without rows */
#pragma unroll
    for (int s = 0; s < COMBINE_WARP_SPLITS; s++) {
        const float fs = __shfl_sync(0xffffffffu, f, s);
        const float t[4] = {s < n ? __fmul_rn(v[s].x, fs) : 0.0f, s < n ? __fmul_rn(v[s].y, fs) : 0.0f,
                            s < n ? __fmul_rn(v[s].z, fs) : 0.0f, s < n ? __fmul_rn(v[s].w, fs) : 0.0f};
#pragma unroll
        for (int k = 0; k < 4; k++) r[k] = s == 0 ? t[k] : __fadd_rn(r[k], t[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) r[k] = L > 0 ? r[k] / L : 0.0f;
    if (a.v_rot) {
        hadamard_warp<D>(r);
#pragma unroll
        for (int k = 0; k < 4; k++) r[k] = r[k] * sign[k];
    }
    if (mu && a.v_bits < 16 && L > 0)
#pragma unroll
        for (int k = 0; k < 4; k++) r[k] += LP / L * vmu[k];
    const size_t at = ((size_t)t * a.n_head + h) * D + d0;
    if (a.out) *(float4 *)(a.out + at) = make_float4(r[0], r[1], r[2], r[3]);
    if (a.xq.q) round_x4(r, true, a.xq.q + (at & ~(size_t)31), a.xq.dsum + at / 32);
#pragma unroll
    for (int k = 0; k < 4; k++) store_half(r[k], (int64_t)(at + k), a.xq.h, a.xq.h_wide);
}

/* The splits' merge: attn_combine_warp where it takes them. */
template <int D>
static void launch_combine(cuk_queue *qu, const cuk_attn_args *a, int n_splits) {
    const int items = a->n * a->n_head;
    if (D == 128 && n_splits <= COMBINE_WARP_SPLITS && items >= cuk_warp_items())
        pdl_launch(attn_combine_warp, dim3((unsigned)((items + 3) / 4)), dim3(128), qu, *a, n_splits);
    else pdl_launch(attn_combine<D>, dim3((unsigned)items), dim3(D), qu, *a, n_splits);
}

static int heads_per_block(const cuk_attn_args *a) {
    const int group = a->n_head / a->n_kv;
    return group >= 8 ? 8 : group >= 4 ? 4 : group >= 2 ? 2 : 1;
}

/* Splits of each (token, KV head, head chunk) item: as many as keep the chip's
 * resident blocks busy in one wave (a second, partial wave would double the time);
 * split_rows gives each at least a block of rows. */
static int splits_for(const cuk_attn_args *a, int resident_per_sm) {
    const int hb = heads_per_block(a), n_hch = (a->n_head / a->n_kv + hb - 1) / hb;
    const long items = (long)a->n * a->n_kv * n_hch;
    long s = (long)resident_per_sm * a->n_sm / items;
    if (s > MAX_SPLITS) s = MAX_SPLITS;
    return s < 1 ? 1 : (int)s;
}

/* Blocks of a kernel resident on one multiprocessor (asked once per kernel). */
template <typename K>
static int resident(K kernel, int *cache) {
    if (*cache == 0 && cudaOccupancyMaxActiveBlocksPerMultiprocessor(cache, kernel, WARPS * 32, 0) != cudaSuccess)
        *cache = 1;
    return *cache > 0 ? *cache : 1;
}

template <int D, int KB, int VB, int HMAX>
static void launch_split(cuk_queue *qu, const cuk_attn_args *a) {
    static int per_sm;
    const int hb = heads_per_block(a), n_hch = (a->n_head / a->n_kv + hb - 1) / hb;
    const int n_splits = splits_for(a, resident(attn_split<D, KB, VB, HMAX>, &per_sm));
    const bool prep = a->k_rot || a->k_bits < 16; /* packed keys may have offsets */
    if (prep) launch_prep(qu, a, D);
    pdl_launch(attn_split<D, KB, VB, HMAX>, dim3((unsigned)(a->n * a->n_kv * n_hch), (unsigned)n_splits),
               dim3(WARPS * 32), qu, *a, n_splits, n_hch, prep);
    launch_combine<D>(qu, a, n_splits);
}

template <int D, int KB, int VB>
static void launch(cuk_queue *qu, const cuk_attn_args *a) {
    switch (heads_per_block(a)) {
    case 1: launch_split<D, KB, VB, 1>(qu, a); break;
    case 2: launch_split<D, KB, VB, 2>(qu, a); break;
    case 4: launch_split<D, KB, VB, 4>(qu, a); break;
    default: launch_split<D, KB, VB, 8>(qu, a); break;
    }
}

template <int D>
static void launch_formats(cuk_queue *qu, const cuk_attn_args *a) {
    if (attn_tile_takes(a)) { /* tensor cores */
        if (attn_tile_prepped(a)) launch_prep(qu, a, D);
        const int n_splits = attn_tile_launch(qu, a);
        launch_combine<D>(qu, a, n_splits);
        return;
    }
    const int kb = a->k_bits, vb = a->v_bits;
    /* packed rows must sit on 4-byte boundaries for the word loads of 4 and 8 bits;
     * normal-float rows take the generic loads */
    const bool aligned = a->k_row % 4 == 0 && a->v_row % 4 == 0 && a->head_bytes % 16 == 0 &&
                         a->k_group != KERN_KVQ_NF && a->v_group != KERN_KVQ_NF;
    if (kb == 16 && vb == 16) launch<D, 16, 16>(qu, a);
    else if (aligned && kb == 8 && vb == 8) launch<D, 8, 8>(qu, a);
    else if (aligned && kb == 8 && vb == 4) launch<D, 8, 4>(qu, a);
    else if (aligned && kb == 4 && vb == 4) launch<D, 4, 4>(qu, a);
    else launch<D, 0, 0>(qu, a);
}

extern "C" int cuk_attention_head_dim_supported(int head_dim) {
    return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

extern "C" size_t cuk_attention_scratch_floats(int n, int n_head, int head_dim, int n_sm) {
    /* items x splits <= max(items, resident blocks), items <= n n_head, resident
     * <= 32 n_sm (the hardware's limit of blocks per multiprocessor) */
    const size_t split_rows = (size_t)n * n_head > 32 * (size_t)n_sm * 8 ? (size_t)n * n_head : 32 * (size_t)n_sm * 8;
    return split_rows * (size_t)(head_dim + 4);
}

extern "C" size_t cuk_qprep_floats(int n, int n_head, int head_dim) { return (size_t)n * n_head * (head_dim + 1); }

extern "C" void cuk_attention(cuk_queue *qu, const cuk_attn_args *a) {
    if (a->n <= 0) return;
    switch (a->head_dim) {
    case 64: launch_formats<64>(qu, a); break;
    case 128: launch_formats<128>(qu, a); break;
    case 256: launch_formats<256>(qu, a); break;
    default: break; /* refused when the backend starts */
    }
}
