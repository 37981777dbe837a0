/* The public API's error codes: each kind of failure a caller may act on comes with
 * its code beside the message (a missing file, a file that is no GGUF, a bad
 * argument, a full context, an exhausted KV budget), and a wrapped message keeps the
 * code of the failure it reports. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvq.h"

int main(void) {
    CHECK(strcmp(KVQ_VERSION_STRING, "0.1.0") == 0 && KVQ_VERSION_MAJOR == 0 && KVQ_VERSION_MINOR == 1, "version %s",
          KVQ_VERSION_STRING);

    CHECK(kvq_model_load("/nonexistent/kvq-test.gguf") == NULL, "a missing file loads");
    CHECK(kvq_last_error_code() == KVQ_ERR_IO, "missing file: code %d (%s)", kvq_last_error_code(), kvq_last_error());

    char path[] = "/tmp/kvq-test-error-codes-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    FILE *f = fdopen(fd, "wb");
    for (int i = 0; i < 64; i++) fputs("not a gguf file ", f);
    fclose(f);
    CHECK(kvq_model_load(path) == NULL, "a text file loads");
    CHECK(kvq_last_error_code() == KVQ_ERR_FORMAT, "text file: code %d (%s)", kvq_last_error_code(), kvq_last_error());
    /* a KV cache file that is not one: the loader wraps the message, keeping the code */
    struct kvq_kv_config kv;
    CHECK(kvq_seq_file_kv_config(path, &kv) != 0, "a text file reads as a KV cache file");
    CHECK(kvq_last_error_code() == KVQ_ERR_FORMAT, "text file as KV state: code %d (%s)", kvq_last_error_code(),
          kvq_last_error());
    remove(path);

    struct kvq_model *m = kvq_model_load(require_shared("models/tinydoc-q8_0.gguf"));
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return check_finish();
    struct kvq_context_params cp;
    kvq_context_params_default(&cp);
    cp.n_threads = 2;
    cp.n_seq = 0;
    CHECK(kvq_context_new(m, &cp) == NULL, "a context of no sequences");
    CHECK(kvq_last_error_code() == KVQ_ERR_INVALID, "no sequences: code %d (%s)", kvq_last_error_code(),
          kvq_last_error());

    cp.n_seq = 2;
    cp.n_ctx = 32;
    struct kvq_context *c = kvq_context_new(m, &cp);
    CHECK(c != NULL, "context: %s", kvq_last_error());
    if (!c) return check_finish();
    kvq_token toks[40];
    for (int i = 0; i < 40; i++) toks[i] = 100 + i;
    struct kvq_batch b = {.n_tokens = 40, .tokens = toks};
    CHECK(kvq_decode(c, &b) != 0, "40 tokens fit a context of 32");
    CHECK(kvq_last_error_code() == KVQ_ERR_CONTEXT_FULL, "context full: code %d (%s)", kvq_last_error_code(),
          kvq_last_error());
    kvq_context_free(c);

    /* a budget for one sequence's 32 tokens (the cache takes whole blocks, and asks for
     * what a batch may take at most before it starts): the second sequence's do not fit */
    cp.kv_budget_bytes = 64 * kvq_kv_token_bytes(m, &cp.kv);
    c = kvq_context_new(m, &cp);
    CHECK(c != NULL, "context: %s", kvq_last_error());
    if (!c) return check_finish();
    b.n_tokens = 32;
    CHECK(kvq_decode(c, &b) == 0, "decode: %s", kvq_last_error());
    int32_t seq1[32];
    for (int i = 0; i < 32; i++) seq1[i] = 1;
    b.seq_ids = seq1;
    CHECK(kvq_decode(c, &b) != 0, "a second sequence fits a budget of one");
    CHECK(kvq_last_error_code() == KVQ_ERR_BUDGET, "budget: code %d (%s)", kvq_last_error_code(), kvq_last_error());
    kvq_context_free(c);
    kvq_model_free(m);
    return check_finish();
}
