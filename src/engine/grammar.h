/* Byte-level context-free grammars for constrained decoding: rules built by a
 * compiler (json_schema.c), matched as a set of stacks advanced byte by byte, and
 * the tokens allowed next found by walking a byte trie of the vocabulary. */
#ifndef KVQ_ENGINE_GRAMMAR_H
#define KVQ_ENGINE_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tokenizer;
struct grammar;
struct grammar_vocab;

/* A set of bytes. */
struct gclass {
    uint64_t bits[4];
};
void gclass_add_range(struct gclass *c, unsigned lo, unsigned hi);

/* An alternative being built: a sequence of elements. Out of memory is remembered
 * and reported when it is added to a rule. */
struct gseq {
    struct gelem *v;
    int n, cap;
    bool oom;
};
void gseq_lit(struct gseq *s, struct grammar *g, const char *text, size_t len);
void gseq_class(struct gseq *s, struct grammar *g, const struct gclass *c);
/* Any number of bytes of the class, matched greedily: what follows it must not
 * start with a byte of the class (the token masks rely on it). */
void gseq_star(struct gseq *s, struct grammar *g, const struct gclass *c);
/* lo to hi bytes of the class (hi >= 1), with the same rule for what follows. */
void gseq_run(struct gseq *s, struct grammar *g, const struct gclass *c, int lo, int hi);
void gseq_ref(struct gseq *s, int rule);
void gseq_free(struct gseq *s);

struct grammar *grammar_new(void);
void grammar_free(struct grammar *g);
/* A new rule without alternatives yet (it may be referred to before it has any). */
int grammar_rule(struct grammar *g);
/* Adds s as an alternative of rule and frees s; 0 or -1 (out of memory, too large). */
int grammar_add_alt(struct grammar *g, int rule, struct gseq *s);
/* Starts matching at rule root; 0 or -1 with an error (a rule with no alternative). */
int grammar_start(struct grammar *g, int root);

/* Advances over bytes: 0, or -1 (nothing changed) when the grammar does not allow them. */
int grammar_accept_bytes(struct grammar *g, const char *b, size_t n);
/* The text so far is a complete sentence of the grammar. */
bool grammar_accepting(const struct grammar *g);
/* Some byte may still follow. */
bool grammar_can_continue(const struct grammar *g);

/* The vocabulary as the grammar sees it: every token's bytes (as the detokenizer
 * writes them; control tokens have none) in a trie. Built once per model, shared
 * by the grammars of all sequences (its caches are locked). */
struct grammar_vocab *grammar_vocab_new(const struct tokenizer *t, int n_vocab);
void grammar_vocab_free(struct grammar_vocab *v);
/* Token id's bytes (*bytes, the count returned; 0 for none or an id out of range). */
int grammar_vocab_token(const struct grammar_vocab *v, int id, const char **bytes);
/* Tells the grammar the vocabulary its masks are for (before grammar_mask). */
int grammar_bind_vocab(struct grammar *g, struct grammar_vocab *v);
/* Sets bit t of allowed ([n_vocab / 64 rounded up]) for each token whose bytes the
 * grammar allows next, and for the end-of-generation tokens when it is accepting.
 * Returns the number of tokens allowed. */
int grammar_mask(struct grammar *g, uint64_t *allowed);

#endif
