/* The tile loops of the SIMD matrix kernels, one for every ISA and weight type:
 * it walks the output rows [r0, r1) and the tokens in register tiles of R weight
 * rows x T tokens (R in 4, 2, 1; T in 1..4) and calls the ISA file's micro-kernel
 * for each tile. Include only from the ISA files (matmul_avx2.c, matmul_avx512.c).
 *
 * A micro-kernel is an INLINE function tile(t, R, T) with R and T compile-time
 * constants at every call below: kern_tile_loop is inlined with a constant tile
 * function, so each (R, T) becomes its own straight-line kernel with the
 * accumulators in registers (no call per tile). */
#ifndef KVQ_KERNELS_MATMUL_TILES_H
#define KVQ_KERNELS_MATMUL_TILES_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/inline.h"
#include "kernels/matmul.h"

/* One register tile: R weight rows from w, T tokens from xa, each over k values;
 * writes y[t * ys + r] for t < T, r < R. */
struct kern_tile {
    const uint8_t *w;
    size_t wrb; /* bytes per weight row */
    const uint8_t *xa;
    size_t xrb; /* bytes per prepared activation row */
    int64_t k;
    float *y;
    int64_t ys;
    size_t pfd; /* software prefetch distance in bytes for matvec (0: none) */
};
typedef void (*kern_tile_fn)(const struct kern_tile *t, const int R, const int T);

/* How one ISA tiles one weight type. */
struct kern_tiling {
    int rows_1;         /* rows per tile for one token: 4, 2 or 1 */
    int rows_n;         /* rows per tile for 2..4 tokens: 4, 2 or 1 */
    size_t chunk_bytes; /* more than 4 tokens: rows are done in chunks of about this many
                         * weight bytes (kept in L1/L2 while every token group uses them) */
    int chunk_align;    /* chunks are a multiple of this many rows */
    int pf_tiles;       /* matvec (up to 4 tokens): prefetch this many 4-row tiles ahead */
};

/* Tiles of R rows (R constant) over rows [r, re) for T tokens; returns the first
 * row left over. */
INLINE int64_t kern_tile_rows(kern_tile_fn tile, struct kern_tile *t, const uint8_t *w, float *y, const int R,
                              const int T, int64_t r, int64_t re) {
    for (; r + R <= re; r += R) {
        t->w = w + (size_t)r * t->wrb;
        t->y = y + r;
        tile(t, R, T);
    }
    return r;
}

INLINE int64_t kern_tile_rows_t(kern_tile_fn tile, struct kern_tile *t, const uint8_t *w, float *y, const int R,
                                int T, int64_t r, int64_t re) {
    switch (T) {
    case 1: return kern_tile_rows(tile, t, w, y, R, 1, r, re);
    case 2: return kern_tile_rows(tile, t, w, y, R, 2, r, re);
    case 3: return kern_tile_rows(tile, t, w, y, R, 3, r, re);
    default: return kern_tile_rows(tile, t, w, y, R, 4, r, re);
    }
}

/* y rows [r0, r1) for all tokens of a. tl should be a constant known here. */
INLINE void kern_tile_loop(const struct kern_matmul_args *a, int64_t r0, int64_t r1, const struct kern_tiling tl,
                           kern_tile_fn tile) {
    const size_t wrb = a->w_row_bytes, xrb = a->xa_row_bytes;
    const uint8_t *w = (const uint8_t *)a->w;
    int64_t chunk = r1 - r0;
    if (a->n_tok > 4) {
        chunk = (int64_t)(tl.chunk_bytes / (wrb ? wrb : 1));
        chunk -= chunk % tl.chunk_align;
        if (chunk < tl.chunk_align) chunk = tl.chunk_align;
    }
    struct kern_tile t = {.wrb = wrb, .xrb = xrb, .k = a->k, .ys = a->y_stride,
                          .pfd = a->n_tok <= 4 ? (size_t)tl.pf_tiles * 4 * wrb : 0};
    for (int64_t rc = r0; rc < r1; rc += chunk) {
        const int64_t re = rc + chunk < r1 ? rc + chunk : r1;
        for (int t0 = 0; t0 < a->n_tok; t0 += 4) {
            const int T = a->n_tok - t0 < 4 ? a->n_tok - t0 : 4;
            const int R = T == 1 ? tl.rows_1 : tl.rows_n;
            float *y = a->y + (int64_t)t0 * a->y_stride;
            t.xa = (const uint8_t *)a->xa + (size_t)t0 * xrb;
            int64_t r = rc;
            if (R >= 4) r = kern_tile_rows_t(tile, &t, w, y, 4, T, r, re);
            if (R >= 2) r = kern_tile_rows_t(tile, &t, w, y, 2, T, r, re);
            kern_tile_rows_t(tile, &t, w, y, 1, T, r, re);
        }
    }
}

/* The walk for weights in the 16-row form (matmul.h): tiles of 16 rows, their
 * tokens in groups of up to max_t, each group one call group(t, n) of the ISA file,
 * which switches to a micro-kernel for n tokens (n a constant there: called through
 * this pointer with a constant, clang merged the calls and could not unroll). */
struct kern_rows16_tile {
    const uint8_t *tile; /* the tile's blocks */
    int64_t nb;          /* blocks per row */
    const uint8_t *xa;   /* the group's first token's prepared activations */
    size_t xrb;
    float *y; /* y[t * ys + r] for the tile's rows r in [lo, hi) */
    int64_t ys;
    int lo, hi;
    const uint8_t *pf; /* NULL, or the next tile (prefetched by the first group) */
};
typedef void (*kern_rows16_group_fn)(const struct kern_rows16_tile *t, int n);

static inline void kern_rows16_loop(const struct kern_matmul_args *a, int64_t r0, int64_t r1, int max_t,
                                    kern_rows16_group_fn group) {
    const size_t tb = kern_rows16_tile_bytes(a->wtype, a->k);
    struct kern_rows16_tile t = {.nb = a->k / 32, .xrb = a->xa_row_bytes, .ys = a->y_stride};
    for (int64_t tr = r0 / 16 * 16; tr < r1; tr += 16) {
        const uint8_t *tile = (const uint8_t *)a->w16 + (size_t)(tr / 16) * tb;
        t.tile = tile;
        t.lo = r0 > tr ? (int)(r0 - tr) : 0;
        t.hi = r1 - tr < 16 ? (int)(r1 - tr) : 16;
        for (int t0 = 0; t0 < a->n_tok; t0 += max_t) {
            t.xa = (const uint8_t *)a->xa + (size_t)t0 * t.xrb;
            t.pf = t0 == 0 && tr + 16 < r1 ? tile + tb : NULL;
            t.y = a->y + (int64_t)t0 * t.ys + tr;
            group(&t, a->n_tok - t0 < max_t ? a->n_tok - t0 : max_t);
        }
    }
}

#endif
