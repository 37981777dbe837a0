/* Reads hyperparameters and locates weights of a Llama-family GGUF model. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "model/model.h"

static bool arch_from_name(const char *name, enum model_arch *arch) {
    if (strcmp(name, "llama") == 0 || strcmp(name, "mistral") == 0) *arch = ARCH_LLAMA;
    else if (strcmp(name, "qwen2") == 0) *arch = ARCH_QWEN2;
    else if (strcmp(name, "qwen3") == 0) *arch = ARCH_QWEN3;
    else if (strcmp(name, "gemma3") == 0) *arch = ARCH_GEMMA3;
    else return false;
    return true;
}

/* Reads "<arch>.<suffix>" as an int; `required` makes a missing key an error. */
static int get_int(const struct gguf_file *f, const char *arch, const char *suffix, int *out, bool required) {
    char key[128];
    uint32_t v;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (gguf_get_u32(f, key, &v)) {
        if (v > (1u << 30)) return kvq_error_code(KVQ_ERR_FORMAT, "model metadata %s = %u is out of range", key, v);
        *out = (int)v;
        return 0;
    }
    if (gguf_find(f, key)) return kvq_error_code(KVQ_ERR_FORMAT, "model metadata %s has an unexpected type", key);
    return required ? kvq_error_code(KVQ_ERR_FORMAT, "model metadata %s is missing", key) : 0;
}

/* Every float hyperparameter read here (epsilons, rope bases and factors) is a
 * finite positive number; a negative, NaN or inf one would run and print garbage. */
static int get_float(const struct gguf_file *f, const char *arch, const char *suffix, float *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (gguf_get_f32(f, key, out) && !(isfinite(*out) && *out > 0))
        return kvq_error_code(KVQ_ERR_FORMAT, "model metadata %s = %g: expected a finite positive number", key,
                              (double)*out);
    return 0;
}

static int read_hparams(const struct gguf_file *f, struct model_hparams *hp) {
    if (!gguf_get_str(f, "general.architecture", hp->arch_name, sizeof hp->arch_name))
        return kvq_error_code(KVQ_ERR_FORMAT, "model has no general.architecture");
    if (!arch_from_name(hp->arch_name, &hp->arch))
        return kvq_error_code(KVQ_ERR_UNSUPPORTED,
                              "unsupported architecture '%s' (supported: llama, mistral, qwen2, qwen3, gemma3)",
                              hp->arch_name);
    const char *a = hp->arch_name;
    if (get_int(f, a, "embedding_length", &hp->n_embd, true) || get_int(f, a, "block_count", &hp->n_layer, true) ||
        get_int(f, a, "feed_forward_length", &hp->n_ff, true) ||
        get_int(f, a, "attention.head_count", &hp->n_head, true))
        return -1;
    hp->n_head_kv = hp->n_head;
    hp->n_ctx_train = 2048;
    if (get_int(f, a, "attention.head_count_kv", &hp->n_head_kv, false) ||
        get_int(f, a, "context_length", &hp->n_ctx_train, false))
        return -1;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_ff <= 0 || hp->n_head <= 0 || hp->n_head_kv <= 0 ||
        hp->n_head % hp->n_head_kv != 0)
        return kvq_error_code(KVQ_ERR_FORMAT, "invalid model shape: embd %d, layers %d, ffn %d, heads %d/%d",
                              hp->n_embd, hp->n_layer, hp->n_ff, hp->n_head, hp->n_head_kv);
    hp->head_dim = hp->n_embd / hp->n_head;
    if (get_int(f, a, "attention.key_length", &hp->head_dim, false)) return -1;
    int vlen = hp->head_dim;
    if (get_int(f, a, "attention.value_length", &vlen, false)) return -1;
    if (vlen != hp->head_dim)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "models with key_length != value_length are not supported");
    if (hp->head_dim <= 0 || hp->head_dim % 2 != 0 || hp->head_dim > 1024)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "unsupported head dimension %d", hp->head_dim);
    hp->rope_dim = hp->head_dim;
    if (get_int(f, a, "rope.dimension_count", &hp->rope_dim, false)) return -1;
    if (hp->rope_dim <= 0 || hp->rope_dim > hp->head_dim || hp->rope_dim % 2 != 0)
        return kvq_error_code(KVQ_ERR_FORMAT, "invalid rope.dimension_count %d", hp->rope_dim);
    hp->rms_eps = 1e-5f;
    hp->rope_base = 10000.0f;
    if (get_float(f, a, "attention.layer_norm_rms_epsilon", &hp->rms_eps) ||
        get_float(f, a, "rope.freq_base", &hp->rope_base))
        return -1;
    hp->rope_pairing = hp->arch == ARCH_LLAMA ? ROPE_ADJACENT : ROPE_HALVES;
    /* key_length is the query scale's dimension too (Gemma 3 writes it explicitly) */
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    hp->embd_scale = hp->arch == ARCH_GEMMA3 ? sqrtf((float)hp->n_embd) : 1.0f;
    hp->ffn_act = hp->arch == ARCH_GEMMA3 ? FFN_GELU_TANH : FFN_SILU;
    hp->rope_linear_factor = 1.0f;
    char key[128], scaling[32] = "";
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    gguf_get_str(f, key, scaling, sizeof scaling);
    if (strcmp(scaling, "linear") == 0) {
        if (get_float(f, a, "rope.scaling.factor", &hp->rope_linear_factor)) return -1;
    } else if (scaling[0] && strcmp(scaling, "none") != 0 && strcmp(scaling, "llama3") != 0) {
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "unsupported rope scaling '%s' (supported: none, linear, llama3)",
                              scaling);
    }
    if (get_int(f, a, "attention.sliding_window", &hp->sliding_window, hp->arch == ARCH_GEMMA3)) return -1;
    if (hp->arch == ARCH_GEMMA3 && hp->sliding_window <= 0)
        return kvq_error_code(KVQ_ERR_FORMAT, "invalid %s.attention.sliding_window %d", a, hp->sliding_window);
    return 0;
}

/* Gemma 3: five sliding layers then one global, repeating; sliding layers use RoPE
 * base 10000 without scaling. Neither is in the file: llama.cpp hard-codes both. */
#define GEMMA3_PATTERN 6
#define GEMMA3_LOCAL_ROPE_BASE 10000.0f

static int init_layer_attn(struct model *m) {
    const struct model_hparams *hp = &m->hp;
    m->layer_attn = calloc((size_t)hp->n_layer, sizeof *m->layer_attn);
    if (!m->layer_attn) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    m->n_rope_sets = hp->arch == ARCH_GEMMA3 ? 2 : 1;
    for (int il = 0; il < hp->n_layer; il++) {
        struct layer_attn *la = &m->layer_attn[il];
        bool local = hp->arch == ARCH_GEMMA3 && il % GEMMA3_PATTERN < GEMMA3_PATTERN - 1;
        /* other models: the file's window (if any) applies to every layer */
        la->window = hp->arch == ARCH_GEMMA3 ? (local ? hp->sliding_window : 0) : hp->sliding_window;
        la->rope_set = local ? 1 : 0;
    }
    return 0;
}

/* The tensor of that name, marked as taken by the model. */
static const struct gguf_tensor *take_tensor(struct model *m, const char *name) {
    const struct gguf_tensor *t = gguf_find_tensor(m->file, name);
    if (t) m->tensor_taken[t - gguf_tensor_at(m->file, 0)] = true;
    return t;
}

/* Metadata and tensors must agree: a tensor no layer took (block_count smaller than
 * the layers present, a misspelt or foreign name) would silently go unused. */
static int check_all_taken(const struct model *m) {
    for (uint64_t i = 0; i < gguf_n_tensors(m->file); i++) {
        if (m->tensor_taken[i]) continue;
        const struct gguf_tensor *t = gguf_tensor_at(m->file, i);
        return kvq_error_code(
            KVQ_ERR_FORMAT,
            "tensor '%.*s' is not used by a %d-layer %s model (%s.block_count = %d): the metadata does "
            "not match the tensors",
            (int)t->name.len, t->name.ptr, m->hp.n_layer, m->hp.arch_name, m->hp.arch_name, m->hp.n_layer);
    }
    return 0;
}

/* Inverse RoPE frequencies, with Llama-3 long-context scaling when the file asks
 * for it (a rope_freqs tensor holds per-pair divisors; or the metadata parameters). */
static int init_rope(struct model *m) {
    const struct model_hparams *hp = &m->hp;
    int n = hp->rope_dim / 2;
    m->rope_inv_freq = malloc(sizeof(float) * (size_t)n * (size_t)m->n_rope_sets);
    if (!m->rope_inv_freq) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    for (int i = 0; i < n; i++) m->rope_inv_freq[i] = (float)(1.0 / pow(hp->rope_base, (2.0 * i) / hp->rope_dim));
    m->rope_linear_factor[0] = hp->rope_linear_factor;
    if (m->n_rope_sets > 1) { /* Gemma 3's sliding layers: local base, no scaling */
        for (int i = 0; i < n; i++)
            m->rope_inv_freq[n + i] = (float)(1.0 / pow(GEMMA3_LOCAL_ROPE_BASE, (2.0 * i) / hp->rope_dim));
        m->rope_linear_factor[1] = 1.0f;
    }

    const struct gguf_tensor *t = take_tensor(m, "rope_freqs.weight");
    if (t) {
        if (t->type != KVQ_F32 || t->ne[0] != (uint64_t)n)
            return kvq_error_code(KVQ_ERR_FORMAT, "rope_freqs.weight must be f32 with %d values", n);
        const float *div = t->data;
        for (int i = 0; i < n; i++) m->rope_inv_freq[i] /= div[i];
        return 0;
    }
    char key[128], scaling[32] = "";
    snprintf(key, sizeof key, "%s.rope.scaling.type", hp->arch_name);
    if (!gguf_get_str(m->file, key, scaling, sizeof scaling) || strcmp(scaling, "llama3") != 0) return 0;
    /* Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between. */
    float factor = 8, low = 1, high = 4;
    int orig_ctx = 8192;
    if (get_float(m->file, hp->arch_name, "rope.scaling.factor", &factor) ||
        get_float(m->file, hp->arch_name, "rope.scaling.low_freq_factor", &low) ||
        get_float(m->file, hp->arch_name, "rope.scaling.high_freq_factor", &high) || get_int(m->file, hp->arch_name, "rope.scaling.original_context_length", &orig_ctx, false)) return -1;
    double low_wavelen = orig_ctx / low, high_wavelen = orig_ctx / high;
    for (int i = 0; i < n; i++) {
        double f = m->rope_inv_freq[i], wavelen = 2 * M_PI / f;
        if (wavelen > low_wavelen) f /= factor;
        else if (wavelen >= high_wavelen) {
            double smooth = (orig_ctx / wavelen - low) / (high - low);
            f = (1 - smooth) * f / factor + smooth * f;
        }
        m->rope_inv_freq[i] = (float)f;
    }
    return 0;
}

static int find_weight(struct model *m, const char *name, int64_t cols, int64_t rows, bool required, struct weight *w) {
    const struct gguf_tensor *t = take_tensor(m, name);
    memset(w, 0, sizeof *w);
    if (!t) return required ? kvq_error_code(KVQ_ERR_FORMAT, "model is missing tensor '%s'", name) : 0;
    if (t->ne[0] != (uint64_t)cols || t->ne[1] != (uint64_t)rows || t->ne[2] != 1 || t->ne[3] != 1)
        return kvq_error_code(KVQ_ERR_FORMAT, "tensor '%s' has shape [%llu, %llu], expected [%lld, %lld]", name,
                              (unsigned long long)t->ne[0], (unsigned long long)t->ne[1], (long long)cols,
                              (long long)rows);
    if (!kvq_dtype_supported(t->type))
        return kvq_error_code(KVQ_ERR_UNSUPPORTED, "unsupported tensor type %s in tensor %s", kvq_dtype_name(t->type),
                              name);
    w->type = t->type;
    w->data = t->data;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = kvq_dtype_row_bytes(t->type, (uint64_t)cols);
    w->file = m->file;
    m->n_params += (uint64_t)rows * (uint64_t)cols;
    m->weight_bytes += t->nbytes;
    return 0;
}

/* A 1-D f32 vector of n values (norm weights, biases). */
static int find_vector(struct model *m, const char *name, int64_t n, bool required, const float **out) {
    const struct gguf_tensor *t = take_tensor(m, name);
    *out = NULL;
    if (!t) return required ? kvq_error_code(KVQ_ERR_FORMAT, "model is missing tensor '%s'", name) : 0;
    if (t->type != KVQ_F32 || t->ne[0] != (uint64_t)n || t->ne[1] != 1)
        return kvq_error_code(KVQ_ERR_FORMAT, "tensor '%s' must be f32 with %lld values (found %s, %llu)", name,
                              (long long)n, kvq_dtype_name(t->type), (unsigned long long)t->ne[0]);
    *out = t->data;
    m->n_params += (uint64_t)n;
    m->weight_bytes += t->nbytes;
    return 0;
}

static int load_layer(struct model *m, int il) {
    const struct model_hparams *hp = &m->hp;
    struct layer_weights *L = &m->layers[il];
    int64_t q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    char name[96];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d.%s", il, s), name)
    if (find_vector(m, NAME("attn_norm.weight"), hp->n_embd, true, &L->attn_norm) ||
        find_vector(m, NAME("ffn_norm.weight"), hp->n_embd, true, &L->ffn_norm) ||
        find_weight(m, NAME("attn_q.weight"), hp->n_embd, q_dim, true, &L->wq) ||
        find_weight(m, NAME("attn_k.weight"), hp->n_embd, kv_dim, true, &L->wk) ||
        find_weight(m, NAME("attn_v.weight"), hp->n_embd, kv_dim, true, &L->wv) ||
        find_weight(m, NAME("attn_output.weight"), q_dim, hp->n_embd, true, &L->wo) ||
        find_weight(m, NAME("ffn_gate.weight"), hp->n_embd, hp->n_ff, true, &L->w_gate) ||
        find_weight(m, NAME("ffn_up.weight"), hp->n_embd, hp->n_ff, true, &L->w_up) ||
        find_weight(m, NAME("ffn_down.weight"), hp->n_ff, hp->n_embd, true, &L->w_down))
        return -1;
    L->wq.split = L->wk.split = L->wv.split = L->w_gate.split = L->w_up.split = WEIGHT_BY_ROWS;
    L->wo.split = L->w_down.split = WEIGHT_BY_COLS;
    bool has_bias = hp->arch == ARCH_QWEN2;
    if (find_vector(m, NAME("attn_q.bias"), q_dim, has_bias, &L->bq) ||
        find_vector(m, NAME("attn_k.bias"), kv_dim, has_bias, &L->bk) ||
        find_vector(m, NAME("attn_v.bias"), kv_dim, has_bias, &L->bv))
        return -1;
    bool has_qk_norm = hp->arch == ARCH_QWEN3 || hp->arch == ARCH_GEMMA3, gemma = hp->arch == ARCH_GEMMA3;
    if (find_vector(m, NAME("attn_q_norm.weight"), hp->head_dim, has_qk_norm, &L->q_norm) ||
        find_vector(m, NAME("attn_k_norm.weight"), hp->head_dim, has_qk_norm, &L->k_norm) ||
        find_vector(m, NAME("post_attention_norm.weight"), hp->n_embd, gemma, &L->post_attn_norm) ||
        find_vector(m, NAME("post_ffw_norm.weight"), hp->n_embd, gemma, &L->post_ffn_norm))
        return -1;
#undef NAME
    return 0;
}

struct model *model_load(const char *path) {
    struct model *m = calloc(1, sizeof *m);
    if (!m) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        return NULL;
    }
    m->file = gguf_open(path);
    if (!m->file || read_hparams(m->file, &m->hp) != 0) goto fail;
    if (gguf_n_tensors(m->file) == 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "'%s' holds no weights (a vocabulary-only file: only 'kvq tokenize' can use it)",
                       path);
        goto fail;
    }
    struct model_hparams *hp = &m->hp;
    if (!(m->tensor_taken = calloc(gguf_n_tensors(m->file), sizeof *m->tensor_taken))) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        goto fail;
    }
    const struct gguf_value *tokens = gguf_get_arr(m->file, "tokenizer.ggml.tokens", GGUF_TYPE_STRING);
    hp->n_vocab = tokens ? (int)tokens->arr.n : 0;
    if (get_int(m->file, hp->arch_name, "vocab_size", &hp->n_vocab, false)) goto fail;
    const struct gguf_tensor *emb = gguf_find_tensor(m->file, "token_embd.weight");
    if (emb && hp->n_vocab == 0) hp->n_vocab = (int)emb->ne[1];
    if (hp->n_vocab <= 0) {
        kvq_error_code(KVQ_ERR_FORMAT, "model has no vocabulary");
        goto fail;
    }
    if (find_weight(m, "token_embd.weight", hp->n_embd, hp->n_vocab, true, &m->tok_embd) ||
        find_vector(m, "output_norm.weight", hp->n_embd, true, &m->output_norm) ||
        find_weight(m, "output.weight", hp->n_embd, hp->n_vocab, false, &m->output))
        goto fail;
    if (!m->output.data) m->output = m->tok_embd; /* tied embeddings */
    m->tok_embd.lookup = true;
    /* every layer has several tensors: a block_count beyond the tensor count is a
     * lie that would otherwise size the layer table (2^30 layers: 360 GB) */
    if ((uint64_t)hp->n_layer > gguf_n_tensors(m->file)) {
        kvq_error_code(KVQ_ERR_FORMAT, "model metadata %s.block_count = %d, but the file holds only %llu tensors",
                       hp->arch_name, hp->n_layer, (unsigned long long)gguf_n_tensors(m->file));
        goto fail;
    }
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        kvq_error_code(KVQ_ERR_OOM, "out of memory");
        goto fail;
    }
    for (int il = 0; il < hp->n_layer; il++)
        if (load_layer(m, il) != 0) goto fail;
    if (init_layer_attn(m) != 0 || init_rope(m) != 0 || check_all_taken(m) != 0) goto fail;
    free(m->tensor_taken);
    m->tensor_taken = NULL;
    return m;
fail:
    model_free(m);
    return NULL;
}

const struct weight *model_layer_product(const struct layer_weights *L, int i) {
    const struct weight *ws[MODEL_LAYER_PRODUCTS] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    return ws[i];
}

void model_free(struct model *m) {
    if (!m) return;
    gguf_close(m->file);
    free(m->tensor_taken);
    free(m->layers);
    free(m->rope_inv_freq);
    free(m->layer_attn);
    free(m);
}

const char *model_weight_type_name(const struct model *m) {
    static _Thread_local char buf[48];
    uint32_t t = m->layers[0].w_gate.type;
    bool mixed = false;
    for (int il = 0; il < m->hp.n_layer; il++)
        for (int i = 0; i < MODEL_LAYER_PRODUCTS; i++) mixed |= model_layer_product(&m->layers[il], i)->type != t;
    snprintf(buf, sizeof buf, "%s%s", kvq_dtype_name(t), mixed ? " (mixed)" : "");
    return buf;
}
