#include "server/prefix_remote.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define VALUE_MAGIC "KVQPCR2" /* 8 bytes with its NUL: the value header's version (1: whole entries) */
#define MAX_LOOKUP_BLOCKS 2048 /* blocks looked up or published at most (131072 tokens) */
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

/* Keys: kvq:SPACE:NS:k:CHAIN, one per block, CHAIN the chain hash of the tokens up to
 * the block's end. SPACE and NS are hashes; the chain starts from the namespace's full
 * name, so a collision of NS hashes never joins two namespaces' chains, and the value's
 * header names the namespace and the chain again. (The first layout's :b: and :e: keys,
 * whole entries, are never read.) */
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

#define KEY_SIZE 80

/* The chains and keys of blocks [first, last) of toks: chains[i] hashes the first
 * (first + i + 1) blocks, names + i * KEY_SIZE is its key. False when out of memory. */
struct block_keys {
    uint64_t *chains;
    char *names;
    int count;
};

static bool block_keys(struct block_keys *bk, const struct keys *k, const kvq_token *toks, int first, int last) {
    bk->count = last - first;
    bk->chains = malloc(sizeof *bk->chains * (size_t)bk->count);
    bk->names = malloc((size_t)bk->count * KEY_SIZE);
    if (!bk->chains || !bk->names) return false;
    uint64_t h = k->seed;
    for (int i = 0; i < last; i++) {
        h = fnv1a(h, toks + (size_t)i * PREFIX_REMOTE_BLOCK, sizeof *toks * PREFIX_REMOTE_BLOCK);
        if (i < first) continue;
        bk->chains[i - first] = h;
        snprintf(bk->names + (size_t)(i - first) * KEY_SIZE, KEY_SIZE, "%sk:%016" PRIx64, k->prefix, h);
    }
    return true;
}

static void block_keys_free(struct block_keys *bk) {
    free(bk->chains);
    free(bk->names);
}

static const char *key_of(const struct block_keys *bk, int i) { return bk->names + (size_t)i * KEY_SIZE; }

/* Sends one command per block (argv[1] its key; argv[k] its value where lens names
 * one) and reads the replies into reps; false when the connection broke. */
static bool pipeline(struct prefix_remote *r, struct conn *k, const struct block_keys *bk, int argc, const char **argv,
                     size_t *lens, redisReply **reps) {
    for (int i = 0; i < bk->count; i++) {
        argv[1] = key_of(bk, i);
        if (lens) lens[1] = strlen(argv[1]);
        redisAppendCommandArgv(k->c, argc, argv, lens);
    }
    return read_replies(r, k, reps, bk->count);
}

static void free_replies(redisReply **reps, int n) {
    for (int i = 0; i < n; i++)
        if (reps[i]) freeReplyObject(reps[i]);
}

/* The value header: magic[8], u32 namespace length, the namespace's bytes, u64 the
 * key's chain (a value copied under another key is refused). */
static size_t header_len(const char *ns) { return 8 + 4 + strlen(ns_or_empty(ns)) + 8; }

static void put_header(unsigned char *b, const char *ns, uint64_t chain) {
    const char *s = ns_or_empty(ns);
    uint32_t n = (uint32_t)strlen(s);
    memcpy(b, VALUE_MAGIC, 8);
    for (int i = 0; i < 4; i++) b[8 + i] = (unsigned char)(n >> (8 * i));
    memcpy(b + 12, s, n);
    for (int i = 0; i < 8; i++) b[12 + n + i] = (unsigned char)(chain >> (8 * i));
}

/* The block's bytes after a header naming ns and chain; NULL when the header is not that. */
static const unsigned char *check_header(const unsigned char *v, size_t len, const char *ns, uint64_t chain,
                                         size_t *body_len) {
    const char *s = ns_or_empty(ns);
    size_t h = header_len(ns);
    if (len < h || memcmp(v, VALUE_MAGIC, 8)) return NULL;
    uint32_t n = 0;
    uint64_t c = 0;
    for (int i = 0; i < 4; i++) n |= (uint32_t)v[8 + i] << (8 * i);
    if (n != strlen(s) || memcmp(v + 12, s, n)) return NULL;
    for (int i = 0; i < 8; i++) c |= (uint64_t)v[12 + n + i] << (8 * i);
    if (c != chain) return NULL;
    *body_len = len - h;
    return v + h;
}

/* ---- lookup -------------------------------------------------------------------- */

/* Deletes a value that was refused (so a good one can take its key again). */
static void reject(struct prefix_remote *r, const char *key) {
    atomic_fetch_add(&r->rejected, 1);
    fprintf(stderr, "kvq serve: prefix cache remote: skipping %s (not a valid block of this namespace)\n", key);
    const char *argv[] = {"UNLINK", key};
    redisReply *rep = command(r, &r->lookup, 2, argv, NULL);
    if (rep) freeReplyObject(rep);
}

static int lookup_last(int n) {
    int last = n / PREFIX_REMOTE_BLOCK;
    return last > MAX_LOOKUP_BLOCKS ? MAX_LOOKUP_BLOCKS : last;
}

int prefix_remote_probe(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n,
                        int first) {
    int last = lookup_last(n), run = first;
    if (last <= first || !conn_get(r, &r->lookup)) return first;
    struct keys ks;
    struct block_keys bk;
    keys_init(&ks, space, ns);
    redisReply **reps = NULL;
    if (block_keys(&bk, &ks, toks, first, last) && (reps = calloc((size_t)bk.count, sizeof *reps))) {
        const char *argv[] = {"STRLEN", NULL};
        if (pipeline(r, &r->lookup, &bk, 2, argv, NULL, reps)) {
            for (int i = 0; i < bk.count; i++) {
                long long len = reps[i] && reps[i]->type == REDIS_REPLY_INTEGER ? reps[i]->integer : 0;
                if (len <= 0) break;
                if ((unsigned long long)len > r->max_value) { /* refused unread */
                    reject(r, key_of(&bk, i));
                    break;
                }
                run = first + i + 1;
            }
            free_replies(reps, bk.count);
        }
    }
    if (run == first && r->lookup.c) atomic_fetch_add(&r->misses, 1);
    free(reps);
    block_keys_free(&bk);
    return run;
}

int prefix_remote_fetch(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int first,
                        int last, prefix_remote_accept accept, void *ctx) {
    if (last <= first || !conn_get(r, &r->lookup)) return 0;
    struct keys ks;
    struct block_keys bk;
    keys_init(&ks, space, ns);
    redisReply **reps = NULL;
    int taken = 0;
    if (block_keys(&bk, &ks, toks, first, last) && (reps = calloc((size_t)bk.count, sizeof *reps))) {
        const char *argv[] = {"GET", NULL};
        if (pipeline(r, &r->lookup, &bk, 2, argv, NULL, reps)) {
            for (int i = 0; i < bk.count; i++) {
                const redisReply *rep = reps[i];
                if (!rep || rep->type != REDIS_REPLY_STRING) break; /* evicted since the probe */
                atomic_fetch_add(&r->bytes_read, rep->len);
                size_t len;
                const unsigned char *body =
                    check_header((const unsigned char *)rep->str, rep->len, ns, bk.chains[i], &len);
                int got = body ? accept(ctx, first + i, body, len) : 0;
                if (got == 0) reject(r, key_of(&bk, i));
                if (got <= 0) break;
                taken++;
            }
            free_replies(reps, bk.count);
        }
    }
    if (r->lookup.c) atomic_fetch_add(taken ? &r->hits : &r->misses, 1);
    free(reps);
    block_keys_free(&bk);
    return taken;
}

/* ---- writes -------------------------------------------------------------------- */

/* Sends blocks [first, blocks) of bk's (encoded by encode) in one pipeline. */
static void send_blocks(struct prefix_remote *r, const char *ns, struct block_keys *bk, int first,
                        prefix_remote_encode encode, void *ctx) {
    const int count = bk->count - first;
    size_t *lens = malloc(sizeof *lens * (size_t)count), hl = header_len(ns), most = 0;
    redisReply **reps = calloc((size_t)count, sizeof *reps);
    void *data = NULL;
    unsigned char *value = NULL;
    if (!lens || !reps || encode(ctx, first, count, &data, lens) != 0) goto done;
    for (int i = 0; i < count; i++) most = lens[i] > most ? lens[i] : most;
    if (!(value = malloc(hl + most))) {
        fprintf(stderr, "kvq serve: prefix cache remote: out of memory publishing an entry\n");
        goto done;
    }
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%d", r->ttl_s);
    size_t off = 0, sent = 0;
    for (int i = 0; i < count; i++) { /* hiredis copies each command into its buffer */
        put_header(value, ns, bk->chains[first + i]);
        memcpy(value + hl, (const unsigned char *)data + off, lens[i]);
        off += lens[i];
        const char *argv[] = {"SET", key_of(bk, first + i), (const char *)value, "EX", ttl};
        size_t alens[] = {3, strlen(argv[1]), hl + lens[i], 2, strlen(ttl)};
        redisAppendCommandArgv(r->writer.c, 5, argv, alens);
    }
    if (!read_replies(r, &r->writer, reps, count)) goto done;
    uint64_t tokens = 0;
    for (int i = 0; i < count; i++)
        if (reps[i]) { /* stored (a full store answers an error instead) */
            sent += hl + lens[i] + strlen(key_of(bk, first + i));
            tokens += PREFIX_REMOTE_BLOCK;
        }
    free_replies(reps, count);
    atomic_fetch_add(&r->bytes_written, sent);
    atomic_fetch_add(&r->tokens_written, tokens);
done:
    free(lens);
    free(reps);
    free(data);
    free(value);
}

void prefix_remote_put(struct prefix_remote *r, uint64_t space, const char *ns, const kvq_token *toks, int n,
                       prefix_remote_encode encode, void *ctx) {
    int blocks = lookup_last(n);
    if (blocks < 1 || !conn_get(r, &r->writer)) return;
    struct keys ks;
    struct block_keys bk;
    keys_init(&ks, space, ns);
    redisReply **reps = NULL;
    if (!block_keys(&bk, &ks, toks, 0, blocks) || !(reps = calloc((size_t)blocks, sizeof *reps))) {
        fprintf(stderr, "kvq serve: prefix cache remote: out of memory publishing an entry\n");
        goto done;
    }
    /* blocks the store holds (another replica's, or this one's earlier entry): their
     * TTL starts again; the rest is sent from the first missing one on */
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%d", r->ttl_s);
    const char *argv[] = {"EXPIRE", NULL, ttl};
    if (!pipeline(r, &r->writer, &bk, 3, argv, NULL, reps)) goto done;
    int missing = blocks;
    for (int i = 0; i < blocks && missing == blocks; i++)
        if (!reps[i] || reps[i]->type != REDIS_REPLY_INTEGER || reps[i]->integer != 1) missing = i;
    free_replies(reps, blocks);
    if (missing < blocks) send_blocks(r, ns, &bk, missing, encode, ctx);
done:
    free(reps);
    block_keys_free(&bk);
}

void prefix_remote_set_max_value(struct prefix_remote *r, size_t bytes) { r->max_value = bytes; }

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
