#include "check.h"

#include <stdlib.h>
#include <unistd.h>

int check_failures;
int check_count;

const char *shared_path(const char *rel) {
    static char buf[4096];
    const char *dir = getenv("KVQ_SHARED_DIR");
    if (!dir || !*dir) dir = KVQ_SOURCE_DIR "/../shared";
    snprintf(buf, sizeof buf, "%s/%s", dir, rel);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

const char *require_shared(const char *rel) {
    const char *p = shared_path(rel);
    if (!p) {
        printf("SKIP: test asset ../shared/%s is missing (set KVQ_SHARED_DIR to the shared folder)\n", rel);
        exit(77);
    }
    return p;
}

int check_finish(void) {
    printf("%d checks, %d failed\n", check_count, check_failures);
    return check_failures ? 1 : 0;
}
