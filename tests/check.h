/* Minimal test helpers: CHECK records a failure and continues; the test's main
 * returns check_finish(). Exit 77 = skipped (ctest SKIP_RETURN_CODE). */
#ifndef KVQ_TESTS_CHECK_H
#define KVQ_TESTS_CHECK_H

#include <stdbool.h>
#include <stdio.h>

extern int check_failures;
extern int check_count;

#define CHECK(cond, ...)                                                         \
    do {                                                                         \
        check_count++;                                                           \
        if (!(cond)) {                                                           \
            check_failures++;                                                    \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                        \
            fputc('\n', stderr);                                                 \
        }                                                                        \
    } while (0)

/* Path to a file under the shared test assets (../shared or $KVQ_SHARED_DIR),
 * or NULL when the assets are missing. Static buffer, valid until the next call. */
const char *shared_path(const char *rel);
/* Exits with 77 and a clear message when the shared asset is missing. */
const char *require_shared(const char *rel);
/* Prints "N checks, M failed" and returns the exit code. */
int check_finish(void);

#endif
