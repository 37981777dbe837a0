/* Tensor element types, numbered as in the GGUF/ggml format, with the facts
 * needed to size a row: values per block and bytes per block. */
#ifndef KVQ_CORE_DTYPE_H
#define KVQ_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

enum kvq_dtype {
    KVQ_F32 = 0,
    KVQ_F16 = 1,
    KVQ_Q4_0 = 2,
    KVQ_Q4_1 = 3,
    KVQ_Q5_0 = 6,
    KVQ_Q5_1 = 7,
    KVQ_Q8_0 = 8,
    KVQ_Q8_1 = 9,
    KVQ_Q2_K = 10,
    KVQ_Q3_K = 11,
    KVQ_Q4_K = 12,
    KVQ_Q5_K = 13,
    KVQ_Q6_K = 14,
    KVQ_Q8_K = 15,
    KVQ_IQ2_XXS = 16,
    KVQ_IQ2_XS = 17,
    KVQ_IQ3_XXS = 18,
    KVQ_IQ1_S = 19,
    KVQ_IQ4_NL = 20,
    KVQ_IQ3_S = 21,
    KVQ_IQ2_S = 22,
    KVQ_IQ4_XS = 23,
    KVQ_I8 = 24,
    KVQ_I16 = 25,
    KVQ_I32 = 26,
    KVQ_I64 = 27,
    KVQ_F64 = 28,
    KVQ_IQ1_M = 29,
    KVQ_BF16 = 30,
    KVQ_TQ1_0 = 34,
    KVQ_TQ2_0 = 35,
    KVQ_DTYPE_COUNT = 40
};

struct kvq_dtype_info {
    const char *name;     /* "q8_0"; NULL for numbers that name no type */
    uint32_t block_size;  /* values per block (1 for plain types) */
    uint32_t block_bytes; /* bytes per block */
};

/* Facts about a type; NULL when the number is unknown. */
const struct kvq_dtype_info *kvq_dtype_info(uint32_t type);
/* Name for messages; "type#N" style text for unknown numbers (static buffer). */
const char *kvq_dtype_name(uint32_t type);
/* Bytes of a row of n values; 0 if the type is unknown or n is not a multiple of the block. */
size_t kvq_dtype_row_bytes(uint32_t type, uint64_t n);
/* Types the compute kernels can multiply with (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K). */
bool kvq_dtype_supported(uint32_t type);

#endif
