/* kvq tokenize: prints the token ids of a text as [1, 2, 3]. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"

static const char *const tokenize_help =
    "usage: kvq tokenize -m MODEL (-p TEXT | -f FILE) [--no-bos] [--no-parse-special]\n"
    "\n"
    "Prints the token ids of the text, e.g. [1, 450, 4996].\n"
    "  --no-bos             do not add the BOS token the model's metadata asks for\n"
    "  --no-parse-special   treat special-token text like \"<s>\" as plain text\n";

static const char *const tokenize_value_flags[] = {"-m", "--model", "-p", "--prompt", "-f", "--file", NULL};

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL, *file = NULL;
    bool bos = true, parse_special = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(tokenize_help, stdout);
            return 0;
        }
        if (!strcmp(a, "--no-bos")) { bos = false; continue; }
        if (!strcmp(a, "--no-parse-special")) { parse_special = false; continue; }
        if (!(v = cli_option_value(argc, argv, &i, tokenize_value_flags, "tokenize"))) return 1;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) text = v;
        else file = v;
    }
    if (!model) return cli_fail("tokenize needs a model: -m FILE");
    if (!text && !file) return cli_fail("tokenize needs a text: -p TEXT or -f FILE");
    size_t len;
    char *buf = file ? cli_read_file(file, &len) : strdup(text);
    if (!buf) return 1;
    if (!file) len = strlen(buf);
    /* the tokenizer is all it needs: vocabulary-only files work too */
    struct kvq_model *m = kvq_model_load_vocab(model);
    if (!m) {
        free(buf);
        return cli_fail("%s", kvq_last_error());
    }
    int n, rc = 1;
    kvq_token *ids = cli_tokenize(m, buf, len, bos, parse_special, &n);
    if (ids) {
        rc = 0;
        putchar('[');
        for (int i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
        puts("]");
    }
    free(ids);
    free(buf);
    kvq_model_free(m);
    return rc;
}
