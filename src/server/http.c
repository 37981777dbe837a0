#include "server/http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "server/llama_api.h"
#include "server/openai_json.h"
#include "server/strbuf.h"

struct http_server {
    struct http_params p;
    struct MHD_Daemon *d;
    int port;
    long started;
    atomic_ullong n_http, n_errors, next_id;
    atomic_int busy;      /* requests given to the scheduler whose answer is not yet sent */
    atomic_bool draining; /* shutting down: new requests get a 503 */
};

/* Per request: the body as it arrives. */
struct conn_state {
    struct strbuf body;
    bool busy;    /* counted in h->busy */
    bool too_big; /* a chunked body grew past the limit: discarded, then a 413 */
    bool http11;  /* may be sent an interim response */
    bool probed;  /* the client's end-of-file was answered with an interim "100 Continue" */
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- responses ---- */

static enum MHD_Result respond(struct http_server *h, struct MHD_Connection *c, unsigned status, const char *type,
                               const char *body) {
    if (!body) status = 500, type = "application/json", body = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\"}}";
    if (status >= 400) atomic_fetch_add(&h->n_errors, 1);
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == 401) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (status == 503 || status == 429) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result respond_json(struct http_server *h, struct MHD_Connection *c, unsigned status, char *json) {
    enum MHD_Result ret = respond(h, c, status, "application/json", json);
    free(json);
    return ret;
}

static enum MHD_Result respond_error(struct http_server *h, struct MHD_Connection *c, const struct oai_error *e) {
    return respond_json(h, c, (unsigned)e->status, oai_error_json(e));
}

static enum MHD_Result fail(struct http_server *h, struct MHD_Connection *c, int status, const char *type,
                            const char *param, const char *code, const char *msg) {
    struct oai_error e;
    oai_error_set(&e, status, type, param, code, "%s", msg);
    return respond_error(h, c, &e);
}

/* True when the connection is broken: reset, or closed both ways. A read end-of-file
 * alone (*eof) is not that: a client may shut down its sending side after a complete
 * request (shutdown(SHUT_WR)) and still read the answer. A client that closed
 * entirely resets the connection at the next byte written to it, which then shows
 * here as POLLHUP/POLLERR; so on end-of-file the caller writes one byte early: a
 * stream a ': ping', a plain HTTP/1.1 request an interim "100 Continue" (a response
 * every HTTP/1.1 client must accept and skip). */
static bool client_gone(struct MHD_Connection *c, bool *eof) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    *eof = false;
    if (!ci) return false;
    struct pollfd pfd = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&pfd, 1, 0) <= 0) return false;
    *eof = pfd.revents & POLLRDHUP;
    return pfd.revents & (POLLHUP | POLLERR);
}

/* The interim response above, sent straight to the socket: nothing else writes to
 * it while the request's handler runs (a thread per connection). */
static void send_interim(struct MHD_Connection *c) {
    static const char interim[] = "HTTP/1.1 100 Continue\r\n\r\n";
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) (void)!send(ci->connect_fd, interim, sizeof interim - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* The idle timeout counts from the last byte read or written. Generation is the
 * server's own time, not the client's idleness: setting the timeout again after a
 * wait restarts its clock (libmicrohttpd does so when it goes from none to some). */
static void timeout_restart(struct http_server *h, struct MHD_Connection *c) {
    if (!h->p.timeout_s) return;
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned)h->p.timeout_s);
}

/* ---- requests to prompts ---- */

/* Token ids of a request (prompts, logit_bias, stop_token_ids) must be in the vocabulary. */
static int check_ids(const struct http_server *h, const char *param, const kvq_token *ids, int n, struct oai_error *e) {
    struct kvq_model_info info;
    kvq_model_get_info(h->p.model, &info);
    const int nv = info.n_vocab;
    for (int i = 0; i < n; i++)
        if (ids[i] >= nv) {
            oai_error_set(e, 400, "invalid_request_error", param, NULL, "token id %d is outside the vocabulary (0..%d)",
                          ids[i], nv - 1);
            return -1;
        }
    return 0;
}

/* Prompt p's tokens: chat messages through the template (which drops a leading BOS
 * text when the tokenizer adds BOS itself), the raw prompt, or the prompt's token
 * ids as they are. */
static int prompt_tokens(struct http_server *h, const struct oai_request *q, int p, kvq_token **out,
                         struct oai_error *e) {
    if (q->kind == OAI_COMPLETION && q->prompts[p].ids) {
        const struct oai_prompt *o = &q->prompts[p];
        if (check_ids(h, "prompt", o->ids, o->n_ids, e)) return -1;
        if (!(*out = malloc(sizeof **out * (size_t)o->n_ids))) {
            oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
            return -1;
        }
        memcpy(*out, o->ids, sizeof **out * (size_t)o->n_ids);
        return o->n_ids;
    }
    char *text = q->kind == OAI_CHAT ? api_render_chat(h->p.chat, h->p.tool_syntax, q, e) : strdup(q->prompts[p].text);
    if (!text) {
        if (q->kind != OAI_CHAT) oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return -1;
    }
    int n = api_tokenize_text(h->p.model, text, strlen(text), true, true, out);
    free(text);
    if (n < 0) oai_error_set(e, 400, "invalid_request_error", NULL, NULL, "cannot tokenize the prompt: %s", kvq_last_error());
    else if (n == 0) {
        free(*out);
        oai_error_set(e, 400, "invalid_request_error", q->kind == OAI_CHAT ? "messages" : "prompt", NULL,
                      "the prompt is empty");
        n = -1;
    }
    return n;
}

/* The grammar the request's output must follow (NULL: none): a forced tool call, or
 * response_format's schema. -1 with e for a schema it cannot follow. */
static int request_grammar(struct http_server *h, const struct oai_request *q, struct kvq_grammar **g,
                           struct oai_error *e) {
    *g = NULL;
    if (oai_tools_on(q) && (q->tool_choice == OAI_TOOLS_REQUIRED || q->tool_choice == OAI_TOOLS_NAMED)) {
        const char *prefix, *suffix, *err;
        char *schema = tool_call_schema(h->p.tool_syntax, q->tools, q->n_tools,
                                        q->tool_choice == OAI_TOOLS_NAMED ? q->tool_name : NULL, &prefix, &suffix, &err);
        if (!schema) {
            oai_error_set(e, 400, "invalid_request_error", "tools", NULL, "%s", err);
            return -1;
        }
        *g = kvq_grammar_from_json_schema(h->p.model, schema, strlen(schema), prefix, suffix);
        free(schema);
        if (!*g) oai_error_set(e, 400, "invalid_request_error", "tools", NULL, "a tool's parameters: %s", kvq_last_error());
        return *g ? 0 : -1;
    }
    if (!q->response_schema) return 0;
    *g = kvq_grammar_from_json_schema(h->p.model, q->response_schema, strlen(q->response_schema), NULL, NULL);
    if (!*g) oai_error_set(e, 400, "invalid_request_error", "response_format", NULL, "%s", kvq_last_error());
    return *g ? 0 : -1;
}

/* ---- log-probabilities ---- */

static int token_piece(const void *model, kvq_token t, char *buf, int size) {
    return kvq_token_bytes(model, t, buf, size);
}

/* The logprobs of a response or chunk: NULL when the request asked for none. */
static const struct oai_logprobs *lp_view(struct http_server *h, bool wanted, const struct lp_list *l,
                                          struct oai_logprobs *out) {
    if (!wanted) return NULL;
    *out = (struct oai_logprobs){l->v, l->n, token_piece, h->p.model};
    return out;
}

/* ---- choices ---- */

/* One choice of a request (n per prompt, one or more prompts): its scheduler request
 * and what has been read of it. */
struct choice {
    struct sched_req *r;
    char *echo; /* completions' echo: the prompt's text, sent before the answer's */
    struct sched_cursor cur;
    struct sched_result res;
    bool done;
    struct strbuf text; /* a whole response's; a tool stream's text so far */
    size_t sent;        /* a tool stream: how much of text went out as content */
    struct lp_list lps;
};

static void choices_free(struct choice *ch, int n, bool cancel) {
    for (int i = 0; ch && i < n; i++) {
        if (cancel && !ch[i].done) sched_req_cancel(ch[i].r);
        sched_req_release(ch[i].r);
        free(ch[i].echo);
        strbuf_free(&ch[i].text);
        lp_list_free(&ch[i].lps);
    }
    free(ch);
}

/* The usage of all choices: each prompt counted once (with its first choice). */
static struct oai_usage usage_of(const struct choice *ch, int n, int per_prompt) {
    struct oai_usage u = {0};
    for (int i = 0; i < n; i++) {
        if (i % per_prompt == 0) {
            u.prompt_tokens += ch[i].res.prompt_tokens;
            u.cached_tokens += ch[i].res.cached_tokens;
        }
        u.completion_tokens += ch[i].res.completion_tokens;
    }
    return u;
}

/* Tokenizes every prompt and submits n choices of each (a group sharing the prompt's
 * KV blocks); *out holds them in OpenAI's order (prompt by prompt). 0, or -1 with e. */
static int submit_choices(struct http_server *h, struct oai_request *q, unsigned long long id, struct choice **out,
                          int *n_out, struct oai_error *e) {
    const int n_prompts = q->kind == OAI_CHAT ? 1 : q->n_prompts, n = q->n;
    if (check_ids(h, "logit_bias", q->gen.bias_ids, q->gen.n_bias, e) ||
        check_ids(h, "stop_token_ids", q->gen.stop_ids, q->gen.n_stop_ids, e))
        return -1;
    if (n_prompts * n > OAI_MAX_PROMPTS) {
        oai_error_set(e, 400, "invalid_request_error", "n", NULL, "%d prompts x n %d = %d choices; at most %d in one request",
                      n_prompts, n, n_prompts * n, OAI_MAX_PROMPTS);
        return -1;
    }
    struct choice *ch = calloc((size_t)(n_prompts * n), sizeof *ch);
    struct sched_req **group = calloc((size_t)n, sizeof *group);
    const uint64_t seed = q->has_seed ? q->gen.sampling.seed : (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL ^ id;
    int made = 0, rc = 0;
    if (!ch || !group) {
        oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        rc = -1;
    }
    for (int p = 0; p < n_prompts && rc == 0; p++) {
        kvq_token *toks = NULL;
        int n_tok = prompt_tokens(h, q, p, &toks, e);
        if (n_tok < 0) {
            rc = -1;
            break;
        }
        for (int i = 0; i < n && rc == 0; i++) {
            struct gen_params g;
            kvq_token *t = i == 0 ? toks : malloc(sizeof *t * (size_t)n_tok);
            if (t && i > 0) memcpy(t, toks, sizeof *t * (size_t)n_tok);
            group[i] = NULL;
            bool refused = false; /* a schema the grammar cannot follow: e says why */
            if (t && gen_params_copy(&g, &q->gen) == 0) {
                g.sampling.seed = seed + (uint64_t)(p * n + i); /* choices differ, reproducibly */
                /* each choice its own grammar: it holds how far that choice has come */
                if ((refused = request_grammar(h, q, &g.grammar, e) != 0) ||
                    !(group[i] = sched_req_new(t, n_tok, &g, q->cache_key)))
                    gen_params_free(&g);
            }
            if (!group[i]) {
                if (t != toks || i == 0) free(t);
                for (int j = 0; j < i; j++) sched_req_release(group[j]);
                if (!refused) oai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
                rc = -1;
            }
        }
        if (rc) break;
        int status;
        char msg[256];
        if (sched_submit_group(h->p.sched, group, n, &status, msg, sizeof msg) != 0) {
            for (int i = 0; i < n; i++) sched_req_release(group[i]);
            oai_error_set(e, status, status >= 500 ? "server_error" : "invalid_request_error", NULL,
                          status == 400 && strstr(msg, "context") ? "context_length_exceeded" : NULL, "%s", msg);
            rc = -1;
            break;
        }
        for (int i = 0; i < n; i++) {
            struct choice *c = &ch[made++];
            c->r = group[i];
            if (q->echo) {
                const struct oai_prompt *o = &q->prompts[p];
                c->echo = o->text ? strdup(o->text) : api_detokenize_text(h->p.model, o->ids, o->n_ids);
                if (!c->echo) c->text.oom = true;
            }
        }
    }
    free(group);
    if (rc) {
        choices_free(ch, made, true);
        return -1;
    }
    *out = ch;
    *n_out = made;
    return 0;
}

/* ---- streams ---- */

struct stream {
    struct http_server *h;
    struct MHD_Connection *conn;
    struct choice *ch;
    int n_choices, per_prompt;
    enum oai_kind kind;
    char id[48];
    long created;
    bool include_usage, logprobs, first_sent, finished;
    bool tools;        /* tool calls are parsed out of each choice's text */
    bool probed; /* the client's end-of-file was answered with a ': ping' */
    struct strbuf out; /* SSE bytes not yet handed to MHD */
    size_t out_off;
    double last_write;
};

static void sse_event(struct stream *st, char *json) {
    if (!json) {
        st->out.oom = true;
        return;
    }
    strbuf_add(&st->out, "data: ");
    strbuf_add(&st->out, json);
    strbuf_add(&st->out, "\n\n");
    free(json);
}

/* Choice i of a stream whose text may hold tool calls: content goes out up to where a
 * call may start; at its end the calls, parsed from its whole text, go out as
 * delta.tool_calls with finish_reason "tool_calls" (or what is left, as content). */
static void tool_stream_fill(struct stream *st, int i, const struct strbuf *text, const struct oai_logprobs *lp,
                             bool done) {
    const char *model = st->h->p.model_id;
    struct choice *c = &st->ch[i];
    strbuf_addn(&c->text, text->s ? text->s : "", text->len);
    const char *all = c->text.s ? c->text.s : "";
    size_t upto = tool_stream_safe(st->h->p.tool_syntax, all, c->text.len);
    struct tool_call *calls = NULL;
    int n_calls = 0;
    if (done && tool_calls_parse(st->h->p.tool_syntax, all, c->text.len, &calls, &n_calls, &upto) != 0)
        st->out.oom = true;
    if (upto > c->sent || (lp && lp->n)) {
        size_t n = upto > c->sent ? upto - c->sent : 0;
        sse_event(st, oai_chunk_json(OAI_CHAT, st->id, st->created, model, i, false, n ? all + c->sent : NULL, n, NULL, lp));
        c->sent += n;
    }
    if (!done) return;
    if (n_calls) sse_event(st, oai_tool_chunk_json(st->id, st->created, model, i, calls, n_calls));
    sse_event(st, oai_chunk_json(OAI_CHAT, st->id, st->created, model, i, false, NULL, 0,
                                 n_calls ? "tool_calls" : c->res.finish_reason, NULL));
    tool_calls_free(calls, n_calls);
}

/* Turns what the scheduler produced into SSE events: a chunk per choice with news, the
 * usage chunk and [DONE] once all have ended. Waits (briefly) on the first choice still
 * running and takes what the others have so far. */
static void stream_fill(struct stream *st) {
    const char *model = st->h->p.model_id;
    if (!st->first_sent) {
        st->first_sent = true;
        bool sent = false;
        for (int i = 0; i < st->n_choices; i++) {
            const struct choice *c = &st->ch[i];
            if (st->kind == OAI_CHAT) /* clients take the role from the first chunk */
                sse_event(st, oai_chunk_json(st->kind, st->id, st->created, model, i, true, "", 0, NULL, NULL));
            else if (c->echo)
                sse_event(st, oai_chunk_json(st->kind, st->id, st->created, model, i, false, c->echo, strlen(c->echo),
                                             NULL, NULL));
            sent = sent || st->kind == OAI_CHAT || c->echo;
        }
        if (sent) return;
    }
    bool waited = false, all_done = true;
    for (int i = 0; i < st->n_choices && !st->finished; i++) {
        struct choice *c = &st->ch[i];
        if (c->done) continue;
        struct strbuf text = {0};
        struct lp_list lps = {0};
        struct oai_logprobs lpv;
        bool done = sched_req_wait(c->r, waited ? 0 : 100, &c->cur, &text, st->logprobs ? &lps : NULL, &c->res);
        waited = true;
        if (text.oom || lps.oom) st->out.oom = true;
        const struct oai_logprobs *lp = lp_view(st->h, st->logprobs, &lps, &lpv);
        bool news = text.len || lps.n;
        if (st->tools && !(done && c->res.error_status)) {
            tool_stream_fill(st, i, &text, lp, done);
        } else if (done && c->res.error_status) {
            if (news)
                sse_event(st, oai_chunk_json(st->kind, st->id, st->created, model, i, false, text.s, text.len, NULL, lp));
            struct oai_error e;
            oai_error_set(&e, c->res.error_status, c->res.error_status >= 500 ? "server_error" : "invalid_request_error",
                          NULL, NULL, "%s", c->res.error_msg);
            sse_event(st, oai_error_json(&e));
            atomic_fetch_add(&st->h->n_errors, 1);
            strbuf_add(&st->out, "data: [DONE]\n\n");
            st->finished = true; /* stream_free cancels the other choices */
        } else if (done || news) {
            /* the last content chunk carries finish_reason */
            sse_event(st, oai_chunk_json(st->kind, st->id, st->created, model, i, false, text.len ? text.s : NULL,
                                         text.len, done ? c->res.finish_reason : NULL, lp));
        }
        c->done = done;
        all_done = all_done && done;
        strbuf_free(&text);
        lp_list_free(&lps);
    }
    if (all_done && !st->finished) {
        if (st->include_usage) {
            struct oai_usage u = usage_of(st->ch, st->n_choices, st->per_prompt);
            sse_event(st, oai_usage_chunk_json(st->kind, st->id, st->created, model, &u));
        }
        strbuf_add(&st->out, "data: [DONE]\n\n");
        st->finished = true;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    struct stream *st = cls;
    for (;;) {
        if (st->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (st->out_off < st->out.len) {
            size_t n = st->out.len - st->out_off < max ? st->out.len - st->out_off : max;
            memcpy(buf, st->out.s + st->out_off, n);
            st->out_off += n;
            if (st->out_off == st->out.len) st->out.len = st->out_off = 0;
            st->last_write = now_s();
            timeout_restart(st->h, st->conn);
            return (ssize_t)n;
        }
        if (st->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        stream_fill(st);
        if (st->out.len) continue;
        /* nothing new after a short wait: is the client still there? */
        bool eof;
        if (client_gone(st->conn, &eof)) {
            for (int i = 0; i < st->n_choices; i++) sched_req_cancel(st->ch[i].r);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if ((eof && !st->probed) || now_s() - st->last_write >= st->h->p.ping_seconds)
            strbuf_add(&st->out, ": ping\n\n");
        st->probed |= eof;
    }
}

static void stream_free(void *cls) {
    struct stream *st = cls;
    choices_free(st->ch, st->n_choices, true); /* a client that left early: its sequences are freed now */
    strbuf_free(&st->out);
    free(st);
}

/* ---- endpoints ---- */

static enum MHD_Result completions(struct http_server *h, struct MHD_Connection *c, enum oai_kind kind,
                                   struct conn_state *cs) {
    struct oai_request q;
    struct oai_error e;
    if (oai_parse_request(cs->body.s ? cs->body.s : "", cs->body.len, kind, h->p.strict_api, &q, &e) != 0)
        return respond_error(h, c, &e);
    if (!h->p.sched) { /* the HTTP layer alone (fuzz/fuzz_http.c) */
        oai_request_free(&q);
        return fail(h, c, 503, "server_error", NULL, NULL, "no model is loaded");
    }
    unsigned long long id = atomic_fetch_add(&h->next_id, 1);
    struct choice *ch = NULL;
    int n_ch = 0;
    const int per_prompt = q.n;
    bool stream = q.stream, include_usage = q.include_usage, logprobs = q.gen.logprobs >= 0;
    const bool tools = kind == OAI_CHAT && oai_tools_on(&q);
    int rc = submit_choices(h, &q, id, &ch, &n_ch, &e);
    oai_request_free(&q);
    if (rc) return respond_error(h, c, &e);
    cs->busy = true; /* until the answer is sent (on_completed) */
    atomic_fetch_add(&h->busy, 1);
    char rid[48];
    snprintf(rid, sizeof rid, "%s-%llx%08lx", kind == OAI_CHAT ? "chatcmpl" : "cmpl", id, (unsigned long)time(NULL));
    long created = (long)time(NULL);
    if (stream) {
        struct stream *st = calloc(1, sizeof *st);
        if (!st) {
            choices_free(ch, n_ch, true);
            return fail(h, c, 500, "server_error", NULL, NULL, "out of memory");
        }
        *st = (struct stream){.h = h, .conn = c, .ch = ch, .n_choices = n_ch, .per_prompt = per_prompt, .kind = kind,
                              .created = created, .include_usage = include_usage, .logprobs = logprobs,
                              .tools = tools, .last_write = now_s()};
        memcpy(st->id, rid, sizeof rid);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, st, stream_free);
        if (!resp) {
            stream_free(st);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    const struct sched_result *err = NULL;
    bool oom = false;
    for (int i = 0; i < n_ch; i++) {
        struct choice *x = &ch[i];
        if (x->echo) strbuf_add(&x->text, x->echo);
        while (!(x->done = sched_req_wait(x->r, 100, &x->cur, &x->text, logprobs ? &x->lps : NULL, &x->res))) {
            bool eof;
            if (client_gone(c, &eof)) {
                choices_free(ch, n_ch, true);
                return MHD_NO;
            }
            if (eof && !cs->probed && cs->http11) send_interim(c);
            cs->probed |= eof;
        }
        if (x->res.error_status && !err) err = &x->res;
        oom = oom || x->text.oom || x->lps.oom;
    }
    timeout_restart(h, c);
    enum MHD_Result ret;
    if (err) {
        ret = fail(h, c, err->error_status, err->error_status >= 500 ? "server_error" : "invalid_request_error", NULL,
                   NULL, err->error_msg);
    } else {
        struct oai_usage u = usage_of(ch, n_ch, per_prompt);
        struct oai_choice *oc = calloc((size_t)n_ch, sizeof *oc);
        struct oai_logprobs *lpv = calloc((size_t)n_ch, sizeof *lpv);
        struct tool_call **calls = calloc((size_t)n_ch, sizeof *calls);
        for (int i = 0; oc && lpv && calls && i < n_ch; i++) {
            struct oai_choice *o = &oc[i];
            *o = (struct oai_choice){ch[i].text.s ? ch[i].text.s : "", ch[i].text.len, ch[i].res.finish_reason,
                                     lp_view(h, logprobs, &ch[i].lps, &lpv[i]), NULL, 0};
            size_t content_len = o->text_len;
            if (tools && tool_calls_parse(h->p.tool_syntax, o->text, o->text_len, &calls[i], &o->n_calls, &content_len))
                oom = true;
            if (o->n_calls == 0) continue;
            while (content_len > 0 && (o->text[content_len - 1] == ' ' || o->text[content_len - 1] == '\n'))
                content_len--; /* before the first call */
            o->calls = calls[i];
            o->text_len = content_len;
            o->finish_reason = "tool_calls";
        }
        ret = respond_json(h, c, 200,
                           oom || !oc || !lpv || !calls ? NULL
                                                        : oai_response_json_n(kind, rid, created, h->p.model_id, oc, n_ch, &u));
        for (int i = 0; oc && calls && i < n_ch; i++) tool_calls_free(calls[i], oc[i].n_calls);
        free(calls);
        free(oc);
        free(lpv);
    }
    choices_free(ch, n_ch, false);
    return ret;
}

static void metric(struct strbuf *b, const char *name, const char *type, const char *help, double v) {
    strbuf_printf(b, "# HELP kvq_%s %s\n# TYPE kvq_%s %s\nkvq_%s %.17g\n", name, help, name, type, name, v);
}

static enum MHD_Result metrics(struct http_server *h, struct MHD_Connection *c) {
    struct sched_stats s = {0};
    if (h->p.sched) sched_get_stats(h->p.sched, &s);
    struct strbuf b = {0};
    metric(&b, "http_requests_total", "counter", "HTTP requests received.", (double)atomic_load(&h->n_http));
    metric(&b, "http_errors_total", "counter", "HTTP requests answered with an error.", (double)atomic_load(&h->n_errors));
    metric(&b, "requests_total", "counter", "Generation requests accepted by the scheduler.", (double)s.requests);
    metric(&b, "prompt_tokens_total", "counter", "Prompt tokens of started requests.", (double)s.prompt_tokens);
    metric(&b, "generated_tokens_total", "counter", "Tokens generated.", (double)s.generated_tokens);
    metric(&b, "decode_tokens_per_second", "gauge", "Tokens generated per second over the last second.", s.decode_tok_s);
    metric(&b, "queue_length", "gauge", "Requests waiting for a sequence or KV memory.", s.queued);
    metric(&b, "running_sequences", "gauge", "Sequences being prefilled or decoded.", s.running);
    metric(&b, "requests_waiting_for_memory", "gauge", "Queued requests that wait for KV memory while sequence slots are free.",
           s.waiting_memory);
    metric(&b, "kv_bytes_in_use", "gauge", "KV cache bytes in use (shared blocks once).", (double)s.kv_bytes);
    metric(&b, "kv_budget_bytes", "gauge", "KV cache byte budget.", (double)s.kv_budget);
    metric(&b, "kv_blocks_in_use", "gauge", "KV blocks in use.", (double)s.kv_blocks);
    metric(&b, "prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", (double)s.cache_hits);
    metric(&b, "prefix_cache_misses_total", "counter", "Requests that found no cached prefix.", (double)s.cache_misses);
    metric(&b, "prefix_cache_tokens_total", "counter", "Prompt tokens taken from the prefix cache.", (double)s.cached_tokens);
    metric(&b, "prefix_cache_bytes", "gauge", "Bytes of prefix-cache entries.", (double)s.cache_bytes);
    metric(&b, "prefix_cache_entries", "gauge", "Prefix-cache entries.", s.cache_entries);
    metric(&b, "prefix_cache_host_bytes", "gauge", "Bytes of prefix-cache entries in host memory.", (double)s.cache_host_bytes);
    metric(&b, "prefix_cache_host_entries", "gauge", "Prefix-cache entries in host memory.", s.cache_host_entries);
    if (h->p.remote) {
        struct prefix_remote_stats r;
        prefix_remote_stats(h->p.remote, &r);
        const struct {
            const char *name, *help;
            uint64_t v;
        } rm[] = {
            {"hits_total", "Lookups that took blocks from the remote store.", r.hits},
            {"misses_total", "Remote lookups that found no usable block.", r.misses},
            {"bytes_read_total", "Bytes of blocks read from the remote store.", r.bytes_read},
            {"bytes_written_total", "Bytes written to the remote store (blocks and their keys).",
             r.bytes_written},
            {"tokens_written_total", "Tokens of the blocks written to the store.", r.tokens_written},
            {"errors_total", "Failed connections and commands to the store.", r.errors},
            {"rejected_total", "Values under this server's keys skipped as corrupt or foreign.", r.rejected},
        };
        for (size_t i = 0; i < sizeof rm / sizeof rm[0]; i++) {
            char name[64];
            snprintf(name, sizeof name, "prefix_cache_remote_%s", rm[i].name);
            metric(&b, name, "counter", rm[i].help, (double)rm[i].v);
        }
        metric(&b, "prefix_cache_remote_up", "gauge", "1 when the last command reached the store.", r.up ? 1 : 0);
    }
    char *text = strbuf_take(&b);
    enum MHD_Result ret = respond(h, c, 200, "text/plain; version=0.0.4", text);
    free(text);
    return ret;
}

/* llama-server's /tokenize, /detokenize and /apply-template, and /v1/embeddings. */
static enum MHD_Result aux_endpoint(struct http_server *h, struct MHD_Connection *c, const char *path,
                                    struct conn_state *cs) {
    const char *body = cs->body.s ? cs->body.s : "";
    struct oai_error e = {0};
    char *out;
    if (!h->p.model) /* the HTTP layer alone (fuzz/fuzz_http.c) */
        return fail(h, c, 503, "server_error", NULL, NULL, "no model is loaded");
    if (!strcmp(path, "/tokenize")) out = api_tokenize(h->p.model, body, cs->body.len, &e);
    else if (!strcmp(path, "/detokenize")) out = api_detokenize(h->p.model, body, cs->body.len, &e);
    else if (!strcmp(path, "/apply-template"))
        out = api_apply_template(h->p.chat, h->p.tool_syntax, body, cs->body.len, h->p.strict_api, &e);
    else if (!h->p.embedder)
        return fail(h, c, 501, "not_supported_error", NULL, NULL,
                    "this server does not compute embeddings: start it with --embeddings");
    else {
        cs->busy = true; /* a running request a graceful shutdown waits for (on_completed) */
        atomic_fetch_add(&h->busy, 1);
        out = api_embeddings(h->p.embedder, h->p.model_id, body, cs->body.len, h->p.strict_api, &e);
        timeout_restart(h, c); /* the computation is the server's time, not the client's */
    }
    return out ? respond_json(h, c, 200, out) : respond_error(h, c, &e);
}

/* Collapses repeated slashes and drops a trailing one (clients send //v1//models). */
static void normalize(const char *url, char *out, size_t size) {
    size_t n = 0;
    for (const char *p = url; *p && n + 1 < size; p++)
        if (*p != '/' || n == 0 || out[n - 1] != '/') out[n++] = *p;
    if (n > 1 && out[n - 1] == '/') n--;
    out[n] = '\0';
}

/* The smallest header key address above p (or end): where the next header line begins. */
struct next_key {
    uintptr_t p, next;
};

static enum MHD_Result find_next_key(void *cls, enum MHD_ValueKind kind, const char *key, size_t key_size,
                                     const char *value, size_t value_size) {
    (void)kind, (void)key_size, (void)value, (void)value_size;
    struct next_key *k = cls;
    if ((uintptr_t)key > k->p && (uintptr_t)key < k->next) k->next = (uintptr_t)key;
    return MHD_YES;
}

/* True when a NUL byte cut a header value short. libmicrohttpd (0.9.75) parses each
 * header line as a C string, so "Bearer KEY\0junk" reads as "Bearer KEY"; the line
 * stays in place in its header block, where the end of the line (CR, LF) became NULs:
 * anything else between the value's end and the next line is what the NUL hid. When
 * the value is not inside the block (another libmicrohttpd), nothing is checked. */
static bool value_cut(struct MHD_Connection *c, const char *method, const char *v, size_t n) {
    const union MHD_ConnectionInfo *hs = MHD_get_connection_info(c, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    uintptr_t start = (uintptr_t)method, end = hs ? start + hs->header_size : start, at = (uintptr_t)v + n;
    if ((uintptr_t)v < start || at >= end) return false;
    struct next_key k = {at, end};
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, find_next_key, &k);
    for (const char *p = v + n; (uintptr_t)p < k.next; p++)
        if (*p) return true;
    return false;
}

/* The whole header value, so one cut short by a NUL byte does not pass. */
static bool authorized(const struct http_server *h, struct MHD_Connection *c, const char *method) {
    if (!h->p.api_key) return true;
    const char *a;
    size_t la;
    static const char hdr[] = MHD_HTTP_HEADER_AUTHORIZATION;
    if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, hdr, sizeof hdr - 1, &a, &la) != MHD_YES || !a || la < 7 ||
        strncmp(a, "Bearer ", 7) != 0 || value_cut(c, method, a, la))
        return false;
    a += 7, la -= 7;
    /* compare in time independent of where they differ */
    size_t lk = strlen(h->p.api_key);
    unsigned diff = (unsigned)(la != lk);
    for (size_t i = 0; i < la && i < lk; i++) diff |= (unsigned char)(a[i] ^ h->p.api_key[i]);
    return diff == 0;
}

static bool is_health(const char *path) { return !strcmp(path, "/health") || !strcmp(path, "/v1/health"); }

static enum MHD_Result too_big(struct http_server *h, struct MHD_Connection *c) {
    char msg[128];
    snprintf(msg, sizeof msg, "the request body is larger than the limit of %zu bytes", h->p.max_body);
    return fail(h, c, 413, "invalid_request_error", NULL, NULL, msg);
}

/* What the headers alone decide, answered before any of the body is read (so a
 * refused body is never stored, and an oversized one is not waited for): a server
 * shutting down, a missing API key, a declared body over the limit. MHD_YES with
 * nothing queued: read the body. */
static enum MHD_Result from_headers(struct http_server *h, struct MHD_Connection *c, const char *method,
                                    const char *path) {
    if (atomic_load(&h->draining)) return fail(h, c, 503, "server_error", NULL, NULL, "the server is shutting down");
    if (is_health(path)) return MHD_YES;
    if (!authorized(h, c, method))
        return fail(h, c, 401, "invalid_request_error", NULL, "invalid_api_key",
                    "Incorrect API key provided (send it as 'Authorization: Bearer KEY')");
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        errno = 0;
        unsigned long long n = strtoull(cl, NULL, 10);
        if (errno == ERANGE || n > h->p.max_body) return too_big(h, c);
    }
    return MHD_YES;
}

static enum MHD_Result route(struct http_server *h, struct MHD_Connection *c, const char *url, const char *method,
                             struct conn_state *cs) {
    char path[256];
    normalize(url, path, sizeof path);
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (is_health(path))
        return get ? respond(h, c, 200, "application/json", "{\"status\":\"ok\"}")
                   : fail(h, c, 405, "invalid_request_error", NULL, NULL, "use GET for /health");
    if (cs->too_big) return too_big(h, c);
    enum oai_kind kind;
    if (!strcmp(path, "/v1/chat/completions") || !strcmp(path, "/chat/completions")) kind = OAI_CHAT;
    else if (!strcmp(path, "/v1/completions") || !strcmp(path, "/completions")) kind = OAI_COMPLETION;
    else if (!strcmp(path, "/v1/models") || !strcmp(path, "/models")) {
        if (!get) return fail(h, c, 405, "invalid_request_error", NULL, NULL, "use GET for /v1/models");
        return respond_json(h, c, 200, oai_models_json(h->p.model_id, h->started));
    } else if (!strcmp(path, "/tokenize") || !strcmp(path, "/detokenize") || !strcmp(path, "/apply-template") ||
               !strcmp(path, "/v1/embeddings") || !strcmp(path, "/embeddings")) {
        if (!post) return fail(h, c, 405, "invalid_request_error", NULL, NULL, "use POST for this endpoint");
        return aux_endpoint(h, c, path, cs);
    } else if (!strcmp(path, "/metrics")) {
        if (!get) return fail(h, c, 405, "invalid_request_error", NULL, NULL, "use GET for /metrics");
        return metrics(h, c);
    } else {
        char msg[300];
        snprintf(msg, sizeof msg, "unknown endpoint %s %s", method, path);
        return fail(h, c, 404, "invalid_request_error", NULL, "not_found", msg);
    }
    if (!post) return fail(h, c, 405, "invalid_request_error", NULL, NULL, "use POST for completions");
    return completions(h, c, kind, cs);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    struct http_server *h = cls;
    struct conn_state *cs = *con_cls;
    if (!cs) { /* the first call: headers only */
        if (!(cs = calloc(1, sizeof *cs))) return MHD_NO;
        *con_cls = cs;
        atomic_fetch_add(&h->n_http, 1);
        cs->http11 = !strcmp(version, MHD_HTTP_VERSION_1_1);
        char path[256];
        normalize(url, path, sizeof path);
        return from_headers(h, c, method, path);
    }
    if (*upload_size) {
        if (!cs->too_big && cs->body.len + *upload_size > h->p.max_body) {
            cs->too_big = true;
            strbuf_free(&cs->body);
        }
        if (!cs->too_big) strbuf_addn(&cs->body, upload, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    if (cs->body.oom) return fail(h, c, 500, "server_error", NULL, NULL, "out of memory");
    return route(h, c, url, method, cs);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode code) {
    (void)c, (void)code;
    struct http_server *h = cls;
    struct conn_state *cs = *con_cls;
    if (!cs) return;
    if (cs->busy) atomic_fetch_sub(&h->busy, 1);
    strbuf_free(&cs->body);
    free(cs);
    *con_cls = NULL;
}

/* libmicrohttpd's own messages (e.g. a client gone mid-response), marked as such. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    fputs("kvq serve: http: ", stderr);
    vfprintf(stderr, fmt, ap);
    if (!*fmt || fmt[strlen(fmt) - 1] != '\n') fputc('\n', stderr);
}

/* Decodes %XX in the URL and its arguments as libmicrohttpd does, except %00: a NUL
 * would cut the path short ("/health%00/v1/models" is not /health), so it stays as
 * the three characters, and such a path matches no endpoint. */
static int hex_digit(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static size_t unescape(void *cls, struct MHD_Connection *c, char *s) {
    (void)cls, (void)c;
    char *w = s;
    for (const char *r = s; *r;) {
        int hi, lo;
        if (r[0] == '%' && (hi = hex_digit(r[1])) >= 0 && (lo = hex_digit(r[2])) >= 0 && (hi | lo)) {
            *w++ = (char)(hi << 4 | lo);
            r += 3;
        } else {
            *w++ = *r++;
        }
    }
    *w = '\0';
    return (size_t)(w - s);
}

/* The listening socket, made here for SO_REUSEADDR (libmicrohttpd's address-reuse
 * option is SO_REUSEPORT, which would let a second server share the port): the port
 * binds while connections of a server that just left sit in TIME-WAIT. */
static int listen_socket(const struct http_params *p) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *ai;
    char port[16];
    snprintf(port, sizeof port, "%d", p->port);
    int rc = getaddrinfo(p->host, port, &hints, &ai);
    if (rc != 0) {
        fprintf(stderr, "kvq serve: cannot resolve host '%s': %s\n", p->host, gai_strerror(rc));
        return -1;
    }
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol), one = 1;
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, SOMAXCONN) != 0) {
        fprintf(stderr, "kvq serve: cannot listen on %s:%d: %s\n", p->host, p->port, strerror(errno));
        if (fd >= 0) close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

static int bound_port(int fd) {
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &len) != 0) return -1;
    return ntohs(a.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a)->sin6_port : ((struct sockaddr_in *)&a)->sin_port);
}

struct http_server *http_start(const struct http_params *p) {
    int fd = listen_socket(p);
    if (fd < 0) return NULL;
    struct http_server *h = calloc(1, sizeof *h);
    if (!h) {
        close(fd);
        return NULL;
    }
    h->p = *p;
    h->started = (long)time(NULL);
    h->port = bound_port(fd);
    /* A thread per connection (handlers wait for the scheduler), polled with poll():
     * no FD_SETSIZE cap on descriptors; idle connections time out; the connection
     * count is capped in all and per client address. ITC: for MHD_quiesce_daemon. */
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    h->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                            MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)p->timeout_s,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned)p->max_connections,
                            MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)p->max_connections_per_ip,
                            MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                            MHD_OPTION_END);
    if (!h->d) {
        fprintf(stderr, "kvq serve: cannot start the HTTP server on %s:%d\n", p->host, p->port);
        close(fd);
        free(h);
        return NULL;
    }
    return h;
}

int http_port(const struct http_server *h) { return h->port; }

int http_drain(struct http_server *h, double seconds) {
    if (!atomic_exchange(&h->draining, true)) {
        MHD_socket fd = MHD_quiesce_daemon(h->d);
        if (fd != MHD_INVALID_SOCKET) close(fd);
    }
    for (double end = now_s() + seconds; atomic_load(&h->busy) > 0 && now_s() < end;)
        nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    return atomic_load(&h->busy);
}

void http_stop(struct http_server *h) {
    if (!h) return;
    MHD_stop_daemon(h->d);
    free(h);
}
