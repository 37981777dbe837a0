/* What engine.c lends the rest of src/engine (not public). */
#ifndef KVQ_ENGINE_INTERNAL_H
#define KVQ_ENGINE_INTERNAL_H

#include "kvq.h"

struct model;
struct kv_cache;
struct grammar_vocab;
struct tokenizer;

const struct model *engine_model(const struct kvq_context *c);
/* The k <= KVQ_TOP_N largest of x[0..n), best first, of equal values the first ones
 * (sampler.c: a greedy draw's order). */
void sampler_top(const float *x, int n, int k, float *vals, kvq_token *ids);
/* A draw settled where the logits are (backend.h's be_draw), for a backend whose
 * logits stay in its memory: sampler_plan fills d for s's next draw, with the
 * log-probabilities of the `logprobs` most likely tokens (-1: none), and writes its
 * adjustments (at most sampler_draw_ops_max) to ops, returning how many (0 and a
 * BE_ROW_LOGITS row where the device cannot make it). After the pass, sampler_finish
 * gives the token from row r's results in out and advances s as kvq_sampler_sample
 * would have. A BE_ROW_CUT row first goes through sampler_cut_settles, which sorts its
 * candidates and finds the cut among them (with top-k: its k largest), left in s for
 * sampler_finish; where they do not settle it, the host reads the row (adjusted) and
 * draws by sampler_draw_adjusted. */
struct be_draw;
struct be_draw_op;
struct be_draw_out;
int sampler_draw_ops_max(const struct kvq_sampler *s);
int sampler_plan(const struct kvq_sampler *s, int logprobs, struct be_draw *d, struct be_draw_op *ops);
bool sampler_cut_settles(struct kvq_sampler *s, const struct be_draw_out *out, int r);
kvq_token sampler_finish(struct kvq_sampler *s, const struct be_draw *d, const struct be_draw_out *out, int r);
kvq_token sampler_draw_adjusted(struct kvq_sampler *s, const float *x);
const struct model *engine_model_data(const struct kvq_model *m);
/* The model's vocabulary as grammars see it, made on first use (any thread); NULL
 * with an error. */
struct grammar_vocab *engine_grammar_vocab(const struct kvq_model *m);
const struct kvq_kv_config *engine_kv_config(const struct kvq_context *c);
/* The sequence's caches, [n_layer]; NULL with an error for a bad sequence id. */
struct kv_cache **engine_seq_caches(const struct kvq_context *c, int seq);
/* A held prefix with empty caches (to load into), in the context's config or in kv
 * (which engine_prefix_kv_ok must accept: it differs in format only), and its parts. */
struct kvq_prefix *engine_prefix_new(struct kvq_context *c);
struct kvq_prefix *engine_prefix_new_kv(struct kvq_context *c, const struct kvq_kv_config *kv);
bool engine_prefix_kv_ok(const struct kvq_context *c, const struct kvq_kv_config *kv);
const struct kvq_kv_config *engine_prefix_kv(const struct kvq_prefix *p);
struct kv_cache **engine_prefix_caches(const struct kvq_prefix *p);
struct kvq_context *engine_prefix_context(const struct kvq_prefix *p);

/* seq_state.c's parts of the saved formats, for the shared blocks (seq_blocks.c). */
struct kv_buf;
struct kv_reader;
#define ENGINE_FNV_INIT 0xcbf29ce484222325ull
uint64_t engine_fnv1a(uint64_t h, const void *p, size_t n);
/* The model's fingerprint (the one saved files carry); the context's model's, as
 * computed when it was loaded. */
uint64_t engine_fingerprint(const struct model *m);
uint64_t engine_context_fingerprint(const struct kvq_context *c);
void engine_put_kv_config(struct kv_buf *b, const struct kvq_kv_config *kv);
/* Reads a config written by engine_put_kv_config (file version: fields of older
 * ones); -1 with an error naming `name` for a truncated or impossible one. */
int engine_read_kv_config(struct kv_reader *r, struct kvq_kv_config *kv, uint32_t version, const char *name);
bool engine_same_kv(const struct kvq_kv_config *a, const struct kvq_kv_config *b);
/* kv's per-layer bits for a model of n_layer layers: 0, or -1 with an error (the
 * caches check each layer's bits against its row kind). */
int engine_check_layer_bits(const struct kvq_kv_config *kv, int n_layer);
/* kv's layers' row layouts as a GPU context can hold them: 0, or -1 with an error. */
int engine_check_gpu_layouts(const struct kvq_kv_config *kv, int n_layer, int head_dim);

#endif
