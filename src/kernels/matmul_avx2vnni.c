/* The AVX2 matrix kernels again with AVX-VNNI: Q4_0 and Q8_0 products by vpdpbusd, one
 * instruction where vpmaddubsw + vpmaddwd + vpaddd took three (the same sums). */
#define KVQ_AVXVNNI 1
#include "matmul_avx2.c"
