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

#include <jansson.h>

#include "server/chat_template.h"
#include "server/openai_json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Token t of the fake vocabulary is the byte t (so pieces can be invalid UTF-8). */
static int byte_piece(const void *ctx, kvq_token t, char *buf, int size) {
    (void)ctx;
    if (size > 0) buf[0] = (char)t;
    return 1;
}

static const char *const builtin_names[] = {"chatml", "llama2", "llama3", "mistral", "gemma", "phi3", "zephyr"};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct chat_template_params tp = {.text = chat_template_builtin(builtin_names[size % 7]), .bos = "<s>",
                                      .eos = "</s>", .strip_bos = size % 2};
    char err[256];
    struct chat_template *tmpl = chat_template_new(&tp, err, sizeof err);
    for (int k = 0; k < 2; k++) {
        struct oai_request r;
        struct oai_error e;
        enum oai_kind kind = k ? OAI_COMPLETION : OAI_CHAT;
        if (oai_parse_request((const char *)data, size, kind, size % 2 == 0, &r, &e) != 0) {
            free(oai_error_json(&e));
            continue;
        }
        struct chat_request cr = {r.messages, oai_tools_on(&r) ? r.tools_json : NULL, r.template_kwargs, true};
        char *prompt = kind == OAI_CHAT && tmpl ? chat_template_apply(tmpl, &cr, err, sizeof err) : NULL;
        const char *text = prompt ? prompt : r.n_prompts && r.prompts[0].text ? r.prompts[0].text : "";
        struct oai_usage u = {r.gen.max_tokens, r.gen.n_stop, (int)json_array_size(r.messages)};
        /* log-probabilities when asked for: one entry per byte of the text, its
         * alternatives the next bytes */
        struct lp_entry lpe[8];
        int n_lp = 0;
        for (size_t i = 0; r.gen.logprobs >= 0 && i < strlen(text) && n_lp < 8; i++, n_lp++) {
            lpe[n_lp] = (struct lp_entry){.id = (unsigned char)text[i], .logprob = -(float)i, .text_start = i,
                                          .text_end = i + 1, .n_top = r.gen.logprobs};
            for (int j = 0; j < r.gen.logprobs; j++) lpe[n_lp].top[j] = (struct lp_top){(kvq_token)(text[i] + j), -j};
        }
        struct oai_logprobs lp = {lpe, n_lp, byte_piece, NULL};
        free(oai_response_json(kind, "id", 0, "m", text, strlen(text), "stop", &u, r.gen.logprobs >= 0 ? &lp : NULL));
        free(oai_chunk_json(kind, "id", 0, "m", 0, true, text, strlen(text), NULL, r.gen.logprobs >= 0 ? &lp : NULL));
        free(prompt);
        oai_request_free(&r);
    }
    chat_template_free(tmpl);
    return 0;
}
