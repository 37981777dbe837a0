/* kvq gen-model: qwen2.5-0.5b at q8_0 (full depth) and f16 (2 layers), written to a
 * temporary folder, loads through the public API with the real model's shape and
 * parameter count (494,032,768 for Qwen2.5-0.5B), its tensors have the expected
 * types, its placeholder vocabulary tokenizes, and one decode step gives finite
 * logits. Files are deleted afterwards. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/dtype.h"
#include "gguf/gguf.h"
#include "kvq.h"

/* Qwen2.5-0.5B: embeddings 151936 x 896 (tied); per layer q/o 896x896, k/v 896x128,
 * q/k/v biases, gate/up/down 896x4864, two norms; a final norm. */
static uint64_t qwen05_params(int n_layer) {
    uint64_t per_layer = 2ull * 896 * 896 + 2ull * 896 * 128 + 896 + 2 * 128 + 3ull * 896 * 4864 + 2 * 896;
    return 151936ull * 896 + per_layer * (uint64_t)n_layer + 896;
}

static void check_model(const char *bin, const char *dir, const char *type, int layers, uint32_t want_type) {
    char path[512], cmd[2048];
    snprintf(path, sizeof path, "%s/qwen-%s.gguf", dir, type);
    char extra[32] = "";
    if (layers) snprintf(extra, sizeof extra, " --layers %d", layers);
    snprintf(cmd, sizeof cmd, "'%s' gen-model --shape qwen2.5-0.5b --type %s -o '%s' --seed 7%s", bin, type, path, extra);
    int rc = system(cmd);
    CHECK(rc == 0, "'%s' exited with %d", cmd, rc);
    if (rc != 0) return;

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
            for (int i = 0; lg && i < info.n_vocab; i++) finite &= isfinite(lg[i]);
            CHECK(finite, "logits are finite");
        }
        kvq_context_free(c);
        kvq_model_free(m);
    }
    remove(path);
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
    rmdir(dir);
    return check_finish();
}
