/* Tensor parallelism's small all-reduces in one kernel a GPU, through NCCL's device
 * API: each rank copies its floats into a window of NCCL's symmetric memory, meets its
 * peers at an NCCL barrier, then reads every rank's copy over NVLink and adds them in
 * rank order (so that every rank holds the same bits). For the sums of decode steps
 * (a 70B model's step has 160 of 32 KB), where it takes less time than NCCL's ring
 * kernel; larger sums stay with NCCL's all-reduce. */
#ifndef KVQ_BACKEND_CUDA_ALL_REDUCE_H
#define KVQ_BACKEND_CUDA_ALL_REDUCE_H

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct cuk_reducer;

/* The reducer of n ranks (comm[r] on device dev[r], all driven from this thread), made
 * collectively; NULL where NCCL's device API or symmetric memory is not to be had (why
 * says what was missing). */
struct cuk_reducer *cuk_reducer_new(const ncclComm_t *comm, const int *dev, int n, char *why, size_t why_size);
/* Whether `bytes` of floats at each rank's p[r] can take the reducer: small enough,
 * whole 16-byte units, 16-byte aligned. */
bool cuk_reducer_takes(const struct cuk_reducer *red, void *const *p, size_t bytes);
/* The sum over the ranks of their floats at p[r], in place, queued on each rank's
 * stream[r] (with programmatic dependent launch where pdl); leaves the last rank's
 * device current. */
cudaError_t cuk_reducer_run(struct cuk_reducer *red, void *const *p, size_t bytes, const cudaStream_t *stream, bool pdl);
/* Collective, as cuk_reducer_new; before the communicators are destroyed. */
void cuk_reducer_free(struct cuk_reducer *red);

#ifdef __cplusplus
}
#endif

#endif
