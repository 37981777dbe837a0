#include "backend/cpu/cpu_weights.h"

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
    size_t bytes; /* of rows16 when owned */
    bool owned;
};

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

int cpu_weights_add(struct cpu_weights *t, struct kvq_threads *pool, const struct weight *w) {
    if (find(t, w)) return 0;
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 64;
        struct cpu_weight *e = realloc(t->ents, sizeof *e * (size_t)cap);
        if (!e) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
        t->ents = e;
        t->cap = cap;
    }
    struct cpu_weight ent = {w, NULL, 0, false};
    if (w->data && kern_rows16_wanted(w->type)) {
        for (int i = 0; i < t->n && !ent.rows16; i++) /* tied: the other descriptor's copy */
            if (t->ents[i].w->data == w->data) ent.rows16 = t->ents[i].rows16;
        if (!ent.rows16 && !w->lookup) {
            const size_t bytes = kern_rows16_bytes(w->type, w->rows, w->cols);
            /* mapped, not malloc'd: freeing it then leaves malloc's thresholds alone (a
             * context made after one freed kept freed copies' pages in the heap) */
            ent.rows16 = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (ent.rows16 == MAP_FAILED)
                return kvq_error_code(KVQ_ERR_OOM, "out of memory for a %zu-byte weight's 16-row form", bytes);
            ent.owned = true;
            ent.bytes = bytes;
            /* threads: reading the mapped file and the copy's writes go at the speed of
             * memory, not of one core (an 8B Q4_0 model took seconds on one) */
            kvq_threads_run(pool, pack_tiles, &(struct pack_arg){w, ent.rows16});
            /* the products read only the copy now, and so do the lookups of tied
             * embeddings (else every lookup faulted 64 KB of the file back in) */
            for (int i = 0; i < t->n; i++)
                if (t->ents[i].w->data == w->data) t->ents[i].rows16 = ent.rows16;
            if (w->file) gguf_release_pages(w->file, w->data, w->row_bytes * (size_t)w->rows);
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
        if (t->ents[i].owned) munmap(t->ents[i].rows16, t->ents[i].bytes);
    free(t->ents);
    memset(t, 0, sizeof *t);
}
