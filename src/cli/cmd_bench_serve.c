/* kvq bench-serve: a load generator for OpenAI-compatible servers (kvq serve, vLLM,
 * llama-server). `--concurrency` client threads take requests from a shared counter
 * until `--requests` are done; each request is one connection (every wait on it
 * bounded by poll()) that streams a completion and times its SSE chunks. Threads, not
 * an event loop: at 256 clients that is 256 small stacks, and each stream's code reads
 * top to bottom. The main thread polls
 * /metrics for kvq_kv_bytes_in_use and shows progress on a terminal.
 *
 * Metrics, as scripts/bench_serve.mjs defines them: TTFT from just before connecting
 * to the first chunk with text; ITL the gaps between consecutive chunks with text
 * (a chunk holding several tokens is one gap, so ITL is per chunk: "tokens per
 * chunk" says how far that is from per token; TPOT = (last chunk - first chunk) /
 * (completion_tokens - 1) per request is the per-token figure); output tokens from
 * each stream's usage chunk (stream_options.include_usage); percentiles are the
 * sorted value at floor(p/100 * n). Prompts are random whole-word tokens of the
 * model's own vocabulary (-m), sized with its tokenizer as the server counts them. */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cli/bench_prompts.h"
#include "cli/cli.h"
#include "cli/http_client.h"

static const char *const bench_serve_help =
    "usage: kvq bench-serve -m MODEL [--url URL | --host H --port P] [--concurrency N] [--requests N]\n"
    "                       [--prompt-tokens N] [--output-tokens N] [--shared-prefix-tokens N] [--chat]\n"
    "                       [--temperature T] [--top-p P] [--top-k K] [--api-key KEY] [--seed N]\n"
    "                       [--json]\n"
    "\n"
    "Streams OpenAI completions from a running server at a fixed concurrency and reports\n"
    "requests/s, output tok/s, total tokens, TTFT, ITL and TPOT percentiles, the peak of the\n"
    "server's kvq_kv_bytes_in_use (/metrics) and errors by kind.\n"
    "\n"
    "  -m, --model FILE            the served model's GGUF (only its tokenizer is read): prompts\n"
    "                              are random words of its vocabulary sized with it exactly\n"
    "  --url URL                   the server, http://HOST[:PORT][/PATH] (default http://127.0.0.1:8080)\n"
    "  --host H, --port P          the same in parts (default 127.0.0.1 and 8080)\n"
    "  --concurrency N             requests in flight at once (default 1)\n"
    "  --requests N                requests in all (default 4 x concurrency)\n"
    "  --prompt-tokens N           prompt tokens as the server counts them, BOS included\n"
    "                              (default 512); with --chat, the message's tokens (the chat\n"
    "                              template adds its own)\n"
    "  --shared-prefix-tokens N    the first N of them are the same in every request (default 0)\n"
    "  --output-tokens N           tokens generated per request (default 256): sends max_tokens,\n"
    "                              and ignore_eos and min_tokens (vLLM/llama.cpp) for a fixed length\n"
    "  --temperature T             the requests' sampling temperature (default 0: greedy); each\n"
    "                              request then sends its own seed\n"
    "  --top-p P                   the requests' top_p (default: not sent)\n"
    "  --top-k K                   the requests' top_k (vLLM/llama.cpp; default: not sent)\n"
    "  --no-ignore-eos             send only max_tokens (for servers that refuse those fields);\n"
    "                              a generation may then end early at EOS\n"
    "  --chat                      POST /v1/chat/completions (one user message) instead of\n"
    "                              /v1/completions\n"
    "  --model-name NAME           the request's \"model\" (default: the first of GET /v1/models)\n"
    "  --api-key KEY               sent as 'Authorization: Bearer KEY' (default $KVQ_API_KEY)\n"
    "  --seed N                    seed of the prompts' words (default 0)\n"
    "  --timeout S                 a request fails after S seconds without a byte (default 120)\n"
    "  --connect-timeout S         connecting fails after S seconds (default 10)\n"
    "  --json                      JSON instead of the table\n"
    "  -h, --help                  this text\n"
    "\n"
    "Exit status: 0 when every request succeeded, 2 when some failed (the report is still\n"
    "printed), 1 for bad options.\n";

static const char *const bench_serve_value_flags[] = {
    "-m", "--model", "--url", "--host", "--port", "--concurrency", "--requests", "--prompt-tokens",
    "--output-tokens", "--shared-prefix-tokens", "--model-name", "--api-key", "--seed", "--timeout",
    "--connect-timeout", "--temperature", "--top-p", "--top-k", NULL};

struct bs_opts {
    const char *model, *url, *host, *model_name, *api_key;
    int port, concurrency, requests, prompt_tokens, output_tokens, shared_prefix, timeout_s, connect_timeout_s, top_k;
    uint64_t seed;
    float temperature, top_p;
    bool chat, ignore_eos, json;
};

/* No control characters or spaces: the value goes into an HTTP header. */
static bool header_safe(const char *flag, const char *v) {
    for (const char *c = v; *c; c++)
        if ((unsigned char)*c <= ' ' || *c == 0x7f) {
            cli_fail("%s must not hold spaces or control characters", flag);
            return false;
        }
    if (!*v) cli_fail("%s must not be empty", flag);
    return *v != '\0';
}

static int parse_args(int argc, char **argv, struct bs_opts *o) {
    *o = (struct bs_opts){.port = -1, .concurrency = 1, .requests = -1, .prompt_tokens = 512,
                          .output_tokens = 256, .timeout_s = 120, .connect_timeout_s = 10, .ignore_eos = true,
                          .top_p = -1, .top_k = -1, .api_key = getenv("KVQ_API_KEY")};
    if (o->api_key && !*o->api_key) o->api_key = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(bench_serve_help, stdout);
            exit(0);
        }
        if (!strcmp(a, "--json")) { o->json = true; continue; }
        if (!strcmp(a, "--chat")) { o->chat = true; continue; }
        if (!strcmp(a, "--no-ignore-eos")) { o->ignore_eos = false; continue; }
        if (!(v = cli_option_value(argc, argv, &i, bench_serve_value_flags, "bench-serve"))) return 1;
        bool ok = true;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--url")) o->url = v;
        else if (!strcmp(a, "--host")) o->host = v;
        else if (!strcmp(a, "--model-name")) o->model_name = v;
        else if (!strcmp(a, "--api-key")) ok = header_safe(a, o->api_key = v);
        else if (!strcmp(a, "--port")) ok = cli_parse_int(a, v, 1, 65535, &o->port);
        else if (!strcmp(a, "--concurrency")) ok = cli_parse_int(a, v, 1, 4096, &o->concurrency);
        else if (!strcmp(a, "--requests")) ok = cli_parse_int(a, v, 1, 10000000, &o->requests);
        else if (!strcmp(a, "--prompt-tokens")) ok = cli_parse_int(a, v, 1, 1 << 20, &o->prompt_tokens);
        else if (!strcmp(a, "--output-tokens")) ok = cli_parse_int(a, v, 1, 1 << 20, &o->output_tokens);
        else if (!strcmp(a, "--shared-prefix-tokens")) ok = cli_parse_int(a, v, 0, 1 << 20, &o->shared_prefix);
        else if (!strcmp(a, "--timeout")) ok = cli_parse_int(a, v, 1, 86400, &o->timeout_s);
        else if (!strcmp(a, "--connect-timeout")) ok = cli_parse_int(a, v, 1, 3600, &o->connect_timeout_s);
        else if (!strcmp(a, "--seed")) ok = cli_parse_u64(a, v, &o->seed);
        else if (!strcmp(a, "--temperature")) ok = cli_parse_float(a, v, 0, 2, &o->temperature);
        else if (!strcmp(a, "--top-p")) ok = cli_parse_float(a, v, 0, 1, &o->top_p);
        else if (!strcmp(a, "--top-k")) ok = cli_parse_int(a, v, 0, 1 << 30, &o->top_k);
        if (!ok) return 1;
    }
    if (!o->model) return cli_fail("bench-serve needs the served model's GGUF for its tokenizer: -m FILE");
    if (o->url && (o->host || o->port >= 0)) return cli_fail("give either --url or --host/--port, not both");
    if (o->shared_prefix >= o->prompt_tokens)
        return cli_fail("--shared-prefix-tokens (%d) must be smaller than --prompt-tokens (%d)", o->shared_prefix,
                        o->prompt_tokens);
    if (o->requests < 0) o->requests = o->concurrency > 10000000 / 4 ? 10000000 : 4 * o->concurrency;
    if (o->model_name && !*o->model_name) return cli_fail("--model-name must not be empty");
    return 0;
}

/* The request bodies (JSON), prompts freed as they are used. */
static char **make_bodies(const struct bs_opts *o, const char *model_name, char **prompts) {
    char **bodies = calloc((size_t)o->requests, sizeof *bodies);
    for (int i = 0; i < o->requests; i++) {
        json_t *r = json_object();
        if (model_name) json_object_set_new(r, "model", json_string(model_name));
        if (o->chat) {
            json_t *msg = json_object();
            json_object_set_new(msg, "role", json_string("user"));
            json_object_set_new(msg, "content", json_string(prompts[i]));
            json_t *msgs = json_array();
            json_array_append_new(msgs, msg);
            json_object_set_new(r, "messages", msgs);
        } else
            json_object_set_new(r, "prompt", json_string(prompts[i]));
        json_object_set_new(r, "max_tokens", json_integer(o->output_tokens));
        json_object_set_new(r, "temperature", json_real(o->temperature));
        if (o->temperature > 0) json_object_set_new(r, "seed", json_integer((json_int_t)(o->seed + (uint64_t)i)));
        if (o->top_p >= 0) json_object_set_new(r, "top_p", json_real(o->top_p));
        if (o->top_k >= 0) json_object_set_new(r, "top_k", json_integer(o->top_k));
        json_object_set_new(r, "stream", json_true());
        json_t *so = json_object();
        json_object_set_new(so, "include_usage", json_true());
        json_object_set_new(r, "stream_options", so);
        if (o->ignore_eos) {
            json_object_set_new(r, "ignore_eos", json_true());
            json_object_set_new(r, "min_tokens", json_integer(o->output_tokens));
        }
        free(prompts[i]);
        prompts[i] = NULL;
        if (bodies) bodies[i] = json_dumps(r, JSON_COMPACT);
        json_decref(r);
        if (bodies && !bodies[i]) {
            for (int j = 0; j < i; j++) free(bodies[j]);
            free(bodies);
            bodies = NULL;
        }
    }
    if (!bodies) cli_fail("out of memory");
    return bodies;
}

/* ---- requests ---- */

enum err_kind { ERR_CONNECT, ERR_TIMEOUT, ERR_CLOSED, ERR_PROTOCOL, ERR_HTTP_4XX, ERR_HTTP_5XX, ERR_STREAM, ERR_INCOMPLETE, ERR_KINDS };
static const char *const err_names[ERR_KINDS] = {"connect", "timeout", "closed", "protocol",
                                                 "http_4xx", "http_5xx", "stream_error", "incomplete"};

struct req_result {
    bool ok, has_usage;
    double t_start, t_first, t_last, t_end;
    int n_chunks, prompt_tokens, completion_tokens, cached_tokens;
    double *gaps; /* [n_chunks - 1] seconds between chunks with text */
    int gaps_cap;
};

struct run {
    const struct bs_opts *o;
    const struct http_target *target;
    const char *path;
    char **bodies;
    struct req_result *res;
    atomic_int next, done, failed;
    atomic_llong out_tokens;
    pthread_mutex_t lock; /* errors */
    int err_count[ERR_KINDS];
    char err_first[ERR_KINDS][256];
};

/* snprintf("%s") without gcc's truncation warning: the messages are cut on purpose. */
static void copy_text(char *dst, size_t size, const char *src) {
    size_t n = strlen(src) < size - 1 ? strlen(src) : size - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static void record_error(struct run *run, enum err_kind k, const char *msg) {
    pthread_mutex_lock(&run->lock);
    if (run->err_count[k]++ == 0) copy_text(run->err_first[k], sizeof run->err_first[k], msg);
    pthread_mutex_unlock(&run->lock);
}

/* One stream being read. */
struct stream {
    struct req_result *r;
    struct sse_parser sse;
    const int *status;
    bool chat, done, bad_json, oom;
    char err_body[512]; /* the start of an error response, or the stream's error message */
    size_t err_len;
    bool stream_error;
};

static const char *choice_text(json_t *chunk, bool chat) {
    json_t *c = json_array_get(json_object_get(chunk, "choices"), 0);
    json_t *t = chat ? json_object_get(json_object_get(c, "delta"), "content") : json_object_get(c, "text");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

static int json_int_at(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (int)json_integer_value(v) : 0;
}

static bool on_event(void *ctx, const char *data, size_t len) {
    struct stream *s = ctx;
    double now = cli_now();
    if (!strcmp(data, "[DONE]")) {
        s->done = true;
        return true;
    }
    json_t *j = json_loadb(data, len, 0, NULL);
    if (!json_is_object(j)) {
        json_decref(j);
        s->bad_json = true;
        snprintf(s->err_body, sizeof s->err_body, "a stream chunk is not a JSON object: %.80s", data);
        return false;
    }
    json_t *err = json_object_get(j, "error");
    if (err) {
        json_t *m = json_object_get(err, "message");
        snprintf(s->err_body, sizeof s->err_body, "error in the stream: %s",
                 json_is_string(m) ? json_string_value(m) : data);
        s->stream_error = true;
        json_decref(j);
        return false;
    }
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        struct req_result *r = s->r;
        r->has_usage = true;
        r->prompt_tokens = json_int_at(u, "prompt_tokens");
        r->completion_tokens = json_int_at(u, "completion_tokens");
        r->cached_tokens = json_int_at(json_object_get(u, "prompt_tokens_details"), "cached_tokens");
    }
    const char *text = choice_text(j, s->chat);
    if (text && *text) {
        struct req_result *r = s->r;
        if (r->n_chunks++ == 0) r->t_first = now;
        else {
            if (r->n_chunks - 1 > r->gaps_cap) {
                int cap = r->gaps_cap ? 2 * r->gaps_cap : 256;
                double *g = realloc(r->gaps, sizeof *g * (size_t)cap);
                if (!g) {
                    s->oom = true;
                    json_decref(j);
                    return false;
                }
                r->gaps = g, r->gaps_cap = cap;
            }
            r->gaps[r->n_chunks - 2] = now - r->t_last;
        }
        r->t_last = now;
    }
    json_decref(j);
    return true;
}

static bool on_body(void *ctx, const char *data, size_t len) {
    struct stream *s = ctx;
    if (*s->status != 200) { /* keep the start of the error body for the report */
        size_t n = len < sizeof s->err_body - 1 - s->err_len ? len : sizeof s->err_body - 1 - s->err_len;
        memcpy(s->err_body + s->err_len, data, n);
        s->err_len += n;
        s->err_body[s->err_len] = '\0';
        return true;
    }
    return sse_feed(&s->sse, data, len);
}

/* The message of an OpenAI error body, else the body's start. */
static void error_message(const char *body, char *out, size_t size) {
    json_t *j = json_loads(body, 0, NULL);
    json_t *m = json_object_get(json_object_get(j, "error"), "message");
    copy_text(out, size, json_is_string(m) ? json_string_value(m) : body);
    json_decref(j);
}

static void run_one(struct run *run, int i) {
    struct req_result *r = &run->res[i];
    int status = 0;
    struct stream s = {.r = r, .status = &status, .chat = run->o->chat};
    s.sse = (struct sse_parser){.on_event = on_event, .ctx = &s};
    struct http_request q = {.method = "POST", .path = run->path, .api_key = run->o->api_key,
                             .body = run->bodies[i], .body_len = strlen(run->bodies[i]),
                             .connect_timeout_ms = run->o->connect_timeout_s * 1000,
                             .read_timeout_ms = run->o->timeout_s * 1000, .on_body = on_body, .ctx = &s};
    char err[256];
    r->t_start = cli_now();
    enum http_fail f = http_do(run->target, &q, &status, err, sizeof err);
    r->t_end = cli_now();
    enum err_kind kind = ERR_KINDS;
    if (f == HTTP_FAIL_CONNECT) kind = ERR_CONNECT;
    else if (f == HTTP_FAIL_TIMEOUT) kind = ERR_TIMEOUT;
    else if (f == HTTP_FAIL_CLOSED) kind = ERR_CLOSED;
    else if (f == HTTP_FAIL_PROTOCOL) kind = ERR_PROTOCOL;
    else if (s.stream_error || s.bad_json) {
        kind = s.stream_error ? ERR_STREAM : ERR_PROTOCOL;
        copy_text(err, sizeof err, s.err_body);
    } else if (f == HTTP_FAIL_ABORTED) {
        kind = ERR_PROTOCOL;
        if (s.oom || s.sse.oom) snprintf(err, sizeof err, "out of memory reading the stream");
        else if (s.sse.too_long) snprintf(err, sizeof err, "a stream line over 64 MiB");
    } else if (status != 200) {
        kind = status >= 500 ? ERR_HTTP_5XX : ERR_HTTP_4XX;
        char m[400];
        error_message(s.err_body, m, sizeof m);
        snprintf(err, sizeof err, "HTTP %d: %.200s", status, m);
    } else if (!s.done) {
        kind = ERR_INCOMPLETE;
        snprintf(err, sizeof err, "the stream ended without 'data: [DONE]'");
    }
    sse_free(&s.sse);
    if (kind != ERR_KINDS) {
        record_error(run, kind, err);
        atomic_fetch_add(&run->failed, 1);
    } else {
        r->ok = true;
        if (!r->has_usage) r->completion_tokens = r->n_chunks; /* a server without include_usage */
        atomic_fetch_add(&run->out_tokens, r->completion_tokens);
    }
    atomic_fetch_add(&run->done, 1);
}

static void *worker(void *arg) {
    struct run *run = arg;
    for (int i; (i = atomic_fetch_add(&run->next, 1)) < run->o->requests;) run_one(run, i);
    return NULL;
}

/* ---- the server's side ---- */

struct collect {
    char *s;
    size_t len, cap;
};

static bool collect_body(void *ctx, const char *data, size_t len) {
    struct collect *c = ctx;
    if (c->len + len + 1 > c->cap) {
        if (c->len + len + 1 > (4u << 20)) return false;
        size_t cap = (c->len + len + 1) * 2;
        char *s = realloc(c->s, cap);
        if (!s) return false;
        c->s = s, c->cap = cap;
    }
    memcpy(c->s + c->len, data, len);
    c->len += len;
    c->s[c->len] = '\0';
    return true;
}

/* GET path; the body (caller frees) when the answer is 200, else NULL. */
static char *http_get(const struct http_target *t, const char *path, const char *api_key, int timeout_ms) {
    struct collect c = {0};
    struct http_request q = {.method = "GET", .path = path, .api_key = api_key, .connect_timeout_ms = timeout_ms,
                             .read_timeout_ms = timeout_ms, .on_body = collect_body, .ctx = &c};
    int status;
    char err[256];
    if (http_do(t, &q, &status, err, sizeof err) != HTTP_OK || status != 200 || !c.s) {
        free(c.s);
        return NULL;
    }
    return c.s;
}

/* The first model /v1/models lists (servers such as vLLM check the field), or NULL. */
static char *served_model(const struct http_target *t, const struct bs_opts *o) {
    char *body = http_get(t, "/v1/models", o->api_key, o->connect_timeout_s * 1000);
    json_t *j = body ? json_loads(body, 0, NULL) : NULL;
    json_t *id = json_object_get(json_array_get(json_object_get(j, "data"), 0), "id");
    char *name = json_is_string(id) ? strdup(json_string_value(id)) : NULL;
    json_decref(j);
    free(body);
    return name;
}

/* kvq_kv_bytes_in_use from /metrics: its value, -1 when the answer has none, -2 when
 * there was no answer. */
static double kv_bytes_in_use(const struct http_target *t, const struct bs_opts *o) {
    char *body = http_get(t, "/metrics", o->api_key, o->timeout_s < 2 ? o->timeout_s * 1000 : 2000);
    if (!body) return -2;
    double v = -1;
    for (const char *p = body; p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, "kvq_kv_bytes_in_use ", 20)) {
            v = strtod(p + 20, NULL);
            break;
        }
    free(body);
    return v;
}

/* ---- the report ---- */

struct dist {
    double p50, p90, p99, mean;
    size_t n;
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Percentiles as scripts/bench_serve.mjs takes them: sorted[min(n-1, floor(p/100*n))]; in ms. */
static struct dist dist_of(double *v, size_t n) {
    struct dist d = {.n = n};
    if (!n) return d;
    qsort(v, n, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += v[i];
    int at[3] = {50, 90, 99};
    double *out[3] = {&d.p50, &d.p90, &d.p99};
    for (int k = 0; k < 3; k++) {
        size_t i = (size_t)floor(at[k] / 100.0 * (double)n);
        *out[k] = v[i < n - 1 ? i : n - 1] * 1000;
    }
    d.mean = sum / (double)n * 1000;
    return d;
}

struct summary {
    int ok, failed;
    double wall, peak_kv; /* peak_kv < 0: unknown */
    long long prompt_tokens, output_tokens, cached_tokens, chunks, usage_missing, short_outputs;
    struct dist ttft, itl, tpot, e2e;
};

static bool summarize(const struct run *run, double peak_kv, struct summary *s) {
    const struct bs_opts *o = run->o;
    *s = (struct summary){.peak_kv = peak_kv};
    long long n_gaps = 0;
    double t0 = INFINITY, t1 = -INFINITY;
    for (int i = 0; i < o->requests; i++) {
        const struct req_result *r = &run->res[i];
        if (r->t_start < t0) t0 = r->t_start;
        if (r->t_end > t1) t1 = r->t_end;
        if (!r->ok) continue;
        n_gaps += r->n_chunks > 1 ? r->n_chunks - 1 : 0;
    }
    s->wall = t1 > t0 ? t1 - t0 : 0;
    double *ttft = malloc(sizeof(double) * (size_t)o->requests), *tpot = malloc(sizeof(double) * (size_t)o->requests),
           *e2e = malloc(sizeof(double) * (size_t)o->requests), *itl = malloc(sizeof(double) * (size_t)(n_gaps + 1));
    bool ok = ttft && tpot && e2e && itl;
    size_t n_ttft = 0, n_tpot = 0, g = 0;
    for (int i = 0; ok && i < o->requests; i++) {
        const struct req_result *r = &run->res[i];
        if (!r->ok) {
            s->failed++;
            continue;
        }
        s->ok++;
        s->prompt_tokens += r->prompt_tokens;
        s->output_tokens += r->completion_tokens;
        s->cached_tokens += r->cached_tokens;
        s->chunks += r->n_chunks;
        s->usage_missing += !r->has_usage;
        s->short_outputs += r->completion_tokens < o->output_tokens;
        e2e[s->ok - 1] = r->t_end - r->t_start;
        if (r->n_chunks) ttft[n_ttft++] = r->t_first - r->t_start;
        if (r->n_chunks > 1 && r->completion_tokens > 1)
            tpot[n_tpot++] = (r->t_last - r->t_first) / (r->completion_tokens - 1);
        for (int k = 0; k + 1 < r->n_chunks; k++) itl[g++] = r->gaps[k];
    }
    if (ok) {
        s->ttft = dist_of(ttft, n_ttft);
        s->tpot = dist_of(tpot, n_tpot);
        s->e2e = dist_of(e2e, (size_t)s->ok);
        s->itl = dist_of(itl, g);
    }
    free(ttft), free(tpot), free(e2e), free(itl);
    if (!ok) cli_fail("out of memory");
    return ok;
}

static json_t *dist_json(const struct dist *d) {
    if (!d->n) return json_null();
    return json_pack("{s:f,s:f,s:f,s:f}", "p50", d->p50, "p90", d->p90, "p99", d->p99, "mean", d->mean);
}

static double per_s(double x, double wall) { return wall > 0 ? x / wall : 0; }

static void print_json(const struct run *run, const struct summary *s, const char *url) {
    const struct bs_opts *o = run->o;
    json_t *errs = json_object();
    for (int k = 0; k < ERR_KINDS; k++)
        if (run->err_count[k]) json_object_set_new(errs, err_names[k], json_integer(run->err_count[k]));
    json_t *msgs = json_object();
    for (int k = 0; k < ERR_KINDS; k++)
        if (run->err_count[k]) json_object_set_new(msgs, err_names[k], json_string(run->err_first[k]));
    json_t *j = json_object();
    json_object_set_new(j, "url", json_string(url));
    json_object_set_new(j, "concurrency", json_integer(o->concurrency));
    json_object_set_new(j, "requests", json_integer(o->requests));
    json_object_set_new(j, "prompt_tokens", json_integer(o->prompt_tokens));
    json_object_set_new(j, "shared_prefix_tokens", json_integer(o->shared_prefix));
    json_object_set_new(j, "output_tokens", json_integer(o->output_tokens));
    json_object_set_new(j, "ignore_eos", json_boolean(o->ignore_eos));
    json_object_set_new(j, "temperature", json_real(o->temperature));
    if (o->top_p >= 0) json_object_set_new(j, "top_p", json_real(o->top_p));
    if (o->top_k >= 0) json_object_set_new(j, "top_k", json_integer(o->top_k));
    json_object_set_new(j, "successful_requests", json_integer(s->ok));
    json_object_set_new(j, "failed_requests", json_integer(s->failed));
    json_object_set_new(j, "duration_s", json_real(s->wall));
    json_object_set_new(j, "requests_per_s", json_real(per_s(s->ok, s->wall)));
    json_object_set_new(j, "output_tokens_per_s", json_real(per_s((double)s->output_tokens, s->wall)));
    json_object_set_new(j, "total_tokens_per_s", json_real(per_s((double)(s->prompt_tokens + s->output_tokens), s->wall)));
    json_object_set_new(j, "total_prompt_tokens", json_integer(s->prompt_tokens));
    json_object_set_new(j, "total_output_tokens", json_integer(s->output_tokens));
    json_object_set_new(j, "cached_prompt_tokens", json_integer(s->cached_tokens));
    json_object_set_new(j, "output_chunks", json_integer(s->chunks));
    json_object_set_new(j, "tokens_per_chunk", s->chunks ? json_real((double)s->output_tokens / (double)s->chunks) : json_null());
    json_object_set_new(j, "short_outputs", json_integer(s->short_outputs));
    json_object_set_new(j, "usage_missing", json_integer(s->usage_missing));
    json_object_set_new(j, "ttft_ms", dist_json(&s->ttft));
    json_object_set_new(j, "itl_ms", dist_json(&s->itl));
    json_object_set_new(j, "tpot_ms", dist_json(&s->tpot));
    json_object_set_new(j, "e2e_ms", dist_json(&s->e2e));
    json_object_set_new(j, "peak_kv_bytes_in_use", s->peak_kv >= 0 ? json_integer((json_int_t)s->peak_kv) : json_null());
    json_object_set_new(j, "errors", errs);
    json_object_set_new(j, "error_messages", msgs);
    char *text = json_dumps(j, JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    if (text) puts(text);
    free(text);
    json_decref(j);
}

static void print_dist(const char *name, const struct dist *d) {
    if (!d->n) printf("%-22s %10s\n", name, "-");
    else printf("%-22s %10.2f %10.2f %10.2f %10.2f\n", name, d->p50, d->p90, d->p99, d->mean);
}

static void print_table(const struct run *run, const struct summary *s, const char *url) {
    const struct bs_opts *o = run->o;
    printf("kvq bench-serve: %s, concurrency %d, %d requests\n", url, o->concurrency, o->requests);
    printf("prompts of %d tokens (%d shared), %d output tokens%s, temperature %g", o->prompt_tokens, o->shared_prefix,
           o->output_tokens, o->ignore_eos ? " (ignore_eos)" : "", o->temperature);
    if (o->top_p >= 0) printf(", top_p %g", o->top_p);
    if (o->top_k >= 0) printf(", top_k %d", o->top_k);
    printf("\n\n");
    printf("%-22s %d of %d\n", "successful requests", s->ok, o->requests);
    printf("%-22s %.2f s\n", "duration", s->wall);
    printf("%-22s %.2f\n", "requests/s", per_s(s->ok, s->wall));
    printf("%-22s %.1f\n", "output tok/s", per_s((double)s->output_tokens, s->wall));
    printf("%-22s %.1f\n", "total tok/s", per_s((double)(s->prompt_tokens + s->output_tokens), s->wall));
    printf("%-22s %lld (%lld cached)\n", "prompt tokens", s->prompt_tokens, s->cached_tokens);
    printf("%-22s %lld", "output tokens", s->output_tokens);
    if (s->short_outputs) printf(" (%lld requests stopped before %d)", s->short_outputs, o->output_tokens);
    if (s->usage_missing) printf(" (%lld streams without usage: counted as chunks)", s->usage_missing);
    printf("\n");
    if (s->chunks) printf("%-22s %.2f\n", "tokens per chunk", (double)s->output_tokens / (double)s->chunks);
    if (s->peak_kv >= 0) printf("%-22s %.2f MiB\n", "peak kv_bytes_in_use", s->peak_kv / 1048576.0);
    else printf("%-22s %s\n", "peak kv_bytes_in_use", "unknown (no kvq_kv_bytes_in_use on /metrics)");
    printf("\n%-22s %10s %10s %10s %10s\n", "ms", "p50", "p90", "p99", "mean");
    print_dist("TTFT", &s->ttft);
    print_dist("ITL (per chunk)", &s->itl);
    print_dist("TPOT (per token)", &s->tpot);
    print_dist("request latency", &s->e2e);
    printf("\n");
    bool any = false;
    for (int k = 0; k < ERR_KINDS; k++)
        if (run->err_count[k]) {
            printf("%-22s %s %d, first: %s\n", any ? "" : "errors", err_names[k], run->err_count[k], run->err_first[k]);
            any = true;
        }
    if (!any) printf("%-22s none\n", "errors");
}

/* ---- the command ---- */

/* One socket per client plus a few: raise the soft limit on open files if needed. */
static bool enough_files(int clients) {
    struct rlimit rl;
    rlim_t need = (rlim_t)clients + 32;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur >= need) return true;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur >= need) return true;
    cli_fail("--concurrency %d needs %llu open files but the limit is %llu (ulimit -n)", clients,
             (unsigned long long)need, (unsigned long long)rl.rlim_cur);
    return false;
}

int cmd_bench_serve(int argc, char **argv) {
    struct bs_opts o;
    if (parse_args(argc, argv, &o)) return 1;
    char parts[600], err[256];
    const char *h = o.host ? o.host : "127.0.0.1", *url = o.url ? o.url : parts;
    bool v6 = strchr(h, ':') && h[0] != '[';
    snprintf(parts, sizeof parts, "http://%s%.300s%s:%d", v6 ? "[" : "", h, v6 ? "]" : "", o.port >= 0 ? o.port : 8080);
    if (!enough_files(o.concurrency < o.requests ? o.concurrency : o.requests)) return 1;
    struct http_target target;
    if (!http_target_parse(url, &target, err, sizeof err))
        return cli_fail("invalid %s '%s': %s", o.url ? "--url" : "--host", o.url ? url : h, err);
    if (!http_target_resolve(&target, err, sizeof err)) return cli_fail("%s", err);

    struct kvq_model *m = kvq_model_load_vocab(o.model);
    if (!m) {
        http_target_free(&target);
        return cli_fail("%s", kvq_last_error());
    }
    char **prompts = bench_prompts(m, o.requests, o.prompt_tokens, o.shared_prefix, !o.chat, o.seed);
    kvq_model_free(m);
    char *model_name = o.model_name ? strdup(o.model_name) : served_model(&target, &o);
    char **bodies = prompts ? make_bodies(&o, model_name, prompts) : NULL;
    free(prompts);
    free(model_name);
    struct run run = {.o = &o, .target = &target, .path = o.chat ? "/v1/chat/completions" : "/v1/completions",
                      .bodies = bodies, .res = bodies ? calloc((size_t)o.requests, sizeof *run.res) : NULL,
                      .lock = PTHREAD_MUTEX_INITIALIZER};
    int n_threads = o.concurrency < o.requests ? o.concurrency : o.requests, started = 0, rc = 1;
    pthread_t *th = calloc((size_t)n_threads, sizeof *th);
    if (!run.res || !th) {
        if (bodies) cli_fail("out of memory");
        goto out;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    for (; started < n_threads; started++)
        if (pthread_create(&th[started], &attr, worker, &run) != 0) break;
    pthread_attr_destroy(&attr);
    if (started == 0) {
        cli_fail("cannot start a client thread");
        goto out;
    }
    if (started < n_threads) fprintf(stderr, "kvq: warning: only %d of %d client threads started\n", started, n_threads);

    bool tty = isatty(STDERR_FILENO), poll_metrics = true;
    double peak_kv = -1;
    while (atomic_load(&run.done) < o.requests) {
        double t = cli_now();
        if (poll_metrics) {
            double v = kv_bytes_in_use(&target, &o);
            if (v == -1) poll_metrics = false; /* an answer without the gauge: not a kvq server */
            if (v > peak_kv) peak_kv = v;
        }
        if (tty)
            fprintf(stderr, "\rkvq bench-serve: %d/%d requests done, %d failed, %lld output tokens", atomic_load(&run.done),
                    o.requests, atomic_load(&run.failed), (long long)atomic_load(&run.out_tokens));
        double left = 0.1 - (cli_now() - t);
        if (left > 0) nanosleep(&(struct timespec){0, (long)(left * 1e9)}, NULL);
    }
    if (tty) fputs("\r\033[K", stderr);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    double last = poll_metrics && peak_kv >= 0 ? kv_bytes_in_use(&target, &o) : -1;
    if (last > peak_kv) peak_kv = last;

    struct summary s;
    if (summarize(&run, peak_kv, &s)) {
        char shown[700];
        snprintf(shown, sizeof shown, "http://%s%s%s", target.authority, target.base, run.path);
        if (o.json) print_json(&run, &s, shown);
        else print_table(&run, &s, shown);
        rc = s.failed ? 2 : 0;
        const char *refused = run.err_first[ERR_HTTP_4XX];
        if (s.failed)
            fprintf(stderr, "kvq: %d of %d requests failed%s\n", s.failed, o.requests,
                    o.ignore_eos && (strstr(refused, "ignore_eos") || strstr(refused, "min_tokens"))
                        ? " (the server refuses ignore_eos/min_tokens: try --no-ignore-eos)"
                        : "");
    }
out:
    if (run.res)
        for (int i = 0; i < o.requests; i++) free(run.res[i].gaps);
    if (bodies)
        for (int i = 0; i < o.requests; i++) free(bodies[i]);
    free(bodies);
    free(run.res);
    free(th);
    http_target_free(&target);
    return rc;
}
