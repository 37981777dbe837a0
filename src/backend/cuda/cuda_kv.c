/* The device copy of the KV cache: blocks from arenas mirroring the host pool, each
 * cache's block table, f16 windows and offsets on the device, kept current before the
 * kernels that read them; appends encoded on the device. On one GPU the device's block
 * rows are the authoritative ones (the host fetches them when it reads them, kv_pool.h)
 * and only window rows are read back at sync; under tensor parallelism every new row
 * is read back to the host's copy. */
#include <sys/mman.h>

#include "backend/cuda/cuda_private.h"

/* No pending appends (their early copies, if any, are left unread). */
void drop_pending(struct cuda_backend *cb) {
    for (int i = 0; i < cb->n_pending; i++) /* the host's cache has the offsets now, or never */
        if (cb->pending[i].offs_T > 0) mirror_of(cb, cb->pending[i].cache)->mu_chosen = false;
    cb->n_pending = cb->rows_copied = cb->rows_from = cb->n_row_copies = 0;
    cb->rb_copied = 0;
    cb->n_held_pack = 0;
}


/* The stack of spare memory of `bytes`, made when `make` (NULL when there is none). */
static struct spares *spares_of(struct cuda_backend *cb, size_t bytes, bool make) {
    for (int i = 0; i < cb->n_spare; i++)
        if (cb->spare[i].bytes == bytes) return &cb->spare[i];
    if (!make) return NULL;
    struct spares *sp = realloc(cb->spare, sizeof *sp * (size_t)(cb->n_spare + 1));
    if (!sp) return NULL;
    cb->spare = sp;
    sp[cb->n_spare] = (struct spares){bytes, NULL, 0, 0};
    return &sp[cb->n_spare++];
}


static void *arena_alloc(struct arena **list, enum arena_mem mem, size_t bytes, size_t chunk);

/* Device memory of `bytes` for a cache's mirror: a spare one of that size, or new from
 * the mirrors' chunks (a cudaMalloc for each of a new sequence's layers held up its
 * first pass). NULL with the failure recorded. */
static void *mirror_alloc(struct cuda_backend *cb, size_t bytes, const char *what) {
    struct spares *sp = spares_of(cb, bytes, false);
    if (sp && sp->n > 0) return sp->p[--sp->n];
    void *p = arena_alloc(&cb->mirror_arena, ARENA_DEVICE, bytes, MIRROR_CHUNK);
    if (!p && drop_f16_copies(cb)) /* the cache before the copies */
        p = arena_alloc(&cb->mirror_arena, ARENA_DEVICE, bytes, MIRROR_CHUNK);
    if (!p) ck(cb, cudaErrorMemoryAllocation, what);
    return p;
}


/* Keeps a freed mirror's memory for the next cache (lost until the backend's end
 * where the list cannot grow). */
static void mirror_keep(struct cuda_backend *cb, void *p, size_t bytes) {
    if (!p) return;
    struct spares *sp = spares_of(cb, bytes, true);
    if (sp && sp->n == sp->cap) {
        int cap = sp->cap ? 2 * sp->cap : 64;
        void **np = realloc(sp->p, sizeof *np * (size_t)cap);
        if (np) sp->p = np, sp->cap = cap;
    }
    if (sp && sp->n < sp->cap) sp->p[sp->n++] = p;
}


/* mirror_keep once the step's work, which may still read p, is done. */
static bool keep_after_step(struct cuda_backend *cb, void *p, size_t bytes) {
    if (cb->n_later == cb->cap_later) {
        const int n = cb->cap_later ? 2 * cb->cap_later : 64;
        struct spare_later *l = realloc(cb->later, sizeof *l * (size_t)n);
        if (!l) return ck(cb, cudaErrorMemoryAllocation, "host memory");
        cb->later = l;
        cb->cap_later = n;
    }
    cb->later[cb->n_later++] = (struct spare_later){p, bytes};
    return true;
}



/* A new chunk of cap bytes at the head of the list; false with an error. */
static bool arena_grow(struct arena **list, enum arena_mem mem, size_t cap) {
    struct arena *n = calloc(1, sizeof *n);
    if (!n) return false;
    static const char *const what[] = {"device", "pinned host", "host"};
    const char *why = NULL;
    if (mem == ARENA_MAPPED) {
        void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        n->base = p == MAP_FAILED ? NULL : p;
        why = n->base ? NULL : "mmap failed";
    } else {
        /* portable: pinned for every GPU's copies (tensor parallelism reads it from all) */
        cudaError_t st = mem == ARENA_PINNED ? cudaHostAlloc((void **)&n->base, cap, cudaHostAllocPortable)
                                             : cudaMalloc((void **)&n->base, cap);
        if (st != cudaSuccess) cudaGetLastError(), why = cudaGetErrorString(st);
    }
    if (why) {
        free(n);
        kvq_error_code(KVQ_ERR_DEVICE, "CUDA: no %s memory for the KV cache (%s)", what[mem], why);
        return false;
    }
    n->cap = cap;
    n->mem = mem;
    n->next = *list;
    *list = n;
    return true;
}


static void *arena_alloc(struct arena **list, enum arena_mem mem, size_t bytes, size_t chunk) {
    bytes = (bytes + 255) & ~(size_t)255;
    if ((!*list || (*list)->used + bytes > (*list)->cap) && !arena_grow(list, mem, bytes > chunk ? bytes : chunk))
        return NULL;
    struct arena *a = *list;
    void *p = a->base + a->used;
    a->used += bytes;
    return p;
}


void arena_free(struct arena *a) {
    while (a) {
        struct arena *n = a->next;
        if (a->mem == ARENA_MAPPED) munmap(a->base, a->cap);
        else if (a->mem == ARENA_PINNED) cudaFreeHost(a->base);
        else cudaFree(a->base);
        free(a);
        a = n;
    }
}


static void *host_block(void *ctx, size_t bytes) {
    struct cuda_backend *cb = ctx;
    return arena_alloc(&cb->host_arena, ARENA_MAPPED, bytes, ARENA_CHUNK);
}

static void *dev_block(void *ctx, size_t bytes) {
    struct cuda_backend *cb = ctx;
    void *p = arena_alloc(&cb->dev_arena, ARENA_DEVICE, bytes, ARENA_CHUNK);
    if (!p && drop_f16_copies(cb)) p = arena_alloc(&cb->dev_arena, ARENA_DEVICE, bytes, ARENA_CHUNK); /* as mirror_alloc */
    return p;
}


/* The blocks' device rows into their host copies, after the work queued so far
 * (kv_pool_mirror.fetch): the host reads or writes them next. Through pinned memory,
 * in one wait (a copy into mapped memory waits for itself). */
#define FETCH_BYTES ((size_t)8 << 20)

static int fetch_blocks(void *ctx, struct kv_block *const *b, int n, size_t bytes) {
    struct cuda_backend *cb = ctx;
    record_stop(cb); /* the recorded work first */
    const size_t want = bytes > FETCH_BYTES ? bytes : FETCH_BYTES;
    if (cb->fetch_cap < want) {
        cudaFreeHost(cb->fetch_h);
        cb->fetch_h = NULL;
        cb->fetch_cap = 0;
        if (!ck(cb, cudaMallocHost((void **)&cb->fetch_h, want), "pinned memory for KV rows"))
            return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
        cb->fetch_cap = want;
    }
    const int per = (int)(cb->fetch_cap / bytes);
    for (int i0 = 0; i0 < n && !cb->failed; i0 += per) {
        const int m = n - i0 < per ? n - i0 : per;
        for (int i = 0; i < m; i++)
            ck(cb, cudaMemcpyAsync(cb->fetch_h + (size_t)i * bytes, b[i0 + i]->dev, bytes, cudaMemcpyDeviceToHost, cb->stream),
               "reading KV rows");
        if (!cb->failed && ck(cb, cudaStreamSynchronize(cb->stream), "reading KV rows"))
            for (int i = 0; i < m; i++) memcpy(b[i0 + i]->data, cb->fetch_h + (size_t)i * bytes, bytes);
    }
    return cb->failed ? kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure) : 0;
}


/* The pages wholly inside a freed block's host copy, given back (kv_pool_mirror.host_idle):
 * a block the host read once (a save) otherwise keeps them while the server runs. */
static void host_block_idle(void *ctx, void *data, size_t bytes) {
    (void)ctx;
    const uintptr_t page = 4096, lo = ((uintptr_t)data + page - 1) & ~(page - 1),
                    hi = ((uintptr_t)data + bytes) & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}


/* Whether the cache's new block rows come back to the host's copy (tensor parallelism),
 * not only stay on the device (one GPU: kv_pool_mirror.fetch). */
static bool rows_back(const struct kv_cache *c) { return !kv_pool_device_rows(kv_cache_pool(c)); }


/* A shared block copied on write, on the device (kv_pool_mirror.copy). */
static void copy_block(void *ctx, struct kv_block *dst, const struct kv_block *src, size_t bytes) {
    struct cuda_backend *cb = ctx;
    cuk_queue_copy(&cb->q, dst->dev, src->dev, bytes);
}

/* Bytes of `rows` window rows of each of a cache's KV heads, keys and values. */
static size_t win_bytes(const struct cuda_mirror *m, int32_t rows) {
    return 2 * (size_t)m->n_kv * (size_t)rows * m->win_row;
}


/* A cache is freed between steps: its device memory is kept for the next cache. */
static void mirror_free(void *ctx, void *mirror) {
    struct cuda_backend *cb = ctx;
    struct cuda_mirror *m = mirror;
    if (!m) return;
    for (int i = 0; i < cb->n_long && m->long_ring; i++)
        if (cb->long_rings[i] == m) cb->long_rings[i] = NULL;
    mirror_keep(cb, m->table_d, sizeof *m->table_d * (size_t)m->table_cap);
    free(m->table_blk);
    mirror_keep(cb, m->win, win_bytes(m, m->ring_cap));
    mirror_keep(cb, m->sink, win_bytes(m, m->sink_cap));
    mirror_keep(cb, m->mu, sizeof(float) * 4 * (size_t)m->n_kv * (size_t)m->head_dim);
    free(m);
}


struct kv_pool *cuda_kv_pool_new(struct backend *b, size_t budget) {
    struct cuda_backend *cb = cuda(b);
    struct kv_pool_mirror m = {cb, host_block, dev_block, mirror_free, fetch_blocks, copy_block, host_block_idle};
    /* memory for the whole budget now, when it can be had: taken during decoding, a
     * device chunk stalls a step for tens of milliseconds (the host's is only mapped) */
    const size_t have = cb->dev_arena ? cb->dev_arena->cap - cb->dev_arena->used : 0;
    if (budget > have && budget <= ((size_t)1 << 40) && arena_grow(&cb->dev_arena, ARENA_DEVICE, budget))
        arena_grow(&cb->host_arena, ARENA_MAPPED, budget); /* else grown on demand */
    return kv_pool_new_mirrored(budget, &m);
}


/* Tensor parallelism's pool: rank 0's pinned host rows; each rank's n-th of a block
 * at the same chunk and offset of its arena as rank 0's (block_dev), so the arenas
 * grow together or not at all. */
static void *tp_host_block(void *ctx, size_t bytes) {
    struct tp_shared *tp = ctx;
    return arena_alloc(&tp->rank[0]->host_arena, ARENA_PINNED, bytes, ARENA_CHUNK);
}

static void pop_chunk(struct arena **list) {
    struct arena *a = *list;
    *list = a->next;
    a->next = NULL;
    arena_free(a);
}

/* A chunk of cap bytes more on every rank's device arena; false (none added) with an error. */
static bool tp_grow(struct tp_shared *tp, size_t cap) {
    int cur = 0;
    cudaGetDevice(&cur);
    int r = 0;
    for (; r < tp->n; r++) {
        cudaSetDevice(tp->rank[r]->device);
        if (!arena_grow(&tp->rank[r]->dev_arena, ARENA_DEVICE, cap)) break;
    }
    for (int q = 0; q < r && r < tp->n; q++) {
        cudaSetDevice(tp->rank[q]->device);
        pop_chunk(&tp->rank[q]->dev_arena);
    }
    cudaSetDevice(cur);
    return r == tp->n;
}

static void *tp_dev_block(void *ctx, size_t bytes) {
    struct tp_shared *tp = ctx;
    assert(bytes % (size_t)tp->n == 0);
    const size_t part = (bytes / (size_t)tp->n + 255) & ~(size_t)255;
    const struct arena *a0 = tp->rank[0]->dev_arena;
    if ((!a0 || a0->used + part > a0->cap) && !tp_grow(tp, part > ARENA_CHUNK ? part : ARENA_CHUNK)) return NULL;
    void *p0 = NULL;
    for (int r = 0; r < tp->n; r++) { /* room on each: no device call */
        void *p = arena_alloc(&tp->rank[r]->dev_arena, ARENA_DEVICE, part, ARENA_CHUNK);
        if (r == 0) p0 = p;
    }
    return p0;
}

static void tp_mirror_free(void *ctx, void *mirror) {
    struct tp_shared *tp = ctx;
    void **ms = mirror;
    if (!ms) return;
    int cur = 0;
    cudaGetDevice(&cur);
    for (int r = 0; r < tp->n; r++) {
        cudaSetDevice(tp->rank[r]->device);
        mirror_free(tp->rank[r], ms[r]);
    }
    cudaSetDevice(cur);
    free(ms);
}

struct kv_pool *tp_kv_pool_new(struct tp_shared *tp, size_t budget) {
    /* every rank's rows read back: its share of a block (no fetch) */
    struct kv_pool_mirror m = {tp, tp_host_block, tp_dev_block, tp_mirror_free, NULL, NULL, NULL};
    /* the whole budget now where it can be had (cuda_kv_pool_new says why) */
    if (budget > 0 && budget <= ((size_t)1 << 40) && tp_grow(tp, budget / (size_t)tp->n))
        arena_grow(&tp->rank[0]->host_arena, ARENA_PINNED, budget);
    return kv_pool_new_mirrored(budget, &m);
}


/* The backend's state of a cache (made at first use; the pool frees it with the cache).
 * Under tensor parallelism the cache's slot holds one per rank. */
struct cuda_mirror *mirror_of(struct cuda_backend *cb, struct kv_cache *c) {
    struct cuda_mirror **mp = (struct cuda_mirror **)kv_cache_mirror(c);
    if (cb->tp) {
        void **slot = (void **)mp;
        if (!*slot && !(*slot = calloc(TP_MAX, sizeof(struct cuda_mirror *)))) {
            ck(cb, cudaErrorMemoryAllocation, "host memory");
            return NULL;
        }
        mp = (struct cuda_mirror **)*slot + cb->rank;
    }
    if (!*mp && !(*mp = calloc(1, sizeof **mp))) ck(cb, cudaErrorMemoryAllocation, "host memory");
    return *mp;
}


void *block_dev(const struct cuda_backend *cb, const struct kv_block *b) {
    if (!cb->tp || cb->rank == 0) return b->dev;
    /* the same chunk and offset in this rank's arena as in rank 0's */
    const struct arena *a0 = cb->tp->rank[0]->dev_arena, *a = cb->dev_arena;
    for (; a0 && a; a0 = a0->next, a = a->next)
        if ((const uint8_t *)b->dev >= a0->base && (const uint8_t *)b->dev < a0->base + a0->cap)
            return a->base + ((const uint8_t *)b->dev - a0->base);
    assert(!"a block outside rank 0's arena");
    return NULL;
}


/* Where the encode writes the table entry e of a block that position p begins (0:
 * nowhere, sync_table uploads it): the entry past the uploaded ones, or one of them,
 * on a table with room. The mirror takes the block, so sync_table finds the entry
 * current; a decode step that begins a block then issues no scatter, the same
 * launches as other steps. */
static uint64_t table_entry_by_encode(struct cuda_mirror *m, int32_t p, int32_t e, const struct kv_block *block) {
    if (!m || p % KV_BLOCK_TOKENS != 0 || e >= m->table_cap || e > m->table_n) return 0;
    m->table_blk[e] = block;
    if (e == m->table_n) m->table_n = e + 1;
    return (uint64_t)(uintptr_t)(m->table_d + e);
}


/* The cache's block table on the device, made current: the entries that changed.
 * Entries are compared by block: reading every block's address to compare it
 * cost a step the host time of 32 tables of 512 blocks at 32K rows (about 20 ns an
 * entry with the blocks out of cache), before its first issue (docs). */
bool sync_table(struct cuda_backend *cb, struct cuda_mirror *m, const struct kv_view *v) {
    if (v->n_blk > m->table_cap) {
        int32_t cap = m->table_cap ? m->table_cap : 64;
        while (cap < v->n_blk) cap *= 2;
        uint64_t *d = NULL;
        const struct kv_block **hb = malloc(sizeof *hb * (size_t)cap);
        if (!hb || !(d = mirror_alloc(cb, sizeof *d * (size_t)cap, "device memory for a block table"))) {
            free(hb);
            return ck(cb, cudaErrorMemoryAllocation, "host memory");
        }
        if (m->table_d && !keep_after_step(cb, m->table_d, sizeof *m->table_d * (size_t)m->table_cap)) {
            mirror_keep(cb, d, sizeof *d * (size_t)cap);
            free(hb);
            return false;
        }
        free(m->table_blk);
        m->table_d = d;
        m->table_blk = hb;
        m->table_cap = cap;
        m->table_n = 0;
    }
    for (int32_t i = 0; i < v->n_blk;) {
        int32_t j = i;
        while (j < v->n_blk && !(j < m->table_n && m->table_blk[j] == v->blk[j])) j++; /* a run of changed entries */
        if (j > i) { /* their addresses, staged for the device */
            uint64_t *a = copy_space(cb, m->table_d + i, sizeof *a * (size_t)(j - i));
            if (!a) return false;
            for (int32_t k = i; k < j; k++) {
                m->table_blk[k] = v->blk[k];
                a[k - i] = v->blk[k] ? (uint64_t)(uintptr_t)block_dev(cb, v->blk[k]) : 0;
            }
        }
        i = j > i ? j : i + 1;
    }
    m->table_n = v->n_blk;
    return true;
}


/* The rows a cache's ring holds for a pass of n of its tokens: the window rows before
 * the pass (win_span) and the pass's own, which overwrite older ones. Short passes (a
 * decode step's one token) take a short ring; a prompt's chunks take a long one, which
 * rings_step_end makes short after a step that did not need it long (a prompt's
 * chunks in consecutive steps keep it). A long ring for every cache (the largest
 * pass's rows) took 302 MB a Llama-3-8B sequence in the server (docs/cuda-performance.md). */
#define RING_SHORT 16

static int32_t ring_cap_for(const struct cuda_backend *cb, int32_t win_span, int n) {
    return win_span + (n <= RING_SHORT ? RING_SHORT : n > cb->max_tokens ? n : cb->max_tokens);
}


/* Gives m a ring of cap rows a head, into which the device moves the rows the next
 * pass reads of those it holds: positions [from, synced). The old ring is spare now
 * (between steps: the work queued later runs after the move) or after the step. */
static bool ring_resize(struct cuda_backend *cb, struct cuda_mirror *m, int32_t cap, int32_t from, bool now) {
    uint8_t *ring = mirror_alloc(cb, win_bytes(m, cap), "device memory for KV windows");
    if (!ring) return false;
    int32_t lo = m->synced - (cap < m->ring_cap ? cap : m->ring_cap);
    if (lo < from) lo = from;
    if (lo < 0) lo = 0;
    assert(m->win_row % 16 == 0 && m->synced - lo <= cap);
    if (m->valid) cuk_ring_move(&cb->q, ring, cap, m->win, m->ring_cap, 2 * m->n_kv, m->win_row, lo, m->synced);
    const size_t old = win_bytes(m, m->ring_cap);
    if (now) {
        mirror_keep(cb, m->win, old);
    } else if (!keep_after_step(cb, m->win, old)) {
        mirror_keep(cb, ring, win_bytes(m, cap));
        return false;
    }
    m->win = ring;
    m->ring_cap = cap;
    return true;
}


/* A ring longer than a decode step's (needed so by a pass of `tokens`), to be made
 * short at the end of a step that does not use it so. */
static bool note_long(struct cuda_backend *cb, struct cuda_mirror *m, int tokens) {
    m->long_used = m->long_used || tokens > RING_SHORT;
    if (m->long_ring || m->ring_cap <= ring_cap_for(cb, m->win_span, 1)) return true;
    if (cb->n_long == cb->cap_long) {
        const int n = cb->cap_long ? 2 * cb->cap_long : 64;
        struct cuda_mirror **l = realloc(cb->long_rings, sizeof *l * (size_t)n);
        if (!l) return ck(cb, cudaErrorMemoryAllocation, "host memory");
        cb->long_rings = l;
        cb->cap_long = n;
    }
    cb->long_rings[cb->n_long++] = m;
    m->long_ring = true;
    return true;
}


/* After a step's work: the rings it replaced are spare, and (when `shorten`) the long
 * ones it did not use so become short, keeping the rows the next step reads; without
 * `shorten` (a failed step, the backend's end) none stays listed. */
void rings_step_end(struct cuda_backend *cb, bool shorten) {
    for (int i = 0; i < cb->n_later; i++) mirror_keep(cb, cb->later[i].p, cb->later[i].bytes);
    cb->n_later = 0;
    int kept = 0;
    for (int i = 0; i < cb->n_long; i++) {
        struct cuda_mirror *m = cb->long_rings[i];
        if (!m) continue;
        if (shorten && m->long_used) {
            cb->long_rings[kept++] = m;
        } else {
            if (shorten && !cb->failed)
                ring_resize(cb, m, ring_cap_for(cb, m->win_span, 1), m->synced - m->win_span, true);
            m->long_ring = false;
        }
        m->long_used = false;
    }
    cb->n_long = kept;
}


/* The device copy of a cache's windows, made current up to position `limit` (the
 * rows from there on are being encoded on the device) for a pass of n of its tokens:
 * rows appended since the last sync, or all of them after a change that was not an
 * append (kv_cache_epoch). */
struct cuda_mirror *sync_windows(struct cuda_backend *cb, struct kv_cache *c, const struct kv_view *v, int32_t limit,
                                 int n) {
    struct cuda_mirror *m = mirror_of(cb, c);
    const struct kv_shape *sh = kv_cache_get_shape(c);
    int h0;
    const int H = rank_heads(cb, sh->n_kv_heads, &h0), D = sh->head_dim;
    if (!m) return NULL;
    const int32_t cap = ring_cap_for(cb, v->win_span, n);
    if (!m->win) {
        m->win_span = v->win_span;
        m->ring_cap = cap;
        m->sink_cap = v->sinks > 0 ? v->sinks : 1;
        m->n_kv = H;
        m->head_dim = D;
        m->win_row = v->win_row;
        if (!(m->win = mirror_alloc(cb, win_bytes(m, m->ring_cap), "device memory for KV windows")) ||
            !(m->sink = mirror_alloc(cb, win_bytes(m, m->sink_cap), "device memory for KV windows")) ||
            /* the offsets, then room for them rotated (cuk_kv_offsets) */
            !(m->mu = mirror_alloc(cb, sizeof(float) * 4 * (size_t)H * D, "device memory for KV offsets"))) {
            mirror_keep(cb, m->win, win_bytes(m, m->ring_cap));
            mirror_keep(cb, m->sink, win_bytes(m, m->sink_cap));
            m->win = m->sink = NULL;
            return NULL;
        }
        m->valid = false;
    } else if (m->ring_cap < cap && !ring_resize(cb, m, cap, limit - m->win_span, false)) {
        return NULL;
    }
    if (!note_long(cb, m, n)) return NULL;
    const int32_t np = kv_cache_n_past(c) < limit ? kv_cache_n_past(c) : limit;
    const bool full = !m->valid || m->epoch != kv_cache_epoch(c);
    int32_t lo = full ? 0 : m->synced;
    if (lo < np - m->ring_cap) lo = np - m->ring_cap;
    uint8_t *sink = m->sink;
    for (int side = 0; side < 2; side++)
        for (int h = 0; h < H; h++) {
            const size_t hs = (size_t)side * H + h;
            for (int32_t p = full ? 0 : lo; p < np && p < v->sinks; p++) {
                const uint8_t *row = kv_cache_window_row(c, side, h0 + h, p);
                if (row) copy_to(cb, sink + (hs * m->sink_cap + p) * m->win_row, row, m->win_row);
            }
            for (int32_t p = lo; p < np; p++) {
                const uint8_t *row = kv_cache_window_row(c, side, h0 + h, p);
                if (row) copy_to(cb, m->win + (hs * m->ring_cap + p % m->ring_cap) * m->win_row, row, m->win_row);
            }
        }
    /* offsets chosen since (the windows' rows stay as they were) */
    if (full || m->has_mu != (v->mu != NULL || m->mu_chosen)) {
        m->has_mu = v->mu != NULL || m->mu_chosen;
        for (int side = 0; side < 2 && v->mu; side++) /* [2][heads][D]: this rank's heads of each side */
            copy_to(cb, m->mu + (size_t)side * H * D, v->mu + ((size_t)side * sh->n_kv_heads + h0) * D,
                    sizeof(float) * (size_t)H * D);
    }
    m->valid = true;
    m->epoch = kv_cache_epoch(c);
    m->synced = kv_cache_n_past(c);
    return m;
}


/* Queues block b's rows [lo, hi) (this rank's heads of them). */
static void copy_block_rows(struct cuda_backend *cb, struct kv_pool *pool, struct kv_block *b, int32_t lo, int32_t hi,
                            const struct kv_view *v, int n_kv, bool rows) {
    if (b->refs <= 0 || lo >= hi) return;
    const int n = cb->tp ? cb->tp->n : 1;
    const size_t bytes = kv_block_bytes(pool, b), part = bytes / (size_t)n, at = part * (size_t)(cb->tp ? cb->rank : 0);
    uint8_t *dev = block_dev(cb, b);
    if (!rows || 2 * (hi - lo) >= KV_BLOCK_TOKENS || bytes != (size_t)n * n_kv * v->head_bytes) {
        /* most of the block (or a block of another layout): all of it, straight from the
         * host's copy, but staged where a graph records it (mapped host memory is not pinned) */
        if (cb->q.recording && kv_pool_device_rows(pool)) copy_to(cb, dev, b->data + at, part);
        else cuk_queue_copy(&cb->q, dev, b->data + at, part);
        return;
    }
    for (int h = 0; h < n_kv; h++) {
        size_t kh = (size_t)h * v->head_bytes, vh = kh + KV_BLOCK_TOKENS * v->k_row;
        copy_to(cb, dev + kh + lo * v->k_row, b->data + at + kh + lo * v->k_row, (hi - lo) * v->k_row);
        copy_to(cb, dev + vh + lo * v->v_row, b->data + at + vh + lo * v->v_row, (hi - lo) * v->v_row);
    }
}


/* Queues the rows written into blocks since the last step (n_kv: this rank's heads).
 * Under tensor parallelism rank 0 takes them from the pool and keeps the list for
 * the other ranks, which run the same operation after it. */
int sync_blocks(struct cuda_backend *cb, struct kv_pool *pool, const struct kv_view *v, int n_kv, bool rows) {
    struct tp_shared *tp = cb->tp;
    if (tp && cb->rank > 0) {
        for (const struct tp_dirty *d = tp->dirty; d < tp->dirty + tp->n_dirty; d++)
            copy_block_rows(cb, pool, d->b, d->lo, d->hi, v, n_kv, rows);
        return 0;
    }
    struct kv_block **blocks;
    int n = kv_pool_take_dirty(pool, &blocks);
    if (n < 0) return -1;
    if (tp && n > tp->cap_dirty) {
        struct tp_dirty *d = realloc(tp->dirty, sizeof *d * (size_t)(2 * n));
        if (!d) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        tp->dirty = d;
        tp->cap_dirty = 2 * n;
    }
    for (int i = 0; i < n; i++) {
        struct kv_block *b = blocks[i];
        const int32_t lo = b->dirty_lo, hi = b->dirty_hi;
        b->dirty_lo = b->dirty_hi = 0;
        if (tp) tp->dirty[i] = (struct tp_dirty){b, lo, hi};
        copy_block_rows(cb, pool, b, lo, hi, v, n_kv, rows);
    }
    if (tp) tp->n_dirty = n;
    return 0;
}


bool same_format(const struct kv_view *a, const struct kv_view *b) {
    return a->k_bits == b->k_bits && a->v_bits == b->v_bits && a->k_group == b->k_group &&
           a->v_group == b->v_group && a->k_rot == b->k_rot && a->v_rot == b->v_rot;
}


/* The Hadamard signs on the device: the same for every cache of a head size (a fixed seed). */
int ensure_signs(struct cuda_backend *cb, int D, const float *host) {
    if (cb->signs_dim == D) return 0;
    cudaFree(cb->signs);
    cb->signs = NULL;
    cb->signs_dim = 0;
    if (!ck(cb, cudaMalloc((void **)&cb->signs, sizeof(float) * (size_t)D), "device memory") ||
        !ck(cb, cudaMemcpy(cb->signs, host, sizeof(float) * (size_t)D, cudaMemcpyHostToDevice), "signs"))
        return -1;
    cb->signs_dim = D;
    return 0;
}


/* Room for `bytes` more of read-back rows this step (device; kept across a resize). */
static size_t readback_alloc(struct cuda_backend *cb, size_t bytes) {
    size_t off = (cb->rb_used + 15) & ~(size_t)15;
    if (off + bytes > cb->rb_cap) {
        size_t cap = cb->rb_cap ? 2 * cb->rb_cap : (size_t)16 << 20;
        while (cap < off + bytes) cap *= 2;
        uint8_t *d = NULL;
        record_stop(cb); /* what it recorded writes the old buffer */
        if (!ck(cb, cudaMalloc((void **)&d, cap), "device memory for new KV rows")) return (size_t)-1;
        if (cb->rb_used) ck(cb, cudaMemcpyAsync(d, cb->rb_d, cb->rb_used, cudaMemcpyDeviceToDevice, cb->stream), "KV rows");
        wait_streams(cb); /* the copies read the old buffer */
        cudaFree(cb->rb_d);
        cb->rb_d = d;
        cb->rb_cap = cap;
    }
    cb->rb_used = off + bytes;
    return off;
}


/* The pinned read-back buffer at `bytes` (what it held is dropped); false with the
 * failure recorded. */
bool rb_host_make(struct cuda_backend *cb, size_t bytes) {
    cudaFreeHost(cb->rb_h);
    cb->rb_h = NULL;
    cb->rb_h_cap = 0;
    if (!ck(cb, cudaMallocHost((void **)&cb->rb_h, bytes), "pinned memory for new KV rows")) return false;
    cb->rb_h_cap = bytes;
    return true;
}


/* The read-back buffers, device and pinned host, for a pass's rows: made here once
 * (pinning 100 MB took 50-75 ms on an H100 machine's host, which growing them at a
 * prompt's first passes added to its time), grown by readback_alloc and cuda_sync
 * only where a pass appends more than the engine foresaw. */
int cuda_reserve_kv(struct backend *b, size_t bytes) {
    struct cuda_backend *cb = cuda(b);
    if (bytes > cb->rb_cap) {
        cudaFree(cb->rb_d);
        cb->rb_d = NULL;
        cb->rb_cap = 0;
        if (!ck(cb, cudaMalloc((void **)&cb->rb_d, bytes), "device memory for new KV rows"))
            return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
        cb->rb_cap = bytes;
    }
    if (bytes > cb->rb_h_cap && !rb_host_make(cb, bytes)) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    return 0;
}


/* Room for the prepared queries of n tokens. */
bool ensure_qprep(struct cuda_backend *cb, int n, int n_head, int D) {
    const size_t need = cuk_qprep_floats(n > cb->max_tokens ? n : cb->max_tokens, n_head, D);
    return grow_floats(cb, &cb->qprep, &cb->qprep_floats, need, "device memory for attention");
}


/* The rows a token at position q reads by its plan: packed ranges, sinks and window. */
int plan_rows(const struct kv_query_plan *pl, int32_t q) {
    return (pl->b1 >= pl->a1 ? pl->b1 - pl->a1 + 1 : 0) + (pl->b2 >= pl->a2 ? pl->b2 - pl->a2 + 1 : 0) + pl->sinks +
           (pl->ws <= q ? q - pl->ws + 1 : 0);
}


/* Room for the rows of n tokens that an encode leaves for cuk_kv_pack, this step's
 * first free ones; NULL with the failure recorded. */
static float *defer_rows(struct cuda_backend *cb, int n, int H, int D) {
    const size_t need = (size_t)n * 2 * H * D;
    if (cb->defer_used + need > cb->defer_floats) {
        size_t cap = cb->defer_floats ? 2 * cb->defer_floats : 64 * need;
        while (cap < cb->defer_used + need) cap *= 2;
        if (!grow_floats(cb, &cb->defer, &cb->defer_floats, cap, "device memory for KV rows")) return NULL;
    }
    float *at = cb->defer + cb->defer_used;
    cb->defer_used += need;
    return at;
}


_Static_assert(sizeof(struct cuk_qk_rope) == 7 * sizeof(void *) + 6 * 4 &&
                   sizeof(struct cuk_enc_args) == 10 * 4 + 4 * sizeof(size_t) + 6 * sizeof(void *) +
                                                      sizeof(struct cuk_qk_rope),
               "a kernel's argument structs have no padding (a recorded step's bytes would differ)");

/* The staged plan of a cache whose offsets the device chooses in this pass (T: their
 * point): its item, and a row descriptor for each position before the pass's end from
 * `rows` on (`first`: the first's index among its format's). Where rows are read back,
 * the pass's own rows, from pa->p0 (its tokens from t0), go to their read-back rows;
 * the earlier ones' host copies come from the device's blocks at sync (take_offsets). */
static void offsets_plan(struct cuda_backend *cb, const struct pending_append *pa, const struct kv_view *v, int H,
                         struct cuda_mirror *m, int t0, struct cuk_offs_item *item, struct cuk_enc_tok *rows,
                         int first) {
    const int32_t p0 = pa->p0;
    const bool back = rows_back(pa->cache);
    assert(m && m->ring_cap >= p0 + pa->n); /* the ring holds every position of the pass and before */
    *item = (struct cuk_offs_item){.ring = (uint64_t)(uintptr_t)m->win, .mu = (uint64_t)(uintptr_t)m->mu,
                                   .ring_cap = m->ring_cap, .T = pa->offs_T, .first = first};
    for (int32_t p = 0; p < p0 + pa->n; p++) {
        const bool own = p >= p0 && back;
        const struct kv_block *b = v->blk[kv_view_entry(v, p)]; /* (released: a rotating window's) */
        rows[p] = (struct cuk_enc_tok){
            .t = p >= p0 ? t0 + (p - p0) : 0, .p = p, .block = b ? (uint64_t)(uintptr_t)block_dev(cb, b) : 0,
            .rb_k = own ? (uint32_t)(pa->k + (size_t)(p - p0) * H * v->k_row) : CUK_NO_ROW,
            .rb_v = own ? (uint32_t)(pa->v + (size_t)(p - p0) * H * v->v_row) : CUK_NO_ROW};
    }
    m->has_mu = m->mu_chosen = true; /* the attention of this pass reads them (the host's from the next) */
}


/* The layer's new keys and values, encoded into the device cache; the host's copy of
 * the rows is filed during the next sync (kv_cache_append_begin / _end). With r, the same
 * launch first norms and rotates the queries and keys, and prepares the queries for
 * the attention that follows (cuda_attention then skips that launch). */
int cuda_kv_append(struct backend *b, const struct be_kv_append *seqs, int n_seqs, const float *k,
                          const float *v, const struct be_rope *r) {
    struct cuda_backend *cb = cuda(b);
    if (n_seqs <= 0 || cb->failed) return cb->failed ? kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure) : 0;
    const int n_tok = seqs[n_seqs - 1].first + seqs[n_seqs - 1].n;
    step_op(cb, n_tok, false);
    if (cb->q.recording && n_tok > CUK_MATVEC_MAX && n_seqs < n_tok)
        record_stop(cb); /* past CUK_MATVEC_MAX tokens only decode steps (a row a sequence) are recorded */
    cb->qprep_of = NULL;
    double t0 = prof_begin(cb);
    const struct kv_shape *sh = kv_cache_get_shape(seqs[0].cache);
    int h0;
    const int H = rank_heads(cb, sh->n_kv_heads, &h0), D = sh->head_dim;
    if (!cuk_attention_head_dim_supported(D))
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "the CUDA backend takes head sizes 64, 128 and 256, not %d", D);
    if (cb->n_pending + n_seqs > cb->cap_pending) {
        int cap = 2 * (cb->n_pending + n_seqs);
        struct pending_append *pa = realloc(cb->pending, sizeof *pa * (size_t)cap);
        if (!pa) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        cb->pending = pa;
        cb->cap_pending = cap;
    }
    if (n_seqs > cb->cap_seq_enc) {
        free(cb->seq_enc);
        cb->seq_enc = malloc(sizeof *cb->seq_enc * (size_t)n_seqs);
        cb->cap_seq_enc = cb->seq_enc ? n_seqs : 0;
        if (!cb->seq_enc) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    }
    /* the device chooses the offsets in the pass that reaches their point, but for
     * one-row steps (their packing may run after the rows are encoded again) and tensor
     * parallelism (each rank holds some heads; its passes end at the point): the host
     * then (finish_appends) */
    bool one_row_each = cb->q.recording;
    for (int s = 0; s < n_seqs; s++) one_row_each = one_row_each && seqs[s].n == 1;
    const bool device_offsets = !one_row_each && !cb->tp;
    bool past_point = false; /* a cache chooses its offsets before this pass's last row */
    int n_offs = 0, offs_rows = 0;
    for (int s = 0; s < n_seqs; s++) cb->seq_enc[s].offs_T = 0;
    for (int s = 0; s < n_seqs && !(cb->tp && cb->rank > 0); s++) { /* the host's changes, once */
        struct kv_cache *c = seqs[s].cache;
        const int32_t p0 = kv_cache_n_past(c);
        const int32_t T = device_offsets ? kv_cache_append_begin_claim(c, seqs[s].n, p0)
                                         : kv_cache_append_begin(c, seqs[s].n, p0, true);
        if (T > 0) cb->seq_enc[s].offs_T = T;
        if (T < 0) {
            drop_pending(cb); /* the forward pass drops this batch's rows */
            return -1;
        }
        n_offs += T > 0;
        offs_rows += T > 0 ? p0 + seqs[s].n : 0;
        past_point = past_point || (T > 0 && p0 + seqs[s].n > T);
    }
    size_t toks_off = stage_alloc(cb, sizeof(struct cuk_enc_tok) * (size_t)(seqs[n_seqs - 1].first + seqs[n_seqs - 1].n));
    if (toks_off == (size_t)-1) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    struct kv_view views[MAX_FORMATS];
    int n_fmt = 0, k_tok = 0, o_item = 0, o_row = 0;
    int first[MAX_FORMATS + 1] = {0}, first_offs[MAX_FORMATS + 1] = {0}, first_offs_row[MAX_FORMATS + 1] = {0};
    size_t offs_items_off = 0, offs_toks_off = 0;
    /* windows of each cache up to this batch, then its encode descriptors, grouped by format */
    for (int pass = 0; pass < 2; pass++) {
        if (pass && n_offs > 0 &&
            ((offs_items_off = stage_alloc(cb, sizeof(struct cuk_offs_item) * (size_t)n_offs)) == (size_t)-1 ||
             (offs_toks_off = stage_alloc(cb, sizeof(struct cuk_enc_tok) * (size_t)offs_rows)) == (size_t)-1))
            return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
        for (int f = 0; f < (pass ? n_fmt : 1); f++) {
            if (pass) first[f] = k_tok, first_offs[f] = o_item, first_offs_row[f] = o_row;
            for (int s = 0; s < n_seqs; s++) {
                struct kv_cache *c = seqs[s].cache;
                struct kv_view v;
                kv_cache_view(c, &v);
                const int32_t p0 = kv_cache_n_past(c) - seqs[s].n;
                if (!pass) {
                    int g = 0;
                    while (g < n_fmt && !same_format(&views[g], &v)) g++;
                    if (g == n_fmt) {
                        if (n_fmt == MAX_FORMATS)
                            return kvq_error_code(KVQ_ERR_UNSUPPORTED, "more than 4 KV formats in one batch");
                        views[n_fmt++] = v;
                    }
                    cb->seq_enc[s].fmt = g;
                    continue;
                }
                if (cb->seq_enc[s].fmt != f) continue;
                struct cuda_mirror *m = v.windows ? sync_windows(cb, c, &v, p0, seqs[s].n) : NULL;
                if (v.windows && !m) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
                struct cuda_mirror *tm = m ? m : mirror_of(cb, c);
                /* window rows read back: those the host's windows keep (from w0 on); block
                 * rows where the host keeps them current */
                const int32_t w0 = v.windows ? kv_cache_window_rows_from(c, p0) : p0 + seqs[s].n;
                const bool back = rows_back(c);
                const size_t n = (size_t)seqs[s].n, kb = back ? n * H * v.k_row : 0, vb = back ? n * H * v.v_row : 0,
                             wb = (size_t)(p0 + seqs[s].n - w0) * H * v.win_row;
                size_t rb = readback_alloc(cb, kb + vb + 2 * wb);
                if (rb == (size_t)-1) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
                struct pending_append *pa = &cb->pending[cb->n_pending++];
                *pa = (struct pending_append){c, p0, seqs[s].n, w0, rb, rb + kb, rb + kb + vb, rb + kb + vb + wb,
                                              v.windows, 0, cb->seq_enc[s].offs_T};
                for (int i = 0; i < seqs[s].n; i++, k_tok++) {
                    const int32_t p = p0 + i, e = kv_view_entry(&v, p);
                    const size_t wr = (size_t)(p - w0) * H * v.win_row;
                    const uint64_t block = (uint64_t)(uintptr_t)block_dev(cb, v.blk[e]);
                    struct cuk_enc_tok *tk = (struct cuk_enc_tok *)(cb->stage_h + toks_off) + k_tok;
                    *tk = (struct cuk_enc_tok){
                        .t = seqs[s].first + i, .p = p, .block = block,
                        .table_at = table_entry_by_encode(tm, p, e, v.blk[e]),
                        .ring = m ? (uint64_t)(uintptr_t)m->win : 0,
                        .sink = m ? (uint64_t)(uintptr_t)m->sink : 0,
                        .ring_cap = m ? m->ring_cap : 1, .sink_cap = m ? m->sink_cap : 1, .sinks = v.sinks,
                        .repack = pa->offs_T > 0, .mu = m && m->has_mu ? (uint64_t)(uintptr_t)m->mu : 0,
                        .rb_k = back ? (uint32_t)(rb + (size_t)i * H * v.k_row) : CUK_NO_ROW,
                        .rb_v = back ? (uint32_t)(rb + kb + (size_t)i * H * v.v_row) : CUK_NO_ROW,
                        .rb_wk = p < w0 ? CUK_NO_ROW : (uint32_t)(rb + kb + vb + wr),
                        .rb_wv = p < w0 ? CUK_NO_ROW : (uint32_t)(rb + kb + vb + wb + wr),
                    };
                }
                if (pa->offs_T > 0) { /* after the tokens: they encode as before the offsets */
                    offsets_plan(cb, pa, &v, H, m, seqs[s].first,
                                 (struct cuk_offs_item *)(cb->stage_h + offs_items_off) + o_item++,
                                 (struct cuk_enc_tok *)(cb->stage_h + offs_toks_off) + o_row, o_row - first_offs_row[f]);
                    o_row += p0 + seqs[s].n;
                }
            }
        }
    }
    first[n_fmt] = k_tok, first_offs[n_fmt] = o_item, first_offs_row[n_fmt] = o_row;
    /* blocks made or copied by the appends (and anything else changed on the host) first:
     * the encode below writes over their new rows */
    if (sync_blocks(cb, kv_cache_pool(seqs[0].cache), &views[0], H, n_fmt == 1) != 0) return -1;
    flush_copies(cb);
    if (ensure_signs(cb, D, views[0].signs) != 0) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    struct cuk_qk_rope rope = {0};
    if (r) {
        if (!ensure_qprep(cb, n_tok, r->n_head, D)) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
        rope = (struct cuk_qk_rope){.q = r->q, .k = r->k, .n_head = r->n_head, .q_norm = dev_vec(cb, r->q_norm),
                                    .k_norm = dev_vec(cb, r->k_norm), .eps = r->eps, .cos = r->cos, .sin = r->sin,
                                    .half = r->half, .pairing = r->pairing, .scale = r->attn_scale};
    }
    /* a recorded step whose sequences append a row each reads those rows from f16
     * windows where the cache keeps its newest rows there (win_span): their packing can
     * go beside the step's attention, or the products after it (held_pack), off the
     * chain of launches it waits for */
    /* a one-token step's packing waits for the next norm after a short attention */
    bool hold = false;
    if (one_row_each && cb->one_token) {
        const int32_t q = kv_cache_n_past(seqs[0].cache) - 1;
        struct kv_query_plan pl;
        kv_cache_query_plan(seqs[0].cache, q, &pl);
        hold = plan_rows(&pl, q) < cuk_long_attn_rows();
    }
    for (int f = 0; f < n_fmt; f++) {
        const struct kv_view *vw = &views[f];
        struct cuk_enc_args args = {
            .k_bits = vw->k_bits, .k_group = vw->k_group, .v_bits = vw->v_bits, .v_group = vw->v_group,
            .k_rot = vw->k_rot, .v_rot = vw->v_rot, .windows = vw->windows, .k_row = vw->k_row, .v_row = vw->v_row,
            .head_bytes = vw->head_bytes, .win_row = vw->win_row, .n_kv = H, .head_dim = D, .k = k, .v = v,
            .signs = cb->signs, .toks = (const struct cuk_enc_tok *)(cb->stage_d + toks_off) + first[f],
            .n = first[f + 1] - first[f], .readback = cb->rb_d, .rope = rope,
        };
        /* prepared as the attention kernels read rotated or packed keys; past a point
         * chosen in this pass by the attention, whose q.mu needs the new offsets */
        if (r && !past_point && (vw->k_rot || vw->k_bits < 16)) args.rope.qprep = cb->qprep;
        if (one_row_each && vw->windows && vw->win_span > 0 && (vw->k_bits < 16 || vw->v_bits < 16) &&
            !(args.defer = defer_rows(cb, args.n, H, D)))
            return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
        cuk_kv_encode(&cb->q, &args);
        if (args.defer && hold) {
            if (cb->n_held_pack == MAX_FORMATS) launch_held_packs(cb); /* no norm since the last append */
            cb->held_pack[cb->n_held_pack++] = args;
        } else {
            cuk_kv_pack(&cb->q, &args);
        }
        if (first_offs[f + 1] > first_offs[f]) { /* the rows are encoded: the offsets from their windows */
            struct cuk_enc_args oa = args;
            oa.rope = (struct cuk_qk_rope){0};
            oa.toks = (const struct cuk_enc_tok *)(cb->stage_d + offs_toks_off) + first_offs_row[f];
            oa.n = first_offs_row[f + 1] - first_offs_row[f];
            cuk_kv_offsets(&cb->q, &oa, (const struct cuk_offs_item *)(cb->stage_d + offs_items_off) + first_offs[f],
                           first_offs[f + 1] - first_offs[f]);
        }
        if (!args.defer && cb->one_token && cb->q.recording) cuk_idle_beside(&cb->q);
    }
    prof_end(cb, P_KV_ENCODE, t0);
    if (!cb->q.recording) copy_new_rows(cb); /* recorded: after the segment is issued */
    if (cb->failed) return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    if (r && !past_point) { /* else the attention prepares the queries with the new offsets */
        cb->qprep_of = r->q;
        cb->qprep_n = n_tok;
        cb->qprep_scale = r->attn_scale;
    }
    return 0;
}


/* The parts the appends' ends left (caches that reached their offsets point), as one
 * list over the threads. */
static void offsets_task(void *arg, int ith, int nth) {
    const struct cuda_backend *cb = arg;
    long total = 0, begin, end;
    for (int i = 0; i < cb->n_pending; i++) total += cb->pending[i].parts;
    kvq_split(total, ith, nth, &begin, &end);
    for (int i = 0, first = 0; i < cb->n_pending; first += cb->pending[i++].parts)
        for (long p = begin > first ? begin : first; p < end && p < first + cb->pending[i].parts; p++)
            kv_cache_offsets_part(cb->pending[i].cache, (int)(p - first));
}


/* The pending appends' rows into the host's copy, an append at a time to whichever
 * thread asks next (a thread the OS holds back then holds back no share of them). */
static void rows_task(void *arg, int ith, int nth) {
    (void)ith, (void)nth;
    struct cuda_backend *cb = arg;
    for (int i; (i = atomic_fetch_add_explicit(&cb->rows_next, 1, memory_order_relaxed)) < cb->rows_to;) {
        const struct pending_append *pa = &cb->pending[i];
        const uint8_t *h = cb->rb_h;
        int h0;
        const int nh = rank_heads(cb, kv_cache_get_shape(pa->cache)->n_kv_heads, &h0);
        const bool back = rows_back(pa->cache);
        kv_cache_append_heads(pa->cache, pa->p0, pa->n, back ? h + pa->k : NULL, back ? h + pa->v : NULL,
                              pa->windows ? h + pa->wk : NULL, pa->windows ? h + pa->wv : NULL, pa->w0, h0, nh);
    }
}


/* Runs task over the host threads (the pool made at first need), or inline. */
static void on_host_threads(struct cuda_backend *cb, kvq_task_fn task, void *arg) {
    if (!cb->pool && cb->n_threads != 1) cb->pool = kvq_threads_new(cb->n_threads);
    if (cb->pool) kvq_threads_run(cb->pool, task, arg);
    else task(arg, 0, 1);
}

void cuda_run_on_host_threads(struct backend *b, kvq_task_fn fn, void *arg) { on_host_threads(cuda(b), fn, arg); }


/* The rows of the pending appends up to `to` (read back) into the host's copy: on
 * the host threads when they are many (a prompt's, or a layer's of 64 sequences or
 * more: 128 sequences' rows are some 50 small copies each, which on one thread made
 * a server step wait), else on this thread. A decode step's 32 one-token appends are
 * a few KB: waking 15 threads for them each step made a 64-token run on a 16-core
 * host decode up to a third slower now and then (a thread late to run holds the
 * step), and never with 4 threads or 1. Where a step's rows come back a layer at a
 * time (COPIES_HELD copies or more: a step launched as queued), rows for the threads
 * wait, unless `last`, until there are ROWS_A_WAKE of them: a wide step's 32 layers
 * then wake the threads 8 times, not 32. A recorded step's come back a segment at a
 * time, a few copies a step, each filed as it comes: held to ROWS_A_WAKE, a
 * 16-sequence step's 512 rows were all filed after the GPU had finished (docs). */
#define ROWS_FOR_THREADS 64
#define ROWS_A_WAKE 512
#define COPIES_HELD 16

void file_rows(struct cuda_backend *cb, int to, bool last) {
    if (to <= cb->rows_from) return;
    long rows = 0; /* that come back: an f16 cache's on one GPU stay there, nothing to file */
    for (int i = cb->rows_from; i < to && rows < ROWS_A_WAKE; i++)
        rows += rows_back(cb->pending[i].cache) || cb->pending[i].windows ? cb->pending[i].n : 0;
    if (rows >= ROWS_FOR_THREADS && rows < ROWS_A_WAKE && !last && cb->n_row_copies >= COPIES_HELD) return;
    if (rows == 0) {
        cb->rows_from = to;
        return;
    }
    cb->rows_to = to;
    atomic_store_explicit(&cb->rows_next, cb->rows_from, memory_order_relaxed);
    if (rows < ROWS_FOR_THREADS) rows_task(cb, 0, 1);
    else on_host_threads(cb, rows_task, cb);
    cb->rows_from = to;
}


/* Floats of a cache's offsets, [2][n_kv_heads][head_dim]. */
static size_t offsets_floats(const struct kv_cache *c) {
    const struct kv_shape *sh = kv_cache_get_shape(c);
    return 2 * (size_t)sh->n_kv_heads * (size_t)sh->head_dim;
}


/* The offsets the device chose in the step (kv_cache_append_begin_claim) into the host's
 * caches, and the rows before each pass that it encoded again: their blocks. 0, or -1
 * with an error. */
static int take_offsets(struct cuda_backend *cb) {
    size_t floats = 0;
    for (int i = 0; i < cb->n_pending; i++) floats += cb->pending[i].offs_T > 0 ? offsets_floats(cb->pending[i].cache) : 0;
    if (floats == 0) return 0;
    if (floats > cb->offs_h_floats) {
        cudaFreeHost(cb->offs_h);
        cb->offs_h_floats = 0;
        if (!ck(cb, cudaMallocHost((void **)&cb->offs_h, sizeof(float) * floats), "pinned memory for KV offsets"))
            return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
        cb->offs_h_floats = floats;
    }
    float *at = cb->offs_h;
    for (int i = 0; i < cb->n_pending; i++) {
        const struct pending_append *pa = &cb->pending[i];
        if (pa->offs_T <= 0) continue;
        struct kv_view v;
        kv_cache_view(pa->cache, &v);
        /* the host's copies of the rows before the pass, encoded again (where the device's
         * rows are authoritative, kv_cache_offsets_given marks them stale instead) */
        for (int32_t L = 0; L * KV_BLOCK_TOKENS < pa->p0 && rows_back(pa->cache); L++) {
            struct kv_block *b = v.blk[kv_view_entry(&v, L * KV_BLOCK_TOKENS)];
            if (b)
                ck(cb, cudaMemcpyAsync(b->data, block_dev(cb, b), kv_block_bytes(kv_cache_pool(pa->cache), b),
                                       cudaMemcpyDeviceToHost, cb->stream), "reading KV rows");
        }
        ck(cb, cudaMemcpyAsync(at, mirror_of(cb, pa->cache)->mu, sizeof(float) * offsets_floats(pa->cache),
                               cudaMemcpyDeviceToHost, cb->stream), "reading KV offsets");
        at += offsets_floats(pa->cache);
    }
    if (!ck(cb, cudaStreamSynchronize(cb->stream), "reading KV offsets"))
        return kvq_error_code(KVQ_ERR_DEVICE, "%s", cb->failure);
    at = cb->offs_h;
    for (int i = 0; i < cb->n_pending; i++)
        if (cb->pending[i].offs_T > 0) {
            kv_cache_offsets_given(cb->pending[i].cache, at);
            at += offsets_floats(cb->pending[i].cache);
        }
    return 0;
}


/* After the step: the host's copy of the rows the device encoded that no early copy
 * took (a 4096-token prompt brings 0.5 GB of f16 rows: one host thread copied them at
 * about 6 GB/s), the offsets the device chose, then the host's re-encoding where a
 * cache reached its point without them (tensor parallelism, one-row steps: 32 layers
 * of 8 KV heads re-encode 2 x 8 x 128 rows each, about 70 ms on one thread). */
int finish_appends(struct cuda_backend *cb) {
    int rc = 0, parts = 0;
    double t0 = prof_begin(cb);
    file_rows(cb, cb->n_pending, true);
    /* the host's changes once, after every rank filed its heads' rows: by the last */
    const bool ends = !cb->tp || cb->rank == cb->tp->n - 1;
    if (ends) rc = take_offsets(cb);
    for (int i = 0; i < cb->n_pending && ends; i++) {
        struct pending_append *pa = &cb->pending[i];
        pa->parts = rc == 0 ? kv_cache_append_end(pa->cache, pa->p0, pa->n) : 0;
        if (pa->parts < 0) rc = -1, pa->parts = 0;
        parts += pa->parts;
    }
    if (parts > 0) on_host_threads(cb, offsets_task, cb);
    drop_pending(cb);
    cb->rb_used = 0;
    prof_end(cb, P_KV_FINISH, t0);
    return rc;
}
