/* The HTTP side of kvq serve (libmicrohttpd, a thread per connection): routing,
 * the API key, body limits, the OpenAI endpoints, SSE streams, /health and
 * /metrics. Requests go to the scheduler; the engine is never called from here
 * except to tokenize. */
#ifndef KVQ_SERVER_HTTP_H
#define KVQ_SERVER_HTTP_H

#include <stdbool.h>
#include <stddef.h>

#include "kvq.h"
#include "server/chat_template.h"
#include "server/llama_api.h"
#include "server/prefix_remote.h"
#include "server/scheduler.h"
#include "server/tool_calls.h"

struct http_params {
    const char *host; /* numeric address or "localhost" */
    int port;         /* 0: any free port (http_port() says which) */
    const char *api_key; /* NULL: no key needed */
    size_t max_body;  /* request body limit in bytes */
    const char *model_id; /* the name /v1/models reports */
    int ping_seconds; /* ": ping" on a stream idle this long */
    bool strict_api;  /* fields beyond OpenAI's are a 400 (else ignored and logged once) */
    int timeout_s;    /* a connection with no byte read or written this long is closed (0: never) */
    int max_connections, max_connections_per_ip; /* beyond: refused at once (per address 0: no cap) */
    const struct kvq_model *model;
    const struct chat_template *chat;
    enum tool_syntax tool_syntax; /* how the model calls tools */
    struct sched *sched; /* NULL: generation requests are answered 503 (the HTTP layer alone) */
    struct embedder *embedder; /* NULL: /v1/embeddings answers 501 */
    const struct prefix_remote *remote; /* the prefix cache's store, for /metrics (NULL: none) */
};

struct http_server;
/* NULL with a message on stderr when the address cannot be bound. */
struct http_server *http_start(const struct http_params *p);
int http_port(const struct http_server *h);
/* Stops accepting (new requests on open connections get a 503) and waits up to
 * seconds for the requests given to the scheduler to be answered; returns how many
 * are left. */
int http_drain(struct http_server *h, double seconds);
/* Closes every connection, waits for the connection threads, frees. */
void http_stop(struct http_server *h);

#endif
