// The group kernels of the quantized matmuls (quant.cpp), without torch, so that check.cpp builds them for any
// target: llama.cpp's scheme, our own code.
//
// Activations are quantized per row to int8 in blocks of 32 (scale dx = max|x| / 127, plus the block's
// sum s = dx * sum(qx)). Each output is then one float accumulator updated block by block, in block order:
//   q4 (Q4_0/Q4_1/Q4_K as w = d q + m, q in 0..15):  y = fma(m_b, s_b, fma(<qw, qx>_b, d_b dx_b, y))
//   q8 (w = d q, q in -127..127, one d per block):   y = fma(<qw, qx>_b, d_b dx_b, y)
//   q8 with a d per half block (Q6_K, Q3_K):          y = fma(<qw, qx>_b1, d_b1 dx_b, fma(<qw, qx>_b0, d_b0 dx_b, y))
//   affine q8 (w = d q + m, Q5_1 / Q5_K per block, Q2_K per half block): each (half) block's step is followed by
//   y = fma(m, s, y), s the activations' sum over it (q4's order: a Q4 widened to affine q8 gives the same bits)
// where <qw, qx>_b is the block's integer dot product (exact in int32, so its summation order is free). That
// order depends only on K, never on how many rows the pass has or which thread runs it, so a position's
// result is bitwise the same alone, in a verification pass or in a batch of rows (docs: "exact in the served
// format"); the SIMD paths (AVX2, VNNI, NEON with or without sdot) and the portable path compute the same float
// operations, with explicit fma, so they agree too (built with -ffp-contract=off; check.cpp and
// tests/test_kernels.py compare them bit for bit).
//
// Weights are held interleaved in groups of 8 rows (model/quant.py's `interleave`, rows padded to a multiple
// of 8): for group g and block b, word j of every row, 4 bytes, side by side, [G, nb, words, 8] int32. One
// 32-byte load then holds 4 elements of 8 rows, one maddubs multiplies them by 4 activations broadcast, and
// the 8 lanes of the accumulator are 8 outputs: no horizontal sum per output, and the scales of 8 rows come
// in one load. Measured on an AVX2 EPYC, one thread, 3072x576 q4: 70 -> 33 us at one row, 229 -> 111 at
// four; the 49152x576 q8 head 5.4 -> 2.8 ms at one row (llama.cpp's AVX2 REPACK kernels use the same idea).
// q4 words hold the nibbles as GGUF does: the low nibbles of word j are elements 4j..4j+3 of the block, the
// high nibbles elements 16+4j..16+4j+3. A group kernel takes pw [nb, words, 8] (one group's words), d8, m8
// [nb * S, 8] (S scales per block), a tile of R <= ROWS activation rows, and writes 8 outputs per row, rows ldo
// apart. A tile holds ROWS rows block by block: block b of row r at qx + 32 (b ROWS + r), its scale and sum at
// dx, sx [b ROWS + r], its sums per scale at ss [(b ROWS + r) S + h]. Rows K apart cost a pointer per row: at 8
// rows GCC ran out of registers and kept 6 of them on the stack, added to in memory every block; a tile's rows
// sit at constant offsets from one pointer per block (the served model's layer matmuls, VNNI, the old and new
// builds alternated on a 2-core EPYC: 0.94x the time at 8 rows, 0.98x at 16, 0.97x at 64, 1.0x at 1 and 2).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "simd.h"

namespace groups {

constexpr int QK = 32;  // elements per quantization block
constexpr int G8 = 8;   // weight rows per interleaved group
// activation rows per call of a group's kernel (each weight block read once for them): 16 with AMX (a tile's
// rows, groups_amx.h; fewer rows than AMX_ROWS take the VNNI kernels, 8 at a time), 8 where AVX-512 VL's 32
// vector registers hold 8 rows' sums and accumulators, 4 where 16 registers (AVX2, AVX-VNNI) hold 4 rows' (8
// would spill), and 4 on NEON (its 128-bit registers hold 4 outputs, so a row's sums and accumulators take 4-6)
#if defined(ES_AMX)
constexpr int ROWS = 16;
#elif defined(ES_VNNI) && defined(__AVX512VL__)
constexpr int ROWS = 8;
#else
constexpr int ROWS = 4;
#endif

// weight groups one kernel call takes at once where they are whole: 2 in a build with 512-bit kernels
// (groups_x86.h's Z16) or tiles (groups_amx.h), else 1
#if defined(ES_ZMM) || defined(ES_AMX)
constexpr int WIDE = 2;
#else
constexpr int WIDE = 1;
#endif
// the fewest rows for which two groups go through one 512-bit kernel: fewer rows, bound by the weights' bytes,
// go group by group in 256-bit registers (the 512-bit kernels measured 1.05-1.07x their time at 1-4 rows, the same
// at 5, 0.94x at 6; simd.h)
constexpr int WIDE_ROWS = 5;

// One block's scale and sums as quantize_row writes them at index i (the block's place in the tile, below):
// dx[i] = d, sx[i] = d * (lo + hi), and where sh is not null sh[2i], sh[2i + 1] = d * lo, d * hi (lo, hi: the
// sums of the block's two halves of qx).
inline void block_sums(int64_t b, float d, int lo, int hi, float* dx, float* sx, float* sh) {
  dx[b] = d;
  sx[b] = d * static_cast<float>(lo + hi);
  if (sh != nullptr) {
    sh[2 * b] = d * static_cast<float>(lo);
    sh[2 * b + 1] = d * static_cast<float>(hi);
  }
}

// x [K] float -> its K/32 blocks of int8 qx, their scales dx and sums sx (sx = dx * sum of the block's qx), and
// where sh is not null the same per half block (only Q2_K's offsets per 16 read them), block b at qx + 32 b step,
// dx[b step], sx[b step], sh[2 b step + 0..1]: step = 1 writes a plain row, step = ROWS a row of a tile (above).
// The SIMD quantizers (quantize_row picks this build's) compute the same: max|x| ignoring NaN, as std::max does
// here, d and 1/d in scalars, each x * (1/d) rounded to nearest even (nearbyint under the default rounding mode;
// cvtps and fcvtns alike).
inline void quantize_row_portable(const float* x, int64_t K, int8_t* qx, float* dx, float* sx, float* sh,
                                  int64_t step) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum[2] = {0, 0};
    for (int i = 0; i < QK; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));
      qx[b * step * QK + i] = static_cast<int8_t>(q);
      sum[i / 16] += q;
    }
    block_sums(b * step, d, sum[0], sum[1], dx, sx, sh);
  }
}

inline int32_t word(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// rows 0..R-1 (1 <= R <= ROWS at run time) through the compile-time kernel `tile`
template <typename Tile>
inline void by_rows(int64_t R, Tile tile) {
  switch (R) {
    case 1: tile(std::integral_constant<int, 1>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
#ifdef ES_VNNI
    case 4: tile(std::integral_constant<int, 4>{}); break;
    case 5: tile(std::integral_constant<int, 5>{}); break;
    case 6: tile(std::integral_constant<int, 6>{}); break;
    case 7: tile(std::integral_constant<int, 7>{}); break;
    default: tile(std::integral_constant<int, 8>{});
#else
    default: tile(std::integral_constant<int, 4>{});
#endif
  }
}

#include "groups_x86.h"
#include "groups_amx.h"
#include "groups_neon.h"

#ifndef ES_AMX
// the tiles of a build without AMX: none (groups_amx.h's Tiles loads them)
class Tiles {
 public:
  Tiles(int, int64_t) {}
  bool on() const { return false; }
};
#endif

// the VNNI kernels over R rows of a tile, 8 at a time (AMX's tiles hold 16): kernel(n, r) takes rows r..r+n-1
template <typename Kernel>
inline void by_eights(int64_t R, Kernel kernel) {
  for (int64_t r = 0; r < R; r += 8) kernel(std::min<int64_t>(8, R - r), r);
}

// quantize_row_portable through this build's path. The scalar loop ran on one thread before the groups split
// over both: on the 2-core EPYC (AVX-512 VNNI) 4.6% of a 4-row pass's samples against the q4 kernel's 24.9% on
// both threads; with these, the served model's layer matmuls took 0.87x the time at 4 rows, 0.80x at 8 and 0.75x
// at 64 (old and new builds alternated in one process)
inline void quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx, float* sh,
                         int64_t step) {
#if defined(ES_AVX2)
  quantize_row_avx2(x, K, qx, dx, sx, sh, step);
#elif defined(ES_NEON)
  quantize_row_neon(x, K, qx, dx, sx, sh, step);
#else
  quantize_row_portable(x, K, qx, dx, sx, sh, step);
#endif
}


// The portable kernels: the same float operations per output as the groups above, one output at a time.
// Word j of row `lane` of a block sits at pw[(b * words + j) * 8 + lane]. Each output of rows 0..R-1 is
// acc = step(acc, r, lane, b) over the blocks in order, from 0.
template <typename Step>
inline void group_portable(int64_t R, int64_t nb, float* out, int64_t ldo, Step step) {
  for (int64_t r = 0; r < R; ++r)
    for (int lane = 0; lane < G8; ++lane) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) acc = step(acc, r, lane, b);
      out[r * ldo + lane] = acc;
    }
}

inline void group_q4_portable(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                       const float* sx, int64_t nb, int64_t R, float* out, int64_t ldo) {
  group_portable(R, nb, out, ldo, [&](float acc, int64_t r, int lane, int64_t b) {
    const int8_t* xb = qx + (b * ROWS + r) * QK;
    int dot = 0;
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = static_cast<uint32_t>(pw[(b * 4 + j) * G8 + lane]);
      for (int e = 0; e < 4; ++e) {
        const int byte = (w >> (8 * e)) & 0xFF;
        dot += (byte & 0x0F) * xb[4 * j + e] + (byte >> 4) * xb[16 + 4 * j + e];
      }
    }
    acc = std::fma(static_cast<float>(dot), d8[b * G8 + lane] * dx[b * ROWS + r], acc);
    return std::fma(m8[b * G8 + lane], sx[b * ROWS + r], acc);
  });
}

template <int S, bool A>
void group_q8_portable(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                       const float* ss, int64_t nb, int64_t R, float* out, int64_t ldo) {
  group_portable(R, nb, out, ldo, [&](float acc, int64_t r, int lane, int64_t b) {
    const int8_t* xb = qx + (b * ROWS + r) * QK;
    int dot[S] = {};
    for (int j = 0; j < 8; ++j) {
      const int32_t w = pw[(b * 8 + j) * G8 + lane];
      for (int e = 0; e < 4; ++e) dot[j * S / 8] += static_cast<int8_t>((w >> (8 * e)) & 0xFF) * xb[4 * j + e];
    }
    for (int h = 0; h < S; ++h) {
      acc = std::fma(static_cast<float>(dot[h]), d8[(b * S + h) * G8 + lane] * dx[b * ROWS + r], acc);
      if constexpr (A) acc = std::fma(m8[(b * S + h) * G8 + lane], ss[(b * ROWS + r) * S + h], acc);
    }
    return acc;
  });
}

// The 8 outputs of one weight group for R <= ROWS activation rows, through this build's path (without tiles).
inline void q4_one(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                   const float* sx, int64_t nb, int64_t R, float* out, int64_t ldo) {
#if defined(ES_VNNI)
  by_eights(R, [&](int64_t n, int64_t r) {
    by_rows(n, [&](auto Rc) {
      group_q4_vnni<Y8, decltype(Rc)::value>(pw, d8, m8, qx + r * QK, dx + r, sx + r, nb, out + r * ldo, ldo);
    });
  });
#elif defined(ES_AVX2)
  by_rows(R, [&](auto Rc) { group_q4<decltype(Rc)::value>(pw, d8, m8, qx, dx, sx, nb, out, ldo); });
#elif defined(ES_NEON)
  by_rows(R, [&](auto Rc) { group_q4_neon<decltype(Rc)::value>(pw, d8, m8, qx, dx, sx, nb, out, ldo); });
#else
  group_q4_portable(pw, d8, m8, qx, dx, sx, nb, R, out, ldo);
#endif
}

// The 8 G outputs of G adjacent weight groups (G = 1, or WIDE where both are whole; each group's words and scales
// follow the one before it) for R <= ROWS activation rows, through this build's path: the AMX tiles where
// `tiles` are loaded and R is AMX_ROWS or more, two groups in 512-bit registers where the build has them and R is
// WIDE_ROWS or more, else group by group (through q4_one: a call of q4_group itself per group was not inlined,
// and the served model's layer matmuls took 1.09x the time at 1 row, 1.19x at 4, its q8 head 1.29x at 4).
inline void q4_group(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                     const float* sx, int64_t nb, int64_t R, float* out, int64_t ldo, const Tiles& tiles, int G = 1) {
#if defined(ES_AMX)
  if (tiles.on() && R >= AMX_ROWS) return group_amx_rows<1, true, true>(pw, d8, m8, qx, dx, sx, nb, R, out, ldo, G);
#else
  (void)tiles;
#endif
#if defined(ES_ZMM)
  if (G == 2 && R >= WIDE_ROWS) {
    by_rows(R, [&](auto Rc) { group_q4_vnni<Z16, decltype(Rc)::value>(pw, d8, m8, qx, dx, sx, nb, out, ldo); });
    return;
  }
#endif
  for (int g = 0; g < G; ++g)
    q4_one(pw + g * nb * 4 * G8, d8 + g * nb * G8, m8 + g * nb * G8, qx, dx, sx, nb, R, out + g * G8, ldo);
}

// The activations as a q8 group kernel of this build reads them: VNNI's unsigned ux = qx + 128 (qx ^ 0x80; its
// kernel says why), made once per pass; none on the other paths.
inline std::vector<uint8_t> q8_activations(const int8_t* qx, int64_t n) {
#ifdef ES_VNNI
  std::vector<uint8_t> ux(n);
  for (int64_t i = 0; i < n; ++i) ux[i] = static_cast<uint8_t>(qx[i]) ^ 0x80;
  return ux;
#else
  (void)qx, (void)n;
  return {};
#endif
}

// q4_one for q8 weights: S scales per block, A with offsets (m8, and ss the activations' sums per scale); ux is
// q8_activations' bytes of the same rows (read by VNNI only).
template <int S, bool A>
void q8_one(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const uint8_t* ux,
            const float* dx, const float* ss, int64_t nb, int64_t R, float* out, int64_t ldo) {
#if defined(ES_VNNI)
  (void)qx;
  by_eights(R, [&](int64_t n, int64_t r) {
    by_rows(n, [&](auto Rc) {
      group_q8_vnni<Y8, decltype(Rc)::value, S, A>(pw, d8, m8, ux + r * QK, dx + r, ss + r * S, nb, out + r * ldo,
                                                   ldo);
    });
  });
#elif defined(ES_AVX2)
  (void)ux;
  by_rows(R, [&](auto Rc) { group_q8<decltype(Rc)::value, S, A>(pw, d8, m8, qx, dx, ss, nb, out, ldo); });
#elif defined(ES_NEON)
  (void)ux;
  by_rows(R, [&](auto Rc) { group_q8_neon<decltype(Rc)::value, S, A>(pw, d8, m8, qx, dx, ss, nb, out, ldo); });
#else
  (void)ux;
  group_q8_portable<S, A>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo);
#endif
}

// q4_group for q8 weights (q8_one's arguments)
template <int S, bool A>
void q8_group(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const uint8_t* ux,
              const float* dx, const float* ss, int64_t nb, int64_t R, float* out, int64_t ldo, const Tiles& tiles,
              int G = 1) {
#if defined(ES_AMX)
  if (tiles.on() && R >= AMX_ROWS) return group_amx_rows<S, A, false>(pw, d8, m8, qx, dx, ss, nb, R, out, ldo, G);
#else
  (void)tiles;
#endif
#if defined(ES_ZMM)
  if (G == 2 && R >= WIDE_ROWS) {
    by_rows(R, [&](auto Rc) { group_q8_vnni<Z16, decltype(Rc)::value, S, A>(pw, d8, m8, ux, dx, ss, nb, out, ldo); });
    return;
  }
#endif
  for (int g = 0; g < G; ++g)
    q8_one<S, A>(pw + g * nb * 8 * G8, d8 + g * nb * S * G8, m8 ? m8 + g * nb * S * G8 : nullptr, qx, ux, dx, ss, nb,
                 R, out + g * G8, ldo);
}

}  // namespace groups
