/* Output files that are never left half-written and never destroy what they
 * replace: a regular (or new) path is written under a temporary name in the same
 * folder and renamed over the path only once every byte and the close succeeded.
 * A path that exists and is not a regular file (a device, a pipe) is written in
 * place and never removed: kvq only removes files it created itself. */
#ifndef KVQ_CORE_OUTFILE_H
#define KVQ_CORE_OUTFILE_H

#include <stdbool.h>
#include <stdio.h>

struct kvq_outfile {
    FILE *f;
    const char *path;
    char *tmp; /* the temporary name; NULL when writing in place */
};

/* Opens path for writing (binary). Returns o->f, or NULL with kvq_error set
 * ("cannot create 'PATH': reason"). */
FILE *kvq_outfile_open(struct kvq_outfile *o, const char *path);
/* Flushes, checks every earlier write and the close, then renames the temporary
 * file over the path. 0 on success; -1 with kvq_error set, the temporary removed. */
int kvq_outfile_commit(struct kvq_outfile *o);
/* Gives up: closes, removes the temporary (never the path). Safe on a closed one. */
void kvq_outfile_abort(struct kvq_outfile *o);

#endif
