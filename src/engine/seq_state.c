/* Saving and loading one sequence's KV cache state (kvq_seq_save / kvq_seq_load).
 *
 * File format, version 3 (little-endian):
 *   char  magic[8] = "KVQCACHE"
 *   u32   version = 2
 *   u64   model fingerprint (FNV-1a 64 of arch, hyperparameters and weight samples)
 *   u32   n_layer, n_head, n_head_kv, head_dim, n_vocab
 *   i32   KV config: k_bits v_bits k_group v_group max_size keep quantized_start hadamard residual
 *         flags (bit 0: swa_full, bit 1: per-layer bits follow: i32 n, then n x i32 first last
 *         k_bits v_bits)
 *   i32   n_past
 *   u32   n_tokens, then i32 tokens[n_tokens]   (what the sequence holds; may be 0)
 *   u32   n_logits (0 or n_vocab), then f32 logits[n_logits] (after the last token)
 *   n_layer cache sections (kv_cache_save: kind, formats, offset, rotation index, rows)
 *   u64   FNV-1a 64 checksum of every byte before it
 * Readers check the magic, the version, the checksum, then the model and config,
 * and bound every count by the bytes actually present.
 * Each layer section holds that layer's own cache config (a sliding-window layer's
 * rotating size), so per-layer kinds are recorded and compared layer by layer.
 * Version 2 files (no flags) load as flags 0; version 1 files (no residual in the
 * config, 'KVL1' layer sections without window rows) also as residual 0. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/error.h"
#include "core/outfile.h"
#include "engine/engine_internal.h"
#include "kvcache/kv_cache.h"
#include "model/model.h"

#define SEQ_MAGIC "KVQCACHE"
#define SEQ_VERSION 3u

uint64_t engine_fnv1a(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static uint64_t weight_sample(uint64_t h, const struct weight *w) {
    if (!w->data) return h;
    size_t total = (size_t)w->rows * w->row_bytes, n = total < 4096 ? total : 4096;
    h = engine_fnv1a(h, w->data, n);
    return engine_fnv1a(h, (const uint8_t *)w->data + total - n, n);
}

uint64_t engine_fingerprint(const struct model *m) {
    const struct model_hparams *hp = &m->hp;
    uint64_t h = engine_fnv1a(ENGINE_FNV_INIT, hp->arch_name, strlen(hp->arch_name));
    int32_t ints[] = {hp->n_vocab, hp->n_ctx_train, hp->n_embd, hp->n_layer, hp->n_ff, hp->n_head, hp->n_head_kv,
                      hp->head_dim, hp->rope_dim, (int32_t)hp->rope_pairing, hp->sliding_window};
    float floats[] = {hp->rms_eps, hp->rope_base, hp->rope_linear_factor};
    h = engine_fnv1a(h, ints, sizeof ints);
    h = engine_fnv1a(h, floats, sizeof floats);
    h = weight_sample(h, &m->tok_embd);
    h = weight_sample(h, &m->output);
    h = engine_fnv1a(h, m->output_norm, sizeof(float) * (size_t)hp->n_embd);
    for (int il = 0; il < hp->n_layer; il++) h = weight_sample(h, &m->layers[il].wk);
    return h;
}

void engine_put_kv_config(struct kv_buf *b, const struct kvq_kv_config *kv) {
    int32_t v[] = {kv->k_bits, kv->v_bits, kv->k_group, kv->v_group, kv->max_size, kv->keep, kv->quantized_start,
                   kv->hadamard, kv->residual, kv->swa_full ? 1 : 0};
    if (kv->n_layer_bits > 0) v[9] |= 2;
    for (int i = 0; i < 10; i++) kv_buf_u32(b, (uint32_t)v[i]);
    if (kv->n_layer_bits <= 0) return; /* files without per-layer bits are as before */
    kv_buf_u32(b, (uint32_t)kv->n_layer_bits);
    for (int i = 0; i < kv->n_layer_bits; i++) {
        const struct kvq_layer_bits *l = &kv->layer_bits[i];
        int32_t w[] = {l->first, l->last, l->k_bits, l->v_bits};
        for (int j = 0; j < 4; j++) kv_buf_u32(b, (uint32_t)w[j]);
    }
}

/* The file's bytes, checksum included, in b (freed by the caller, also on failure). */
static int encode_caches(const struct kvq_context *c, const struct kvq_kv_config *kv, struct kv_cache *const *caches,
                         const kvq_token *tokens, int n_tokens, const float *logits, struct kv_buf *out) {
    const struct model *m = engine_model(c);
    const struct model_hparams *hp = &m->hp;
    if (n_tokens < 0 || (n_tokens > 0 && !tokens)) return kvq_error("invalid token list");
    for (int il = 0; il < hp->n_layer; il++) /* a GPU's rows first: its error, not the save's, is told */
        if (kv_cache_fetch(caches[il]) != 0) return -1;
    struct kv_buf b = {0};
    kv_buf_put(&b, SEQ_MAGIC, 8);
    kv_buf_u32(&b, SEQ_VERSION);
    kv_buf_u64(&b, engine_fingerprint(m));
    uint32_t dims[] = {(uint32_t)hp->n_layer, (uint32_t)hp->n_head, (uint32_t)hp->n_head_kv, (uint32_t)hp->head_dim,
                       (uint32_t)hp->n_vocab};
    for (int i = 0; i < 5; i++) kv_buf_u32(&b, dims[i]);
    engine_put_kv_config(&b, kv);
    kv_buf_u32(&b, (uint32_t)kv_cache_n_past(caches[0]));
    kv_buf_u32(&b, (uint32_t)n_tokens);
    for (int i = 0; i < n_tokens; i++) kv_buf_u32(&b, (uint32_t)tokens[i]);
    kv_buf_u32(&b, logits ? (uint32_t)hp->n_vocab : 0);
    for (int i = 0; logits && i < hp->n_vocab; i++) {
        uint32_t u;
        memcpy(&u, &logits[i], 4);
        kv_buf_u32(&b, u);
    }
    for (int il = 0; il < hp->n_layer; il++) kv_cache_save(caches[il], &b);
    if (!b.oom) kv_buf_u64(&b, engine_fnv1a(ENGINE_FNV_INIT, b.data, b.len));
    *out = b;
    return b.oom ? kvq_error_code(KVQ_ERR_OOM, "out of memory saving the KV cache") : 0;
}

static int save_caches(const struct kvq_context *c, const struct kvq_kv_config *kv, struct kv_cache *const *caches,
                       const char *path, const kvq_token *tokens, int n_tokens, const float *logits) {
    struct kv_buf b = {0};
    if (encode_caches(c, kv, caches, tokens, n_tokens, logits, &b) != 0) {
        free(b.data);
        return -1;
    }
    struct kvq_outfile out; /* a temporary renamed into place: never a partial file */
    FILE *f = kvq_outfile_open(&out, path);
    if (!f) {
        free(b.data);
        return -1;
    }
    bool ok = fwrite(b.data, 1, b.len, f) == b.len;
    free(b.data);
    if (!ok) {
        kvq_outfile_abort(&out);
        return kvq_error_code(KVQ_ERR_IO, "cannot write '%s': %s", path, strerror(errno));
    }
    return kvq_outfile_commit(&out);
}

int kvq_seq_save_ex(const struct kvq_context *c, int seq, const char *path, const kvq_token *tokens, int n_tokens,
                    const float *logits) {
    struct kv_cache **caches = engine_seq_caches(c, seq);
    return caches ? save_caches(c, engine_kv_config(c), caches, path, tokens, n_tokens, logits) : -1;
}

int kvq_prefix_save(const struct kvq_prefix *p, const char *path, const kvq_token *tokens, int n_tokens,
                    const float *logits) {
    return save_caches(engine_prefix_context(p), engine_prefix_kv(p), engine_prefix_caches(p), path, tokens, n_tokens,
                       logits);
}

int kvq_prefix_encode(const struct kvq_prefix *p, const kvq_token *tokens, int n_tokens, void **data, size_t *len) {
    struct kv_buf b = {0};
    if (encode_caches(engine_prefix_context(p), engine_prefix_kv(p), engine_prefix_caches(p), tokens, n_tokens, NULL,
                      &b) != 0) {
        free(b.data);
        return -1;
    }
    *data = b.data;
    *len = b.len;
    return 0;
}

void kvq_prefix_kv_config(const struct kvq_prefix *p, struct kvq_kv_config *kv) { *kv = *engine_prefix_kv(p); }

uint64_t kvq_model_fingerprint(const struct kvq_model *m) { return engine_fingerprint(engine_model_data(m)); }

int kvq_seq_save(const struct kvq_context *c, int seq, const char *path) {
    return kvq_seq_save_ex(c, seq, path, NULL, 0, NULL);
}

/* Reads the whole file; its size bounds every allocation that follows. */
static uint8_t *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        kvq_error_code(KVQ_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) { /* ftell of a directory says LONG_MAX */
        fclose(f);
        kvq_error_code(KVQ_ERR_IO, "'%s' is not a regular file", path);
        return NULL;
    }
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        kvq_error_code(KVQ_ERR_IO, "cannot read '%s'", path);
        return NULL;
    }
    uint8_t *data = malloc((size_t)size + 1);
    if (!data) {
        fclose(f);
        kvq_error_code(KVQ_ERR_OOM, "out of memory reading '%s' (%ld bytes)", path, size);
        return NULL;
    }
    size_t got = fread(data, 1, (size_t)size, f);
    fclose(f);
    if (got != (size_t)size) {
        free(data);
        kvq_error_code(KVQ_ERR_IO, "cannot read '%s'", path);
        return NULL;
    }
    *len = got;
    return data;
}

/* Checks magic, version and checksum; leaves r after the version. */
static int check_envelope(const char *path, const uint8_t *data, size_t len, struct kv_reader *r,
                          uint32_t *version_out) {
    uint32_t version;
    if (len < 12 && memcmp(data, SEQ_MAGIC, len < 8 ? len : 8) == 0 && len >= 4)
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    if (len < 12 || memcmp(data, SEQ_MAGIC, 8) != 0)
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is not a kvq KV cache file", path);
    *r = (struct kv_reader){data, len, 8};
    kv_read_u32(r, &version);
    if (version < 1 || version > SEQ_VERSION)
        return kvq_error_code(KVQ_ERR_UNSUPPORTED,
                              "'%s' has KV cache file version %u; this build reads versions 1 to %u", path, version,
                              SEQ_VERSION);
    *version_out = version;
    if (len < 12 + 8) return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    struct kv_reader t = {data, len, len - 8};
    uint64_t sum;
    kv_read_u64(&t, &sum);
    if (sum != engine_fnv1a(ENGINE_FNV_INIT, data, len - 8))
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is corrupt or truncated (checksum mismatch)", path);
    r->len = len - 8; /* the payload */
    return 0;
}

/* -1 with the error set: truncated, or fields no writer makes (unknown flag bits,
 * sizes beyond any context), refused before anything is sized from them. */
int engine_read_kv_config(struct kv_reader *r, struct kvq_kv_config *kv, uint32_t version, const char *path) {
    int32_t v[10] = {0};
    for (int i = 0; i < (version >= 3 ? 10 : version == 2 ? 9 : 8); i++)
        if (!kv_read_i32(r, &v[i])) return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    if (v[9] & ~3)
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' has unknown KV flag bits 0x%x", path, (unsigned)v[9] & ~3u);
    if (v[4] < 0 || v[4] > (1 << 30) || v[5] < 0 || v[5] > (1 << 30) || v[6] < 0 || v[6] > (1 << 30))
        return kvq_error_code(KVQ_ERR_FORMAT,
                              "'%s' holds an impossible KV config (max size %d, keep %d, quantized start %d)", path,
                              v[4], v[5], v[6]);
    kv->k_bits = v[0];
    kv->v_bits = v[1];
    kv->k_group = v[2];
    kv->v_group = v[3];
    kv->max_size = v[4];
    kv->keep = v[5];
    kv->quantized_start = v[6];
    kv->hadamard = v[7] != 0;
    kv->residual = v[8];
    kv->swa_full = (v[9] & 1) != 0;
    kv->n_layer_bits = 0;
    if (!(v[9] & 2)) return 0;
    int32_t n;
    if (!kv_read_i32(r, &n)) return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    if (n < 1 || n > KVQ_MAX_LAYER_BITS)
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' holds %d per-layer bit ranges (at most %d)", path, n,
                              KVQ_MAX_LAYER_BITS);
    for (int i = 0; i < n; i++) {
        int32_t w[4];
        for (int j = 0; j < 4; j++)
            if (!kv_read_i32(r, &w[j])) return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
        if (w[0] < 0 || w[0] > w[1] || w[1] > 65535 || w[2] < 2 || w[2] > 32 || w[3] < 2 || w[3] > 32)
            return kvq_error_code(KVQ_ERR_FORMAT, "'%s' holds impossible per-layer bits (layers %d..%d: K%d/V%d)", path,
                                  w[0], w[1], w[2], w[3]);
        kv->layer_bits[i] = (struct kvq_layer_bits){w[0], w[1], w[2], w[3]};
    }
    kv->n_layer_bits = n;
    return 0;
}

static int data_kv_config(const char *path, const uint8_t *data, size_t len, struct kvq_kv_config *kv) {
    struct kv_reader r;
    uint64_t fp;
    uint32_t dims[5];
    uint32_t version = 0;
    int rc = check_envelope(path, data, len, &r, &version);
    if (rc == 0) {
        memset(kv, 0, sizeof *kv);
        bool ok = kv_read_u64(&r, &fp);
        for (int i = 0; i < 5 && ok; i++) ok = kv_read_u32(&r, &dims[i]);
        rc = ok ? engine_read_kv_config(&r, kv, version, path) : kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    }
    return rc;
}

int kvq_seq_file_kv_config(const char *path, struct kvq_kv_config *kv) {
    size_t len;
    uint8_t *data = read_all(path, &len);
    if (!data) return -1;
    int rc = data_kv_config(path, data, len, kv);
    free(data);
    return rc;
}

bool engine_same_kv(const struct kvq_kv_config *a, const struct kvq_kv_config *b) {
    return kvq_kv_same_format(a, b) && a->max_size == b->max_size && a->keep == b->keep &&
           a->quantized_start == b->quantized_start && a->hadamard == b->hadamard && a->residual == b->residual &&
           a->swa_full == b->swa_full;
}

static int load_body(struct kvq_context *c, const struct kvq_kv_config *mine, struct kv_cache **caches,
                     const char *path, struct kv_reader *r, uint32_t version, struct kvq_seq_extra *extra) {
    const struct model *m = engine_model(c);
    const struct model_hparams *hp = &m->hp;
    uint64_t fp;
    uint32_t dims[5], n_tok, n_logits;
    int32_t n_past;
    struct kvq_kv_config kv = {0};
    bool ok = kv_read_u64(r, &fp);
    for (int i = 0; i < 5 && ok; i++) ok = kv_read_u32(r, &dims[i]);
    if (!ok) return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    if (engine_read_kv_config(r, &kv, version, path) != 0) return -1;
    if (!kv_read_i32(r, &n_past)) return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    if (dims[0] != (uint32_t)hp->n_layer || dims[1] != (uint32_t)hp->n_head || dims[2] != (uint32_t)hp->n_head_kv ||
        dims[3] != (uint32_t)hp->head_dim || dims[4] != (uint32_t)hp->n_vocab)
        return kvq_error("'%s' was written for another model (%u layers, %u/%u heads, head_dim %u, vocab %u; this one "
                         "has %d layers, %d/%d heads, head_dim %d, vocab %d)",
                         path, dims[0], dims[1], dims[2], dims[3], dims[4], hp->n_layer, hp->n_head, hp->n_head_kv,
                         hp->head_dim, hp->n_vocab);
    if (fp != engine_fingerprint(m)) /* same shape: listing it would not tell the models apart */
        return kvq_error("'%s' was written for another model of the same shape (other weights or hyperparameters)",
                         path);
    if (!engine_same_kv(&kv, mine)) {
        char theirs[256], ours[256];
        if (kvq_kv_layer_bits_name(&kv, theirs, sizeof theirs) <= 0) snprintf(theirs, sizeof theirs, "none");
        if (kvq_kv_layer_bits_name(mine, ours, sizeof ours) <= 0) snprintf(ours, sizeof ours, "none");
        return kvq_error("'%s' was written with another KV cache config (K%d/V%d bits, groups %d/%d, max size %d, "
                         "keep %d, quantized start %d, rotation %d, residual %d, swa-full %d, layer bits %s); this "
                         "context uses K%d/V%d bits, groups %d/%d, max size %d, keep %d, quantized start %d, rotation "
                         "%d, residual %d, swa-full %d, layer bits %s",
                         path, kv.k_bits, kv.v_bits, kv.k_group, kv.v_group, kv.max_size, kv.keep, kv.quantized_start,
                         kv.hadamard, kv.residual, kv.swa_full, theirs, mine->k_bits, mine->v_bits, mine->k_group,
                         mine->v_group, mine->max_size, mine->keep, mine->quantized_start, mine->hadamard,
                         mine->residual, mine->swa_full, ours);
    }
    /* a rotating cache may hold a long past, but positions must stay far from INT_MAX */
    if (n_past < 0 || n_past > (1 << 30) || (n_past > kvq_context_n_ctx(c) && mine->max_size == 0))
        return kvq_error_code(KVQ_ERR_CONTEXT_FULL, "'%s' holds %d tokens, more than the context of %d", path, n_past,
                              kvq_context_n_ctx(c));
    if (!kv_read_u32(r, &n_tok) || n_tok > (r->len - r->off) / 4)
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' is truncated", path);
    kvq_token *toks = malloc(sizeof(kvq_token) * (n_tok ? n_tok : 1));
    if (!toks) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    for (uint32_t i = 0; i < n_tok; i++) {
        kv_read_i32(r, &toks[i]);
        if (toks[i] < 0 || toks[i] >= hp->n_vocab) {
            int bad = toks[i];
            free(toks);
            return kvq_error_code(KVQ_ERR_FORMAT, "'%s' holds an invalid token id %d", path, bad);
        }
    }
    float *logits = NULL;
    if (!kv_read_u32(r, &n_logits) || (n_logits != 0 && n_logits != (uint32_t)hp->n_vocab) ||
        n_logits > (r->len - r->off) / 4 || (n_logits && !(logits = malloc(sizeof(float) * n_logits)))) {
        free(toks);
        return kvq_error_code(KVQ_ERR_FORMAT, "'%s' has an invalid logits block", path);
    }
    for (uint32_t i = 0; i < n_logits; i++) {
        uint32_t u;
        kv_read_u32(r, &u);
        memcpy(&logits[i], &u, 4);
        if (!isfinite(logits[i])) { /* the sampler would pick from NaNs */
            free(toks);
            free(logits);
            return kvq_error_code(KVQ_ERR_FORMAT, "'%s' holds a non-finite logit (token %u)", path, i);
        }
    }
    int rc = 0;
    for (int il = 0; il < hp->n_layer && rc == 0; il++) {
        if (kv_cache_load(caches[il], r) != 0) rc = kvq_error_wrap("'%s', layer %d: %s", path, il, kvq_last_error());
        else if (kv_cache_n_past(caches[il]) != n_past)
            rc = kvq_error_code(KVQ_ERR_FORMAT, "'%s', layer %d: inconsistent offset", path, il);
    }
    if (rc == 0 && r->off != r->len) rc = kvq_error_code(KVQ_ERR_FORMAT, "'%s' has trailing bytes", path);
    if (rc == 0 && extra) {
        extra->tokens = toks;
        extra->n_tokens = (int)n_tok;
        extra->logits = logits;
    } else {
        free(toks);
        free(logits);
    }
    return rc;
}

/* Loads a file's bytes (named path in errors) into caches [n_layer] of config kv; on
 * failure they are emptied. */
static int load_data(struct kvq_context *c, const struct kvq_kv_config *kv, struct kv_cache **caches,
                     const char *path, const uint8_t *data, size_t len, struct kvq_seq_extra *extra) {
    if (extra) memset(extra, 0, sizeof *extra);
    struct kv_reader r;
    uint32_t version = 0;
    int rc = check_envelope(path, data, len, &r, &version);
    if (rc == 0) rc = load_body(c, kv, caches, path, &r, version, extra);
    if (rc != 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvq_last_error());
        for (int il = 0; il < engine_model(c)->hp.n_layer; il++) kv_cache_clear(caches[il]);
        kvq_error_wrap("%s", msg);
    }
    return rc;
}

static int load_caches(struct kvq_context *c, const struct kvq_kv_config *kv, struct kv_cache **caches,
                       const char *path, struct kvq_seq_extra *extra) {
    if (extra) memset(extra, 0, sizeof *extra);
    size_t len;
    uint8_t *data = read_all(path, &len);
    if (!data) return -1;
    int rc = load_data(c, kv, caches, path, data, len, extra);
    free(data);
    return rc;
}

int kvq_seq_load_ex(struct kvq_context *c, int seq, const char *path, struct kvq_seq_extra *extra) {
    if (extra) memset(extra, 0, sizeof *extra);
    struct kv_cache **caches = engine_seq_caches(c, seq);
    return caches ? load_caches(c, engine_kv_config(c), caches, path, extra) : -1;
}

struct kvq_prefix *kvq_prefix_decode(struct kvq_context *c, const void *data, size_t len, const char *name,
                                     struct kvq_seq_extra *extra) {
    /* a prefix held in another format (kvq_prefix_hold_as) loads in that format */
    struct kvq_kv_config kv;
    if (extra) memset(extra, 0, sizeof *extra);
    if (data_kv_config(name, data, len, &kv) != 0) return NULL;
    bool other = !engine_same_kv(&kv, engine_kv_config(c)) && engine_prefix_kv_ok(c, &kv);
    struct kvq_prefix *p = other ? engine_prefix_new_kv(c, &kv) : engine_prefix_new(c);
    if (p && load_data(c, engine_prefix_kv(p), engine_prefix_caches(p), name, data, len, extra) != 0) {
        kvq_prefix_free(p);
        return NULL;
    }
    return p;
}

struct kvq_prefix *kvq_prefix_load(struct kvq_context *c, const char *path, struct kvq_seq_extra *extra) {
    if (extra) memset(extra, 0, sizeof *extra);
    size_t len;
    uint8_t *data = read_all(path, &len);
    if (!data) return NULL;
    struct kvq_prefix *p = kvq_prefix_decode(c, data, len, path, extra);
    free(data);
    return p;
}

int kvq_seq_load(struct kvq_context *c, int seq, const char *path) { return kvq_seq_load_ex(c, seq, path, NULL); }

void kvq_seq_extra_free(struct kvq_seq_extra *e) {
    if (!e) return;
    free(e->tokens);
    free(e->logits);
    memset(e, 0, sizeof *e);
}
