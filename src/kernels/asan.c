/* The range checks that stand in for AddressSanitizer's own inside the hot loops
 * (kernels/asan.h). This file is instrumented: the read of the first bad byte below
 * is what ASan reports, with the caller's stack. */
#include "kernels/asan.h"

#ifdef KERN_ASAN
#include <sanitizer/asan_interface.h>

void kern_asan_range(const void *p, size_t n) {
    if (n == 0) return;
    const volatile char *bad = __asan_region_is_poisoned((void *)(size_t)p, n);
    if (bad) (void)*bad;
}

/* The rows' whole span: rows of one tensor or block have no redzones between them. */
void kern_asan_rows(const void *p, size_t rows, size_t row_bytes, size_t stride) {
    if (rows > 0) kern_asan_range(p, (rows - 1) * stride + row_bytes);
}
#else
typedef int kern_asan_unused; /* ISO C wants something in a translation unit */
#endif
