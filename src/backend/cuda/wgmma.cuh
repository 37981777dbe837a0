/* Warpgroup tensor-core products (wgmma, sm_90a): an m64nNk16 product whose A (64 x
 * 16, f16) comes from the registers of the warpgroup's 4 warps, each 16 rows with
 * the fragment layout of mma.m16n8k16 (mma.cuh), and whose B (16 x N, f16) is read
 * from shared memory through a descriptor; f32 sums, d[i] of warp w at row 16 w + g
 * + 8 ((i / 2) % 2), column 8 (i / 4) + 2 t + i % 2. The product runs asynchronously:
 * wg_fence() orders the registers written before it, wg_commit() closes a group of
 * products, wg_wait<N>() returns once at most N groups are in flight. */
#ifndef KVQ_BACKEND_CUDA_WGMMA_CUH
#define KVQ_BACKEND_CUDA_WGMMA_CUH

#include <stdint.h>

#include "backend/cuda/cp_async.cuh"

/* Whether this compilation has wgmma (sm_90a; a build for compute_90 PTX has not). */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVQ_WGMMA 1
#else
#define KVQ_WGMMA 0
#endif

/* B's descriptor for a K-major tile without swizzling: 8 x 16-byte core matrices,
 * lbo bytes from one to the next along k, sbo along n. */
static __device__ __forceinline__ uint64_t wg_desc(const void *smem, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((smem_addr(smem) & 0x3FFFF) >> 4) | (uint64_t)(lbo >> 4) << 16 | (uint64_t)(sbo >> 4) << 32;
}

static __device__ __forceinline__ void wg_fence() {
#if KVQ_WGMMA
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
static __device__ __forceinline__ void wg_commit() {
#if KVQ_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
static __device__ __forceinline__ void wg_wait() {
#if KVQ_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
/* Writes to shared memory by ordinary stores or cp.async, made visible to wgmma's reads. */
static __device__ __forceinline__ void fence_async_shared() {
#if KVQ_WGMMA
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
/* An accumulator read after wg_wait: its uses stay after the wait. */
static __device__ __forceinline__ void wg_pin(float &r) { asm volatile("" : "+f"(r)::"memory"); }
/* A fragment's register kept until here (after the wait for the products that read
 * it), so that nothing else is given it while they run; a use, not a definition, so
 * that ptxas need not serialize the products. */
static __device__ __forceinline__ void wg_keep(uint32_t r) { asm volatile("" ::"r"(r)); }

/* d += A B, N tokens (columns of B). */
template <int N>
static __device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);

template <>
__device__ __forceinline__ void wgmma_f16<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
#if KVQ_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
}

template <>
__device__ __forceinline__ void wgmma_f16<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t desc) {
#if KVQ_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
}

template <>
__device__ __forceinline__ void wgmma_f16<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#if KVQ_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
}

template <>
__device__ __forceinline__ void wgmma_f16<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
#if KVQ_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#endif
}

#endif
