#include "core/dtype.h"

#include <stdio.h>

static const struct kvq_dtype_info dtype_table[KVQ_DTYPE_COUNT] = {
    [KVQ_F32] = {"f32", 1, 4},
    [KVQ_F16] = {"f16", 1, 2},
    [KVQ_Q4_0] = {"q4_0", 32, 18},
    [KVQ_Q4_1] = {"q4_1", 32, 20},
    [KVQ_Q5_0] = {"q5_0", 32, 22},
    [KVQ_Q5_1] = {"q5_1", 32, 24},
    [KVQ_Q8_0] = {"q8_0", 32, 34},
    [KVQ_Q8_1] = {"q8_1", 32, 36},
    [KVQ_Q2_K] = {"q2_K", 256, 84},
    [KVQ_Q3_K] = {"q3_K", 256, 110},
    [KVQ_Q4_K] = {"q4_K", 256, 144},
    [KVQ_Q5_K] = {"q5_K", 256, 176},
    [KVQ_Q6_K] = {"q6_K", 256, 210},
    [KVQ_Q8_K] = {"q8_K", 256, 292},
    [KVQ_IQ2_XXS] = {"iq2_xxs", 256, 66},
    [KVQ_IQ2_XS] = {"iq2_xs", 256, 74},
    [KVQ_IQ3_XXS] = {"iq3_xxs", 256, 98},
    [KVQ_IQ1_S] = {"iq1_s", 256, 50},
    [KVQ_IQ4_NL] = {"iq4_nl", 32, 18},
    [KVQ_IQ3_S] = {"iq3_s", 256, 110},
    [KVQ_IQ2_S] = {"iq2_s", 256, 82},
    [KVQ_IQ4_XS] = {"iq4_xs", 256, 136},
    [KVQ_I8] = {"i8", 1, 1},
    [KVQ_I16] = {"i16", 1, 2},
    [KVQ_I32] = {"i32", 1, 4},
    [KVQ_I64] = {"i64", 1, 8},
    [KVQ_F64] = {"f64", 1, 8},
    [KVQ_IQ1_M] = {"iq1_m", 256, 56},
    [KVQ_BF16] = {"bf16", 1, 2},
    [KVQ_TQ1_0] = {"tq1_0", 256, 54},
    [KVQ_TQ2_0] = {"tq2_0", 256, 66},
};

const struct kvq_dtype_info *kvq_dtype_info(uint32_t type) {
    if (type >= KVQ_DTYPE_COUNT || dtype_table[type].name == NULL) return NULL;
    return &dtype_table[type];
}

const char *kvq_dtype_name(uint32_t type) {
    static _Thread_local char buf[32];
    const struct kvq_dtype_info *info = kvq_dtype_info(type);
    if (info) return info->name;
    snprintf(buf, sizeof buf, "unknown type %u", type);
    return buf;
}

size_t kvq_dtype_row_bytes(uint32_t type, uint64_t n) {
    const struct kvq_dtype_info *info = kvq_dtype_info(type);
    if (!info || n % info->block_size != 0) return 0;
    return (size_t)(n / info->block_size) * info->block_bytes;
}

bool kvq_dtype_supported(uint32_t type) {
    switch (type) {
    case KVQ_F32: case KVQ_F16: case KVQ_BF16:
    case KVQ_Q8_0: case KVQ_Q4_0: case KVQ_Q4_K: case KVQ_Q6_K:
        return true;
    default:
        return false;
    }
}
