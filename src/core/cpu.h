/* The one CPU feature detector of the engine: which SIMD level the kernels may use.
 * Every kernel family dispatches on kvq_simd_level(); a level is only reported when
 * the CPU has every feature its kernel files are compiled with (see CMakeLists.txt)
 * and the OS saves the register state (XGETBV). */
#ifndef KVQ_CORE_CPU_H
#define KVQ_CORE_CPU_H

#include <stddef.h>

enum kvq_simd {
    KVQ_SIMD_SCALAR = 0,
    KVQ_SIMD_AVX2 = 1,   /* AVX2 + FMA + F16C, OS saves ymm */
    KVQ_SIMD_AVX512 = 2, /* the above + AVX-512 F/BW/VL/DQ/VNNI, OS saves zmm and opmasks */
};

/* Best level this CPU runs, capped by the environment variable KVQ_SIMD
 * (scalar|avx2|avx2vnni|avx512) read once: a capped level counts as unavailable, so
 * forcing KVQ_SIMD=avx2 makes the process behave as on an AVX2-only machine without
 * AVX-VNNI, and avx2vnni as on one with it (where this CPU has it). */
enum kvq_simd kvq_simd_max(void);
/* True when level <= kvq_simd_max(). */
int kvq_simd_available(enum kvq_simd level);
/* The level kernels use now (kvq_simd_max() unless forced). */
enum kvq_simd kvq_simd_level(void);
/* Forces a level (tests and benchmarks; not while kernels run). -1 if unavailable. */
int kvq_simd_force(enum kvq_simd level);
/* True when the CPU has AVX-512 VBMI (vpermb, vpmultishiftqb): kernels of the AVX-512
 * level may take a variant compiled with it (kernels/kv_quant_avx512vbmi.c). */
int kvq_cpu_avx512_vbmi(void);
/* True when the level in use is AVX2 and its kernels may take their variant compiled
 * with AVX-VNNI (vpdpbusd in VEX form; CPUID leaf 7.1 EAX bit 4: Intel since Alder
 * Lake, AMD since Zen 4): the CPU has it and neither KVQ_SIMD=avx2 nor
 * kvq_cpu_use_avx_vnni(0) leaves it out. */
int kvq_cpu_avx_vnni(void);
/* 0: the AVX2 kernels leave AVX-VNNI out (tests of both variants on one machine). */
void kvq_cpu_use_avx_vnni(int on);
/* The CPU's brand string (CPUID), or "unknown", into buf of n bytes. */
void kvq_cpu_model(char *buf, size_t n);
/* "scalar", "avx2" or "avx512". */
const char *kvq_simd_name(enum kvq_simd level);
/* The name of the level in use, "avx2vnni" where it is AVX2 with AVX-VNNI. */
const char *kvq_simd_level_name(void);

#endif
