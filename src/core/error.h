/* One error slot per thread: a failing function returns NULL/-1/false and leaves
 * a human-readable reason here, so callers can print one clear line, and a code
 * (kvq.h's enum kvq_err) that says what kind of failure it was. */
#ifndef KVQ_CORE_ERROR_H
#define KVQ_CORE_ERROR_H

#include "kvq.h"

#if defined(__GNUC__)
#define KVQ_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KVQ_PRINTF(a, b)
#endif

/* Sets the error message (printf-style) with code KVQ_ERR_INVALID. Always returns -1
 * so that `return kvq_error("...")` reads naturally in int-returning functions. */
int kvq_error(const char *fmt, ...) KVQ_PRINTF(1, 2);
/* The same with a code of its own. */
int kvq_error_code(enum kvq_err code, const char *fmt, ...) KVQ_PRINTF(2, 3);
/* Rewords the last error (the message usually includes kvq_last_error()), keeping
 * its code. */
int kvq_error_wrap(const char *fmt, ...) KVQ_PRINTF(1, 2);
/* The message of the last error on this thread ("" when none). */
const char *kvq_last_error(void);
void kvq_clear_error(void);

#endif
