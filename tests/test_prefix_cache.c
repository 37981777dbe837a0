/* kvq serve's prefix cache on tinydoc: a fetch attaches the longest common prefix
 * among the entries (token by token: a prompt that diverges mid-entry gets only the
 * shared part, and the logits after it equal a fresh prefill); namespaces keep
 * entries apart; longer entries replace the prefixes they cover; the byte budget
 * evicts the least recently used (to host memory, where there is a host budget, and
 * back on a hit); a folder round trip reloads entries and skips a corrupt file; every
 * block goes back once the cache is freed. */
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "kvq.h"
#include "server/prefix_cache.h"

static struct kvq_model *model;
static int V;

static void prefill(struct kvq_context *c, int seq, const kvq_token *t, int n) {
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    for (int i = 0; i < n; i++) ids[i] = seq;
    struct kvq_batch b = {.n_tokens = n, .tokens = t, .seq_ids = ids};
    CHECK(kvq_decode(c, &b) == 0, "decode: %s", kvq_last_error());
    free(ids);
}

/* The logits after feeding t[from..n) to seq (which holds t[0..from)). */
static float *finish(struct kvq_context *c, int seq, const kvq_token *t, int from, int n) {
    prefill(c, seq, t + from, n - from);
    float *l = malloc(sizeof *l * (size_t)V);
    memcpy(l, kvq_get_logits(c, n - from - 1), sizeof *l * (size_t)V);
    return l;
}

/* The largest logit difference between seq 1 after a hit of `got` tokens of t (then fed
 * the rest) and a fresh prefill of t; seq 1 is left empty. */
static double hit_vs_fresh(struct kvq_context *c, const kvq_token *t, int got, int n) {
    float *hit = finish(c, 1, t, got, n);
    kvq_seq_clear(c, 1);
    float *fresh = finish(c, 1, t, 0, n);
    kvq_seq_clear(c, 1);
    double d = 0;
    for (int i = 0; i < V; i++) d = fmax(d, fabs((double)hit[i] - fresh[i]));
    free(hit);
    free(fresh);
    return d;
}

/* A sequence of t's first n tokens, finished and stored (seq 0, left empty). */
static void store_finished(struct prefix_cache *pc, struct kvq_context *c, const kvq_token *t, int n) {
    prefill(c, 0, t, n);
    prefix_cache_store(pc, 0, NULL, t, n, true, 0);
    kvq_seq_clear(c, 0);
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *de; d && (de = readdir(d));) n += strstr(de->d_name, ".kvq") != NULL;
    if (d) closedir(d);
    return n;
}

int main(void) {
    const char *path = require_shared("models/tinydoc-q8_0.gguf");
    model = kvq_model_load(path);
    CHECK(model != NULL, "load: %s", kvq_last_error());
    if (!model) return check_finish();
    struct kvq_model_info info;
    kvq_model_get_info(model, &info);
    V = info.n_vocab;
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 1024;
    cp.n_seq = 2;
    cp.n_threads = 2;
    struct kvq_context *c = kvq_context_new(model, &cp);
    CHECK(c != NULL, "context: %s", kvq_last_error());
    if (!c) return check_finish();

    /* token ids from a fixed pseudo-random walk over the vocabulary (content does not matter) */
    enum { N = 300 };
    kvq_token a[N], b[N];
    uint32_t x = 12345;
    for (int i = 0; i < N; i++) a[i] = b[i] = (kvq_token)((x = x * 1103515245u + 12345u) >> 8) % (V - 3) + 3;
    for (int i = 200; i < N; i++) b[i] = (a[i] + 1) % (V - 3) + 3; /* b diverges from a at 200 */

    struct prefix_cache_params pp = {.kv = &cp.kv, .budget = (size_t)64 << 20};
    struct prefix_cache *pc = prefix_cache_new(c, model, &pp);
    CHECK(prefix_cache_fetch(pc, 0, NULL, a, N - 1) == 0, "empty cache misses");
    store_finished(pc, c, a, 250);

    /* b shares 200 tokens with the entry: exactly those are attached */
    int got = prefix_cache_fetch(pc, 1, NULL, b, N - 1);
    CHECK(got == 200 && kvq_seq_len(c, 1) == 200, "longest common prefix: %d", got);
    double d = hit_vs_fresh(c, b, got, N);
    CHECK(d == 0, "logits after a hit equal a fresh prefill (max diff %g)", d);

    CHECK(prefix_cache_fetch(pc, 1, "tenant", b, N - 1) == 0 && kvq_seq_len(c, 1) == 0, "other namespace misses");
    CHECK(prefix_cache_fetch(pc, 1, NULL, a, 100) == 100, "max_use bounds the hit");
    kvq_seq_clear(c, 1);

    /* a longer sequence replaces the entry it extends */
    int entries;
    size_t bytes;
    store_finished(pc, c, a, N);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 1, "the longer entry replaced the shorter: %d entries", entries);
    CHECK(prefix_cache_fetch(pc, 1, NULL, a, N - 1) == N - 1, "hit on the longer entry");
    kvq_seq_clear(c, 1);
    prefix_cache_free(pc);
    CHECK(kvq_kv_blocks(c) == 0, "blocks back after free: %lld", (long long)kvq_kv_blocks(c));

    /* the budget holds one entry of 300 tokens: storing a second evicts the older */
    size_t one = kvq_kv_token_bytes(model, &cp.kv) * 320 + kvq_kv_window_bytes(model, &cp.kv);
    char dir[] = "/tmp/kvq_pc_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    pp = (struct prefix_cache_params){.kv = &cp.kv, .budget = one + one / 2, .dir = dir};
    pc = prefix_cache_new(c, model, &pp);
    store_finished(pc, c, a, N);
    store_finished(pc, c, b, N);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 1 && bytes <= one + one / 2, "LRU eviction: %d entries, %zu bytes", entries, bytes);
    CHECK(prefix_cache_fetch(pc, 1, NULL, b, N - 1) == N - 1, "the newer entry stays");
    kvq_seq_clear(c, 1);
    CHECK(prefix_cache_fetch(pc, 1, NULL, a, N - 1) == 200, "the older one was evicted (only b's 200 shared)");
    kvq_seq_clear(c, 1);
    prefix_cache_free(pc);

    /* reload from the folder, with a corrupt file beside the entry */
    char junk[64];
    snprintf(junk, sizeof junk, "%s/0000000000000000-00000000000000ff.kvq", dir);
    FILE *f = fopen(junk, "wb");
    if (f) {
        fputs("not a cache file", f);
        fclose(f);
    }
    pc = prefix_cache_new(c, model, &pp);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 1, "one entry reloaded, the corrupt file skipped: %d", entries);
    got = prefix_cache_fetch(pc, 1, NULL, b, N - 1);
    CHECK(got == N - 1, "hit from the reloaded entry: %d", got);
    d = hit_vs_fresh(c, b, got, N);
    CHECK(d == 0, "logits after a disk hit equal a fresh prefill (max diff %g)", d);
    prefix_cache_free(pc);
    CHECK(kvq_kv_blocks(c) == 0, "blocks back after free: %lld", (long long)kvq_kv_blocks(c));

    /* with a host budget the evicted entry moves to host memory, and a fetch that it
     * covers further than the entries in the KV budget attaches it from there, giving a
     * fresh prefill's logits; where the host budget is too small, nothing is kept */
    for (int room = 0; room < 2; room++) {
        pp = (struct prefix_cache_params){.kv = &cp.kv, .budget = one + one / 2, .host_budget = room ? 64 << 20 : 4096};
        pc = prefix_cache_new(c, model, &pp);
        store_finished(pc, c, a, N);
        store_finished(pc, c, b, N);
        got = prefix_cache_fetch(pc, 1, NULL, a, N - 1);
        struct prefix_cache_stats hs;
        prefix_cache_stats(pc, &hs);
        CHECK(got == (room ? N - 1 : 200) && hs.host_stores == 2 * room && hs.host_hits == room, /* a out, then b for a */
              "host budget %zu: fetch took %d tokens (%d stored, %d hits)", pp.host_budget, got, hs.host_stores, hs.host_hits);
        d = hit_vs_fresh(c, a, got, N);
        CHECK(d == 0, "logits after a host-memory hit equal a fresh prefill (max diff %g)", d);
        /* b went to host memory for a's room, and comes back in turn */
        CHECK(!room || prefix_cache_fetch(pc, 1, NULL, b, N - 1) == N - 1, "the other entry comes back too");
        kvq_seq_clear(c, 1);
        prefix_cache_free(pc);
        CHECK(kvq_kv_blocks(c) == 0, "blocks back after free: %lld", (long long)kvq_kv_blocks(c));
    }
    char cmd0[128];

    /* entries of >= 256 tokens stored in 8 bits (live: f16): a copy of about half the
     * bytes, converted back on attach; the logits after a hit stay close to a fresh
     * prefill's; shorter entries share the live blocks; the folder keeps the format */
    snprintf(cmd0, sizeof cmd0, "rm -f %s/*.kvq", dir);
    CHECK(system(cmd0) == 0, "empty the folder");
    struct kvq_kv_config q8 = cp.kv;
    q8.k_bits = q8.v_bits = 8;
    size_t live_bytes = kvq_kv_token_bytes(model, &cp.kv) * 320 + kvq_kv_window_bytes(model, &cp.kv);
    size_t q8_bytes = kvq_kv_token_bytes(model, &q8) * 320 + kvq_kv_window_bytes(model, &q8);
    pp = (struct prefix_cache_params){.kv = &cp.kv, .store_kv = &q8, .min_tokens = 256, .budget = (size_t)64 << 20,
                                      .dir = dir};
    pc = prefix_cache_new(c, model, &pp);
    prefill(c, 0, a, 100);
    prefix_cache_store(pc, 0, "short", a, 100, true, 0); /* under min_tokens: shares the live blocks */
    size_t before = kvq_kv_bytes(c);
    prefill(c, 0, a + 100, N - 100);
    prefix_cache_store(pc, 0, NULL, a, N, true, 0);
    /* held live (sharing the sequence's blocks) until the server is idle */
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 2 && bytes == live_bytes + kvq_kv_token_bytes(model, &cp.kv) * 128 &&
              kvq_kv_bytes(c) - before == kvq_kv_token_bytes(model, &cp.kv) * 256 && count_files(dir) <= 1,
          "a finished long entry waits live and unwritten (the short one: %d files): %zu bytes", count_files(dir), bytes);
    CHECK(prefix_cache_convert_one(pc) && !prefix_cache_convert_one(pc), "one entry converted when idle");
    size_t copy_bytes = kvq_kv_bytes(c) - before - (kvq_kv_token_bytes(model, &cp.kv) * 256); /* minus a's new blocks */
    kvq_seq_clear(c, 0);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 2 && bytes == q8_bytes + kvq_kv_token_bytes(model, &cp.kv) * 128, "usage %zu: 8-bit %zu + short", bytes,
          q8_bytes);
    /* per token 8 bits + a 4-byte scale/bias per 64 values against 16 bits; the f16
     * window (residual and sinks) comes on top */
    CHECK(kvq_kv_token_bytes(model, &q8) * 100 < kvq_kv_token_bytes(model, &cp.kv) * 54 && q8_bytes * 10 < live_bytes * 7,
          "8-bit entry %zu bytes vs live %zu", q8_bytes, live_bytes);
    CHECK(copy_bytes <= q8_bytes + (size_t)kvq_kv_token_bytes(model, &q8) * 64, "the converted copy took %zu bytes (estimate %zu)",
          copy_bytes, q8_bytes);
    got = prefix_cache_fetch(pc, 1, NULL, a, N - 1);
    CHECK(got == N - 1 && kvq_seq_len(c, 1) == N - 1, "hit on the converted entry: %d", got);
    float *hit = finish(c, 1, a, got, N);
    kvq_seq_clear(c, 1);
    float *fresh = finish(c, 1, a, 0, N);
    kvq_seq_clear(c, 1);
    d = 0;
    int am_hit = 0, am_fresh = 0;
    for (int i = 0; i < V; i++) {
        d = fmax(d, fabs((double)hit[i] - fresh[i]));
        if (hit[i] > hit[am_hit]) am_hit = i;
        if (fresh[i] > fresh[am_fresh]) am_fresh = i;
    }
    CHECK(d > 0 && d < 0.5 && am_hit == am_fresh, "8-bit hit: logits within %g of a fresh prefill, same argmax (%d %d)",
          d, am_hit, am_fresh);
    printf("8-bit prefix entry: max logit difference %.4f after a hit\n", d);
    CHECK(prefix_cache_fetch(pc, 1, "short", a, N - 1) == 100, "the short entry hits");
    kvq_seq_clear(c, 1);
    /* the hit made the entry hot: it now holds the live copy, and the next hit shares it */
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(bytes == live_bytes + kvq_kv_token_bytes(model, &cp.kv) * 128, "a hit entry turns live: %zu bytes", bytes);
    CHECK(prefix_cache_fetch(pc, 1, NULL, a, N - 1) == N - 1, "hit again");
    float *again = finish(c, 1, a, N - 1, N);
    kvq_seq_clear(c, 1);
    d = 0;
    for (int i = 0; i < V; i++) d = fmax(d, fabs((double)hit[i] - again[i]));
    CHECK(d == 0, "the live copy gives the first hit's logits (%g)", d);
    free(again);
    struct prefix_cache_stats pst;
    prefix_cache_stats(pc, &pst);
    CHECK(pst.converted_stores == 1 && pst.converted_fetches == 1 && pst.converted_tokens_stored == N,
          "conversion counted: %d stores, %d fetches", pst.converted_stores, pst.converted_fetches);
    printf("conversion f16 -> 8 bits on store: %.2f ms per 1000 tokens; back on attach: %.2f ms per 1000 tokens\n",
           pst.store_ms * 1000 / pst.converted_tokens_stored, pst.fetch_ms * 1000 / pst.converted_tokens_fetched);
    prefix_cache_free(pc); /* writes what is still queued */
    CHECK(kvq_kv_blocks(c) == 0, "blocks back after free: %lld", (long long)kvq_kv_blocks(c));
    pc = prefix_cache_new(c, model, &pp);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 2 && bytes == q8_bytes + kvq_kv_token_bytes(model, &cp.kv) * 128,
          "both entries reloaded in their formats: %d, %zu bytes", entries, bytes);
    /* a running sequence's entry (its prompt) stays live and shared, and is not written */
    size_t before_run = bytes;
    prefill(c, 0, b, N);
    prefix_cache_store(pc, 0, "run", b, N, false, 0);
    kvq_seq_clear(c, 0);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 3 && bytes - before_run == live_bytes, "a running entry in the live format: %zu bytes",
          bytes - before_run);
    CHECK(count_files(dir) == 2, "a running entry is not written: %d files", count_files(dir));
    got = prefix_cache_fetch(pc, 1, NULL, a, N - 1);
    float *disk = finish(c, 1, a, got, N);
    kvq_seq_clear(c, 1);
    d = 0;
    for (int i = 0; i < V; i++) d = fmax(d, fabs((double)hit[i] - disk[i]));
    CHECK(got == N - 1 && d == 0, "the reloaded 8-bit entry gives the same logits as before (%d, %g)", got, d);
    free(disk);
    free(hit);
    free(fresh);
    prefix_cache_free(pc);
    CHECK(kvq_kv_blocks(c) == 0, "blocks back after free: %lld", (long long)kvq_kv_blocks(c));

    /* a budget for one live and one 8-bit entry: storing the second converts the waiting
     * first instead of evicting it */
    pp = (struct prefix_cache_params){.kv = &cp.kv, .store_kv = &q8, .min_tokens = 256,
                                      .budget = live_bytes + q8_bytes + q8_bytes / 2};
    pc = prefix_cache_new(c, model, &pp);
    store_finished(pc, c, a, N);
    prefill(c, 0, b, N);
    prefix_cache_store(pc, 0, "b", b, N, true, 0);
    kvq_seq_clear(c, 0);
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 2 && bytes == live_bytes + q8_bytes, "the waiting entry converted to make room: %d entries, %zu bytes",
          entries, bytes);
    CHECK(prefix_cache_convert_one(pc) && !prefix_cache_convert_one(pc), "the second waits until idle");
    prefix_cache_usage(pc, &entries, &bytes);
    CHECK(entries == 2 && bytes == 2 * q8_bytes, "then both are 8-bit: %zu bytes", bytes);
    prefix_cache_free(pc);
    CHECK(kvq_kv_blocks(c) == 0, "blocks back after free: %lld", (long long)kvq_kv_blocks(c));

    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
    kvq_context_free(c);
    kvq_model_free(model);
    return check_finish();
}
