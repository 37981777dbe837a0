/* Host data for a step through one pinned staging buffer, uploaded in stream order;
 * decode steps recorded and issued as CUDA graphs in segments (queue.h); copies to the
 * device scattered by one launch; results and new KV rows read back behind the work. */
#include "backend/cuda/cuda_private.h"

/* The staging buffers at cap bytes (rounded up to STAGE_ROUND, fetch_staged's unit),
 * what they hold kept; false with the failure recorded. */
#define STAGE_ROUND 4096

bool stage_grow(struct cuda_backend *cb, size_t cap) {
    uint8_t *h = NULL, *d = NULL;
    cap = (cap + STAGE_ROUND - 1) / STAGE_ROUND * STAGE_ROUND;
    if (!ck(cb, cudaStreamSynchronize(cb->stream), "waiting for the stream") ||
        !ck(cb, cudaMallocHost((void **)&h, cap), "pinned staging memory") ||
        !ck(cb, cudaMalloc((void **)&d, cap), "device staging memory")) {
        if (h) cudaFreeHost(h);
        return false;
    }
    if (cb->stage_used) memcpy(h, cb->stage_h, cb->stage_used);
    cudaFreeHost(cb->stage_h);
    cudaFree(cb->stage_d);
    cb->stage_h = h;
    cb->stage_d = d;
    cb->stage_cap = cap;
    cb->stage_up = 0; /* the new device buffer holds nothing yet */
    return true;
}


/* Room for `bytes` more at an aligned offset; the offset, or (size_t)-1. Growing
 * waits for the stream first (earlier uploads may still read the old buffer). */
size_t stage_alloc(struct cuda_backend *cb, size_t bytes) {
    size_t off = (cb->stage_used + 15) & ~(size_t)15;
    if (off + bytes > cb->stage_cap) {
        record_stop(cb); /* what it recorded reads the old buffer */
        size_t cap = cb->stage_cap ? cb->stage_cap : (size_t)1 << 20;
        while (cap < off + bytes) cap *= 2;
        if (!stage_grow(cb, cap)) return (size_t)-1;
    }
    cb->stage_used = off + bytes;
    return off;
}


static size_t stage_put(struct cuda_backend *cb, const void *data, size_t bytes) {
    size_t off = stage_alloc(cb, bytes);
    if (off != (size_t)-1 && bytes) memcpy(cb->stage_h + off, data, bytes);
    return off;
}


/* Uploads what was staged since the last upload. */
static void stage_upload(struct cuda_backend *cb) {
    if (cb->stage_used > cb->stage_up)
        ck(cb, cudaMemcpyAsync(cb->stage_d + cb->stage_up, cb->stage_h + cb->stage_up, cb->stage_used - cb->stage_up,
                               cudaMemcpyHostToDevice, cb->stream),
           "uploading step data");
    cb->stage_up = cb->stage_used;
}


/* Before a launch that reads what was staged: uploads it now, or, while a step is
 * recorded, when the record is issued. */
static void stage_flush(struct cuda_backend *cb) {
    if (!cb->q.recording) stage_upload(cb);
}


/* A host array as device memory for the next launch (NULL on failure). */
const void *stage_array(struct cuda_backend *cb, const void *data, size_t bytes) {
    size_t off = stage_put(cb, data, bytes);
    if (off == (size_t)-1) return NULL;
    stage_flush(cb);
    return cb->stage_d + off;
}


/* The copy stream's next copies wait for the work queued on the compute stream so far
 * (copies there would hold up the kernels behind them). */
void copies_follow_work(struct cuda_backend *cb) {
    ck(cb, cudaEventRecord(cb->work_ev, cb->stream), "an event");
    ck(cb, cudaStreamWaitEvent(cb->copy_stream, cb->work_ev, 0), "an event");
}


/* After an issued segment (or a KV append not recorded): the rows encoded since the
 * last copy, read back on the copy stream once the work so far is done, with an event
 * behind them (cuda_sync files them while the GPU runs on; in the compute stream the
 * copies held up the kernels behind them, 0.18 ms of a 16-token step). Skipped (left
 * for the step's end) when the pinned buffer is short; it grows at sync. */
void copy_new_rows(struct cuda_backend *cb) {
    if (cb->n_pending == cb->rows_copied || !cb->rb_h || cb->rb_used > cb->rb_h_cap || cb->n_row_copies == ROW_COPIES ||
        cb->failed)
        return;
    const int i = cb->n_row_copies;
    copies_follow_work(cb);
    ck(cb, cudaMemcpyAsync(cb->rb_h + cb->rb_copied, cb->rb_d + cb->rb_copied, cb->rb_used - cb->rb_copied,
                           cudaMemcpyDeviceToHost, cb->copy_stream),
       "reading new KV rows");
    ck(cb, cudaEventRecord(cb->row_ev[i], cb->copy_stream), "an event");
    cb->row_end[cb->n_row_copies++] = cb->rows_copied = cb->n_pending;
    cb->rb_copied = cb->rb_used;
}


/* The packings held back (held_pack), beside the stream from here. */
void launch_held_packs(struct cuda_backend *cb) {
    for (int i = 0; i < cb->n_held_pack; i++) cuk_kv_pack(&cb->q, &cb->held_pack[i]);
    cb->n_held_pack = 0;
}


/* A one-token step's staged data read by a kernel at the head of its record, from the
 * pinned host buffer (mapped), instead of copied before the record is issued: that
 * small cudaMemcpyAsync took the host 3.5-11 us (H100 machine), and the GPU waits for
 * the first segment's issue. The range ends at a STAGE_ROUND boundary (within the
 * buffer, stage_grow), so that the record (and its graph) is the same from step to
 * step; what the fetch reads past the staged bytes is overwritten by the next one
 * before any launch reads it. False where it does not apply (the caller uploads). */
static bool fetch_staged(struct cuda_backend *cb) {
    if (!cb->uva || !cb->q.recording || !cb->one_token || cb->stage_used <= cb->stage_up)
        return false;
    const size_t from = cb->stage_up & ~(size_t)15;
    const size_t to = (cb->stage_used + STAGE_ROUND - 1) / STAGE_ROUND * STAGE_ROUND;
    cuk_stage_fetch(&cb->q, cb->stage_d + from, cb->stage_h + from, to - from);
    cuk_queue_last_to_front(&cb->q);
    cb->stage_up = cb->stage_used;
    return true;
}


/* What precedes an issue of the record: the packings held back (so that the rows
 * read back after it are whole), the staged data. */
static void before_issue(struct cuda_backend *cb) {
    launch_held_packs(cb);
    steps_first_issue(cb->steps, cb->stream);
    if (!fetch_staged(cb)) stage_upload(cb);
}

/* Issues every rank's record together (tensor parallelism: they meet at the
 * all-reduces), each on its GPU; the caller's device stays current. */
void issue_records_together(struct tp_shared *tp) {
    int dev = 0;
    cudaGetDevice(&dev);
    for (int r = 0; r < tp->n; r++) {
        cudaSetDevice(tp->rank[r]->device);
        before_issue(tp->rank[r]);
    }
    cuk_group_issue(&tp->group);
    for (int r = 0; r < tp->n; r++) {
        cudaSetDevice(tp->rank[r]->device);
        copy_new_rows(tp->rank[r]);
    }
    cudaSetDevice(dev);
}

/* Uploads the staged data and issues the record. */
void issue_record(struct cuda_backend *cb) {
    if (cb->q.n_meets > 0) {
        issue_records_together(cb->tp);
        return;
    }
    double t0 = prof_begin(cb);
    before_issue(cb);
    cuk_queue_issue(&cb->q);
    copy_new_rows(cb);
    prof_end(cb, P_ISSUE, t0);
}


/* Every operation that queues work starts here. The first one of a step decides
 * whether the step is recorded: decode-sized steps are, when graphs are on. A
 * recorded step is issued in segments, so that the GPU starts on the first layers
 * while the host records the next ones; but kernels in different graphs do not
 * overlap as those launched with PDL within one do (about 2 us of GPU time a
 * boundary, more where it keeps the next kernel from loading weights early).
 * - Several tokens: a short first segment (the GPU idles until it is issued), then
 *   segments of SEGMENT_LAUNCHES, so that the host, whose work grows with the
 *   tokens, stays ahead (longer ones left the GPU waiting for 16 sequences).
 * - One token: four segments, and the output product's (cuda_matmul). Each ends
 *   before a GLU (the down product's blocks load their weights while it runs): the
 *   first at the first GLU (layer 0's), so that the GPU starts after about 10
 *   launches are recorded rather than 30; the next ones SEGMENT_ONE[1], then
 *   SEGMENT_ONE[2] launches later (layers 4 and 12 in a 7-8B model), short enough
 *   that the host records each while the GPU runs the one before. Against a first
 *   segment of 30 launches the host's median time beyond the GPU's fell from 34-37
 *   to 20-25 us a step, for 0-17 us more GPU time (H100, llama3-8b Q4_0;
 *   docs/cuda-performance.md). */
/* Wide steps recorded as graphs up to this many tokens (measured to 64; the wider
 * packed steps were not measured recorded). */
#define GRAPH_STEP_MAX 64
#define SEGMENT_FIRST 12

#define SEGMENT_LAUNCHES 96

static const int SEGMENT_ONE[] = {5, 40, 90};

/* Issues what the step recorded so far; recording goes on in a new segment. */
void cut_segment(struct cuda_backend *cb) {
    issue_record(cb);
    cb->segments++;
}

static bool segment_ends(const struct cuda_backend *cb, bool glu) {
    const int n_one = (int)(sizeof SEGMENT_ONE / sizeof *SEGMENT_ONE);
    if (cb->one_token) return glu && cb->segments < n_one && cb->q.n_ent >= SEGMENT_ONE[cb->segments];
    return cb->q.n_ent >= (cb->segments ? SEGMENT_LAUNCHES : SEGMENT_FIRST);
}

/* glu: the operation is a GLU (segment_ends). A wide product's pending sums are settled
 * here, before any operation, unless it took them (take_sums) before calling this. */
void step_op(struct cuda_backend *cb, int n, bool glu) {
    if (!cb->in_step) {
        cb->in_step = true;
        steps_begin(cb->steps, n);
        /* steps whose products are all this backend's kernels (cuBLAS is not recorded);
         * under tensor parallelism only those of up to 16 tokens, which two GPUs have run */
        cb->q.recording = cb->q.graphs && n <= (cb->wide && !cb->tp ? GRAPH_STEP_MAX : CUK_MATVEC_MAX);
        cb->segments = 0;
        cb->one_token = n == 1;
        if (!cb->q.recording) steps_first_issue(cb->steps, cb->stream); /* launched as queued */
    } else if (cb->q.recording && !cb->tp && segment_ends(cb, glu)) { /* tensor parallelism: tp_backend.c cuts */
        cut_segment(cb);
    }
    settle_sums(cb);
}


/* Issues what the step recorded so far and queues the rest of it at once: before
 * anything that waits for the stream or cannot be recorded. */
void record_stop(struct cuda_backend *cb) {
    if (!cb->q.recording) return;
    issue_record(cb);
    cb->q.recording = false;
}


/* Frees device memory after the step (its recorded work may still read it). */
void free_after_step(struct cuda_backend *cb, void *p) {
    if (!p) return;
    if (cb->n_dead == cb->cap_dead) {
        int cap = cb->cap_dead ? 2 * cb->cap_dead : 16;
        void **d = realloc(cb->dead, sizeof *d * (size_t)cap);
        if (!d) {
            record_stop(cb);
            cudaStreamSynchronize(cb->stream);
            cudaFree(p);
            return;
        }
        cb->dead = d;
        cb->cap_dead = cap;
    }
    cb->dead[cb->n_dead++] = p;
}


/* Queues a copy of `bytes` staged bytes to the device address dst (done by
 * flush_copies): where the caller writes them, or NULL. */
void *copy_space(struct cuda_backend *cb, const void *dst, size_t bytes) {
    size_t off = stage_alloc(cb, bytes);
    if (off == (size_t)-1) return NULL;
    if (cb->n_copies == cb->cap_copies) {
        int cap = cb->cap_copies ? 2 * cb->cap_copies : 1024;
        struct cuk_copy *c = realloc(cb->copies, sizeof *c * (size_t)cap);
        if (!c) {
            ck(cb, cudaErrorMemoryAllocation, "host memory for copies");
            return NULL;
        }
        cb->copies = c;
        cb->cap_copies = cap;
    }
    cb->copies[cb->n_copies++] = (struct cuk_copy){(uint64_t)(uintptr_t)dst, (uint32_t)off, (uint32_t)bytes};
    return cb->stage_h + off;
}


/* Queues a copy of bytes at data to the device address dst. */
bool copy_to(struct cuda_backend *cb, const void *dst, const void *data, size_t bytes) {
    void *h = copy_space(cb, dst, bytes);
    if (h && bytes) memcpy(h, data, bytes);
    return h != NULL;
}


/* Uploads what was staged, then places the queued copies. */
void flush_copies(struct cuda_backend *cb) {
    size_t list = cb->n_copies ? stage_put(cb, cb->copies, sizeof *cb->copies * (size_t)cb->n_copies) : 0;
    stage_flush(cb);
    if (cb->n_copies && list != (size_t)-1)
        cuk_scatter(&cb->q, (const struct cuk_copy *)(cb->stage_d + list), cb->n_copies, cb->stage_d);
    cb->n_copies = 0;
}


/* Copies device memory to the host once the work queued so far is done: recorded
 * work's results after it, at sync. */
void post_copy(struct cuda_backend *cb, void *dst, const void *src, size_t bytes) {
    if (!cb->q.recording) {
        ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "reading results");
        return;
    }
    if (cb->n_post == cb->cap_post) { /* after the recorded work, at sync */
        int cap = cb->cap_post ? 2 * cb->cap_post : 8;
        struct post_copy *p = realloc(cb->post, sizeof *p * (size_t)cap);
        if (!p) {
            record_stop(cb);
            ck(cb, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "reading results");
            return;
        }
        cb->post = p;
        cb->cap_post = cap;
    }
    cb->post[cb->n_post++] = (struct post_copy){dst, src, bytes};
}
