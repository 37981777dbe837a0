/* Reads ../shared/refs/<model>/refs.json: the prompts' token ids and greedy
 * continuations computed by Hugging Face transformers. */
#ifndef KVQ_TESTS_REFS_H
#define KVQ_TESTS_REFS_H

#include <stdint.h>

struct kvq_context;

#define REFS_MAX_IDS 64
#define REFS_PROMPTS 4

struct ref_prompt {
    char text[256];
    int n_ids, n_next;
    int32_t ids[REFS_MAX_IDS];  /* prompt with BOS */
    int32_t next[REFS_MAX_IDS]; /* greedy continuation */
    char logits_file[64];
    char dir[32]; /* "tinydoc", "tinygemma3", ... */
};

/* A prompt longer than the window of a sliding-window model: its argmax at every
 * position and the logits of its last n_logits positions. */
struct ref_long {
    int n_ids, n_argmax, n_logits;
    int32_t *ids, *argmax;
    char logits_file[64];
    char dir[32];
};

/* Loads the four tinydoc prompts; exits 77 (skip) when the refs are missing. */
void refs_load(struct ref_prompt out[REFS_PROMPTS]);
/* The same from refs/<dir>/refs.json. */
void refs_load_dir(const char *dir, struct ref_prompt out[REFS_PROMPTS]);
/* The fifth entry (long prompt) of refs/<dir>/refs.json; 0, or -1 if it has none.
 * Free with refs_long_free. */
int refs_load_long(const char *dir, struct ref_long *out);
void refs_long_free(struct ref_long *r);
/* Reads the long prompt's logits ([n_logits][n_vocab]); caller frees. */
float *refs_long_logits(const struct ref_long *r, int n_vocab);
/* The k largest of l[0..n) by selection, larger first, of equal values the lower
 * index: what a greedy draw's candidates must be. */
void refs_top_k(const float *l, int n, int k, float *vals, int32_t *ids);
/* Reads logits_N.f32 ([n_ids][n_vocab]); caller frees. */
float *refs_logits(const struct ref_prompt *p, int n_vocab);
/* Decodes the prompt into sequence 0 of ctx with logits at every position and
 * CHECKs them against the reference: max |dlogit| < 1e-2, the same argmax everywhere.
 * Returns the decode's result (the logits are there to read when 0). */
int refs_check_logits(struct kvq_context *ctx, const struct ref_prompt *p, int n_vocab, const char *label);

#endif
