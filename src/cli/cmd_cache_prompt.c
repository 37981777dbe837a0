#include "cli/cli.h"
int cmd_cache_prompt(int argc, char **argv) { (void)argc; (void)argv; return 1; }
