/* kvq: LLM inference with a quantized KV cache. The public engine API.
 *
 * A model is loaded once; a context holds the KV caches of up to n_seq sequences
 * and runs batches of tokens from any of them together. Functions that can fail
 * return NULL or a negative number; kvq_last_error() then says why in one line, and
 * kvq_last_error_code() what kind of failure it was. */
#ifndef KVQ_H
#define KVQ_H

/* The API's version: the minor number grows with additions, the major one with
 * changes that break callers. */
#define KVQ_VERSION_MAJOR 0
#define KVQ_VERSION_MINOR 1
#define KVQ_VERSION_PATCH 0
#define KVQ_VERSION_STRING "0.1.0"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t kvq_token;

struct kvq_model;
struct kvq_context;
struct kvq_sampler;
struct kvq_detok;

/* What kind of failure the last error on this thread was, for a caller to act on
 * (the message is for people). */
enum kvq_err {
    KVQ_OK = 0,
    KVQ_ERR_INVALID,      /* a bad argument, request or state (the default) */
    KVQ_ERR_IO,           /* a file could not be opened, read or written */
    KVQ_ERR_FORMAT,       /* a file's contents are malformed or of another kind */
    KVQ_ERR_UNSUPPORTED,  /* valid, but not what this build or device can do */
    KVQ_ERR_OOM,          /* out of host memory */
    KVQ_ERR_DEVICE,       /* the GPU failed or ran out of memory */
    KVQ_ERR_BUDGET,       /* the KV cache budget is exhausted (free sequences or prefixes, retry) */
    KVQ_ERR_CONTEXT_FULL, /* a sequence would exceed the context */
};

const char *kvq_last_error(void);
enum kvq_err kvq_last_error_code(void);

/* ---- model ---------------------------------------------------------------- */

struct kvq_model *kvq_model_load(const char *path);
/* Loads only the tokenizer of a GGUF file, which may hold no weights (llama.cpp's
 * vocabulary-only files). Such a model supports the tokenizer functions only. */
struct kvq_model *kvq_model_load_vocab(const char *path);
void kvq_model_free(struct kvq_model *m);

struct kvq_model_info {
    const char *arch;        /* "llama", "qwen2", "qwen3", "gemma3" */
    const char *weight_type; /* e.g. "q8_0" */
    int n_vocab, n_ctx_train, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    uint64_t n_params;
    size_t weight_bytes;
};
void kvq_model_get_info(const struct kvq_model *m, struct kvq_model_info *info);
/* A string from the model file's metadata (e.g. "tokenizer.chat_template") copied
 * NUL-terminated into buf; returns its length (retry with a larger buffer when that
 * is >= size), -1 when the key is missing or not a string. */
int kvq_model_meta_str(const struct kvq_model *m, const char *key, char *buf, size_t size);

/* ---- tokenizer ------------------------------------------------------------ */

/* Encodes text; add_special adds BOS/EOS as the model's metadata says; parse_special
 * turns special-token text (e.g. "<|eot_id|>") into those tokens. Returns the number
 * of tokens the text needs (may exceed max: retry with a larger buffer), -1 on error. */
int kvq_tokenize(const struct kvq_model *m, const char *text, size_t len, bool add_special, bool parse_special,
                 kvq_token *out, int max);
kvq_token kvq_token_bos(const struct kvq_model *m);
kvq_token kvq_token_eos(const struct kvq_model *m);
/* True for tokens that end a generation (EOS, end-of-turn, ...). */
bool kvq_token_is_eog(const struct kvq_model *m, kvq_token t);
/* The bytes token t stands for alone (byte tokens decoded, control tokens as their
 * text), copied into buf: not NUL-terminated, possibly part of a UTF-8 sequence.
 * Returns their count (buf holds a prefix when that is > size), -1 for a bad id. */
int kvq_token_bytes(const struct kvq_model *m, kvq_token t, char *buf, int size);

/* Streaming detokenizer: emits only complete UTF-8 sequences. */
struct kvq_detok *kvq_detok_new(const struct kvq_model *m);
/* Appends the text of token t to out (capacity size); returns the bytes written. */
int kvq_detok_feed(struct kvq_detok *d, kvq_token t, char *out, int size);
int kvq_detok_flush(struct kvq_detok *d, char *out, int size);
void kvq_detok_free(struct kvq_detok *d);

/* ---- KV cache settings ---------------------------------------------------- */

#define KVQ_KV_NF (-1) /* a group size: normal-float rows (kernels/kv_quant.h) */
#define KVQ_MAX_LAYER_BITS 64
/* Layers first..last whose keys and values take other bits than the rest (same row
 * kind and groups): mixed precision, e.g. as `kvq calibrate-kv` picks it. */
struct kvq_layer_bits {
    int first, last;
    int k_bits, v_bits;
};
struct kvq_kv_config {
    int k_bits, v_bits;   /* 16/32: float; 2,3,4,5,6,8: quantized */
    int k_group, v_group; /* quantization group sizes (values along head_dim), or
                           * KVQ_KV_NF: normal-float rows (bits 2..5, one scale a row) */
    int max_size;         /* rotating window in tokens (0: unbounded) */
    int keep;             /* tokens kept at the start when rotating */
    int quantized_start;  /* tokens held in 16 bits before quantizing */
    bool hadamard;        /* randomized Hadamard rotation before quantizing */
    int residual;         /* quantized: the newest R tokens (and the first `keep`) also held in f16 */
    bool swa_full;        /* sliding-window layers keep every token like global ones (their
                           * attention still spans the window): an all-global cache, to compare */
    int n_layer_bits;     /* quantized caches: layer_bits[0..n) override k_bits/v_bits (the first
                           * range naming a layer wins); bits quantized, as the row kind takes */
    struct kvq_layer_bits layer_bits[KVQ_MAX_LAYER_BITS];
};
/* Layer il's key and value bits: its layer_bits range's, else k_bits and v_bits. */
void kvq_kv_layer_bits(const struct kvq_kv_config *kv, int il, int *k_bits, int *v_bits);
/* Whether a and b store rows alike: the same bits in every layer and the same groups. */
bool kvq_kv_same_format(const struct kvq_kv_config *a, const struct kvq_kv_config *b);
/* kv's per-layer bits as --kv-layer-bits takes them: the ranges of each width in turn
 * ("2-3,5=5,4 7=8,8"; "" for none); the length, or -1 when size is too small. */
int kvq_kv_layer_bits_name(const struct kvq_kv_config *kv, char *buf, size_t size);
/* f16 keys and values; for quantized bits: groups of 64, Hadamard rotation on, keep 4. */
void kvq_kv_config_default(struct kvq_kv_config *kv);
/* Bytes one token takes in the cache of the whole model with this config (summed
 * over layers; a sliding-window layer stops growing at its window). */
size_t kvq_kv_token_bytes(const struct kvq_model *m, const struct kvq_kv_config *kv);
/* The constant f16 overhead of the residual window and sinks, whole model, in bytes:
 * a sequence of n tokens takes n x kvq_kv_token_bytes + this (once n > residual + keep;
 * a multi-token batch's rows are held in f16 too until the next decode call). */
size_t kvq_kv_window_bytes(const struct kvq_model *m, const struct kvq_kv_config *kv);

/* ---- context -------------------------------------------------------------- */

/* KVQ_DEVICE_CUDA: weights, activations and a device copy of the KV cache on the
 * first NVIDIA GPU, or split over several (kvq_context_params.tp) (a kvq built with
 * -DKVQ_CUDA=ON); the KV policy stays on the host. */
enum kvq_device { KVQ_DEVICE_CPU, KVQ_DEVICE_CUDA };
#define KVQ_MAX_GPUS 8

struct kvq_context_params {
    int n_ctx;     /* max tokens per sequence (0: the model's training context) */
    int n_seq;     /* sequences the context can hold */
    int n_batch;   /* max tokens per forward pass (longer batches are split) */
    /* max rows of logits per forward pass (0: n_batch): a GPU keeps a buffer of this
     * many rows of the vocabulary; a batch asking for more takes more passes (a server
     * asks for one a sequence) */
    int max_logit_rows;
    int n_threads; /* <= 0: one per CPU */
    enum kvq_device device; /* where the model runs (KVQ_DEVICE_CPU by default) */
    /* KVQ_DEVICE_CUDA: products of more than 16 tokens read f16 copies of the
     * quantized weights, each made at its first such product while the GPU keeps a
     * reserve free (2 bytes a weight more device memory); true: they dequantize the
     * weights in bands at every product instead (slower prefill and wide batches) */
    bool gpu_f16_weights_off;
    /* KVQ_DEVICE_CUDA: tensor parallelism over tp GPUs of this host (0 or 1: one GPU;
     * at most KVQ_MAX_GPUS), which must divide the model's KV heads: gpus[0..tp) when
     * n_gpus == tp, else GPUs 0..tp-1 */
    int tp;
    int n_gpus;
    int gpus[KVQ_MAX_GPUS];
    struct kvq_kv_config kv;
    size_t kv_budget_bytes; /* KV blocks in use at once, all sequences and held prefixes
                             * (0: what n_ctx tokens of each of the n_seq sequences need) */
};
void kvq_context_params_default(struct kvq_context_params *p);
/* A CPU context keeps (on CPUs whose kernels have that path) its own copy of the
 * model's Q8_0/Q4_0 weights, in the layout its kernels read fastest. */
struct kvq_context *kvq_context_new(struct kvq_model *m, const struct kvq_context_params *p);
void kvq_context_free(struct kvq_context *c);
int kvq_context_n_ctx(const struct kvq_context *c);

/* Tokens of one or more sequences. Each sequence's tokens continue where it left
 * off, in order. logits[i] asks for the logits after token i (NULL: last token only). */
struct kvq_batch {
    int n_tokens;
    const kvq_token *tokens;
    const int32_t *seq_ids; /* NULL: all in sequence 0 */
    const bool *logits;
    /* true: of each row of logits asked for, only its KVQ_TOP_N largest are kept
     * (kvq_get_top), not the logits: on a GPU only those cross to the host, which is
     * all a greedy draw needs (kvq_sampler_top_enough) */
    bool top_only;
    /* Optional, per token: the sampler that draws the token after token i, where its
     * logits are asked for (NULL: none; a sampler at most once a batch). kvq_decode
     * then draws it (kvq_get_drawn), on a GPU where the logits are when the sampler's
     * settings allow (only the token crosses to the host), and the sampler advances as
     * kvq_sampler_sample's draw would; nothing is accepted. Such rows keep no logits. */
    struct kvq_sampler *const *samplers;
    /* Optional, per token with a sampler: the log-probabilities of the drawn token and
     * of the logprobs[i] (0..KVQ_LOGPROBS_MAX) most likely are wanted too (-1: none). */
    const int *logprobs;
};
#define KVQ_LOGPROBS_MAX 20
#define KVQ_TOP_N 8
int kvq_decode(struct kvq_context *c, const struct kvq_batch *b);
/* Logits after token i of the last batch ([n_vocab]); NULL if not requested (or the
 * batch kept only the largest). */
const float *kvq_get_logits(const struct kvq_context *c, int i);
/* The KVQ_TOP_N largest logits after token i of a top_only batch, best first (of equal
 * values the lower id first, as a greedy draw takes them), into vals and ids. 0, or -1
 * where none were kept. */
int kvq_get_top(const struct kvq_context *c, int i, float *vals, kvq_token *ids);
/* The token its sampler drew after token i of the last batch (kvq_batch.samplers), or
 * -1 where none did. */
kvq_token kvq_get_drawn(const struct kvq_context *c, int i);
/* The log-probabilities that draw was asked for (kvq_batch.logprobs), of the model's
 * distribution (the softmax of the logits as the model made them: no temperature,
 * bias or penalty): the drawn token's into *drawn, the k most likely tokens' into ids
 * and lps [k] (best first, of equal values the lower id; -inf where a probability is
 * 0). Returns k, or -1 where none were asked for. */
int kvq_get_logprobs(const struct kvq_context *c, int i, float *drawn, kvq_token *ids, float *lps);
/* The same from a row of logits x[n]: the k most likely into ids and lps; returns the
 * log of the sum of e^x (a token t's log-probability is x[t] less it). */
double kvq_logprobs(const float *x, int n, int k, kvq_token *ids, float *lps);

/* Pooling of a text's final hidden states (after the output norm) into one vector. */
enum kvq_pooling { KVQ_POOLING_MEAN, KVQ_POOLING_LAST };
/* The embedding of n tokens: their final hidden states pooled (the mean, or the last
 * token's), L2-normalized, written to out[n_embd]. Runs them through sequence seq,
 * which is empty before and after (CPU contexts only). 0, or -1 with an error. */
int kvq_embed(struct kvq_context *c, int seq, const kvq_token *tokens, int n, enum kvq_pooling pooling, float *out);

/* Tokens held by a sequence (its next position). */
int kvq_seq_len(const struct kvq_context *c, int seq);
/* Removes the last n tokens of a sequence; returns how many were removed (0 when a
 * rotating window no longer holds what the shorter sequence would see). */
int kvq_seq_trim(struct kvq_context *c, int seq, int n);
/* Keeps the first n tokens of a sequence (0, or -1 with nothing changed). */
int kvq_seq_keep_prefix(struct kvq_context *c, int seq, int n);
void kvq_seq_clear(struct kvq_context *c, int seq);
/* dst becomes a copy of src without copying: both share src's KV blocks, and each
 * copies a shared block only when it first writes into it (the partly filled last
 * one). Memory grows only by what they then append on their own. 0 or -1. */
int kvq_seq_fork(struct kvq_context *c, int src, int dst);

/* KV memory: bytes of the KV blocks in use (a block shared by several sequences or
 * held prefixes counts once) plus the f16 windows of quantized caches. The budget
 * bounds the blocks; a kvq_decode that would exceed it fails before writing anything
 * and every sequence stays as it was. */
size_t kvq_kv_bytes(const struct kvq_context *c);
size_t kvq_kv_budget(const struct kvq_context *c);
/* The sequence length at which this context runs a batch in two forward passes (0:
 * never): where the quantized caches of a backend that encodes rows on its devices
 * but cannot choose their value offsets there (tensor parallelism) choose them, since
 * rows past that point in the same pass would be encoded twice. A server ends prompt
 * chunks there; on the CPU and one GPU a prompt crosses it in one pass. */
int kvq_pass_split_tokens(const struct kvq_context *c);
/* KV blocks in use (0 once every sequence is cleared and every prefix freed). */
int64_t kvq_kv_blocks(const struct kvq_context *c);
/* Runs fn(arg, ith, nth) for ith in [0, nth) on the context's host threads, the
 * caller's as ith 0, and returns when every call has returned. For a caller's own
 * parallel work between decodes (a server's sampling): it shares the engine's
 * threads rather than keep threads of its own spinning beside them. */
void kvq_run_parallel(struct kvq_context *c, void (*fn)(void *arg, int ith, int nth), void *arg);

/* ---- held prefixes ---------------------------------------------------------- */

/* A sequence's KV state held outside any sequence slot: it shares the sequence's
 * blocks (nothing is copied) and keeps them alive after the slot moves on, so it can
 * be attached to any sequence later (what a prefix cache keeps). Owned by the caller;
 * free every prefix before its context. */
struct kvq_prefix;
struct kvq_prefix *kvq_prefix_hold(struct kvq_context *c, int seq);
/* The sequence becomes the held state (sharing its blocks); kvq_seq_keep_prefix then
 * shortens it to the part a new prompt has in common with it. 0 or -1. */
int kvq_prefix_attach(struct kvq_context *c, int seq, const struct kvq_prefix *p);
/* kvq_prefix_hold storing the prefix in another format: kv's bits and group sizes (the
 * rest is the context's). Its rows are re-encoded into new blocks (a copy, not shared;
 * lossy when fewer bits); kvq_prefix_attach then re-encodes them into the context's
 * format (again a copy). Same format as the context's (or kv NULL): kvq_prefix_hold.
 * Owned by the caller like any prefix; NULL with an error (e.g. the KV budget). */
struct kvq_prefix *kvq_prefix_hold_as(struct kvq_context *c, int seq, const struct kvq_kv_config *kv);
/* kvq_prefix_hold_as of a held prefix: a new prefix in kv's format (a copy; p stays as
 * it is). NULL with an error. */
struct kvq_prefix *kvq_prefix_convert(const struct kvq_prefix *p, const struct kvq_kv_config *kv);
int kvq_prefix_len(const struct kvq_prefix *p);
/* Makes the prefix's rows readable from another thread (kvq_prefix_save and
 * kvq_prefix_encode_blocks there): where the GPU alone holds them, copies them to host
 * memory now, waiting for the GPU. Call it on the thread that drives the context,
 * before handing the prefix over. 0, or -1 with an error. */
int kvq_prefix_fetch(const struct kvq_prefix *p);
/* The format the prefix is held in (the context's, or kvq_prefix_hold_as's). */
void kvq_prefix_kv_config(const struct kvq_prefix *p, struct kvq_kv_config *kv);
void kvq_prefix_free(struct kvq_prefix *p);
/* The layers grouped by cache kind, for reports on hybrid models (Gemma 3: sliding
 * layers keep a rotating window, global layers everything). */
struct kvq_kv_layer_kind {
    const char *kind; /* "dense", "quantized", "rotating", "quantized-rotating" (now) */
    int window;       /* the model's sliding window of these layers; 0 = global */
    int max_size;     /* their cache's rotating size; 0 = unbounded */
    int n_layers;
    size_t bytes; /* held now by these layers, all sequences */
};
/* Writes up to max groups; returns how many there are. */
int kvq_kv_layer_kinds(const struct kvq_context *c, struct kvq_kv_layer_kind *out, int max);

/* ---- saving and loading a sequence's KV cache ----------------------------- */

/* Writes the sequence's cache state to a file: versioned, checksummed, tied to the
 * model (a fingerprint of its hyperparameters and weights) and to the KV config. */
int kvq_seq_save(const struct kvq_context *c, int seq, const char *path);
/* Replaces the sequence's state with the file's. Fails with a clear error (and an
 * empty sequence) for another model, another KV config, an unknown version, or a
 * corrupt or truncated file. */
int kvq_seq_load(struct kvq_context *c, int seq, const char *path);

/* The same, also storing the tokens the sequence holds and the logits after its
 * last token (n_vocab floats; NULL: none), so generation continues without a
 * recomputation. Loaded arrays are malloc'd: release with kvq_seq_extra_free(). */
struct kvq_seq_extra {
    kvq_token *tokens;
    int n_tokens;
    float *logits; /* [n_vocab] or NULL */
};
int kvq_seq_save_ex(const struct kvq_context *c, int seq, const char *path, const kvq_token *tokens, int n_tokens,
                    const float *logits);
int kvq_seq_load_ex(struct kvq_context *c, int seq, const char *path, struct kvq_seq_extra *extra);
void kvq_seq_extra_free(struct kvq_seq_extra *e);
/* The same for a held prefix: a file kvq_seq_load_ex can read (when the prefix is in
 * the context's format), and back; a prefix saved from kvq_prefix_hold_as loads in
 * its own format. */
int kvq_prefix_save(const struct kvq_prefix *p, const char *path, const kvq_token *tokens, int n_tokens,
                    const float *logits);
struct kvq_prefix *kvq_prefix_load(struct kvq_context *c, const char *path, struct kvq_seq_extra *extra);
/* kvq_prefix_save's bytes in memory (*data malloc'd, *len bytes), no logits: what
 * kvq_prefix_decode reads back. 0, or -1 with an error. */
int kvq_prefix_encode(const struct kvq_prefix *p, const kvq_token *tokens, int n_tokens, void **data, size_t *len);
/* kvq_prefix_load of a file's bytes in memory, with every check it makes (name stands
 * for the path in its errors). */
struct kvq_prefix *kvq_prefix_decode(struct kvq_context *c, const void *data, size_t len, const char *name,
                                     struct kvq_seq_extra *extra);
/* A held prefix block by block (a shared store's values): blocks [first, first + count)
 * of KVQ_BLOCK_TOKENS positions, each one value holding every layer's rows of those
 * positions in format kv (bits and groups; the rest of kv must be the context's), the
 * model's fingerprint, kv, the block's position and tokens (tokens: the prefix's), and
 * a checksum. A prefix held in another format is re-encoded on private caches (outside
 * the KV budget), so another thread may call this while the prefix is held. *data
 * (malloc'd) holds the values one after another, lens[i] bytes each. 0, or -1. */
#define KVQ_BLOCK_TOKENS 64
int kvq_prefix_encode_blocks(const struct kvq_prefix *p, const struct kvq_kv_config *kv, const kvq_token *tokens,
                             int first, int count, void **data, size_t *lens);
/* Appends one such value of config kv to sequence seq, which must hold exactly the
 * positions before its block, with the checks kvq_prefix_decode makes (checksum, model,
 * config, position, finite values) and its tokens compared with tokens (the sequence's,
 * at least to the block's end); the rows are decoded and held in the context's format.
 * 0, or -1 with the error (KVQ_ERR_BUDGET: no KV room now) and the sequence unchanged. */
int kvq_seq_append_block(struct kvq_context *c, int seq, const struct kvq_kv_config *kv, const void *data, size_t len,
                         const kvq_token *tokens);
/* A fingerprint of the model's architecture, hyperparameters and weights (the one saved
 * files carry): replicas of one model agree on it. */
uint64_t kvq_model_fingerprint(const struct kvq_model *m);
/* Reads the KV config a saved file was written with (to make a matching context). */
int kvq_seq_file_kv_config(const char *path, struct kvq_kv_config *kv);

/* ---- sampling ------------------------------------------------------------- */

struct kvq_sampler_params {
    float temp;           /* <= 0: greedy */
    int top_k;            /* <= 0: off */
    float top_p;          /* >= 1: off */
    float min_p;          /* <= 0: off */
    float repeat_penalty; /* 1: off */
    int repeat_last_n;    /* tokens of history the penalty looks at */
    uint64_t seed;
};
void kvq_sampler_params_default(struct kvq_sampler_params *p);
struct kvq_sampler *kvq_sampler_new(const struct kvq_sampler_params *p, int n_vocab);
void kvq_sampler_free(struct kvq_sampler *s);
/* Picks the next token from logits (not modified). */
kvq_token kvq_sampler_sample(struct kvq_sampler *s, const float *logits);
/* True when the next draw is the best allowed one of the k largest logits: greedy,
 * with no bias, penalty or grammar in effect and fewer than k tokens banned. */
bool kvq_sampler_top_enough(const struct kvq_sampler *s, int k);
/* That draw from the k largest logits, best first (kvq_get_top): the token
 * kvq_sampler_sample would pick from the whole row. */
kvq_token kvq_sampler_sample_top(struct kvq_sampler *s, const kvq_token *ids, int k);
/* Records a token in the history (prompt and generated) for the repetition penalty. */
void kvq_sampler_accept(struct kvq_sampler *s, kvq_token t);
/* Records a generated token: in the history, as kvq_sampler_accept does, and, while a
 * frequency or presence penalty is set, in the counts they read (they see generated
 * tokens only: set them before the first). */
void kvq_sampler_accept_output(struct kvq_sampler *s, kvq_token t);
/* OpenAI's frequency and presence penalties: before each draw, a token generated c > 0
 * times loses c x frequency + presence from its logit. Both 0 (the default): off. */
void kvq_sampler_set_penalties(struct kvq_sampler *s, float frequency, float presence);
/* Adds bias[i] to the logit of ids[i] before each draw (OpenAI's logit_bias), replacing
 * an earlier list (n = 0: none). 0, or -1 for an id outside the vocabulary or out of memory. */
int kvq_sampler_set_logit_bias(struct kvq_sampler *s, const kvq_token *ids, const float *bias, int n);
/* Tokens never drawn until the next call (n = 0: none), e.g. the end-of-generation
 * tokens while an answer is shorter than asked for. 0, or -1 as above. */
int kvq_sampler_ban(struct kvq_sampler *s, const kvq_token *ids, int n);

/* ---- constrained decoding ------------------------------------------------- */

/* A grammar the generated text must follow, matched against each token's bytes (as
 * the detokenizer writes them). One per generated sequence: it holds how far that
 * sequence has come. The model must outlive it. */
struct kvq_grammar;
/* The text: prefix, then a JSON value valid under schema (a JSON Schema in JSON
 * text: objects, arrays with minItems/maxItems, enum, const, anyOf/oneOf, $ref into
 * $defs, strings with minLength/maxLength, number, integer, boolean, null;
 * {"type": "object"} is any JSON object), then suffix (both literal, NULL: none).
 * NULL with kvq_last_error() naming what is invalid or unsupported. */
struct kvq_grammar *kvq_grammar_from_json_schema(const struct kvq_model *m, const char *schema, size_t len,
                                                 const char *prefix, const char *suffix);
void kvq_grammar_free(struct kvq_grammar *g);
/* Sets the logits ([n_vocab]) of tokens the grammar does not allow next to -inf;
 * end-of-generation tokens are allowed only once the text is complete. Returns how
 * many tokens are allowed. */
int kvq_grammar_apply(struct kvq_grammar *g, float *logits);
/* Moves past token t; -1 (nothing changed) when the grammar does not allow it. */
int kvq_grammar_accept(struct kvq_grammar *g, kvq_token t);
/* The text is complete and nothing may follow it: generation is over. */
bool kvq_grammar_done(const struct kvq_grammar *g);
/* The sampler draws only tokens g allows (NULL: no constraint). g is not owned;
 * the caller moves it on with kvq_grammar_accept after each draw. */
int kvq_sampler_set_grammar(struct kvq_sampler *s, struct kvq_grammar *g);

#ifdef __cplusplus
}
#endif
#endif
