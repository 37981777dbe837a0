/* Rows of logits settled where they are, so that only what a draw needs crosses to the
 * host. The largest values of each row (a greedy draw's candidates): k (value, index)
 * pairs a row instead of the whole row.
 * Order: larger first, of equal values the lower index first, as the host's sampler
 * takes them (a NaN never enters). Two launches: blocks find the best CUK_TOP_MAX of
 * a segment of a row each (a few blocks a row where rows are few, so that one row
 * still reads at the GPU's speed), then a warp a row merges the segments' lists. */
#include <cfloat>
#include <climits>

#include "backend/backend.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/launch.cuh"

#define K CUK_TOP_MAX
#define TOP_THREADS 512
#define FULL 0xffffffffu

static __device__ __forceinline__ bool better(float a, int ia, float b, int ib) {
    return a > b || (a == b && ia < ib);
}

/* A list of the best K, best first; the empty slots (-inf, INT_MAX) lose to any value. */
struct top_list {
    float v[K];
    int i[K];

    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int j = 0; j < K; j++) v[j] = -INFINITY, i[j] = INT_MAX;
    }
    __device__ __forceinline__ void insert(float x, int ix) {
        if (!better(x, ix, v[K - 1], i[K - 1])) return;
        v[K - 1] = x;
        i[K - 1] = ix;
#pragma unroll
        for (int j = K - 1; j > 0; j--)
            if (better(v[j], i[j], v[j - 1], i[j - 1])) {
                const float tv = v[j];
                const int ti = i[j];
                v[j] = v[j - 1], i[j] = i[j - 1];
                v[j - 1] = tv, i[j - 1] = ti;
            }
    }
    __device__ __forceinline__ void pop() {
#pragma unroll
        for (int j = 0; j < K - 1; j++) v[j] = v[j + 1], i[j] = i[j + 1];
        v[K - 1] = -INFINITY;
        i[K - 1] = INT_MAX;
    }
};

/* The best n (<= K) of the warp's lists into out_v/out_i (lane 0 writes): n rounds,
 * each taking the best head over the lanes, whose lane moves on to its next. Indices
 * are unique across lanes but for empty slots, which only win where fewer than n
 * values are left. */
static __device__ __forceinline__ void warp_best(top_list &l, int n, float *out_v, int *out_i) {
    const int lane = threadIdx.x & 31;
    for (int r = 0; r < n; r++) {
        float bv = l.v[0];
        int bi = l.i[0];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(FULL, bv, off);
            const int oi = __shfl_xor_sync(FULL, bi, off);
            if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
        }
        if (lane == 0) out_v[r] = bv, out_i[r] = bi;
        if (l.i[0] == bi && l.v[0] == bv) l.pop();
    }
}

/* Block (s, r): the best K of row r's segment s of `seg` values, into part[r][s]. */
__global__ void top_segments_k(const float *x, int cols, int seg, float *part_v, int *part_i) {
    griddep_release();
    griddep_wait();
    __shared__ float sv[TOP_THREADS / 32][K];
    __shared__ int si[TOP_THREADS / 32][K];
    const int r = blockIdx.y, s = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const float *row = x + (size_t)r * cols;
    const int lo = s * seg, hi = lo + seg < cols ? lo + seg : cols;
    top_list l;
    l.clear();
#pragma unroll 4
    for (int c = lo + threadIdx.x; c < hi; c += TOP_THREADS) l.insert(row[c], c);
    warp_best(l, K, sv[warp], si[warp]);
    __syncthreads();
    if (warp != 0) return;
    l.clear();
    if (lane < TOP_THREADS / 32)
#pragma unroll
        for (int j = 0; j < K; j++) l.v[j] = sv[lane][j], l.i[j] = si[lane][j];
    const size_t at = ((size_t)r * gridDim.x + s) * K;
    warp_best(l, K, part_v + at, part_i + at);
}

/* Warp w of block b: row b * 4 + w, its n_seg lists merged into the best k. */
__global__ void top_merge_k(const float *part_v, const int *part_i, int n_rows, int n_seg, int k, float *out_v,
                            int *out_i) {
    griddep_release();
    griddep_wait();
    const int r = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (r >= n_rows) return; /* a whole warp */
    top_list l;
    l.clear();
    if (lane < n_seg)
#pragma unroll
        for (int j = 0; j < K; j++) {
            const size_t at = ((size_t)r * n_seg + lane) * K + j;
            l.v[j] = part_v[at], l.i[j] = part_i[at];
        }
    warp_best(l, k, out_v + (size_t)r * k, out_i + (size_t)r * k);
}

extern "C" size_t cuk_top_scratch_bytes(int n) { return (size_t)n * CUK_TOP_SEGMENTS * K * (sizeof(float) + sizeof(int)); }

extern "C" void cuk_top(cuk_queue *qu, const float *x, int n, int cols, int k, float *out_v, int32_t *out_i,
                        void *scratch, int n_sm) {
    if (n <= 0 || k <= 0 || k > K) return;
    /* two blocks a multiprocessor over all rows, whole segments of the threads' stride */
    int n_seg = 2 * n_sm / n;
    if (n_seg < 1) n_seg = 1;
    if (n_seg > CUK_TOP_SEGMENTS) n_seg = CUK_TOP_SEGMENTS;
    int seg = (cols + n_seg - 1) / n_seg;
    seg = (seg + TOP_THREADS - 1) / TOP_THREADS * TOP_THREADS;
    n_seg = (cols + seg - 1) / seg;
    float *part_v = (float *)scratch;
    int *part_i = (int *)(part_v + (size_t)n * n_seg * K);
    pdl_launch(top_segments_k, dim3((unsigned)n_seg, (unsigned)n), dim3(TOP_THREADS), qu, x, cols, seg, part_v, part_i);
    pdl_launch(top_merge_k, dim3((unsigned)((n + 3) / 4)), dim3(128), qu, (const float *)part_v, (const int *)part_i, n,
               n_seg, k, out_v, (int *)out_i);
}


/* ---- draws (backend.h's be_draw), as the host's sampler (sampler.c) makes them ---- */

/* Each row's adjustments in order, a thread a row (a few dozen each), rounded as the
 * host rounds them (no contraction). */
__global__ void adjust_k(float *x, int n, int cols, const be_draw *d, const be_draw_op *ops) {
    griddep_release();
    griddep_wait();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n || d[r].row == BE_ROW_LOGITS || d[r].bans_aside) return;
    float *row = x + (size_t)r * cols;
    for (int j = d[r].op0; j < d[r].op0 + d[r].n_ops; j++) {
        const be_draw_op o = ops[j];
        float *l = row + o.id;
        if (o.kind == BE_ADD) *l = __fadd_rn(*l, o.a);
        else if (o.kind == BE_REPEAT) *l = *l > 0 ? __fdiv_rn(*l, o.a) : __fmul_rn(*l, o.a);
        else if (o.kind == BE_SUB) *l = __fsub_rn(*l, o.a);
        else *l = -INFINITY;
    }
}

extern "C" void cuk_adjust(cuk_queue *qu, float *x, int n, int cols, const be_draw *d, const be_draw_op *ops) {
    pdl_launch(adjust_k, dim3((unsigned)((n + 127) / 128)), dim3(128), qu, x, n, cols, d, ops);
}

/* e^x step for step as the host's exp256 (online_softmax.h) computes it, so that the
 * weights, their sums and the draw come out bit for bit as the host's. */
static __device__ __forceinline__ float exp_as_host(float x) {
    x = fmaxf(x, -87.0f);
    const float n = rintf(__fmul_rn(x, 1.442695041f));
    float r = __fmaf_rn(-n, 0.693145752f, x);
    r = __fmaf_rn(-n, 1.428606765e-6f, r);
    float p = 1.0f / 5040;
    p = __fmaf_rn(p, r, 1.0f / 720);
    p = __fmaf_rn(p, r, 1.0f / 120);
    p = __fmaf_rn(p, r, 1.0f / 24);
    p = __fmaf_rn(p, r, 1.0f / 6);
    p = __fmaf_rn(p, r, 0.5f);
    p = __fmaf_rn(p, r, 1.0f);
    p = __fmaf_rn(p, r, 1.0f);
    return __fmul_rn(p, __uint_as_float((unsigned)((int)n + 127) << 23));
}

#define DRAW_THREADS 256
#define DRAW_BLOCK 64 /* ids a sum covers (sampler.c's BLOCK) */

struct draw_row {
    const float *x;
    int cols, n8; /* the host takes ids past n8 (the last cols % 8) by expf */
    float max, scale;
    const be_draw_op *bans; /* bans_aside: their weights are dropped */
    int n_bans;

    /* The exponent of id i's weight (<= 0 but for banned ids above the largest allowed),
     * and the weight, as kern_exp_shifted makes them. */
    __device__ __forceinline__ float exponent(int i) const { return __fmul_rn(__fsub_rn(x[i], max), scale); }
    __device__ __forceinline__ float weight(int i, float v) const {
        return i < n8 ? exp_as_host(v) : (float)exp((double)v);
    }
    __device__ __forceinline__ float weight(int i) const { return weight(i, exponent(i)); }
    __device__ __forceinline__ bool banned(int id, int before) const {
        for (int j = 0; j < before; j++)
            if (bans[j].id == id) return true;
        return false;
    }
};

/* The sums of each DRAW_BLOCK ids' weights into bs, the block's threads in parallel,
 * eight running sums each as the host keeps them (weights()), each weight also handed
 * to seen(v, w); returns how many sums, the block synchronized after. */
template <typename F>
static __device__ int block_sums(const draw_row &w, double *bs, F seen) {
    const int nb = (w.cols + DRAW_BLOCK - 1) / DRAW_BLOCK;
    for (int b = threadIdx.x; b < nb; b += DRAW_THREADS) {
        const int e = (b + 1) * DRAW_BLOCK < w.cols ? (b + 1) * DRAW_BLOCK : w.cols;
        float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int i = b * DRAW_BLOCK;
        for (; i + 8 <= e; i += 8)
#pragma unroll
            for (int l = 0; l < 8; l++) {
                const float v = w.exponent(i + l), wt = w.weight(i + l, v);
                s[l] = __fadd_rn(s[l], wt);
                seen(v, wt);
            }
        for (; i < e; i++) { /* the last ids of a short block, in the first sum */
            const float v = w.exponent(i), wt = w.weight(i, v);
            s[0] = __fadd_rn(s[0], wt);
            seen(v, wt);
        }
        bs[b] = __fadd_rn(__fadd_rn(__fadd_rn(s[0], s[1]), __fadd_rn(s[2], s[3])),
                          __fadd_rn(__fadd_rn(s[4], s[5]), __fadd_rn(s[6], s[7])));
    }
    __syncthreads();
    return nb;
}

/* The log of the sum of e^x over the row (x as it is, the largest first), in double as
 * the server's log-probabilities take it; every thread of the block gets it. */
static __device__ double log_sum_exp(const float *x, int cols, float max) {
    __shared__ double part[DRAW_THREADS / 32];
    double s = 0;
    for (int i = threadIdx.x; i < cols; i += DRAW_THREADS) s += exp((double)x[i] - (double)max);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(FULL, s, off);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = s;
    __syncthreads();
    s = 0;
    for (int w = 0; w < DRAW_THREADS / 32; w++) s += part[w];
    return (double)max + log(s);
}

/* Block r: row r's log-normalizer when it is a logprobs row, its draw when it is a
 * BE_ROW_DRAW. The blocks' sums of weights in parallel, eight running sums each as the
 * host keeps them; then one thread sums them in order, drops banned weights and walks
 * to where u falls, as draw_index does. */
__global__ void __launch_bounds__(DRAW_THREADS)
    draw_k(const float *x, int cols, const be_draw *d, const be_draw_op *ops, const float *top_v, const int *top_i,
           int *drawn, float *drawn_logit, double *log_z) {
    griddep_release();
    griddep_wait();
    __shared__ double bs[BE_DRAW_MAX_COLS / DRAW_BLOCK];
    const int r = blockIdx.x;
    const be_draw dr = d[r];
    if (dr.logprobs) {
        const double z = log_sum_exp(x + (size_t)r * cols, cols, top_v[r * K]);
        if (threadIdx.x == 0) log_z[r] = z;
    }
    if (dr.row != BE_ROW_DRAW) return;
    draw_row w = {x + (size_t)r * cols, cols, cols / 8 * 8, 0, dr.scale, ops + dr.op0, dr.bans_aside ? dr.n_ops : 0};
    /* the largest (allowed) logit: fewer than K bans leave one among the K largest */
    int j = 0;
    while (j < K - 1 && w.banned(top_i[r * K + j], w.n_bans)) j++;
    const int best = top_i[r * K + j];
    w.max = top_v[r * K + j];
    const int nb = block_sums(w, bs, [](float, float) {});
    if (threadIdx.x != 0) return;
    double sum = 0, dropped = 0;
    for (int b = 0; b < nb; b++) sum += bs[b];
    for (int k = 0; k < w.n_bans; k++) { /* a repeated id drops nothing more */
        const int t = w.bans[k].id;
        const float wt = w.banned(t, k) ? 0.0f : w.weight(t);
        bs[t / DRAW_BLOCK] -= wt;
        dropped += wt;
    }
    double u = dr.u * (sum - dropped);
    for (int b = 0; b < nb; b++) {
        if (u >= bs[b]) {
            u -= bs[b];
            continue;
        }
        const int e = (b + 1) * DRAW_BLOCK < cols ? (b + 1) * DRAW_BLOCK : cols;
        for (int i = b * DRAW_BLOCK; i < e; i++)
            if ((u -= w.banned(i, w.n_bans) ? 0.0f : w.weight(i)) < 0) {
                drawn[r] = i;
                drawn_logit[r] = w.x[i];
                return;
            }
        u = 0; /* rounding left u past the block: the next id with a weight */
    }
    drawn[r] = best;
    drawn_logit[r] = w.x[best];
}

#define CUT_BUCKETS 1024
#define CUT_RANGE 40.0f /* exponents below -40 (weights under e^-40 of the best) are not counted */

/* Block r: row r's candidates when it is a BE_ROW_CUT. The weights' total as draw_k makes
 * it, and a histogram of the weights by exponent; then the point down to which the cut
 * surely lies: where the histogram holds top_p of the total and a thousandth more, or
 * where min-p cuts (with a margin for the host's expf), whichever comes first; with
 * top_k, where it holds top_k tokens (the host cuts those), the bucket there split into
 * CUT_BUCKETS more where it holds too many (a flat row's). The tokens down to it, in
 * no order. */
__global__ void __launch_bounds__(DRAW_THREADS)
    cut_k(const float *x, int cols, const be_draw *d, const float *top_v, double *sum_out, int *n_cand, float *cand_v,
          int *cand_i) {
    griddep_release();
    griddep_wait();
    __shared__ double bs[BE_DRAW_MAX_COLS / DRAW_BLOCK];
    __shared__ float hist[CUT_BUCKETS];
    __shared__ int tokens[CUT_BUCKETS]; /* top_k: the tokens a bucket holds */
    __shared__ int cut_bucket, count, below, sub;
    __shared__ float cut_exp;
    const int r = blockIdx.x;
    const be_draw dr = d[r];
    if (dr.row != BE_ROW_CUT) return;
    for (int b = threadIdx.x; b < CUT_BUCKETS; b += DRAW_THREADS) hist[b] = 0, tokens[b] = 0;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const draw_row w = {x + (size_t)r * cols, cols, cols / 8 * 8, top_v[r * K], dr.scale, nullptr, 0};
    const float per_bucket = CUT_BUCKETS / CUT_RANGE;
    const int nb = block_sums(w, bs, [&](float v, float wt) {
        if (-v * per_bucket < CUT_BUCKETS) { /* top-k counts tokens; top-p and min-p weigh them */
            if (dr.top_k > 0) atomicAdd(&tokens[(int)(-v * per_bucket)], 1);
            else atomicAdd(&hist[(int)(-v * per_bucket)], wt);
        }
    });
    if (threadIdx.x == 0) {
        double sum = 0;
        for (int b = 0; b < nb; b++) sum += bs[b];
        sum_out[r] = sum;
        int bucket = CUT_BUCKETS; /* none */
        double acc = 0;
        float e = INFINITY;
        if (dr.top_k > 0) { /* top-p and min-p cut within the top k */
            for (int b = 0, held = 0; b < CUT_BUCKETS && bucket == CUT_BUCKETS; b++)
                if ((held += tokens[b]) >= dr.top_k) bucket = b, below = held - tokens[b];
        } else {
            for (int b = 0; b < CUT_BUCKETS && dr.top_p < 1.0f && bucket == CUT_BUCKETS; b++)
                if ((acc += hist[b]) >= (double)dr.top_p * sum * 1.001) bucket = b;
            e = dr.min_p > 0 ? -logf(dr.min_p) * 1.0001f + 1e-4f : INFINITY;
            if (bucket < CUT_BUCKETS && (float)(bucket + 1) / per_bucket < e) e = INFINITY; /* top-p's comes first */
            else bucket = CUT_BUCKETS;
        }
        cut_bucket = bucket, cut_exp = e;
    }
    __syncthreads();
    const int bucket = cut_bucket;
    const float e = cut_exp;
    if (bucket == CUT_BUCKETS && e == INFINITY) { /* neither: the row */
        if (threadIdx.x == 0) n_cand[r] = -1;
        return;
    }
    /* top-k: where the bucket holds too many, the tokens of its first `sub` + 1 parts
     * (s - bucket is exact, s < 1025, and so times CUT_BUCKETS) */
    int last = CUT_BUCKETS - 1;
    if (dr.top_k > 0 && below + tokens[bucket] > BE_CUT_MAX) {
        __syncthreads();
        for (int b = threadIdx.x; b < CUT_BUCKETS; b += DRAW_THREADS) tokens[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < cols; i += DRAW_THREADS) {
            const float s = -w.exponent(i) * per_bucket;
            if (s >= bucket && s < bucket + 1) atomicAdd(&tokens[(int)((s - bucket) * CUT_BUCKETS)], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            sub = CUT_BUCKETS - 1; /* they hold the top_k: the first pass counted them */
            for (int b = 0, held = below; b < CUT_BUCKETS; b++)
                if ((held += tokens[b]) >= dr.top_k) {
                    sub = b;
                    break;
                }
        }
        __syncthreads();
        last = sub;
    }
    for (int i = threadIdx.x; i < cols; i += DRAW_THREADS) {
        const float v = w.exponent(i), s = -v * per_bucket;
        if (bucket < CUT_BUCKETS ? s < bucket || (s < bucket + 1 && (int)((s - bucket) * CUT_BUCKETS) <= last)
                                 : -v <= e) {
            const int at = atomicAdd(&count, 1);
            if (at < BE_CUT_MAX) cand_v[(size_t)r * BE_CUT_MAX + at] = w.x[i], cand_i[(size_t)r * BE_CUT_MAX + at] = i;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) n_cand[r] = count > BE_CUT_MAX ? -1 : count | (bucket == CUT_BUCKETS ? BE_CUT_ALL : 0);
}

extern "C" void cuk_cut(cuk_queue *qu, const float *x, int n, int cols, const be_draw *d, const float *top_v,
                        double *sum, int32_t *n_cand, float *cand_v, int32_t *cand_i) {
    pdl_launch(cut_k, dim3((unsigned)n), dim3(DRAW_THREADS), qu, x, cols, d, top_v, sum, (int *)n_cand, cand_v,
               (int *)cand_i);
}

extern "C" void cuk_draw(cuk_queue *qu, const float *x, int n, int cols, const be_draw *d, const be_draw_op *ops,
                         const float *top_v, const int32_t *top_i, int32_t *drawn, float *drawn_logit, double *log_z) {
    pdl_launch(draw_k, dim3((unsigned)n), dim3(DRAW_THREADS), qu, x, cols, d, ops, top_v, (const int *)top_i,
               (int *)drawn, drawn_logit, log_z);
}
