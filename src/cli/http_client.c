#include "cli/http_client.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cli/cli.h"

/* ---- targets ---- */

bool http_target_parse(const char *url, struct http_target *t, char *err, size_t err_size) {
    memset(t, 0, sizeof *t);
    for (const char *c = url; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == 0x7f) {
            snprintf(err, err_size, "the URL must not hold spaces or control characters");
            return false;
        }
    if (!strncasecmp(url, "https://", 8)) {
        snprintf(err, err_size, "https is not supported: bench-serve speaks plain HTTP (use http://)");
        return false;
    }
    if (strncasecmp(url, "http://", 7) != 0) {
        snprintf(err, err_size, "expected a URL of the form http://HOST[:PORT][/PATH]");
        return false;
    }
    const char *auth = url + 7, *path = auth + strcspn(auth, "/?#");
    size_t auth_len = (size_t)(path - auth);
    if (memchr(auth, '@', auth_len)) {
        snprintf(err, err_size, "user names in the URL are not supported (use --api-key)");
        return false;
    }
    const char *port = NULL, *host = auth;
    size_t host_len;
    if (*auth == '[') { /* [IPv6]:port */
        const char *close = memchr(auth, ']', auth_len);
        if (!close) {
            snprintf(err, err_size, "unclosed '[' in the URL's host");
            return false;
        }
        host = auth + 1, host_len = (size_t)(close - host);
        if (close + 1 < path) {
            if (close[1] != ':') {
                snprintf(err, err_size, "expected ':PORT' after ']' in the URL");
                return false;
            }
            port = close + 2;
        }
    } else {
        const char *colon = memchr(auth, ':', auth_len);
        host_len = colon ? (size_t)(colon - auth) : auth_len;
        if (colon) port = colon + 1;
    }
    if (host_len == 0 || host_len >= sizeof t->host) {
        snprintf(err, err_size, "the URL has %s host name", host_len ? "too long a" : "no");
        return false;
    }
    memcpy(t->host, host, host_len);
    size_t port_len = port ? (size_t)(path - port) : 0;
    char pbuf[8] = "80";
    if (port) {
        if (port_len == 0 || port_len >= sizeof pbuf || strspn(port, "0123456789") < port_len) {
            snprintf(err, err_size, "the URL's port must be a number from 1 to 65535");
            return false;
        }
        memcpy(pbuf, port, port_len);
        pbuf[port_len] = '\0';
    }
    long pn = strtol(pbuf, NULL, 10);
    if (pn < 1 || pn > 65535) {
        snprintf(err, err_size, "the URL's port must be a number from 1 to 65535");
        return false;
    }
    snprintf(t->port, sizeof t->port, "%ld", pn);
    if (strpbrk(path, "?#")) {
        snprintf(err, err_size, "the URL must not hold a query or fragment");
        return false;
    }
    size_t base_len = strlen(path);
    while (base_len && path[base_len - 1] == '/') base_len--;
    /* the endpoints are /v1/...: a URL ending in /v1, as OpenAI clients take it, means the same */
    if (base_len >= 3 && !strncmp(path + base_len - 3, "/v1", 3)) base_len -= 3;
    if (base_len >= sizeof t->base) {
        snprintf(err, err_size, "the URL's path is too long");
        return false;
    }
    memcpy(t->base, path, base_len);
    bool v6 = strchr(t->host, ':') != NULL;
    snprintf(t->authority, sizeof t->authority, "%s%s%s:%s", v6 ? "[" : "", t->host, v6 ? "]" : "", t->port);
    return true;
}

bool http_target_resolve(struct http_target *t, char *err, size_t err_size) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    int rc = getaddrinfo(t->host, t->port, &hints, &t->addrs);
    if (rc != 0) {
        t->addrs = NULL;
        snprintf(err, err_size, "cannot resolve '%s': %s", t->host, gai_strerror(rc));
        return false;
    }
    return true;
}

void http_target_free(struct http_target *t) {
    if (t->addrs) freeaddrinfo(t->addrs);
    t->addrs = NULL;
}

/* ---- one connection ---- */

struct conn {
    int fd, timeout_ms;
    char buf[16384];
    size_t pos, len;
    bool eof;
    enum http_fail fail;
    char *err;
    size_t err_size;
    const char *authority;
};

static bool failf(struct conn *c, enum http_fail f, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool failf(struct conn *c, enum http_fail f, const char *fmt, ...) {
    c->fail = f;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->err_size, fmt, ap);
    va_end(ap);
    return false;
}

/* poll() for one event within the timeout, across signals. 1 ready, 0 timed out, -1 error. */
static int wait_for(int fd, short events, int timeout_ms) {
    double deadline = cli_now() + timeout_ms / 1000.0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events};
        int left = (int)((deadline - cli_now()) * 1000.0 + 0.5);
        int rc = poll(&p, 1, left > 0 ? left : 0);
        if (rc >= 0) return rc;
        if (errno != EINTR) return -1;
    }
}

static int connect_one(const struct addrinfo *a, int timeout_ms, int *err) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) return fd;
    if (errno != EINPROGRESS && errno != EINTR) {
        *err = errno;
        close(fd);
        return -1;
    }
    int rc = wait_for(fd, POLLOUT, timeout_ms), so = 0;
    socklen_t len = sizeof so;
    if (rc <= 0) so = rc == 0 ? ETIMEDOUT : errno;
    else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) != 0) so = errno;
    if (so) {
        *err = so;
        close(fd);
        return -1;
    }
    return fd;
}

static bool send_all(struct conn *c, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w, n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = wait_for(c->fd, POLLOUT, c->timeout_ms);
            if (rc == 0) return failf(c, HTTP_FAIL_TIMEOUT, "%s: no progress sending the request for %d ms", c->authority, c->timeout_ms);
            if (rc > 0) continue;
        }
        return failf(c, HTTP_FAIL_CLOSED, "%s: sending the request: %s", c->authority, strerror(errno));
    }
    return true;
}

/* Makes bytes available in c->buf; false at end of stream (c->eof) or on failure. */
static bool fill(struct conn *c) {
    if (c->pos < c->len) return true;
    if (c->eof) return false;
    for (;;) {
        int rc = wait_for(c->fd, POLLIN, c->timeout_ms);
        if (rc == 0) return failf(c, HTTP_FAIL_TIMEOUT, "%s: no data for %d ms", c->authority, c->timeout_ms);
        if (rc < 0) return failf(c, HTTP_FAIL_CLOSED, "%s: %s", c->authority, strerror(errno));
        ssize_t n = recv(c->fd, c->buf, sizeof c->buf, 0);
        if (n > 0) {
            c->pos = 0, c->len = (size_t)n;
            return true;
        }
        if (n == 0) {
            c->eof = true;
            return false;
        }
        if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
            return failf(c, HTTP_FAIL_CLOSED, "%s: %s", c->authority, strerror(errno));
    }
}

/* One line without its CR LF; a premature end or an overlong line fails. */
static bool read_line(struct conn *c, char *out, size_t cap) {
    size_t n = 0;
    for (;;) {
        if (!fill(c)) return c->fail ? false : failf(c, HTTP_FAIL_CLOSED, "%s: connection closed mid-response", c->authority);
        char ch = c->buf[c->pos++];
        if (ch == '\n') break;
        if (n + 1 >= cap) return failf(c, HTTP_FAIL_PROTOCOL, "%s: a response line is longer than %zu bytes", c->authority, cap);
        out[n++] = ch;
    }
    if (n && out[n - 1] == '\r') n--;
    out[n] = '\0';
    return true;
}

/* Hands up to `limit` bytes (SIZE_MAX: until close) of the body to the callback. */
static bool pass_body(struct conn *c, const struct http_request *r, size_t limit, bool until_close) {
    while (limit) {
        if (!fill(c)) {
            if (c->fail) return false;
            return until_close ? true : failf(c, HTTP_FAIL_CLOSED, "%s: connection closed mid-response", c->authority);
        }
        size_t n = c->len - c->pos < limit ? c->len - c->pos : limit;
        if (r->on_body && !r->on_body(r->ctx, c->buf + c->pos, n))
            return failf(c, HTTP_FAIL_ABORTED, "stopped reading the response");
        c->pos += n, limit -= n;
    }
    return true;
}

static bool read_chunked(struct conn *c, const struct http_request *r) {
    char line[1024];
    for (;;) {
        if (!read_line(c, line, sizeof line)) return false;
        char *end;
        errno = 0;
        unsigned long long size = strtoull(line, &end, 16);
        if (!isxdigit((unsigned char)line[0]) || errno || (*end && *end != ';' && *end != ' ' && *end != '\t'))
            return failf(c, HTTP_FAIL_PROTOCOL, "%s: bad chunk size line '%.40s'", c->authority, line);
        if (size == 0) break;
        if (!pass_body(c, r, (size_t)size, false) || !read_line(c, line, sizeof line)) return false;
        if (line[0]) return failf(c, HTTP_FAIL_PROTOCOL, "%s: a chunk is longer than its size", c->authority);
    }
    do /* trailers up to the empty line */
        if (!read_line(c, line, sizeof line)) return false;
    while (line[0]);
    return true;
}

static bool read_response(struct conn *c, const struct http_request *r, int *status) {
    char line[8192];
    bool chunked;
    long long length;
    do { /* skip 1xx interim responses */
        if (!read_line(c, line, sizeof line)) return false;
        int major, minor, st;
        if (sscanf(line, "HTTP/%d.%d %3d", &major, &minor, &st) != 3 || st < 100 || st > 999)
            return failf(c, HTTP_FAIL_PROTOCOL, "%s: not an HTTP response: '%.60s'", c->authority, line);
        *status = st;
        chunked = false, length = -1;
        for (;;) {
            if (!read_line(c, line, sizeof line)) return false;
            if (!line[0]) break;
            char *v = strchr(line, ':');
            if (!v) return failf(c, HTTP_FAIL_PROTOCOL, "%s: bad header line '%.60s'", c->authority, line);
            *v++ = '\0';
            v += strspn(v, " \t");
            if (!strcasecmp(line, "transfer-encoding")) chunked = strcasestr(v, "chunked") != NULL;
            else if (!strcasecmp(line, "content-length")) {
                char *end;
                length = strtoll(v, &end, 10);
                if (end == v || length < 0) return failf(c, HTTP_FAIL_PROTOCOL, "%s: bad Content-Length '%s'", c->authority, v);
            }
        }
    } while (*status < 200);
    if (*status == 204 || *status == 304 || !strcmp(r->method, "HEAD")) return true;
    if (chunked) return read_chunked(c, r);
    if (length >= 0) return pass_body(c, r, (size_t)length, false);
    return pass_body(c, r, SIZE_MAX, true);
}

enum http_fail http_do(const struct http_target *t, const struct http_request *r, int *status, char *err,
                       size_t err_size) {
    *status = 0;
    err[0] = '\0';
    struct conn *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, err_size, "out of memory");
        return HTTP_FAIL_ABORTED;
    }
    *c = (struct conn){.fd = -1, .timeout_ms = r->read_timeout_ms, .err = err, .err_size = err_size,
                       .authority = t->authority};
    int cerr = 0;
    for (const struct addrinfo *a = t->addrs; a && c->fd < 0; a = a->ai_next)
        c->fd = connect_one(a, r->connect_timeout_ms, &cerr);
    if (c->fd < 0) {
        failf(c, HTTP_FAIL_CONNECT, "connect to %s: %s", t->authority,
              cerr == ETIMEDOUT ? "no answer (timed out)" : strerror(cerr));
    } else {
        char head[1024];
        int n = snprintf(head, sizeof head,
                         "%s %s%s HTTP/1.1\r\nHost: %s\r\nUser-Agent: kvq-bench-serve\r\nAccept: */*\r\n"
                         "Connection: close\r\n",
                         r->method, t->base, r->path, t->authority);
        if (r->body) n += snprintf(head + n, sizeof head - (size_t)n, "Content-Type: application/json\r\nContent-Length: %zu\r\n", r->body_len);
        bool ok = (size_t)n < sizeof head ? send_all(c, head, (size_t)n)
                                          : failf(c, HTTP_FAIL_PROTOCOL, "the request's path is too long");
        if (ok && r->api_key)
            ok = send_all(c, "Authorization: Bearer ", 22) && send_all(c, r->api_key, strlen(r->api_key)) &&
                 send_all(c, "\r\n", 2);
        ok = ok && send_all(c, "\r\n", 2) && (!r->body || send_all(c, r->body, r->body_len));
        if (ok) read_response(c, r, status);
        close(c->fd);
    }
    enum http_fail f = c->fail;
    free(c);
    return f;
}

/* ---- server-sent events ---- */

#define SSE_MAX_LINE ((size_t)64 << 20)

static bool grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return true;
    size_t n = *cap ? *cap : 256;
    while (n < need) n *= 2;
    char *q = realloc(*p, n);
    if (!q) return false;
    *p = q, *cap = n;
    return true;
}

static bool sse_line(struct sse_parser *p) {
    char *l = p->line;
    size_t n = p->line_len;
    if (n && l[n - 1] == '\r') n--;
    if (n == 0) { /* end of an event */
        if (!p->has_data) return true;
        p->has_data = false;
        size_t len = p->data_len;
        p->data_len = 0;
        p->data[len] = '\0';
        return p->on_event(p->ctx, p->data, len);
    }
    if (n < 5 || memcmp(l, "data:", 5) != 0) return true; /* comments, event:, id:, retry: */
    size_t off = n > 5 && l[5] == ' ' ? 6 : 5;
    size_t need = p->data_len + (p->has_data ? 1 : 0) + (n - off) + 1;
    if (!grow(&p->data, &p->data_cap, need)) return !(p->oom = true);
    if (p->has_data) p->data[p->data_len++] = '\n';
    memcpy(p->data + p->data_len, l + off, n - off);
    p->data_len += n - off;
    p->has_data = true;
    return true;
}

bool sse_feed(struct sse_parser *p, const char *bytes, size_t len) {
    while (len) {
        const char *nl = memchr(bytes, '\n', len);
        size_t take = nl ? (size_t)(nl - bytes) : len;
        if (p->line_len + take + 1 > SSE_MAX_LINE) return !(p->too_long = true);
        if (!grow(&p->line, &p->line_cap, p->line_len + take + 1)) return !(p->oom = true);
        memcpy(p->line + p->line_len, bytes, take);
        p->line_len += take;
        if (!nl) break;
        bytes += take + 1, len -= take + 1;
        bool ok = sse_line(p);
        p->line_len = 0;
        if (!ok) return false;
    }
    return true;
}

void sse_free(struct sse_parser *p) {
    free(p->line);
    free(p->data);
    p->line = p->data = NULL;
}
