/* Shared pieces of the kvq command line: the subcommand table, flag parsing
 * with clear errors, and the KV-cache flags every command accepts. */
#ifndef KVQ_CLI_H
#define KVQ_CLI_H

#include <stdbool.h>
#include <stdint.h>

#include "kvq.h"

/* A subcommand: argv[0] is the subcommand's name. Returns the exit code. */
struct cli_command {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv);
};

int cmd_generate(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_cache_prompt(int argc, char **argv);
int cmd_bench_kv_cache(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_calibrate_kv(int argc, char **argv);
int cmd_passkey(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_gen_model(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_bench_serve(int argc, char **argv);

/* Prints "kvq: <message>" on stderr; returns 1 (the exit code for usage/input errors). */
int cli_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The model at path, its info in *info (unless NULL); NULL after printing why not. */
struct kvq_model *cli_load_model(const char *path, struct kvq_model_info *info);

/* Flag value parsers: print a clear error and return false on bad input. */
bool cli_parse_int(const char *flag, const char *value, long min, long max, int *out);
bool cli_parse_u64(const char *flag, const char *value, uint64_t *out);
bool cli_parse_float(const char *flag, const char *value, double min, double max, float *out);
/* True when s is in the NULL-terminated list (to tell unknown flags from known ones
 * before taking their value). */
bool cli_is_one_of(const char *s, const char *const *list);
/* The value after flag argv[*i] (advancing *i); NULL with an error if missing. */
const char *cli_flag_value(int argc, char **argv, int *i);
/* The same for a command's own options: an option not in `known` (NULL-terminated)
 * is reported as unknown for `cmd`, even as the last argument. */
const char *cli_option_value(int argc, char **argv, int *i, const char *const *known, const char *cmd);

/* One option of a command's table: its names and what its value becomes. */
enum cli_opt_type {
    CLI_OPT_FLAG,  /* no value: *(bool *)out = true */
    CLI_OPT_STR,   /* *(const char **)out = the value */
    CLI_OPT_INT,   /* *(int *)out, an integer from min to max */
    CLI_OPT_U64,   /* *(uint64_t *)out, a non-negative integer */
    CLI_OPT_FLOAT, /* *(float *)out, a number from min to max */
    CLI_OPT_FN,    /* fn(flag, value, out) parses it (false after printing an error) */
};
struct cli_opt {
    const char *names[4]; /* the first NULL ends them */
    enum cli_opt_type type;
    void *out;
    double min, max;
    bool (*fn)(const char *flag, const char *value, void *out);
    bool *given; /* set true when the option is given (may be NULL) */
};
/* Table entries: the value's destination (and range), then the option's names. */
#define CLI_FLAG(out_, ...) {.names = {__VA_ARGS__}, .type = CLI_OPT_FLAG, .out = (out_)}
#define CLI_STR(out_, ...) {.names = {__VA_ARGS__}, .type = CLI_OPT_STR, .out = (out_)}
#define CLI_INT(out_, lo, hi, ...) {.names = {__VA_ARGS__}, .type = CLI_OPT_INT, .out = (out_), .min = (lo), .max = (hi)}
#define CLI_U64(out_, ...) {.names = {__VA_ARGS__}, .type = CLI_OPT_U64, .out = (out_)}
#define CLI_FLOAT(out_, lo, hi, ...) {.names = {__VA_ARGS__}, .type = CLI_OPT_FLOAT, .out = (out_), .min = (lo), .max = (hi)}
#define CLI_FN(fn_, out_, ...) {.names = {__VA_ARGS__}, .type = CLI_OPT_FN, .out = (out_), .fn = (fn_)}
#define CLI_END {.names = {NULL}}
/* Parses argv[1..argc) for command cmd: the context flags into cp (cli_parse_kv_flag;
 * cp NULL: none, and *kv_given set when one was given, kv_given may be NULL),
 * -h/--help (prints help and more, exits 0), and the options of the table (ended by
 * an entry without names). Unknown options and missing or bad values get one error
 * line. 0, or 1 after the error. */
int cli_parse_args(int argc, char **argv, const char *cmd, const struct cli_opt *opts, struct kvq_context_params *cp,
                   bool *kv_given, const char *help, const char *more);

/* --device cpu|cuda, and llama.cpp's -ngl N (N > 0: cuda). */
bool cli_is_device_flag(const char *flag);
bool cli_parse_device(const char *flag, const char *value, enum kvq_device *out);
/* --gpu-f16-weights auto|off */
bool cli_parse_f16_weights(const char *flag, const char *value, bool *off);
/* --tp N (--tensor-parallel-size, -tp) and --devices LIST into cp. */
bool cli_is_tp_flag(const char *flag);
bool cli_parse_tp(const char *flag, const char *value, struct kvq_context_params *cp);
/* Context flags (--kv-bits, --kv-group-size, --max-kv-size, --keep,
 * --quantized-kv-start, --kv-rotation, --kv-residual, --kv-budget-mb, --device). Returns 1 when
 * argv[*i] was one of them (consumed, advancing *i), 0 when it was not, -1 on a bad value. */
int cli_parse_kv_flag(int argc, char **argv, int *i, struct kvq_context_params *cp);
/* Help text for those flags. */
extern const char *const cli_kv_flags_help;
/* "B" or "K,V", quantized bits (2, 3, 4, 5, 6, 8); false with an error printed. */
bool cli_parse_quantized_bits(const char *flag, const char *value, int *k_bits, int *v_bits);
/* A whole KV config in one word, for commands that compare several:
 *   f16 | f32 | BITS | KBITS,VBITS  then optional suffixes
 *   :gG or :gGK,GV (group size), :rot / :norot (Hadamard rotation), :rN (residual
 *   f16 window), :qsN (quantized-kv-start)       e.g. 8,4  4:g32  4,2:r0:norot
 * Unset fields keep kvq_kv_config_default's values. False with an error printed. */
bool cli_parse_kv_spec(const char *spec, struct kvq_kv_config *kv);
extern const char *const cli_kv_spec_help;

/* Checks flag combinations after parsing; false with an error printed. */
bool cli_kv_config_check(const struct kvq_kv_config *kv);
/* "f16", "K8/V4 g64" ... for reports. */
const char *cli_kv_config_name(const struct kvq_kv_config *kv);
/* Effective bits a key or value of kv at n tokens of model m: the packed rows (codes,
 * scales) alone, and all bytes (with the key/value offsets and the f16 windows). */
void cli_kv_bits(const struct kvq_model *m, const struct kvq_kv_config *kv, int n, double *rows, double *all);

/* Prints to stderr the KV bytes of each layer kind when the model's layers differ
 * (hybrid sliding-window models); nothing for uniform models. */
void cli_print_kv_layer_kinds(const struct kvq_context *ctx);

/* Prints a command's help (two parts) and exits: 0, or 1 with a message when stdout
 * lost it (a full disk, a closed descriptor), as for any other output. */
_Noreturn void cli_exit_help(const char *help, const char *more);

/* Reads a whole file into a NUL-terminated buffer (caller frees); NULL with an error
 * printed, also for a file over CLI_MAX_TEXT_BYTES (prompts, corpora, templates: a
 * million-token context is about 4 MB of text). */
#define CLI_MAX_TEXT_BYTES (256 << 20) /* said as "256 MiB" in the message */
char *cli_read_file(const char *path, size_t *len);
/* Monotonic time in seconds. */
double cli_now(void);

/* Tokenizes text (add_special: BOS as the model's metadata says; special-token text is
 * not parsed); returns a malloc'd array, NULL with an error printed. */
kvq_token *cli_tokenize(const struct kvq_model *m, const char *text, size_t len, bool add_special, bool parse_special,
                        int *n_out);
/* True when the model's tokenizer puts BOS in front of a text. */
bool cli_model_adds_bos(const struct kvq_model *m);

#endif
