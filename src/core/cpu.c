/* CPU feature detection (CPUID + XGETBV) and the KVQ_SIMD override. */
#include "core/cpu.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static enum kvq_simd cpu_detect(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return KVQ_SIMD_SCALAR;
    const unsigned fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx || !fma || !f16c) return KVQ_SIMD_SCALAR;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0x6) != 0x6) return KVQ_SIMD_SCALAR; /* xmm + ymm state */
    if (__get_cpuid_max(0, NULL) < 7) return KVQ_SIMD_SCALAR;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((b >> 5) & 1)) return KVQ_SIMD_SCALAR; /* avx2 */
    /* exactly the flags *_avx512.c are compiled with: F(16) DQ(17) BW(30) VL(31), VNNI(ecx 11) */
    const unsigned need_b = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    const int avx512 = (b & need_b) == need_b && ((c >> 11) & 1);
    if (avx512 && (xlo & 0xE0) == 0xE0) return KVQ_SIMD_AVX512; /* opmask + zmm state */
    return KVQ_SIMD_AVX2;
}

static int vbmi_detect(void) {
    unsigned a, b, c, d;
    if (cpu_detect() < KVQ_SIMD_AVX512) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (c >> 1) & 1; /* AVX512_VBMI */
}
static int avx_vnni_detect(void) {
    unsigned a, b, c, d;
    if (cpu_detect() < KVQ_SIMD_AVX2) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    if (a < 1) return 0; /* no subleaf 1 */
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1; /* AVX-VNNI */
}
#else
static enum kvq_simd cpu_detect(void) { return KVQ_SIMD_SCALAR; }
static int vbmi_detect(void) { return 0; }
static int avx_vnni_detect(void) { return 0; }
#endif

int kvq_cpu_avx512_vbmi(void) {
    static atomic_int vbmi = -1; /* CPUID traps to the hypervisor in a VM: once */
    int v = atomic_load_explicit(&vbmi, memory_order_relaxed);
    if (v < 0) {
        v = vbmi_detect();
        atomic_store_explicit(&vbmi, v, memory_order_relaxed);
    }
    return v && kvq_simd_max() >= KVQ_SIMD_AVX512;
}

static atomic_int g_max = -1, g_level = -1, g_vnni = -1, g_vnni_wanted = 1;

/* The CPU's best level capped by KVQ_SIMD, and whether AVX-VNNI may be used (the CPU has
 * it and KVQ_SIMD is not scalar or avx2), read once. */
static void simd_init(void) {
    const char *env = getenv("KVQ_SIMD");
    const int scalar = env && strcmp(env, "scalar") == 0, avx2 = env && strcmp(env, "avx2") == 0;
    int l = (int)cpu_detect();
    const int cap = scalar ? KVQ_SIMD_SCALAR : avx2 || (env && strcmp(env, "avx2vnni") == 0) ? KVQ_SIMD_AVX2 : l;
    if (cap < l) l = cap; /* never above what the CPU runs */
    atomic_store_explicit(&g_vnni, avx_vnni_detect() && !scalar && !avx2, memory_order_relaxed);
    atomic_store_explicit(&g_max, l, memory_order_relaxed);
}

int kvq_cpu_avx_vnni(void) {
    int v = atomic_load_explicit(&g_vnni, memory_order_relaxed);
    if (v < 0) simd_init(), v = atomic_load_explicit(&g_vnni, memory_order_relaxed);
    return v && atomic_load_explicit(&g_vnni_wanted, memory_order_relaxed) && kvq_simd_level() == KVQ_SIMD_AVX2;
}

void kvq_cpu_use_avx_vnni(int on) { atomic_store_explicit(&g_vnni_wanted, on != 0, memory_order_relaxed); }

enum kvq_simd kvq_simd_max(void) {
    int l = atomic_load_explicit(&g_max, memory_order_relaxed);
    if (l < 0) simd_init(), l = atomic_load_explicit(&g_max, memory_order_relaxed);
    return (enum kvq_simd)l;
}

int kvq_simd_available(enum kvq_simd level) { return (int)level <= (int)kvq_simd_max(); }

enum kvq_simd kvq_simd_level(void) {
    int l = atomic_load_explicit(&g_level, memory_order_relaxed);
    if (l < 0) {
        l = (int)kvq_simd_max();
        atomic_store_explicit(&g_level, l, memory_order_relaxed);
    }
    return (enum kvq_simd)l;
}

int kvq_simd_force(enum kvq_simd level) {
    if (!kvq_simd_available(level)) return -1;
    atomic_store_explicit(&g_level, (int)level, memory_order_relaxed);
    return 0;
}

void kvq_cpu_model(char *buf, size_t n) {
    if (!n) return;
    buf[0] = 0;
#if defined(__x86_64__) || defined(__i386__)
    unsigned r[12];
    if ((unsigned)__get_cpuid_max(0x80000000u, NULL) >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) __cpuid(0x80000002u + i, r[4 * i], r[4 * i + 1], r[4 * i + 2], r[4 * i + 3]);
        char s[49];
        memcpy(s, r, 48);
        s[48] = 0;
        const char *b = s;
        while (*b == ' ') b++; /* the brand string may be right-aligned */
        size_t len = strlen(b);
        while (len && b[len - 1] == ' ') len--;
        if (len >= n) len = n - 1;
        memcpy(buf, b, len);
        buf[len] = 0;
    }
#endif
    if (!buf[0]) snprintf(buf, n, "unknown");
}

const char *kvq_simd_name(enum kvq_simd level) {
    switch (level) {
    case KVQ_SIMD_AVX512: return "avx512";
    case KVQ_SIMD_AVX2: return "avx2";
    default: return "scalar";
    }
}

const char *kvq_simd_level_name(void) { return kvq_cpu_avx_vnni() ? "avx2vnni" : kvq_simd_name(kvq_simd_level()); }
