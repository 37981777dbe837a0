/* Quantized and rotating KV caches in the model (tinydoc, stories260K): greedy
 * generation for the seed's test plan, kv-bits 8 equal to Hugging Face's greedy
 * continuations, rotating windows, and saving/loading a sequence (the version-1
 * fixture, a fresh round trip, corrupt/truncated/foreign files). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvq.h"
#include "refs.h"

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static struct kvq_context *new_ctx(struct kvq_model *m, const struct kvq_kv_config *kv) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 512;
    cp.n_threads = 2;
    cp.kv = *kv;
    struct kvq_context *c = kvq_context_new(m, &cp);
    CHECK(c != NULL, "context: %s", kvq_last_error());
    return c;
}

/* Decodes ids then max greedy tokens (EOS included, no stop when ignore_eos). */
static int greedy(struct kvq_context *ctx, const struct kvq_model *m, const int32_t *ids, int n_ids, int32_t *out,
                  int max, bool ignore_eos, const float *first_logits) {
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    struct kvq_batch b = {.n_tokens = n_ids, .tokens = ids};
    if (n_ids > 0 && kvq_decode(ctx, &b) != 0) return -1;
    int n = 0;
    while (n < max) {
        const float *lg = first_logits && n == 0 && n_ids == 0 ? first_logits : kvq_get_logits(ctx, b.n_tokens - 1);
        int32_t t = argmax(lg, info.n_vocab);
        out[n++] = t;
        if (!ignore_eos && kvq_token_is_eog(m, t)) break;
        b = (struct kvq_batch){.n_tokens = 1, .tokens = &out[n - 1]};
        if (kvq_decode(ctx, &b) != 0) return -1;
    }
    return n;
}

static struct kvq_kv_config kvc(int kb, int vb, int max, bool rot) {
    struct kvq_kv_config kv;
    kvq_kv_config_default(&kv);
    kv.k_bits = kb;
    kv.v_bits = vb;
    kv.max_size = max;
    kv.hadamard = rot;
    return kv;
}

static void test_plan(struct kvq_model *m, const struct ref_prompt *refs) {
    /* the seed's configurations: generation works and starts like f16 */
    struct {
        const char *name;
        struct kvq_kv_config kv;
        int min_same;
    } cases[] = {
        {"kv-bits 8", kvc(8, 8, 0, true), 8},           {"kv-bits 4", kvc(4, 4, 0, true), 6},
        {"kv-bits 8,4", kvc(8, 4, 0, true), 6},         {"kv-bits 4,2", kvc(4, 2, 0, true), 4},
        {"max-kv-size 128", kvc(16, 16, 128, false), 8},
        {"max-kv-size 128, kv-bits 4", kvc(4, 4, 128, true), 6},
        {"max-kv-size 128, kv-bits 8,4", kvc(8, 4, 128, true), 6},
    };
    const struct ref_prompt *r = &refs[1];
    struct kvq_kv_config f16 = kvc(16, 16, 0, false);
    struct kvq_context *ctx = new_ctx(m, &f16);
    int32_t base[8], got[8];
    greedy(ctx, m, r->ids, r->n_ids, base, 8, true, NULL);
    kvq_context_free(ctx);
    /* Teacher-forced along the f16 continuation, so that one near-tie does not
     * derail the rest: how often the quantized cache picks the same next token. */
    struct kvq_model_info mi;
    kvq_model_get_info(m, &mi);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        ctx = new_ctx(m, &cases[c].kv);
        struct kvq_batch b = {.n_tokens = r->n_ids, .tokens = r->ids};
        int same = 0, n = 0;
        for (; n < 8 && kvq_decode(ctx, &b) == 0; n++) {
            got[n] = argmax(kvq_get_logits(ctx, b.n_tokens - 1), mi.n_vocab);
            same += got[n] == base[n];
            b = (struct kvq_batch){.n_tokens = 1, .tokens = &base[n]};
        }
        printf("%-30s %2d of 8 next tokens equal f16's (KV %zu bytes)\n", cases[c].name, same, kvq_kv_bytes(ctx));
        CHECK(n == 8 && same >= cases[c].min_same, "%s: %d tokens, %d equal f16", cases[c].name, n, same);
        kvq_context_free(ctx);
    }
    /* 100 decode steps past max-kv-size with keep 4: equal to f16 while the window
     * holds everything, then the cache stays bounded */
    struct kvq_kv_config rq = kvc(8, 4, 36, true), rf = kvc(16, 16, 36, false);
    int32_t a[80], b[80], full[80];
    ctx = new_ctx(m, &f16);
    greedy(ctx, m, r->ids, r->n_ids, full, 80 - r->n_ids, true, NULL);
    kvq_context_free(ctx);
    ctx = new_ctx(m, &rf);
    int na = greedy(ctx, m, r->ids, r->n_ids, a, 80 - r->n_ids, true, NULL);
    int same = 0;
    while (same < na && a[same] == full[same]) same++;
    CHECK(na == 80 - r->n_ids && same >= 36 - r->n_ids - 1, "rotating f16: %d tokens, equal to full for %d", na, same);
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    /* whole blocks of 64 tokens: the one of the kept first tokens and the window's */
    CHECK(kvq_seq_len(ctx, 0) == 80 && kvq_kv_bytes(ctx) == 2 * 64 * kvq_kv_token_bytes(m, &rf) &&
              kvq_kv_blocks(ctx) == 2 * info.n_layer,
          "rotating bytes %zu", kvq_kv_bytes(ctx));
    kvq_context_free(ctx);
    ctx = new_ctx(m, &rq);
    int nb = greedy(ctx, m, r->ids, r->n_ids, b, 80 - r->n_ids, true, NULL);
    CHECK(nb == 80 - r->n_ids && kvq_kv_bytes(ctx) == 2 * 64 * kvq_kv_token_bytes(m, &rq) + kvq_kv_window_bytes(m, &rq),
          "quantized rotating: %d, %zu",
          nb, kvq_kv_bytes(ctx));
    kvq_context_free(ctx);
}

static void test_save_load(struct kvq_model *m, const struct ref_prompt *refs) {
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    /* the last: normal-float rows, layers 1-2 and 4 at other bits (mixed precision) */
    struct kvq_kv_config cfgs[] = {kvc(8, 4, 0, true), kvc(4, 2, 40, true), kvc(16, 16, 0, false), kvc(4, 4, 0, true)};
    cfgs[3].k_group = cfgs[3].v_group = KVQ_KV_NF;
    cfgs[3].n_layer_bits = 2;
    cfgs[3].layer_bits[0] = (struct kvq_layer_bits){1, 2, 5, 4};
    cfgs[3].layer_bits[1] = (struct kvq_layer_bits){4, 4, 5, 3};
    const char *path = "test_kv_model.kvq";
    const struct ref_prompt *r = &refs[2];
    int32_t more[3] = {r->next[0], r->next[1], r->next[2]};
    for (int ci = 0; ci < 4; ci++) {
        struct kvq_kv_config kv = cfgs[ci];
        kv.quantized_start = ci == 0 ? 8 : 0; /* converts during the prompt */
        /* uninterrupted: the prompt, then 3 more tokens, then 6 greedy (the same batches;
         * the key/value offsets come from the first batch) */
        int32_t want[6], got[6];
        struct kvq_context *ctx = new_ctx(m, &kv);
        /* the CPU chooses the offsets inside a batch: a server need not cut prompts there */
        CHECK(kvq_pass_split_tokens(ctx) == 0, "config %d: the CPU splits passes at %d tokens", ci,
              kvq_pass_split_tokens(ctx));
        struct kvq_batch b0 = {.n_tokens = r->n_ids, .tokens = r->ids};
        CHECK(kvq_decode(ctx, &b0) == 0, "decode");
        greedy(ctx, m, more, 3, want, 6, true, NULL);
        kvq_context_free(ctx);
        /* saved after the prompt, loaded into a fresh context, continued */
        ctx = new_ctx(m, &kv);
        struct kvq_batch b = {.n_tokens = r->n_ids, .tokens = r->ids};
        CHECK(kvq_decode(ctx, &b) == 0, "decode");
        CHECK(kvq_seq_save_ex(ctx, 0, path, r->ids, r->n_ids, kvq_get_logits(ctx, r->n_ids - 1)) == 0, "save: %s",
              kvq_last_error());
        kvq_context_free(ctx);
        struct kvq_kv_config fkv;
        CHECK(kvq_seq_file_kv_config(path, &fkv) == 0 && !memcmp(&fkv, &kv, sizeof kv), "file kv config");
        ctx = new_ctx(m, &kv);
        struct kvq_seq_extra ex;
        CHECK(kvq_seq_load_ex(ctx, 0, path, &ex) == 0, "load: %s", kvq_last_error());
        CHECK(ex.n_tokens == r->n_ids && ex.logits && kvq_seq_len(ctx, 0) == r->n_ids, "extra");
        CHECK(ex.logits && argmax(ex.logits, info.n_vocab) == r->next[0], "saved logits");
        greedy(ctx, m, more, 3, got, 6, true, NULL);
        CHECK(!memcmp(got, want, sizeof got), "config %d: continuation after load differs", ci);
        kvq_seq_extra_free(&ex);
        /* corrupt, truncated, unknown version, wrong config */
        FILE *f = fopen(path, "rb");
        fseek(f, 0, SEEK_END);
        long len = ftell(f);
        fseek(f, 0, SEEK_SET);
        unsigned char *data = malloc((size_t)len);
        CHECK(fread(data, 1, (size_t)len, f) == (size_t)len, "read");
        fclose(f);
        const char *bad = "test_kv_model_bad.kvq";
        struct {
            long cut, flip;
            const char *err;
        } cases[] = {{len, len / 2, "corrupt"}, {len / 3, -1, "corrupt"}, {10, -1, "truncated"}, {len, 8, "version"},
                     {4, -1, "truncated"}};
        for (int k = 0; k < 5; k++) {
            f = fopen(bad, "wb");
            if (cases[k].flip >= 0) data[cases[k].flip] ^= 0x40;
            fwrite(data, 1, (size_t)cases[k].cut, f);
            if (cases[k].flip >= 0) data[cases[k].flip] ^= 0x40;
            fclose(f);
            CHECK(kvq_seq_load(ctx, 0, bad) != 0 && strstr(kvq_last_error(), cases[k].err) && kvq_seq_len(ctx, 0) == 0,
                  "bad file %d: '%s'", k, kvq_last_error());
        }
        free(data);
        remove(bad);
        struct kvq_kv_config other = kv;
        other.v_bits = kv.v_bits == 4 ? (kv.v_group == KVQ_KV_NF ? 3 : 8) : 4;
        struct kvq_context *o = new_ctx(m, &other);
        CHECK(kvq_seq_load(o, 0, path) != 0 && strstr(kvq_last_error(), "another KV cache config"), "other config: %s",
              kvq_last_error());
        kvq_context_free(o);
        if (kv.n_layer_bits) { /* the same but for one layer's bits; then the same as other ranges */
            other = kv;
            other.layer_bits[1].v_bits = 4;
            o = new_ctx(m, &other);
            CHECK(kvq_seq_load(o, 0, path) != 0 && strstr(kvq_last_error(), "layer bits 1-2=5,4 4=5,3"),
                  "other layer bits: %s", kvq_last_error());
            kvq_context_free(o);
            other = kv;
            other.n_layer_bits = 3;
            other.layer_bits[0].last = 1;
            other.layer_bits[2] = (struct kvq_layer_bits){2, 2, 5, 4};
            o = new_ctx(m, &other);
            CHECK(kvq_seq_load(o, 0, path) == 0 && kvq_seq_len(o, 0) == r->n_ids, "same bits, other ranges: %s",
                  kvq_last_error());
            kvq_context_free(o);
        }
        kvq_context_free(ctx);
    }
    remove(path);
}

/* A prefix held in a mixed-precision format (normal-float rows, two layers at other
 * bits): it reports that format, saves and loads in it, and attached to a K8V4
 * context continues as the sequence it came from does, up to the rounding of two
 * re-encodings (max |dlogit| about 6% of the largest logit, as with 4,4:nf alone). */
static void test_mixed_prefix(struct kvq_model *m, const struct ref_prompt *refs) {
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    const struct ref_prompt *r = &refs[2];
    struct kvq_kv_config kv = kvc(8, 4, 0, true), mixed = kvc(4, 4, 0, true), got;
    mixed.k_group = mixed.v_group = KVQ_KV_NF;
    mixed.n_layer_bits = 1;
    mixed.layer_bits[0] = (struct kvq_layer_bits){1, 2, 5, 4};
    struct kvq_context *ctx = new_ctx(m, &kv);
    struct kvq_batch b = {.n_tokens = r->n_ids, .tokens = r->ids};
    CHECK(kvq_decode(ctx, &b) == 0, "decode");
    struct kvq_prefix *p = kvq_prefix_hold_as(ctx, 0, &mixed);
    CHECK(p != NULL, "hold as mixed: %s", kvq_last_error());
    if (!p) return kvq_context_free(ctx);
    kvq_prefix_kv_config(p, &got);
    CHECK(kvq_kv_same_format(&got, &mixed) && !kvq_kv_same_format(&got, &kv), "the prefix's format");
    const char *path = "test_kv_model_mixed.kvq";
    CHECK(kvq_prefix_save(p, path, r->ids, r->n_ids, NULL) == 0, "save: %s", kvq_last_error());
    kvq_prefix_free(p);
    struct kvq_batch one = {.n_tokens = 1, .tokens = &r->next[0]};
    CHECK(kvq_decode(ctx, &one) == 0, "decode");
    float *want = malloc(sizeof *want * (size_t)info.n_vocab);
    memcpy(want, kvq_get_logits(ctx, 0), sizeof *want * (size_t)info.n_vocab);
    kvq_seq_clear(ctx, 0);
    struct kvq_seq_extra ex;
    p = kvq_prefix_load(ctx, path, &ex);
    CHECK(p != NULL, "load: %s", kvq_last_error());
    if (p) {
        kvq_prefix_kv_config(p, &got);
        CHECK(kvq_kv_same_format(&got, &mixed) && kvq_prefix_len(p) == r->n_ids, "loaded in its format");
        CHECK(kvq_prefix_attach(ctx, 0, p) == 0 && kvq_decode(ctx, &one) == 0, "attach: %s", kvq_last_error());
        const float *l = kvq_get_logits(ctx, 0);
        double d = 0, mx = 0;
        for (int i = 0; i < info.n_vocab; i++) {
            d = fmax(d, fabs((double)l[i] - want[i]));
            mx = fmax(mx, fabs((double)want[i]));
        }
        CHECK(argmax(l, info.n_vocab) == argmax(want, info.n_vocab) && d < 0.1 * mx,
              "continued from the mixed prefix: max |dlogit| %.4f of %.2f", d, mx);
        kvq_seq_extra_free(&ex);
        kvq_prefix_free(p);
    }
    free(want);
    remove(path);
    kvq_context_free(ctx);
}

/* The version-1 fixture (stories260K, K8/V4 g8 hadamard): still reads, continues as
 * a recomputation would, and is rejected by another model. */
static void test_fixture(struct kvq_model *tinydoc) {
    const char *fx = KVQ_SOURCE_DIR "/tests/fixtures/stories260K-k8v4-g8-rot-v1.kvq";
    struct kvq_model *m = kvq_model_load(require_shared("models/stories260K.gguf"));
    CHECK(m != NULL, "stories260K: %s", kvq_last_error());
    if (!m) return;
    struct kvq_kv_config kv;
    CHECK(kvq_seq_file_kv_config(fx, &kv) == 0, "fixture config: %s", kvq_last_error());
    CHECK(kv.k_bits == 8 && kv.v_bits == 4 && kv.k_group == 8 && kv.hadamard, "fixture config values");
    struct kvq_context *ctx = new_ctx(m, &kv);
    struct kvq_seq_extra ex;
    CHECK(kvq_seq_load_ex(ctx, 0, fx, &ex) == 0, "fixture load: %s", kvq_last_error());
    int32_t got[20], want[20];
    int n = greedy(ctx, m, NULL, 0, got, 20, true, ex.logits);
    kvq_context_free(ctx);
    ctx = new_ctx(m, &kv);
    int n2 = greedy(ctx, m, ex.tokens, ex.n_tokens, want, 20, true, NULL);
    CHECK(n == 20 && n2 == 20 && !memcmp(got, want, sizeof got), "fixture continuation equals recomputation");
    kvq_context_free(ctx);
    kvq_seq_extra_free(&ex);
    kvq_model_free(m);
    ctx = new_ctx(tinydoc, &kv);
    CHECK(ctx && kvq_seq_load(ctx, 0, fx) != 0 && strstr(kvq_last_error(), "another model"), "wrong model: %s",
          kvq_last_error());
    kvq_context_free(ctx);
}

int main(void) {
    struct ref_prompt refs[REFS_PROMPTS];
    refs_load(refs);
    struct kvq_model *m = kvq_model_load(require_shared("models/tinydoc-q8_0.gguf"));
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return check_finish();
    test_fixture(m);
    test_save_load(m, refs);
    test_mixed_prefix(m, refs);
    test_plan(m, refs);
    kvq_model_free(m);
    /* kv-bits 8 on the f16 weights, which the references were computed from */
    m = kvq_model_load(require_shared("models/tinydoc-f16.gguf"));
    struct kvq_kv_config k8 = kvc(8, 8, 0, true);
    for (int i = 0; i < REFS_PROMPTS && m; i++) {
        struct kvq_context *ctx = new_ctx(m, &k8);
        int32_t got[REFS_MAX_IDS];
        int n = greedy(ctx, m, refs[i].ids, refs[i].n_ids, got, refs[i].n_next, false, NULL);
        CHECK(n == refs[i].n_next && !memcmp(got, refs[i].next, sizeof(int32_t) * n), "f16 weights, kv-bits 8, prompt %d",
              i);
        kvq_context_free(ctx);
    }
    kvq_model_free(m);
    return check_finish();
}
