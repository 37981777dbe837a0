/* BPE pre-tokenization: the regex list for each tokenizer.ggml.pre family, run
 * with PCRE2. The regexes are applied one after another, each to every piece
 * the previous one produced; both the matches and the text between matches
 * become pieces (llama.cpp's convention), and no piece ever spans two pieces of
 * the previous step. The patterns are those llama.cpp uses (some adapted from
 * the models' tokenizer.json files). */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "tokenizer/tok_internal.h"

/* --- the patterns -------------------------------------------------------- */

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"

#define RE_CONTRACTIONS_CI "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

#define RE_LLAMA3                                                                                  \
    RE_CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
                       "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

#define RE_QWEN2                                                                                \
    RE_CONTRACTIONS_CI "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|" \
                       "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* Letters of the DeepSeek LLM tokenizer's Latin/Greek/Cyrillic/... class. */
#define RE_DEEPSEEK_LETTERS                                                                        \
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\\x{1F7D}ᾀ-ᾴᾶ-ᾼ\\x{1FBE}ῂ-ῄῆ-ῌῐ-\\x{1FD3}ῖ-\\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\\x{2126}ℨ\\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"

#define RE_CJK "[一-龥ࠀ-一가-퟿]+"

/* Tekken / GPT-4o in llama.cpp's lookahead form ("a letter that is not a-z"). */
#define RE_TEKKEN                                                                         \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|"               \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s" \
    "\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

#define RE_GPT4O                                                                                   \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" RE_CONTRACTIONS_CI "?|" \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" RE_CONTRACTIONS_CI "?|" \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

struct pre_family {
    const char *names; /* '|'-separated tokenizer.ggml.pre values */
    bool ignore_merges;
    bool add_bos;
    const char *regex[TOK_MAX_REGEX]; /* NULL-terminated */
};

static const struct pre_family families[] = {
    {"default", false, false, {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
    {"llama3|llama-v3|llama-bpe|falcon3|falcon-h1|pixtral|midm-2.0|lfm2", true, true, {RE_LLAMA3}},
    {"dbrx|smaug-bpe|chatglm-bpe|glm4", false, false, {RE_LLAMA3}},
    {"deepseek-llm",
     false,
     false,
     {"[\r\n]", RE_DEEPSEEK_LETTERS, "\\s?[!-/:-~！-／：-～‘-‟　-。]+", "\\s+$", RE_CJK, "\\p{N}+"}},
    {"deepseek-coder", false, false, {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", RE_CJK, "\\p{N}"}},
    {"deepseek-v3",
     false,
     false,
     {"\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
      "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}},
    {"falcon", false, false, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"}},
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b", false, false, {"\\p{N}", RE_GPT2}},
    {"gpt-2|phi-2|mpt|olmo|jais|exaone4|jina-es|jina-de|jina-v2-es|jina-v2-de|roberta-bpe|jina-v1-en|"
     "jina-v2-code|trillion|granite-docling|mellum|gigachat|a.x-4.0|modern-bert",
     false,
     false,
     {RE_GPT2}},
    {"qwen2|deepseek-r1-qwen|stablelm2|megrez|hunyuan|kormo", false, false, {RE_QWEN2}},
    {"poro-chat|bloom|gpt3-finnish", false, false, {" ?[^(\\s|.,!?…。，、।۔،)]+"}},
    {"viking", false, false, {" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"}},
    {"tekken", true, true, {RE_TEKKEN}},
    {"gpt-4o|llama4", false, false, {RE_GPT4O}},
};

static bool name_in_list(const char *list, const char *name) {
    size_t n = strlen(name);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, '|');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && memcmp(p, name, n) == 0) return true;
        p += len + (end != NULL);
    }
    return false;
}

int pretok_init(struct pretokenizer *p, const char *pre_name, bool *ignore_merges, bool *add_bos_default) {
    memset(p, 0, sizeof *p);
    const char *name = pre_name && *pre_name ? pre_name : "default";
    const struct pre_family *fam = NULL;
    for (size_t i = 0; i < sizeof families / sizeof families[0] && !fam; i++)
        if (name_in_list(families[i].names, name)) fam = &families[i];
    if (!fam) return kvq_error("tokenizer: unknown pre-tokenizer type '%s'", name);
    *ignore_merges = fam->ignore_merges;
    *add_bos_default = fam->add_bos;

    const uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY | PCRE2_MATCH_INVALID_UTF;
    for (int i = 0; i < TOK_MAX_REGEX && fam->regex[i]; i++) {
        int err;
        PCRE2_SIZE err_off;
        pcre2_code *code = pcre2_compile((PCRE2_SPTR)fam->regex[i], PCRE2_ZERO_TERMINATED, opts, &err, &err_off, NULL);
        if (!code) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(err, msg, sizeof msg);
            pretok_free(p);
            return kvq_error("tokenizer: regex %d of pre-tokenizer '%s' does not compile at %zu: %s", i, name,
                             (size_t)err_off, (const char *)msg);
        }
        pcre2_jit_compile(code, PCRE2_JIT_COMPLETE); /* optional speed-up; the interpreter is the fallback */
        p->code[p->n_regex++] = code;
    }
    return 0;
}

void pretok_free(struct pretokenizer *p) {
    for (int i = 0; i < p->n_regex; i++) pcre2_code_free((pcre2_code *)p->code[i]);
    p->n_regex = 0;
}

/* --- splitting ----------------------------------------------------------- */

static int piece_push(struct piece_vec *v, size_t off, size_t len) {
    if (len == 0) return 0;
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        struct piece *p = realloc(v->data, cap * sizeof *p);
        if (!p) return -1;
        v->data = p;
        v->cap = cap;
    }
    v->data[v->n++] = (struct piece){off, len};
    return 0;
}

/* One match attempt; falls back to the interpreter when the JIT runs out of stack. */
static int match_at(const pcre2_code *code, const char *subj, size_t len, size_t start, pcre2_match_data *md) {
    int rc = pcre2_match(code, (PCRE2_SPTR)subj, len, start, 0, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(code, (PCRE2_SPTR)subj, len, start, PCRE2_NO_JIT, md, NULL);
    return rc;
}

/* Splits one piece (its own subject: lookarounds cannot see past it) into
 * matches and the gaps between them. */
static int split_piece(const pcre2_code *code, pcre2_match_data *md, const char *text, struct piece pc,
                       struct piece_vec *out) {
    const char *subj = text + pc.off;
    size_t start = 0, prev_end = 0;
    while (start < pc.len) {
        int rc = match_at(code, subj, pc.len, start, md);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return kvq_error("tokenizer: regex match failed: %s", (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t m0 = ov[0], m1 = ov[1];
        if (m1 == m0) { /* empty match: step over one character */
            start = m0 + utf8_lead_len((unsigned char)subj[m0]);
            continue;
        }
        if (piece_push(out, pc.off + prev_end, m0 - prev_end) || piece_push(out, pc.off + m0, m1 - m0)) return -2;
        prev_end = start = m1;
    }
    return piece_push(out, pc.off + prev_end, pc.len - prev_end) ? -2 : 0;
}

int pretok_split(const struct pretokenizer *p, const char *text, size_t len, struct piece_vec *out) {
    struct piece_vec cur = {0}, next = {0};
    if (piece_push(&cur, 0, len) != 0) return kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory");
    int rc = 0;
    for (int r = 0; r < p->n_regex && rc == 0; r++) {
        const pcre2_code *code = (const pcre2_code *)p->code[r];
        pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
        if (!md) {
            rc = -2;
            break;
        }
        next.n = 0;
        for (size_t i = 0; i < cur.n && rc == 0; i++) rc = split_piece(code, md, text, cur.data[i], &next);
        pcre2_match_data_free(md);
        struct piece_vec tmp = cur;
        cur = next;
        next = tmp;
    }
    free(next.data);
    if (rc != 0) {
        free(cur.data);
        return rc == -2 ? kvq_error_code(KVQ_ERR_OOM, "tokenizer: out of memory") : -1;
    }
    free(out->data);
    *out = cur;
    return 0;
}
