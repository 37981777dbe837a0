/* What engine.c lends the rest of src/engine (not public). */
#ifndef KVQ_ENGINE_INTERNAL_H
#define KVQ_ENGINE_INTERNAL_H

#include "kvq.h"

struct model;
struct kv_cache;
struct grammar_vocab;
struct tokenizer;

const struct model *engine_model(const struct kvq_context *c);
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

#endif
