/* Programmatic dependent launch (Hopper): a kernel launched with pdl_launch may be
 * scheduled while the kernel before it in the stream is finishing, so its launch
 * and its prologue (a matrix-vector kernel's first weight loads, which depend on
 * nothing) overlap the other's tail. Such a kernel calls griddep_wait() before it
 * reads what earlier kernels wrote or writes anything: the wait returns once the
 * previous grid has completed and its writes are visible. Every kernel launched
 * this way calls griddep_release() first, which lets the next one be scheduled.
 * Before the wait a kernel may read what the host copied in (staged plans, the
 * Hadamard signs: copies precede the kernels that follow them, and no kernel writes
 * these), what stage_fetch_k fetched (the launch after it is a plain one) and what
 * scatter_k placed (a cache's offsets, block tables, window rows):
 * the launch after a scatter is a plain one, which starts once the scatter's writes
 * are visible. A kernel that merely does not release its dependents early gives no
 * such promise: they may start as its blocks exit, before its writes are visible (an
 * intermittent illegal address in 16-sequence prefills read a block table early). */
#ifndef KVQ_BACKEND_CUDA_LAUNCH_CUH
#define KVQ_BACKEND_CUDA_LAUNCH_CUH

#include <cuda_runtime.h>

#include <tuple>
#include <utility>

#include "backend/cuda/queue.h"

/* Whether the current device asks for the first time at a call site whose flags are
 * *seen (a bit per device): a kernel attribute (its shared memory limit) is set per
 * device, and tensor parallelism runs the same kernels on several. */
static inline bool cuk_first_on_device(unsigned *seen) {
    int dev = 0;
    cudaGetDevice(&dev);
    const unsigned bit = 1u << (dev & 31);
    if (*seen & bit) return false;
    *seen |= bit;
    return true;
}

/* Per-item launches (a row, a head) take a warp an item instead of a block of D
 * threads from this many items on: about a wave of such blocks on the largest GPUs
 * (16 a multiprocessor). Below it the blocks all run at once, and a block's chain (a
 * value a thread) is shorter than a warp's (several a lane). */
#define CUK_WARP_ITEMS_MIN 2048
int cuk_warp_items(void); /* cuk_tuning's warp_items, or CUK_WARP_ITEMS_MIN */

static __device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

static __device__ __forceinline__ void griddep_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <typename... Params, size_t... I>
static void queue_launch_tuple(cuk_queue *q, const void *f, dim3 grid, dim3 block, size_t smem, bool pdl,
                               std::tuple<Params...> &t, std::index_sequence<I...>) {
    void *args[sizeof...(Params) + 1] = {(void *)&std::get<I>(t)...};
    const size_t sizes[sizeof...(Params) + 1] = {sizeof(Params)...};
    cuk_queue_launch(q, f, grid, block, smem, pdl, args, sizes, (int)sizeof...(Params));
}

/* kernel<<<grid, block>>>(args...) on the queue (queue.h): launched now or recorded. */
template <typename... Params, typename... Args>
static void queue_launch(void (*kernel)(Params...), dim3 grid, dim3 block, cuk_queue *q, Args... args) {
    std::tuple<Params...> t(static_cast<Params>(args)...);
    queue_launch_tuple(q, (const void *)kernel, grid, block, 0, false, t, std::index_sequence_for<Params...>{});
}

/* The same with programmatic dependent launch. */
template <typename... Params, typename... Args>
static void pdl_launch(void (*kernel)(Params...), dim3 grid, dim3 block, cuk_queue *q, Args... args) {
    std::tuple<Params...> t(static_cast<Params>(args)...);
    queue_launch_tuple(q, (const void *)kernel, grid, block, 0, true, t, std::index_sequence_for<Params...>{});
}

/* The same with smem bytes of dynamic shared memory. */
template <typename... Params, typename... Args>
static void pdl_launch_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cuk_queue *q,
                            Args... args) {
    std::tuple<Params...> t(static_cast<Params>(args)...);
    queue_launch_tuple(q, (const void *)kernel, grid, block, smem, true, t, std::index_sequence_for<Params...>{});
}

#endif
