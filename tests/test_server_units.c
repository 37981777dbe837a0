/* kvq serve's pure parts: chat templates per family against the strings their
 * reference Jinja templates render, family detection by markers, OpenAI request
 * parsing (accepted fields, and one clear 400 per bad field), response JSON, and
 * the UTF-8 cleaning of generated text. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "server/chat_template.h"
#include "server/logprobs.h"
#include "server/openai_json.h"
#include "server/strbuf.h"

static const struct chat_message conv[] = {
    {"system", "You are helpful."},
    {"user", "Hello"},
    {"assistant", "Hi there"},
    {"user", "How are you?"},
};

static void expect_render(enum chat_family f, const char *expected) {
    char *got = chat_template_render(f, conv, 4, chat_family_bos(f), chat_family_eos(f));
    CHECK(got && strcmp(got, expected) == 0, "%s renders\n%s\nexpected\n%s", chat_family_name(f), got ? got : "(null)",
          expected);
    free(got);
}

static void test_templates(void) {
    expect_render(CHAT_CHATML, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                               "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
                               "<|im_start|>assistant\n");
    expect_render(CHAT_LLAMA3,
                  "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n");
    expect_render(CHAT_LLAMA2, "<s>[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHello [/INST] Hi there </s>"
                               "<s>[INST] How are you? [/INST]");
    expect_render(CHAT_MISTRAL, "<s>[INST] You are helpful.\n\nHello [/INST]Hi there</s>[INST] How are you? [/INST]");
    expect_render(CHAT_GEMMA, "<bos><start_of_turn>user\nYou are helpful.\n\nHello<end_of_turn>\n"
                              "<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nHow are you?"
                              "<end_of_turn>\n<start_of_turn>model\n");
    expect_render(CHAT_PHI3, "<|system|>\nYou are helpful.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there"
                             "<|end|>\n<|user|>\nHow are you?<|end|>\n<|assistant|>\n");
    expect_render(CHAT_ZEPHYR, "<|system|>\nYou are helpful.</s>\n<|user|>\nHello</s>\n<|assistant|>\nHi there</s>\n"
                               "<|user|>\nHow are you?</s>\n<|assistant|>\n");

    /* templates that trim content (Llama 2 and 3, Gemma) and ones that do not (ChatML) */
    const struct chat_message padded[] = {{"user", "  Hi \n"}};
    char *s = chat_template_render(CHAT_LLAMA3, padded, 1, "", "");
    CHECK(s && !strcmp(s, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n"), "llama3 trims: %s", s);
    free(s);
    s = chat_template_render(CHAT_LLAMA2, padded, 1, "<s>", "</s>");
    CHECK(s && !strcmp(s, "<s>[INST] Hi [/INST]"), "llama2 strips: %s", s);
    free(s);
    s = chat_template_render(CHAT_CHATML, padded, 1, "", "");
    CHECK(s && !strcmp(s, "<|im_start|>user\n  Hi \n<|im_end|>\n<|im_start|>assistant\n"), "chatml keeps: %s", s);
    free(s);

    /* detection from marker strings of real templates (abridged) */
    CHECK(chat_template_detect("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'") ==
              CHAT_CHATML, "chatml");
    CHECK(chat_template_detect("{{ bos_token }}{% set content = '<|start_header_id|>' + message['role'] %}") ==
              CHAT_LLAMA3, "llama3");
    CHECK(chat_template_detect("{% set content = '<<SYS>>\\n' + system_message %}{{ bos_token + '[INST] ' }}") ==
              CHAT_LLAMA2, "llama2");
    CHECK(chat_template_detect("{{ bos_token }}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
                               "+ ' [/INST]' }}") == CHAT_MISTRAL, "mistral");
    CHECK(chat_template_detect("{{ '<start_of_turn>' + role + '\\n' }}") == CHAT_GEMMA, "gemma");
    CHECK(chat_template_detect("{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>'}}") ==
              CHAT_PHI3, "phi3");
    CHECK(chat_template_detect("{{ '<|user|>\\n' + message['content'] + eos_token }}{{ '<|assistant|>' }}") ==
              CHAT_ZEPHYR, "zephyr");
    CHECK(chat_template_detect("{{ messages }}") == CHAT_UNKNOWN, "unknown");
    for (int f = 0; f < CHAT_UNKNOWN; f++)
        CHECK((int)chat_family_from_name(chat_family_name((enum chat_family)f)) == f, "name round trip %d", f);
    CHECK(chat_family_from_name("jinja") == CHAT_UNKNOWN, "unknown name");
}

static int parse_as(enum oai_kind kind, const char *body, bool strict, struct oai_request *r, struct oai_error *e) {
    return oai_parse_request(body, strlen(body), kind, strict, r, e);
}

static int parse(enum oai_kind kind, const char *body, struct oai_request *r, struct oai_error *e) {
    return parse_as(kind, body, false, r, e);
}

static void expect_400_as(enum oai_kind kind, const char *body, bool strict, const char *param) {
    struct oai_request r;
    struct oai_error e;
    int rc = parse_as(kind, body, strict, &r, &e);
    CHECK(rc == -1 && e.status == 400, "%s: rc %d status %d", body, rc, e.status);
    CHECK(rc == 0 || !strcmp(e.param, param ? param : ""), "%s: param '%s'", body, e.param);
    CHECK(rc == 0 || e.message[0], "%s: a message", body);
    if (rc == 0) oai_request_free(&r);
}

static void expect_400(enum oai_kind kind, const char *body, const char *param) {
    expect_400_as(kind, body, false, param);
}

/* With --strict-api: a 400 (else accepted). */
static void expect_400_strict(enum oai_kind kind, const char *body, const char *param) {
    expect_400_as(kind, body, true, param);
    struct oai_request r;
    struct oai_error e;
    CHECK(parse(kind, body, &r, &e) == 0, "%s accepted without --strict-api: %s", body, e.message);
    oai_request_free(&r);
}

static void test_parse(void) {
    struct oai_request r;
    struct oai_error e;
    int rc = parse(OAI_CHAT,
                   "{\"model\":\"x\",\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\","
                   "\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}],"
                   "\"max_completion_tokens\":7,\"temperature\":0,\"top_p\":0.5,\"top_k\":3,\"min_p\":0.1,"
                   "\"stop\":[\"x\",\"yz\"],\"seed\":42,\"n\":1,\"stream\":true,"
                   "\"stream_options\":{\"include_usage\":true},\"prompt_cache_key\":\"k\",\"user\":\"u\","
                   "\"presence_penalty\":0,\"logprobs\":false}",
                   &r, &e);
    CHECK(rc == 0, "full chat request: %s", e.message);
    if (rc == 0) {
        CHECK(r.n_messages == 2 && !strcmp(r.messages[1].content, "ab") && !strcmp(r.messages[0].role, "system"),
              "messages");
        CHECK(r.gen.max_tokens == 7 && r.gen.sampling.temp == 0 && r.gen.sampling.top_k == 3, "numbers");
        CHECK(r.gen.sampling.top_p == 0.5f && r.gen.sampling.min_p == 0.1f && r.gen.sampling.seed == 42, "sampling");
        CHECK(r.gen.n_stop == 2 && !strcmp(r.gen.stop[1], "yz"), "stop list");
        CHECK(r.stream && r.include_usage && r.has_seed && !strcmp(r.cache_key, "k"), "flags");
        oai_request_free(&r);
    }
    rc = parse(OAI_COMPLETION, "{\"prompt\":[\"hello\"],\"stop\":\"\\n\",\"max_tokens\":null}", &r, &e);
    CHECK(rc == 0 && r.n_prompts == 1 && !strcmp(r.prompts[0].text, "hello") && r.gen.n_stop == 1 && r.gen.max_tokens == 16 && !r.stream,
          "completion request: %s", e.message);
    if (rc == 0) oai_request_free(&r);

    expect_400(OAI_CHAT, "{\"messages\":", NULL);                                      /* malformed */
    expect_400(OAI_CHAT, "[1,2]", NULL);                                               /* not an object */
    expect_400(OAI_CHAT, "{}", "messages");                                            /* missing */
    expect_400(OAI_CHAT, "{\"messages\":[]}", "messages");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"function\",\"content\":\"x\"}]}", "messages");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"n\":200}", "n");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":\"10\"}", "max_tokens");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":0}", "max_tokens");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"temperature\":3}", "temperature");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"top_p\":\"x\"}", "top_p");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", "stop");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"stop\":[1]}", "stop");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"stream\":1}", "stream");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", "stream_options");
    expect_400_strict(OAI_COMPLETION, "{\"prompt\":\"a\",\"frobnicate\":true}", "frobnicate");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"prompt\":\"b\"}", NULL);           /* duplicate key */
    expect_400(OAI_COMPLETION, "{\"prompt\":\"\\u0000\"}", NULL);                       /* NUL in a string */
    expect_400(OAI_COMPLETION, "{\"prompt\":\"\xff\"}", NULL);                          /* invalid UTF-8 */
    expect_400(OAI_COMPLETION, "{\"prompt\":[1,\"a\"]}", "prompt");
    expect_400(OAI_COMPLETION, "{\"prompt\":[\"a\",[1]]}", "prompt");
    expect_400(OAI_COMPLETION, "{\"prompt\":[[1],[-1]]}", "prompt");
    expect_400(OAI_COMPLETION, "{\"prompt\":[]}", "prompt");
    expect_400(OAI_CHAT, "{\"prompt\":\"a\"}", "prompt"); /* a completion field on chat */
}

/* Item by item: prompt lists and token ids, n, penalties, logit_bias, the vLLM and
 * llama.cpp fields applied, those ignored (type-checked), unknown ones. */
static void test_parse_extensions(void) {
    struct oai_request r;
    struct oai_error e;
    int rc = parse(OAI_COMPLETION,
                   "{\"prompt\":[\"a\",\"bc\"],\"n\":3,\"best_of\":3,\"echo\":true,\"frequency_penalty\":0.5,"
                   "\"presence_penalty\":-1.5,\"logit_bias\":{\"7\":-100,\"12\":2.5},\"ignore_eos\":true,"
                   "\"min_tokens\":4,\"max_tokens\":9,\"stop_token_ids\":[5,6],\"cache_prompt\":true,"
                   "\"typical_p\":1,\"frobnicate\":{\"x\":1},\"repetition_penalty\":1.1}",
                   &r, &e);
    CHECK(rc == 0, "extended completion request: %s", e.message);
    if (rc == 0) {
        CHECK(r.n_prompts == 2 && !strcmp(r.prompts[1].text, "bc") && r.n == 3 && r.echo, "prompts, n, echo");
        CHECK(r.gen.frequency_penalty == 0.5f && r.gen.presence_penalty == -1.5f, "penalties");
        CHECK(r.gen.n_bias == 2 && r.gen.bias_ids[0] == 7 && r.gen.bias_values[0] == -100 && r.gen.bias_ids[1] == 12 &&
                  r.gen.bias_values[1] == 2.5f, "logit_bias");
        CHECK(r.gen.ignore_eos && r.gen.min_tokens == 4 && r.gen.n_stop_ids == 2 && r.gen.stop_ids[1] == 6, "vLLM fields");
        CHECK(fabsf(r.gen.sampling.repeat_penalty - 1.1f) < 1e-6f, "repetition_penalty");
        struct gen_params copy;
        CHECK(gen_params_copy(&copy, &r.gen) == 0 && copy.bias_ids != r.gen.bias_ids && copy.stop_ids[0] == 5,
              "deep copy");
        gen_params_free(&copy);
        oai_request_free(&r);
    }
    rc = parse(OAI_COMPLETION, "{\"prompt\":[[1,2,3],[4]],\"logit_bias\":[[3,false],[4,-1]],\"n_predict\":-1}", &r, &e);
    CHECK(rc == 0 && r.n_prompts == 2 && r.prompts[0].n_ids == 3 && r.prompts[1].ids[0] == 4 && !r.prompts[0].text,
          "token id prompts: %s", e.message);
    CHECK(rc == 0 && r.gen.n_bias == 2 && isinf(r.gen.bias_values[0]) && r.gen.bias_values[1] == -1 &&
              r.gen.max_tokens == -1, "llama.cpp's logit_bias pairs and n_predict");
    if (rc == 0) oai_request_free(&r);
    /* llama.cpp's json_schema and vLLM's guided_json (an object or its text): the schema as response_format's */
    rc = parse(OAI_COMPLETION, "{\"prompt\":\"a\",\"json_schema\":{\"type\":\"integer\"}}", &r, &e);
    CHECK(rc == 0 && r.response_schema && !strcmp(r.response_schema, "{\"type\":\"integer\"}"), "json_schema: %s",
          rc ? e.message : r.response_schema);
    if (rc == 0) oai_request_free(&r);
    rc = parse(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"guided_json\":\"{\\\"enum\\\": [1, 2]}\"}",
               &r, &e);
    CHECK(rc == 0 && r.response_schema && !strcmp(r.response_schema, "{\"enum\":[1,2]}"), "guided_json text: %s",
          rc ? e.message : r.response_schema);
    if (rc == 0) oai_request_free(&r);
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"guided_json\":\"{not json\"}", "guided_json");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"json_schema\":[1]}", "json_schema");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"response_format\":{\"type\":\"json_object\"},\"json_schema\":{}}",
               "json_schema");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"guided_json\":{},\"response_format\":{\"type\":\"json_object\"}}",
               "response_format");
    expect_400_strict(OAI_COMPLETION, "{\"prompt\":\"a\",\"json_schema\":{}}", "json_schema");
    rc = parse(OAI_COMPLETION, "{\"prompt\":[1,2,3],\"stop_token_ids\":[]}", &r, &e);
    CHECK(rc == 0 && r.n_prompts == 1 && r.prompts[0].n_ids == 3 && r.prompts[0].ids[2] == 3, "one prompt of ids");
    if (rc == 0) oai_request_free(&r);
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"frequency_penalty\":3}", "frequency_penalty");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":{\"x\":1}}", "logit_bias");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":{\"5\":101}}", "logit_bias");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"best_of\":2}", "best_of");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"min_tokens\":20,\"max_tokens\":5}", "min_tokens");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"echo\":true,\"logprobs\":2}", "echo");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"ignore_eos\":1}", "ignore_eos");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"stop_token_ids\":[1.5]}", "stop_token_ids");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"typical_p\":\"x\"}", "typical_p"); /* ignored, still typed */
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"cache_prompt\":3}", "cache_prompt");
    expect_400_strict(OAI_COMPLETION, "{\"prompt\":\"a\",\"ignore_eos\":true}", "ignore_eos");
    expect_400_strict(OAI_COMPLETION, "{\"prompt\":\"a\",\"cache_prompt\":true}", "cache_prompt");
    expect_400_strict(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"min_tokens\":2}", "min_tokens");
    expect_400_strict(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":true}", "echo");
    rc = parse_as(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_k\":3,\"n\":2,\"echo\":false}",
                  true, &r, &e);
    CHECK(rc == 0 && r.n == 2 && r.gen.sampling.top_k == 3, "strict still takes OpenAI's fields and top_k: %s", e.message);
    if (rc == 0) oai_request_free(&r);
    rc = parse_as(OAI_CHAT,
                  "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":2,\"parallel_tool_calls\":false,"
                  "\"response_format\":{\"type\":\"json_object\"},\"tool_choice\":\"required\","
                  "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
                  true, &r, &e);
    CHECK(rc == 0 && r.n == 2 && r.n_tools == 1 && r.tool_choice == OAI_TOOLS_REQUIRED && r.response_schema,
          "strict takes response_format and tools: %s", e.message);
    if (rc == 0) oai_request_free(&r);
}

/* logprobs / top_logprobs: chat takes a boolean and 0..20 alternatives, completions
 * the legacy integer; gen.logprobs is -1 when none are asked for. */
static void test_parse_logprobs(void) {
    static const struct {
        enum oai_kind kind;
        const char *body;
        int want;
    } ok[] = {
        {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", -1},
        {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true}", 0},
        {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":20}", 20},
        {OAI_CHAT, "{\"top_logprobs\":3,\"logprobs\":true,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 3},
        {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":false,\"top_logprobs\":0}", -1},
        {OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":5}", 5},
        {OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":0}", 0},
        {OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":null}", -1},
        {OAI_COMPLETION, "{\"prompt\":\"a\"}", -1},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        struct oai_request r;
        struct oai_error e;
        int rc = parse(ok[i].kind, ok[i].body, &r, &e);
        CHECK(rc == 0 && r.gen.logprobs == ok[i].want, "%s: rc %d logprobs %d (%s)", ok[i].body, rc,
              rc == 0 ? r.gen.logprobs : -2, e.message);
        if (rc == 0) oai_request_free(&r);
    }
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":21}",
               "top_logprobs");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":-1}",
               "top_logprobs");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", "top_logprobs");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":3}", "logprobs");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,\"top_logprobs\":1.5}",
               "top_logprobs");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":21}", "logprobs");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":-1}", "logprobs");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":true}", "logprobs");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":\"2\"}", "logprobs");
}

/* Several choices in one response and their chunks; embeddings as floats and as
 * base64 of little-endian float32 (1.0f is 00 00 80 3f, -2.5f is 00 00 20 c0). */
static void test_choices_and_embeddings_json(void) {
    const struct oai_usage u = {5, 6, 1};
    const struct oai_choice ch[2] = {{"ab", 2, "stop", NULL, NULL, 0}, {"cde", 3, "length", NULL, NULL, 0}};
    char *s = oai_response_json_n(OAI_COMPLETION, "id", 1, "m", ch, 2, &u);
    CHECK(s && strstr(s, "\"choices\":[{\"index\":0,\"text\":\"ab\",\"logprobs\":null,\"finish_reason\":\"stop\"},"
                         "{\"index\":1,\"text\":\"cde\",\"logprobs\":null,\"finish_reason\":\"length\"}]"),
          "two choices: %s", s);
    free(s);
    /* chat choices side by side: one with text, one with a call and no text before it */
    struct tool_call call = {"call_1", "add", "{\"a\":1}"};
    const struct oai_choice tc[2] = {{"hi", 2, "stop", NULL, NULL, 0}, {"", 0, "tool_calls", NULL, &call, 1}};
    s = oai_response_json_n(OAI_CHAT, "id", 1, "m", tc, 2, &u);
    CHECK(s && strstr(s, "{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"}") &&
              strstr(s, "{\"index\":1,\"message\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":"
                        "\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"add\",\"arguments\":\"{\\\"a\\\":1}\"}}]},"
                        "\"logprobs\":null,\"finish_reason\":\"tool_calls\"}"),
          "a choice with a tool call: %s", s);
    free(s);
    s = oai_tool_chunk_json("id", 1, "m", 2, &call, 1);
    CHECK(s && strstr(s, "\"choices\":[{\"index\":2,\"delta\":{\"tool_calls\":[{") && strstr(s, "\"index\":0}"),
          "tool-call chunk of choice 2: %s", s);
    free(s);
    s = oai_chunk_json(OAI_CHAT, "id", 1, "m", 3, true, "x", 1, NULL, NULL);
    CHECK(s && strstr(s, "\"index\":3") && strstr(s, "\"role\":\"assistant\""), "chunk of choice 3: %s", s);
    free(s);
    const float v[4] = {1.0f, -2.5f, 0.5f, 0.0f};
    s = oai_embeddings_json("m", v, 2, 2, true, 7);
    CHECK(s && strstr(s, "\"embedding\":\"AACAPwAAIMA=\"") && strstr(s, "\"embedding\":\"AAAAPwAAAAA=\"") &&
              strstr(s, "\"index\":1") && strstr(s, "\"prompt_tokens\":7,\"total_tokens\":7"),
          "base64 embeddings: %s", s);
    free(s);
    s = oai_embeddings_json("m", v, 1, 3, false, 2);
    CHECK(s && strstr(s, "\"embedding\":[1.0,-2.5,0.5]") && strstr(s, "\"object\":\"list\""), "float embeddings: %s", s);
    free(s);
    struct oai_embed_request r;
    struct oai_error e;
    const char *body = "{\"input\":[[1,2],[3]],\"model\":\"m\",\"encoding_format\":\"base64\",\"dimensions\":512}";
    CHECK(oai_parse_embeddings(body, strlen(body), false, &r, &e) == 0 && r.n_inputs == 2 && r.inputs[1].ids[0] == 3 &&
              r.base64 && r.dimensions == 512, "embeddings request: %s", e.message);
    oai_embed_request_free(&r);
    body = "{\"input\":\"a\",\"encoding_format\":\"hex\"}";
    CHECK(oai_parse_embeddings(body, strlen(body), false, &r, &e) == -1 && !strcmp(e.param, "encoding_format"),
          "bad encoding_format");
    body = "{\"model\":\"m\"}";
    CHECK(oai_parse_embeddings(body, strlen(body), false, &r, &e) == -1 && !strcmp(e.param, "input"), "no input");
}

/* lp_compute against values computed by hand (log-softmax in double precision). */
static void test_logprobs_math(void) {
    const float l[5] = {1, 2, 3, 0, 3};
    /* log Z = log(e^1 + e^2 + 2 e^3 + e^0) = 3.937269840482335 */
    struct lp_top top[LP_MAX_TOP];
    float lp = lp_compute(l, 5, 0, 3, top);
    CHECK(fabsf(lp - -2.93726984f) < 1e-5f, "chosen token 0: %.7f", lp);
    CHECK(top[0].id == 2 && top[1].id == 4 && top[2].id == 1, "top-3 order (ties: lower id first): %d %d %d",
          top[0].id, top[1].id, top[2].id);
    CHECK(fabsf(top[0].logprob - -0.93726984f) < 1e-5f && fabsf(top[1].logprob - -0.93726984f) < 1e-5f &&
              fabsf(top[2].logprob - -1.93726984f) < 1e-5f,
          "top-3 values %.7f %.7f %.7f", top[0].logprob, top[1].logprob, top[2].logprob);
    double total = 0;
    lp_compute(l, 5, 0, 5, top);
    for (int i = 0; i < 5; i++) total += exp(top[i].logprob);
    CHECK(fabs(total - 1) < 1e-6 && top[4].id == 3, "all five sum to probability 1: %.9f", total);
    CHECK(lp_compute(l, 5, 2, 0, top) == lp_compute(l, 5, 4, 0, top), "k = 0: just the chosen token");

    /* a masked logit (-inf) is reported as OpenAI's floor, never as -inf or NaN */
    const float m[4] = {0.5f, -1.25f, -INFINITY, 2.0f};
    lp = lp_compute(m, 4, 2, 20, top); /* k larger than the vocabulary: clamped to 4 */
    CHECK(lp == LP_FLOOR, "-inf logit gives %g", lp);
    CHECK(top[0].id == 3 && fabsf(top[0].logprob - -0.23262198f) < 1e-5f && top[3].id == 2 && top[3].logprob == LP_FLOOR,
          "top with a masked token: %d %.7f / %d %g", top[0].id, top[0].logprob, top[3].id, top[3].logprob);
    CHECK(fabsf(lp_compute(m, 4, 1, 0, top) - -3.48262198f) < 1e-5f, "token 1");

    /* a large vocabulary with big logits: the sum in double stays exact enough */
    enum { N = 150000 };
    float *big = malloc(sizeof *big * N);
    for (int i = 0; i < N; i++) big[i] = 80.0f + (float)(i % 7) * 0.001f;
    lp = lp_compute(big, N, 6, 1, top);
    double ref = 0.006 - log(N / 7.0 * (exp(0) + exp(0.001) + exp(0.002) + exp(0.003) + exp(0.004) + exp(0.005) + exp(0.006))) ;
    /* the reference is only close, since N is not a multiple of 7; compare loosely */
    CHECK(isfinite(lp) && fabs(lp - ref) < 1e-4, "big vocabulary: %.7f vs %.7f", lp, ref);
    CHECK(top[0].id == 6, "argmax of the big vocabulary: %d", top[0].id);
    free(big);
}

/* Token t of a fake vocabulary: "t<id>", except 7: the bytes 0xe2 0x82 (part of a
 * UTF-8 sequence). */
static int fake_piece(const void *ctx, kvq_token t, char *buf, int size) {
    (void)ctx;
    char tmp[16];
    int n = t == 7 ? 2 : snprintf(tmp, sizeof tmp, "t%d", t);
    if (t == 7) memcpy(tmp, "\xe2\x82", 2);
    memcpy(buf, tmp, (size_t)(n < size ? n : size));
    return n;
}

static void test_logprobs_json(void) {
    struct lp_entry e[2] = {
        {.id = 5, .logprob = -0.5f, .n_top = 2, .top = {{5, -0.5f}, {9, -1.25f}}, .text_start = 0, .text_end = 2},
        {.id = 7, .logprob = -2.0f, .n_top = 1, .top = {{3, -0.25f}}, .text_start = 2, .text_end = 5},
    };
    struct oai_logprobs lp = {e, 2, fake_piece, NULL};
    struct oai_usage u = {1, 2, 0};
    char *s = oai_response_json(OAI_CHAT, "id", 1, "m", "t5\xef\xbf\xbd", 5, "stop", &u, &lp);
    CHECK(s && strstr(s, "\"logprobs\":{\"content\":[{\"token\":\"t5\",\"logprob\":-0.5,\"bytes\":[116,53],"
                         "\"top_logprobs\":[{\"token\":\"t5\",\"logprob\":-0.5,\"bytes\":[116,53]},"
                         "{\"token\":\"t9\",\"logprob\":-1.25,\"bytes\":[116,57]}]},"
                         "{\"token\":\"\xef\xbf\xbd\xef\xbf\xbd\",\"logprob\":-2.0,\"bytes\":[226,130],"
                         "\"top_logprobs\":[{\"token\":\"t3\",\"logprob\":-0.25,\"bytes\":[116,51]}]}],"
                         "\"refusal\":null}"),
          "chat logprobs: %s", s);
    free(s);
    s = oai_response_json(OAI_COMPLETION, "id", 1, "m", "t5", 2, "stop", &u, &lp);
    CHECK(s && strstr(s, "\"logprobs\":{\"tokens\":[\"t5\",\"\xef\xbf\xbd\xef\xbf\xbd\"],\"token_logprobs\":[-0.5,-2.0],"
                         "\"top_logprobs\":[{\"t5\":-0.5,\"t9\":-1.25},{\"t3\":-0.25}],\"text_offset\":[0,2]}"),
          "completion logprobs: %s", s);
    free(s);
    struct oai_logprobs one = {e + 1, 1, fake_piece, NULL};
    s = oai_chunk_json(OAI_COMPLETION, "id", 1, "m", 0, false, "x", 1, NULL, &one);
    CHECK(s && strstr(s, "\"text_offset\":[2]") && strstr(s, "\"text\":\"x\""), "chunk logprobs: %s", s);
    free(s);
    s = oai_chunk_json(OAI_CHAT, "id", 1, "m", 0, false, "x", 1, NULL, NULL);
    CHECK(s && strstr(s, "\"logprobs\":null"), "no logprobs asked: null: %s", s);
    free(s);
}

static void test_json_out(void) {
    struct oai_error e;
    oai_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key", "bad %s", "key");
    char *s = oai_error_json(&e);
    CHECK(s && !strcmp(s, "{\"error\":{\"message\":\"bad key\",\"type\":\"invalid_request_error\",\"param\":null,"
                          "\"code\":\"invalid_api_key\"}}"), "error json: %s", s);
    free(s);
    struct oai_usage u = {10, 3, 4};
    s = oai_response_json(OAI_CHAT, "id1", 5, "m", "hi", 2, "length", &u, NULL);
    CHECK(s && strstr(s, "\"message\":{\"role\":\"assistant\",\"content\":\"hi\"}") &&
              strstr(s, "\"finish_reason\":\"length\"") && strstr(s, "\"total_tokens\":13") &&
              strstr(s, "\"prompt_tokens_details\":{\"cached_tokens\":4}"), "chat response: %s", s);
    free(s);
    s = oai_chunk_json(OAI_CHAT, "id1", 5, "m", 0, true, "", 0, NULL, NULL);
    CHECK(s && strstr(s, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"}") && strstr(s, "\"finish_reason\":null"),
          "first chunk: %s", s);
    free(s);
    s = oai_usage_chunk_json(OAI_COMPLETION, "id1", 5, "m", &u);
    CHECK(s && strstr(s, "\"choices\":[]") && strstr(s, "\"usage\""), "usage chunk: %s", s);
    free(s);
}

static void test_utf8(void) {
    struct strbuf b = {0};
    strbuf_add_utf8(&b, "a\xc3\xa9" "b\xff" "c\xe2\x82" "d\xed\xa0\x80", 13);
    char *s = strbuf_take(&b);
    CHECK(s && !strcmp(s, "a\xc3\xa9" "b\xef\xbf\xbd" "c\xef\xbf\xbd\xef\xbf\xbd" "d\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"),
          "utf8 cleaned: %s", s);
    free(s);
}

/* kvq_model_meta_str, which the server reads tokenizer.chat_template with. */
static void test_meta(void) {
    const char *path = shared_path("models/tinydoc-q8_0.gguf");
    if (!path) {
        printf("note: ../shared missing, kvq_model_meta_str not checked\n");
        return;
    }
    struct kvq_model *m = kvq_model_load(path);
    CHECK(m != NULL, "load: %s", kvq_last_error());
    if (!m) return;
    char buf[16];
    CHECK(kvq_model_meta_str(m, "general.architecture", buf, sizeof buf) == 5 && !strcmp(buf, "llama"), "arch");
    CHECK(kvq_model_meta_str(m, "general.architecture", buf, 3) == 5 && !strcmp(buf, "ll"), "cut to the buffer");
    CHECK(kvq_model_meta_str(m, "general.architecture", NULL, 0) == 5, "length only");
    CHECK(kvq_model_meta_str(m, "no.such.key", buf, sizeof buf) == -1, "missing key");
    CHECK(kvq_model_meta_str(m, "llama.block_count", buf, sizeof buf) == -1, "not a string");
    kvq_model_free(m);
}

int main(void) {
    test_meta();
    test_templates();
    test_parse();
    test_parse_extensions();
    test_choices_and_embeddings_json();
    test_parse_logprobs();
    test_logprobs_math();
    test_logprobs_json();
    test_json_out();
    test_utf8();
    return check_finish();
}
