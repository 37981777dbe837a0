/* The CPU backend's own forms of the model's weights: where this CPU's kernels have a
 * 16-row path for a weight's type (kernels/matmul.h), a packed copy made at upload,
 * one for the whole process (backends of one model share it, counted); the products
 * then read only the copy, and the file's pages of the weight are released. Weights
 * without such a form are read in place from the mapped file. Looked up by the
 * descriptor's address, as the model hands the same descriptors to every step. */
#ifndef KVQ_BACKEND_CPU_WEIGHTS_H
#define KVQ_BACKEND_CPU_WEIGHTS_H

struct weight;
struct kvq_threads;

struct cpu_weights {
    struct cpu_weight *ents; /* sorted by descriptor address */
    int n, cap;
};

/* Registers w, packing it on the pool's threads when this CPU has a 16-row path
 * for its type (not an embedding table, which shares its tied output's copy).
 * 0, or -1 with an error (out of memory). */
int cpu_weights_add(struct cpu_weights *t, struct kvq_threads *pool, const struct weight *w);
/* w's 16-row form, or NULL (read w->data). */
const void *cpu_weights_rows16(const struct cpu_weights *t, const struct weight *w);
void cpu_weights_free(struct cpu_weights *t);

#endif
