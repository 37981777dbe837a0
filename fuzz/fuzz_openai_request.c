/* libFuzzer target for kvq serve's request path: a JSON body to generation
 * parameters (both endpoints), then the chat prompt and a response built from it.
 * Build with clang:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *   cmake --build build-fuzz --target fuzz_openai_request
 *   ./build-fuzz/fuzz_openai_request -max_total_time=60 -max_len=4096 -dict=fuzz/openai.dict CORPUS_DIR
 * Seeds: a few request bodies, e.g. {"messages":[{"role":"user","content":"hi"}],"stop":["a"]}. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/chat_template.h"
#include "server/openai_json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    for (int k = 0; k < 2; k++) {
        struct oai_request r;
        struct oai_error e;
        enum oai_kind kind = k ? OAI_COMPLETION : OAI_CHAT;
        if (oai_parse_request((const char *)data, size, kind, &r, &e) != 0) {
            free(oai_error_json(&e));
            continue;
        }
        char *prompt = kind == OAI_CHAT ? chat_template_render((enum chat_family)(size % CHAT_UNKNOWN), r.messages,
                                                               r.n_messages, "<s>", "</s>")
                                        : NULL;
        const char *text = prompt ? prompt : r.prompt ? r.prompt : "";
        struct oai_usage u = {r.gen.max_tokens, r.gen.n_stop, r.n_messages};
        free(oai_response_json(kind, "id", 0, "m", text, strlen(text), "stop", &u));
        free(oai_chunk_json(kind, "id", 0, "m", true, text, strlen(text), NULL));
        free(prompt);
        oai_request_free(&r);
    }
    return 0;
}
