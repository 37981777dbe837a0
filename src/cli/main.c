/* kvq: one binary, one subcommand per job. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static const struct cli_command commands[] = {
    {"generate", "generate text from a prompt", cmd_generate},
    {"tokenize", "print the token ids of a text", cmd_tokenize},
    {"cache-prompt", "save the KV cache state after a prompt to a file", cmd_cache_prompt},
    {"bench-kv-cache", "memory, error and speed of the KV cache formats", cmd_bench_kv_cache},
    {"perplexity", "perplexity and KL divergence over a text (llama-perplexity conventions)", cmd_perplexity},
    {"calibrate-kv", "which layers gain most from more KV bits (mixed precision at a byte budget)", cmd_calibrate_kv},
    {"passkey", "long-context pass-key retrieval accuracy", cmd_passkey},
    {"bench", "prefill/decode speed and memory per KV config, depth and batch", cmd_bench},
    {"gen-model", "write a random-weight GGUF model of a real shape", cmd_gen_model},
    {"serve", "OpenAI-compatible HTTP server with continuous batching and a prefix cache", cmd_serve},
    {"bench-serve", "load generator for a running server: throughput, TTFT, ITL", cmd_bench_serve},
};

static void usage(FILE *out) {
    fprintf(out, "kvq: LLM inference with a quantized KV cache\n\nusage: kvq COMMAND [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(out, "  %-16s %s\n", commands[i].name, commands[i].summary);
    fprintf(out, "\n'kvq COMMAND --help' describes a command's options.\n");
}

/* Output that did not reach stdout (a full disk, a closed descriptor) is a failure,
 * not a silent success: every command's printing ends here. */
static int finish_stdout(int rc) {
    errno = 0;
    bool bad = fflush(stdout) != 0 || ferror(stdout);
    int err = errno;
    if (fclose(stdout) != 0 && !bad) {
        bad = true;
        err = errno;
    }
    if (bad && rc == 0) { /* a failed command has already said why */
        fprintf(stderr, "kvq: cannot write the output: %s\n", err ? strerror(err) : "write error");
        return 1;
    }
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "kvq: no command given (run 'kvq --help' for the list)\n");
        return 1;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return finish_stdout(0);
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(argv[1], commands[i].name) == 0) return finish_stdout(commands[i].run(argc - 1, argv + 1));
    fprintf(stderr, "kvq: unknown command '%s' (run 'kvq --help' for the list)\n", argv[1]);
    return 1;
}
