/* libFuzzer target for the GGUF reader and the model loader. Build with clang:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *   cmake --build build-fuzz --target fuzz_gguf
 *   ./build-fuzz/fuzz_gguf -max_total_time=60 -max_len=65536 CORPUS_DIR
 * A corpus seed: the first 64 KB of any .gguf file.
 *
 * Each input is used twice:
 *  1. as a GGUF file itself (bit-level: counts, lengths, offsets);
 *  2. as a list of structured edits to a real, valid model (KVQ_FUZZ_MODEL, default
 *     ../shared/models/stories260K.gguf): 13-byte records {op, index u32, value u64}
 *     that change a tensor's type byte, a dimension, its offset or n_dims, or a
 *     metadata value's bytes (a key's scalar, e.g. block_count or rms_epsilon).
 *     The edited file must be refused with a message or load and run one decode
 *     step, sanitizer-clean: bit flips alone rarely make such well-formed lies. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "kvq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint8_t *base;   /* the valid model's bytes */
static size_t base_len;
static struct gguf_file *base_f;
static char path[64];

static void load_base(void) {
    const char *m = getenv("KVQ_FUZZ_MODEL");
    FILE *f = fopen(m ? m : "../shared/models/stories260K.gguf", "rb");
    if (!f || fseek(f, 0, SEEK_END) != 0) {
        fprintf(stderr, "fuzz_gguf: no base model (set KVQ_FUZZ_MODEL); structured edits off\n");
        if (f) fclose(f);
        base_len = 1; /* tried */
        return;
    }
    long n = ftell(f);
    rewind(f);
    base = malloc((size_t)n);
    if (!base || fread(base, 1, (size_t)n, f) != (size_t)n) abort();
    fclose(f);
    base_len = (size_t)n;
    base_f = gguf_open_memory(base, base_len);
    if (!base_f) abort();
    snprintf(path, sizeof path, "/dev/shm/fuzz_gguf.%ld", (long)getpid());
}

static void parse_raw(const uint8_t *data, size_t size) {
    struct gguf_file *f = gguf_open_memory(data, size);
    if (f) {
        /* Touch what a consumer would: every key and every tensor's bytes. */
        volatile uint64_t sink = 0;
        for (uint64_t i = 0; i < gguf_n_kv(f); i++) sink += gguf_kv_at(f, i)->key.len;
        for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
            const struct gguf_tensor *t = gguf_tensor_at(f, i);
            if (t->nbytes) sink += ((const uint8_t *)t->data)[t->nbytes - 1];
        }
        (void)sink;
        gguf_close(f);
    }
}

/* Where a tensor info's fields lie in the file: after its name come n_dims (u32),
 * ne[n_dims] (u64 each), type (u32), offset (u64). */
static size_t tensor_field(const struct gguf_tensor *t, int which, uint32_t dim) {
    size_t p = (size_t)((const uint8_t *)t->name.ptr - base) + t->name.len;
    switch (which) {
    case 0: return p;                                      /* n_dims */
    case 1: return p + 4 + 8 * (dim % t->n_dims);          /* one dimension */
    case 2: return p + 4 + 8 * t->n_dims;                  /* type */
    default: return p + 4 + 8 * t->n_dims + 4;             /* offset */
    }
}

static void edit_and_load(const uint8_t *data, size_t size) {
    size_t n_edits = size / 13;
    if (!base_f || n_edits == 0) return;
    if (n_edits > 8) n_edits = 8;
    uint8_t *m = malloc(base_len);
    if (!m) abort();
    memcpy(m, base, base_len);
    for (size_t e = 0; e < n_edits; e++) {
        const uint8_t *r = data + 13 * e;
        uint32_t idx;
        uint64_t val;
        memcpy(&idx, r + 1, 4);
        memcpy(&val, r + 5, 8);
        uint64_t nt = gguf_n_tensors(base_f), nk = gguf_n_kv(base_f);
        size_t at, len;
        switch (r[0] % 6) {
        case 0: /* tensor type byte: mostly a real type, sometimes anything */
            if (!nt) continue;
            at = tensor_field(gguf_tensor_at(base_f, idx % nt), 2, 0), len = 4;
            if (val & 1) val = (val >> 1) % 40;
            break;
        case 1: /* a dimension: small values, or any */
            if (!nt) continue;
            at = tensor_field(gguf_tensor_at(base_f, idx % nt), 1, (uint32_t)(val >> 56)), len = 8;
            if (val & 1) val = (val >> 1) % 4096;
            break;
        case 2: /* the data offset */
            if (!nt) continue;
            at = tensor_field(gguf_tensor_at(base_f, idx % nt), 3, 0), len = 8;
            if (val & 1) val = ((val >> 1) % 4096) * 32;
            break;
        case 3: /* n_dims */
            if (!nt) continue;
            at = tensor_field(gguf_tensor_at(base_f, idx % nt), 0, 0), len = 4;
            val %= 6;
            break;
        default: { /* a metadata value's first bytes (scalars: the whole value) */
            if (!nk) continue;
            const struct gguf_kv *kv = gguf_kv_at(base_f, idx % nk);
            at = (size_t)((const uint8_t *)kv->key.ptr - base) + kv->key.len + 4;
            len = kv->value.type == GGUF_TYPE_STRING || kv->value.type == GGUF_TYPE_ARRAY ? 8 : 4;
            if (kv->value.type == GGUF_TYPE_UINT64 || kv->value.type == GGUF_TYPE_INT64 ||
                kv->value.type == GGUF_TYPE_FLOAT64)
                len = 8;
            if (r[0] % 6 == 5 && kv->value.type == GGUF_TYPE_FLOAT32) { /* special floats */
                static const uint32_t special[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0xbf800000u, 0, 0x00000001u};
                uint32_t sp = special[val % 6];
                val = sp;
            }
            break;
        }
        }
        if (at + len <= base_len) memcpy(m + at, &val, len); /* little-endian host */
    }
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(m, 1, base_len, f) != base_len || fclose(f) != 0) abort();
    free(m);
    struct kvq_model *model = kvq_model_load(path);
    if (!model) return;
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 16;
    cp.n_threads = 1;
    struct kvq_context *ctx = kvq_context_new(model, &cp);
    if (ctx) {
        kvq_token t[2] = {1, 2};
        struct kvq_batch b = {.n_tokens = 2, .tokens = t};
        if (kvq_decode(ctx, &b) == 0) {
            volatile float sink = kvq_get_logits(ctx, 1)[0];
            (void)sink;
        }
        kvq_context_free(ctx);
    }
    kvq_model_free(model);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!base_len) load_base();
    parse_raw(data, size);
    edit_and_load(data, size);
    return 0;
}
