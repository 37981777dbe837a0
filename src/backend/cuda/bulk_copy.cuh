/* Hopper's copy engine (the tensor memory accelerator) and the barriers that count its
 * bytes: one thread starts a copy of a box of a tensor described by a CUtensorMap
 * (cp.async.bulk.tensor) into this block's shared memory; the copy adds its bytes to
 * an mbarrier there, whose phase completes once every expected arrival and byte is in.
 * Threads wait on a phase by its parity. */
#ifndef KVQ_BACKEND_CUDA_BULK_COPY_CUH
#define KVQ_BACKEND_CUDA_BULK_COPY_CUH

#include <cuda.h>
#include <stdint.h>

#include "backend/cuda/cp_async.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVQ_BULK 1
#else
#define KVQ_BULK 0
#endif

/* Barriers are 8-byte words of shared memory named by their shared address. */
static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
#if KVQ_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
#endif
}
/* Initialized barriers made visible to the copy engine (before a __syncthreads). */
static __device__ __forceinline__ void mbar_init_fence() {
#if KVQ_BULK
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
/* One arrival that also expects `bytes` more of copies in the current phase. */
static __device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
#if KVQ_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
/* One arrival where `on` (else none): a predicate, not a branch, so that it can sit
 * between warpgroup products without ptxas serializing them (C7513). */
static __device__ __forceinline__ void mbar_arrive(uint32_t bar, uint32_t on) {
#if KVQ_BULK
    asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}" ::"r"(bar), "r"(on)
                 : "memory");
#endif
}
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if KVQ_BULK
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
#endif
}

/* The box of a 2-D tensor map at (x, y) (x the inner dimension) to dst, counted on bar. */
static __device__ __forceinline__ void bulk_box(uint32_t dst, const CUtensorMap *map, int x, int y, uint32_t bar) {
#if KVQ_BULK
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(map), "r"(x), "r"(y), "r"(bar)
                 : "memory");
#endif
}

/* The box of a 3-D tensor map at (x, y, z) to dst in this block, counted on bar. */
static __device__ __forceinline__ void bulk_box3(uint32_t dst, const CUtensorMap *map, int x, int y, int z,
                                                 uint32_t bar) {
#if KVQ_BULK
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
                 : "memory");
#endif
}

#endif
