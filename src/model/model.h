/* A Llama-family model: hyperparameters and weights read from a GGUF file, and the
 * forward pass over a batch of tokens from one or more sequences. Weights stay in
 * the mapped file; the KV cache is reached only through kvcache/kv_cache.h. */
#ifndef KVQ_MODEL_H
#define KVQ_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/weight.h"

struct gguf_file;
struct kv_cache;
struct backend;

enum model_arch { ARCH_LLAMA, ARCH_QWEN2, ARCH_QWEN3, ARCH_GEMMA3 };
/* The FFN's gate activation: SwiGLU (Llama, Qwen) or GELU-tanh (Gemma). */
enum ffn_act { FFN_SILU, FFN_GELU_TANH };

struct model_hparams {
    enum model_arch arch;
    char arch_name[32];
    int n_vocab, n_ctx_train, n_embd, n_layer, n_ff;
    int n_head, n_head_kv, head_dim;
    float rms_eps;
    float rope_base;
    int rope_dim;
    enum rope_pairing rope_pairing;
    float rope_linear_factor; /* positions are divided by it (1 = none) */
    int sliding_window;       /* span of the sliding layers; 0 = full attention */
    float embd_scale;         /* embeddings are multiplied by it (Gemma: sqrt(n_embd)) */
    float attn_scale;         /* query scale before softmax */
    enum ffn_act ffn_act;
};

/* Attention facts that vary per layer (Gemma 3: five sliding layers, then one global
 * with its own RoPE base and scaling). Uniform models have one set for every layer. */
struct layer_attn {
    int window;   /* sliding-window span in tokens; 0 = global */
    int rope_set; /* index of the layer's RoPE frequencies in model->rope_inv_freq */
};

#define MODEL_MAX_ROPE_SETS 2

struct layer_weights {
    const float *attn_norm, *ffn_norm;
    const float *q_norm, *k_norm; /* qwen3, gemma3; NULL otherwise */
    const float *post_attn_norm, *post_ffn_norm; /* gemma3: norms of the block outputs */
    const float *bq, *bk, *bv;    /* qwen2; NULL otherwise */
    struct weight wq, wk, wv, wo, w_gate, w_up, w_down;
};

struct model {
    struct model_hparams hp;
    struct gguf_file *file;
    bool *tensor_taken; /* while loading: the file's tensors the model took (the rest are refused) */
    struct weight tok_embd, output;
    const float *output_norm;
    struct layer_weights *layers;
    struct layer_attn *layer_attn; /* [n_layer] */
    int n_rope_sets;
    float *rope_inv_freq; /* [n_rope_sets][rope_dim / 2] */
    float rope_linear_factor[MODEL_MAX_ROPE_SETS]; /* positions are divided by it, per set */
    uint64_t n_params;
    size_t weight_bytes;
};

/* A layer's product weights: i in [0, MODEL_LAYER_PRODUCTS) gives q, k, v, o, gate,
 * up, down. */
#define MODEL_LAYER_PRODUCTS 7
const struct weight *model_layer_product(const struct layer_weights *L, int i);

/* Loads a model (weights mmapped). NULL with kvq_last_error() on failure. */
struct model *model_load(const char *path);
void model_free(struct model *m);
/* The file's name for its weight type mix, e.g. "q8_0" or "f16 (mixed)". */
const char *model_weight_type_name(const struct model *m);

/* One sequence's share of a batch: tokens [first, first + n) of the batch, at
 * positions following what its caches already hold. */
struct fwd_seq {
    int first, n;
    struct kv_cache **caches; /* [n_layer] */
};

struct fwd_batch {
    int n_tokens;
    const int32_t *tokens;
    int n_seqs;
    const struct fwd_seq *seqs;
    int n_logits;             /* rows of logits wanted */
    const int32_t *logit_rows; /* batch indices whose logits are wanted */
    float *hidden; /* set (a backend with host memory only): those rows' final normed hidden
                    * states [n_logits][n_embd] go here instead of logits */
    /* draws set (a backend with ops->draw and device logits only): each row is settled
     * where the logits are, as draws[n_logits] say, its results in draw_out (backend.h;
     * BE_ROW_LOGITS rows' logits there too, none to forward_run's) */
    const struct be_draw *draws;
    const struct be_draw_op *draw_ops;
    int n_draw_ops;
    const struct be_draw_out *draw_out;
};

struct forward;

/* Buffers (in the backend's memory) for batches of up to max_tokens tokens, up to
 * max_logits of them with logits. */
struct forward *forward_new(const struct model *m, struct backend *be, int max_tokens, int max_logits);
void forward_free(struct forward *f);
/* Runs the batch, appends its K/V to the caches, writes logits
 * [n_logits][n_vocab]. 0, or -1 with kvq_last_error() (e.g. cache full). */
int forward_run(struct forward *f, const struct fwd_batch *b, float *logits);
/* Copies row `row` of the last pass's logits as draws left them (the backend's memory,
 * a backend with ops->draw) to dst [n_vocab] (host_alloc memory), there after the
 * backend's sync; before the next pass. */
void forward_read_logits(struct forward *f, int row, float *dst);

#endif
