/* A held prefix block by block (the remote prefix tier's values) on tinydoc: blocks in
 * the live format appended to an empty sequence, or after the first blocks of a local
 * prefix, give logits equal to a fresh prefill (f16) or to the held prefix cut back to
 * the same length (--kv-bits 8,4: the same rows, offsets and sinks); blocks re-encoded
 * in 8 bits from an f16 prefix land within 8-bit error of it; a block at another
 * position, of other tokens, of another config, corrupt, truncated, longer, or whose
 * rows decode beyond f16 is refused with the sequence unchanged; every KV block goes
 * back at the end. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvq.h"

enum { N = 300, B = KVQ_BLOCK_TOKENS };

static struct kvq_model *model;
static int V;
static kvq_token toks[N];

static void prefill(struct kvq_context *c, int seq, int from, int n) {
    int32_t ids[N];
    for (int i = 0; i < n - from; i++) ids[i] = seq;
    struct kvq_batch b = {.n_tokens = n - from, .tokens = toks + from, .seq_ids = ids};
    CHECK(kvq_decode(c, &b) == 0, "decode: %s", kvq_last_error());
}

/* The logits after feeding toks[from..N) to seq (which holds toks[0..from)); seq is then cleared. */
static float *finish(struct kvq_context *c, int seq, int from) {
    prefill(c, seq, from, N);
    float *l = malloc(sizeof *l * (size_t)V);
    memcpy(l, kvq_get_logits(c, N - from - 1), sizeof *l * (size_t)V);
    kvq_seq_clear(c, seq);
    return l;
}

static double max_diff(float *a, float *b) {
    double d = 0;
    for (int i = 0; i < V; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    free(a);
    free(b);
    return d;
}

static struct kvq_context *context(const char *kv_bits) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 512;
    cp.n_seq = 2;
    cp.n_threads = 2;
    if (kv_bits) {
        cp.kv.k_bits = 8;
        cp.kv.v_bits = 4;
        cp.kv.k_group = cp.kv.v_group = 64;
        cp.kv.hadamard = true;
        cp.kv.keep = 4;
        cp.kv.residual = 32;
    }
    struct kvq_context *c = kvq_context_new(model, &cp);
    CHECK(c != NULL, "context %s: %s", kv_bits ? kv_bits : "f16", kvq_last_error());
    return c;
}

/* Appends blocks [first, first + n) of data (lens) to seq; 0 or -1 at the first failure. */
static int append(struct kvq_context *c, int seq, const struct kvq_kv_config *kv, const unsigned char *data,
                  const size_t *lens, int n) {
    for (int i = 0; i < n; data += lens[i++])
        if (kvq_seq_append_block(c, seq, kv, data, lens[i], toks) != 0) return -1;
    return 0;
}

/* The block checksum (src/engine/seq_blocks.c): FNV-1a 64 over little-endian 64-bit words. */
static uint64_t block_checksum(const unsigned char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = 0;
        for (int j = 0; j < 8; j++) w |= (uint64_t)p[i + j] << (8 * j);
        h = (h ^ w) * 0x100000001b3ull;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static void refused(struct kvq_context *c, const struct kvq_kv_config *kv, const unsigned char *v, size_t len,
                    const char *what) {
    int before = kvq_seq_len(c, 1);
    int rc = kvq_seq_append_block(c, 1, kv, v, len, toks);
    CHECK(rc == -1 && kvq_last_error_code() == KVQ_ERR_FORMAT && kvq_seq_len(c, 1) == before,
          "%s: refused (rc %d, %s), the sequence unchanged", what, rc, kvq_last_error());
}

int main(void) {
    model = kvq_model_load(require_shared("models/tinydoc-q8_0.gguf"));
    CHECK(model != NULL, "load: %s", kvq_last_error());
    if (!model) return check_finish();
    struct kvq_model_info info;
    kvq_model_get_info(model, &info);
    V = info.n_vocab;
    uint32_t x = 777;
    for (int i = 0; i < N; i++) toks[i] = (kvq_token)((x = x * 1103515245u + 12345u) >> 8) % (V - 3) + 3;
    toks[0] = 1;

    /* f16: four live blocks into an empty sequence, then two after a local prefix's first two */
    struct kvq_context *c = context(NULL);
    if (!c) return check_finish();
    struct kvq_kv_config f16;
    kvq_kv_config_default(&f16);
    prefill(c, 0, 0, N);
    struct kvq_prefix *p = kvq_prefix_hold(c, 0);
    kvq_seq_clear(c, 0);
    void *data;
    size_t lens[4];
    CHECK(kvq_prefix_encode_blocks(p, &f16, toks, 0, 4, &data, lens) == 0, "encode: %s", kvq_last_error());
    float *fresh = finish(c, 1, 0);
    CHECK(append(c, 1, &f16, data, lens, 4) == 0 && kvq_seq_len(c, 1) == 4 * B, "4 blocks: %s", kvq_last_error());
    double d = max_diff(finish(c, 1, 4 * B), fresh);
    CHECK(d == 0, "f16 blocks: logits equal a fresh prefill (max diff %g)", d);
    CHECK(kvq_prefix_attach(c, 1, p) == 0 && kvq_seq_keep_prefix(c, 1, 2 * B) == 0, "local prefix");
    CHECK(append(c, 1, &f16, (unsigned char *)data + lens[0] + lens[1], lens + 2, 2) == 0, "2 blocks after 2 local");
    d = max_diff(finish(c, 1, 4 * B), finish(c, 0, 0));
    CHECK(d == 0, "local prefix and blocks: logits equal a fresh prefill (max diff %g)", d);

    /* refusals */
    const unsigned char *b0 = data, *b1 = b0 + lens[0];
    refused(c, &f16, b1, lens[1], "a block at another position");
    unsigned char *v = malloc(lens[0] + 1);
    memcpy(v, b0, lens[0]);
    v[lens[0] / 2] ^= 1;
    refused(c, &f16, v, lens[0], "a flipped bit");
    refused(c, &f16, b0, lens[0] - 9, "a truncated block");
    memcpy(v, b0, lens[0]);
    v[lens[0]] = 0;
    refused(c, &f16, v, lens[0] + 1, "a trailing byte");
    struct kvq_kv_config q8 = f16;
    q8.k_bits = q8.v_bits = 8;
    refused(c, &q8, b0, lens[0], "another KV config than the one expected");
    kvq_token saved = toks[5];
    toks[5] = toks[5] == 3 ? 4 : 3;
    refused(c, &f16, b0, lens[0], "other tokens");
    toks[5] = saved;
    free(v);
    free(data);
    const size_t f16_len = lens[0];

    /* f16 prefix re-encoded in 8 bits for the wire: close to the f16 state */
    struct kvq_kv_config q8ctx = f16; /* the rest of the config must be the context's */
    q8ctx.k_bits = q8ctx.v_bits = 8;
    q8ctx.k_group = q8ctx.v_group = 64;
    CHECK(kvq_prefix_encode_blocks(p, &q8ctx, toks, 0, 4, &data, lens) == 0, "encode 8-bit: %s", kvq_last_error());
    CHECK(lens[1] < f16_len * 6 / 10, "8-bit blocks: %zu bytes against %zu in f16", lens[1], f16_len);
    /* a finite f16 scale that decodes beyond f16 (layer 0's key row of position 10,
     * past the sinks, which come from their f16 copies), the checksum made right:
     * refused, not held as inf */
    v = malloc(lens[0]);
    memcpy(v, data, lens[0]);
    const size_t formats = 80 + 4 * B, mu_set = v[formats + 24]; /* after the header and tokens */
    const size_t rows = formats + 7 * 4 + (mu_set ? 2 * 2 * 128 * 4 : 0) + 4; /* offsets, sink count */
    const size_t scale = rows + 10 * (128 + 2 * 4) + 128; /* 8-bit rows: codes, then scale and bias per 64 */
    v[scale] = 0xff, v[scale + 1] = 0x7b;
    uint64_t sum = block_checksum(v, lens[0] - 8);
    for (int i = 0; i < 8; i++) v[lens[0] - 8 + i] = (unsigned char)(sum >> (8 * i));
    refused(c, &q8ctx, v, lens[0], "rows that decode beyond f16");
    free(v);
    CHECK(append(c, 1, &q8ctx, data, lens, 4) == 0, "8-bit blocks into an f16 sequence: %s", kvq_last_error());
    float *hit = finish(c, 1, 4 * B), *ref = finish(c, 0, 0);
    int am = 0, bm = 0;
    for (int i = 1; i < V; i++) am = hit[i] > hit[am] ? i : am, bm = ref[i] > ref[bm] ? i : bm;
    d = max_diff(hit, ref);
    CHECK(d > 0 && d < 0.5 && am == bm, "8-bit blocks: logits within 8-bit error (max diff %g, argmax %d %d)", d, am, bm);
    free(data);
    kvq_prefix_free(p);
    CHECK(kvq_kv_blocks(c) == 0, "f16: blocks back: %lld", (long long)kvq_kv_blocks(c));
    kvq_context_free(c);

    /* 8,4 live: blocks taken as they are give the held prefix's state cut back */
    c = context("8,4");
    if (!c) return check_finish();
    prefill(c, 0, 0, N - 1); /* a batch's rows stay in the f16 window until the next decode, */
    prefill(c, 0, N - 1, N); /* as after a finished request's last step */
    p = kvq_prefix_hold(c, 0);
    kvq_seq_clear(c, 0);
    struct kvq_kv_config live;
    kvq_prefix_kv_config(p, &live);
    CHECK(kvq_prefix_encode_blocks(p, &live, toks, 0, 4, &data, lens) == 0, "encode 8,4: %s", kvq_last_error());
    CHECK(append(c, 1, &live, data, lens, 4) == 0, "8,4 blocks: %s", kvq_last_error());
    CHECK(kvq_prefix_attach(c, 0, p) == 0 && kvq_seq_keep_prefix(c, 0, 4 * B) == 0, "8,4 local prefix");
    d = max_diff(finish(c, 1, 4 * B), finish(c, 0, 4 * B));
    CHECK(d == 0, "8,4 blocks: logits equal the held prefix cut back (max diff %g)", d);
    free(data);
    kvq_prefix_free(p);
    CHECK(kvq_kv_blocks(c) == 0, "8,4: blocks back: %lld", (long long)kvq_kv_blocks(c));
    kvq_context_free(c);
    kvq_model_free(model);
    return check_finish();
}
