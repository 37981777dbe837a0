/* Reads ../shared/refs/tinydoc/refs.json: the prompts' token ids and greedy
 * continuations computed by Hugging Face transformers. */
#ifndef KVQ_TESTS_REFS_H
#define KVQ_TESTS_REFS_H

#include <stdint.h>

#define REFS_MAX_IDS 64
#define REFS_PROMPTS 4

struct ref_prompt {
    char text[256];
    int n_ids, n_next;
    int32_t ids[REFS_MAX_IDS];  /* prompt with BOS */
    int32_t next[REFS_MAX_IDS]; /* greedy continuation */
    char logits_file[64];
};

/* Loads the four prompts; exits 77 (skip) when the refs are missing. */
void refs_load(struct ref_prompt out[REFS_PROMPTS]);
/* Reads logits_N.f32 ([n_ids][n_vocab]); caller frees. */
float *refs_logits(const struct ref_prompt *p, int n_vocab);

#endif
