#include "server/prefix_remote.h"

#include <ctype.h>
#include <errno.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define VALUE_MAGIC "KVQPCR1" /* 8 bytes with its NUL: the value header's version */
#define MAX_LOOKUP_BLOCKS 2048 /* boundaries asked for at most (131072 tokens) */
#define MAX_TRIES 3            /* entries tried per lookup, longest first */
#define LOOKUP_BUDGET_S 0.3    /* no further entry is tried after this (a slow store) */
#define BACKOFF_MIN_S 0.25
#define BACKOFF_MAX_S 1.0

/* One connection and its backoff; used by one thread only. */
struct conn {
    redisContext *c;
    double retry_at, backoff;
    int timeout_ms; /* connect and every command */
    unsigned epoch; /* the store's up-period it connected in */
};

struct prefix_remote {
    char *host, *path, *user, *password; /* path: a unix socket (host NULL) */
    int port, db, ttl_s;
    size_t max_value;
    struct conn lookup, writer;
    atomic_bool up;
    atomic_uint epoch; /* counts the outages: a connection of an older epoch has seen one */
    atomic_uint_fast64_t hits, misses, bytes_read, bytes_written, tokens_written, errors, rejected;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}
#define FNV_BASIS 0xcbf29ce484222325ULL

static const char *ns_or_empty(const char *ns) { return ns ? ns : ""; }

/* ---- URL -------------------------------------------------------------------- */

static bool parse_db(const char *s, int *db) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 0 || v > 1 << 20) return false;
    *db = (int)v;
    return true;
}

static int url_fail(char *err, size_t n, const char *url, const char *why) {
    snprintf(err, n, "--prefix-cache-remote '%s': %s", url, why);
    return -1;
}

/* redis://[USER@]HOST[:PORT][/DB] or unix:///PATH[?db=DB]. */
static int parse_url(struct prefix_remote *r, const char *url, char *err, size_t n) {
    r->port = 6379;
    if (!strncmp(url, "unix://", 7)) {
        const char *p = url + 7, *q = strstr(p, "?db=");
        if (*p != '/') return url_fail(err, n, url, "expected unix:///absolute/path.sock");
        size_t len = q ? (size_t)(q - p) : strlen(p);
        if (q && !parse_db(q + 4, &r->db)) return url_fail(err, n, url, "the db must be a number");
        if (!(r->path = strndup(p, len))) return url_fail(err, n, url, "out of memory");
        return 0;
    }
    if (!strncmp(url, "rediss://", 9))
        return url_fail(err, n, url,
                        "TLS is not available: this build's hiredis has no TLS support (reach a remote store "
                        "through a TLS tunnel, or use a unix socket)");
    if (strncmp(url, "redis://", 8)) return url_fail(err, n, url, "expected redis://HOST:PORT[/DB] or unix:///PATH");
    const char *p = url + 8, *at = strchr(p, '@'), *slash;
    if (at) {
        if (memchr(p, ':', (size_t)(at - p)))
            return url_fail(err, n, url,
                            "no password in the URL (it would show in the process list): use "
                            "--prefix-cache-remote-auth FILE or $KVQ_PREFIX_CACHE_REMOTE_AUTH");
        if (at == p || !(r->user = strndup(p, (size_t)(at - p)))) return url_fail(err, n, url, "empty user name");
        p = at + 1;
    }
    slash = strchr(p, '/');
    size_t hlen = slash ? (size_t)(slash - p) : strlen(p);
    const char *colon = memchr(p, ':', hlen);
    if (p[0] == '[') return url_fail(err, n, url, "IPv6 literals are not supported; use a host name");
    if (colon) {
        char port[8] = {0};
        size_t plen = hlen - (size_t)(colon + 1 - p);
        int v = 0;
        if (plen == 0 || plen >= sizeof port) return url_fail(err, n, url, "bad port");
        memcpy(port, colon + 1, plen);
        if (!parse_db(port, &v) || v < 1 || v > 65535) return url_fail(err, n, url, "bad port");
        r->port = v;
        hlen = (size_t)(colon - p);
    }
    if (hlen == 0) return url_fail(err, n, url, "no host");
    if (slash && slash[1] && !parse_db(slash + 1, &r->db)) return url_fail(err, n, url, "the db must be a number");
    if (!(r->host = strndup(p, hlen))) return url_fail(err, n, url, "out of memory");
    return 0;
}

/* The password: the file's first line, or the environment's. */
static int read_auth(struct prefix_remote *r, const char *file, char *err, size_t n) {
    const char *env = getenv("KVQ_PREFIX_CACHE_REMOTE_AUTH");
    if (!file) {
        if (env && *env && !(r->password = strdup(env))) return snprintf(err, n, "out of memory"), -1;
        return 0;
    }
    FILE *f = fopen(file, "r");
    char line[1024];
    if (!f) return snprintf(err, n, "--prefix-cache-remote-auth '%s': %s", file, strerror(errno)), -1;
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    line[got ? strcspn(line, "\r\n") : 0] = '\0';
    if (!line[0]) return snprintf(err, n, "--prefix-cache-remote-auth '%s': no password on its first line", file), -1;
    r->password = strdup(line);
    memset(line, 0, sizeof line);
    return r->password ? 0 : (snprintf(err, n, "out of memory"), -1);
}

/* ---- connections ------------------------------------------------------------- */

static const char *where(const struct prefix_remote *r, char *buf, size_t n) {
    if (r->path) snprintf(buf, n, "unix:%s", r->path);
    else snprintf(buf, n, "%s:%d", r->host, r->port);
    return buf;
}

/* The connection failed (why): closed, and the next attempt waits. Logs when the
 * store turns unreachable. A connection made before an outage the other one already
 * saw (and recovered from) fails quietly and reconnects at its next use. */
static void conn_fail(struct prefix_remote *r, struct conn *k, const char *why) {
    char w[300];
    bool stale = k->c && k->epoch != atomic_load(&r->epoch);
    if (!stale && atomic_exchange(&r->up, false)) {
        atomic_fetch_add(&r->epoch, 1);
        fprintf(stderr,
                "kvq serve: prefix cache remote %s unreachable (%s); serving from the local cache, retrying in the "
                "background\n",
                where(r, w, sizeof w), why);
    }
    atomic_fetch_add(&r->errors, 1);
    if (k->c) redisFree(k->c);
    k->c = NULL;
    if (stale) {
        k->retry_at = 0;
        return;
    }
    k->backoff = k->backoff ? k->backoff * 2 : BACKOFF_MIN_S;
    if (k->backoff > BACKOFF_MAX_S) k->backoff = BACKOFF_MAX_S;
    k->retry_at = now_s() + k->backoff;
}

/* A command went through: the store is reachable. */
static void conn_ok(struct prefix_remote *r, struct conn *k) {
    char w[300];
    k->backoff = 0;
    if (!atomic_load(&r->up) && !atomic_exchange(&r->up, true))
        fprintf(stderr, "kvq serve: prefix cache remote %s reachable\n", where(r, w, sizeof w));
}

/* One command; NULL on a broken connection (then failed); an error reply is counted
 * and freed, and NULL returned, the connection kept. */
static redisReply *command(struct prefix_remote *r, struct conn *k, int argc, const char **argv, const size_t *lens) {
    redisReply *rep = redisCommandArgv(k->c, argc, argv, lens);
    if (!rep) {
        conn_fail(r, k, k->c->errstr[0] ? k->c->errstr : "connection lost");
        return NULL;
    }
    conn_ok(r, k);
    if (rep->type == REDIS_REPLY_ERROR) {
        fprintf(stderr, "kvq serve: prefix cache remote: %s: %.200s\n", argv[0], rep->str);
        atomic_fetch_add(&r->errors, 1);
        freeReplyObject(rep);
        return NULL;
    }
    return rep;
}

/* A command of a new connection (AUTH, SELECT, PING): any error fails it. */
static bool setup(struct prefix_remote *r, struct conn *k, int argc, const char **argv) {
    redisReply *rep = redisCommandArgv(k->c, argc, argv, NULL);
    char why[200];
    if (rep && rep->type != REDIS_REPLY_ERROR) {
        freeReplyObject(rep);
        return true;
    }
    snprintf(why, sizeof why, "%s: %.150s", argv[0], rep ? rep->str : k->c->errstr[0] ? k->c->errstr : "no answer");
    if (rep) freeReplyObject(rep);
    conn_fail(r, k, why);
    return false;
}

/* The connection, made when there is none and the backoff allows; NULL meanwhile. */
static redisContext *conn_get(struct prefix_remote *r, struct conn *k) {
    if (k->c) return k->c;
    if (k->retry_at && now_s() < k->retry_at) return NULL;
    struct timeval tv = {k->timeout_ms / 1000, (k->timeout_ms % 1000) * 1000};
    k->c = r->path ? redisConnectUnixWithTimeout(r->path, tv) : redisConnectWithTimeout(r->host, r->port, tv);
    if (!k->c || k->c->err) {
        char why[160];
        snprintf(why, sizeof why, "%s", k->c ? k->c->errstr : "out of memory");
        if (k->c) redisFree(k->c);
        k->c = NULL; /* not a connection of an older epoch: the backoff applies */
        conn_fail(r, k, why);
        return NULL;
    }
    redisSetTimeout(k->c, tv);
    k->epoch = atomic_load(&r->epoch);
    char db[16];
    snprintf(db, sizeof db, "%d", r->db);
    const char *auth[] = {"AUTH", r->user ? r->user : r->password, r->password}, *select[] = {"SELECT", db},
               *ping[] = {"PING"};
    if ((r->password && !setup(r, k, r->user ? 3 : 2, auth)) || (r->db && !setup(r, k, 2, select)) ||
        !setup(r, k, 1, ping))
        return NULL;
    conn_ok(r, k);
    return k->c;
}

/* Reads count pipelined replies into reps (NULL for error replies); false when the
 * connection broke (then failed, every reply freed). */
static bool read_replies(struct prefix_remote *r, struct conn *k, redisReply **reps, int count) {
    for (int i = 0; i < count; i++) {
        void *rep = NULL;
        if (redisGetReply(k->c, &rep) != REDIS_OK || !rep) {
            for (int j = 0; j < i; j++)
                if (reps[j]) freeReplyObject(reps[j]);
            conn_fail(r, k, k->c->errstr[0] ? k->c->errstr : "connection lost");
            return false;
        }
        reps[i] = rep;
        if (i == 0) conn_ok(r, k);
        if (reps[i]->type == REDIS_REPLY_ERROR) {
            if (i == 0) fprintf(stderr, "kvq serve: prefix cache remote: %.200s\n", reps[i]->str);
            atomic_fetch_add(&r->errors, 1);
            freeReplyObject(reps[i]);
            reps[i] = NULL;
        }
    }
    return true;
}

/* ---- keys and values ----------------------------------------------------------- */

/* Keys: kvq:SPACE:NS:b:CHAIN (a block boundary: its value names an entry) and
 * kvq:SPACE:NS:e:ID (an entry: header and file bytes). SPACE and NS are hashes; the
 * chain starts from the namespace's full name, so a collision of NS hashes never
 * joins two namespaces' chains, and the value's header names the namespace again. */
struct keys {
    char prefix[48];
    uint64_t seed;
};

static void keys_init(struct keys *k, uint64_t space, const char *ns) {
    const char *s = ns_or_empty(ns);
    uint64_t nh = fnv1a(FNV_BASIS, s, strlen(s));
    snprintf(k->prefix, sizeof k->prefix, "kvq:%016" PRIx64 ":%016" PRIx64 ":", space, nh);
    k->seed = fnv1a(fnv1a(FNV_BASIS, &space, sizeof space), s, strlen(s) + 1);
}

/* chains[i]: the hash of the first (i + 1) blocks of toks, for i < n_blocks. */
static void chain_hashes(const struct keys *k, const kvq_token *toks, int n_blocks, uint64_t *chains) {
    uint64_t h = k->seed;
    for (int i = 0; i < n_blocks; i++) {
        h = fnv1a(h, toks + (size_t)i * PREFIX_REMOTE_BLOCK, sizeof *toks * PREFIX_REMOTE_BLOCK);
        chains[i] = h;
    }
}

/* An entry's id, from all its tokens: "HASH-N". */
static void entry_id(const struct keys *k, const kvq_token *toks, int n, char *id, size_t size) {
    uint64_t h = fnv1a(k->seed, toks, sizeof *toks * (size_t)n);
    snprintf(id, size, "%016" PRIx64 "-%d", h, n);
}

/* An index value names an entry id: 16 hex digits, '-', a token count. */
static bool valid_id(const char *s, size_t len) {
    if (len < 18 || len > 28 || s[16] != '-') return false;
    for (size_t i = 0; i < len; i++)
        if (i != 16 && !(i < 16 ? isxdigit((unsigned char)s[i]) : isdigit((unsigned char)s[i]))) return false;
    return true;
}

/* The value header: magic[8], u32 namespace length, the namespace's bytes. */
static size_t header_len(const char *ns) { return 8 + 4 + strlen(ns_or_empty(ns)); }

static void put_header(unsigned char *b, const char *ns) {
    const char *s = ns_or_empty(ns);
    uint32_t n = (uint32_t)strlen(s);
    memcpy(b, VALUE_MAGIC, 8);
    for (int i = 0; i < 4; i++) b[8 + i] = (unsigned char)(n >> (8 * i));
    memcpy(b + 12, s, n);
}

/* The file bytes after a header naming ns; NULL when the header is not that. */
static const unsigned char *check_header(const unsigned char *v, size_t len, const char *ns, size_t *file_len) {
    const char *s = ns_or_empty(ns);
    size_t h = header_len(ns);
    if (len < h || memcmp(v, VALUE_MAGIC, 8)) return NULL;
    uint32_t n = 0;
    for (int i = 0; i < 4; i++) n |= (uint32_t)v[8 + i] << (8 * i);
    if (n != strlen(s) || memcmp(v + 12, s, n)) return NULL;
    *file_len = len - h;
    return v + h;
}

/* ---- lookup -------------------------------------------------------------------- */

/* Deletes a value that was refused (so a good one can take its key again). */
static void reject(struct prefix_remote *r, const char *key) {
    atomic_fetch_add(&r->rejected, 1);
    fprintf(stderr, "kvq serve: prefix cache remote: skipping %s (not a valid entry of this namespace)\n", key);
    const char *argv[] = {"UNLINK", key};
    redisReply *rep = command(r, &r->lookup, 2, argv, NULL);
    if (rep) freeReplyObject(rep);
}

/* Fetches and offers the entry id; 1: taken, 0: missing, refused or no room, -1: store error. */
static int try_entry(struct prefix_remote *r, const struct keys *ks, const char *id, prefix_remote_accept accept,
                     void *ctx, const char *ns) {
    char key[128];
    snprintf(key, sizeof key, "%se:%s", ks->prefix, id);
    const char *argv[] = {"STRLEN", key};
    redisReply *rep = command(r, &r->lookup, 2, argv, NULL);
    if (!rep) return -1;
    long long len = rep->type == REDIS_REPLY_INTEGER ? rep->integer : -1;
    freeReplyObject(rep);
    if (len <= 0) return 0; /* evicted or expired since the index was read */
    if ((unsigned long long)len > r->max_value) {
        reject(r, key);
        return 0;
    }
    argv[0] = "GET";
    if (!(rep = command(r, &r->lookup, 2, argv, NULL))) return -1;
    int got = 0;
    if (rep->type == REDIS_REPLY_STRING) {
        atomic_fetch_add(&r->bytes_read, rep->len);
        size_t flen;
        const unsigned char *file = check_header((const unsigned char *)rep->str, rep->len, ns, &flen);
        got = file ? accept(ctx, file, flen) : 0;
        if (got == 0) reject(r, key);
    }
    freeReplyObject(rep);
    return got > 0;
}

bool prefix_remote_find(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n, int have,
                        prefix_remote_accept accept, void *ctx) {
    int first = have / PREFIX_REMOTE_BLOCK + 1, last = n / PREFIX_REMOTE_BLOCK; /* block counts to ask for */
    if (last > MAX_LOOKUP_BLOCKS) last = MAX_LOOKUP_BLOCKS;
    double t0 = now_s();
    if (last < first || !conn_get(r, &r->lookup)) return false;
    struct keys ks;
    keys_init(&ks, space, ns);
    int count = last - first + 1;
    uint64_t *chains = malloc(sizeof *chains * (size_t)last);
    char *names = malloc((size_t)count * 80);
    const char **argv = malloc(sizeof *argv * (size_t)(count + 1));
    bool hit = false;
    if (!chains || !names || !argv) goto done;
    chain_hashes(&ks, toks, last, chains);
    argv[0] = "MGET";
    for (int i = 0; i < count; i++) {
        snprintf(names + (size_t)i * 80, 80, "%sb:%016" PRIx64, ks.prefix, chains[first - 1 + i]);
        argv[i + 1] = names + (size_t)i * 80;
    }
    redisReply *rep = command(r, &r->lookup, count + 1, argv, NULL);
    if (!rep) goto done;
    /* the longest boundary first; a few distinct entries at most */
    char tried[MAX_TRIES][32];
    int n_tried = 0;
    for (int i = (int)rep->elements - 1; rep->type == REDIS_REPLY_ARRAY && i >= 0 && n_tried < MAX_TRIES && !hit &&
                                         now_s() - t0 < LOOKUP_BUDGET_S;
         i--) {
        const redisReply *e = rep->element[i];
        if (e->type != REDIS_REPLY_STRING) continue;
        if (!valid_id(e->str, e->len)) {
            reject(r, argv[i + 1]);
            if (!r->lookup.c) break;
            continue;
        }
        bool seen = false;
        for (int j = 0; j < n_tried; j++) seen |= !strcmp(tried[j], e->str);
        if (seen) continue;
        memcpy(tried[n_tried], e->str, e->len + 1);
        int got = try_entry(r, &ks, tried[n_tried++], accept, ctx, ns);
        if (got < 0 && !r->lookup.c) break;
        hit = got > 0;
    }
    freeReplyObject(rep);
    if (r->lookup.c) atomic_fetch_add(hit ? &r->hits : &r->misses, 1);
done:
    free(chains);
    free(names);
    free(argv);
    return hit;
}

/* ---- writes -------------------------------------------------------------------- */

void prefix_remote_put(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n,
                       const void *data, size_t len) {
    int blocks = n / PREFIX_REMOTE_BLOCK;
    if (blocks < 1 || header_len(ns) + len > r->max_value || !conn_get(r, &r->writer)) return;
    if (blocks > MAX_LOOKUP_BLOCKS) blocks = MAX_LOOKUP_BLOCKS;
    struct keys ks;
    keys_init(&ks, space, ns);
    char id[32], key[128], ttl[16];
    entry_id(&ks, toks, n, id, sizeof id);
    snprintf(key, sizeof key, "%se:%s", ks.prefix, id);
    snprintf(ttl, sizeof ttl, "%d", r->ttl_s);
    /* held already (another replica wrote the same tokens): its TTL starts again */
    const char *ex[] = {"EXPIRE", key, ttl};
    redisReply *rep = command(r, &r->writer, 3, ex, NULL);
    if (!rep) return;
    bool held = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
    freeReplyObject(rep);
    if (held) return;
    size_t hl = header_len(ns), vlen = hl + len;
    unsigned char *value = malloc(vlen);
    uint64_t *chains = malloc(sizeof *chains * (size_t)blocks);
    redisReply **reps = calloc((size_t)blocks + 1, sizeof *reps);
    if (!value || !chains || !reps) {
        fprintf(stderr, "kvq serve: prefix cache remote: out of memory publishing an entry\n");
        goto done;
    }
    put_header(value, ns);
    memcpy(value + hl, data, len);
    /* the entry first, then its boundaries: an index key never names an entry that
     * was not sent before it */
    const char *argv[] = {"SET", key, (const char *)value, "EX", ttl};
    size_t lens[] = {3, strlen(key), vlen, 2, strlen(ttl)};
    redisAppendCommandArgv(r->writer.c, 5, argv, lens);
    size_t idlen = strlen(id), sent = vlen;
    chain_hashes(&ks, toks, blocks, chains);
    for (int i = 0; i < blocks; i++) {
        char bkey[128];
        snprintf(bkey, sizeof bkey, "%sb:%016" PRIx64, ks.prefix, chains[i]);
        const char *bargv[] = {"SET", bkey, id, "EX", ttl};
        size_t blens[] = {3, strlen(bkey), idlen, 2, strlen(ttl)};
        redisAppendCommandArgv(r->writer.c, 5, bargv, blens);
        sent += idlen + strlen(bkey);
    }
    if (!read_replies(r, &r->writer, reps, blocks + 1)) goto done;
    if (reps[0]) { /* the entry was stored (a full store answers an error instead) */
        atomic_fetch_add(&r->bytes_written, sent);
        atomic_fetch_add(&r->tokens_written, (uint64_t)n);
    }
    for (int i = 0; i <= blocks; i++)
        if (reps[i]) freeReplyObject(reps[i]);
done:
    free(value);
    free(chains);
    free(reps);
}

/* ---- life -------------------------------------------------------------------------- */

struct prefix_remote *prefix_remote_new(const struct prefix_remote_params *p, char *err, size_t err_size) {
    struct prefix_remote *r = calloc(1, sizeof *r);
    if (!r) {
        snprintf(err, err_size, "out of memory");
        return NULL;
    }
    if (parse_url(r, p->url, err, err_size) != 0 || read_auth(r, p->auth_file, err, err_size) != 0 ||
        (r->user && !r->password && url_fail(err, err_size, p->url, "a user name needs a password (--prefix-cache-remote-auth)"))) {
        prefix_remote_free(r);
        return NULL;
    }
    r->ttl_s = p->ttl_s;
    r->max_value = p->max_value;
    r->lookup.timeout_ms = 300;  /* on the scheduler's path: a slow store costs little */
    r->writer.timeout_ms = 3000; /* a writer thread's: a large entry may take a while */
    atomic_init(&r->up, true);   /* so the first failure is logged */
    atomic_init(&r->epoch, 0);
    conn_get(r, &r->lookup);
    char w[300];
    if (atomic_load(&r->up)) fprintf(stderr, "kvq serve: prefix cache remote %s reachable\n", where(r, w, sizeof w));
    return r;
}

void prefix_remote_free(struct prefix_remote *r) {
    if (!r) return;
    if (r->lookup.c) redisFree(r->lookup.c);
    if (r->writer.c) redisFree(r->writer.c);
    free(r->host);
    free(r->path);
    free(r->user);
    if (r->password) memset(r->password, 0, strlen(r->password));
    free(r->password);
    free(r);
}

void prefix_remote_stats(const struct prefix_remote *r, struct prefix_remote_stats *st) {
    struct prefix_remote *w = (struct prefix_remote *)r; /* C11 atomics load through non-const */
    *st = (struct prefix_remote_stats){
        .hits = atomic_load(&w->hits), .misses = atomic_load(&w->misses), .bytes_read = atomic_load(&w->bytes_read),
        .bytes_written = atomic_load(&w->bytes_written), .tokens_written = atomic_load(&w->tokens_written),
        .errors = atomic_load(&w->errors), .rejected = atomic_load(&w->rejected), .up = atomic_load(&w->up)};
}
