// Row-invariant CPU matmuls over block-quantized weights: the passes over weight groups, threads and tiles of
// activation rows; groups.h holds the kernels of one group (its header says the scheme and why every path gives
// the same bits), simd.h which path this build compiles.
#include "common.h"
#include "groups.h"

namespace {

using groups::G8;
using groups::QK;
using groups::ROWS;

// Dense float weights; K % 8 == 0 (checked by the caller).
void dot_f32(const float* w, const float* x, int64_t K, int64_t r0, int64_t r1, float* out, int64_t N) {
  for (int64_t r = r0; r < r1; ++r) out[r * N] = dot8(w, x + r * K, K);
}

struct QuantizedRows {
  // tiles of ROWS rows as the group kernels read them (groups.h), M rounded up to a whole tile: [Mt, K] int8,
  // [Mt, K/32], [Mt, K/32], [Mt, K/16] (empty unless asked for); the rows after M are zeros in the floats
  at::Tensor qx, dx, sx, sh;
};

QuantizedRows quantize_rows(const at::Tensor& x, bool half_sums = false) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK, Mt = (M + ROWS - 1) / ROWS * ROWS;
  // The AMX kernels' float steps run for the tile's rows rounded up to an even count (groups_amx.h), so they
  // read the scales and sums of a row after M (into an output never stored). Left as the allocator gave them,
  // those often held an earlier pass's int8 bytes, which read as floats are denormals, and every fma on one took
  // a microcode assist: when the float steps ran for 16 rows, the served model's batch steps of 10 to 15
  // sequences took 20.7-35.0 ms against 12.3-20.4 with zeros, alternated (bench/results/issue39-tile-padding).
  auto floats = [&](int64_t rows, int64_t cols) {
    return Mt == M ? at::empty({rows, cols}, at::kFloat) : at::zeros({rows, cols}, at::kFloat);
  };
  QuantizedRows q{at::empty({Mt, K}, at::kChar), floats(Mt, nb), floats(Mt, nb), floats(half_sums ? Mt : 0, 2 * nb)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.qx.data_ptr<int8_t>();
  float *dp = q.dx.data_ptr<float>(), *sp = q.sx.data_ptr<float>();
  float* hp = half_sums ? q.sh.data_ptr<float>() : nullptr;
  // rows on the pool's threads in chunks of 16 (a decode pass's few rows stay on this one: waking a thread costs
  // more than quantizing them); each row on its own, so the split changes no bits
  parallel_chunks(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t at = r / ROWS * ROWS * nb + r % ROWS;  // the row's first block in its tile, in blocks
      groups::quantize_row(xp + r * K, K, qp + at * QK, dp + at, sp + at, hp != nullptr ? hp + 2 * at : nullptr,
                           ROWS);
    }
  });
  return q;
}

void check_x(const at::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float [M, K]");
  TORCH_CHECK(x.size(1) == K && K % multiple == 0, "x has ", x.size(1), " columns, the weight ", K);
}

// S: scales per block (q8 may have 2, one per half block)
void check_groups(const at::Tensor& pw, const at::Tensor& d8, int64_t words, int64_t N, int64_t S = 1) {
  TORCH_CHECK(pw.dim() == 4 && pw.scalar_type() == at::kInt && pw.size(2) == words && pw.size(3) == G8 &&
                  pw.is_contiguous(), "weights must be interleaved int32 [G, nb, ", words, ", 8]");
  TORCH_CHECK(d8.dim() == 3 && d8.size(0) == pw.size(0) && d8.size(1) == pw.size(1) * S && d8.size(2) == G8 &&
                  d8.scalar_type() == at::kFloat && d8.is_contiguous(), "scales must be float [G, nb * ", S, ", 8]");
  TORCH_CHECK(N > (pw.size(0) - 1) * G8 && N <= pw.size(0) * G8, N, " rows do not fill ", pw.size(0), " groups");
}

// All outputs [M, N] by weight groups: group(g, G, r, R, out, ldo, tiles) computes the 8 G outputs of groups
// g..g+G-1 (G = 1, or groups::WIDE where they are whole) for rows r..r+R-1 (R <= ROWS, r a multiple of ROWS: one
// tile of quantize_rows'); `tiles` the AMX tiles for dots of `tile_k` bytes, loaded by each thread for its share of
// the pass where the build has them (groups_amx.h). Work is split over units of WIDE groups only; within a
// thread's units, activation rows go in runs of 16 so that a run's quantized rows stay in L1 while the groups
// stream past, and each unit's weights are reused for the run's ROWS-row steps. A unit past N's last whole groups
// goes group by group, the last one, when N is not a multiple of 8, through a buffer.
template <typename Group>
at::Tensor run_groups(int64_t M, int64_t N, int tile_k, Group group) {
  constexpr int64_t RUN = 16, W = groups::WIDE;
  auto out = at::empty({M, N}, at::kFloat);
  float* op = out.data_ptr<float>();
  const int64_t G = (N + G8 - 1) / G8;
  parallel_chunks(0, (G + W - 1) / W, std::max<int64_t>(1, 2 / W), [&](int64_t lo, int64_t hi) {
    const groups::Tiles tiles(tile_k, M);
    for (int64_t r0 = 0; r0 < M; r0 += RUN)
      for (int64_t u = lo; u < hi; ++u)
        for (int64_t r = r0; r < std::min(M, r0 + RUN); r += ROWS) {
          const int64_t R = std::min<int64_t>(ROWS, M - r);
          if ((u + 1) * W * G8 <= N) {
            group(u * W, W, r, R, op + r * N + u * W * G8, N, tiles);
            continue;
          }
          for (int64_t g = u * W; g < std::min(G, (u + 1) * W); ++g) {
            const int64_t n = g * G8;
            if (n + G8 <= N) {
              group(g, 1, r, R, op + r * N + n, N, tiles);
            } else {
              float part[ROWS * G8];
              group(g, 1, r, R, part, G8, tiles);
              for (int64_t i = 0; i < R; ++i) std::copy(part + i * G8, part + i * G8 + (N - n), op + (r + i) * N + n);
            }
          }
        }
  });
  return out;
}

// Dense rows by weight row, activation rows in tiles of 16 (a weight row read once per tile).
template <typename Dot>
at::Tensor run(int64_t M, int64_t N, Dot dot) {
  constexpr int64_t TILE = 16;
  auto out = at::empty({M, N}, at::kFloat);
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
at::Tensor q4_matmul(at::Tensor x, at::Tensor pw, at::Tensor d8, at::Tensor m8, int64_t N) {
  const int64_t nb = pw.size(1), K = nb * QK;
  check_x(x, K, QK);
  check_groups(pw, d8, 4, N);
  TORCH_CHECK(m8.sizes() == d8.sizes() && m8.scalar_type() == at::kFloat && m8.is_contiguous(), "bad offsets");
  auto q = quantize_rows(x);
  const int32_t* w = pw.data_ptr<int32_t>();
  const float *dp = d8.data_ptr<float>(), *mp = m8.data_ptr<float>();
  const int8_t* qx = q.qx.data_ptr<int8_t>();
  const float *dx = q.dx.data_ptr<float>(), *sx = q.sx.data_ptr<float>();
  auto one = [&](int64_t g, int G, int64_t r, int64_t R, float* o, int64_t ldo, const groups::Tiles& tiles) {
    groups::q4_group(w + g * nb * 4 * G8, dp + g * nb * G8, mp + g * nb * G8, qx + r * K, dx + r * nb, sx + r * nb, nb,
                     R, o, ldo, tiles, G);
  };
  return run_groups(x.size(0), N, QK, one);
}

// a scale per block (S = 1) or per half block (S = 2) of an interleaved q8 weight, from its scales' shape
int64_t q8_scales(const at::Tensor& pw, const at::Tensor& d8) {
  TORCH_CHECK(pw.dim() == 4 && d8.dim() == 3 && pw.size(1) > 0, "interleaved q8 weight expected");
  const int64_t S = d8.size(1) / pw.size(1);
  TORCH_CHECK(S == 1 || S == 2, "q8 scales must be one per block or one per half block");
  return S;
}

// x [M, K] float; pw [G, K/32, 8, 8] int32, d8 [G, K/32 * S, 8] float (S = 1 or 2), m8 like d8 or none (affine);
// N rows -> [M, N] float
at::Tensor q8_matmul(at::Tensor x, at::Tensor pw, at::Tensor d8, c10::optional<at::Tensor> m8,
                     int64_t N) {
  const int64_t nb = pw.size(1), K = nb * QK, S = q8_scales(pw, d8);
  check_x(x, K, QK);
  check_groups(pw, d8, 8, N, S);
  TORCH_CHECK(!m8.has_value() || (m8->sizes() == d8.sizes() && m8->scalar_type() == at::kFloat &&
                                  m8->is_contiguous()), "offsets must be float, shaped as the scales");
  auto q = quantize_rows(x, S == 2 && m8.has_value());  // offsets per half block read the sums per half
  const int32_t* w = pw.data_ptr<int32_t>();
  const float *dp = d8.data_ptr<float>(), *mp = m8.has_value() ? m8->data_ptr<float>() : nullptr;
  const int8_t* qx = q.qx.data_ptr<int8_t>();
  const float* dx = q.dx.data_ptr<float>();
  const float* ss = (S == 2 && mp ? q.sh : q.sx).data_ptr<float>();  // the activations' sums per offset
  const std::vector<uint8_t> ux = groups::q8_activations(qx, q.qx.numel());
  auto one = [&](int64_t g, int G, int64_t r, int64_t R, float* o, int64_t ldo, const groups::Tiles& tiles) {
    const int32_t* gw = w + g * nb * 8 * G8;
    const float *gd = dp + g * nb * S * G8, *gm = mp ? mp + g * nb * S * G8 : nullptr;
    const uint8_t* gu = ux.empty() ? nullptr : ux.data() + r * K;
    auto kernel = [&](auto Sc, auto Ac) {
      constexpr int SS = decltype(Sc)::value;
      groups::q8_group<SS, decltype(Ac)::value>(gw, gd, gm, qx + r * K, gu, dx + r * nb, ss + r * nb * SS, nb, R, o,
                                                ldo, tiles, G);
    };
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    using Yes = std::true_type;
    using No = std::false_type;
    if (S == 2) gm ? kernel(Two{}, Yes{}) : kernel(Two{}, No{});
    else gm ? kernel(One{}, Yes{}) : kernel(One{}, No{});
  };
  return run_groups(x.size(0), N, static_cast<int>(QK / S), one);
}

// x [M, K] float; w [N, K] float -> [M, N] float
at::Tensor f32_matmul(at::Tensor x, at::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1);
  check_x(x, K, 8);
  const float *wp = w.data_ptr<float>(), *xp = x.data_ptr<float>();
  return run(x.size(0), N, [&](int64_t n, int64_t r0, int64_t r1, float* o) { dot_f32(wp + n * K, xp, K, r0, r1, o, N); });
}

// Rows ids [n] of an interleaved q8 matrix as floats [n, K], d q in float32 (a tied embedding's lookup: the
// same values as the plain matrix's, without a second copy of the table)
at::Tensor q8_rows(at::Tensor pw, at::Tensor d8, c10::optional<at::Tensor> m8, at::Tensor ids) {
  const int64_t S = q8_scales(pw, d8);
  check_groups(pw, d8, 8, pw.size(0) * G8, S);
  TORCH_CHECK(!m8.has_value() || m8->sizes() == d8.sizes(), "offsets must be shaped as the scales");
  const float* mp = m8.has_value() ? m8->data_ptr<float>() : nullptr;
  ids = ids.to(at::kLong).contiguous();
  const int64_t nb = pw.size(1), n = ids.numel(), G = pw.size(0);
  auto out = at::empty({n, nb * QK}, at::kFloat);
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
