#include "core/outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"

FILE *kvq_outfile_open(struct kvq_outfile *o, const char *path) {
    *o = (struct kvq_outfile){.path = path};
    struct stat st;
    if (stat(path, &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            kvq_error_code(KVQ_ERR_IO, "cannot create '%s': it is a directory", path);
            return NULL;
        }
        if (!S_ISREG(st.st_mode)) { /* a device or pipe: write in place, never replace it */
            if (!(o->f = fopen(path, "wb")))
                kvq_error_code(KVQ_ERR_IO, "cannot create '%s': %s", path, strerror(errno));
            return o->f;
        }
    }
    size_t n = strlen(path) + 32;
    if (!(o->tmp = malloc(n))) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    /* O_EXCL: the temporary name is ours alone, so removing it later is safe. */
    int fd = -1;
    for (int attempt = 0; attempt < 100 && fd < 0; attempt++) {
        snprintf(o->tmp, n, "%s.tmp%ld.%d", path, (long)getpid(), attempt);
        fd = open(o->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0 || !(o->f = fdopen(fd, "wb"))) {
        kvq_error_code(KVQ_ERR_IO, "cannot create '%s': %s", path, strerror(errno));
        if (fd >= 0) {
            close(fd);
            unlink(o->tmp);
        }
        free(o->tmp);
        o->tmp = NULL;
        return NULL;
    }
    return o->f;
}

int kvq_outfile_commit(struct kvq_outfile *o) {
    if (!o->f) return kvq_error_code(KVQ_ERR_IO, "cannot write '%s'", o->path);
    errno = 0;
    bool ok = fflush(o->f) == 0 && !ferror(o->f);
    int err = errno;
    if (fclose(o->f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    o->f = NULL;
    if (ok && o->tmp && rename(o->tmp, o->path) != 0) {
        ok = false;
        err = errno;
    }
    if (!ok) {
        kvq_outfile_abort(o);
        return kvq_error_code(KVQ_ERR_IO, "cannot write '%s': %s", o->path, err ? strerror(err) : "write error");
    }
    free(o->tmp);
    o->tmp = NULL;
    return 0;
}

void kvq_outfile_abort(struct kvq_outfile *o) {
    if (o->f) fclose(o->f);
    o->f = NULL;
    if (o->tmp) unlink(o->tmp);
    free(o->tmp);
    o->tmp = NULL;
}
