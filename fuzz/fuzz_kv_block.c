/* Structure-aware libFuzzer target for a shared prefix's block values
 * (kvq_seq_append_block: what kvq serve reads from a Redis/Valkey store). The input is
 * a block *without* its trailing checksum: the target appends the right one, so every
 * mutation lands beneath it, in the header, the KV config, the position, the tokens,
 * each layer's formats, offsets, sink rows and rows. The tokens the block is checked
 * against are its own (a mutant with other tokens still reaches the rows). Each input
 * goes to a sequence of an f16 context, a --kv-bits 8,4 one and a 4,3:nf one, empty or (a block
 * at position 64) holding one block's tokens already (rows taken
 * as they are, or decoded and appended); a block that is taken is then decoded one
 * token further, so attention reads its rows.
 *
 * Build (clang): cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *                cmake --build build-fuzz --target fuzz_kv_block
 * Seeds: KVQ_FUZZ_SEEDS=DIR ./build-fuzz/fuzz_kv_block -runs=0 writes blocks of each
 * format (first and second block, checksums left off) to DIR; then
 *                ./build-fuzz/fuzz_kv_block DIR
 * Model: KVQ_FUZZ_MODEL, default ../shared/models/stories260K.gguf. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

enum { HEADER = 80, N_CTX = 256 }; /* a block's bytes before its tokens; the contexts' length */

static struct kvq_model *model;
#define N_KINDS 3
static struct kvq_context *ctx[N_KINDS]; /* f16, 8,4, 4,3:nf */
static const char *const kind_name[N_KINDS] = {"f16", "8-4", "4-3-nf"};

/* The block checksum (src/engine/seq_blocks.c): FNV-1a 64 over little-endian 64-bit words. */
static uint64_t checksum(const uint8_t *p, size_t n) {
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

static int32_t le32(const uint8_t *p) { return (int32_t)((uint32_t)p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24); }

static struct kvq_context *context(int kind) {
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = N_CTX;
    cp.n_seq = 1;
    cp.n_threads = 1;
    cp.n_batch = 64;
    if (kind > 0) {
        cp.kv.k_bits = kind == 1 ? 8 : 4;
        cp.kv.v_bits = kind == 1 ? 4 : 3;
        cp.kv.k_group = cp.kv.v_group = kind == 1 ? 8 : KVQ_KV_NF; /* 8: stories260K's head_dim */
        cp.kv.residual = 32;
    }
    struct kvq_context *c = kvq_context_new(model, &cp);
    if (!c) {
        fprintf(stderr, "fuzz_kv_block: %s\n", kvq_last_error());
        exit(1);
    }
    return c;
}

/* Writes blocks 0 and 1 of a 130-token prefix of each context, in its own format, to dir. */
static void write_seeds(const char *dir) {
    kvq_token toks[130];
    for (int i = 0; i < 130; i++) toks[i] = 1 + i % 200;
    for (int q = 0; q < N_KINDS; q++) {
        struct kvq_batch b = {.n_tokens = 130, .tokens = toks};
        if (kvq_decode(ctx[q], &b) != 0) exit(1);
        struct kvq_prefix *p = kvq_prefix_hold(ctx[q], 0);
        struct kvq_kv_config kv;
        kvq_prefix_kv_config(p, &kv);
        void *data;
        size_t lens[2];
        if (!p || kvq_prefix_encode_blocks(p, &kv, toks, 0, 2, &data, lens) != 0) exit(1);
        const uint8_t *v = data;
        for (int i = 0; i < 2; v += lens[i++]) {
            char path[4096];
            snprintf(path, sizeof path, "%s/seed-%s-%d", dir, kind_name[q], i);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(v, 1, lens[i] - 8, f) != lens[i] - 8 || fclose(f) != 0) exit(1);
        }
        free(data);
        kvq_prefix_free(p);
        kvq_seq_clear(ctx[q], 0);
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *m = getenv("KVQ_FUZZ_MODEL");
    model = kvq_model_load(m ? m : "../shared/models/stories260K.gguf");
    if (!model) {
        fprintf(stderr, "fuzz_kv_block: %s (set KVQ_FUZZ_MODEL)\n", kvq_last_error());
        exit(1);
    }
    for (int q = 0; q < N_KINDS; q++) ctx[q] = context(q);
    if (getenv("KVQ_FUZZ_SEEDS")) write_seeds(getenv("KVQ_FUZZ_SEEDS"));
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < HEADER || size > (1u << 22)) return 0;
    uint8_t *v = malloc(size + 8);
    if (!v) abort();
    memcpy(v, data, size);
    uint64_t sum = checksum(data, size);
    for (int i = 0; i < 8; i++) v[size + i] = (uint8_t)(sum >> (8 * i));
    /* the rows' config (the value's own) and tokens: the ones it is checked against */
    int32_t f[10];
    for (int i = 0; i < 10; i++) f[i] = le32(data + 32 + 4 * i);
    struct kvq_kv_config kv = {.k_bits = f[0], .v_bits = f[1], .k_group = f[2], .v_group = f[3], .max_size = f[4],
                               .keep = f[5], .quantized_start = f[6], .hadamard = f[7] != 0, .residual = f[8],
                               .swa_full = (f[9] & 1) != 0};
    const int32_t first = le32(data + 72);
    kvq_token toks[N_CTX]; /* the block's own at its position; BOS before it (prefilled) */
    for (int i = 0; i < N_CTX; i++) {
        size_t at = HEADER + 4 * (size_t)(i % 64);
        toks[i] = (first != 64 || i >= 64) && at + 4 <= size ? le32(data + at) : 1;
    }
    for (int q = 0; q < N_KINDS; q++) {
        struct kvq_context *c = ctx[q];
        struct kvq_batch pre = {.n_tokens = 64, .tokens = toks};
        if (first == 64 && kvq_decode(c, &pre) != 0) abort(); /* a second block follows a first */
        if (kvq_seq_append_block(c, 0, &kv, v, size + 8, toks) == 0) {
            kvq_token t = 1;
            struct kvq_batch b = {.n_tokens = 1, .tokens = &t};
            if (kvq_seq_len(c, 0) < N_CTX && kvq_decode(c, &b) == 0) {
                volatile float sink = kvq_get_logits(c, 0)[0];
                (void)sink;
            }
        } else if (kvq_last_error()[0] == '\0') {
            abort(); /* a refusal must say why */
        }
        kvq_seq_clear(c, 0);
    }
    free(v);
    return 0;
}
