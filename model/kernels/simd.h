// The SIMD switch, without torch (so the standalone check.cpp builds for any target): which path this build
// compiles, from the compiler's target macros (model/kernels/__init__.py's compile_flags sets them per CPU).
// -DES_NO_SIMD builds the portable C++ loops on any CPU (an aarch64 compiler targets NEON by default).
#pragma once
#include <cstdint>
#include <cstring>

#if !defined(ES_NO_SIMD) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ES_AVX2 1
#endif

// VNNI: vpdpbusd on 256-bit vectors, from AVX512_VNNI + VL or from AVX-VNNI; acc + the sums of 4 products of
// unsigned bytes u by signed bytes s, per int32 lane (exact)
#if defined(ES_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ES_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(ES_AVX2) && defined(__AVXVNNI__)
#define ES_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

// ES_ZMM (set by the build, model/kernels/__init__.py: no compiler macro tells it): the VNNI kernels also take two
// weight groups at once in 512-bit registers (groups_x86.h's Z16), for CPUs whose 512-bit vpdpbusd does twice a
// 256-bit one's work per cycle. Measured (the served model's layer matmuls, both threads, the paths alternated
// in one run: bench/results/issue39-pass-cost/session-9): on a 2-core Zen 5 EPYC (family 1Ah) 0.93x the 256-bit
// kernels' time at 8 rows, 0.85x at 16, 0.67x at 64, the same at 1-4 (groups.h's WIDE_ROWS); on a Zen 4 EPYC,
// which runs a 512-bit op as two 256-bit halves, 8.4 ms at one row against 6.1, 13.2 against 11.0 at eight (one
// thread, same run), so it keeps the 256-bit kernels alone.
#if defined(ES_ZMM) && !(defined(ES_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__))
#error "ES_ZMM needs AVX-512 VNNI and BW"
#endif

// AMX-INT8 tiles (Sapphire Rapids and later Xeons), with the AVX-512 VNNI kernels for passes of fewer rows
// (groups_amx.h)
#if defined(ES_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__)
#define ES_AMX 1
#endif

// ES_ZMM_FLOAT: attention's weighted values in 512-bit float lanes (ops.cpp's Lanes<16>, kv.h's load16) where the
// 512-bit kernels run (ES_ZMM) and on AMX's Xeons, which issue 512-bit float fmas on two ports (their integer
// multiplies on one: ES_ZMM above). A value's fma chain over the slots is one lane's in either width, so the bits
// are the same. A 1000-token prompt's pass on a 2-core Xeon with AMX: 0.95x the time (six runs alternated with
// the 256-bit build, bench/results/issue39-serial-work).
#if defined(ES_ZMM) || defined(ES_AMX)
#define ES_ZMM_FLOAT 1
#endif

// aarch64: NEON (every ARMv8-A core, the Pi 4's Cortex-A72 included), with sdot where the core has the dot
// product extension (ARMv8.2-A's, the Pi 5's Cortex-A76: -march=armv8.2-a+dotprod)
#if !defined(ES_NO_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define ES_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define ES_DOTPROD 1
#endif
#endif

// the name of the path this build compiled (`isa()` in Python; model/kernels/__init__.py's Isa)
inline const char* isa_name() {
#if defined(ES_AMX)
  return "avx512-amx";
#elif defined(ES_ZMM)
  return "avx512-vnni-zmm";
#elif defined(ES_VNNI) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(ES_VNNI)
  return "avx-vnni";
#elif defined(ES_AVX2)
  return "avx2";
#elif defined(ES_DOTPROD)
  return "neon-dotprod";
#elif defined(ES_NEON)
  return "neon";
#else
  return "portable";
#endif
}
