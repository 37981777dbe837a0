/* The long parts of test_paged.c (release suite only): 8 sequences of lengths
 * 1..3000 batched vs alone, and the memory 8 forks of a 2000-token sequence take. */
#define PAGED_SLOW 1
#include "test_paged.c"
