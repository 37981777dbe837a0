/* Structure-aware libFuzzer target for saved sequence / prompt-cache files
 * (kvq_seq_load_ex). A plain byte fuzzer only meets the trailing FNV-1a checksum,
 * so here the input is the file *without* its checksum: the target appends the
 * right one, and every mutation lands beneath it, in the header fields, the KV
 * config, token ids, logits, layer sections and rows. The file's own KV config
 * picks the context's config (as `kvq generate --prompt-cache` does); a file that
 * loads is then decoded one token further, so attention reads the loaded rows.
 *
 * Build (clang): cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *                cmake --build build-fuzz --target fuzz_seq_cache
 * Seeds: files from `kvq cache-prompt -m ../shared/models/stories260K.gguf` (several
 * --kv-bits) without their last 8 bytes (`head -c -8`): with the checksum left on, every
 * mutant would carry 8 stray bytes and stop at "trailing bytes", never loading.
 * Model: KVQ_FUZZ_MODEL, default ../shared/models/stories260K.gguf. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static struct kvq_model *model;
static char path[64];

static uint64_t fnv1a(const uint8_t *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *m = getenv("KVQ_FUZZ_MODEL");
    model = kvq_model_load(m ? m : "../shared/models/stories260K.gguf");
    if (!model) {
        fprintf(stderr, "fuzz_seq_cache: %s (set KVQ_FUZZ_MODEL)\n", kvq_last_error());
        exit(1);
    }
    snprintf(path, sizeof path, "/dev/shm/fuzz_seq_cache.%ld", (long)getpid());
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > (1u << 22)) return 0;
    uint64_t sum = fnv1a(data, size);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(sum >> (8 * i));
    if (fwrite(data, 1, size, f) != size || fwrite(le, 1, 8, f) != 8 || fclose(f) != 0) abort();

    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_ctx = 256;
    cp.n_threads = 1;
    cp.n_batch = 8;
    if (kvq_seq_file_kv_config(path, &cp.kv) != 0) return 0;
    struct kvq_context *ctx = kvq_context_new(model, &cp);
    if (!ctx) return 0;
    struct kvq_seq_extra extra;
    if (kvq_seq_load_ex(ctx, 0, path, &extra) == 0) {
        if (kvq_seq_len(ctx, 0) < 250 || cp.kv.max_size > 0) { /* one more token reads every loaded row */
            kvq_token t = extra.n_tokens > 0 ? extra.tokens[extra.n_tokens - 1] : 1;
            struct kvq_batch b = {.n_tokens = 1, .tokens = &t};
            if (kvq_decode(ctx, &b) == 0) {
                volatile float sink = kvq_get_logits(ctx, 0)[0];
                (void)sink;
            }
        }
        kvq_seq_extra_free(&extra);
    } else if (kvq_last_error()[0] == '\0') {
        abort(); /* a refusal must say why */
    }
    kvq_context_free(ctx);
    return 0;
}
