#include "server/prefix_cache.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct entry {
    uint64_t ns;    /* hash of the namespace (prompt_cache_key) */
    kvq_token *tokens;
    int n;
    size_t bytes;
    uint64_t used;  /* LRU clock */
    struct kvq_prefix *prefix;
    char *path;     /* its file, or NULL */
};

struct prefix_cache {
    struct kvq_context *c;
    size_t token_bytes, window_bytes, budget, bytes;
    char *dir;
    struct entry *e;
    int n, cap;
    uint64_t clock;
};

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}
#define FNV_BASIS 0xcbf29ce484222325ULL

static uint64_t ns_hash(const char *ns) { return ns && *ns ? fnv1a(FNV_BASIS, ns, strlen(ns)) : 0; }

/* Whole 64-token blocks of every layer plus the f16 window: what holding n tokens pins. */
static size_t entry_bytes(const struct prefix_cache *pc, int n) {
    return pc->token_bytes * (((size_t)n + 63) / 64 * 64) + pc->window_bytes;
}

static void drop(struct prefix_cache *pc, int i, bool unlink_file) {
    struct entry *e = &pc->e[i];
    if (unlink_file && e->path) remove(e->path);
    kvq_prefix_free(e->prefix);
    free(e->tokens);
    free(e->path);
    pc->bytes -= e->bytes;
    pc->e[i] = pc->e[--pc->n];
}

static int lru(const struct prefix_cache *pc) {
    int best = -1;
    for (int i = 0; i < pc->n; i++)
        if (best < 0 || pc->e[i].used < pc->e[best].used) best = i;
    return best;
}

bool prefix_cache_evict_one(struct prefix_cache *pc) {
    int i = pc ? lru(pc) : -1;
    if (i < 0) return false;
    fprintf(stderr, "kvq serve: cache_evict tokens=%d bytes=%zu\n", pc->e[i].n, pc->e[i].bytes);
    drop(pc, i, true);
    return true;
}

/* Adds an entry (taking tokens, prefix and path), evicting LRU entries to make room. */
static bool add(struct prefix_cache *pc, uint64_t ns, kvq_token *tokens, int n, struct kvq_prefix *p, char *path) {
    size_t bytes = entry_bytes(pc, n);
    if (bytes > pc->budget) return false;
    while (pc->bytes + bytes > pc->budget && prefix_cache_evict_one(pc)) {
    }
    if (pc->n == pc->cap) {
        int cap = pc->cap ? pc->cap * 2 : 16;
        struct entry *e = realloc(pc->e, sizeof *e * (size_t)cap);
        if (!e) return false;
        pc->e = e;
        pc->cap = cap;
    }
    pc->e[pc->n++] = (struct entry){ns, tokens, n, bytes, ++pc->clock, p, path};
    pc->bytes += bytes;
    return true;
}

static int common_prefix(const kvq_token *a, int na, const kvq_token *b, int nb) {
    int i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

int prefix_cache_fetch(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int max_use) {
    uint64_t h = ns_hash(ns);
    int best = -1, best_len = 0;
    for (int i = 0; i < pc->n; i++) {
        if (pc->e[i].ns != h) continue;
        int len = common_prefix(pc->e[i].tokens, pc->e[i].n, toks, max_use);
        if (len > best_len) best = i, best_len = len;
    }
    if (best < 0) return 0;
    /* attach then cut back to the common part; a rotating window that no longer holds
     * that shorter state refuses, and the request is prefilled from scratch */
    if (kvq_prefix_attach(pc->c, seq, pc->e[best].prefix) != 0 || kvq_seq_keep_prefix(pc->c, seq, best_len) != 0 ||
        kvq_seq_len(pc->c, seq) != best_len) {
        kvq_seq_clear(pc->c, seq);
        return 0;
    }
    pc->e[best].used = ++pc->clock;
    return best_len;
}

/* Writes an entry to a temporary name and renames it into place, so a crash never
 * leaves a half-written entry under a name the loader reads. */
static char *persist(struct prefix_cache *pc, const struct kvq_prefix *p, uint64_t ns, const kvq_token *toks, int n) {
    uint64_t th = fnv1a(FNV_BASIS, toks, sizeof *toks * (size_t)n);
    size_t len = strlen(pc->dir) + 64;
    char *path = malloc(len), *tmp = malloc(len + 8);
    if (!path || !tmp) goto fail;
    snprintf(path, len, "%s/%016" PRIx64 "-%016" PRIx64 ".kvq", pc->dir, ns, th);
    snprintf(tmp, len + 8, "%s.tmp", path);
    if (kvq_prefix_save(p, tmp, toks, n, NULL) != 0) {
        fprintf(stderr, "kvq serve: cannot persist a prefix-cache entry: %s\n", kvq_last_error());
        remove(tmp);
        goto fail;
    }
    if (rename(tmp, path) != 0) {
        fprintf(stderr, "kvq serve: cannot rename %s: %s\n", tmp, strerror(errno));
        remove(tmp);
        goto fail;
    }
    free(tmp);
    return path;
fail:
    free(path);
    free(tmp);
    return NULL;
}

void prefix_cache_store(struct prefix_cache *pc, int seq, const char *ns, const kvq_token *toks, int n) {
    uint64_t h = ns_hash(ns);
    if (n <= 0 || entry_bytes(pc, n) > pc->budget) return;
    for (int i = 0; i < pc->n; i++) {
        struct entry *e = &pc->e[i];
        if (e->ns != h) continue;
        int common = common_prefix(e->tokens, e->n, toks, n);
        if (common == n) { /* already covered by a longer (or equal) entry */
            e->used = ++pc->clock;
            return;
        }
        if (common == e->n) drop(pc, i--, true); /* the new entry covers this one */
    }
    kvq_token *copy = malloc(sizeof *copy * (size_t)n);
    struct kvq_prefix *p = copy ? kvq_prefix_hold(pc->c, seq) : NULL;
    if (!p) {
        fprintf(stderr, "kvq serve: cannot hold a prefix: %s\n", copy ? kvq_last_error() : "out of memory");
        free(copy);
        return;
    }
    memcpy(copy, toks, sizeof *copy * (size_t)n);
    char *path = pc->dir ? persist(pc, p, h, toks, n) : NULL;
    if (!add(pc, h, copy, n, p, path)) {
        if (path) remove(path);
        free(path);
        kvq_prefix_free(p);
        free(copy);
        return;
    }
    fprintf(stderr, "kvq serve: cache_store tokens=%d bytes=%zu\n", n, entry_bytes(pc, n));
}

void prefix_cache_usage(const struct prefix_cache *pc, int *entries, size_t *bytes) {
    *entries = pc ? pc->n : 0;
    *bytes = pc ? pc->bytes : 0;
}

struct found {
    char *path;
    uint64_t ns;
    time_t mtime;
};

static int newest_first(const void *a, const void *b) {
    time_t x = ((const struct found *)a)->mtime, y = ((const struct found *)b)->mtime;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Loads the folder's entries, newest first, while they fit the budget; a file that
 * does not load (corrupt, truncated, another model or KV config) is skipped with a
 * log line and left alone. */
static void load_dir(struct prefix_cache *pc) {
    DIR *d = opendir(pc->dir);
    if (!d) {
        fprintf(stderr, "kvq serve: prefix cache folder %s: %s\n", pc->dir, strerror(errno));
        return;
    }
    struct found *f = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        uint64_t ns, th;
        char tail[8];
        if (sscanf(de->d_name, "%16" SCNx64 "-%16" SCNx64 "%7s", &ns, &th, tail) != 3 || strcmp(tail, ".kvq")) continue;
        size_t len = strlen(pc->dir) + strlen(de->d_name) + 2;
        char *path = malloc(len);
        struct stat st;
        if (!path) break;
        snprintf(path, len, "%s/%s", pc->dir, de->d_name);
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(path);
            continue;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            struct found *g = realloc(f, sizeof *g * (size_t)cap);
            if (!g) {
                free(path);
                break;
            }
            f = g;
        }
        f[n++] = (struct found){path, ns, st.st_mtime};
    }
    closedir(d);
    if (n > 1) qsort(f, (size_t)n, sizeof *f, newest_first);
    int loaded = 0;
    for (int i = 0; i < n; i++) {
        struct kvq_seq_extra extra = {0};
        struct kvq_prefix *p = kvq_prefix_load(pc->c, f[i].path, &extra);
        if (!p) {
            fprintf(stderr, "kvq serve: prefix cache: skipping %s: %s\n", f[i].path, kvq_last_error());
            free(f[i].path);
            continue;
        }
        bool ok = extra.n_tokens > 0 && extra.n_tokens == kvq_prefix_len(p) &&
                  pc->bytes + entry_bytes(pc, extra.n_tokens) <= pc->budget;
        if (ok && add(pc, f[i].ns, extra.tokens, extra.n_tokens, p, f[i].path)) {
            extra.tokens = NULL;
            loaded++;
        } else {
            fprintf(stderr, "kvq serve: prefix cache: skipping %s: %s\n", f[i].path,
                    ok ? "out of memory" : "no tokens, or over the prefix-cache budget");
            kvq_prefix_free(p);
            free(f[i].path);
        }
        kvq_seq_extra_free(&extra);
    }
    free(f);
    fprintf(stderr, "kvq serve: prefix cache: loaded %d entries (%zu bytes) from %s\n", loaded, pc->bytes, pc->dir);
}

struct prefix_cache *prefix_cache_new(struct kvq_context *c, const struct kvq_model *m,
                                      const struct kvq_kv_config *kv, size_t budget, const char *dir) {
    struct prefix_cache *pc = calloc(1, sizeof *pc);
    if (!pc) return NULL;
    pc->c = c;
    pc->budget = budget;
    pc->token_bytes = kvq_kv_token_bytes(m, kv);
    pc->window_bytes = kvq_kv_window_bytes(m, kv);
    if (dir && !(pc->dir = strdup(dir))) {
        free(pc);
        return NULL;
    }
    if (pc->dir) {
        if (mkdir(pc->dir, 0755) != 0 && errno != EEXIST)
            fprintf(stderr, "kvq serve: cannot create %s: %s\n", pc->dir, strerror(errno));
        load_dir(pc);
    }
    return pc;
}

void prefix_cache_free(struct prefix_cache *pc) {
    if (!pc) return;
    while (pc->n) drop(pc, pc->n - 1, false);
    free(pc->e);
    free(pc->dir);
    free(pc);
}
