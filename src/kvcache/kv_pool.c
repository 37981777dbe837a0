/* KV block pool: budget accounting, refcounts and per-size free lists. */
#include "kvcache/kv_pool.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"

#define POOL_CLASSES 16   /* distinct block sizes (formats x layer shapes) */
#define FREE_LIST_MAX 256 /* blocks kept per size beyond that are returned to the OS */
#define WIN_CLASSES 128    /* window sizes: 4 KB and up, four a power of two */
#define WIN_SPARE_MAX ((size_t)512 << 20)
/* Freed blocks whose host copies hold pages (kv_pool_mirror.host_idle) keep them up to
 * this many bytes: the next sequence's blocks come from the free list, and its rows
 * fetched again into pages already there skip a fault a page (a server converts every
 * finished sequence for its prefix cache); beyond, the pages are given back. */
#define HOST_WARM_MAX ((size_t)1 << 30)

struct size_class {
    size_t bytes;
    struct kv_block *free;
    int n_free;
};

struct kv_pool {
    size_t budget, used;
    int64_t n_blocks;
    int n_classes;
    struct size_class cls[POOL_CLASSES];
    bool mirrored;
    struct kv_pool_mirror mirror;
    struct kv_block **dirty, **taken; /* blocks written since the last take, and the last taken list */
    int n_dirty, cap_dirty, n_taken;
    bool dirty_lost;
    void *win_free[WIN_CLASSES]; /* spare window memory by class, linked through its first bytes */
    size_t win_spare;
    size_t host_warm; /* bytes of freed blocks with host_used */
};

struct kv_pool *kv_pool_new(size_t budget) {
    struct kv_pool *p = calloc(1, sizeof *p);
    if (!p) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    p->budget = budget;
    return p;
}

struct kv_pool *kv_pool_new_mirrored(size_t budget, const struct kv_pool_mirror *m) {
    struct kv_pool *p = kv_pool_new(budget);
    if (p) {
        p->mirrored = true;
        p->mirror = *m;
    }
    return p;
}

const struct kv_pool_mirror *kv_pool_get_mirror(const struct kv_pool *p) { return p->mirrored ? &p->mirror : NULL; }

/* [*lo, *hi) widened to take in [a, b) (an empty one becomes it). */
static void widen(int32_t *lo, int32_t *hi, int32_t a, int32_t b) {
    const bool empty = *lo == *hi;
    if (empty || a < *lo) *lo = a;
    if (empty || b > *hi) *hi = b;
}

void kv_block_touch(struct kv_pool *p, struct kv_block *b, int32_t lo, int32_t hi) {
    if (!p->mirrored) return;
    assert(b->stale_lo == b->stale_hi); /* the host writes rows only once they are current */
    if (kv_pool_device_rows(p)) b->host_used = true;
    widen(&b->dirty_lo, &b->dirty_hi, lo, hi);
    if (b->listed) return;
    if (p->n_dirty == p->cap_dirty) { /* grows with the blocks in use, then stays */
        int cap = p->cap_dirty ? 2 * p->cap_dirty : 256;
        struct kv_block **d = realloc(p->dirty, sizeof *d * (size_t)cap), **t = realloc(p->taken, sizeof *t * (size_t)cap);
        if (d) p->dirty = d;
        if (t) p->taken = t;
        if (!d || !t) {
            p->dirty_lost = true; /* reported by the next take: a row would be missed */
            return;
        }
        p->cap_dirty = cap;
    }
    p->dirty[p->n_dirty++] = b;
    b->listed = true;
}

bool kv_pool_device_rows(const struct kv_pool *p) { return p->mirrored && p->mirror.fetch; }

void kv_block_device_wrote(struct kv_pool *p, struct kv_block *b, int32_t lo, int32_t hi) {
    if (kv_pool_device_rows(p) && b && lo < hi) widen(&b->stale_lo, &b->stale_hi, lo, hi);
}

int kv_blocks_fetch(struct kv_pool *p, struct kv_block *const *b, int n) {
    if (!kv_pool_device_rows(p)) return 0;
    /* the stale ones, up to 64 of one size a call */
    struct kv_block *stale[64];
    for (int i = 0; i < n;) {
        int m = 0;
        size_t bytes = 0;
        for (; i < n && m < 64; i++) {
            if (!b[i] || b[i]->stale_lo == b[i]->stale_hi) continue;
            if (m > 0 && kv_block_bytes(p, b[i]) != bytes) break;
            bytes = kv_block_bytes(p, b[i]);
            stale[m++] = b[i];
        }
        if (m > 0 && p->mirror.fetch(p->mirror.ctx, stale, m, bytes) != 0) return -1;
        for (int j = 0; j < m; j++) stale[j]->stale_lo = stale[j]->stale_hi = 0, stale[j]->host_used = true;
    }
    return 0;
}

int kv_pool_take_dirty(struct kv_pool *p, struct kv_block ***blocks) {
    if (p->dirty_lost) return kvq_error_code(KVQ_ERR_OOM, "out of memory tracking the KV rows to copy to the device");
    struct kv_block **t = p->taken;
    p->taken = p->dirty;
    p->dirty = t;
    p->n_taken = p->n_dirty;
    p->n_dirty = 0;
    for (int i = 0; i < p->n_taken; i++) p->taken[i]->listed = false;
    *blocks = p->taken;
    return p->n_taken;
}

static void block_release(const struct kv_pool *p, struct kv_block *b) {
    if (!p->mirrored) free(b->data); /* a mirror's arenas own theirs */
    free(b);
}

/* The class of a window of `bytes` and its size: the bytes rounded up to 4 KB at least
 * and to their top three bits (at most a quarter more). */
static int win_class(size_t bytes, size_t *size) {
    if (bytes < 4096) bytes = 4096;
    int e = 63 - __builtin_clzll((unsigned long long)bytes);
    const size_t unit = (size_t)1 << (e - 2);
    bytes = (bytes + unit - 1) / unit * unit;
    e = 63 - __builtin_clzll((unsigned long long)bytes);
    *size = bytes;
    const int cls = (e - 12) * 4 + (int)(bytes >> (e - 2)) - 4;
    return cls < WIN_CLASSES ? cls : -1;
}

void *kv_pool_win_alloc(struct kv_pool *p, size_t bytes, bool *fresh) {
    size_t size;
    const int cls = win_class(bytes, &size);
    void *m = cls >= 0 ? p->win_free[cls] : NULL;
    *fresh = m == NULL;
    if (m) {
        memcpy(&p->win_free[cls], m, sizeof(void *));
        p->win_spare -= size;
        return m;
    }
    return malloc(size);
}

void kv_pool_win_free(struct kv_pool *p, void *mem, size_t bytes) {
    if (!mem) return;
    size_t size;
    const int cls = win_class(bytes, &size);
    if (cls < 0 || p->win_spare + size > WIN_SPARE_MAX) {
        free(mem);
        return;
    }
    memcpy(mem, &p->win_free[cls], sizeof(void *));
    p->win_free[cls] = mem;
    p->win_spare += size;
}

void kv_pool_free(struct kv_pool *p) {
    if (!p) return;
    for (int i = 0; i < WIN_CLASSES; i++)
        for (void *m = p->win_free[i], *n; m; m = n) {
            memcpy(&n, m, sizeof n);
            free(m);
        }
    for (int i = 0; i < p->n_classes; i++)
        for (struct kv_block *b = p->cls[i].free, *n; b; b = n) {
            n = b->next;
            block_release(p, b);
        }
    free(p->dirty);
    free(p->taken);
    free(p);
}

static int class_of(struct kv_pool *p, size_t bytes) {
    for (int i = 0; i < p->n_classes; i++)
        if (p->cls[i].bytes == bytes) return i;
    if (p->n_classes == POOL_CLASSES) return kvq_error("too many KV block sizes in one context");
    p->cls[p->n_classes].bytes = bytes;
    return p->n_classes++;
}

struct kv_block *kv_block_new(struct kv_pool *p, size_t bytes) {
    if (!kv_pool_fits(p, bytes)) {
        kvq_error_code(KVQ_ERR_BUDGET, "KV cache budget exhausted: %zu of %zu bytes in use, a block needs %zu more",
                       p->used, p->budget, bytes);
        return NULL;
    }
    int ci = class_of(p, bytes);
    if (ci < 0) return NULL;
    struct size_class *sc = &p->cls[ci];
    struct kv_block *b = sc->free;
    if (b) {
        sc->free = b->next;
        sc->n_free--;
        if (b->host_used) p->host_warm -= bytes;
    } else {
        b = calloc(1, sizeof *b);
        void *data = NULL;
        bool ok = b != NULL;
        if (ok && p->mirrored) {
            ok = (data = p->mirror.host_alloc(p->mirror.ctx, bytes)) && (b->dev = p->mirror.dev_alloc(p->mirror.ctx, bytes));
        } else if (ok) {
            ok = posix_memalign(&data, 64, bytes ? bytes : 64) == 0;
        }
        if (!ok) {
            if (!p->mirrored) free(data);
            free(b);
            kvq_error_code(KVQ_ERR_OOM, "out of memory for a KV block of %zu bytes", bytes);
            return NULL;
        }
        b->data = data;
        b->cls = (uint32_t)ci;
    }
    b->refs = 1;
    b->next = NULL;
    b->stale_lo = b->stale_hi = 0;
    p->used += bytes;
    p->n_blocks++;
    return b;
}

void kv_block_ref(struct kv_block *b) {
    assert(b->refs > 0); /* a block in the free list has no holders to share it */
    b->refs++;
}

void kv_block_unref(struct kv_pool *p, struct kv_block *b) {
    assert(!b || b->refs > 0);
    if (!b || --b->refs > 0) return;
    struct size_class *sc = &p->cls[b->cls];
    assert(p->used >= sc->bytes && p->n_blocks > 0);
    p->used -= sc->bytes;
    p->n_blocks--;
    if (b->host_used && p->host_warm + sc->bytes <= HOST_WARM_MAX) {
        p->host_warm += sc->bytes;
    } else if (b->host_used) {
        if (p->mirror.host_idle) p->mirror.host_idle(p->mirror.ctx, b->data, sc->bytes);
        b->host_used = false;
    }
    if (sc->n_free >= FREE_LIST_MAX && !p->mirrored) {
        block_release(p, b);
        return;
    }
    b->next = sc->free;
    sc->free = b;
    sc->n_free++;
}

size_t kv_block_bytes(const struct kv_pool *p, const struct kv_block *b) { return p->cls[b->cls].bytes; }
size_t kv_pool_budget(const struct kv_pool *p) { return p->budget; }
size_t kv_pool_used(const struct kv_pool *p) { return p->used; }
int64_t kv_pool_blocks(const struct kv_pool *p) { return p->n_blocks; }
bool kv_pool_fits(const struct kv_pool *p, size_t bytes) {
    return p->budget == 0 || (p->used <= p->budget && bytes <= p->budget - p->used);
}
