/* The gemma3 path against Hugging Face transformers on tinygemma3 (5 sliding layers
 * of window 512, then 1 global): logits and greedy continuations of four prompts; a
 * 1124-token prompt longer than the window (argmax at every position, logits of the
 * last 16) through the rotating caches of the sliding layers, in big and odd-sized
 * batches; and a save/load round trip of a sequence whose layers have different
 * cache kinds. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "kvq.h"
#include "refs.h"

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static struct kvq_context *new_ctx(struct kvq_model *m, int n_batch, int kv_bits) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 2048;
    cp.n_batch = n_batch;
    cp.n_threads = 2;
    cp.kv.k_bits = cp.kv.v_bits = kv_bits;
    struct kvq_context *ctx = kvq_context_new(m, &cp);
    CHECK(ctx != NULL, "context: %s", kvq_last_error());
    return ctx;
}

static void check_prompts(struct kvq_model *m, int n_vocab) {
    struct ref_prompt refs[REFS_PROMPTS];
    refs_load_dir("tinygemma3", refs);
    for (int i = 0; i < REFS_PROMPTS; i++) {
        const struct ref_prompt *r = &refs[i];
        struct kvq_context *ctx = new_ctx(m, 512, 16);
        if (!ctx) return;
        char label[32];
        snprintf(label, sizeof label, "prompt %d", i);
        if (refs_check_logits(ctx, r, n_vocab, label) != 0) {
            kvq_context_free(ctx);
            continue;
        }
        /* greedy continuation, one token per decode call */
        int n = 0;
        int32_t t = argmax(kvq_get_logits(ctx, r->n_ids - 1), n_vocab);
        while (n < r->n_next && t == r->next[n]) {
            n++;
            if (kvq_token_is_eog(m, t) || n == r->n_next) break;
            struct kvq_batch b = {.n_tokens = 1, .tokens = &t};
            if (kvq_decode(ctx, &b) != 0) break;
            t = argmax(kvq_get_logits(ctx, 0), n_vocab);
        }
        printf("prompt %d: greedy continuation matches HF for %d/%d tokens\n", i, n, r->n_next);
        CHECK(n == r->n_next, "prompt %d: greedy continuation diverges at token %d", i, n);
        kvq_context_free(ctx);
    }
}

/* Runs the long prompt in batches of n_batch with logits everywhere; checks the
 * argmax at every position and the last positions' logits. Leaves the sequence. */
static void check_long(struct kvq_context *ctx, const struct ref_long *r, const float *want, int n_vocab,
                       const char *what, double min_agree, double max_dlogit) {
    bool *all = malloc(sizeof(bool) * (size_t)r->n_ids);
    for (int t = 0; t < r->n_ids; t++) all[t] = true;
    struct kvq_batch b = {.n_tokens = r->n_ids, .tokens = r->ids, .logits = all};
    CHECK(kvq_decode(ctx, &b) == 0, "%s: decode: %s", what, kvq_last_error());
    int same = 0;
    double max_err = 0;
    for (int t = 0; t < r->n_ids; t++) {
        const float *got = kvq_get_logits(ctx, t);
        if (!got) break;
        same += argmax(got, n_vocab) == r->argmax[t];
        int row = t - (r->n_ids - r->n_logits);
        for (int v = 0; row >= 0 && want && v < n_vocab; v++)
            max_err = fmax(max_err, fabs(got[v] - want[(size_t)row * n_vocab + v]));
    }
    double agree = (double)same / r->n_ids;
    printf("long prompt (%s): argmax agrees at %d/%d positions, last %d positions max |logit - HF| = %.2e\n", what,
           same, r->n_ids, r->n_logits, max_err);
    CHECK(agree >= min_agree, "%s: argmax agrees at only %.2f%% of positions", what, 100 * agree);
    CHECK(max_err < max_dlogit, "%s: last logits differ from HF by %g", what, max_err);
    free(all);
}

/* A sequence whose sliding layers are quantized-rotating and global layer quantized
 * survives a save/load: the next token's logits are identical. */
static void check_round_trip(struct kvq_model *m, const struct ref_long *r, int n_vocab) {
    struct kvq_context *a = new_ctx(m, 256, 4), *b = new_ctx(m, 256, 4);
    if (!a || !b) return;
    struct kvq_kv_layer_kind k[8];
    int n = 700; /* past the window: the rings have wrapped */
    struct kvq_batch batch = {.n_tokens = n, .tokens = r->ids};
    CHECK(kvq_decode(a, &batch) == 0, "decode: %s", kvq_last_error());
    /* the sliding layers still hold the blocks a query at n - 1 sees: one token comes off */
    CHECK(kvq_seq_trim(a, 0, 1) == 1 && kvq_seq_len(a, 0) == n - 1, "trim inside the window: %s", kvq_last_error());
    struct kvq_batch last = {.n_tokens = 1, .tokens = r->ids + n - 1};
    CHECK(kvq_decode(a, &last) == 0 && kvq_seq_len(a, 0) == n, "decode after trim: %s", kvq_last_error());
    int nk = kvq_kv_layer_kinds(a, k, 8);
    CHECK(nk == 2, "two layer kinds, got %d", nk);
    CHECK(nk == 2 && k[0].window == 512 && k[0].n_layers == 5 && !strcmp(k[0].kind, "quantized-rotating") &&
              k[0].max_size == 512,
          "sliding layers: %d x %s window %d max %d", k[0].n_layers, k[0].kind, k[0].window, k[0].max_size);
    CHECK(nk == 2 && k[1].window == 0 && k[1].n_layers == 1 && !strcmp(k[1].kind, "quantized") && k[1].max_size == 0,
          "global layer: %d x %s window %d", k[1].n_layers, k[1].kind, k[1].window);
    char path[64];
    snprintf(path, sizeof path, "/tmp/kvq_gemma3_%d.kvq", (int)getpid());
    CHECK(kvq_seq_save(a, 0, path) == 0, "save: %s", kvq_last_error());
    CHECK(kvq_seq_load(b, 0, path) == 0, "load: %s", kvq_last_error());
    CHECK(kvq_kv_bytes(a) == kvq_kv_bytes(b), "bytes after load %zu vs %zu", kvq_kv_bytes(b), kvq_kv_bytes(a));
    batch = (struct kvq_batch){.n_tokens = 1, .tokens = &r->ids[n]};
    CHECK(kvq_decode(a, &batch) == 0 && kvq_decode(b, &batch) == 0, "decode after load: %s", kvq_last_error());
    const float *la = kvq_get_logits(a, 0), *lb = kvq_get_logits(b, 0);
    CHECK(la && lb && memcmp(la, lb, sizeof(float) * (size_t)n_vocab) == 0, "logits differ after a round trip");
    /* a context with other per-layer settings refuses the file */
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_threads = 2;
    struct kvq_context *f16 = kvq_context_new(m, &cp);
    CHECK(f16 && kvq_seq_load(f16, 0, path) != 0 && strstr(kvq_last_error(), "KV cache config"),
          "f16 context loads a 4-bit file: %s", kvq_last_error());
    kvq_context_free(f16);
    remove(path);
    kvq_context_free(a);
    kvq_context_free(b);
}

int main(void) {
    const char *path = require_shared("models/tinygemma3-f16.gguf");
    struct kvq_model *m = kvq_model_load(path);
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return check_finish();
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    CHECK(!strcmp(info.arch, "gemma3") && info.head_dim == 256 && info.n_head_kv == 1, "info: %s head_dim %d",
          info.arch, info.head_dim);
    check_prompts(m, info.n_vocab);

    struct ref_long r;
    CHECK(refs_load_long("tinygemma3", &r) == 0 && r.n_ids > 1024 && r.n_argmax == r.n_ids && r.n_logits == 16,
          "long prompt refs: %d ids, %d argmax, %d logit rows", r.n_ids, r.n_argmax, r.n_logits);
    float *want = refs_long_logits(&r, info.n_vocab);
    CHECK(want != NULL, "long prompt logits");
    struct kvq_context *ctx = new_ctx(m, 512, 16);
    if (ctx) check_long(ctx, &r, want, info.n_vocab, "f16, batches of 512", 0.99, 1e-2);
    kvq_context_free(ctx);
    /* odd batches wrap the 512-token rings at every offset */
    ctx = new_ctx(m, 77, 16);
    if (ctx) check_long(ctx, &r, want, info.n_vocab, "f16, batches of 77", 0.99, 1e-2);
    kvq_context_free(ctx);
    /* 8-bit keys and values stay close (no HF reference for them: looser bounds) */
    ctx = new_ctx(m, 512, 8);
    if (ctx) check_long(ctx, &r, want, info.n_vocab, "8-bit KV", 0.97, 0.5);
    kvq_context_free(ctx);
    check_round_trip(m, &r, info.n_vocab);
    free(want);
    refs_long_free(&r);
    kvq_model_free(m);
    return check_finish();
}
