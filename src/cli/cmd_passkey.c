/* kvq passkey: long-context fact recall.
 *
 * Each trial's prompt, for a total length of L tokens (BOS included), is the
 * concatenation of separately tokenized parts:
 *   BOS + tok(INTRO "\n") + filler[0:pos] + tok("\n" NEEDLE "\n") + filler[pos:] + tok("\n" QUESTION)
 * INTRO    = "There is a pass key hidden in this text. Find it and remember it."
 * NEEDLE   = "The pass key is K. Remember it. K is the pass key."   (K: 5 random digits)
 * QUESTION = "What is the pass key? The pass key is"
 * The filler is a run of tokens of the filler text (tokenized once, without BOS),
 * starting at a random offset, as long as L needs; pos is uniform over the filler.
 * Then 8 tokens are generated greedily; a trial succeeds when K appears in them.
 * All trials of one length run together as separate sequences.
 *
 * The newline joins ("--format newline", the default) reproduce the Hugging Face
 * reference for tinydoc (100% at 512 tokens); joining the parts with spaces only
 * ("--format space": each part tokenized on its own, so a SentencePiece tokenizer
 * starts each as a new word) scored 85% (17/20) at 512. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

static const char *const passkey_help =
    "usage: kvq passkey -m MODEL [-f FILLER] [--lengths 512,1024,2048,4000] [--trials 20] [options] [cache flags]\n"
    "\n"
    "Hides \"The pass key is K. Remember it. K is the pass key.\" (K: 5 random digits) at a\n"
    "random place in filler text after \"There is a pass key hidden in this text. Find it\n"
    "and remember it.\", asks \"What is the pass key? The pass key is\", generates 8 tokens\n"
    "greedily and counts the trials whose output contains K. Prints accuracy per length.\n"
    "\n"
    "  -m, --model FILE     GGUF model\n"
    "  -f, --file FILE      filler text (default ../shared/data/wikitext2-test.txt)\n"
    "      --lengths LIST   prompt lengths in tokens, BOS included (default 512,1024,2048,4000)\n"
    "      --trials N       trials per length (default 20)\n"
    "      --seed S         seed for keys, filler offsets and needle positions (default 1)\n"
    "      --format F       newline (default): intro, needle and question on their own\n"
    "                       lines; space: parts joined by spaces only\n"
    "  -t, --threads N      threads (default: all cores)\n"
    "  -b, --batch-size N   tokens per forward pass (default 512; 2048 on a GPU)\n"
    "  -v, --verbose        print each trial's key, position and answer\n"
    "  -h, --help           this text\n";

#define MAX_LENGTHS 32

struct pk_opts {
    const char *model, *file;
    int lengths[MAX_LENGTHS], n_lengths, trials;
    uint64_t seed;
    bool newline, verbose;
    struct kvq_context_params cp;
};

static bool parse_lengths(const char *v, struct pk_opts *o) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", v);
    o->n_lengths = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (o->n_lengths == MAX_LENGTHS) {
            cli_fail("--lengths takes at most %d values", MAX_LENGTHS);
            return false;
        }
        if (!cli_parse_int("--lengths", tok, 64, 1 << 20, &o->lengths[o->n_lengths++])) return false;
    }
    if (o->n_lengths == 0) {
        cli_fail("--lengths needs at least one length");
        return false;
    }
    return true;
}

static bool parse_lengths_opt(const char *flag, const char *v, void *o) {
    (void)flag;
    return parse_lengths(v, o);
}

static bool parse_format(const char *flag, const char *v, void *newline) {
    (void)flag;
    if (!strcmp(v, "newline")) *(bool *)newline = true;
    else if (!strcmp(v, "space")) *(bool *)newline = false;
    else return cli_fail("invalid value '%s' for --format: expected space or newline", v), false;
    return true;
}

static int parse_args(int argc, char **argv, struct pk_opts *o) {
    kvq_context_params_default(&o->cp);
    o->trials = 20;
    o->seed = 1;
    o->newline = true;
    parse_lengths("512,1024,2048,4000", o);
    const struct cli_opt opts[] = {
        CLI_FLAG(&o->verbose, "-v", "--verbose"),
        CLI_STR(&o->model, "-m", "--model"),
        CLI_STR(&o->file, "-f", "--file"),
        CLI_FN(parse_lengths_opt, o, "--lengths"),
        CLI_INT(&o->trials, 1, 4096, "--trials"),
        CLI_U64(&o->seed, "--seed"),
        CLI_FN(parse_format, &o->newline, "--format"),
        CLI_INT(&o->cp.n_threads, 1, 1024, "-t", "--threads"),
        CLI_INT(&o->cp.n_batch, 1, 1 << 16, "-b", "--batch-size"),
        CLI_END,
    };
    if (cli_parse_args(argc, argv, "passkey", opts, &o->cp, NULL, passkey_help, cli_kv_flags_help)) return 1;
    if (!o->model) return cli_fail("passkey needs a model: -m FILE");
    if (!cli_kv_config_check(&o->cp.kv)) return 1;
    return 0;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static kvq_token argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

struct trial {
    int key, pos, n_prompt;
    kvq_token *prompt;
    kvq_token ans[8];
    int n_ans;
    bool done;
};

int cmd_passkey(int argc, char **argv) {
    struct pk_opts o = {0};
    if (parse_args(argc, argv, &o) != 0) return 1;
    char default_file[4096];
    if (!o.file) {
        const char *dir = getenv("KVQ_SHARED_DIR");
        snprintf(default_file, sizeof default_file, "%s/data/wikitext2-test.txt", dir && *dir ? dir : "../shared");
        o.file = default_file;
    }
    int rc = 1;
    char *text = NULL;
    kvq_token *filler = NULL, *intro = NULL, *question = NULL, *btok = NULL;
    int32_t *bseq = NULL;
    bool *blog = NULL;
    struct trial *tr = NULL;
    struct kvq_detok *dt = NULL;
    size_t len;
    struct kvq_model_info info;
    struct kvq_model *m = cli_load_model(o.model, &info);
    if (!m) goto done;
    if (!(text = cli_read_file(o.file, &len))) goto done;
    int n_filler, n_intro, n_question;
    const char *intro_s = o.newline ? "There is a pass key hidden in this text. Find it and remember it.\n"
                                    : "There is a pass key hidden in this text. Find it and remember it.";
    const char *question_s = o.newline ? "\nWhat is the pass key? The pass key is" : "What is the pass key? The pass key is";
    if (!(filler = cli_tokenize(m, text, len, false, false, &n_filler))) goto done;
    if (!(intro = cli_tokenize(m, intro_s, strlen(intro_s), true, false, &n_intro))) goto done;
    if (!(question = cli_tokenize(m, question_s, strlen(question_s), false, false, &n_question))) goto done;
    tr = calloc((size_t)o.trials, sizeof *tr);
    if (!tr) {
        cli_fail("out of memory");
        goto done;
    }
    fprintf(stderr, "kvq: passkey on %s (%s), KV %s, %d trials per length, filler %s (%d tokens)\n", o.model,
            info.weight_type, cli_kv_config_name(&o.cp.kv), o.trials, o.file, n_filler);
    printf("| length | trials | correct | accuracy |\n|---:|---:|---:|---:|\n");
    fflush(stdout);
    bool tty = isatty(STDERR_FILENO);
    for (int li = 0; li < o.n_lengths; li++) {
        int L = o.lengths[li];
        double t0 = cli_now();
        /* Build every trial's prompt. */
        for (int t = 0; t < o.trials; t++) {
            struct trial *x = &tr[t];
            uint64_t s = o.seed * 0x100000001b3ull ^ ((uint64_t)L << 20) ^ (uint64_t)t;
            splitmix(&s);
            x->key = 10000 + (int)(splitmix(&s) % 90000);
            char needle_s[160];
            snprintf(needle_s, sizeof needle_s, o.newline ? "\nThe pass key is %d. Remember it. %d is the pass key.\n"
                                                          : "The pass key is %d. Remember it. %d is the pass key.",
                     x->key, x->key);
            int n_needle;
            kvq_token *needle = cli_tokenize(m, needle_s, strlen(needle_s), false, false, &n_needle);
            if (!needle) goto done;
            int nf = L - n_intro - n_needle - n_question;
            if (nf < 0 || nf > n_filler) {
                free(needle);
                cli_fail("length %d does not fit: the fixed parts take %d tokens and the filler text has %d", L,
                         L - nf, n_filler);
                goto done;
            }
            int off = (int)(splitmix(&s) % (uint64_t)(n_filler - nf + 1));
            x->pos = (int)(splitmix(&s) % (uint64_t)(nf + 1));
            free(x->prompt);
            x->prompt = malloc(sizeof(kvq_token) * (size_t)L);
            if (!x->prompt) {
                free(needle);
                cli_fail("out of memory");
                goto done;
            }
            kvq_token *p = x->prompt;
            memcpy(p, intro, sizeof *p * (size_t)n_intro), p += n_intro;
            memcpy(p, filler + off, sizeof *p * (size_t)x->pos), p += x->pos;
            memcpy(p, needle, sizeof *p * (size_t)n_needle), p += n_needle;
            memcpy(p, filler + off + x->pos, sizeof *p * (size_t)(nf - x->pos)), p += nf - x->pos;
            memcpy(p, question, sizeof *p * (size_t)n_question);
            x->n_prompt = L;
            x->n_ans = 0;
            x->done = false;
            free(needle);
        }
        /* One context holds all trials as sequences; prompts go in one batch. */
        struct kvq_context_params cp = o.cp;
        cp.n_ctx = L + 8;
        cp.n_seq = o.trials;
        struct kvq_context *ctx = kvq_context_new(m, &cp);
        if (!ctx) {
            cli_fail("%s", kvq_last_error());
            goto done;
        }
        size_t nb = (size_t)L * o.trials;
        free(btok), free(bseq), free(blog);
        btok = malloc(sizeof *btok * nb);
        bseq = malloc(sizeof *bseq * nb);
        blog = malloc(sizeof *blog * nb);
        if (!btok || !bseq || !blog) {
            kvq_context_free(ctx);
            cli_fail("out of memory");
            goto done;
        }
        for (int t = 0; t < o.trials; t++)
            for (int j = 0; j < L; j++) {
                size_t k = (size_t)t * L + j;
                btok[k] = tr[t].prompt[j];
                bseq[k] = t;
                blog[k] = j == L - 1;
            }
        struct kvq_batch b = {.n_tokens = (int)nb, .tokens = btok, .seq_ids = bseq, .logits = blog};
        int ok = kvq_decode(ctx, &b);
        kvq_token next[4096];
        for (int t = 0; t < o.trials && ok == 0; t++) next[t] = argmax(kvq_get_logits(ctx, t * L + L - 1), info.n_vocab);
        for (int step = 0; step < 8 && ok == 0; step++) {
            for (int t = 0; t < o.trials; t++) {
                struct trial *x = &tr[t];
                if (x->done) continue;
                if (kvq_token_is_eog(m, next[t])) x->done = true;
                else x->ans[x->n_ans++] = next[t];
            }
            if (step == 7) break;
            for (int t = 0; t < o.trials; t++) {
                btok[t] = next[t];
                bseq[t] = t;
                blog[t] = true;
            }
            struct kvq_batch d = {.n_tokens = o.trials, .tokens = btok, .seq_ids = bseq, .logits = blog};
            ok = kvq_decode(ctx, &d);
            for (int t = 0; t < o.trials && ok == 0; t++) next[t] = argmax(kvq_get_logits(ctx, t), info.n_vocab);
        }
        kvq_context_free(ctx);
        if (ok != 0) {
            cli_fail("evaluation failed: %s", kvq_last_error());
            goto done;
        }
        int correct = 0;
        for (int t = 0; t < o.trials; t++) {
            struct trial *x = &tr[t];
            char out[256];
            int n = 0;
            dt = kvq_detok_new(m);
            if (!dt) {
                cli_fail("%s", kvq_last_error());
                goto done;
            }
            for (int k = 0; k < x->n_ans; k++) {
                int w = kvq_detok_feed(dt, x->ans[k], out + n, (int)sizeof out - n - 1);
                if (w > 0 && n + w < (int)sizeof out - 1) n += w;
            }
            int w = kvq_detok_flush(dt, out + n, (int)sizeof out - n - 1);
            if (w > 0 && n + w < (int)sizeof out - 1) n += w;
            out[n] = 0;
            kvq_detok_free(dt);
            dt = NULL;
            char key[16];
            snprintf(key, sizeof key, "%d", x->key);
            bool hit = strstr(out, key) != NULL;
            correct += hit;
            if (o.verbose) {
                for (char *c = out; *c; c++)
                    if (*c == '\n') *c = ' ';
                fprintf(stderr, "kvq: L %d trial %2d: key %d at filler token %d: %s \"%s\"\n", L, t, x->key, x->pos,
                        hit ? "ok  " : "MISS", out);
            }
        }
        printf("| %d | %d | %d | %.1f%% |\n", L, o.trials, correct, 100.0 * correct / o.trials);
        fflush(stdout);
        if (tty || o.verbose)
            fprintf(stderr, "kvq: length %d: %d/%d in %.1f s\n", L, correct, o.trials, cli_now() - t0);
    }
    rc = 0;
done:
    if (tr)
        for (int t = 0; t < o.trials; t++) free(tr[t].prompt);
    free(tr);
    kvq_detok_free(dt);
    free(btok), free(bseq), free(blog);
    free(filler), free(intro), free(question);
    free(text);
    kvq_model_free(m);
    return rc;
}
