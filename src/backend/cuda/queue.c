/* The launch queue (queue.h): a record of launches and copies, issued one by one or
 * as a CUDA graph. A record seen a second time (by hash, among the last few issued
 * without a graph) is captured into a graph; later identical records replay it. A
 * step may be issued in several records (segments), so each graph remembers the one
 * that followed it, which is compared first. */
#include "backend/cuda/queue.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One launch, a copy (func NULL), or a meeting point of a group's records (func NULL,
 * meet 1: the group's collective over `bytes` at dst). All fields set, no padding:
 * records compare byte for byte. */
struct cuk_rec_entry {
    const void *func;
    void *dst;
    const void *src;
    size_t bytes;
    uint32_t grid[3], block[3];
    uint32_t smem, pdl, arg0, n_args; /* arguments: offs[arg0 .. arg0 + n_args) into blob */
    uint32_t side, meet;              /* side: beside the stream (cuk_queue_launch_side_next) */
};

struct cuk_graph {
    uint64_t hash, used;
    int next; /* the graph issued after this one last time, or -1 */
    struct cuk_rec_entry *ent;
    uint32_t *offs;
    uint8_t *blob;
    int n_ent, n_offs;
    size_t blob_len;
    cudaGraphExec_t exec;
};

static void fail(struct cuk_queue *q, cudaError_t e) {
    if (e != cudaSuccess && q->err == cudaSuccess) q->err = e;
}

static bool grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return true;
    int c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    void *n = realloc(*p, elem * (size_t)c);
    if (!n) return false;
    *p = n;
    *cap = c;
    return true;
}

static struct cuk_rec_entry *new_entry(struct cuk_queue *q) {
    if (!grow((void **)&q->ent, &q->cap_ent, q->n_ent + 1, sizeof *q->ent)) {
        fail(q, cudaErrorMemoryAllocation);
        return NULL;
    }
    struct cuk_rec_entry *e = &q->ent[q->n_ent++];
    memset(e, 0, sizeof *e);
    return e;
}

static void launch(struct cuk_queue *q, cudaStream_t stream, const void *func, dim3 grid, dim3 block, size_t smem,
                   bool pdl, void **args) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {0};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = pdl && q->pdl; /* 0: a plain launch */
    fail(q, cudaLaunchKernelExC(&cfg, func, args));
}

static void issue_one(struct cuk_queue *q, const struct cuk_rec_entry *e, const uint32_t *offs, uint8_t *blob) {
    if (!e->func) {
        fail(q, cudaMemcpyAsync(e->dst, e->src, e->bytes, cudaMemcpyDefault, q->stream));
        return;
    }
    void *args[64];
    for (uint32_t i = 0; i < e->n_args; i++) args[i] = blob + offs[e->arg0 + i];
    cudaStream_t stream = q->stream;
    if (e->side) { /* forked after the work so far (in a capture, the side stream joins it) */
        fail(q, cudaEventRecord(q->fork_ev, q->stream));
        fail(q, cudaStreamWaitEvent(q->side, q->fork_ev, 0));
        stream = q->side;
        q->side_open = true;
    }
    launch(q, stream, e->func, (dim3){e->grid[0], e->grid[1], e->grid[2]}, (dim3){e->block[0], e->block[1], e->block[2]},
           e->smem, e->pdl, args);
}

/* KVQ_CUDA_LEAVE_OUT=name[,name...]: launches of kernels whose (mangled) name contains
 * one of the names are dropped, so a step's GPU time without them (KVQ_CUDA_PROFILE=steps)
 * says what they cost where they overlap their neighbours (PDL, graphs), which timing a
 * kernel alone does not. A measurement aid: outputs are wrong. KVQ_CUDA_LEAVE_OUT=list
 * drops nothing and prints each kernel's name and shape the first time it is launched. */
static bool left_out(const char *names, const void *func, dim3 grid, dim3 block) {
    static const void *seen[256];
    static int n_seen;
    const char *name = NULL;
    if (!names || !*names || cudaFuncGetName(&name, func) != cudaSuccess || !name) return false;
    if (!strcmp(names, "list")) {
        int i = 0;
        while (i < n_seen && seen[i] != func) i++;
        if (i == n_seen && n_seen < 256) {
            seen[n_seen++] = func;
            fprintf(stderr, "kvq kernel: %s (grid %u,%u, block %u)\n", name, grid.x, grid.y, block.x);
        }
        return false;
    }
    for (const char *p = names; *p;) {
        size_t len = strcspn(p, ",");
        char part[128];
        if (len > 0 && len < sizeof part) {
            memcpy(part, p, len);
            part[len] = 0;
            if (strstr(name, part)) return true;
        }
        p += len + (p[len] == ',');
    }
    return false;
}

void cuk_queue_launch(struct cuk_queue *q, const void *func, dim3 grid, dim3 block, size_t smem, bool pdl,
                      void **args, const size_t *sizes, int n_args) {
    const bool side = q->side_next && q->recording;
    q->side_next = false;
    if (q->leave_out && left_out(q->leave_out, func, grid, block)) return;
    pdl = pdl && !q->plain_next && !side;
    if (!side) q->plain_next = false;
    if (!q->recording) {
        launch(q, q->stream, func, grid, block, smem, pdl, args);
        return;
    }
    if (side && !q->side &&
        (cudaStreamCreateWithFlags(&q->side, cudaStreamNonBlocking) != cudaSuccess ||
         cudaEventCreateWithFlags(&q->fork_ev, cudaEventDisableTiming) != cudaSuccess ||
         cudaEventCreateWithFlags(&q->join_ev, cudaEventDisableTiming) != cudaSuccess)) {
        fail(q, cudaErrorMemoryAllocation);
        return;
    }
    struct cuk_rec_entry *e = n_args <= 64 ? new_entry(q) : NULL;
    if (!e) {
        fail(q, cudaErrorInvalidValue);
        return;
    }
    e->func = func;
    e->grid[0] = grid.x, e->grid[1] = grid.y, e->grid[2] = grid.z;
    e->block[0] = block.x, e->block[1] = block.y, e->block[2] = block.z;
    e->smem = (uint32_t)smem;
    e->pdl = pdl;
    e->side = side;
    e->n_args = (uint32_t)n_args;
    /* arguments at 16-byte aligned offsets, the gaps zeroed */
    size_t need = q->blob_len;
    for (int i = 0; i < n_args; i++) need = ((need + 15) & ~(size_t)15) + sizes[i];
    if (need > q->blob_cap) {
        size_t cap = q->blob_cap ? q->blob_cap : (size_t)1 << 16;
        while (cap < need) cap *= 2;
        uint8_t *b = realloc(q->blob, cap);
        if (!b) {
            q->n_ent--;
            fail(q, cudaErrorMemoryAllocation);
            return;
        }
        q->blob = b;
        q->blob_cap = cap;
    }
    if (!grow((void **)&q->offs, &q->cap_offs, q->n_offs + n_args, sizeof *q->offs)) {
        q->n_ent--;
        fail(q, cudaErrorMemoryAllocation);
        return;
    }
    e->arg0 = (uint32_t)q->n_offs;
    for (int i = 0; i < n_args; i++) {
        size_t at = (q->blob_len + 15) & ~(size_t)15;
        memset(q->blob + q->blob_len, 0, at - q->blob_len);
        memcpy(q->blob + at, args[i], sizes[i]);
        q->offs[q->n_offs++] = (uint32_t)at;
        q->blob_len = at + sizes[i];
    }
}

void cuk_queue_launch_plain_next(struct cuk_queue *q) { q->plain_next = true; }

void cuk_queue_launch_side_next(struct cuk_queue *q) { q->side_next = true; }

void cuk_queue_last_to_front(struct cuk_queue *q) {
    if (!q->recording || q->n_ent < 2) return;
    const struct cuk_rec_entry last = q->ent[q->n_ent - 1];
    memmove(q->ent + 1, q->ent, sizeof *q->ent * (size_t)(q->n_ent - 1));
    q->ent[0] = last;
    /* the next launch in the stream plain: it starts once the first one's writes are
     * visible (launches beside the stream fork after it anyway) */
    for (int i = 1; i < q->n_ent; i++)
        if (!q->ent[i].side) {
            q->ent[i].pdl = 0;
            break;
        }
}

void cuk_queue_copy(struct cuk_queue *q, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (!q->recording) {
        fail(q, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, q->stream));
        return;
    }
    struct cuk_rec_entry *e = new_entry(q);
    if (!e) return;
    e->dst = dst;
    e->src = src;
    e->bytes = bytes;
}

void cuk_queue_meet(struct cuk_queue *q, void *p, size_t bytes) {
    struct cuk_rec_entry *e = new_entry(q);
    if (!e) return;
    e->dst = p;
    e->bytes = bytes;
    e->meet = 1;
    q->n_meets++;
}

/* A hash of n bytes, 8 at a time (records are tens of kilobytes). */
static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (; n >= 8; n -= 8, b += 8) {
        uint64_t w;
        memcpy(&w, b, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ull;
        h ^= h >> 29;
    }
    for (; n > 0; n--, b++) h = (h ^ *b) * 0x100000001b3ull;
    return h;
}

static uint64_t record_hash(const struct cuk_queue *q) {
    uint64_t h = hash_bytes(0xcbf29ce484222325ull, q->ent, sizeof *q->ent * (size_t)q->n_ent);
    h = hash_bytes(h, q->offs, sizeof *q->offs * (size_t)q->n_offs);
    return hash_bytes(h, q->blob, q->blob_len);
}

static bool same_record(const struct cuk_graph *g, const struct cuk_queue *q) {
    return g->n_ent == q->n_ent && g->n_offs == q->n_offs && g->blob_len == q->blob_len &&
           memcmp(g->ent, q->ent, sizeof *q->ent * (size_t)q->n_ent) == 0 &&
           memcmp(g->offs, q->offs, sizeof *q->offs * (size_t)q->n_offs) == 0 &&
           memcmp(g->blob, q->blob, q->blob_len) == 0;
}

static bool listed(const uint64_t *list, int n, uint64_t h) {
    for (int i = 0; i < n; i++)
        if (list[i] == h) return true;
    return false;
}

static void remember(uint64_t *list, int *n, uint64_t h) {
    const int max = CUK_QUEUE_RECENT;
    if (*n >= max) { /* the oldest dropped */
        memmove(list, list + 1, sizeof *list * (size_t)(max - 1));
        *n = max;
    } else {
        (*n)++;
    }
    list[*n - 1] = h;
}

/* Makes q's GPU current when it is issued among others (alone, it is already). */
static void to_gpu(const struct cuk_queue *q, int n) {
    if (n > 1) cudaSetDevice(q->device);
}

static void join_side(struct cuk_queue *q) {
    if (!q->side_open) return;
    fail(q, cudaEventRecord(q->join_ev, q->side));
    fail(q, cudaStreamWaitEvent(q->stream, q->join_ev, 0));
    q->side_open = false;
}

/* The records of n queues (one, or a group's) in order: each GPU's entries up to its
 * next meeting point, then the group's collective, and on; then the side streams
 * joined back. */
static void issue_all(struct cuk_queue *const *qs, int n, const struct cuk_group *grp) {
    int at[CUK_GROUP_MAX] = {0};
    for (;;) {
        int waiting = 0;
        for (int i = 0; i < n; i++) {
            struct cuk_queue *q = qs[i];
            to_gpu(q, n);
            while (at[i] < q->n_ent && !q->ent[at[i]].meet) issue_one(q, &q->ent[at[i]++], q->offs, q->blob);
            waiting += at[i] < q->n_ent;
        }
        if (waiting == 0) break;
        assert(grp && waiting == n); /* the records meet alike */
        void *p[CUK_GROUP_MAX];
        for (int i = 0; i < n; i++) p[i] = qs[i]->ent[at[i]++].dst;
        grp->meet(grp->ctx, p, qs[0]->ent[at[0] - 1].bytes);
    }
    for (int i = 0; i < n; i++) {
        to_gpu(qs[i], n);
        join_side(qs[i]);
    }
}

static void graph_free(struct cuk_graph *g) {
    if (g->exec) cudaGraphExecDestroy(g->exec);
    free(g->ent);
    free(g->offs);
    free(g->blob);
    memset(g, 0, sizeof *g);
}

/* A slot for a new graph: an unused one, else the least recently used, freed. */
static struct cuk_graph *graph_slot(struct cuk_queue *q) {
    const int max = CUK_QUEUE_RECENT;
    if (!q->graph && !(q->graph = calloc((size_t)max, sizeof *q->graph))) return NULL;
    if (q->n_graph < max) return &q->graph[q->n_graph];
    struct cuk_graph *g = &q->graph[0];
    for (int i = 1; i < max; i++)
        if (q->graph[i].used < g->used) g = &q->graph[i];
    graph_free(g);
    return g;
}

/* Makes g of the graph captured from q's record (ok false: the capture failed, or
 * one of the group's did, and it is discarded): instantiated, with the record it
 * replays. false when it is not made. Instantiation follows the end of every capture
 * of the group, as a thread capturing a stream may not instantiate. */
static bool graph_make(struct cuk_queue *q, struct cuk_graph *g, cudaGraph_t graph, uint64_t hash, bool ok) {
    if (ok) ok = cudaGraphInstantiate(&g->exec, graph, 0) == cudaSuccess;
    if (graph) cudaGraphDestroy(graph);
    if (ok) {
        g->ent = malloc(sizeof *q->ent * (size_t)q->n_ent);
        g->offs = malloc(sizeof *q->offs * (size_t)(q->n_offs ? q->n_offs : 1));
        g->blob = malloc(q->blob_len ? q->blob_len : 1);
        ok = g->ent && g->offs && g->blob;
    }
    if (!ok) {
        graph_free(g);
        return false;
    }
    memcpy(g->ent, q->ent, sizeof *q->ent * (size_t)q->n_ent);
    memcpy(g->offs, q->offs, sizeof *q->offs * (size_t)q->n_offs);
    memcpy(g->blob, q->blob, q->blob_len);
    g->n_ent = q->n_ent;
    g->n_offs = q->n_offs;
    g->blob_len = q->blob_len;
    g->hash = hash;
    g->next = -1;
    return true;
}

/* Captures the records of n queues into a graph each (not run), all or none: false
 * when one failed (the records are then to be issued launch by launch; a failed
 * capture leaves no error). g[i]: a graph of queue i's record made by another
 * capture, freed (the group's graphs replay together only as captured together);
 * then the new graphs. */
static bool capture(struct cuk_queue *const *qs, int n, const struct cuk_group *grp, const uint64_t *hash,
                    struct cuk_graph **g) {
    cudaError_t before[CUK_GROUP_MAX];
    cudaGraph_t graph[CUK_GROUP_MAX] = {0};
    int begun = 0;
    for (; begun < n; begun++) {
        struct cuk_queue *q = qs[begun];
        if (g[begun]) graph_free(g[begun]);
        if (!(g[begun] = graph_slot(q))) break;
        to_gpu(q, n);
        before[begun] = q->err;
        if (cudaStreamBeginCapture(q->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) break;
    }
    if (begun == n) issue_all(qs, n, grp);
    bool ok = begun == n;
    for (int i = 0; i < begun; i++) {
        struct cuk_queue *q = qs[i];
        to_gpu(q, n);
        ok = cudaStreamEndCapture(q->stream, &graph[i]) == cudaSuccess && q->err == before[i] && graph[i] && ok;
        q->err = before[i];
    }
    for (int i = 0; i < begun; i++) {
        to_gpu(qs[i], n);
        ok = graph_make(qs[i], g[i], graph[i], hash[i], ok) && ok;
    }
    cudaGetLastError();
    for (int i = 0; i < begun; i++) {
        struct cuk_queue *q = qs[i];
        if (!ok) graph_free(g[i]);
        else if (g[i] == &q->graph[q->n_graph]) q->n_graph++;
    }
    return ok;
}

/* The graph that replays q's record (the one that followed the last graph, else any
 * of the same hash), or NULL; *hash: the record's. */
static struct cuk_graph *find_graph(struct cuk_queue *q, uint64_t *hash) {
    const int expect = q->last >= 0 && q->last < q->n_graph ? q->graph[q->last].next : -1;
    if (expect >= 0 && expect < q->n_graph && same_record(&q->graph[expect], q)) {
        *hash = q->graph[expect].hash;
        return &q->graph[expect];
    }
    *hash = record_hash(q);
    for (int i = 0; i < q->n_graph; i++)
        if (q->graph[i].hash == *hash && same_record(&q->graph[i], q)) return &q->graph[i];
    return NULL;
}

static void launch_graph(struct cuk_queue *q, struct cuk_graph *g) {
    const int gi = (int)(g - q->graph);
    if (q->last >= 0 && q->last < q->n_graph) q->graph[q->last].next = gi;
    q->last = gi;
    g->used = ++q->clock;
    fail(q, cudaGraphLaunch(g->exec, q->stream));
}

/* Waits for the group's GPUs when what they may run (collectives captured or not)
 * differs from what comes (cuk_group). */
static void group_turns(struct cuk_group *grp, enum cuk_in_flight how) {
    if (grp->in_flight != CUK_IDLE && grp->in_flight != how)
        for (int i = 0; i < grp->n; i++) fail(grp->q[i], cudaStreamSynchronize(grp->q[i]->stream));
    grp->in_flight = how;
}

/* Issues the records of n queues (one, or a group's) as graphs, all replayed or all
 * captured, else launch by launch; and empties them. A record is captured the second
 * time it is seen (by hash, among the last few issued without a graph). */
static void issue(struct cuk_queue *const *qs, int n, struct cuk_group *grp) {
    struct cuk_graph *g[CUK_GROUP_MAX] = {0};
    uint64_t h[CUK_GROUP_MAX] = {0};
    bool replay = true, seen = true;
    for (int i = 0; i < n; i++) {
        struct cuk_queue *q = qs[i];
        if (!q->graphs) {
            replay = seen = false;
            continue;
        }
        g[i] = find_graph(q, &h[i]);
        replay = replay && g[i];
        seen = seen && listed(q->seen, q->n_seen, h[i]) && !listed(q->never, q->n_never, h[i]);
    }
    bool graphs = replay;
    if (!replay && seen) {
        graphs = capture(qs, n, grp, h, g);
        for (int i = 0; i < n; i++)
            if (graphs) qs[i]->n_captures++;
            else remember(qs[i]->never, &qs[i]->n_never, h[i]);
    } else if (!replay) {
        for (int i = 0; i < n; i++)
            if (qs[i]->graphs && !listed(qs[i]->seen, qs[i]->n_seen, h[i])) remember(qs[i]->seen, &qs[i]->n_seen, h[i]);
    }
    if (grp && qs[0]->n_meets > 0) group_turns(grp, graphs ? CUK_GRAPHS : CUK_LAUNCHES);
    if (graphs) {
        for (int i = 0; i < n; i++) {
            to_gpu(qs[i], n);
            launch_graph(qs[i], g[i]);
            qs[i]->n_replays += replay;
        }
    } else {
        issue_all(qs, n, grp);
        for (int i = 0; i < n; i++) {
            qs[i]->last = -1;
            qs[i]->n_eager++;
        }
    }
    for (int i = 0; i < n; i++) {
        qs[i]->n_ent = qs[i]->n_offs = qs[i]->n_meets = 0;
        qs[i]->blob_len = 0;
    }
}

void cuk_queue_issue(struct cuk_queue *q) {
    if (q->n_ent == 0) return;
    assert(q->n_meets == 0); /* a group's record: cuk_group_issue */
    issue(&q, 1, NULL);
}

void cuk_group_issue(struct cuk_group *g) {
    int n_ent = 0;
    for (int i = 0; i < g->n; i++) n_ent += g->q[i]->n_ent;
    if (n_ent > 0) issue(g->q, g->n, g);
}

void cuk_group_meet_now(struct cuk_group *g, void *const *p, size_t bytes) {
    group_turns(g, CUK_LAUNCHES);
    g->meet(g->ctx, p, bytes);
}

cudaError_t cuk_queue_error(struct cuk_queue *q) {
    cudaError_t e = q->err;
    q->err = cudaSuccess;
    return e;
}

void cuk_queue_free(struct cuk_queue *q) {
    if (q->side) cudaStreamDestroy(q->side);
    if (q->fork_ev) cudaEventDestroy(q->fork_ev);
    if (q->join_ev) cudaEventDestroy(q->join_ev);
    for (int i = 0; i < q->n_graph; i++) graph_free(&q->graph[i]);
    free(q->graph);
    free(q->ent);
    free(q->offs);
    free(q->blob);
    memset(q, 0, sizeof *q);
}
