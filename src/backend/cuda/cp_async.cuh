/* Asynchronous copies from device to shared memory (cp.async, sm_80 and later): a
 * thread issues all of its copies back to back, with no register waiting on any, and
 * cp_async_wait_all() then waits for them together. A loop of load-then-store copies
 * instead waits out one memory latency per iteration. */
#ifndef KVQ_BACKEND_CUDA_CP_ASYNC_CUH
#define KVQ_BACKEND_CUDA_CP_ASYNC_CUH

#include <stdint.h>

static __device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* 16 bytes, cached in L2 only (s and g 16-byte aligned); s also as a shared-memory
 * address (smem_addr) */
static __device__ __forceinline__ void cp_async16(uint32_t s, const void *g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g));
}
static __device__ __forceinline__ void cp_async16(void *s, const void *g) { cp_async16(smem_addr(s), g); }

/* 16 bytes of which the first `bytes` (0 or 16) are copied and the rest zeroed */
static __device__ __forceinline__ void cp_async16_fill(uint32_t s, const void *g, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(g), "r"(bytes));
}
static __device__ __forceinline__ void cp_async16_fill(void *s, const void *g, int bytes) {
    cp_async16_fill(smem_addr(s), g, bytes);
}

/* 8 bytes (s and g 8-byte aligned) */
static __device__ __forceinline__ void cp_async8(void *s, const void *g) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_addr(s)), "l"(g));
}

static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

/* Groups: the copies a thread issued since its last commit form one; wait<N> returns
 * once at most the N groups it committed last are still in flight. */
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

#endif
