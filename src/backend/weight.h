/* What the model hands a backend to compute with: the descriptor of a weight matrix
 * as it lies in the model file, and how RoPE pairs a head's elements. A leaf header
 * shared by the model (which fills the descriptors) and the backends (which read
 * them, and keep whatever form of a weight they multiply fastest in their own memory:
 * backend_ops.upload_weight). */
#ifndef KVQ_BACKEND_WEIGHT_H
#define KVQ_BACKEND_WEIGHT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gguf_file;

/* How tensor parallelism divides a weight between GPUs (the Megatron split): whole
 * (embeddings, the output matrix), by output rows (Q/K/V by heads, gate/up by FFN
 * columns), or by input columns (O and down: each GPU's partial product is summed
 * over the GPUs). */
enum weight_split { WEIGHT_WHOLE, WEIGHT_BY_ROWS, WEIGHT_BY_COLS };

/* A weight matrix: rows of `cols` values of one GGUF type, row-major. */
struct weight {
    uint32_t type;
    const void *data;
    int64_t rows, cols;
    size_t row_bytes;
    bool lookup;                  /* an embedding table: read by rows, never multiplied (tied: the output's rows) */
    enum weight_split split;
    const struct gguf_file *file; /* the file data is mapped from: a backend that keeps its own
                                   * copy may release those pages (gguf_release_pages) */
};

/* Which elements RoPE rotates together: (2i, 2i+1) or (i, i + rope_dim/2). */
enum rope_pairing { ROPE_ADJACENT, ROPE_HALVES };

#endif
