#include "cli/cli.h"
int cmd_bench(int argc, char **argv) { (void)argc; (void)argv; return cli_fail("not yet"); }
