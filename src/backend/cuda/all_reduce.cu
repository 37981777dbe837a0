/* Small all-reduces through NCCL's device API (all_reduce.h).
 *
 * Each rank's window of symmetric memory has two halves; consecutive all-reduces use
 * alternate halves, so that a rank may copy in the next sum while a slower peer still
 * reads the last one. That is safe one call further on too: rank A copies into half h
 * again at call k + 2 only after its block b met the peers' block b at call k + 1's
 * barrier, which they reach only after their whole call k (every read of half h) has
 * finished, in stream order. The halves are counted on the device (a counter per
 * block, one barrier per block and call), so graphs replay them right. Every rank's
 * block b copies, meets and adds the same elements (a fixed grid), so a block's
 * barrier covers exactly what it reads. */
#ifdef KVQ_HAVE_NCCL
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/all_reduce.h"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0) && __has_include(<nccl_device.h>)
#include <nccl_device.h>

#include "backend/cuda/launch.cuh"

enum {
    AR_BLOCKS = 16,
    AR_THREADS = 256,
};
/* One half of a rank's window: the largest all-reduce it takes. Past 128 KB (four
 * tokens of a 70B model's residual stream, eight of an 8B's) NCCL's ring kernel is the
 * faster inside graphs (docs/tensor-parallel.md). */
static const size_t AR_HALF = (size_t)128 << 10;

struct cuk_reducer {
    int n;
    int dev[CUK_GROUP_MAX];
    ncclComm_t comm[CUK_GROUP_MAX];
    void *buf[CUK_GROUP_MAX];
    ncclWindow_t win[CUK_GROUP_MAX];
    ncclDevComm dc[CUK_GROUP_MAX];
    uint32_t *calls[CUK_GROUP_MAX]; /* a rank's calls so far, a counter per block */
    bool registered, have_dc;
};

__global__ void __launch_bounds__(AR_THREADS) lsa_all_reduce(ncclDevComm dc, ncclWindow_t win, uint32_t *calls,
                                                             float4 *x, size_t n4) {
    griddep_wait(); /* the product's partial sums are written */
    griddep_release();
    __shared__ uint32_t call;
    if (threadIdx.x == 0) call = calls[blockIdx.x];
    __syncthreads();
    const size_t half = (call & 1) * AR_HALF, first = blockIdx.x * (size_t)AR_THREADS + threadIdx.x,
                 step = (size_t)AR_BLOCKS * AR_THREADS;
    float4 *mine = (float4 *)ncclGetLocalPointer(win, half);
    for (size_t i = first; i < n4; i += step) mine[i] = x[i];
    {
        ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), dc, ncclTeamTagLsa(), blockIdx.x);
        bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
    }
    for (size_t i = first; i < n4; i += step) {
        float4 s = __ldcg((const float4 *)ncclGetLsaPointer(win, half, 0) + i);
        for (int r = 1; r < dc.lsaSize; r++) {
            const float4 v = __ldcg((const float4 *)ncclGetLsaPointer(win, half, r) + i);
            s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
        }
        x[i] = s;
    }
    if (threadIdx.x == 0) calls[blockIdx.x] = call + 1;
}

/* The device API is inlined into the kernel, so the structures it reads must be laid
 * out as the running library writes them: 2.28's releases differ among themselves
 * (2.28.9's headers against 2.28.3's library: an illegal address), later ones are
 * told the layout a caller was built with (the requirements' initializer) and serve
 * older ones. */
static bool device_api_matches(int runtime) {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
    return runtime >= NCCL_VERSION_CODE;
#else
    return runtime == NCCL_VERSION_CODE;
#endif
}

/* NCCL's collective setup calls, one a rank, grouped: one thread drives every rank. */
template <typename F> static bool grouped(const cuk_reducer *red, F call) {
    ncclResult_t res = ncclGroupStart();
    for (int r = 0; r < red->n; r++) {
        cudaSetDevice(red->dev[r]);
        const ncclResult_t one = call(r);
        if (res == ncclSuccess) res = one;
    }
    const ncclResult_t end = ncclGroupEnd();
    return res == ncclSuccess && end == ncclSuccess;
}

extern "C" struct cuk_reducer *cuk_reducer_new(const ncclComm_t *comm, const int *dev, int n, char *why,
                                               size_t why_size) {
    int runtime = 0;
    if (ncclGetVersion(&runtime) != ncclSuccess || !device_api_matches(runtime)) {
        snprintf(why, why_size, "NCCL's device API: built with NCCL %d.%d.%d, running %d.%d.%d", NCCL_VERSION_CODE / 10000,
                 NCCL_VERSION_CODE / 100 % 100, NCCL_VERSION_CODE % 100, runtime / 10000, runtime / 100 % 100,
                 runtime % 100);
        return NULL;
    }
    if (n < 2 || n > CUK_GROUP_MAX) {
        snprintf(why, why_size, "%d ranks", n);
        return NULL;
    }
    cuk_reducer *red = (cuk_reducer *)calloc(1, sizeof *red);
    if (!red) {
        snprintf(why, why_size, "out of memory");
        return NULL;
    }
    red->n = n;
    bool ok = true;
    for (int r = 0; r < n && ok; r++) {
        red->dev[r] = dev[r];
        red->comm[r] = comm[r];
        cudaSetDevice(dev[r]);
        ok = ncclMemAlloc(&red->buf[r], 2 * AR_HALF) == ncclSuccess &&
             cudaMalloc((void **)&red->calls[r], AR_BLOCKS * sizeof(uint32_t)) == cudaSuccess &&
             cudaMemset(red->calls[r], 0, AR_BLOCKS * sizeof(uint32_t)) == cudaSuccess;
    }
    const char *failed = ok ? NULL : "symmetric memory (ncclMemAlloc)";
    if (ok) {
        ok = red->registered = grouped(red, [&](int r) {
            return ncclCommWindowRegister(red->comm[r], red->buf[r], 2 * AR_HALF, &red->win[r], NCCL_WIN_COLL_SYMMETRIC);
        });
        if (!ok) failed = "window registration (ncclCommWindowRegister)";
    }
    if (ok) {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
        ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
        ncclDevCommRequirements reqs;
        memset(&reqs, 0, sizeof reqs);
#endif
        reqs.lsaBarrierCount = AR_BLOCKS;
        ok = red->have_dc = grouped(red, [&](int r) { return ncclDevCommCreate(red->comm[r], &reqs, &red->dc[r]); });
        if (!ok) failed = "device communicator (ncclDevCommCreate)";
    }
    for (int r = 0; r < n && ok; r++) /* every rank load/store accessible to every other */
        ok = red->win[r] && red->dc[r].lsaSize == n && red->dc[r].lsaRank == r;
    if (!ok && !failed) failed = "GPUs reachable by loads and stores (NVLink or PCIe peer access)";
    for (int r = 0; r < n && ok; r++) {
        cudaSetDevice(dev[r]);
        ok = cudaDeviceSynchronize() == cudaSuccess;
    }
    if (!ok) {
        snprintf(why, why_size, "%s", failed ? failed : "CUDA");
        cudaGetLastError();
        cuk_reducer_free(red);
        return NULL;
    }
    return red;
}

extern "C" bool cuk_reducer_takes(const struct cuk_reducer *red, void *const *p, size_t bytes) {
    if (!red || bytes == 0 || bytes > AR_HALF || bytes % sizeof(float4) != 0) return false;
    for (int r = 0; r < red->n; r++)
        if ((uintptr_t)p[r] % sizeof(float4) != 0) return false;
    return true;
}

extern "C" cudaError_t cuk_reducer_run(struct cuk_reducer *red, void *const *p, size_t bytes, const cudaStream_t *stream,
                                       bool pdl) {
    cudaError_t err = cudaSuccess;
    for (int r = 0; r < red->n; r++) {
        cudaSetDevice(red->dev[r]);
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(AR_BLOCKS);
        cfg.blockDim = dim3(AR_THREADS);
        cfg.stream = stream[r];
        cfg.attrs = &attr;
        cfg.numAttrs = pdl ? 1 : 0;
        const cudaError_t e = cudaLaunchKernelEx(&cfg, lsa_all_reduce, red->dc[r], red->win[r], red->calls[r],
                                                 (float4 *)p[r], bytes / sizeof(float4));
        if (err == cudaSuccess) err = e;
    }
    return err;
}

extern "C" void cuk_reducer_free(struct cuk_reducer *red) {
    if (!red) return;
    if (red->have_dc) grouped(red, [&](int r) { return ncclDevCommDestroy(red->comm[r], &red->dc[r]); });
    if (red->registered) grouped(red, [&](int r) { return ncclCommWindowDeregister(red->comm[r], red->win[r]); });
    for (int r = 0; r < red->n; r++) {
        cudaSetDevice(red->dev[r]);
        if (red->buf[r]) ncclMemFree(red->buf[r]);
        if (red->calls[r]) cudaFree(red->calls[r]);
    }
    free(red);
}
#else /* an NCCL before 2.28: no device API, NCCL's all-reduce for every sum */
extern "C" struct cuk_reducer *cuk_reducer_new(const ncclComm_t *comm, const int *dev, int n, char *why,
                                               size_t why_size) {
    (void)comm, (void)dev, (void)n;
    snprintf(why, why_size, "NCCL's device API: this kvq was built with NCCL %d.%d (2.28 has it)",
             NCCL_VERSION_CODE / 10000, NCCL_VERSION_CODE / 100 % 100);
    return NULL;
}
extern "C" bool cuk_reducer_takes(const struct cuk_reducer *, void *const *, size_t) { return false; }
extern "C" cudaError_t cuk_reducer_run(struct cuk_reducer *, void *const *, size_t, const cudaStream_t *, bool) {
    return cudaErrorNotSupported;
}
extern "C" void cuk_reducer_free(struct cuk_reducer *) {}
#endif
#endif
