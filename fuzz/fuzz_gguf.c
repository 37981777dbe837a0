/* libFuzzer target for the GGUF reader. Build with clang:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *   cmake --build build-fuzz --target fuzz_gguf
 *   ./build-fuzz/fuzz_gguf -max_total_time=60 -max_len=65536 CORPUS_DIR
 * A corpus seed: the first 64 KB of any .gguf file. */
#include <stddef.h>
#include <stdint.h>

#include "gguf/gguf.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
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
    return 0;
}
