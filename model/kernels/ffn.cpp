// A layer's SwiGLU feed-forward in one call: dense, or a mixture of experts (Qwen3-MoE's sparse block).
//
// The mixture: the router's logits, their softmax in float32, each row's top_k experts (renormalised to sum 1
// where the model says so), and each chosen expert's FFN over just the rows that chose it, so that a pass reads
// only the experts its rows chose, each once for all of its rows, in the file's quantization. A row's output is
// its experts' weighted outputs added in ascending expert order (transformers' index_add_ order): the matmuls
// are row-invariant and the sums' order is fixed by the expert ids alone, so a row's bits depend neither on the
// rows beside it in the pass nor on the threads. Run from Python expert by expert (torch's nonzero, index_add_,
// topk between the kernels), a one-row pass of the 7B-A1B mixture's sparse layer took about 2.7 ms of which the
// experts' matmuls were 0.3: torch's OpenMP threads and the kernels' pool took the two cores from each other.
#include "common.h"

Ffn::Ffn(Linear gate_up, Linear down) : gate_up{gate_up}, down{down}, top_k(0), renorm(false) {}

Ffn::Ffn(Linear router, std::vector<Linear> gate_up, std::vector<Linear> down, int64_t top_k, bool renorm)
    : gate_up(std::move(gate_up)), down(std::move(down)), router(router), top_k(top_k), renorm(renorm) {
  const int64_t E = static_cast<int64_t>(this->gate_up.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(this->down.size()) == E && router.n == E,
              "a mixture needs a router row, a gate_up and a down per expert");
  TORCH_CHECK(top_k > 0 && top_k <= E, "experts per token must be in 1..", E);
}

namespace {

// Each row's experts [M, k] and weights [M, k] from the router's logits [M, E]: softmax (max subtracted, exp,
// divided by the sum in index order), the k largest probabilities (ties to the lower id), renormalised where
// asked. Row by row, in one fixed order.
void route(const torch::Tensor& logits, int64_t k, bool renorm, std::vector<int64_t>& ids, std::vector<float>& wts) {
  const int64_t M = logits.size(0), E = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  ids.resize(M * k), wts.resize(M * k);
  std::vector<float> p(E);
  std::vector<bool> taken(E);
  for (int64_t r = 0; r < M; ++r) {
    const float* l = lp + r * E;
    std::copy(l, l + E, p.begin());
    exp_shifted(p.data(), *std::max_element(l, l + E), E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += p[e];
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::fill(taken.begin(), taken.end(), false);
    float top = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = true;
      ids[r * k + j] = best, wts[r * k + j] = p[best];
      top += p[best];
    }
    if (renorm)
      for (int64_t j = 0; j < k; ++j) wts[r * k + j] /= top;
  }
}

}  // namespace

torch::Tensor Ffn::operator()(const torch::Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "x must be float32");
  const int64_t H = x.size(-1);
  const torch::Tensor rows = x.reshape({-1, H}).contiguous();  // [M, H]
  if (!router.has_value()) return down[0](silu_mul(gate_up[0](rows))).view(x.sizes());
  const int64_t M = rows.size(0), E = static_cast<int64_t>(gate_up.size()), k = top_k;
  std::vector<int64_t> ids;
  std::vector<float> wts;
  route((*router)(rows), k, renorm, ids, wts);
  // the rows (and their weights) of each expert, in row order
  std::vector<std::vector<int64_t>> at(E);
  std::vector<std::vector<float>> weight(E);
  for (int64_t i = 0; i < M * k; ++i) at[ids[i]].push_back(i / k), weight[ids[i]].push_back(wts[i]);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (!at[e].empty()) active.push_back(e);
  const int64_t n = static_cast<int64_t>(active.size());
  std::vector<torch::Tensor> ys(n);  // each active expert's weighted outputs [m, H]
  const float* xp = rows.data_ptr<float>();
  auto expert = [&](int64_t a) {  // plain loops, no torch op: one inside the pool would start OpenMP's threads
    const int64_t e = active[a], m = static_cast<int64_t>(at[e].size());
    torch::Tensor own = torch::empty({m, H}, rows.options());  // the expert's rows [m, H]
    for (int64_t i = 0; i < m; ++i) std::memcpy(own.data_ptr<float>() + i * H, xp + at[e][i] * H, H * sizeof(float));
    torch::Tensor y = down[e](silu_mul(gate_up[e](own)));  // [m, H]
    float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < H; ++c) yp[i * H + c] *= weight[e][i];
    ys[a] = y;
  };
  // Enough experts for every thread: one expert a thread at a time (its matmuls nested, so on that thread); a
  // one-row pass's 6-8 otherwise each split over the threads. The bits are the same either way.
  if (n >= 2 * at::get_num_threads())
    parallel_chunks(0, n, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t a = lo; a < hi; ++a) expert(a);
    });
  else
    for (int64_t a = 0; a < n; ++a) expert(a);
  torch::Tensor out = torch::empty({M, H}, rows.options());
  float* op = out.data_ptr<float>();
  std::fill(op, op + M * H, 0.f);
  for (int64_t a = 0; a < n; ++a) {  // ascending expert order: each row's sum in one fixed order
    const std::vector<int64_t>& own = at[active[a]];
    const float* yp = ys[a].data_ptr<float>();
    for (size_t i = 0; i < own.size(); ++i)
      for (int64_t c = 0; c < H; ++c) op[own[i] * H + c] += yp[i * H + c];
  }
  return out.view(x.sizes());
}
