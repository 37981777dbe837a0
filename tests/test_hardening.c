/* Files that are well-formed but wrong (issue 8, class 2): each is crafted here
 * from a valid file, with the checksum recomputed where there is one, and must be
 * refused with a message that names the problem (never loaded, never a crash):
 *  - saved caches: a NaN in an f16 row, a NaN scale in a packed row, the residual
 *    window's first position = INT_MAX, a non-finite logit;
 *  - GGUF: a changed tensor type byte (a gap or an overlap), overlapping tensors,
 *    rms epsilon negative / NaN / inf, block_count = 2^30;
 *  - the activation quantizer fed NaN and inf (every SIMD level): codes in range,
 *    NaN lanes 0, no undefined conversion (UBSan in the sanitizer build).
 * Each crafted case is first checked to be non-vacuous (the untouched file, saved
 * the same way, loads). */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/cpu.h"
#include "core/dtype.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "kernels/matmul_impl.h"
#include "kvq.h"

static char tmpdir[] = "/tmp/kvq_hardening_XXXXXX";

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    uint8_t *d = malloc((size_t)n);
    if (d && fread(d, 1, (size_t)n, f) != (size_t)n) {
        free(d);
        d = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return d;
}

static void spill(const char *path, const uint8_t *d, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(d, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
}

/* ---- saved caches: the format as documented in src/engine/seq_state.c ---- */

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
static void reseal(uint8_t *d, size_t n) {
    uint64_t h = fnv1a(d, n - 8);
    for (int i = 0; i < 8; i++) d[n - 8 + i] = (uint8_t)(h >> (8 * i));
}
static int32_t rd32(const uint8_t *p) { return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24); }
static void wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static size_t row_bytes(int bits, int group, int d) {
    return bits >= 16 ? (size_t)d * (size_t)bits / 8 : (size_t)d * (size_t)bits / 8 + 4 * (size_t)(d / group);
}

/* Offsets inside the first layer section of a version-2 or -3 file (3 adds a flags
 * word to the KV config). */
struct layout {
    size_t logits;           /* first logit */
    size_t n_logits;
    size_t k_rows, k_row;    /* first key row of head 0, bytes per key row */
    size_t win;              /* the (sinks, first position, rows) triple */
    int32_t n_past, sn, rp0, rn;
};

static bool find_layout(const uint8_t *d, size_t n, struct layout *L) {
    size_t o = 8 + 4 + 8 + 5 * 4; /* magic, version, fingerprint, dims */
    int H = rd32(d + 20 + 8), D = rd32(d + 20 + 12);
    o += (rd32(d + 8) >= 3 ? 10 : 9) * 4;
    L->n_past = rd32(d + o);
    o += 4;
    o += 4 + 4 * (size_t)rd32(d + o); /* tokens */
    L->n_logits = (size_t)rd32(d + o);
    L->logits = o + 4;
    o += 4 + 4 * L->n_logits;
    const uint8_t *s = d + o + 8; /* after 'KVL2' and kind: 20 i32 */
    int kb = rd32(s + 4 * 11), kg = rd32(s + 4 * 12), vb = rd32(s + 4 * 14), vg = rd32(s + 4 * 15);
    int32_t size = rd32(s + 4 * 18);
    o += 8 + 80;
    int32_t mu = rd32(d + o);
    o += 4 + (mu ? 2 * (size_t)H * D * 4 : 0) + 4 * (size_t)size;
    L->k_rows = o;
    L->k_row = row_bytes(kb, kg, D);
    o += (size_t)H * size * (L->k_row + row_bytes(vb, vg, D));
    L->win = o;
    if (o + 12 > n) return false;
    L->sn = rd32(d + o), L->rp0 = rd32(d + o + 4), L->rn = rd32(d + o + 8);
    return true;
}

static struct kvq_model *model;

/* Saves a sequence after `prompt` with the KV bits given, into `path`. */
static struct kvq_context *save_state(int bits, int group, const char *path) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 128;
    cp.n_threads = 1;
    cp.kv.k_bits = cp.kv.v_bits = bits;
    cp.kv.k_group = cp.kv.v_group = group;
    struct kvq_context *ctx = kvq_context_new(model, &cp);
    CHECK(ctx != NULL, "context: %s", kvq_last_error());
    if (!ctx) return NULL;
    kvq_token toks[48];
    for (int i = 0; i < 48; i++) toks[i] = 1 + (i * 37) % 400;
    struct kvq_batch b = {.n_tokens = 48, .tokens = toks};
    CHECK(kvq_decode(ctx, &b) == 0, "decode: %s", kvq_last_error());
    CHECK(kvq_seq_save_ex(ctx, 0, path, toks, 48, kvq_get_logits(ctx, 47)) == 0, "save: %s", kvq_last_error());
    return ctx;
}

/* Loads the crafted bytes; expects a refusal naming `why` (NULL: expects success). */
static void expect_load(struct kvq_context *ctx, const char *path, uint8_t *d, size_t n, const char *why,
                        const char *what) {
    reseal(d, n);
    spill(path, d, n);
    kvq_clear_error();
    struct kvq_seq_extra ex;
    int rc = kvq_seq_load_ex(ctx, 0, path, &ex);
    if (!why) {
        CHECK(rc == 0, "%s: the untouched file should load: %s", what, kvq_last_error());
    } else {
        CHECK(rc != 0, "%s was loaded", what);
        CHECK(strstr(kvq_last_error(), why) != NULL, "%s: error '%s' should mention '%s'", what, kvq_last_error(), why);
        CHECK(kvq_seq_len(ctx, 0) == 0, "%s: a refused file leaves the sequence empty", what);
        /* the message is stable: a second refusal says the same (no self-formatting) */
        char first[512];
        snprintf(first, sizeof first, "%s", kvq_last_error());
        CHECK(kvq_seq_load_ex(ctx, 0, path, &ex) != 0 && strcmp(first, kvq_last_error()) == 0,
              "%s: message changed between runs: '%s' then '%s'", what, first, kvq_last_error());
    }
    if (rc == 0) kvq_seq_extra_free(&ex);
}

static void test_cache_f16_nan(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/f16.kvq", tmpdir);
    struct kvq_context *ctx = save_state(16, 64, path);
    if (!ctx) return;
    size_t n;
    uint8_t *orig = slurp(path, &n), *d = malloc(n);
    struct layout L;
    bool ok = orig && find_layout(orig, n, &L) && L.n_past == 48 && L.n_logits > 0;
    CHECK(ok, "f16 layout");
    if (!ok) {
        free(orig);
        free(d);
        kvq_context_free(ctx);
        return;
    }
    memcpy(d, orig, n);
    expect_load(ctx, path, d, n, NULL, "f16 cache");
    memcpy(d, orig, n);
    d[L.k_rows + 2 * 5] = 0x00, d[L.k_rows + 2 * 5 + 1] = 0x7e; /* f16 NaN in key row 0, value 5 */
    expect_load(ctx, path, d, n, "non-finite", "f16 cache with a NaN key");
    memcpy(d, orig, n);
    wr32(d + L.logits + 4 * 3, 0x7f800000u); /* +inf logit */
    expect_load(ctx, path, d, n, "non-finite logit", "cache with an inf logit");
    /* the KV config after magic, version, fingerprint, dims: max_size is its 5th i32, flags its 10th */
    memcpy(d, orig, n);
    wr32(d + 40 + 4 * 4, INT_MAX);
    expect_load(ctx, path, d, n, "impossible KV config", "cache with max_size INT_MAX");
    memcpy(d, orig, n);
    wr32(d + 40 + 4 * 9, 2); /* per-layer bits said to follow, where n_past and tokens are */
    expect_load(ctx, path, d, n, "per-layer bit", "cache with per-layer bits that are not there");
    wr32(d + 40 + 4 * 9, 4);
    expect_load(ctx, path, d, n, "unknown KV flag bits", "cache with an unknown flag bit");
    struct kvq_kv_config kv;
    CHECK(kvq_seq_file_kv_config(path, &kv) != 0 && strstr(kvq_last_error(), "unknown KV flag bits"),
          "the config reader refuses it too: %s", kvq_last_error());
    free(orig);
    free(d);
    kvq_context_free(ctx);
}

static void test_cache_quantized(void) {
    struct kvq_model_info info;
    kvq_model_get_info(model, &info);
    int group = info.head_dim % 64 == 0 ? 64 : info.head_dim % 32 == 0 ? 32 : 8;
    char path[256];
    snprintf(path, sizeof path, "%s/q4.kvq", tmpdir);
    struct kvq_context *ctx = save_state(4, group, path);
    if (!ctx) return;
    size_t n;
    uint8_t *orig = slurp(path, &n), *d = malloc(n);
    struct layout L;
    bool ok = orig && find_layout(orig, n, &L);
    CHECK(ok && L.rn > 0 && L.rp0 + L.rn == L.n_past, "q4 layout: window of %d rows from %d, n_past %d", L.rn, L.rp0,
          L.n_past);
    if (ok) {
        memcpy(d, orig, n);
        expect_load(ctx, path, d, n, NULL, "q4 cache");
        memcpy(d, orig, n);
        wr32(d + L.win + 4, INT_MAX); /* residual window start */
        expect_load(ctx, path, d, n, "window rows", "window start INT_MAX");
        memcpy(d, orig, n);
        size_t scale = L.k_rows + (size_t)info.head_dim * 4 / 8; /* first group's f16 scale */
        d[scale] = 0x00, d[scale + 1] = 0x7c;                    /* +inf */
        expect_load(ctx, path, d, n, "non-finite", "packed row with an inf scale");
    }
    free(orig);
    free(d);
    kvq_context_free(ctx);
}

/* ---- GGUF ---- */

static size_t tensor_field(const uint8_t *base, const struct gguf_tensor *t, int which) {
    size_t p = (size_t)((const uint8_t *)t->name.ptr - base) + t->name.len;
    return which == 0 ? p + 4 + 8 * t->n_dims : p + 4 + 8 * t->n_dims + 4; /* type, offset */
}

static void expect_gguf_refused(const uint8_t *d, size_t n, const char *why, const char *what) {
    kvq_clear_error();
    struct gguf_file *f = gguf_open_memory(d, n);
    CHECK(f == NULL, "%s was accepted", what);
    CHECK(strstr(kvq_last_error(), why) != NULL, "%s: error '%s' should mention '%s'", what, kvq_last_error(), why);
    gguf_close(f);
}

static void test_gguf_layout(const char *rel, uint32_t new_type, const char *why) {
    const char *p = shared_path(rel);
    if (!p) {
        printf("SKIP %s: missing\n", rel);
        return;
    }
    size_t n;
    uint8_t *d = slurp(p, &n);
    struct gguf_file *f = gguf_open_memory(d, n);
    CHECK(f != NULL, "%s should parse: %s", rel, kvq_last_error());
    if (!f) return;
    const struct gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    size_t at = tensor_field(d, emb, 0);
    uint32_t old;
    memcpy(&old, d + at, 4);
    /* the overlap: the second tensor in file order starts where the first does */
    const struct gguf_tensor *t0 = gguf_tensor_at(f, 0), *t1 = gguf_tensor_at(f, 1);
    size_t at1 = tensor_field(d, t1, 1);
    uint64_t off1 = t1->offset, off0 = t0->offset;
    gguf_close(f);
    memcpy(d + at, &new_type, 4);
    expect_gguf_refused(d, n, why, "changed type byte");
    memcpy(d + at, &old, 4);
    memcpy(d + at1, &off0, 8);
    expect_gguf_refused(d, n, "overlaps", "overlapping tensors");
    memcpy(d + at1, &off1, 8);
    f = gguf_open_memory(d, n);
    CHECK(f != NULL, "restored file parses again: %s", kvq_last_error());
    gguf_close(f);
    free(d);
}

/* Overwrites `len` bytes at `at` bytes after a key's type field (0: a scalar's value
 * or an array's element type; 12: an array's first element) in a copy of the model
 * and expects kvq_model_load to refuse it, naming `why`. */
static void expect_model_refused(const uint8_t *d0, size_t n, const char *key, size_t at, const void *val, size_t len,
                                 const char *why) {
    uint8_t *d = malloc(n);
    memcpy(d, d0, n);
    struct gguf_file *f = gguf_open_memory(d, n);
    for (uint64_t i = 0; f && i < gguf_n_kv(f); i++) {
        const struct gguf_kv *kv = gguf_kv_at(f, i);
        if (gguf_str_eq(kv->key, key)) memcpy(d + ((const uint8_t *)kv->key.ptr - d) + kv->key.len + 4 + at, val, len);
    }
    CHECK(f && gguf_find(f, key), "key %s present", key);
    gguf_close(f);
    char path[256];
    snprintf(path, sizeof path, "%s/m.gguf", tmpdir);
    spill(path, d, n);
    kvq_clear_error();
    struct kvq_model *m = kvq_model_load(path);
    CHECK(m == NULL, "%s edited: model loaded", key);
    CHECK(strstr(kvq_last_error(), why) != NULL, "%s: error '%s' should mention '%s'", key, kvq_last_error(), why);
    kvq_model_free(m);
    free(d);
}

static void test_model_metadata(const char *model_path) {
    size_t n;
    uint8_t *d = slurp(model_path, &n);
    float bad[] = {-1e-5f, 0.0f};
    uint32_t nan = 0x7fc00000u, inf = 0x7f800000u, huge = 1u << 30;
    expect_model_refused(d, n, "llama.attention.layer_norm_rms_epsilon", 0, &bad[0], 4, "finite positive");
    expect_model_refused(d, n, "llama.attention.layer_norm_rms_epsilon", 0, &bad[1], 4, "finite positive");
    expect_model_refused(d, n, "llama.attention.layer_norm_rms_epsilon", 0, &nan, 4, "finite positive");
    expect_model_refused(d, n, "llama.attention.layer_norm_rms_epsilon", 0, &inf, 4, "finite positive");
    expect_model_refused(d, n, "llama.block_count", 0, &huge, 4, "block_count");
    /* issue 72: metadata that loads but disagrees with the tensors or with llama.cpp's types */
    uint32_t one = 1, f32 = GGUF_TYPE_FLOAT32, i32 = GGUF_TYPE_INT32, u32 = GGUF_TYPE_UINT32;
    expect_model_refused(d, n, "llama.block_count", 0, &one, 4, "tensor 'blk.1.");
    expect_model_refused(d, n, "tokenizer.ggml.token_type", 0, &f32, 4, "must be an array of int32");
    expect_model_refused(d, n, "tokenizer.ggml.scores", 0, &i32, 4, "must be an array of float32");
    expect_model_refused(d, n, "tokenizer.ggml.scores", 0, &u32, 4, "must be an array of float32");
    expect_model_refused(d, n, "tokenizer.ggml.scores", 12, &nan, 4, "not finite");
    int32_t types[] = {-1, 0, 7, 100, INT_MAX};
    for (int i = 0; i < 5; i++) expect_model_refused(d, n, "tokenizer.ggml.token_type", 12, &types[i], 4, "types 1..6");
    free(d);
}

static void test_act_quantizer_nan(void) {
    float x[256];
    for (int i = 0; i < 256; i++) x[i] = (float)((i * 7) % 23) - 11.0f;
    x[3] = __builtin_nanf("");
    x[40] = __builtin_inff();
    x[41] = -__builtin_inff();
    static const enum kvq_simd levels[] = {KVQ_SIMD_SCALAR, KVQ_SIMD_AVX2, KVQ_SIMD_AVX512};
    int tried = 0;
    enum kvq_simd orig = kvq_simd_level();
    for (int li = 0; li < 3; li++) {
        if (kvq_simd_force(levels[li]) != 0) continue;
        tried++;
        struct kern_pair pairs[4];
        kern_act_prepare(KVQ_Q8_0, x, pairs, 128);
        CHECK(pairs[0].q[3] == 0, "level %d: NaN lane quantized to %d, expected 0", li, pairs[0].q[3]);
        int32_t sum = 0;
        for (int i = 32; i < 64; i++) sum += pairs[0].q[i];
        CHECK(pairs[0].c[1] == -128 * sum, "level %d: block sum %d does not match its codes", li, pairs[0].c[1]);
        CHECK(pairs[1].q[0] >= -127 && pairs[1].q[0] <= 127 && pairs[1].d[0] > 0, "level %d: a finite block", li);
        struct kern_q8k q8k;
        kern_act_prepare(KVQ_Q6_K, x, &q8k, 256);
        CHECK(q8k.q[3] == 0, "level %d: Q8_K NaN lane quantized to %d", li, q8k.q[3]);
        int bs = 0;
        for (int i = 0; i < 16; i++) bs += q8k.q[i];
        CHECK(q8k.bsums[0] == bs, "level %d: Q8_K bsum %d, codes sum to %d", li, q8k.bsums[0], bs);
    }
    kvq_simd_force(orig);
    CHECK(tried > 0, "no SIMD level could be selected");
}

int main(void) {
    test_act_quantizer_nan();
    const char *mp = require_shared("models/stories260K.gguf");
    if (!mkdtemp(tmpdir)) return 1;
    model = kvq_model_load(mp);
    CHECK(model != NULL, "model: %s", kvq_last_error());
    if (model) {
        struct kvq_context_params cp;
        kvq_context_params_default(&cp);
        cp.kv.max_size = INT_MAX; /* issue 72: overflowed when the budget was sized */
        CHECK(kvq_context_new(model, &cp) == NULL && strstr(kvq_last_error(), "rotating cache size"),
              "a rotating size of INT_MAX: %s", kvq_last_error());
        test_cache_f16_nan();
        test_cache_quantized();
        kvq_model_free(model);
    }
    test_gguf_layout("models/stories260K.gguf", 1 /* f32 -> f16: a gap */, "gap");
    test_gguf_layout("models/tinydoc-q8_0.gguf", 0 /* q8_0 -> f32: an overlap */, "overlaps");
    test_model_metadata(mp);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", tmpdir);
    return check_finish();
}
