/* One error slot per thread: a failing function returns NULL/-1/false and leaves
 * a human-readable reason here, so callers can print one clear line. */
#ifndef KVQ_CORE_ERROR_H
#define KVQ_CORE_ERROR_H

#if defined(__GNUC__)
#define KVQ_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KVQ_PRINTF(a, b)
#endif

/* Sets the error message (printf-style). Always returns -1 so that
 * `return kvq_error("...")` reads naturally in int-returning functions. */
int kvq_error(const char *fmt, ...) KVQ_PRINTF(1, 2);
/* The message of the last error on this thread ("" when none). */
const char *kvq_last_error(void);
void kvq_clear_error(void);

#endif
