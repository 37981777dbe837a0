/* Prompts for kvq bench-serve, sized with the served model's own tokenizer: random
 * tokens of its vocabulary that are one whole lowercase word with their leading
 * space (" the", " kernel"). Joined, such words tokenize back into the same tokens,
 * so a prompt has exactly the size asked for and a shared prefix is the same tokens
 * in every prompt; each size is checked by tokenizing the text as the server does. */
#ifndef KVQ_CLI_BENCH_PROMPTS_H
#define KVQ_CLI_BENCH_PROMPTS_H

#include <stdbool.h>
#include <stdint.h>

#include "kvq.h"

/* n texts of n_tokens tokens each (add_special: BOS counted, as the server adds it
 * to a completion's prompt; chat messages go without), the first n_shared the same
 * in all; the words come from seed. A malloc'd array of malloc'd strings; NULL with
 * an error printed. */
char **bench_prompts(const struct kvq_model *m, int n, int n_tokens, int n_shared, bool add_special, uint64_t seed);

#endif
