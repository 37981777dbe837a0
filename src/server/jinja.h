/* Jinja templates as Hugging Face chat templates use them, rendered the way
 * transformers renders them (jinja2 with trim_blocks and lstrip_blocks, the
 * loopcontrols extension, tojson as json.dumps with ensure_ascii=False, and the
 * globals raise_exception and strftime_now). A parsed template is immutable and
 * may be rendered by several threads at once. */
#ifndef KVQ_SERVER_JINJA_H
#define KVQ_SERVER_JINJA_H

#include <stddef.h>
#include <time.h>

struct json_t;
struct jinja_template;

/* NULL with a message in err (its line number first) when the text is not a
 * template this interpreter understands. */
struct jinja_template *jinja_parse(const char *src, char *err, size_t err_size);
void jinja_free(struct jinja_template *t);

/* Renders with vars (a JSON object: each key a variable) and strftime_now's clock
 * at now. Returns a malloc'd string, or NULL with the message in err: a template
 * error, raise_exception's message, or a limit (memory, output, macro depth). */
char *jinja_render(const struct jinja_template *t, const struct json_t *vars, time_t now, char *err,
                   size_t err_size);

#endif
