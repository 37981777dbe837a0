#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"

int cli_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("kvq: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

struct kvq_model *cli_load_model(const char *path, struct kvq_model_info *info) {
    struct kvq_model *m = kvq_model_load(path);
    if (!m) cli_fail("%s", kvq_last_error());
    else if (info) kvq_model_get_info(m, info);
    return m;
}

bool cli_parse_int(const char *flag, const char *value, long min, long max, int *out) {
    char *end;
    errno = 0;
    long v = strtol(value, &end, 10);
    if (errno || end == value || *end || v < min || v > max) {
        cli_fail("invalid value '%s' for %s: expected an integer from %ld to %ld", value, flag, min, max);
        return false;
    }
    *out = (int)v;
    return true;
}

bool cli_parse_u64(const char *flag, const char *value, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(value, &end, 10);
    if (errno || end == value || *end || !isdigit((unsigned char)value[0])) { /* strtoull takes " -1" */
        cli_fail("invalid value '%s' for %s: expected a non-negative integer", value, flag);
        return false;
    }
    *out = v;
    return true;
}

bool cli_parse_float(const char *flag, const char *value, double min, double max, float *out) {
    char *end;
    errno = 0;
    double v = strtod(value, &end);
    if (errno || end == value || *end || !(v >= min && v <= max)) {
        cli_fail("invalid value '%s' for %s: expected a number from %g to %g", value, flag, min, max);
        return false;
    }
    *out = (float)v;
    return true;
}

bool cli_is_one_of(const char *s, const char *const *list) {
    for (; *list; list++)
        if (strcmp(s, *list) == 0) return true;
    return false;
}

const char *cli_flag_value(int argc, char **argv, int *i) {
    if (*i + 1 >= argc) {
        cli_fail("option %s needs a value", argv[*i]);
        return NULL;
    }
    return argv[++*i];
}

const char *cli_option_value(int argc, char **argv, int *i, const char *const *known, const char *cmd) {
    if (!cli_is_one_of(argv[*i], known)) {
        cli_fail("unknown option '%s' for %s (see 'kvq %s --help')", argv[*i], cmd, cmd);
        return NULL;
    }
    return cli_flag_value(argc, argv, i);
}

static bool valid_bits(int b) { return b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8 || b == 16 || b == 32; }

/* Parses "A" or "A,B" into two ints (B = A when absent). */
static bool parse_pair(const char *flag, const char *value, long min, long max, int *a, int *b) {
    char buf[64];
    snprintf(buf, sizeof buf, "%s", value);
    char *comma = strchr(buf, ',');
    if (comma) *comma = '\0';
    if (!cli_parse_int(flag, buf, min, max, a)) return false;
    if (!comma) {
        *b = *a;
        return true;
    }
    return cli_parse_int(flag, comma + 1, min, max, b);
}

const char *const cli_kv_flags_help =
    "KV cache:\n"
    "  --kv-bits B | K,V[:nf|:uniform]\n"
    "                           bits per key/value: 16 or 32 (float) or 2,3,4,5,6,8 (quantized);\n"
    "                           default 16. 3 (also 3,3 and 4,3) is 4,3:nf and 2 (also 2,2 and\n"
    "                           3,2) is 3,2:nf, the best 3- and 2-bit caches measured. :nf:\n"
    "                           normal-float rows of those bits (2-5; one scale a row); :uniform\n"
    "                           (the default for other bits): uniform groups, bits as written\n"
    "  --kv-layer-bits L=B | L=K,V\n"
    "                           quantized caches: layers L (e.g. 3 or 2-3,5) take other bits of\n"
    "                           --kv-bits' row kind (mixed precision; repeatable; `kvq calibrate-kv`\n"
    "                           says which layers gain most)\n"
    "  --kv-group-size G | K,V  values per quantization group of uniform rows: 8,16,32,64,128\n"
    "                           (default 64; normal-float rows have one scale a row)\n"
    "  --kv-rotation MODE       hadamard (default) | none: rotate head vectors before quantizing\n"
    "  --quantized-kv-start N   keep the first N tokens in 16 bits, then quantize\n"
    "  --max-kv-size N          rotating cache of N tokens (0: unbounded)\n"
    "  --keep N                 tokens kept at the start of a rotating cache (default 4); with\n"
    "                           --kv-residual > 0 they are also held in f16 (attention sinks)\n"
    "  --kv-residual N          quantized caches: the newest N tokens are also held in f16 and\n"
    "                           attention reads them from there (default 32; 0: off)\n"
    "  --kv-budget-mb N         KV blocks in use at once, all sequences (default: what the context\n"
    "                           needs); a batch that would exceed it fails with an error\n"
    "  --swa-full               sliding-window layers (Gemma 3) keep every token, as global layers\n"
    "                           do (same output, more memory: to compare)\n"
    "Device:\n"
    "  --device cpu|cuda        where the model runs (default cpu; cuda needs a kvq built with\n"
    "                           -DKVQ_CUDA=ON); -ngl N (N > 0) means cuda, as in llama.cpp\n"
    "  --gpu-f16-weights auto|off  cuda: products of more than 16 tokens (prefill, wide\n"
    "                           batches) read f16 copies of quantized weights, made while the\n"
    "                           GPU has room (auto, the default; 2 bytes a weight); off: none\n"
    "  --tp N                   cuda: tensor parallelism over N GPUs of this host (2-8, dividing\n"
    "                           the model's KV heads); also --tensor-parallel-size, -tp\n"
    "  --devices LIST           the GPUs --tp runs on, e.g. 2,3 (default 0..N-1)\n";

bool cli_is_device_flag(const char *flag) {
    return !strcmp(flag, "--device") || !strcmp(flag, "-ngl") || !strcmp(flag, "--n-gpu-layers") ||
           !strcmp(flag, "--gpu-layers");
}

bool cli_parse_device(const char *flag, const char *v, enum kvq_device *out) {
    if (strcmp(flag, "--device") != 0) { /* llama.cpp's -ngl: any layer on the GPU puts the model there */
        int n;
        if (!cli_parse_int(flag, v, 0, INT_MAX, &n)) return false;
        *out = n > 0 ? KVQ_DEVICE_CUDA : KVQ_DEVICE_CPU;
        return true;
    }
    if (strcmp(v, "cpu") == 0) *out = KVQ_DEVICE_CPU;
    else if (strcmp(v, "cuda") == 0) *out = KVQ_DEVICE_CUDA;
    else {
        cli_fail("invalid value '%s' for --device: expected cpu or cuda", v);
        return false;
    }
    return true;
}

bool cli_is_tp_flag(const char *flag) {
    return !strcmp(flag, "--tp") || !strcmp(flag, "--tensor-parallel-size") || !strcmp(flag, "-tp") ||
           !strcmp(flag, "--devices");
}

bool cli_parse_tp(const char *flag, const char *v, struct kvq_context_params *cp) {
    if (strcmp(flag, "--devices") != 0) return cli_parse_int(flag, v, 1, KVQ_MAX_GPUS, &cp->tp);
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    cp->n_gpus = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (cp->n_gpus == KVQ_MAX_GPUS) return cli_fail("--devices names at most %d GPUs", KVQ_MAX_GPUS), false;
        if (!cli_parse_int(flag, tok, 0, 255, &cp->gpus[cp->n_gpus++])) return false;
    }
    if (cp->n_gpus == 0) return cli_fail("--devices needs GPU numbers, e.g. 0,1"), false;
    return true;
}

bool cli_parse_f16_weights(const char *flag, const char *v, bool *off) {
    if (strcmp(v, "auto") != 0 && strcmp(v, "off") != 0) {
        cli_fail("invalid value '%s' for %s: expected auto or off", v, flag);
        return false;
    }
    *off = strcmp(v, "off") == 0;
    return true;
}

/* The row kinds of --kv-bits' sides: uniform groups, or normal-float rows when asked
 * (:nf). With no row kind, 3 and 2 bits name the best 3- and 2-bit caches measured,
 * normal-float K4 V3 and K3 V2: less loss than uniform groups of 3 and 2 bits at about
 * their bytes, and faster on the CPU and the GPU (docs/kv-formats.md); ":uniform"
 * keeps the bits as written. */
static bool set_kv_rows(const char *v, const char *kind, struct kvq_kv_config *kv) {
    int *bits[2] = {&kv->k_bits, &kv->v_bits}, *group[2] = {&kv->k_group, &kv->v_group};
    bool nf = kind && !strcmp(kind, "nf");
    if (!kind && kv->v_bits == 3 && (kv->k_bits == 3 || kv->k_bits == 4)) kv->k_bits = 4, nf = true;
    if (!kind && kv->v_bits == 2 && (kv->k_bits == 2 || kv->k_bits == 3)) kv->k_bits = 3, nf = true;
    for (int s = 0; s < 2; s++) {
        if (*bits[s] >= 16) continue;
        if (nf && *bits[s] > 5) {
            cli_fail("invalid value '%s' for --kv-bits: normal-float rows have 2 to 5 bits", v);
            return false;
        }
        if (nf) *group[s] = KVQ_KV_NF;
        else if (*group[s] == KVQ_KV_NF) *group[s] = 64;
    }
    return true;
}

bool cli_parse_quantized_bits(const char *flag, const char *v, int *k_bits, int *v_bits) {
    if (!parse_pair(flag, v, 2, 8, k_bits, v_bits)) return false;
    if (!valid_bits(*k_bits) || !valid_bits(*v_bits))
        return cli_fail("invalid value '%s' for %s: bits must be 2, 3, 4, 5, 6 or 8", v, flag), false;
    return true;
}

/* "LAYERS=B" or "LAYERS=K,V", LAYERS a comma list of layers N and ranges N-M: a range
 * of kv->layer_bits each; several such groups separated by spaces. */
static bool parse_layer_bits(const char *flag, const char *v, struct kvq_kv_config *kv) {
    const char *sp = strchr(v, ' ');
    if (sp) {
        char group[256];
        snprintf(group, sizeof group, "%.*s", (int)(sp - v), v);
        if (sp - v >= (ptrdiff_t)sizeof group) return cli_fail("invalid value for %s: a group is too long", flag), false;
        if (sp > v && !parse_layer_bits(flag, group, kv)) return false;
        return parse_layer_bits(flag, sp + 1, kv);
    }
    if (!*v) return true;
    const char *eq = strchr(v, '=');
    int kb, vb;
    if (!eq || eq == v) return cli_fail("invalid value '%s' for %s: expected LAYERS=BITS, e.g. 2-3,5=5,4", v, flag), false;
    if (!cli_parse_quantized_bits(flag, eq + 1, &kb, &vb)) return false;
    for (const char *p = v; p < eq;) {
        char item[32];
        const size_t len = strcspn(p, ",=");
        int first, last;
        char *dash;
        snprintf(item, sizeof item, "%.*s", (int)(len < sizeof item ? len : sizeof item - 1), p);
        if ((dash = strchr(item, '-')) != NULL) *dash = '\0';
        if (!cli_parse_int(flag, item, 0, 65535, &first) || !cli_parse_int(flag, dash ? dash + 1 : item, 0, 65535, &last))
            return false;
        if (first > last) return cli_fail("invalid value '%s' for %s: layers %d-%d run backwards", v, flag, first, last), false;
        if (kv->n_layer_bits == KVQ_MAX_LAYER_BITS)
            return cli_fail("%s: at most %d layer ranges", flag, KVQ_MAX_LAYER_BITS), false;
        kv->layer_bits[kv->n_layer_bits++] = (struct kvq_layer_bits){first, last, kb, vb};
        p += len + (p[len] == ',');
    }
    return true;
}

int cli_parse_kv_flag(int argc, char **argv, int *i, struct kvq_context_params *cp) {
    struct kvq_kv_config *kv = &cp->kv;
    const char *flag = argv[*i];
    const char *v;
    if (strcmp(flag, "--kv-budget-mb") == 0) {
        int mb;
        if (!(v = cli_flag_value(argc, argv, i)) || !cli_parse_int(flag, v, 0, 1 << 24, &mb)) return -1;
        cp->kv_budget_bytes = (size_t)mb << 20;
        return 1;
    }
    if (cli_is_device_flag(flag))
        return (v = cli_flag_value(argc, argv, i)) && cli_parse_device(flag, v, &cp->device) ? 1 : -1;
    if (strcmp(flag, "--gpu-f16-weights") == 0)
        return (v = cli_flag_value(argc, argv, i)) && cli_parse_f16_weights(flag, v, &cp->gpu_f16_weights_off) ? 1 : -1;
    if (cli_is_tp_flag(flag)) return (v = cli_flag_value(argc, argv, i)) && cli_parse_tp(flag, v, cp) ? 1 : -1;
    if (strcmp(flag, "--kv-bits") == 0) {
        if (!(v = cli_flag_value(argc, argv, i))) return -1;
        char buf[64];
        snprintf(buf, sizeof buf, "%s", v);
        char *kind = strchr(buf, ':');
        if (kind) *kind++ = '\0';
        if (kind && strcmp(kind, "nf") != 0 && strcmp(kind, "uniform") != 0) {
            cli_fail("invalid value '%s' for --kv-bits: the row kind after ':' must be nf or uniform", v);
            return -1;
        }
        if (!parse_pair(flag, buf, 2, 32, &kv->k_bits, &kv->v_bits)) return -1;
        if (!valid_bits(kv->k_bits) || !valid_bits(kv->v_bits)) {
            cli_fail("invalid value '%s' for --kv-bits: bits must be 2, 3, 4, 5, 6, 8, 16 or 32", v);
            return -1;
        }
        return set_kv_rows(v, kind, kv) ? 1 : -1;
    }
    if (strcmp(flag, "--kv-layer-bits") == 0)
        return (v = cli_flag_value(argc, argv, i)) && parse_layer_bits(flag, v, kv) ? 1 : -1;
    if (strcmp(flag, "--kv-group-size") == 0) {
        int kg, vg;
        if (!(v = cli_flag_value(argc, argv, i)) || !parse_pair(flag, v, 1, 1024, &kg, &vg)) return -1;
        if (kv->k_group != KVQ_KV_NF) kv->k_group = kg; /* normal-float rows have no groups */
        if (kv->v_group != KVQ_KV_NF) kv->v_group = vg;
        return 1;
    }
    if (strcmp(flag, "--kv-rotation") == 0) {
        if (!(v = cli_flag_value(argc, argv, i))) return -1;
        if (strcmp(v, "hadamard") == 0) kv->hadamard = true;
        else if (strcmp(v, "none") == 0) kv->hadamard = false;
        else {
            cli_fail("invalid value '%s' for --kv-rotation: expected none or hadamard", v);
            return -1;
        }
        return 1;
    }
    if (strcmp(flag, "--quantized-kv-start") == 0)
        return (v = cli_flag_value(argc, argv, i)) && cli_parse_int(flag, v, 0, INT_MAX, &kv->quantized_start) ? 1 : -1;
    if (strcmp(flag, "--max-kv-size") == 0)
        return (v = cli_flag_value(argc, argv, i)) && cli_parse_int(flag, v, 0, 1 << 30, &kv->max_size) ? 1 : -1;
    if (strcmp(flag, "--kv-residual") == 0)
        return (v = cli_flag_value(argc, argv, i)) && cli_parse_int(flag, v, 0, 1 << 20, &kv->residual) ? 1 : -1;
    if (strcmp(flag, "--swa-full") == 0) {
        kv->swa_full = true;
        return 1;
    }
    if (strcmp(flag, "--keep") == 0)
        return (v = cli_flag_value(argc, argv, i)) && cli_parse_int(flag, v, 0, INT_MAX, &kv->keep) ? 1 : -1;
    return 0;
}

/* Runs one KV flag through the flag parser (same rules and messages). */
static bool kv_flag(const char *flag, const char *value, struct kvq_kv_config *kv) {
    char *args[] = {(char *)"kvq", (char *)flag, (char *)value};
    int i = 1;
    struct kvq_context_params cp = {.kv = *kv};
    if (cli_parse_kv_flag(3, args, &i, &cp) != 1) return false;
    *kv = cp.kv;
    return true;
}

const char *const cli_kv_spec_help =
    "KV config SPEC: f16 | f32 | BITS | KBITS,VBITS (bits as for --kv-bits), then optional\n"
    "  suffixes :nf or :uniform (row kind, as for --kv-bits), :gG or :gGK,GV (group size), :rot or :norot (Hadamard rotation), :rN\n"
    "  (residual f16 window of N tokens), :qsN (quantized-kv-start), :swafull (--swa-full), :lL=K,V\n"
    "  (--kv-layer-bits L=K,V); unset parts take the --kv-* defaults. e.g. 8,4   4:g32   4,2:r0:norot\n"
    "  4,4:nf:l2-3,5=5,4\n";

bool cli_parse_kv_spec(const char *spec, struct kvq_kv_config *kv) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", spec);
    kvq_kv_config_default(kv);
    char *save = NULL, *part = strtok_r(buf, ":", &save);
    if (!part) return cli_fail("empty KV config"), false;
    const char *bits = !strcmp(part, "f16") ? "16" : !strcmp(part, "f32") ? "32" : part;
    if (!kv_flag("--kv-bits", bits, kv)) return false;
    while ((part = strtok_r(NULL, ":", &save))) {
        bool ok;
        char kb[64];
        if (!strcmp(part, "nf") || !strcmp(part, "uniform")) {
            snprintf(kb, sizeof kb, "%s:%s", bits, part);
            ok = kv_flag("--kv-bits", kb, kv);
        } else if (part[0] == 'g') ok = kv_flag("--kv-group-size", part + 1, kv);
        else if (!strcmp(part, "rot")) ok = kv_flag("--kv-rotation", "hadamard", kv);
        else if (!strcmp(part, "norot")) ok = kv_flag("--kv-rotation", "none", kv);
        else if (!strncmp(part, "qs", 2)) ok = kv_flag("--quantized-kv-start", part + 2, kv);
        else if (!strcmp(part, "swafull")) ok = kv_flag("--swa-full", NULL, kv);
        else if (part[0] == 'r') ok = kv_flag("--kv-residual", part + 1, kv);
        else if (part[0] == 'l') ok = kv_flag("--kv-layer-bits", part + 1, kv);
        else {
            cli_fail("invalid suffix ':%s' in KV config '%s' (expected :nf, :uniform, :gG, :rot, :norot, :rN, :qsN, "
                     ":swafull or :lL=K,V)", part, spec);
            return false;
        }
        if (!ok) return false;
    }
    return cli_kv_config_check(kv);
}

bool cli_kv_config_check(const struct kvq_kv_config *kv) {
    if (kv->max_size > 0 && kv->keep >= kv->max_size) {
        cli_fail("--keep (%d) must be smaller than --max-kv-size (%d)", kv->keep, kv->max_size);
        return false;
    }
    for (int i = 0; kv->k_group == KVQ_KV_NF && i < kv->n_layer_bits; i++) {
        const struct kvq_layer_bits *l = &kv->layer_bits[i];
        if (l->k_bits > 5 || l->v_bits > 5) { /* --kv-bits 3 and 2 name normal-float rows too */
            cli_fail("--kv-layer-bits %d-%d=%d,%d: the layers take --kv-bits' normal-float rows, of 2 to 5 bits "
                     "(for uniform rows write --kv-bits K,V:uniform)", l->first, l->last, l->k_bits, l->v_bits);
            return false;
        }
    }
    return true;
}

void cli_kv_bits(const struct kvq_model *m, const struct kvq_kv_config *kv, int n, double *rows, double *all) {
    struct kvq_kv_config f16 = *kv;
    f16.k_bits = f16.v_bits = 16;
    f16.n_layer_bits = 0;
    struct kvq_model_info info;
    kvq_model_get_info(m, &info);
    const double values = (double)kvq_kv_token_bytes(m, &f16) / 2 * n; /* keys and values of n tokens */
    const bool quant = kv->k_bits < 16 || kv->v_bits < 16;
    double bytes = (double)kvq_kv_token_bytes(m, kv) * n;
    *rows = values > 0 ? 8 * bytes / values : 0;
    if (quant && kv->residual > 0) /* the offsets, [2][n_kv_heads][head_dim] f32 a layer */
        bytes += (double)info.n_layer * 2 * info.n_head_kv * info.head_dim * 4 + (double)kvq_kv_window_bytes(m, kv);
    *all = values > 0 ? 8 * bytes / values : 0;
}

const char *cli_kv_config_name(const struct kvq_kv_config *kv) {
    static char buf[320];
    int n;
    if (kv->k_bits >= 16 && kv->v_bits >= 16)
        n = snprintf(buf, sizeof buf, "%s", kv->k_bits == 32 ? "f32" : "f16");
    else if (kv->k_group == KVQ_KV_NF || kv->v_group == KVQ_KV_NF) {
        char side[2][16];
        for (int s = 0; s < 2; s++) {
            int b = s ? kv->v_bits : kv->k_bits, g = s ? kv->v_group : kv->k_group;
            if (b >= 16) snprintf(side[s], sizeof side[s], "f%d", b);
            else if (g == KVQ_KV_NF) snprintf(side[s], sizeof side[s], "%dnf", b);
            else snprintf(side[s], sizeof side[s], "%dg%d", b, g);
        }
        n = snprintf(buf, sizeof buf, "K%s/V%s", side[0], side[1]);
    } else if (kv->k_bits == kv->v_bits && kv->k_group == kv->v_group)
        n = snprintf(buf, sizeof buf, "q%d g%d", kv->k_bits, kv->k_group);
    else
        n = snprintf(buf, sizeof buf, "K%d/V%d g%d/%d", kv->k_bits, kv->v_bits, kv->k_group, kv->v_group);
    if (kv->hadamard && (kv->k_bits < 16 || kv->v_bits < 16)) n += snprintf(buf + n, sizeof buf - (size_t)n, " rot");
    if (kv->residual > 0 && (kv->k_bits < 16 || kv->v_bits < 16))
        n += snprintf(buf + n, sizeof buf - (size_t)n, " residual%d", kv->residual);
    if (kv->n_layer_bits > 0 && (kv->k_bits < 16 || kv->v_bits < 16)) {
        char layers[160];
        if (kvq_kv_layer_bits_name(kv, layers, sizeof layers) < 0) snprintf(layers, sizeof layers, "...");
        n += snprintf(buf + n, sizeof buf - (size_t)n, " layers %s", layers);
    }
    if (kv->max_size) n += snprintf(buf + n, sizeof buf - (size_t)n, " win%d", kv->max_size);
    if (kv->swa_full) snprintf(buf + n, sizeof buf - (size_t)n, " swa-full");
    return buf;
}

char *cli_read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        cli_fail("cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    /* a stream (a pipe, /dev/zero) is read until the limit is passed: no size to ask */
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    const char *why = buf ? NULL : "out of memory";
    while (!why) {
        n += fread(buf + n, 1, cap - n - 1, f);
        if (n < cap - 1) break;
        if (n > CLI_MAX_TEXT_BYTES) {
            why = "larger than the limit for text inputs (256 MiB)";
            break;
        }
        cap = cap * 2 < (size_t)CLI_MAX_TEXT_BYTES + 2 ? cap * 2 : (size_t)CLI_MAX_TEXT_BYTES + 2;
        char *nb = realloc(buf, cap);
        if (!nb) why = "out of memory";
        else buf = nb;
    }
    if (!why && ferror(f)) why = strerror(errno);
    fclose(f);
    if (why) {
        free(buf);
        cli_fail("cannot read '%s': %s", path, why);
        return NULL;
    }
    buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

kvq_token *cli_tokenize(const struct kvq_model *m, const char *text, size_t len, bool add_special, bool parse_special,
                        int *n_out) {
    int cap = (int)(len < INT_MAX / 2 ? len : INT_MAX / 2) + 8;
    for (int attempt = 0; attempt < 2; attempt++) {
        kvq_token *toks = malloc(sizeof *toks * (size_t)cap);
        if (!toks) {
            cli_fail("out of memory for %d tokens", cap);
            return NULL;
        }
        int n = kvq_tokenize(m, text, len, add_special, parse_special, toks, cap);
        if (n < 0) {
            free(toks);
            cli_fail("cannot tokenize: %s", kvq_last_error());
            return NULL;
        }
        if (n <= cap) {
            *n_out = n;
            return toks;
        }
        free(toks);
        cap = n;
    }
    cli_fail("cannot tokenize: the token count changed between attempts");
    return NULL;
}

bool cli_model_adds_bos(const struct kvq_model *m) {
    kvq_token t[4];
    int n = kvq_tokenize(m, "a", 1, true, false, t, 4);
    return n > 0 && n <= 4 && kvq_token_bos(m) >= 0 && t[0] == kvq_token_bos(m);
}

void cli_print_kv_layer_kinds(const struct kvq_context *ctx) {
    struct kvq_kv_layer_kind k[8];
    int n = kvq_kv_layer_kinds(ctx, k, 8);
    if (n > 8) n = 8;
    for (int i = 0; i < n && n > 1; i++) {
        char what[64] = "global", holds[48] = "every token";
        if (k[i].window > 0) snprintf(what, sizeof what, "sliding (window %d)", k[i].window);
        if (k[i].max_size > 0) snprintf(holds, sizeof holds, "at most %d tokens", k[i].max_size);
        fprintf(stderr, "kvq:   %d %s layer%s, %s cache of %s: %zu bytes (%.2f MiB)\n", k[i].n_layers, what,
                k[i].n_layers == 1 ? "" : "s", k[i].kind, holds, k[i].bytes, k[i].bytes / 1048576.0);
    }
}

void cli_exit_help(const char *help, const char *more) {
    errno = 0;
    bool ok = fputs(help, stdout) != EOF && fputs(more, stdout) != EOF && fflush(stdout) == 0;
    if (!ok) cli_fail("cannot write the output: %s", errno ? strerror(errno) : "write error");
    exit(ok ? 0 : 1);
}
