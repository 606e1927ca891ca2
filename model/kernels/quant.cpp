// Row-invariant CPU matmuls over block-quantized weights (llama.cpp's scheme, our own code).
//
// Activations are quantized per row to int8 in blocks of 32 (scale dx = max|x| / 127, plus the block's
// sum s = dx * sum(qx)). Each output is then one float accumulator updated block by block, in block order:
//   q4 (Q4_0/Q4_1/Q4_K as w = d q + m, q in 0..15):  y = fma(m_b, s_b, fma(<qw, qx>_b, d_b dx_b, y))
//   q8 (w = d q, q in -127..127, one d per block):   y = fma(<qw, qx>_b, d_b dx_b, y)
//   q8 with a d per half block (Q6_K, Q3_K):          y = fma(<qw, qx>_b1, d_b1 dx_b, fma(<qw, qx>_b0, d_b0 dx_b, y))
//   affine q8 (w = d q + m, Q5_1 / Q5_K per block, Q2_K per half block): each (half) block's step is followed by
//   y = fma(m, s, y), s the activations' sum over it (q4's order: a Q4 widened to affine q8 gives the same bits)
//   f32 (dense):                                     y = sum_k w_k x_k (8 lanes, then reduce8)
// where <qw, qx>_b is the block's integer dot product (exact in int32, so its summation order is free). That
// order depends only on K, never on how many rows the pass has or which thread runs it, so a position's
// result is bitwise the same alone, in a verification pass or in a batch of rows (docs: "exact in the served
// format"); the AVX2 path and the portable path compute the same float operations, with explicit fma, so
// they agree too (built with -ffp-contract=off).
//
// Weights are held interleaved in groups of 8 rows (model/quant.py's `interleave`, rows padded to a multiple
// of 8): for group g and block b, word j of every row, 4 bytes, side by side, [G, nb, words, 8] int32. One
// 32-byte load then holds 4 elements of 8 rows, one maddubs multiplies them by 4 activations broadcast, and
// the 8 lanes of the accumulator are 8 outputs: no horizontal sum per output, and the scales of 8 rows come
// in one load. Measured on an AVX2 EPYC, one thread, 3072x576 q4: 70 -> 33 us at one row, 229 -> 111 at
// four; the 49152x576 q8 head 5.4 -> 2.8 ms at one row (llama.cpp's AVX2 REPACK kernels use the same idea).
// q4 words hold the nibbles as GGUF does: the low nibbles of word j are elements 4j..4j+3 of the block, the
// high nibbles elements 16+4j..16+4j+3.
#include "common.h"

namespace {

constexpr int QK = 32;  // elements per quantization block
constexpr int G8 = 8;   // weight rows per interleaved group
// activation rows per call of a group's kernel (each weight block read once for them): 8 where AVX-512 VL's 32
// vector registers hold 8 rows' sums and accumulators, 4 where 16 registers (AVX2, AVX-VNNI) hold 4 rows' (8
// would spill)
#if defined(ES_VNNI) && defined(__AVX512VL__)
constexpr int ROWS = 8;
#else
constexpr int ROWS = 4;
#endif

// independent int32 sums per row in a VNNI kernel's block: one chain of 8 vpdpbusd (4-5 cycles each) per block
// would bound a pass of 1 or 2 rows by latency where maddubs' int16 adds take a cycle, so fewer rows take more
// chains, added at the block's end (exact, so the order is free). A reasoned choice: on the shared 2-core EPYC
// it was written on, one row measured 1.04x AVX2's time with one chain and with four alike.
template <int R>
constexpr int chains() { return R == 1 ? 4 : R == 2 ? 2 : 1; }

// x [K] float -> qx [K] int8, dx [K/32], sx [K/32] (sx = dx * sum of the block's qx), and where sh is not null
// sh [K/16] (the same per half block: only Q2_K's offsets per 16 read them)
void quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx, float* sh) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum[2] = {0, 0};
    for (int i = 0; i < QK; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));
      qx[b * QK + i] = static_cast<int8_t>(q);
      sum[i / 16] += q;
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum[0] + sum[1]);
    if (sh != nullptr) {
      sh[2 * b] = d * static_cast<float>(sum[0]);
      sh[2 * b + 1] = d * static_cast<float>(sum[1]);
    }
  }
}

int32_t word(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

#ifdef ES_AVX2
// The 8 outputs of one weight group for R activation rows (R a compile-time count, so the accumulators stay
// in registers): pw [nb, 4, 8] words, d8, m8 [nb, 8]; activation rows K apart, their scales nb apart; out
// gets 8 floats per row, rows ldo apart. The int16 sums cannot overflow: 8 maddubs of at most 2 * 15 * 127.
template <int R>
void group_q4(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
              const float* sx, int64_t nb, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 4 + j) * G8));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + r * K + b * QK;
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(word(xb + 4 * j))));
        s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word(xb + 16 + 4 * j))));
      }
    }
    const __m256 d = _mm256_loadu_ps(d8 + b * G8), m = _mm256_loadu_ps(m8 + b * G8);
    for (int r = 0; r < R; ++r) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// The same for q8: pw [nb, 8, 8] words of signed bytes, d8 [nb * S, 8] with S scales per block (1, or 2 when
// each half block of 16 has its own: words 0..3 are the first half); when A (affine), m8 [nb * S, 8] offsets and
// ss the activations' sums per scale, S per block, rows nb * S apart. maddubs takes |w| times x with w's sign; a
// pair of products reaches 2 * 127 * 127, so each maddubs is widened to int32 before adding.
template <int R, int S, bool A>
void group_q8(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
              const float* ss, int64_t nb, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[S][R];
    for (int h = 0; h < S; ++h)
      for (int r = 0; r < R; ++r) s[h][r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 8 + j) * G8));
      const __m256i a = _mm256_sign_epi8(v, v);  // |w| (w = -128 never occurs: |q| <= 127)
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(word(qx + r * K + b * QK + 4 * j)), v);
        __m256i& acc_s = s[j * S / 8][r];
        acc_s = _mm256_add_epi32(acc_s, _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), ones));
      }
    }
    for (int h = 0; h < S; ++h) {
      const __m256 d = _mm256_loadu_ps(d8 + (b * S + h) * G8);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h][r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
        if constexpr (A)
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + (b * S + h) * G8), _mm256_set1_ps(ss[(r * nb + b) * S + h]),
                                   acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#ifdef ES_VNNI
// VNNI: vpdpbusd multiplies unsigned bytes by signed bytes and adds each lane's 4 products into its int32, in
// place of maddubs + madd + add (three instructions, and an int16 step): the same exact integer dot per block,
// so the same float steps after it, and one instruction per 4 products instead of two or three, which is what
// lets a group take up to 8 rows at once (ROWS) for little more than the cost of reading its weights.
// Tried and dropped: a 512-bit kernel over two weight groups at once (16 outputs per vpdpbusd, half the
// broadcasts): on this Zen 4 EPYC, which runs a 512-bit op as two 256-bit halves, the layer matmuls took 8.4 ms
// at one row against 6.1 for these 256-bit kernels, 13.2 against 11.0 at eight (one thread, same run).
template <int R>
void group_q4_vnni(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                   const float* sx, int64_t nb, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    constexpr int C = chains<R>();
    __m256i s[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) s[c][r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 4 + j) * G8));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = qx + r * K + b * QK;
        s[(2 * j) % C][r] = dpbusd(s[(2 * j) % C][r], lo, _mm256_set1_epi32(word(xb + 4 * j)));
        s[(2 * j + 1) % C][r] = dpbusd(s[(2 * j + 1) % C][r], hi, _mm256_set1_epi32(word(xb + 16 + 4 * j)));
      }
    }
    for (int c = 1; c < C; ++c)
      for (int r = 0; r < R; ++r) s[0][r] = _mm256_add_epi32(s[0][r], s[c][r]);
    const __m256 d = _mm256_loadu_ps(d8 + b * G8), m = _mm256_loadu_ps(m8 + b * G8);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0][r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// q8's weights are signed, so the activations go in as the unsigned bytes ux = qx + 128 (qx ^ 0x80, made once
// per pass): <w, ux> = <w, qx> + 128 sum(w), and 128 sum(w), one vpdpbusd per word for all the rows, is taken
// off (exact in int32: |<w, ux>| <= 32 * 127 * 255). That is one instruction per row and word where the sign
// trick (|w| times x with w's sign) takes two.
template <int R, int S, bool A>
void group_q8_vnni(const int32_t* pw, const float* d8, const float* m8, const uint8_t* ux, const float* dx,
                   const float* ss, int64_t nb, int64_t K, float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    // chains: C per scale (words 0..3 of a half block alternate over them when S = 2, 0..7 when S = 1)
    constexpr int C = S == 1 ? chains<R>() : std::max(1, chains<R>() / 2);
    __m256i s[S][C][R], c[S][C];
    for (int h = 0; h < S; ++h)
      for (int k = 0; k < C; ++k) {
        c[h][k] = _mm256_setzero_si256();
        for (int r = 0; r < R; ++r) s[h][k][r] = _mm256_setzero_si256();
      }
    for (int j = 0; j < 8; ++j) {
      const int h = j * S / 8, k = j % C;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (b * 8 + j) * G8));
      c[h][k] = dpbusd(c[h][k], bias, v);
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = reinterpret_cast<const int8_t*>(ux + r * K + b * QK);
        s[h][k][r] = dpbusd(s[h][k][r], _mm256_set1_epi32(word(xb + 4 * j)), v);
      }
    }
    for (int h = 0; h < S; ++h)
      for (int k = 1; k < C; ++k) {
        c[h][0] = _mm256_add_epi32(c[h][0], c[h][k]);
        for (int r = 0; r < R; ++r) s[h][0][r] = _mm256_add_epi32(s[h][0][r], s[h][k][r]);
      }
    for (int h = 0; h < S; ++h) {
      const __m256 d = _mm256_loadu_ps(d8 + (b * S + h) * G8);
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(s[h][0][r], c[h][0]));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
        if constexpr (A)
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(m8 + (b * S + h) * G8), _mm256_set1_ps(ss[(r * nb + b) * S + h]),
                                   acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#endif

// rows 0..R-1 (1 <= R <= ROWS at run time) through the compile-time kernel `tile`
template <typename Tile>
void by_rows(int64_t R, Tile tile) {
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
#endif

// The portable kernels: the same float operations per output as the groups above, one output at a time.
// Word j of row `lane` of a block sits at pw[(b * words + j) * 8 + lane]. Each output of rows 0..R-1 is
// acc = step(acc, r, lane, b) over the blocks in order, from 0.
template <typename Step>
void group_portable(int64_t R, int64_t nb, float* out, int64_t ldo, Step step) {
  for (int64_t r = 0; r < R; ++r)
    for (int lane = 0; lane < G8; ++lane) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) acc = step(acc, r, lane, b);
      out[r * ldo + lane] = acc;
    }
}

void group_q4_portable(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                       const float* sx, int64_t nb, int64_t K, int64_t R, float* out, int64_t ldo) {
  group_portable(R, nb, out, ldo, [&](float acc, int64_t r, int lane, int64_t b) {
    const int8_t* xb = qx + r * K + b * QK;
    int dot = 0;
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = static_cast<uint32_t>(pw[(b * 4 + j) * G8 + lane]);
      for (int e = 0; e < 4; ++e) {
        const int byte = (w >> (8 * e)) & 0xFF;
        dot += (byte & 0x0F) * xb[4 * j + e] + (byte >> 4) * xb[16 + 4 * j + e];
      }
    }
    acc = std::fma(static_cast<float>(dot), d8[b * G8 + lane] * dx[r * nb + b], acc);
    return std::fma(m8[b * G8 + lane], sx[r * nb + b], acc);
  });
}

template <int S, bool A>
void group_q8_portable(const int32_t* pw, const float* d8, const float* m8, const int8_t* qx, const float* dx,
                       const float* ss, int64_t nb, int64_t K, int64_t R, float* out, int64_t ldo) {
  group_portable(R, nb, out, ldo, [&](float acc, int64_t r, int lane, int64_t b) {
    const int8_t* xb = qx + r * K + b * QK;
    int dot[S] = {};
    for (int j = 0; j < 8; ++j) {
      const int32_t w = pw[(b * 8 + j) * G8 + lane];
      for (int e = 0; e < 4; ++e) dot[j * S / 8] += static_cast<int8_t>((w >> (8 * e)) & 0xFF) * xb[4 * j + e];
    }
    for (int h = 0; h < S; ++h) {
      acc = std::fma(static_cast<float>(dot[h]), d8[(b * S + h) * G8 + lane] * dx[r * nb + b], acc);
      if constexpr (A) acc = std::fma(m8[(b * S + h) * G8 + lane], ss[(r * nb + b) * S + h], acc);
    }
    return acc;
  });
}

// Dense float weights; K % 8 == 0 (checked by the caller).
void dot_f32(const float* w, const float* x, int64_t K, int64_t r0, int64_t r1, float* out, int64_t N) {
  for (int64_t r = r0; r < r1; ++r) out[r * N] = dot8(w, x + r * K, K);
}

struct QuantizedRows {
  torch::Tensor qx, dx, sx, sh;  // [M, K] int8, [M, K/32], [M, K/32], [M, K/16] (empty unless asked for)
};

QuantizedRows quantize_rows(const torch::Tensor& x, bool half_sums = false) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedRows q{torch::empty({M, K}, torch::kInt8), torch::empty({M, K / QK}, torch::kFloat),
                  torch::empty({M, K / QK}, torch::kFloat),
                  torch::empty({half_sums ? M : 0, 2 * K / QK}, torch::kFloat)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.qx.data_ptr<int8_t>();
  float *dp = q.dx.data_ptr<float>(), *sp = q.sx.data_ptr<float>();
  float* hp = half_sums ? q.sh.data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < M; ++r)
    quantize_row(xp + r * K, K, qp + r * K, dp + r * (K / QK), sp + r * (K / QK),
                 hp != nullptr ? hp + r * 2 * (K / QK) : nullptr);
  return q;
}

void check_x(const torch::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float [M, K]");
  TORCH_CHECK(x.size(1) == K && K % multiple == 0, "x has ", x.size(1), " columns, the weight ", K);
}

// S: scales per block (q8 may have 2, one per half block)
void check_groups(const torch::Tensor& pw, const torch::Tensor& d8, int64_t words, int64_t N, int64_t S = 1) {
  TORCH_CHECK(pw.dim() == 4 && pw.scalar_type() == torch::kInt && pw.size(2) == words && pw.size(3) == G8 &&
                  pw.is_contiguous(), "weights must be interleaved int32 [G, nb, ", words, ", 8]");
  TORCH_CHECK(d8.dim() == 3 && d8.size(0) == pw.size(0) && d8.size(1) == pw.size(1) * S && d8.size(2) == G8 &&
                  d8.scalar_type() == torch::kFloat && d8.is_contiguous(), "scales must be float [G, nb * ", S, ", 8]");
  TORCH_CHECK(N > (pw.size(0) - 1) * G8 && N <= pw.size(0) * G8, N, " rows do not fill ", pw.size(0), " groups");
}

// All outputs [M, N] by weight groups: group(g, r, R, out, ldo) computes the 8 outputs of group g for rows
// r..r+R-1 (R <= ROWS). Work is split over groups only; within a thread's groups, activation rows go in tiles of
// 16 so that a tile's quantized rows stay in L1 while the groups stream past, and each group's weights are
// reused for the tile's ROWS-row steps. The last group, when N is not a multiple of 8, writes through a buffer.
template <typename Group>
torch::Tensor run_groups(int64_t M, int64_t N, Group group) {
  constexpr int64_t TILE = 16;
  auto out = torch::empty({M, N}, torch::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t G = (N + G8 - 1) / G8;
  parallel_chunks(0, G, 2, [&](int64_t lo, int64_t hi) {
    for (int64_t r0 = 0; r0 < M; r0 += TILE)
      for (int64_t g = lo; g < hi; ++g)
        for (int64_t r = r0; r < std::min(M, r0 + TILE); r += ROWS) {
          const int64_t R = std::min<int64_t>(ROWS, M - r), n = g * G8;
          if (n + G8 <= N) {
            group(g, r, R, op + r * N + n, N);
          } else {
            float part[ROWS * G8];
            group(g, r, R, part, G8);
            for (int64_t i = 0; i < R; ++i) std::copy(part + i * G8, part + i * G8 + (N - n), op + (r + i) * N + n);
          }
        }
  });
  return out;
}

// Dense rows by weight row, activation rows in tiles of 16 (a weight row read once per tile).
template <typename Dot>
torch::Tensor run(int64_t M, int64_t N, Dot dot) {
  constexpr int64_t TILE = 16;
  auto out = torch::empty({M, N}, torch::kFloat);
  float* op = out.data_ptr<float>();
  parallel_chunks(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r0 = 0; r0 < M; r0 += TILE)
      for (int64_t n = lo; n < hi; ++n) dot(n, r0, std::min(M, r0 + TILE), op + n);
  });
  return out;
}

}  // namespace

// x [M, K] float; pw [G, K/32, 4, 8] int32, d8, m8 [G, K/32, 8] float (interleaved, model/quant.py); N rows
// -> [M, N] float
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor pw, torch::Tensor d8, torch::Tensor m8, int64_t N) {
  const int64_t nb = pw.size(1), K = nb * QK;
  check_x(x, K, QK);
  check_groups(pw, d8, 4, N);
  TORCH_CHECK(m8.sizes() == d8.sizes() && m8.scalar_type() == torch::kFloat && m8.is_contiguous(), "bad offsets");
  auto q = quantize_rows(x);
  const int32_t* w = pw.data_ptr<int32_t>();
  const float *dp = d8.data_ptr<float>(), *mp = m8.data_ptr<float>();
  const int8_t* qx = q.qx.data_ptr<int8_t>();
  const float *dx = q.dx.data_ptr<float>(), *sx = q.sx.data_ptr<float>();
  auto one = [&](int64_t g, int64_t r, int64_t R, float* o, int64_t ldo) {
    const int32_t* gw = w + g * nb * 4 * G8;
    const float *gd = dp + g * nb * G8, *gm = mp + g * nb * G8;
#if defined(ES_VNNI)
    by_rows(R, [&](auto Rc) {
      group_q4_vnni<decltype(Rc)::value>(gw, gd, gm, qx + r * K, dx + r * nb, sx + r * nb, nb, K, o, ldo);
    });
#elif defined(ES_AVX2)
    by_rows(R, [&](auto Rc) {
      group_q4<decltype(Rc)::value>(gw, gd, gm, qx + r * K, dx + r * nb, sx + r * nb, nb, K, o, ldo);
    });
#else
    group_q4_portable(gw, gd, gm, qx + r * K, dx + r * nb, sx + r * nb, nb, K, R, o, ldo);
#endif
  };
  return run_groups(x.size(0), N, one);
}

// a scale per block (S = 1) or per half block (S = 2) of an interleaved q8 weight, from its scales' shape
int64_t q8_scales(const torch::Tensor& pw, const torch::Tensor& d8) {
  TORCH_CHECK(pw.dim() == 4 && d8.dim() == 3 && pw.size(1) > 0, "interleaved q8 weight expected");
  const int64_t S = d8.size(1) / pw.size(1);
  TORCH_CHECK(S == 1 || S == 2, "q8 scales must be one per block or one per half block");
  return S;
}

// x [M, K] float; pw [G, K/32, 8, 8] int32, d8 [G, K/32 * S, 8] float (S = 1 or 2), m8 like d8 or none (affine);
// N rows -> [M, N] float
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor pw, torch::Tensor d8, c10::optional<torch::Tensor> m8,
                        int64_t N) {
  const int64_t nb = pw.size(1), K = nb * QK, S = q8_scales(pw, d8);
  check_x(x, K, QK);
  check_groups(pw, d8, 8, N, S);
  TORCH_CHECK(!m8.has_value() || (m8->sizes() == d8.sizes() && m8->scalar_type() == torch::kFloat &&
                                  m8->is_contiguous()), "offsets must be float, shaped as the scales");
  auto q = quantize_rows(x, S == 2 && m8.has_value());  // offsets per half block read the sums per half
  const int32_t* w = pw.data_ptr<int32_t>();
  const float *dp = d8.data_ptr<float>(), *mp = m8.has_value() ? m8->data_ptr<float>() : nullptr;
  const int8_t* qx = q.qx.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
  const float* ss = (S == 2 && mp ? q.sh : q.sx).data_ptr<float>();  // the activations' sums per offset
#ifdef ES_VNNI
  std::vector<uint8_t> shifted(q.qx.numel());  // qx + 128 as unsigned bytes (group_q8_vnni says why)
  for (size_t i = 0; i < shifted.size(); ++i) shifted[i] = static_cast<uint8_t>(qx[i]) ^ 0x80;
  const uint8_t* ux = shifted.data();
#endif
  auto one = [&](int64_t g, int64_t r, int64_t R, float* o, int64_t ldo) {
    const int32_t* gw = w + g * nb * 8 * G8;
    const float *gd = dp + g * nb * S * G8, *gm = mp ? mp + g * nb * S * G8 : nullptr;
    auto kernel = [&](auto Sc, auto Ac) {
      constexpr int SS = decltype(Sc)::value;
      constexpr bool AA = decltype(Ac)::value;
#if defined(ES_VNNI)
      by_rows(R, [&](auto Rc) {
        group_q8_vnni<decltype(Rc)::value, SS, AA>(gw, gd, gm, ux + r * K, dx + r * nb, ss + r * nb * SS, nb, K, o,
                                                   ldo);
      });
#elif defined(ES_AVX2)
      by_rows(R, [&](auto Rc) {
        group_q8<decltype(Rc)::value, SS, AA>(gw, gd, gm, qx + r * K, dx + r * nb, ss + r * nb * SS, nb, K, o, ldo);
      });
#else
      group_q8_portable<SS, AA>(gw, gd, gm, qx + r * K, dx + r * nb, ss + r * nb * SS, nb, K, R, o, ldo);
#endif
    };
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    using Yes = std::true_type;
    using No = std::false_type;
    if (S == 2) gm ? kernel(Two{}, Yes{}) : kernel(Two{}, No{});
    else gm ? kernel(One{}, Yes{}) : kernel(One{}, No{});
  };
  return run_groups(x.size(0), N, one);
}

// x [M, K] float; w [N, K] float -> [M, N] float
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K, 8);
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) { dot_f32(wp + n * K, xp, K, r0, r1, o, N); });
}

// Rows ids [n] of an interleaved q8 matrix as floats [n, K], d q in float32 (a tied embedding's lookup: the
// same values as the plain matrix's, without a second copy of the table)
torch::Tensor q8_rows(torch::Tensor pw, torch::Tensor d8, c10::optional<torch::Tensor> m8, torch::Tensor ids) {
  const int64_t S = q8_scales(pw, d8);
  check_groups(pw, d8, 8, pw.size(0) * G8, S);
  TORCH_CHECK(!m8.has_value() || m8->sizes() == d8.sizes(), "offsets must be shaped as the scales");
  const float* mp = m8.has_value() ? m8->data_ptr<float>() : nullptr;
  ids = ids.to(torch::kLong).contiguous();
  const int64_t nb = pw.size(1), n = ids.numel(), G = pw.size(0);
  auto out = torch::empty({n, nb * QK}, torch::kFloat);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int8_t* w = reinterpret_cast<const int8_t*>(pw.data_ptr<int32_t>());
  const float* dp = d8.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ip[i] / G8, lane = ip[i] % G8;
    TORCH_CHECK(ip[i] >= 0 && g < G, "row ", ip[i], " is out of range");
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) {
          const int64_t at = ((g * nb + b) * S + j * S / 8) * G8 + lane;
          const float v = static_cast<float>(w[(((g * nb + b) * 8 + j) * G8 + lane) * 4 + e]) * dp[at];
          op[i * nb * QK + b * QK + 4 * j + e] = mp ? v + mp[at] : v;
        }
  }
  return out;
}
