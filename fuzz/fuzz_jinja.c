/* libFuzzer target for the Jinja interpreter: the input is a template, rendered
 * with a small conversation; any input must give a result or one error message,
 * within the interpreter's memory and step limits. Build with clang:
 *   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKVQ_FUZZ=ON -DKVQ_SANITIZE=ON
 *   cmake --build build-fuzz --target fuzz_jinja
 *   ./build-fuzz/fuzz_jinja -max_total_time=60 -max_len=2048 tests/chat_templates */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static json_t *vars;
    if (!vars)
        vars = json_loads("{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": "
                          "\"hi\"}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c\", "
                          "\"function\": {\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5, null]}}}]}], "
                          "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}], "
                          "\"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}",
                          0, NULL);
    char *src = malloc(size + 1);
    if (!src) return 0;
    memcpy(src, data, size);
    src[size] = 0;
    char err[256];
    struct jinja_template *t = jinja_parse(src, err, sizeof err);
    if (t) free(jinja_render(t, vars, 0, err, sizeof err));
    jinja_free(t);
    free(src);
    return 0;
}
