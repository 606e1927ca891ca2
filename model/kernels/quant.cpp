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

constexpr int TILE = 16;  // activation rows that share one unpacking of a weight block

// Outputs (r, n) for rows r of [r0, r1) (at most TILE) of the q4 kernel: weight row qw (16 bytes of nibbles
// per block: element i is the low nibble of byte i, element i + 16 the high nibble), its block scales d and
// offsets m; activation rows quantized as above. A weight block is unpacked once for all the tile's rows.
// Each output keeps its own 8 float lanes and its own offset sum, updated block by block in one fixed
// order whatever r0 and r1 are. (Four weight rows at once, to hide the fma latency, measured no faster at
// one row and 1.9x slower at 8 on an AVX2 EPYC.)
void dot_q4(const uint8_t* qw, const float* d, const float* m, const int8_t* qx, const float* dx,
            const float* sx, int64_t nb, int64_t K, int64_t r0, int64_t r1, float* out, int64_t N) {
  float offs[TILE] = {};
#ifdef ES_AVX2
  __m256 acc[TILE];
  for (int64_t r = r0; r < r1; ++r) acc[r - r0] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + b * 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);  // 32 x 0..15
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r * nb + b;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * QK));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  // 8 lanes, 4 products each
      acc[r - r0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b] * dx[i]), acc[r - r0]);
      offs[r - r0] = std::fma(m[b], sx[i], offs[r - r0]);
    }
  }
  for (int64_t r = r0; r < r1; ++r) out[r * N] = reduce8(acc[r - r0]) + offs[r - r0];
#else
  float acc[TILE][8] = {};
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
#endif
}

// The same for q8 weights (32 int8 per block, w = d q).
void dot_q8(const int8_t* qw, const float* d, const int8_t* qx, const float* dx, int64_t nb, int64_t K,
            int64_t r0, int64_t r1, float* out, int64_t N) {
#ifdef ES_AVX2
  __m256 acc[TILE];
  for (int64_t r = r0; r < r1; ++r) acc[r - r0] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * QK));
    const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (w = -128 never occurs: |q| <= 127)
    for (int64_t r = r0; r < r1; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * QK));
      // signed x signed through maddubs: |w| times x with w's sign
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), ones);
      acc[r - r0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[b] * dx[r * nb + b]), acc[r - r0]);
    }
  }
  for (int64_t r = r0; r < r1; ++r) out[r * N] = reduce8(acc[r - r0]);
#else
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
#endif
}

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
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) {
    dot_q4(w + n * (K / 2), dp + n * nb, mp + n * nb, qx, dx, sx, nb, K, r0, r1, o, N);
  });
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
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) {
    dot_q8(w + n * K, dp + n * nb, qx, dx, nb, K, r0, r1, o, N);
  });
}

// x [M, K] float; w [N, K] float -> [M, N] float
torch::Tensor f32_matmul(torch::Tensor x, torch::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K, 8);
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) { dot_f32(wp + n * K, xp, K, r0, r1, o, N); });
}

