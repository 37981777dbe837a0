/* The largest values of each row of logits (a greedy draw's candidates), so that only
 * they cross to the host: k (value, index) pairs a row instead of the whole row.
 * Order: larger first, of equal values the lower index first, as the host's sampler
 * takes them (a NaN never enters). Two launches: blocks find the best CUK_TOP_MAX of
 * a segment of a row each (a few blocks a row where rows are few, so that one row
 * still reads at the GPU's speed), then a warp a row merges the segments' lists. */
#include <cfloat>
#include <climits>

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
