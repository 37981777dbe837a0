/* Text <-> token ids, built from a GGUF file's tokenizer.* metadata.
 * SentencePiece-style (tokenizer.ggml.model = "llama") and byte-level BPE
 * ("gpt2", pre-tokenizer chosen by tokenizer.ggml.pre). Knows nothing of tensors. */
#ifndef KVQ_TOKENIZER_H
#define KVQ_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gguf_file;
struct tokenizer;

/* NULL on error (kvq_last_error()). The tokenizer copies what it needs; the
 * gguf file may be closed afterwards. */
struct tokenizer *tokenizer_from_gguf(const struct gguf_file *f);
void tokenizer_free(struct tokenizer *t);

int32_t tokenizer_n_vocab(const struct tokenizer *t);
int32_t tokenizer_bos(const struct tokenizer *t); /* -1 if none */
int32_t tokenizer_eos(const struct tokenizer *t); /* -1 if none */
bool tokenizer_add_bos(const struct tokenizer *t); /* metadata default */
bool tokenizer_add_eos(const struct tokenizer *t);
/* True for tokens that end generation (EOS, EOT, ...). */
bool tokenizer_is_eog(const struct tokenizer *t, int32_t id);

/* Encodes text (len bytes, need not be NUL-terminated). add_special: prepend BOS /
 * append EOS as the metadata says. parse_special: text like "<|eot_id|>" becomes the
 * special token instead of being split as plain text.
 * Writes up to max_tokens ids; returns the number of tokens the text needs (which may
 * exceed max_tokens: call again with a bigger buffer), or -1 on error. */
int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool add_special,
                     bool parse_special, int32_t *out, int max_tokens);

/* The bytes a token stands for (after byte-fallback / byte-level decoding, with the
 * SentencePiece space marker turned into a space). Control tokens give "" unless
 * render_special. Returns the byte count (may exceed buf_size: then buf holds a prefix),
 * or -1 for an id outside the vocabulary. */
int tokenizer_token_bytes(const struct tokenizer *t, int32_t id, bool render_special, char *buf,
                          int buf_size);

/* Streaming detokenizer: feeds tokens, emits only complete UTF-8 sequences, holds back
 * an incomplete tail until its continuation bytes arrive. Also drops the leading space
 * SentencePiece adds to the first token when the stream was told the text starts a
 * sequence (strip_leading_space). */
struct tokenizer_stream {
    const struct tokenizer *t;
    char pending[8];
    int n_pending;
    bool strip_leading_space;
};
void tokenizer_stream_init(struct tokenizer_stream *s, const struct tokenizer *t, bool strip_leading_space);
/* Appends the decoded bytes of id to out (capacity out_size); returns bytes written,
 * or -1 (state unchanged) for a bad id or when out_size cannot hold the output
 * (the longest token's bytes + 3 always suffice). */
int tokenizer_stream_feed(struct tokenizer_stream *s, int32_t id, char *out, int out_size);
/* Flushes any held-back bytes (invalid tails become U+FFFD). */
int tokenizer_stream_flush(struct tokenizer_stream *s, char *out, int out_size);

#endif
