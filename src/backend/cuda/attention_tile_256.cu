/* The tensor-core attention kernel (attention_tile.cuh) for head size 256 (Gemma 3),
 * whose warps split the dimensions: a file of its own, so that its kernels compile
 * beside the other head sizes'. */
#include "backend/cuda/attention_tile.cuh"

int attn_tile_launch_256(cuk_queue *qu, const cuk_attn_args *a) { return launch_formats<256>(qu, a); }
