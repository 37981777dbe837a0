/* Programmatic dependent launch (Hopper): a kernel launched with pdl_launch may be
 * scheduled while the kernel before it in the stream is finishing, so its launch
 * and its prologue (a matrix-vector kernel's first weight loads, which depend on
 * nothing) overlap the other's tail. Such a kernel calls griddep_wait() before it
 * reads what earlier kernels wrote or writes anything: the wait returns once the
 * previous grid has completed and its writes are visible. Every kernel launched
 * this way calls griddep_release() first, which lets the next one be scheduled. */
#ifndef KVQ_BACKEND_CUDA_LAUNCH_CUH
#define KVQ_BACKEND_CUDA_LAUNCH_CUH

#include <cuda_runtime.h>

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

template <typename... Params, typename... Args>
static void pdl_launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t s, Args... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = 0;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

#endif
