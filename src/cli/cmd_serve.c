/* kvq serve: an OpenAI-compatible HTTP server (src/server) over one context whose
 * sequences are batched together; this file only reads flags and wires it up. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "server/chat_template.h"
#include "server/http.h"
#include "server/prefix_cache.h"
#include "server/prefix_remote.h"
#include "server/scheduler.h"
#include "server/tool_calls.h"

static const char *const serve_help =
    "usage: kvq serve -m MODEL [options]\n"
    "\n"
    "Serves the model over HTTP with OpenAI's API: POST /v1/chat/completions and\n"
    "/v1/completions (\"stream\": true for Server-Sent Events), GET /v1/models, /health,\n"
    "/metrics (Prometheus); llama-server's POST /tokenize, /detokenize, /apply-template; and\n"
    "POST /v1/embeddings with --embeddings. Requests are batched together, one forward pass per step.\n"
    "\n"
    "  -m, --model FILE           GGUF model\n"
    "  --host ADDR                address to listen on (default 127.0.0.1)\n"
    "  --port N                   port (default 8080; 0: any free port, printed at start)\n"
    "  --max-num-seqs N           sequences decoded together (default 16; also --parallel, -np)\n"
    "  -c, --ctx-size N           tokens per sequence, prompt and answer (default: the model's)\n"
    "  -t, --threads N            threads (default: all cores)\n"
    "  --kv-budget-mb N           KV memory for all sequences and cached prefixes; requests wait\n"
    "                             when it is full (default: a full context per sequence plus the\n"
    "                             prefix cache)\n"
    "  -ctk, --cache-type-k T     llama.cpp's spelling of key bits: f16, f32, q8_0, q6_K, q5_0,\n"
    "  -ctv, --cache-type-v T     q5_1, q4_0, q4_1 (or a number of bits)\n"
    "  --prefix-cache-mb N        prefix cache size (default 256; 0: off)\n"
    "  --prefix-cache-host-mb N   entries evicted from the KV budget move to N MiB of host\n"
    "                             memory and come back from there on a hit (default 0: off)\n"
    "  --prefix-cache-dir DIR     keep prefix-cache entries in DIR and reload them at start\n"
    "  --prefix-cache-bits B      bits of cached entries (default 8; 16: the live format): a side\n"
    "                             cached with more bits than this is re-encoded on store and\n"
    "                             back on attach (groups: --kv-group-size)\n"
    "  --prefix-cache-min-tokens N  shorter entries keep the live format, sharing the\n"
    "                             sequence's blocks (default 256)\n"
    "  --prefix-cache-remote URL  share prefix-cache entries with other replicas through a Redis\n"
    "                             or Valkey store: redis://[USER@]HOST[:PORT][/DB] or\n"
    "                             unix:///PATH[?db=DB]\n"
    "  --prefix-cache-remote-auth FILE  the store's password, the file's first line (default:\n"
    "                             $KVQ_PREFIX_CACHE_REMOTE_AUTH)\n"
    "  --prefix-cache-remote-ttl S  the stored blocks' time to live (default 86400)\n"
    "  --api-key KEY              require 'Authorization: Bearer KEY' (also $KVQ_API_KEY)\n"
    "  --chat-template NAME|FILE  a Jinja chat template file, or a built-in one: chatml, llama2,\n"
    "                             llama3, mistral, gemma, phi3, zephyr (default: the model's\n"
    "                             tokenizer.chat_template, ChatML when it has none)\n"
    "  --alias NAME               the model name /v1/models reports (default: the file's name)\n"
    "  --max-queue N              requests waiting beyond the running ones, then 503 (default 256)\n"
    "  --prefill-chunk N          prompt tokens per sequence per step (default 256)\n"
    "  --step-tokens N            tokens per step, decode and prefill together (default 512 on\n"
    "                             the CPU, 2048 with --device cuda)\n"
    "  --max-body-mb N            request body limit (default 8)\n"
    "  --ping-interval S          ': ping' comment on a stream idle S seconds (default 10)\n"
    "  --embeddings               serve POST /v1/embeddings (a context of one sequence of its own)\n"
    "  --pooling mean|last        how embeddings pool the final hidden states (default mean)\n"
    "  --strict-api               refuse (400) request fields beyond OpenAI's instead of ignoring\n"
    "                             them (vLLM's and llama.cpp's extensions, unknown names)\n"
    "  --timeout S                close a connection after S seconds with nothing read or\n"
    "                             written, generation time not counted (default 600; 0: never)\n"
    "  --max-connections N        open connections at most; more are refused (default 4096)\n"
    "  --max-connections-per-ip N open connections from one address at most (default: a\n"
    "                             quarter of --max-connections; 0: no cap of its own)\n"
    "  --shutdown-timeout S       on SIGTERM/SIGINT stop accepting and let running requests\n"
    "                             finish for up to S seconds; the rest end with an error\n"
    "                             event (default 10)\n"
    "  -h, --help                 this text\n";

struct serve_opts {
    const char *model, *host, *api_key, *chat_template, *alias, *cache_dir, *remote, *remote_auth;
    int port, cache_mb, cache_host_mb, cache_bits, cache_min_tokens, remote_ttl, max_body_mb, ping;
    bool strict_api, embeddings;
    enum kvq_pooling pooling;
    int timeout, max_conns, max_conns_per_ip, shutdown_timeout;
    struct kvq_context_params cp;
    struct sched_params sp;
};

/* llama.cpp's cache type names to bits. */
static bool cache_type_bits(const char *flag, const char *v, void *out) {
    int *bits = out;
    static const struct {
        const char *name;
        int bits;
    } types[] = {{"f16", 16}, {"bf16", 16}, {"f32", 32}, {"q8_0", 8}, {"q6_K", 6}, {"q5_0", 5},
                 {"q5_1", 5}, {"q4_0", 4},  {"q4_1", 4}, {"iq4_nl", 4}, {"q3_K", 3}, {"q2_K", 2}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(v, types[i].name)) return *bits = types[i].bits, true;
    int b;
    if (!cli_parse_int(flag, v, 2, 32, &b)) return false;
    if (b != 2 && b != 3 && b != 4 && b != 5 && b != 6 && b != 8 && b != 16 && b != 32) {
        cli_fail("invalid value '%s' for %s: expected f16, f32, q8_0, q6_K, q5_0, q4_0, ... or bits", v, flag);
        return false;
    }
    *bits = b;
    return true;
}

static bool parse_pooling(const char *flag, const char *v, void *out) {
    (void)flag;
    if (strcmp(v, "mean") && strcmp(v, "last")) return cli_fail("--pooling must be mean or last (got '%s')", v), false;
    *(enum kvq_pooling *)out = strcmp(v, "mean") ? KVQ_POOLING_LAST : KVQ_POOLING_MEAN;
    return true;
}

static int parse_args(int argc, char **argv, struct serve_opts *o) {
    kvq_context_params_default(&o->cp);
    o->host = "127.0.0.1";
    o->port = 8080;
    o->cache_mb = 256;
    o->cache_bits = 8;
    o->cache_min_tokens = 256;
    o->remote_ttl = 86400;
    o->max_body_mb = 8;
    o->ping = 10;
    o->timeout = 600; /* llama-server's */
    o->max_conns = 4096;
    o->max_conns_per_ip = -1;
    o->shutdown_timeout = 10;
    o->api_key = getenv("KVQ_API_KEY");
    o->sp = (struct sched_params){.max_seqs = 16, .max_queue = 256, .prefill_chunk = 256};
    const struct cli_opt opts[] = {
        CLI_FLAG(&o->strict_api, "--strict-api"),
        CLI_FLAG(&o->embeddings, "--embeddings"),
        CLI_STR(&o->model, "-m", "--model"),
        CLI_STR(&o->host, "--host"),
        CLI_STR(&o->api_key, "--api-key"),
        CLI_STR(&o->chat_template, "--chat-template"),
        CLI_STR(&o->alias, "--alias"),
        CLI_STR(&o->cache_dir, "--prefix-cache-dir"),
        CLI_STR(&o->remote, "--prefix-cache-remote"),
        CLI_STR(&o->remote_auth, "--prefix-cache-remote-auth"),
        CLI_INT(&o->remote_ttl, 1, 1 << 30, "--prefix-cache-remote-ttl"),
        CLI_FN(parse_pooling, &o->pooling, "--pooling"),
        CLI_INT(&o->port, 0, 65535, "--port"),
        CLI_INT(&o->sp.max_seqs, 1, 1024, "--max-num-seqs", "--parallel", "-np"),
        CLI_INT(&o->cp.n_ctx, 0, 1 << 24, "-c", "--ctx-size"),
        CLI_INT(&o->cp.n_threads, 1, 1024, "-t", "--threads"),
        CLI_FN(cache_type_bits, &o->cp.kv.k_bits, "-ctk", "--cache-type-k"),
        CLI_FN(cache_type_bits, &o->cp.kv.v_bits, "-ctv", "--cache-type-v"),
        CLI_INT(&o->cache_mb, 0, 1 << 24, "--prefix-cache-mb"),
        CLI_INT(&o->cache_host_mb, 0, 1 << 24, "--prefix-cache-host-mb"),
        CLI_FN(cache_type_bits, &o->cache_bits, "--prefix-cache-bits"),
        CLI_INT(&o->cache_min_tokens, 0, INT_MAX, "--prefix-cache-min-tokens"),
        CLI_INT(&o->sp.max_queue, 0, 1 << 20, "--max-queue"),
        CLI_INT(&o->sp.prefill_chunk, 1, 1 << 16, "--prefill-chunk"),
        CLI_INT(&o->sp.step_tokens, 1, 1 << 16, "--step-tokens"),
        CLI_INT(&o->max_body_mb, 1, 1 << 12, "--max-body-mb"),
        CLI_INT(&o->ping, 1, 3600, "--ping-interval"),
        CLI_INT(&o->timeout, 0, 86400, "--timeout"),
        CLI_INT(&o->max_conns, 1, 1 << 20, "--max-connections"),
        CLI_INT(&o->max_conns_per_ip, 0, 1 << 20, "--max-connections-per-ip"),
        CLI_INT(&o->shutdown_timeout, 0, 86400, "--shutdown-timeout"),
        CLI_END,
    };
    if (cli_parse_args(argc, argv, "serve", opts, &o->cp, NULL, serve_help, cli_kv_flags_help)) return 1;
    if (!o->model) return cli_fail("serve needs a model: -m FILE");
    if (o->api_key && !*o->api_key) return cli_fail("--api-key must not be empty");
    if (o->remote && o->cache_mb == 0) return cli_fail("--prefix-cache-remote needs the prefix cache (--prefix-cache-mb > 0)");
    if (o->cache_host_mb > 0 && o->cache_mb == 0)
        return cli_fail("--prefix-cache-host-mb needs the prefix cache (--prefix-cache-mb > 0)");
    if (!cli_kv_config_check(&o->cp.kv)) return 1;
    /* a GPU's products run near their best from ~2,000 tokens a pass; a CPU's step
     * time grows with its tokens, so it keeps steps short for the running streams */
    if (o->sp.step_tokens == 0) o->sp.step_tokens = o->cp.device == KVQ_DEVICE_CUDA ? 2048 : 512;
    if (o->sp.prefill_chunk > o->sp.step_tokens) o->sp.prefill_chunk = o->sp.step_tokens;
    if (o->max_conns_per_ip < 0) o->max_conns_per_ip = (o->max_conns + 3) / 4;
    return 0;
}

/* --prefix-cache-dir: made when missing, as mkdir -p would; anything else that is
 * not a writable folder stops the start. */
static bool cache_dir_ready(const char *dir) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s", dir) >= (int)sizeof path) {
        cli_fail("--prefix-cache-dir: the path is too long");
        return false;
    }
    for (char *p = path + 1;; p++) {
        bool end = *p == '\0';
        if (end || *p == '/') {
            *p = '\0';
            if (mkdir(path, 0777) != 0 && errno != EEXIST) {
                cli_fail("--prefix-cache-dir '%s': cannot create '%s': %s", dir, path, strerror(errno));
                return false;
            }
            if (end) break;
            *p = '/';
        }
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        cli_fail("--prefix-cache-dir '%s' is not a folder", dir);
        return false;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        cli_fail("--prefix-cache-dir '%s' is not writable: %s", dir, strerror(errno));
        return false;
    }
    return true;
}

/* Each connection holds a descriptor: the soft limit goes up to the hard one, and the
 * connection cap down to what fits under it. */
static void fit_connections(struct serve_opts *o) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    const rlim_t spare = 64; /* the model, prefix-cache files, logs */
    if (rl.rlim_cur != RLIM_INFINITY && (rlim_t)o->max_conns + spare > rl.rlim_cur) {
        int fit = rl.rlim_cur > spare + 1 ? (int)(rl.rlim_cur - spare) : 1;
        fprintf(stderr, "kvq serve: warning: the open-file limit is %llu: at most %d connections\n",
                (unsigned long long)rl.rlim_cur, fit);
        o->max_conns = fit;
    }
}

/* A metadata string of the model (malloc'd), or NULL when absent. */
static char *meta_str(const struct kvq_model *m, const char *key) {
    int n = kvq_model_meta_str(m, key, NULL, 0);
    char *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (text) kvq_model_meta_str(m, key, text, (size_t)n + 1);
    return text;
}

/* The text of a special token ("" when the model has none), malloc'd. */
static char *token_text(const struct kvq_model *m, kvq_token t) {
    char buf[256];
    int n = t >= 0 ? kvq_token_bytes(m, t, buf, (int)sizeof buf - 1) : 0;
    if (n < 0 || n >= (int)sizeof buf) n = 0;
    buf[n] = 0;
    return strdup(buf);
}

/* The chat template: a built-in one by name, a Jinja file, or the model's own
 * (tokenizer.chat_template, with tokenizer.chat_template.tool_use for requests with
 * tools); ChatML when the model has none. And the syntax its tool calls take, read
 * from its text (the tool_use variant's when there is one). */
static struct chat_template *pick_template(const struct kvq_model *m, const char *choice, char *desc, size_t desc_size,
                                           enum tool_syntax *tools) {
    char *text = NULL, *tool_use = NULL;
    const char *builtin = choice ? chat_template_builtin(choice) : NULL;
    if (choice && !builtin && !(text = cli_read_file(choice, NULL))) {
        cli_fail("--chat-template '%s' is neither a built-in template (%s) nor a readable file", choice,
                 chat_template_builtin_names);
        return NULL;
    }
    if (builtin) snprintf(desc, desc_size, "built-in %s", choice);
    else if (choice) snprintf(desc, desc_size, "%.200s", choice);
    if (!choice) {
        snprintf(desc, desc_size, "the model's");
        text = meta_str(m, "tokenizer.chat_template");
        tool_use = meta_str(m, "tokenizer.chat_template.tool_use");
        if (!text) {
            fprintf(stderr, "kvq serve: warning: the model has no chat template; using ChatML (--chat-template "
                            "picks another)\n");
            builtin = chat_template_builtin("chatml");
            snprintf(desc, desc_size, "built-in chatml");
        } else if (tool_use)
            snprintf(desc, desc_size, "the model's (and its tool_use variant)");
    }
    /* the tokenizer adds BOS as the model's metadata says: a template's own BOS text is then dropped */
    kvq_token probe[4];
    bool adds_bos = kvq_tokenize(m, "", 0, true, false, probe, 4) >= 1 && probe[0] == kvq_token_bos(m);
    struct chat_template_params p = {.text = builtin ? builtin : text, .tool_use_text = tool_use,
                                     .bos = token_text(m, kvq_token_bos(m)), .eos = token_text(m, kvq_token_eos(m)),
                                     .strip_bos = adds_bos};
    *tools = tool_syntax_detect(tool_use ? tool_use : p.text);
    char err[320];
    struct chat_template *t = p.bos && p.eos ? chat_template_new(&p, err, sizeof err) : NULL;
    if (!t) cli_fail("%s%s", p.bos && p.eos ? err : "out of memory", choice ? "" : " (--chat-template picks another)");
    free((char *)p.bos);
    free((char *)p.eos);
    free(text);
    free(tool_use);
    return t;
}

/* The remote tier's needs of this model and config: every position kept (its values
 * are blocks of positions) and a bound on a block's bytes. */
static int prefix_remote_ready(struct prefix_remote *remote, const struct kvq_context *ctx, const struct kvq_model *m,
                               const struct kvq_kv_config *store_kv) {
    struct kvq_kv_layer_kind kinds[8];
    int n = kvq_kv_layer_kinds(ctx, kinds, 8);
    for (int i = 0; i < n && i < 8; i++)
        if (kinds[i].max_size > 0)
            return cli_fail("--prefix-cache-remote needs every position kept: this model's sliding-window layers "
                            "keep only their window (add --swa-full) or --kv-max-size is set");
    struct kvq_kv_config f32 = *store_kv;
    f32.k_bits = f32.v_bits = 32;
    f32.n_layer_bits = 0;
    /* the rows, the offsets (a token of f32 rows), tokens and headers */
    prefix_remote_set_max_value(remote, KVQ_BLOCK_TOKENS * kvq_kv_token_bytes(m, store_kv) +
                                            kvq_kv_token_bytes(m, &f32) + (64 << 10));
    return 0;
}

int cmd_serve(int argc, char **argv) {
    struct serve_opts o = {0};
    if (parse_args(argc, argv, &o) != 0) return 1;
    if (o.cache_dir && o.cache_mb > 0 && !cache_dir_ready(o.cache_dir)) return 1;
    char err[512] = "";
    struct prefix_remote_params rp = {.url = o.remote, .auth_file = o.remote_auth, .ttl_s = o.remote_ttl};
    struct prefix_remote *remote = o.remote ? prefix_remote_new(&rp, err, sizeof err) : NULL;
    if (o.remote && !remote) return cli_fail("%s", err);
    fit_connections(&o);
    struct kvq_model *m = cli_load_model(o.model, NULL);
    if (!m) {
        prefix_remote_free(remote);
        return 1;
    }
    int rc = 1;
    struct kvq_context *ctx = NULL;
    struct prefix_cache *pc = NULL;
    struct sched *s = NULL;
    struct http_server *h = NULL;
    struct embedder *em = NULL;
    enum tool_syntax tool_syntax;
    char chat_desc[256];
    struct chat_template *chat = pick_template(m, o.chat_template, chat_desc, sizeof chat_desc, &tool_syntax);
    if (!chat) {
        kvq_model_free(m);
        prefix_remote_free(remote);
        return 1;
    }

    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    o.cp.n_seq = o.sp.max_seqs;
    o.cp.n_batch = o.sp.step_tokens + o.sp.max_seqs; /* a step is never split into several passes */
    o.cp.max_logit_rows = o.sp.max_seqs;             /* it asks for a row of logits a sequence at most */
    int n_ctx = o.cp.n_ctx ? o.cp.n_ctx : info.n_ctx_train;
    size_t cache_bytes = (size_t)o.cache_mb << 20;
    if (!o.cp.kv_budget_bytes) /* --kv-budget-mb: none; a full context per sequence, and room for the prefix cache on top */
        o.cp.kv_budget_bytes = (kvq_kv_token_bytes(m, &o.cp.kv) * (((size_t)n_ctx + 63) / 64 * 64) +
                                kvq_kv_window_bytes(m, &o.cp.kv)) * (size_t)o.sp.max_seqs + cache_bytes;
    /* SIGINT and SIGTERM go to the main thread only (sigwait below): blocked before the
     * first thread is made (the context's pool, the prefix cache's writer, the
     * scheduler), which inherit the mask; blocked after, a signal between the log's
     * "listening" and sigwait could go to a thread that takes the default action (the
     * process killed, status 143). One that comes before sigwait waits for it. SIGPIPE
     * nowhere. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    ctx = kvq_context_new(m, &o.cp);
    if (!ctx) {
        cli_fail("%s", kvq_last_error());
        goto done;
    }
    if (o.cache_mb > 0) {
        /* each side is cached with at most --prefix-cache-bits (never more than it lives with) */
        struct kvq_kv_config store_kv = o.cp.kv;
        int kept = 0; /* per-layer ranges capped too; those left as the rest are dropped */
        for (int i = -1; i < store_kv.n_layer_bits; i++) {
            int *k = i < 0 ? &store_kv.k_bits : &store_kv.layer_bits[i].k_bits;
            int *v = i < 0 ? &store_kv.v_bits : &store_kv.layer_bits[i].v_bits;
            if (o.cache_bits < *k) *k = o.cache_bits;
            if (o.cache_bits < *v) *v = o.cache_bits;
            if (i >= 0 && (*k != store_kv.k_bits || *v != store_kv.v_bits)) store_kv.layer_bits[kept++] = store_kv.layer_bits[i];
        }
        store_kv.n_layer_bits = kept;
        struct prefix_cache_params pp = {.kv = &o.cp.kv, .store_kv = &store_kv, .min_tokens = o.cache_min_tokens,
                                         .budget = cache_bytes, .host_budget = (size_t)o.cache_host_mb << 20,
                                         .dir = o.cache_dir, .remote = remote};
        if (!kvq_kv_same_format(&store_kv, &o.cp.kv)) {
            /* two lines: cli_kv_config_name returns one static buffer */
            fprintf(stderr, "kvq serve: prefix cache: entries of %d tokens or more are stored as %s", o.cache_min_tokens,
                    cli_kv_config_name(&store_kv));
            fprintf(stderr, " (live: %s)\n", cli_kv_config_name(&o.cp.kv));
        }
        if (remote && prefix_remote_ready(remote, ctx, m, &store_kv) != 0) goto done;
        pc = prefix_cache_new(ctx, m, &pp);
        if (!pc) {
            cli_fail("out of memory");
            goto done;
        }
    }
    if (o.embeddings && !(em = embedder_new(m, kvq_context_n_ctx(ctx), o.cp.n_threads, o.pooling))) {
        cli_fail("--embeddings: %s", kvq_last_error());
        goto done;
    }
    o.sp.kv = o.cp.kv;
    s = sched_start(m, ctx, pc, &o.sp);
    if (!s) {
        cli_fail("cannot start the scheduler");
        goto done;
    }
    const char *base = strrchr(o.model, '/') ? strrchr(o.model, '/') + 1 : o.model;
    char model_id[256];
    snprintf(model_id, sizeof model_id, "%s", o.alias ? o.alias : base);
    char *dot = o.alias ? NULL : strstr(model_id, ".gguf");
    if (dot && dot[5] == '\0') *dot = '\0';
    struct http_params hp = {.host = o.host, .port = o.port, .api_key = o.api_key,
                             .max_body = (size_t)o.max_body_mb << 20, .model_id = model_id, .ping_seconds = o.ping,
                             .strict_api = o.strict_api, .timeout_s = o.timeout, .max_connections = o.max_conns,
                             .max_connections_per_ip = o.max_conns_per_ip, .model = m, .chat = chat,
                             .tool_syntax = tool_syntax, .sched = s, .embedder = em, .remote = remote};
    h = http_start(&hp);
    if (!h) goto done;
    fprintf(stderr,
            "kvq serve: model %s (%s), KV %s, %d sequences of %d tokens, KV budget %.1f MiB, prefix cache %d MiB, "
            "chat template %s, tool calls %s\n",
            model_id, info.weight_type, cli_kv_config_name(&o.cp.kv), o.sp.max_seqs, kvq_context_n_ctx(ctx),
            kvq_kv_budget(ctx) / 1048576.0, o.cache_mb, chat_desc, tool_syntax_name(tool_syntax));
    fprintf(stderr, "kvq serve: listening on http://%s:%d\n", o.host, http_port(h));
    int sig;
    sigwait(&sigs, &sig);
    fprintf(stderr, "kvq serve: stopping (signal %d): no new requests; running ones have %d s to finish\n", sig,
            o.shutdown_timeout);
    int left = http_drain(h, o.shutdown_timeout);
    if (left) fprintf(stderr, "kvq serve: %d requests cut short\n", left);
    rc = 0;
done:
    sched_stop(s); /* what still runs ends with an error: an error event and [DONE] on a stream */
    if (h) http_drain(h, 2); /* ...which its connection thread then sends */
    http_stop(h);
    sched_free(s);
    prefix_cache_free(pc);
    prefix_remote_free(remote);
    embedder_free(em);
    kvq_context_free(ctx);
    kvq_model_free(m);
    chat_template_free(chat);
    return rc;
}
