/* The qwen2 code path (RoPE on halves, q/k/v biases) against Hugging Face: tinydoc
 * rewritten as a qwen2 model gives the same function, so its logits must match the
 * reference logits of the llama original.
 *
 * llama.cpp's converter stores a Llama's q/k rows permuted so that RoPE rotates
 * adjacent pairs; qwen2 files keep Hugging Face's order, where RoPE rotates the two
 * halves of each head. Undoing the permutation and adding zero biases turns the llama
 * file into an equivalent qwen2 file. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/dtype.h"
#include "gguf/gguf.h"
#include "kvq.h"
#include "refs.h"

/* Rows of a [rows][row_bytes] head-major matrix back to Hugging Face order: within
 * each head of d rows, row 2i came from i and row 2i+1 from i + d/2. */
static void *unpermute_rows(const struct gguf_tensor *t, int head_dim) {
    size_t row = kvq_dtype_row_bytes(t->type, t->ne[0]);
    uint8_t *out = malloc(t->nbytes);
    const uint8_t *in = t->data;
    for (uint64_t h = 0; h < t->ne[1] / (uint64_t)head_dim; h++)
        for (int i = 0; i < head_dim / 2; i++) {
            size_t base = h * head_dim;
            memcpy(out + (base + i) * row, in + (base + 2 * i) * row, row);
            memcpy(out + (base + i + head_dim / 2) * row, in + (base + 2 * i + 1) * row, row);
        }
    return out;
}

static void copy_u32(struct gguf_writer *w, const struct gguf_file *f, const char *from, const char *to) {
    uint32_t v;
    if (gguf_get_u32(f, from, &v)) gguf_writer_add_u32(w, to, v);
}

/* Writes tinydoc as qwen2 to path; returns 0 on success. */
static int write_qwen2(const struct gguf_file *f, const char *path) {
    struct gguf_writer *w = gguf_writer_new();
    gguf_writer_add_str(w, "general.architecture", "qwen2");
    static const char *const keys[] = {"block_count", "context_length", "embedding_length", "feed_forward_length",
                                       "attention.head_count", "attention.head_count_kv"};
    char from[96], to[96];
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        snprintf(from, sizeof from, "llama.%s", keys[i]);
        snprintf(to, sizeof to, "qwen2.%s", keys[i]);
        copy_u32(w, f, from, to);
    }
    float eps;
    gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &eps);
    gguf_writer_add_f32(w, "qwen2.attention.layer_norm_rms_epsilon", eps);
    gguf_writer_add_f32(w, "qwen2.rope.freq_base", 10000.0f);
    gguf_writer_add_str(w, "tokenizer.ggml.model", "llama");
    const struct gguf_value *tok = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_TYPE_STRING);
    const struct gguf_value *scores = gguf_get_arr(f, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32);
    const struct gguf_value *types = gguf_get_arr(f, "tokenizer.ggml.token_type", GGUF_TYPE_INT32);
    char **strs = malloc(sizeof(char *) * tok->arr.n);
    for (uint64_t i = 0; i < tok->arr.n; i++) strs[i] = strndup(tok->arr.strs[i].ptr, tok->arr.strs[i].len);
    gguf_writer_add_str_arr(w, "tokenizer.ggml.tokens", (const char *const *)strs, tok->arr.n);
    gguf_writer_add_arr(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores->arr.data, scores->arr.n);
    gguf_writer_add_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types->arr.data, types->arr.n);
    copy_u32(w, f, "tokenizer.ggml.bos_token_id", "tokenizer.ggml.bos_token_id");
    copy_u32(w, f, "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eos_token_id");

    uint32_t head_dim = 128;
    gguf_get_u32(f, "llama.attention.key_length", &head_dim);
    void *owned[64];
    int n_owned = 0;
    float *zeros = calloc(4096, sizeof(float));
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        char name[96];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        const void *data = t->data;
        size_t len = strlen(name);
        bool is_q = len > 13 && !strcmp(name + len - 13, "attn_q.weight");
        bool is_k = len > 13 && !strcmp(name + len - 13, "attn_k.weight");
        bool is_v = len > 13 && !strcmp(name + len - 13, "attn_v.weight");
        if (is_q || is_k) data = owned[n_owned++] = unpermute_rows(t, (int)head_dim);
        gguf_writer_add_tensor(w, name, t->n_dims, t->ne, t->type, data);
        if (is_q || is_k || is_v) { /* qwen2 has biases on q, k and v */
            char bias[96];
            snprintf(bias, sizeof bias, "%.*s.bias", (int)(len - 7), name);
            uint64_t ne[1] = {t->ne[1]};
            gguf_writer_add_tensor(w, bias, 1, ne, KVQ_F32, zeros);
        }
    }
    int rc = gguf_writer_write(w, path, NULL, NULL);
    gguf_writer_free(w);
    for (int i = 0; i < n_owned; i++) free(owned[i]);
    for (uint64_t i = 0; i < tok->arr.n; i++) free(strs[i]);
    free(strs);
    free(zeros);
    return rc;
}

int main(void) {
    struct ref_prompt refs[REFS_PROMPTS];
    refs_load(refs);
    struct gguf_file *src = gguf_open(require_shared("models/tinydoc-f16.gguf"));
    CHECK(src != NULL, "open tinydoc: %s", kvq_last_error());
    if (!src) return check_finish();
    char path[] = "/tmp/kvq_qwen2_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    CHECK(write_qwen2(src, path) == 0, "write qwen2 file: %s", kvq_last_error());
    gguf_close(src);

    struct kvq_model *m = kvq_model_load(path);
    CHECK(m != NULL, "load qwen2 file: %s", kvq_last_error());
    if (m) {
        struct kvq_model_info info;
        kvq_model_get_info(m, &info);
        CHECK(!strcmp(info.arch, "qwen2"), "architecture %s", info.arch);
        struct kvq_context_params cp;
        kvq_context_params_default(&cp);
        cp.n_ctx = 64;
        cp.n_threads = 2;
        double worst = 0;
        for (int p = 0; p < REFS_PROMPTS; p++) {
            struct kvq_context *ctx = kvq_context_new(m, &cp);
            bool all[REFS_MAX_IDS];
            for (int t = 0; t < refs[p].n_ids; t++) all[t] = true;
            struct kvq_batch b = {.n_tokens = refs[p].n_ids, .tokens = refs[p].ids, .logits = all};
            CHECK(kvq_decode(ctx, &b) == 0, "decode: %s", kvq_last_error());
            float *want = refs_logits(&refs[p], info.n_vocab);
            for (int t = 0; want && t < refs[p].n_ids; t++) {
                const float *got = kvq_get_logits(ctx, t);
                for (int v = 0; v < info.n_vocab; v++)
                    worst = fmax(worst, fabs(got[v] - want[(size_t)t * info.n_vocab + v]));
            }
            free(want);
            kvq_context_free(ctx);
        }
        printf("qwen2 rewrite of tinydoc: max |logit - HF| = %.2e\n", worst);
        CHECK(worst < 1e-2, "qwen2 path differs from HF by %g", worst);
        kvq_model_free(m);
    }
    remove(path);
    return check_finish();
}
