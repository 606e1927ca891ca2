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
#if defined(ES_VNNI) && defined(__AVX512VNNI__)
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
