/* The AVX-512 fast path again with VBMI: normal-float rows unpack to their level bytes in
 * registers (vpermb, vpmultishiftqb) instead of through copies. */
#define KVQ_VBMI 1
#include "kv_quant_avx512.c"
