/* kvq gen-model: qwen2.5-0.5b at q8_0 (full depth) and f16 (2 layers), written to a
 * temporary folder, loads through the public API with the real model's shape and
 * parameter count (494,032,768 for Qwen2.5-0.5B), its tensors have the expected
 * types, its placeholder vocabulary tokenizes, and one decode step gives finite
 * logits. gemma3-4b (2 layers, q4_0) likewise, with head size 256 != n_embd / n_head
 * and Gemma's metadata and norms. Files are deleted afterwards. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/dtype.h"
#include "gguf/gguf.h"
#include "kernels/f16.h"
#include "kvq.h"

/* Qwen2.5-0.5B: embeddings 151936 x 896 (tied); per layer q/o 896x896, k/v 896x128,
 * q/k/v biases, gate/up/down 896x4864, two norms; a final norm. */
static uint64_t qwen05_params(int n_layer) {
    uint64_t per_layer = 2ull * 896 * 896 + 2ull * 896 * 128 + 896 + 2 * 128 + 3ull * 896 * 4864 + 2 * 896;
    return 151936ull * 896 + per_layer * (uint64_t)n_layer + 896;
}

/* The placeholder vocabulary tokenizes and one decode step gives finite logits. */
static void check_decode(struct kvq_model *m, int n_vocab) {
    kvq_token toks[32];
    int n = kvq_tokenize(m, "Hello, world!", 13, true, false, toks, 32);
    CHECK(n > 2 && n <= 32 && toks[0] == kvq_token_bos(m), "tokenize: %d tokens", n);
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 64;
    cp.n_threads = 2;
    struct kvq_context *c = kvq_context_new(m, &cp);
    CHECK(c != NULL, "context: %s", kvq_last_error());
    if (c && n > 0 && n <= 32) {
        struct kvq_batch b = {.n_tokens = n, .tokens = toks};
        CHECK(kvq_decode(c, &b) == 0, "decode: %s", kvq_last_error());
        const float *lg = kvq_get_logits(c, n - 1);
        bool finite = lg != NULL;
        for (int i = 0; lg && i < n_vocab; i++) finite &= isfinite(lg[i]);
        CHECK(finite, "logits are finite");
    }
    kvq_context_free(c);
}

/* `kvq gen-model ARGS --seed 7 -o PATH`; whether it succeeded. */
static bool gen_model(const char *bin, const char *args, const char *path) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s' gen-model %s --seed 7 -o '%s'", bin, args, path);
    int rc = system(cmd);
    CHECK(rc == 0, "'%s' exited with %d", cmd, rc);
    return rc == 0;
}

static void check_model(const char *bin, const char *dir, const char *type, int layers, uint32_t want_type) {
    char path[512], args[96];
    snprintf(path, sizeof path, "%s/qwen-%s.gguf", dir, type);
    snprintf(args, sizeof args, "--shape qwen2.5-0.5b --type %s --layers %d", type, layers ? layers : 24);
    if (!gen_model(bin, args, path)) return;

    struct gguf_file *f = gguf_open(path);
    CHECK(f != NULL, "gguf_open: %s", kvq_last_error());
    if (f) {
        const struct gguf_tensor *t = gguf_find_tensor(f, "blk.0.attn_q.weight");
        CHECK(t && t->type == want_type, "attn_q type %u", t ? t->type : 999);
        t = gguf_find_tensor(f, "blk.0.attn_k.bias");
        CHECK(t && t->type == KVQ_F32 && t->ne[0] == 128, "attn_k.bias");
        CHECK(gguf_find_tensor(f, "output.weight") == NULL, "tied embeddings: no output.weight");
        uint32_t v;
        CHECK(gguf_get_u32(f, "qwen2.block_count", &v) && v == (uint32_t)(layers ? layers : 24), "block_count %u", v);
        char s[32];
        CHECK(gguf_get_str(f, "general.architecture", s, sizeof s) && !strcmp(s, "qwen2"), "architecture");
        gguf_close(f);
    }

    struct kvq_model *m = kvq_model_load(path);
    CHECK(m != NULL, "load %s: %s", path, kvq_last_error());
    if (m) {
        struct kvq_model_info info;
        kvq_model_get_info(m, &info);
        uint64_t want = qwen05_params(layers ? layers : 24);
        CHECK(info.n_params == want, "%s: %llu parameters, expected %llu", type, (unsigned long long)info.n_params,
              (unsigned long long)want);
        CHECK(info.n_vocab == 151936 && info.n_embd == 896 && info.n_head == 14 && info.n_head_kv == 2 &&
                  info.head_dim == 64 && info.n_ff == 4864,
              "shape: vocab %d embd %d heads %d/%d hd %d ff %d", info.n_vocab, info.n_embd, info.n_head,
              info.n_head_kv, info.head_dim, info.n_ff);
        CHECK(!strcmp(info.arch, "qwen2"), "arch %s", info.arch);
        check_decode(m, info.n_vocab);
        kvq_model_free(m);
    }
    remove(path);
}

/* Gemma 3 4B (llama.cpp's GGUF): embeddings 262144 x 2560 (tied); per layer q 2560x2048,
 * k/v 2560x1024, o 2048x2560, gate/up/down 2560x10240, four norms of 2560 and the
 * q/k norms of 256; a final norm. Full depth (34 layers): 3,880,099,328. */
static uint64_t gemma4b_params(int n_layer) {
    uint64_t per_layer = 2ull * 2560 * 2048 + 2ull * 2560 * 1024 + 3ull * 2560 * 10240 + 4 * 2560 + 2 * 256;
    return 262144ull * 2560 + per_layer * (uint64_t)n_layer + 2560;
}

static void check_gemma(const char *bin, const char *dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/gemma.gguf", dir);
    if (!gen_model(bin, "--shape gemma3-4b --type q4_0 --layers 2", path)) return;

    struct gguf_file *f = gguf_open(path);
    CHECK(f != NULL, "gguf_open: %s", kvq_last_error());
    if (f) {
        const struct gguf_tensor *t = gguf_find_tensor(f, "blk.0.attn_q.weight");
        CHECK(t && t->type == KVQ_Q4_0 && t->ne[0] == 2560 && t->ne[1] == 2048, "attn_q");
        t = gguf_find_tensor(f, "blk.1.attn_output.weight");
        CHECK(t && t->type == KVQ_Q4_0 && t->ne[0] == 2048 && t->ne[1] == 2560, "attn_output");
        t = gguf_find_tensor(f, "blk.1.attn_k_norm.weight");
        CHECK(t && t->type == KVQ_F32 && t->ne[0] == 256 && ((const float *)t->data)[0] == 1.0f, "attn_k_norm");
        t = gguf_find_tensor(f, "blk.0.post_ffw_norm.weight");
        CHECK(t && t->type == KVQ_F32 && t->ne[0] == 2560 && ((const float *)t->data)[2559] == 1.0f, "post_ffw_norm");
        CHECK(gguf_find_tensor(f, "output.weight") == NULL, "tied embeddings: no output.weight");
        uint32_t kl = 0, vl = 0, swa = 0;
        CHECK(gguf_get_u32(f, "gemma3.attention.key_length", &kl) && kl == 256 &&
                  gguf_get_u32(f, "gemma3.attention.value_length", &vl) && vl == 256,
              "key/value length %u/%u", kl, vl);
        CHECK(gguf_get_u32(f, "gemma3.attention.sliding_window", &swa) && swa == 1024, "sliding_window %u", swa);
        float theta = 0, factor = 0, eps = 0;
        CHECK(gguf_get_f32(f, "gemma3.rope.freq_base", &theta) && theta == 1e6f, "rope theta %g", (double)theta);
        CHECK(gguf_get_f32(f, "gemma3.rope.scaling.factor", &factor) && factor == 8.0f, "rope factor %g", (double)factor);
        CHECK(gguf_get_f32(f, "gemma3.attention.layer_norm_rms_epsilon", &eps) && eps == 1e-6f, "eps %g", (double)eps);
        char s[32];
        CHECK(gguf_get_str(f, "gemma3.rope.scaling.type", s, sizeof s) && !strcmp(s, "linear"), "rope scaling");
        CHECK(gguf_get_str(f, "general.architecture", s, sizeof s) && !strcmp(s, "gemma3"), "architecture");
        gguf_close(f);
    }

    struct kvq_model *m = kvq_model_load(path);
    CHECK(m != NULL, "load %s: %s", path, kvq_last_error());
    if (m) {
        struct kvq_model_info info;
        kvq_model_get_info(m, &info);
        CHECK(info.n_params == gemma4b_params(2), "gemma3-4b: %llu parameters, expected %llu",
              (unsigned long long)info.n_params, (unsigned long long)gemma4b_params(2));
        CHECK(info.n_vocab == 262144 && info.n_embd == 2560 && info.n_layer == 2 && info.n_head == 8 &&
                  info.n_head_kv == 4 && info.head_dim == 256 && info.n_ff == 10240 && info.n_ctx_train == 131072,
              "shape: vocab %d embd %d layers %d heads %d/%d hd %d ff %d ctx %d", info.n_vocab, info.n_embd,
              info.n_layer, info.n_head, info.n_head_kv, info.head_dim, info.n_ff, info.n_ctx_train);
        CHECK(!strcmp(info.arch, "gemma3"), "arch %s", info.arch);
        check_decode(m, info.n_vocab);
        kvq_model_free(m);
    }
    remove(path);
}

/* Independent decoders of the ggml block layouts (from the GGUF spec), to check the
 * quantizers against the f16 file of the same seed (the same random values). */
static float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kvq_f16_to_f32(h);
}

static void decode_row(uint32_t type, const uint8_t *p, float *y, int n) {
    if (type == KVQ_F16)
        for (int i = 0; i < n; i++) y[i] = h2f(p + 2 * i);
    else if (type == KVQ_Q8_0)
        for (int b = 0; b < n / 32; b++)
            for (int i = 0; i < 32; i++) y[32 * b + i] = h2f(p + 34 * b) * (int8_t)p[34 * b + 2 + i];
    else if (type == KVQ_Q4_0)
        for (int b = 0; b < n / 32; b++)
            for (int i = 0; i < 16; i++) {
                const uint8_t *blk = p + 18 * b;
                y[32 * b + i] = h2f(blk) * ((blk[2 + i] & 15) - 8);
                y[32 * b + i + 16] = h2f(blk) * ((blk[2 + i] >> 4) - 8);
            }
    else if (type == KVQ_Q4_K)
        for (int b = 0; b < n / 256; b++) {
            const uint8_t *blk = p + 144 * b, *sc = blk + 4, *qs = blk + 16;
            float d = h2f(blk), dmin = h2f(blk + 2);
            for (int j = 0; j < 8; j++) {
                int s, m;
                if (j < 4) s = sc[j] & 63, m = sc[j + 4] & 63;
                else s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4), m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
                for (int i = 0; i < 32; i++) {
                    uint8_t q = qs[32 * (j / 2) + i];
                    q = j % 2 ? q >> 4 : q & 15;
                    y[256 * b + 32 * j + i] = d * s * q - dmin * m;
                }
            }
        }
    else if (type == KVQ_Q6_K) /* ql[128], qh[64], int8 scales[16], f16 d */
        for (int b = 0; b < n / 256; b++) {
            const uint8_t *blk = p + 210 * b;
            for (int v = 0; v < 256; v++) {
                const int h = v / 128, quad = v % 128 / 32, l = v % 32;
                const int lo = blk[64 * h + 32 * (quad & 1) + l] >> (quad >= 2 ? 4 : 0) & 15;
                const int hi = blk[128 + 32 * h + l] >> (2 * quad) & 3;
                y[256 * b + v] = h2f(blk + 208) * (int8_t)blk[192 + v / 16] * ((lo | hi << 4) - 32);
            }
        }
}

/* Relative RMS error of tensor `name` in file `path` against the f16 file. */
static double quant_error(const char *f16_path, const char *path, const char *name, uint32_t want_type) {
    struct gguf_file *a = gguf_open(f16_path), *b = gguf_open(path);
    double err = -1;
    const struct gguf_tensor *ta = a ? gguf_find_tensor(a, name) : NULL, *tb = b ? gguf_find_tensor(b, name) : NULL;
    CHECK(ta && tb && tb->type == want_type && ta->ne[0] == tb->ne[0] && ta->ne[1] == tb->ne[1], "%s in %s: type %u",
          name, path, tb ? tb->type : 999);
    if (ta && tb && tb->type == want_type) {
        int n = (int)ta->ne[0];
        float *x = malloc(sizeof(float) * (size_t)n * 2), *y = x + n;
        double se = 0, ss = 0;
        size_t rba = kvq_dtype_row_bytes(ta->type, (uint64_t)n), rbb = kvq_dtype_row_bytes(tb->type, (uint64_t)n);
        for (uint64_t r = 0; r < ta->ne[1]; r += 7) {
            decode_row(ta->type, (const uint8_t *)ta->data + r * rba, x, n);
            decode_row(tb->type, (const uint8_t *)tb->data + r * rbb, y, n);
            for (int i = 0; i < n; i++) se += (double)(x[i] - y[i]) * (x[i] - y[i]), ss += (double)x[i] * x[i];
        }
        err = sqrt(se / ss);
        double std = sqrt(ss / (double)n / (double)((ta->ne[1] + 6) / 7));
        CHECK(fabs(std * sqrt((double)n) - 1) < 0.05, "%s: std %g, expected 1/sqrt(%d)", name, std, n);
        free(x);
    }
    gguf_close(a);
    gguf_close(b);
    return err;
}

static void check_quantizers(const char *bin, const char *dir) {
    static const char *const types[] = {"f16", "q8_0", "q4_0", "q4_k", "q6_k", "q4_k_m"};
    char path[6][512], cmd[4096];
    for (int i = 0; i < 6; i++) {
        snprintf(path[i], sizeof path[i], "%s/q-%s.gguf", dir, types[i]);
        snprintf(cmd, sizeof cmd, "'%s' gen-model --shape qwen2.5-0.5b --type %s -o '%s' --seed 3 --layers 1 2>/dev/null",
                 bin, types[i], path[i]);
        CHECK(system(cmd) == 0, "gen-model --type %s into %s failed", types[i], dir);
    }
    /* ffn_down rows are 4864 = 19 x 256 values: every type applies; attn_q rows are 896:
     * q4_k falls back to q8_0. Bounds: q8_0 ~0.5%, 4-bit ~10% relative RMS error. */
    double e8 = quant_error(path[0], path[1], "blk.0.ffn_down.weight", KVQ_Q8_0);
    double e40 = quant_error(path[0], path[2], "blk.0.ffn_down.weight", KVQ_Q4_0);
    double e4k = quant_error(path[0], path[3], "blk.0.ffn_down.weight", KVQ_Q4_K);
    double e4kq = quant_error(path[0], path[3], "blk.0.attn_q.weight", KVQ_Q8_0);
    double e6k = quant_error(path[0], path[4], "blk.0.ffn_down.weight", KVQ_Q6_K);
    /* q4_k_m: the one layer is the last eighth's, so its ffn_down is q6_K */
    double e4km = quant_error(path[0], path[5], "blk.0.ffn_down.weight", KVQ_Q6_K);
    printf("relative RMS error: q8_0 %.4f, q4_0 %.4f, q4_k %.4f, q4_k fallback (q8_0) %.4f, q6_k %.4f, q4_k_m's "
           "ffn_down %.4f\n", e8, e40, e4k, e4kq, e6k, e4km);
    CHECK(e8 >= 0 && e8 < 0.01, "q8_0 error %g", e8);
    CHECK(e40 >= 0 && e40 < 0.15, "q4_0 error %g", e40);
    CHECK(e4k >= 0 && e4k < 0.15, "q4_k error %g", e4k);
    CHECK(e4kq >= 0 && e4kq < 0.01, "q4_k fallback error %g", e4kq);
    CHECK(e6k >= 0 && e6k < 0.04, "q6_k error %g", e6k);
    CHECK(e4km == e6k, "q4_k_m's ffn_down error %g, its q6_k error %g", e4km, e6k);
    for (int i = 0; i < 6; i++) remove(path[i]);
}

int main(void) {
    const char *bin = getenv("KVQ_BIN");
    if (!bin || access(bin, X_OK) != 0) {
        printf("SKIP: KVQ_BIN does not name the kvq binary\n");
        return 77;
    }
    char dir[] = "/tmp/kvq_gen_model_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    check_model(bin, dir, "q8_0", 0, KVQ_Q8_0);
    check_model(bin, dir, "f16", 2, KVQ_F16);
    check_gemma(bin, dir);
    check_quantizers(bin, dir);
    rmdir(dir);
    return check_finish();
}
