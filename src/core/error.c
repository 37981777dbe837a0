#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[512];

int kvq_error(const char *fmt, ...) {
    /* Formatted aside first: callers often wrap the previous message
     * (kvq_error("'%s': %s", path, kvq_last_error())), and vsnprintf into the
     * buffer it reads from would garble it. */
    char msg[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(last_error, msg, sizeof msg);
    return -1;
}

const char *kvq_last_error(void) { return last_error; }

void kvq_clear_error(void) { last_error[0] = '\0'; }
