/* The hot SIMD loops under AddressSanitizer. ASan checks every load and store; in the
 * vector loops of the weight products and the attention that made them 15-30x slower
 * than the loops themselves, and the sanitized test suite (which runs the models end
 * to end through the server) took most of an hour on two cores. So those loops are
 * compiled unchecked (KERN_UNCHECKED on the ISA files' entry points and on the static
 * functions they call), and their dispatchers check instead, once a call, every range
 * the loop will read or write (kern_asan_range): a loop that strays outside them is
 * not caught, but every caller that hands them a short buffer, a freed block or a
 * wrong stride is. Without ASan, KERN_UNCHECKED is nothing and the checks are not
 * compiled (the dispatchers' range functions are under #ifdef KERN_ASAN). */
#ifndef KVQ_KERNELS_ASAN_H
#define KVQ_KERNELS_ASAN_H

#include <stddef.h>

#if defined(__SANITIZE_ADDRESS__)
#define KERN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KERN_ASAN 1
#endif
#endif

#ifdef KERN_ASAN
#define KERN_UNCHECKED __attribute__((no_sanitize_address))
/* Reports (as ASan reports a bad access) when any of the n bytes at p is not addressable. */
void kern_asan_range(const void *p, size_t n);
/* The same for rows rows of row_bytes each, stride bytes apart. */
void kern_asan_rows(const void *p, size_t rows, size_t row_bytes, size_t stride);
#else
#define KERN_UNCHECKED
#endif

#endif
