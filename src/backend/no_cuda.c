/* Builds without -DKVQ_CUDA=ON: asking for the CUDA backend is a clear error. */
#include "backend/backend.h"
#include "core/error.h"

#ifndef KVQ_HAVE_CUDA
struct backend *backend_cuda_new(int n_threads, bool f16_weights, int tp, const int *devices) {
    (void)n_threads, (void)f16_weights, (void)tp, (void)devices;
    kvq_error_code(KVQ_ERR_UNSUPPORTED, "this kvq was built without CUDA: configure with -DKVQ_CUDA=ON to use --device cuda");
    return NULL;
}
#else
typedef int kvq_cuda_is_built; /* the real one is cuda/cuda_backend.c */
#endif
