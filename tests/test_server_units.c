/* kvq serve's pure parts: the built-in chat templates against the strings their
 * families' reference templates render, the chat template's variables (tools, the
 * tool_use variant, tool-call arguments, BOS), OpenAI request parsing (accepted
 * fields, and one clear 400 per bad field), response JSON, and the UTF-8 cleaning
 * of generated text. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "server/chat_template.h"
#include "server/logprobs.h"
#include "server/openai_json.h"
#include "server/strbuf.h"

static const char conv[] = "[{\"role\": \"system\", \"content\": \"You are helpful.\"},"
                          "{\"role\": \"user\", \"content\": \"Hello\"},"
                          "{\"role\": \"assistant\", \"content\": \"Hi there\"},"
                          "{\"role\": \"user\", \"content\": \"How are you?\"}]";

/* Renders messages (JSON text) with a template; NULL with err on a refusal. */
static char *apply_extra(const struct chat_template_params *p, const char *messages, const char *tools,
                         const char *extra, char *err) {
    char perr[256];
    struct chat_template *t = chat_template_new(p, perr, sizeof perr);
    CHECK(t, "template: %s", perr);
    if (!t) return NULL;
    json_t *m = json_loads(messages, 0, NULL), *tl = tools ? json_loads(tools, 0, NULL) : NULL;
    json_t *x = extra ? json_loads(extra, 0, NULL) : NULL;
    struct chat_request q = {m, tl, x, true};
    char *out = chat_template_apply(t, &q, err, 256);
    json_decref(m);
    json_decref(tl);
    json_decref(x);
    chat_template_free(t);
    return out;
}

static char *apply(const struct chat_template_params *p, const char *messages, const char *tools, char *err) {
    return apply_extra(p, messages, tools, NULL, err);
}

/* The built-in templates (for models whose GGUF has none) render their families' formats. */
static void expect_builtin(const char *name, const char *bos, const char *eos, const char *expected) {
    struct chat_template_params p = {.text = chat_template_builtin(name), .bos = bos, .eos = eos};
    char err[256] = "";
    CHECK(p.text, "built-in %s", name);
    char *got = p.text ? apply(&p, conv, NULL, err) : NULL;
    CHECK(got && strcmp(got, expected) == 0, "%s renders\n%s\nexpected\n%s", name, got ? got : err, expected);
    free(got);
}

static void test_templates(void) {
    expect_builtin("chatml", "", "<|im_end|>",
                   "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                   "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
                   "<|im_start|>assistant\n");
    expect_builtin("llama3", "<|begin_of_text|>", "<|eot_id|>",
                   "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n");
    expect_builtin("llama2", "<s>", "</s>",
                   "<s>[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHello [/INST] Hi there </s>"
                   "<s>[INST] How are you? [/INST]");
    expect_builtin("mistral", "<s>", "</s>",
                   "<s>[INST] You are helpful.\n\nHello [/INST]Hi there</s>[INST] How are you? [/INST]");
    expect_builtin("gemma", "<bos>", "<eos>",
                   "<bos><start_of_turn>user\nYou are helpful.\n\nHello<end_of_turn>\n"
                   "<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nHow are you?"
                   "<end_of_turn>\n<start_of_turn>model\n");
    expect_builtin("phi3", "<s>", "<|endoftext|>",
                   "<|system|>\nYou are helpful.<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there"
                   "<|end|>\n<|user|>\nHow are you?<|end|>\n<|assistant|>\n");
    expect_builtin("zephyr", "<s>", "</s>",
                   "<|system|>\nYou are helpful.</s>\n<|user|>\nHello</s>\n<|assistant|>\nHi there</s>\n"
                   "<|user|>\nHow are you?</s>\n<|assistant|>\n");
    CHECK(chat_template_builtin("qwen") == chat_template_builtin("chatml"), "qwen is chatml");
    CHECK(!chat_template_builtin("jinja"), "unknown name");

    char err[256] = "";
    /* a leading BOS text is dropped when the tokenizer adds BOS itself */
    struct chat_template_params p = {.text = chat_template_builtin("llama3"), .bos = "<|begin_of_text|>",
                                     .eos = "<|eot_id|>", .strip_bos = true};
    char *s = apply(&p, "[{\"role\": \"user\", \"content\": \" Hi \"}]", NULL, err);
    CHECK(s && !strcmp(s, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n"), "strip_bos: %s", s ? s : err);
    free(s);
    /* a template's refusal is an error, not a prompt */
    p = (struct chat_template_params){.text = chat_template_builtin("gemma"), .bos = "<bos>", .eos = "<eos>"};
    s = apply(&p, "[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"b\"}]", NULL, err);
    CHECK(!s && strstr(err, "must alternate"), "gemma refuses: %s", s ? s : err);
    free(s);
    /* tools go to the tool_use variant when there is one; string arguments of tool calls
     * become objects */
    p = (struct chat_template_params){
        .text = "plain{{ tools is none }}",
        .tool_use_text = "{% for t in tools %}{{ t.function.name }};{% endfor %}"
                         "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}"
                         "{% endfor %}{% endfor %}",
        .bos = "",
        .eos = ""};
    const char *calls = "[{\"role\": \"user\", \"content\": \"w?\"}, {\"role\": \"assistant\", \"content\": null, "
                        "\"tool_calls\": [{\"id\": \"1\", \"type\": \"function\", \"function\": {\"name\": \"w\", "
                        "\"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]}]";
    s = apply(&p, calls, NULL, err);
    CHECK(s && !strcmp(s, "plainTrue"), "no tools: %s", s ? s : err);
    free(s);
    s = apply(&p, calls, "[{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]", err);
    CHECK(s && !strcmp(s, "w;{\"city\": \"Paris\"}"), "tool_use: %s", s ? s : err);
    free(s);
    /* a template that concatenates the arguments (DeepSeek-R1) gets them as sent */
    p.tool_use_text = "{% for m in messages %}{% for c in m.tool_calls %}{{ 'args: ' + c.function.arguments }}"
                      "{% endfor %}{% endfor %}";
    s = apply(&p, calls, "[{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]", err);
    CHECK(s && !strcmp(s, "args: {\"city\": \"Paris\"}"), "arguments as sent: %s", s ? s : err);
    free(s);
    /* an error that is not about the arguments is reported */
    p.tool_use_text = "{{ raise_exception('no tools here') }}";
    s = apply(&p, calls, "[{\"type\": \"function\", \"function\": {\"name\": \"w\"}}]", err);
    CHECK(!s && strstr(err, "no tools here"), "refusal with tools: %s", s ? s : err);
    free(s);
    /* chat_template_kwargs: extra variables, which do not replace the standard ones */
    p = (struct chat_template_params){.text = "{{ enable_thinking }} {{ messages | length }} {{ add_generation_prompt }}",
                                      .bos = "", .eos = ""};
    s = apply_extra(&p, calls, NULL, "{\"enable_thinking\": false, \"messages\": [], \"add_generation_prompt\": 0}", err);
    CHECK(s && !strcmp(s, "False 2 True"), "extra variables: %s", s ? s : err);
    free(s);
    p = (struct chat_template_params){.text = " \n", .bos = "", .eos = ""};
    CHECK(!chat_template_new(&p, err, sizeof err) && strstr(err, "empty"), "empty template: %s", err);
    p = (struct chat_template_params){.text = "{% if %}", .bos = "", .eos = ""};
    CHECK(!chat_template_new(&p, err, sizeof err) && strstr(err, "does not parse"), "bad template: %s", err);
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
        CHECK(json_array_size(r.messages) == 2 &&
                  !strcmp(json_string_value(json_object_get(json_array_get(r.messages, 1), "content")), "ab") &&
                  !strcmp(json_string_value(json_object_get(json_array_get(r.messages, 0), "role")), "system"),
              "messages");
        CHECK(r.gen.max_tokens == 7 && r.gen.sampling.temp == 0 && r.gen.sampling.top_k == 3, "numbers");
        CHECK(r.gen.sampling.top_p == 0.5f && r.gen.sampling.min_p == 0.1f && r.gen.sampling.seed == 42, "sampling");
        CHECK(r.gen.n_stop == 2 && !strcmp(r.gen.stop[1], "yz"), "stop list");
        CHECK(r.stream && r.include_usage && r.has_seed && !strcmp(r.cache_key, "k"), "flags");
        oai_request_free(&r);
    }
    /* tool calls and results pass through; content of a tool-call turn stays null */
    rc = parse(OAI_CHAT,
               "{\"messages\":[{\"role\":\"user\",\"content\":\"w?\"},{\"role\":\"assistant\",\"tool_calls\":"
               "[{\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"w\",\"arguments\":\"{}\"}}]},"
               "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":[{\"type\":\"text\",\"text\":\"sunny\"}]}],"
               "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"w\",\"parameters\":{}}}]}",
               &r, &e);
    CHECK(rc == 0, "tool messages: %s", e.message);
    if (rc == 0) {
        json_t *a = json_array_get(r.messages, 1), *t = json_array_get(r.messages, 2);
        CHECK(json_is_null(json_object_get(a, "content")) && json_array_size(json_object_get(a, "tool_calls")) == 1,
              "assistant tool call");
        CHECK(!strcmp(json_string_value(json_object_get(t, "content")), "sunny") &&
                  !strcmp(json_string_value(json_object_get(t, "tool_call_id")), "c1"),
              "tool result");
        CHECK(json_array_size(r.tools_json) == 1 && r.n_tools == 1, "tools kept");
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
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\"}]}", "messages");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":{}}]}", "messages");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{}}]}]}", "messages");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":{}}", "tools");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":[]}",
               "chat_template_kwargs");
    expect_400(OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"x\"}]}", "tools");
    expect_400(OAI_COMPLETION, "{\"prompt\":\"a\",\"tools\":[{\"type\":\"function\"}]}", "tools");
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
