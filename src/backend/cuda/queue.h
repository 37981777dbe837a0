/* Where the CUDA backend's work goes: launched on its stream at once, or recorded
 * while a step is planned and issued at the step's end, as a CUDA graph when the same
 * step (the same kernels, launch shapes and argument bytes, in order) was recorded
 * before. A decode step is hundreds of small launches whose host cost exceeds their
 * GPU time; a graph launch replaces them, and whatever changes between steps
 * (positions, block addresses) is data the kernels read from device memory, not
 * launch arguments. */
#ifndef KVQ_BACKEND_CUDA_QUEUE_H
#define KVQ_BACKEND_CUDA_QUEUE_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct cuk_rec_entry;
struct cuk_graph;

/* Graphs kept (the least recently used dropped), and hashes remembered of records
 * issued without a graph: a step issues several. */
#define CUK_QUEUE_RECENT 64

struct cuk_queue {
    cudaStream_t stream;
    cudaError_t err;  /* the first failed launch or copy since the last cuk_queue_error() */
    bool recording;   /* launches and copies are recorded, not issued */
    bool graphs;      /* cuk_queue_issue may replay or capture graphs */
    bool pdl;         /* launches asked with pdl use it (compute capability 9.0 and up); else plain */
    bool plain_next;  /* the next launch is plain, whatever it asks (cuk_queue_launch_plain_next) */
    bool side_next;   /* the next launch goes beside the stream (cuk_queue_launch_side_next) */
    /* launches beside the stream: their stream, and the events that fork it from the
     * stream and join it back at the end of an issued record (side_open: forked) */
    cudaStream_t side;
    cudaEvent_t fork_ev, join_ev;
    bool side_open;
    /* the record: entries, argument offsets and argument bytes */
    struct cuk_rec_entry *ent;
    int n_ent, cap_ent;
    uint32_t *offs;
    int n_offs, cap_offs;
    uint8_t *blob;
    size_t blob_len, blob_cap;
    /* captured graphs, and the hashes of records issued without one lately */
    struct cuk_graph *graph;
    int n_graph, last; /* last: the graph issued last (-1: none, or launches) */
    uint64_t seen[CUK_QUEUE_RECENT], never[CUK_QUEUE_RECENT];
    int n_seen, n_never;
    uint64_t clock;
    long n_replays, n_captures, n_eager; /* issues of records, by how */
    /* the most rows a token of the step's last attention read: a hint for the launches
     * after it (matmul.cu: after a long one gate/up holds more weights, after a short
     * one the product that reads its output streams a tile a block) */
    int attn_rows;
    /* set by an attention, taken by the next product (cuk_matvec), the one that reads
     * its output: its blocks may be resident beside the attention's */
    bool after_attn;
    /* kernels whose launches are dropped (the backend's tuning: KVQ_CUDA_LEAVE_OUT,
     * queue.c), or NULL */
    const char *leave_out;
    int device;  /* the queue's GPU, made current to issue it in a group (cuk_group_issue) */
    int n_meets; /* meeting points in the record (cuk_queue_meet) */
};

/* Queues of several GPUs whose records meet (tensor parallelism: one queue a GPU, the
 * all-reduces between them). At each meeting point of the records, `meet` runs the
 * group's collective on each queue's stream: NCCL's calls of all the GPUs, grouped.
 * Issued together, the records become graphs together or not at all: NCCL requires
 * every rank to capture a collective, or none (and each rank to replay the graph of
 * that capture), and a collective captured may not be in flight beside one that was
 * not (NCCL_GRAPH_MIXING_SUPPORT=0: with mixing, graphs of several communicators
 * launched from one thread can deadlock): the group waits for the GPUs when it
 * changes from one to the other. */
#define CUK_GROUP_MAX 8

/* What a group's GPUs may be running of its collectives. */
enum cuk_in_flight { CUK_IDLE, CUK_LAUNCHES, CUK_GRAPHS };

struct cuk_group {
    struct cuk_queue *q[CUK_GROUP_MAX];
    int n;
    void (*meet)(void *ctx, void *const *p, size_t bytes); /* p[i]: queue i's bytes, on its stream */
    void *ctx;
    enum cuk_in_flight in_flight; /* what its last issue ran (idle: the GPUs were waited for since) */
};

/* A kernel launch (args[i] points to argument i of sizes[i] bytes), with programmatic
 * dependent launch (launch.cuh) when pdl. */
void cuk_queue_launch(struct cuk_queue *q, const void *func, dim3 grid, dim3 block, size_t smem, bool pdl,
                      void **args, const size_t *sizes, int n_args);
/* Makes the next launch a plain one, after a kernel whose writes the next kernels
 * read before their griddep_wait: only a plain launch orders them (launch.cuh). */
void cuk_queue_launch_plain_next(struct cuk_queue *q);
/* Makes the next launch, when recorded, run beside the stream rather than in it: after
 * everything queued before it, and before nothing queued after it but the end of the
 * issued record (where the stream waits for it). For work no later launch of the
 * record reads, so that its time leaves the chain of dependent launches. Not
 * recording, the launch goes in the stream as any other. */
void cuk_queue_launch_side_next(struct cuk_queue *q);
/* Moves the last launch recorded to the front of the record, and makes the next
 * launch in the stream a plain one, so that every launch of the record starts after
 * it has finished: for work whose results the whole record reads. */
void cuk_queue_last_to_front(struct cuk_queue *q);
/* A copy to the device from pinned host memory or device memory (recorded ones: from
 * host memory, the bytes are read when the copy runs, so they must stay as they are
 * until then; not recorded, from any host memory). */
void cuk_queue_copy(struct cuk_queue *q, void *dst, const void *src, size_t bytes);
/* A meeting point of the group's records over `bytes` at p (the queue's own buffer):
 * the group's collective runs there when the records are issued (cuk_group_issue). */
void cuk_queue_meet(struct cuk_queue *q, void *p, size_t bytes);
/* Issues the record (in order: a replayed graph, a newly captured one, or launch by
 * launch) and empties it; recording stays as it is. The record has no meeting point. */
void cuk_queue_issue(struct cuk_queue *q);
/* Issues every queue's record of the group together (their meeting points paired in
 * order), each on its GPU; leaves the current device as the group's last queue's. */
void cuk_group_issue(struct cuk_group *g);
/* The collective of each queue's p: the group's `meet` outside any record, after a
 * wait for the GPUs if graphs' collectives may be in flight. */
void cuk_group_meet_now(struct cuk_group *g, void *const *p, size_t bytes);
/* The GPUs have finished what was issued (the caller waited for them). */
static inline void cuk_group_idle(struct cuk_group *g) { g->in_flight = CUK_IDLE; }
/* The first error since the last call (cudaSuccess if none), cleared. */
cudaError_t cuk_queue_error(struct cuk_queue *q);
void cuk_queue_free(struct cuk_queue *q);

#ifdef __cplusplus
}
#endif

#endif
