#include <stdio.h>
int main(void) { puts("kvq"); return 0; }
