#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[512];
static _Thread_local enum kvq_err last_code;

static int set(enum kvq_err code, const char *fmt, va_list ap) {
    /* Formatted aside first: callers often wrap the previous message
     * (kvq_error_wrap("'%s': %s", path, kvq_last_error())), and vsnprintf into the
     * buffer it reads from would garble it. */
    char msg[sizeof last_error];
    vsnprintf(msg, sizeof msg, fmt, ap);
    memcpy(last_error, msg, sizeof msg);
    last_code = code;
    return -1;
}

int kvq_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set(KVQ_ERR_INVALID, fmt, ap);
    va_end(ap);
    return -1;
}

int kvq_error_code(enum kvq_err code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set(code, fmt, ap);
    va_end(ap);
    return -1;
}

int kvq_error_wrap(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    set(last_code == KVQ_OK ? KVQ_ERR_INVALID : last_code, fmt, ap);
    va_end(ap);
    return -1;
}

const char *kvq_last_error(void) { return last_error; }

enum kvq_err kvq_last_error_code(void) { return last_code; }

void kvq_clear_error(void) {
    last_error[0] = '\0';
    last_code = KVQ_OK;
}
