/* The table-driven parser of a command's options (cli.h, cli_parse_args). */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static const struct cli_opt *find_opt(const struct cli_opt *opts, const char *a) {
    for (; opts->names[0]; opts++)
        for (int j = 0; j < 4 && opts->names[j]; j++)
            if (strcmp(opts->names[j], a) == 0) return opts;
    return NULL;
}

static bool parse_value(const struct cli_opt *o, const char *a, const char *v) {
    switch (o->type) {
    case CLI_OPT_STR: *(const char **)o->out = v; return true;
    case CLI_OPT_INT: return cli_parse_int(a, v, (long)o->min, (long)o->max, o->out);
    case CLI_OPT_U64: return cli_parse_u64(a, v, o->out);
    case CLI_OPT_FLOAT: return cli_parse_float(a, v, o->min, o->max, o->out);
    case CLI_OPT_FN: return o->fn(a, v, o->out);
    case CLI_OPT_FLAG: break;
    }
    return false;
}

int cli_parse_args(int argc, char **argv, const char *cmd, const struct cli_opt *opts, struct kvq_context_params *cp,
                   bool *kv_given, const char *help, const char *more) {
    if (cp) cp->n_batch = 0; /* unset: the device's, below */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (cp) {
            int kv = cli_parse_kv_flag(argc, argv, &i, cp);
            if (kv < 0) return 1;
            if (kv > 0) {
                if (kv_given) *kv_given = true;
                continue;
            }
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) cli_exit_help(help, more);
        const struct cli_opt *o = find_opt(opts, a);
        if (!o) return cli_fail("unknown option '%s' for %s (see 'kvq %s --help')", a, cmd, cmd);
        if (o->given) *o->given = true;
        if (o->type == CLI_OPT_FLAG) {
            *(bool *)o->out = true;
            continue;
        }
        if (!(v = cli_flag_value(argc, argv, &i)) || !parse_value(o, a, v)) return 1;
    }
    /* A GPU's passes take 2048 tokens unless -b says otherwise: its products run nearer
     * the tensor cores' peak than in passes of 512 (long prompts prefill 10-15% faster);
     * the rows of logits a pass keeps stay 512 (a pass asking for more takes more). */
    if (cp && cp->n_batch == 0) {
        const bool gpu = cp->device == KVQ_DEVICE_CUDA;
        cp->n_batch = gpu ? 2048 : 512;
        if (gpu && cp->max_logit_rows == 0) cp->max_logit_rows = 512;
    }
    return 0;
}
