/* What engine.c lends the rest of src/engine (not public). */
#ifndef KVQ_ENGINE_INTERNAL_H
#define KVQ_ENGINE_INTERNAL_H

#include "kvq.h"

struct model;
struct kv_cache;

const struct model *engine_model(const struct kvq_context *c);
const struct kvq_kv_config *engine_kv_config(const struct kvq_context *c);
/* The sequence's caches, [n_layer]; NULL with an error for a bad sequence id. */
struct kv_cache **engine_seq_caches(const struct kvq_context *c, int seq);

#endif
