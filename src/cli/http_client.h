/* A minimal HTTP/1.1 client over POSIX sockets for kvq bench-serve: one request per
 * connection (Connection: close), plain http only, a bounded connect and a bounded
 * wait for every read, so a dead or silent server is an error and never a hang.
 * The body arrives through a callback as it is read (chunked, sized or read until
 * close); sse_feed splits such a body into server-sent events. */
#ifndef KVQ_CLI_HTTP_CLIENT_H
#define KVQ_CLI_HTTP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>

struct addrinfo;

/* Where requests go: parsed from http://HOST[:PORT][/BASE] and resolved once. */
struct http_target {
    char host[256];    /* as written (an IPv6 address without brackets) */
    char port[8];
    char base[256];    /* path prefix without a trailing slash ("" for none) */
    char authority[300]; /* the Host header */
    struct addrinfo *addrs;
};

/* Parses url; false with a reason in err. */
bool http_target_parse(const char *url, struct http_target *t, char *err, size_t err_size);
/* Resolves host and port; false with a reason in err. */
bool http_target_resolve(struct http_target *t, char *err, size_t err_size);
void http_target_free(struct http_target *t);

enum http_fail {
    HTTP_OK,
    HTTP_FAIL_CONNECT,  /* refused, unreachable, or no answer within the connect timeout */
    HTTP_FAIL_TIMEOUT,  /* no byte within the read timeout */
    HTTP_FAIL_CLOSED,   /* the server closed or reset the connection before the response ended */
    HTTP_FAIL_PROTOCOL, /* not an HTTP response we can read */
    HTTP_FAIL_ABORTED,  /* the body callback stopped the request */
};

struct http_request {
    const char *method, *path;   /* path after the target's base, e.g. "/v1/completions" */
    const char *api_key;         /* sent as Authorization: Bearer, or NULL */
    const char *body;            /* JSON, or NULL */
    size_t body_len;
    int connect_timeout_ms, read_timeout_ms;
    /* Each piece of the decoded body; returns false to stop reading. */
    bool (*on_body)(void *ctx, const char *data, size_t len);
    void *ctx;
};

/* Runs one request. status gets the HTTP status once the headers arrived (0 before);
 * err a reason for any failure. */
enum http_fail http_do(const struct http_target *t, const struct http_request *r, int *status, char *err,
                       size_t err_size);

/* Server-sent events: bytes in, each event's data (its data: lines joined by '\n',
 * NUL-terminated) out through on_event; comments (": ping") are dropped. */
struct sse_parser {
    char *line, *data;
    size_t line_len, line_cap, data_len, data_cap;
    bool has_data, oom, too_long;
    bool (*on_event)(void *ctx, const char *data, size_t len);
    void *ctx;
};
/* False when on_event stopped, a line grew past 64 MiB (too_long set) or memory ran out (oom set). */
bool sse_feed(struct sse_parser *p, const char *bytes, size_t len);
void sse_free(struct sse_parser *p);

#endif
