// Row-invariant CPU matmuls over block-quantized weights (llama.cpp's scheme, our own code).
//
// Activations are quantized per row to int8 in blocks of 32 (scale dx = max|x| / 127, plus the block's
// sum s = dx * sum(qx)); each output is then a sum over the row's blocks of integer dot products:
//   q4 (Q4_0/Q4_1/Q4_K as w = d q + m, q in 0..15):  y = sum_b d_b dx_b <qw, qx>_b + m_b s_b
//   q8 (Q8_0 as w = d q, q in -127..127):            y = sum_b d_b dx_b <qw, qx>_b
//   f32 (dense):                                     y = sum_k w_k x_k
// Every output element is computed by one function whose operation order depends only on K, never on how
// many rows the pass has or which thread runs it, so a position's result is bitwise the same alone, in a
// verification pass or in a batch of rows (docs: "exact in the served format"). The AVX2 path and the
// portable path keep the same 8 float lanes and the same final reduction, with explicit fma, so they agree
// too (built with -ffp-contract=off).
#include "common.h"

namespace {

constexpr int QK = 32;  // elements per quantization block

// x [K] float -> qx [K] int8, dx [K/32], sx [K/32] (sx = dx * sum of the block's qx)
void quantize_row(const float* x, int64_t K, int8_t* qx, float* dx, float* sx) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < QK; ++i) {
      const int q = static_cast<int>(std::nearbyint(xb[i] * id));
      qx[b * QK + i] = static_cast<int8_t>(q);
      sum += q;
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
  }
}

constexpr int TILE = 16;  // activation rows per call of a dot function (the caller's chunk of the pass)

#ifdef ES_AVX2
// Outputs (r, n) of the q4 kernel for W consecutive weight rows and R consecutive activation rows: weight
// rows qw (16 bytes of nibbles per block, rows K/2 bytes apart: element i is the low nibble of byte i,
// element i + 16 the high nibble), their block scales d and offsets m (rows nb apart); activation rows
// quantized as above. A weight block is unpacked once for all R rows. W and R are compile-time counts so the
// accumulators stay in registers: a runtime count of up to 16 rows kept them in memory, which measured
// 1.3-1.6x slower at every M on an AVX2 EPYC (3072x576: 140 -> 86 us at one row, 487 -> 389 at eight). Each
// output keeps its own 8 float lanes and its own offset sum, updated block by block in one fixed order
// whatever W and R are: W only interleaves independent outputs, so that one activation row has W fma chains
// in flight instead of one (one row: 84 -> 61 us, bit for bit the same).
template <int W, int R>
void dot_q4_tile(const uint8_t* qw, const float* d, const float* m, const int8_t* qx, const float* dx,
                 const float* sx, int64_t nb, int64_t K, float* out, int64_t N) {
  __m256 acc[W][R];
  float offs[W][R];
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = _mm256_setzero_ps(), offs[w][r] = 0.f;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[W];
    for (int w = 0; w < W; ++w) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + w * (K / 2) + b * 16));
      wv[w] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);  // 32 x 0..15
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * QK));
      const float dxr = dx[r * nb + b], sxr = sx[r * nb + b];
      for (int w = 0; w < W; ++w) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[w], x), ones);  // 8 lanes, 4 products each
        acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[w * nb + b] * dxr), acc[w][r]);
        offs[w][r] = std::fma(m[w * nb + b], sxr, offs[w][r]);
      }
    }
  }
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) out[r * N + w] = reduce8(acc[w][r]) + offs[w][r];
}

// The same for q8 weights (32 int8 per block, w = d q; rows K bytes apart).
template <int W, int R>
void dot_q8_tile(const int8_t* qw, const float* d, const int8_t* qx, const float* dx, int64_t nb, int64_t K,
                 float* out, int64_t N) {
  __m256 acc[W][R];
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[W], aw[W];
    for (int w = 0; w < W; ++w) {
      wv[w] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + w * K + b * QK));
      aw[w] = _mm256_sign_epi8(wv[w], wv[w]);  // |w| (w = -128 never occurs: |q| <= 127)
    }
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * QK));
      const float dxr = dx[r * nb + b];
      for (int w = 0; w < W; ++w) {
        // signed x signed through maddubs: |w| times x with w's sign
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[w], _mm256_sign_epi8(x, wv[w])), ones);
        acc[w][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[w * nb + b] * dxr), acc[w][r]);
      }
    }
  }
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) out[r * N + w] = reduce8(acc[w][r]);
}

template <int V>
using I = std::integral_constant<int, V>;

// All outputs [M, N] by tiles: activation rows in chunks of up to 4; weight rows in groups of 4 for a chunk of
// one row and of 2 for two (more fma chains in flight), single for 3-4 (where the rows already give 3-4
// chains: measured, pairs of weight rows were up to 10% slower there). tile(W, R, n, r, out) computes the
// tile at weight row n and activation row r. Work is split over weight rows only.
template <typename Tile>
torch::Tensor run_tiles(int64_t M, int64_t N, Tile tile) {
  auto out = torch::empty({M, N}, torch::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = 0; r < M; r += 4) {
      const int64_t R = std::min<int64_t>(4, M - r);
      float* o = op + r * N;
      int64_t n = lo;
      if (R == 1)
        for (; n + 4 <= hi; n += 4) tile(I<4>{}, I<1>{}, n, r, o + n);
      else if (R == 2)
        for (; n + 2 <= hi; n += 2) tile(I<2>{}, I<2>{}, n, r, o + n);
      for (; n < hi; ++n) {
        switch (R) {
          case 1: tile(I<1>{}, I<1>{}, n, r, o + n); break;
          case 2: tile(I<1>{}, I<2>{}, n, r, o + n); break;
          case 3: tile(I<1>{}, I<3>{}, n, r, o + n); break;
          default: tile(I<1>{}, I<4>{}, n, r, o + n);
        }
      }
    }
  });
  return out;
}
#else
// The portable kernels: the same arithmetic per output as the tiles above (8 float lanes of 4 products
// each, fma, the same reduction), rows [r0, r1) of one weight row.
void dot_q4(const uint8_t* qw, const float* d, const float* m, const int8_t* qx, const float* dx,
            const float* sx, int64_t nb, int64_t K, int64_t r0, int64_t r1, float* out, int64_t N) {
  float acc[TILE][8] = {}, offs[TILE] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = qw + b * 16;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r * nb + b;
      const int8_t* xb = qx + r * K + b * QK;
      const float scale = d[b] * dx[i];
      for (int lane = 0; lane < 8; ++lane) {
        int s = 0;
        for (int j = 4 * lane; j < 4 * lane + 4; ++j) s += (j < 16 ? (wb[j] & 0x0F) : (wb[j - 16] >> 4)) * xb[j];
        acc[r - r0][lane] = std::fma(static_cast<float>(s), scale, acc[r - r0][lane]);
      }
      offs[r - r0] = std::fma(m[b], sx[i], offs[r - r0]);
    }
  }
  for (int64_t r = r0; r < r1; ++r) out[r * N] = reduce8(acc[r - r0]) + offs[r - r0];
}

void dot_q8(const int8_t* qw, const float* d, const int8_t* qx, const float* dx, int64_t nb, int64_t K,
            int64_t r0, int64_t r1, float* out, int64_t N) {
  float acc[TILE][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t r = r0; r < r1; ++r) {
      const float scale = d[b] * dx[r * nb + b];
      for (int lane = 0; lane < 8; ++lane) {
        int s = 0;
        for (int j = 4 * lane; j < 4 * lane + 4; ++j) s += qw[b * QK + j] * qx[r * K + b * QK + j];
        acc[r - r0][lane] = std::fma(static_cast<float>(s), scale, acc[r - r0][lane]);
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) out[r * N] = reduce8(acc[r - r0]);
}
#endif

// Dense float weights; K % 8 == 0 (checked by the caller).
void dot_f32(const float* w, const float* x, int64_t K, int64_t r0, int64_t r1, float* out, int64_t N) {
  for (int64_t r = r0; r < r1; ++r) out[r * N] = dot8(w, x + r * K, K);
}

struct QuantizedRows {
  torch::Tensor qx, dx, sx;  // [M, K] int8, [M, K/32], [M, K/32]
};

QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedRows q{torch::empty({M, K}, torch::kInt8), torch::empty({M, K / QK}, torch::kFloat),
                  torch::empty({M, K / QK}, torch::kFloat)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.qx.data_ptr<int8_t>();
  float *dp = q.dx.data_ptr<float>(), *sp = q.sx.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) quantize_row(xp + r * K, K, qp + r * K, dp + r * (K / QK), sp + r * (K / QK));
  return q;
}

void check_x(const torch::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float [M, K]");
  TORCH_CHECK(x.size(1) == K && K % multiple == 0, "x has ", x.size(1), " columns, the weight ", K);
}

// Outputs are grouped by weight row: a weight row is read from memory once per tile of activation rows and
// reused for all of them while it sits in L1. Work is split over weight rows only.
template <typename Dot>
torch::Tensor run(int64_t M, int64_t N, Dot dot) {
  auto out = torch::empty({M, N}, torch::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r0 = 0; r0 < M; r0 += TILE)
      for (int64_t n = lo; n < hi; ++n) dot(n, r0, std::min(M, r0 + TILE), op + n);
  });
  return out;
}

}  // namespace

// x [M, K] float; qw [N, K/2] uint8; d, m [N, K/32] float -> [M, N] float
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor qw, torch::Tensor d, torch::Tensor m) {
  const int64_t N = qw.size(0), K = qw.size(1) * 2, nb = K / QK;
  check_x(x, K, QK);
  auto q = quantize_rows(x);
  const uint8_t* w = qw.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  const int8_t* qx = q.qx.data_ptr<int8_t>();
  const float *dx = q.dx.data_ptr<float>(), *sx = q.sx.data_ptr<float>();
#ifdef ES_AVX2
  return run_tiles(x.size(0), N, [&](auto W, auto R, int64_t n, int64_t r, float* o) {
    dot_q4_tile<decltype(W)::value, decltype(R)::value>(w + n * (K / 2), dp + n * nb, mp + n * nb, qx + r * K,
                                                        dx + r * nb, sx + r * nb, nb, K, o, N);
  });
#else
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) {
    dot_q4(w + n * (K / 2), dp + n * nb, mp + n * nb, qx, dx, sx, nb, K, r0, r1, o, N);
  });
#endif
}

// x [M, K] float; qw [N, K] int8; d [N, K/32] float -> [M, N] float
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor qw, torch::Tensor d) {
  const int64_t N = qw.size(0), K = qw.size(1), nb = K / QK;
  check_x(x, K, QK);
  auto q = quantize_rows(x);
  const int8_t* w = qw.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  const int8_t* qx = q.qx.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
#ifdef ES_AVX2
  return run_tiles(x.size(0), N, [&](auto W, auto R, int64_t n, int64_t r, float* o) {
    dot_q8_tile<decltype(W)::value, decltype(R)::value>(w + n * K, dp + n * nb, qx + r * K, dx + r * nb, nb, K, o,
                                                        N);
  });
#else
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) {
    dot_q8(w + n * K, dp + n * nb, qx, dx, nb, K, r0, r1, o, N);
  });
#endif
}

// x [M, K] float; w [N, K] float -> [M, N] float
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K, 8);
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) { dot_f32(wp + n * K, xp, K, r0, r1, o, N); });
}

