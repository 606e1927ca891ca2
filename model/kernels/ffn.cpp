// A layer's SwiGLU feed-forward in one call: dense, or a mixture of experts (Qwen3-MoE's sparse block).
//
// The mixture: the router's logits, their softmax in float32, each row's top_k experts (renormalised to sum 1
// where the model says so), and each chosen expert's FFN over just the rows that chose it, so that a pass reads
// only the experts its rows chose, each once for all of its rows, in the file's quantization. A row's output is
// its experts' weighted outputs added in ascending expert order (transformers' index_add_ order): the matmuls
// are row-invariant and the sums' order is fixed by the expert ids alone, so a row's bits depend neither on the
// rows beside it in the pass nor on the threads, nor on where the experts run: a layer whose experts are placed
// on several devices (the planner's choice) runs the same three steps, `route` where its router is, `experts` on
// each device for the (row, slot) choices whose expert it holds (their weighted outputs), and `combine` of every
// slot's output where the router is, each row's slots added in ascending expert order. Run from Python expert by
// expert (torch's nonzero, index_add_, topk between the kernels), a one-row pass of the 7B-A1B mixture's sparse
// layer took about 2.7 ms of which the experts' matmuls were 0.3: torch's OpenMP threads and the kernels' pool
// took the two cores from each other.
#include "common.h"

Ffn::Ffn(Linear gate_up, Linear down) : gate_up{gate_up}, down{down}, top_k(0), renorm(false) {}

Ffn::Ffn(c10::optional<Linear> router, std::vector<int64_t> held, std::vector<Linear> gate_up,
         std::vector<Linear> down, int64_t n_experts, int64_t top_k, bool renorm)
    : gate_up(std::move(gate_up)), down(std::move(down)), router(router), held(std::move(held)),
      local(n_experts, -1), top_k(top_k), renorm(renorm) {
  const size_t n = this->held.size();
  TORCH_CHECK(this->gate_up.size() == n && this->down.size() == n, "a gate_up and a down per held expert");
  TORCH_CHECK(!router || router->n == n_experts, "the router must have a row per expert");
  TORCH_CHECK(top_k > 0 && top_k <= n_experts, "experts per token must be in 1..", n_experts);
  for (size_t i = 0; i < n; ++i) {
    const int64_t e = this->held[i];
    TORCH_CHECK(e >= 0 && e < n_experts && (i == 0 || e > this->held[i - 1]), "held experts must be ascending ids");
    local[e] = static_cast<int64_t>(i);
  }
}

// Each row's experts [M, k] and weights [M, k] from the router's logits [M, E]: softmax (max subtracted, exp,
// divided by the sum in index order), the k largest probabilities (ties to the lower id), renormalised where
// asked. Row by row, in one fixed order.
std::tuple<at::Tensor, at::Tensor> Ffn::route(const at::Tensor& x) const {
  TORCH_CHECK(router.has_value(), "these experts have no router (an expert host's)");
  const at::Tensor logits = (*router)(x.contiguous());
  const int64_t M = logits.size(0), E = logits.size(1), k = top_k;
  at::Tensor ids = at::empty({M, k}, at::kLong), wts = at::empty({M, k}, at::kFloat);
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = wts.data_ptr<float>();
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
      ip[r * k + j] = best, wp[r * k + j] = p[best];
      top += p[best];
    }
    if (renorm)
      for (int64_t j = 0; j < k; ++j) wp[r * k + j] /= top;
  }
  return {ids, wts};
}

// x [M, H] (normed), each row's experts ids [M, k] and weights wts [M, k] -> each slot's weighted expert output
// [M, k, H] for the slots whose expert is held here, zeros elsewhere. Each held expert runs once over just the
// rows that chose it.
at::Tensor Ffn::experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& wts) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be float [M, H]");
  const int64_t M = x.size(0), H = x.size(1), k = ids.size(1);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == M && wts.sizes() == ids.sizes() &&
                  wts.scalar_type() == at::kFloat, "ids (int64) and wts (float) must be [M, k]");
  const at::Tensor rows = x.contiguous(), idc = ids.contiguous(), wc = wts.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  const int64_t E = static_cast<int64_t>(local.size());
  // the slots (row * k + j) of each held expert, in row order
  std::vector<std::vector<int64_t>> at(held.size());
  for (int64_t i = 0; i < M * k; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "expert ", ip[i], " is not one of the ", E);
    if (local[ip[i]] >= 0) at[local[ip[i]]].push_back(i);
  }
  std::vector<int64_t> active;
  for (size_t a = 0; a < at.size(); ++a)
    if (!at[a].empty()) active.push_back(static_cast<int64_t>(a));
  at::Tensor out = at::zeros({M, k, H}, rows.options());
  float* op = out.data_ptr<float>();
  const float* xp = rows.data_ptr<float>();
  auto expert = [&](int64_t a) {  // plain loops, no torch op: one inside the pool would start OpenMP's threads
    const std::vector<int64_t>& slots = at[a];
    const int64_t m = static_cast<int64_t>(slots.size());
    at::Tensor own = at::empty({m, H}, rows.options());  // the expert's rows [m, H]
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(own.data_ptr<float>() + i * H, xp + slots[i] / k * H, H * sizeof(float));
    at::Tensor y = down[a](silu_mul(gate_up[a](own)));  // [m, H]
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < H; ++c) op[slots[i] * H + c] = yp[i * H + c] * wp[slots[i]];
  };
  // Enough experts for every thread: one expert a thread at a time (its matmuls nested, so on that thread); a
  // one-row pass's 6-8 otherwise each split over the threads. The bits are the same either way.
  const int64_t n = static_cast<int64_t>(active.size());
  if (n >= 2 * at::get_num_threads())
    parallel_chunks(0, n, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t a = lo; a < hi; ++a) expert(active[a]);
    });
  else
    for (int64_t a : active) expert(a);
  return out;
}

// ids [M, k], parts [M, k, H] (every slot's weighted output) -> [M, H]: each row's slots added from zero in
// ascending expert order, whichever devices computed them.
at::Tensor Ffn::combine(const at::Tensor& ids, const at::Tensor& parts) const {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && parts.scalar_type() == at::kFloat &&
                  parts.dim() == 3 && parts.size(0) == ids.size(0) && parts.size(1) == ids.size(1),
              "ids must be int64 [M, k] and parts float [M, k, H]");
  const int64_t M = ids.size(0), k = ids.size(1), H = parts.size(2);
  const at::Tensor idc = ids.contiguous(), pc = parts.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const float* pp = pc.data_ptr<float>();
  at::Tensor out = at::zeros({M, H}, parts.options());
  float* op = out.data_ptr<float>();
  std::vector<int64_t> order(k);
  for (int64_t r = 0; r < M; ++r) {
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ip[r * k + a] < ip[r * k + b]; });
    float* o = op + r * H;
    for (int64_t j : order) {
      const float* p = pp + (r * k + j) * H;
      for (int64_t c = 0; c < H; ++c) o[c] += p[c];
    }
  }
  return out;
}

at::Tensor Ffn::operator()(const at::Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  const int64_t H = x.size(-1);
  const at::Tensor rows = x.reshape({-1, H}).contiguous();  // [M, H]
  if (!router.has_value() && held.empty()) return down[0](silu_mul(gate_up[0](rows))).view(x.sizes());
  TORCH_CHECK(held.size() == local.size(), "a layer whose experts are placed on several devices runs in steps: "
              "route, experts on each device, combine");
  const auto [ids, wts] = route(rows);
  return combine(ids, experts(rows, ids, wts)).view(x.sizes());
}
