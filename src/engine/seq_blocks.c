/* A held prefix block by block: the values a shared store keeps (kvq.h,
 * kvq_prefix_encode_blocks / kvq_seq_append_block).
 *
 * A block value, version 1 (little-endian):
 *   char  magic[8] = "KVQBLOCK"
 *   u32   version = 1
 *   u64   model fingerprint (as in seq_state.c's files)
 *   u32   n_layer, n_head_kv, head_dim
 *   i32   KV config of the rows (seq_state.c's ten fields)
 *   u32   first position, n positions
 *   i32   tokens[n] (the tokens at those positions)
 *   n_layer stretches of rows (kv_cache_save_rows: formats, offsets, key and value rows)
 *   u64   checksum of every byte before it: FNV-1a 64 over little-endian 64-bit words (the
 *         last len % 8 bytes one at a time), a file's bytewise FNV-1a at 8x the speed
 * Positions [first, first + n) of every layer, so a reader that holds the positions
 * before them (its own cached prefix, or earlier blocks) appends only these. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "engine/engine_internal.h"
#include "kvcache/kv_cache.h"
#include "kvcache/kv_pool.h"
#include "model/model.h"

#define BLOCK_MAGIC "KVQBLOCK"
#define BLOCK_VERSION 1u

static uint64_t checksum(const uint8_t *p, size_t n) {
    uint64_t h = ENGINE_FNV_INIT;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = 0;
        for (int j = 0; j < 8; j++) w |= (uint64_t)p[i + j] << (8 * j);
        h = (h ^ w) * 0x100000001b3ull;
    }
    return engine_fnv1a(h, p + i, n - i);
}

/* Per-layer caches of format kv (bits and groups) shaped like caches, on private
 * pools: a prefix's rows re-encoded, or a template to decode such rows with. */
static struct kv_cache **format_caches(struct kv_cache *const *caches, int n_layer, const struct kvq_kv_config *kv) {
    struct kv_cache **out = calloc((size_t)n_layer, sizeof *out);
    for (int il = 0; out && il < n_layer; il++) {
        struct kv_cache_config cfg = *kv_cache_get_config(caches[il]);
        kvq_kv_layer_bits(kv, il, &cfg.k_bits, &cfg.v_bits);
        cfg.k_group = kv->k_group;
        cfg.v_group = kv->v_group;
        cfg.quantized_start = 0;
        if (!(out[il] = kv_cache_new(&cfg, kv_cache_get_shape(caches[il])))) {
            while (il-- > 0) kv_cache_free(out[il]);
            free(out);
            return NULL;
        }
    }
    if (!out) kvq_error_code(KVQ_ERR_OOM, "out of memory");
    return out;
}

static void free_caches(struct kv_cache **cs, int n_layer) {
    for (int il = 0; cs && il < n_layer; il++) kv_cache_free(cs[il]);
    free(cs);
}

/* dst (empty) receives src's first n positions, decoded and encoded in dst's format
 * (the offsets chosen from them as a live cache would). */
static int reencode(struct kv_cache *dst, const struct kv_cache *src, int32_t n) {
    const struct kv_shape *sh = kv_cache_get_shape(src);
    const int H = sh->n_kv_heads, D = sh->head_dim;
    const int32_t held = kv_cache_n_past(src);
    float *rows = malloc(sizeof(float) * (size_t)held * D), *kv = malloc(sizeof(float) * 2 * (size_t)n * H * D);
    int rc = rows && kv ? 0 : kvq_error_code(KVQ_ERR_OOM, "out of memory re-encoding a prefix");
    for (int side = 0; side < 2 && rc == 0; side++)
        for (int h = 0; h < H && rc == 0; h++) {
            if (kv_cache_read_rows(src, h, side, rows, NULL, held) != held) rc = kvq_error("a prefix's rows are not all held");
            for (int32_t t = 0; t < n && rc == 0; t++)
                memcpy(kv + (((size_t)side * n + t) * H + h) * D, rows + (size_t)t * D, sizeof(float) * D);
        }
    const float *k = kv, *v = kv ? kv + (size_t)n * H * D : NULL;
    for (int32_t t = 0; t < n && rc == 0; t += KVQ_BLOCK_TOKENS) {
        int m = n - t < KVQ_BLOCK_TOKENS ? n - t : KVQ_BLOCK_TOKENS;
        rc = kv_cache_append(dst, m, k + (size_t)t * H * D, v + (size_t)t * H * D);
    }
    free(rows);
    free(kv);
    return rc;
}

int kvq_prefix_encode_blocks(const struct kvq_prefix *p, const struct kvq_kv_config *kv, const kvq_token *tokens,
                             int first, int count, void **data, size_t *lens) {
    const struct kvq_context *c = engine_prefix_context(p);
    const struct model_hparams *hp = &engine_model(c)->hp;
    const struct kvq_kv_config *pkv = engine_prefix_kv(p);
    struct kv_cache **src = engine_prefix_caches(p), **conv = NULL;
    const int L = hp->n_layer, B = KVQ_BLOCK_TOKENS;
    *data = NULL;
    if (first < 0 || count < 1 || (first + count) * B > kvq_prefix_len(p))
        return kvq_error("blocks %d..%d are beyond the prefix's %d tokens", first, first + count - 1, kvq_prefix_len(p));
    if (!engine_prefix_kv_ok(c, kv)) return kvq_error("blocks may differ from the context's config only in format");
    if (!kvq_kv_same_format(kv, pkv)) {
        if (!(conv = format_caches(src, L, kv))) return -1;
        for (int il = 0; il < L; il++)
            if (reencode(conv[il], src[il], (first + count) * B) != 0) {
                free_caches(conv, L);
                return -1;
            }
        src = conv;
    }
    struct kv_buf b = {0};
    int rc = 0;
    for (int i = first; i < first + count && rc == 0; i++) {
        size_t start = b.len;
        kv_buf_put(&b, BLOCK_MAGIC, 8);
        kv_buf_u32(&b, BLOCK_VERSION);
        kv_buf_u64(&b, engine_context_fingerprint(c));
        kv_buf_u32(&b, (uint32_t)L);
        kv_buf_u32(&b, (uint32_t)hp->n_head_kv);
        kv_buf_u32(&b, (uint32_t)hp->head_dim);
        engine_put_kv_config(&b, kv);
        kv_buf_u32(&b, (uint32_t)(i * B));
        kv_buf_u32(&b, (uint32_t)B);
        for (int t = i * B; t < (i + 1) * B; t++) kv_buf_u32(&b, (uint32_t)tokens[t]);
        for (int il = 0; il < L && rc == 0; il++) rc = kv_cache_save_rows(src[il], i * B, B, &b);
        if (!b.oom) kv_buf_u64(&b, checksum(b.data + start, b.len - start));
        lens[i - first] = b.len - start;
    }
    free_caches(conv, L);
    if (rc == 0 && b.oom) rc = kvq_error_code(KVQ_ERR_OOM, "out of memory encoding a prefix's blocks");
    if (rc != 0) {
        free(b.data);
        return -1;
    }
    *data = b.data;
    return 0;
}

static int bad_block(const char *what) { return kvq_error_code(KVQ_ERR_FORMAT, "invalid KV block: %s", what); }

/* Checks a block value's envelope and header against the context, kv, the sequence's
 * next position np and tokens; leaves r at the first layer's rows. */
static int check_block(const struct kvq_context *c, const struct kvq_kv_config *kv, const uint8_t *data, size_t len,
                       int np, const kvq_token *tokens, struct kv_reader *r, int *n_out) {
    const struct model_hparams *hp = &engine_model(c)->hp;
    uint32_t version, dims[3], first, n;
    uint64_t fp, sum;
    struct kvq_kv_config bkv;
    if (len < 8 + 4 + 8 || memcmp(data, BLOCK_MAGIC, 8) != 0) return bad_block("not a kvq KV block");
    struct kv_reader t = {data, len, len - 8};
    kv_read_u64(&t, &sum);
    if (sum != checksum(data, len - 8)) return bad_block("checksum mismatch");
    *r = (struct kv_reader){data, len - 8, 8};
    kv_read_u32(r, &version);
    if (version != BLOCK_VERSION) return bad_block("unknown version");
    bool ok = kv_read_u64(r, &fp);
    for (int i = 0; i < 3 && ok; i++) ok = kv_read_u32(r, &dims[i]);
    if (!ok) return bad_block("truncated");
    if (fp != engine_context_fingerprint(c) || dims[0] != (uint32_t)hp->n_layer ||
        dims[1] != (uint32_t)hp->n_head_kv || dims[2] != (uint32_t)hp->head_dim)
        return bad_block("written for another model");
    if (engine_read_kv_config(r, &bkv, 3, "KV block") != 0) return -1;
    if (!engine_same_kv(&bkv, kv)) return bad_block("another KV config");
    if (!kv_read_u32(r, &first) || !kv_read_u32(r, &n)) return bad_block("truncated");
    if (first != (uint32_t)np || n < 1 || n > KVQ_BLOCK_TOKENS) return bad_block("another position");
    if (np + (int)n > kvq_context_n_ctx(c))
        return kvq_error_code(KVQ_ERR_CONTEXT_FULL, "a KV block past the context of %d", kvq_context_n_ctx(c));
    for (uint32_t i = 0; i < n; i++) {
        int32_t tok;
        if (!kv_read_i32(r, &tok)) return bad_block("truncated");
        if (tok != tokens[np + i]) return bad_block("other tokens");
    }
    *n_out = (int)n;
    return 0;
}

int kvq_seq_append_block(struct kvq_context *c, int seq, const struct kvq_kv_config *kv, const void *data, size_t len,
                         const kvq_token *tokens) {
    struct kv_cache **cs = engine_seq_caches(c, seq), **like = NULL;
    if (!cs) return -1;
    const int L = engine_model(c)->hp.n_layer, np = kv_cache_n_past(cs[0]);
    struct kv_reader r;
    int n = 0;
    if (!engine_prefix_kv_ok(c, kv)) return kvq_error("blocks may differ from the context's config only in format");
    if (check_block(c, kv, data, len, np, tokens, &r, &n) != 0) return -1;
    /* every layer checked before anything is appended: a bad layer changes nothing */
    struct kv_rows **rows = calloc((size_t)L, sizeof *rows);
    int rc = rows && (like = format_caches(cs, L, kv)) ? 0 : -1;
    if (!rows) kvq_error_code(KVQ_ERR_OOM, "out of memory reading a KV block");
    for (int il = 0; il < L && rc == 0; il++)
        if (!(rows[il] = kv_rows_read(like[il], &r, n))) rc = -1;
    if (rc == 0 && r.off != r.len) rc = bad_block("trailing bytes");
    size_t need = 0;
    for (int il = 0; il < L && rc == 0; il++) need += kv_cache_append_bytes(cs[il], n, n);
    if (rc == 0 && !kv_pool_fits(kv_cache_pool(cs[0]), need))
        rc = kvq_error_code(KVQ_ERR_BUDGET, "KV cache budget exhausted: a KV block needs up to %zu more bytes", need);
    for (int il = 0; il < L && rc == 0; il++) rc = kv_cache_append_rows_from(cs[il], rows[il]);
    if (rc != 0 && kv_cache_n_past(cs[0]) != np) { /* a layer failed: the sequence goes back */
        char msg[512];
        snprintf(msg, sizeof msg, "%s", kvq_last_error());
        for (int il = 0; il < L; il++)
            if (kv_cache_n_past(cs[il]) > np) kv_cache_keep_prefix(cs[il], np);
        kvq_error_wrap("%s", msg);
    }
    for (int il = 0; rows && il < L; il++) kv_rows_free(rows[il]);
    free(rows);
    free_caches(like, L);
    return rc;
}
