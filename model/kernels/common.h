// Shared by the kernels: includes, the SIMD switch (simd.h), and the one fixed reduction of 8 float lanes.
#pragma once
// ATen's tensor and the few factories the kernels call, not <torch/extension.h>: parsing that (all of libtorch's
// C++ API and pybind11) took 30 s of each file's compile here against 4.5 s for these; only bind.cpp needs Python.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>
#include "simd.h"

// ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)): the order the _mm256 reduction below uses
inline float reduce8(const float* a) {
  float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

#ifdef ES_AVX2
inline float reduce8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // t0..t3
  __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));                                  // t0+t2, t1+t3
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
#endif

// <a, b> over n floats (n % 8 == 0): lane j sums elements j, j + 8, ... with fma, then reduce8
inline float dot8(const float* a, const float* b, int64_t n) {
#ifdef ES_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  return reduce8(acc);
#else
  float acc[8] = {};
  for (int64_t k = 0; k < n; k += 8)
    for (int lane = 0; lane < 8; ++lane) acc[lane] = std::fma(a[k + lane], b[k + lane], acc[lane]);
  return reduce8(acc);
#endif
}

// out = w * (x / sqrt(mean(x^2) + eps)) over one row of n floats (n % 8 == 0): rms_norm's arithmetic, which
// the attention block repeats on each head's q and k (Qwen3)
inline void rms_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float scale = 1.f / std::sqrt(dot8(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * scale);
}

// y += p * x over n floats (elementwise: every lane is one element, so no order to fix beyond the caller's)
inline void axpy(float* y, const float* x, float p, int64_t n) {
#ifdef ES_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t k = 0; k < n; k += 8)
    _mm256_storeu_ps(y + k, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + k), _mm256_loadu_ps(y + k)));
#else
  for (int64_t k = 0; k < n; ++k) y[k] = std::fma(p, x[k], y[k]);
#endif
}

// e^x for x <= 0 (softmax weights after the max is subtracted), Cephes' expf: x = n ln2 + r with n the
// nearest integer to x log2(e), a degree-5 polynomial for e^r, then times 2^n. One sequence of IEEE operations
// (explicit fma), so the scalar form and the 8-lane form below give the same bits: std::exp, per element,
// took about a third of attention's time over long contexts (a 485-token prompt beside 4 streams).
constexpr float EXP_LO = -87.3f, EXP_LOG2E = 1.44269504088896341f, EXP_C1 = 0.693359375f, EXP_C2 = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_neg(float x) {
  x = std::max(x, EXP_LO);
  const float n = std::nearbyint(x * EXP_LOG2E);
  float r = std::fma(-n, EXP_C1, x);
  r = std::fma(-n, EXP_C2, r);
  float p = EXP_P[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, EXP_P[i]);
  const float y = std::fma(p, r * r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return y * two_n;
}

#ifdef ES_AVX2
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 neg = _mm256_xor_ps(n, _mm256_set1_ps(-0.f));  // -n, as the scalar form negates
  __m256 r = _mm256_fmadd_ps(neg, _mm256_set1_ps(EXP_C1), x);
  r = _mm256_fmadd_ps(neg, _mm256_set1_ps(EXP_C2), r);
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// a[i] = exp_neg(a[i] - m) for i < n, in place
inline void exp_shifted(float* a, float m, int64_t n) {
  int64_t i = 0;
#ifdef ES_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(a + i), mv)));
#endif
  for (; i < n; ++i) a[i] = exp_neg(a[i] - m);
}

// rotate-half rotary of one head vector x [hd] by c, s [hd]: out = x c + rotate_half(x) s (rope's and the
// attention block's one formula)
inline void rotate(const float* x, const float* c, const float* s, int64_t hd, float* out) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; ++i) {
    const float rot = i < half ? -x[i + half] : x[i - half];
    out[i] = x[i] * c[i] + rot * s[i];
  }
}

// fn(lo, hi) over [begin, end) in chunks of at least `grain`, on the torch thread count's worth of the
// kernels' own threads (pool.cpp says why not at::parallel_for); a nested call runs serially
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

at::Tensor q4_matmul(at::Tensor x, at::Tensor pw, at::Tensor d8, at::Tensor m8, int64_t N);
at::Tensor q8_matmul(at::Tensor x, at::Tensor pw, at::Tensor d8, c10::optional<at::Tensor> m8,
                     int64_t N);
at::Tensor f32_matmul(at::Tensor x, at::Tensor w);
at::Tensor q8_rows(at::Tensor pw, at::Tensor d8, c10::optional<at::Tensor> m8, at::Tensor ids);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor add_rows(const at::Tensor& x, const at::Tensor& y);
void add_bias_(at::Tensor& y, const at::Tensor& bias);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start,
                     c10::optional<at::Tensor> mask);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor kv_encode(at::Tensor x, at::Tensor like);

// The keys and values one attention call reads, in blocks: k, v [N, n_kv, BS, row] in a KV storage format
// (kv.h; any strides, last dim contiguous) and table, int64 [trows, nb] row-major (trows 1 or the query rows): row b's slot j is in block
// table[b][j / BS], at offset j % BS. A sequence of a stage's KV pool reads its blocks in place
// (model/kv_pool.py); plain keys [B, n_kv, S, hd] are B blocks of S slots, row b's table [b]. The table is a
// pointer, not a tensor: a view or a conversion per call cost microseconds, times every sequence and layer of
// a step (measured: 16 sequences decoding in one pass were 12% slower with them).
struct Keys {
  at::Tensor k, v;
  const int64_t* table;
  int64_t trows, nb;
};
at::Tensor attend_keys(at::Tensor q, const Keys& keys, int64_t start, c10::optional<at::Tensor> mask);

// One sequence's share of a batch of rows (layer.cpp's attention_rows): its T rows are written at slots
// start..start+T of its blocks (k, v: the pool's [N, n_kv, BS, row] in a KV format (kv.h), contiguous; table int64 [nb]) and attend
// over the slots before them and themselves; mask [1, 1, T, S] or none (causal).
struct SeqKV {
  at::Tensor k, v, table;
  int64_t start, T;
  c10::optional<at::Tensor> mask;
};
at::Tensor attend_seqs(at::Tensor q, const std::vector<SeqKV>& seqs);

// One linear layer in a compiled format (layer.cpp), built once per weight and called per pass.
struct Linear {
  int64_t kind;  // 0 q4, 1 q8, 2 float32, 3 affine q8
  at::Tensor a, b, c;
  c10::optional<at::Tensor> bias;
  int64_t n;  // output rows
  Linear(int64_t kind, at::Tensor a, at::Tensor b, at::Tensor c, c10::optional<at::Tensor> bias,
         int64_t n);
  at::Tensor operator()(const at::Tensor& x) const;
};
// A layer's attention weights (or those of some of its KV groups, a HeadSplit device's): the q/k/v projection
// (n_q + 2 n_kv heads out), the output projection, and Qwen3's RMS norms of each head's q and k before the
// rotary (weights [hd], eps), where the architecture has them.
struct Attn {
  Linear qkv, o;
  int64_t n_q, n_kv;
  c10::optional<at::Tensor> q_norm, k_norm;
  double eps;
};
at::Tensor attention_block(at::Tensor x, const Attn& attn, at::Tensor cos, at::Tensor sin,
                           at::Tensor k, at::Tensor v, at::Tensor table, int64_t start,
                           c10::optional<at::Tensor> mask);
at::Tensor attention_rows(at::Tensor x, const Attn& attn, at::Tensor cos, at::Tensor sin,
                          const std::vector<SeqKV>& seqs);

// A layer's SwiGLU feed-forward (ffn.cpp): dense (one gate_up and one down), or a mixture of experts (a router
// [E, H], experts_per_token of E a row) holding the experts `held` (all of them, or those a device holds of a
// layer whose experts are placed on several: an expert host's have no router). Built once per loaded layer.
struct Ffn {
  std::vector<Linear> gate_up, down;  // the held experts', in `held` order
  c10::optional<Linear> router;
  std::vector<int64_t> held;  // ascending expert ids
  std::vector<int64_t> local;  // expert id -> its index in gate_up / down, or -1
  int64_t top_k;
  bool renorm;
  Ffn(Linear gate_up, Linear down);
  Ffn(c10::optional<Linear> router, std::vector<int64_t> held, std::vector<Linear> gate_up, std::vector<Linear> down,
      int64_t n_experts, int64_t top_k, bool renorm);
  at::Tensor operator()(const at::Tensor& x) const;  // x [..., H] float, already normed -> [..., H]
  std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x) const;  // x [M, H] -> ids, weights [M, k]
  at::Tensor experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts) const;
  at::Tensor combine(const at::Tensor& ids, const at::Tensor& parts) const;
};

// A compiled decoder layer's weights, gathered once (model/stack.py's LayerStack at load): decoder_layer_rows'
// arguments besides the rows, their rotation and their caches.
struct LayerWeights {
  at::Tensor norm1, norm2;
  double eps;
  Attn attn;
  Ffn ffn;
};
at::Tensor decoder_layer_rows(at::Tensor x, const LayerWeights& w, at::Tensor cos, at::Tensor sin,
                              const std::vector<SeqKV>& seqs);
at::Tensor decoder_layer(at::Tensor x, const LayerWeights& w, at::Tensor cos, at::Tensor sin,
                         at::Tensor k, at::Tensor v, at::Tensor table, int64_t start,
                         c10::optional<at::Tensor> mask);

// One sequence's share of a pass through a stack of layers: SeqKV's, with the keys and values of every layer
// (k[i], v[i]: layer i's pool tensors; one block table for all of them).
struct SeqLayers {
  std::vector<at::Tensor> k, v;
  at::Tensor table;
  int64_t start, T;
  c10::optional<at::Tensor> mask;
};
at::Tensor decoder_stack(at::Tensor x, const std::vector<LayerWeights>& layers,
                         const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         const std::vector<SeqLayers>& seqs);
