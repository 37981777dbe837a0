#include "backend/cpu/cpu_weights.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend/weight.h"
#include "core/error.h"
#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "kernels/matmul.h"

struct cpu_weight {
    const struct weight *w;
    void *rows16; /* NULL, or the 16-row form (a tied embedding table: its output's) */
    bool owned;   /* holds a reference to the process's copy */
};

/* Copies shared by every CPU backend of the process, by the weight's data: two contexts
 * on one model (a server's embeddings beside its sequences) pack and hold a weight once. */
struct shared_copy {
    const void *data;
    void *rows16;
    size_t bytes;
    int refs;
};
static struct shared_copy *shared;
static int n_shared, cap_shared;
static pthread_mutex_t shared_mu = PTHREAD_MUTEX_INITIALIZER;

/* The copy of data's rows (a reference taken), or NULL. Called with shared_mu held. */
static void *shared_take(const void *data) {
    for (int i = 0; i < n_shared; i++)
        if (shared[i].data == data) {
            shared[i].refs++;
            return shared[i].rows16;
        }
    return NULL;
}

/* Gives back a reference; the last one unmaps the copy. */
static void shared_drop(void *rows16) {
    pthread_mutex_lock(&shared_mu);
    for (int i = 0; i < n_shared; i++)
        if (shared[i].rows16 == rows16 && --shared[i].refs == 0) {
            munmap(shared[i].rows16, shared[i].bytes);
            shared[i] = shared[--n_shared];
            break;
        }
    if (n_shared == 0) {
        free(shared);
        shared = NULL;
        cap_shared = 0;
    }
    pthread_mutex_unlock(&shared_mu);
}

static struct cpu_weight *find(const struct cpu_weights *t, const struct weight *w) {
    int lo = 0, hi = t->n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (t->ents[mid].w == w) return &t->ents[mid];
        if ((uintptr_t)t->ents[mid].w < (uintptr_t)w) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

/* Thread ith's share of a weight's tiles of 16 rows. */
struct pack_arg {
    const struct weight *w;
    void *dst;
};
static void pack_tiles(void *arg, int ith, int nth) {
    const struct pack_arg *a = arg;
    const struct weight *w = a->w;
    long t0, t1;
    kvq_split((long)((w->rows + 15) / 16), ith, nth, &t0, &t1);
    if (t0 >= t1) return;
    const int64_t r0 = (int64_t)t0 * 16, r1 = (int64_t)t1 * 16 < w->rows ? (int64_t)t1 * 16 : w->rows;
    kern_rows16_pack(w->type, (const uint8_t *)w->data + (size_t)r0 * w->row_bytes, w->row_bytes, r1 - r0, w->cols,
                     (uint8_t *)a->dst + (size_t)t0 * kern_rows16_tile_bytes(w->type, w->cols));
}

/* ent's copy of w: the process's one (a reference taken), or packed now on the pool's
 * threads. Called with shared_mu held. 0, or -1 with an error. */
static int own_copy(struct kvq_threads *pool, const struct weight *w, struct cpu_weight *ent) {
    if ((ent->rows16 = shared_take(w->data))) {
        ent->owned = true;
        return 0;
    }
    const size_t bytes = kern_rows16_bytes(w->type, w->rows, w->cols);
    if (n_shared == cap_shared) {
        int cap = cap_shared ? 2 * cap_shared : 64;
        struct shared_copy *sc = realloc(shared, sizeof *sc * (size_t)cap);
        if (!sc) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        shared = sc, cap_shared = cap;
    }
    /* mapped, not malloc'd: freeing it then leaves malloc's thresholds alone (a context
     * made after one freed kept freed copies' pages in the heap) */
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return kvq_error_code(KVQ_ERR_OOM, "out of memory for a %zu-byte weight's 16-row form", bytes);
    /* threads: reading the mapped file and the copy's writes go at the speed of memory,
     * not of one core (an 8B Q4_0 model took seconds on one) */
    kvq_threads_run(pool, pack_tiles, &(struct pack_arg){w, m});
    shared[n_shared++] = (struct shared_copy){w->data, m, bytes, 1};
    *ent = (struct cpu_weight){w, m, true};
    if (w->file) gguf_release_pages(w->file, w->data, w->row_bytes * (size_t)w->rows);
    return 0;
}

int cpu_weights_add(struct cpu_weights *t, struct kvq_threads *pool, const struct weight *w) {
    if (find(t, w)) return 0;
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        struct cpu_weight *e = realloc(t->ents, sizeof *e * (size_t)cap);
        if (!e) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        t->ents = e;
        t->cap = cap;
    }
    struct cpu_weight ent = {w, NULL, false};
    if (w->data && kern_rows16_wanted(w->type)) {
        for (int i = 0; i < t->n && !ent.rows16; i++) /* tied: the other descriptor's copy */
            if (t->ents[i].w->data == w->data) ent.rows16 = t->ents[i].rows16;
        if (!ent.rows16 && !w->lookup) {
            pthread_mutex_lock(&shared_mu); /* held while packing: one copy however many contexts start */
            const int rc = own_copy(pool, w, &ent);
            pthread_mutex_unlock(&shared_mu);
            if (rc != 0) return -1;
            /* the products read only the copy now, and so do the lookups of tied
             * embeddings (else every lookup faulted 64 KB of the file back in) */
            for (int i = 0; i < t->n; i++)
                if (t->ents[i].w->data == w->data) t->ents[i].rows16 = ent.rows16;
        }
    }
    int at = t->n;
    while (at > 0 && (uintptr_t)t->ents[at - 1].w > (uintptr_t)w) at--;
    memmove(&t->ents[at + 1], &t->ents[at], sizeof *t->ents * (size_t)(t->n - at));
    t->ents[at] = ent;
    t->n++;
    return 0;
}

const void *cpu_weights_rows16(const struct cpu_weights *t, const struct weight *w) {
    const struct cpu_weight *e = find(t, w);
    return e ? e->rows16 : NULL;
}

void cpu_weights_free(struct cpu_weights *t) {
    for (int i = 0; i < t->n; i++)
        if (t->ents[i].owned) shared_drop(t->ents[i].rows16);
    free(t->ents);
    memset(t, 0, sizeof *t);
}
