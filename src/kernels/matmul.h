/* Matrix kernels over plain buffers: weight rows in any supported GGUF type times
 * f32 activations, f32 accumulation. The fastest variant for the CPU (AVX-512,
 * AVX2, scalar) is chosen once at run time. These functions never spawn threads:
 * callers split the output rows among threads.
 *
 * Use:
 *   1. kern_act_prepare() converts each activation row to the form the weight type
 *      multiplies with fastest (e.g. Q8_0 blocks for Q8_0/Q4_0 weights, Q8_K for
 *      K-quants, f32 for float weights); kern_act_row_bytes() gives its size.
 *   2. kern_matmul() computes y[t][r] = dot(W[r], x[t]) for a range of rows r and
 *      all n_tok activation rows; it reuses each weight block across tokens
 *      (prefill) and streams rows for a single token (decode). */
#ifndef KVQ_KERNELS_MATMUL_H
#define KVQ_KERNELS_MATMUL_H

#include <stddef.h>
#include <stdint.h>

/* Bytes of one prepared activation row of k values for weights of type wtype. */
size_t kern_act_row_bytes(uint32_t wtype, int64_t k);
/* Prepares one activation row (k values; k a multiple of the weight block size). */
void kern_act_prepare(uint32_t wtype, const float *x, void *dst, int64_t k);

struct kern_matmul_args {
    uint32_t wtype;      /* enum kvq_dtype of the weight */
    const void *w;       /* weight rows, each w_row_bytes long */
    size_t w_row_bytes;
    int64_t k;           /* values per row */
    const void *xa;      /* prepared activations: n_tok rows, each xa_row_bytes long */
    size_t xa_row_bytes;
    int n_tok;
    float *y;            /* output: y[t * y_stride + r] */
    int64_t y_stride;
    const void *w16;     /* NULL, or w in 16-row form (kern_rows16_pack): used where a kernel has that path */
};
/* Computes output rows [r0, r1) for all tokens. */
void kern_matmul(const struct kern_matmul_args *a, int64_t r0, int64_t r1);

/* The 16-row form of Q8_0 and Q4_0 weights, made once at load time for the
 * AVX-512 and AVX2 kernels: one vector then holds 4 codes of each of 16 rows, so
 * a token's block is 8 (Q8_0) vpdpbusd against broadcast activations for all 16
 * rows (AVX2: vpmaddubsw + vpmaddwd per 8 rows), and
 * every row's result is the same sum in the same order whatever the number of
 * tokens (exact int32 block sums, then one FMA per block in block order).
 *   Rows in tiles of 16 (the last one zero-padded); nb = k / 32 blocks per row;
 *   CB = 512 (Q8_0) or 256 (Q4_0) code bytes per block of a tile;
 *   tile i at i * kern_rows16_tile_bytes = round_up(nb * (CB + 32), 64):
 *     block b's codes at b * CB: CB / 64 vectors of 64 bytes; vector j holds at
 *       [4r, 4r + 4) bytes [4j, 4j + 4) of row r's block codes:
 *       Q8_0: the int8 codes + 128 (as uint8);  Q4_0: the 16 nibble bytes as stored;
 *     block b's scales at nb * CB + 32 * b: the 16 rows' f16 d.
 * Same bytes as the rows (plus padding). */
/* True when this CPU's kernels have a 16-row path for weights of type wtype. */
int kern_rows16_wanted(uint32_t wtype);
size_t kern_rows16_tile_bytes(uint32_t wtype, int64_t k);
size_t kern_rows16_bytes(uint32_t wtype, int64_t rows, int64_t k);
/* Packs rows [0, rows) of w (each w_row_bytes long, k values) into dst
 * (kern_rows16_bytes, 64-byte aligned). */
void kern_rows16_pack(uint32_t wtype, const void *w, size_t w_row_bytes, int64_t rows, int64_t k, void *dst);
/* Row `row` of a 16-row form as k floats: the values kern_dequantize_row gives for
 * the row it was packed from (embedding lookups in a tied output's copy). */
void kern_rows16_row(uint32_t wtype, const void *w16, int64_t k, int64_t row, float *dst);

/* Dequantizes one row of n values of any supported type to f32. */
void kern_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n);

/* Which implementation kern_matmul uses: "avx512", "avx2" or "scalar". Setting the
 * environment variable KVQ_SIMD to one of these before the first call forces it
 * (tests compare variants this way). */
const char *kern_simd_level(void);

#endif
