/* JSON Schema to grammar rules: the subset OpenAI's structured outputs accept
 * (objects, arrays with min/maxItems, enum, const, anyOf, $ref/$defs, strings with
 * min/maxLength, numbers, integers, booleans, null). Keywords that would need more
 * (pattern, minimum, not, ...) are refused by name, so what the grammar allows
 * always validates. */
#ifndef KVQ_ENGINE_JSON_SCHEMA_H
#define KVQ_ENGINE_JSON_SCHEMA_H

#include <stddef.h>

struct grammar;

/* Adds to g the rules of: prefix, a JSON value the schema (JSON text) accepts, suffix
 * (prefix and suffix literal, may be NULL). Returns the root rule, or -1 with an error
 * naming what is wrong or unsupported. */
int json_schema_compile(struct grammar *g, const char *schema, size_t len, const char *prefix, const char *suffix);

#endif
