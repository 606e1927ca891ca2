// A decoder layer in one call: attention block (q/k/v projection, rotary, KV write, attention, output
// projection) and SwiGLU FFN, on the kernels of quant.cpp and ops.cpp. Python dispatch between those kernels
// was half of a decoding step once the matmuls were fast (measured on a 2-core EPYC, SmolLM2-135M in Q4_1:
// 14.1 ms per token, of which about 7 outside the matmuls: ~20 torch ops per layer at 5-10 us each). The
// arithmetic is the per-op path's, op for op, so a layer gives the same bits called whole or in blocks (as a
// HeadSplit device calls it), and every output keeps its one fixed order whatever the pass shape.
#include "common.h"

// One linear layer of n output rows in a compiled format: kind 0 = q4 (pw, d8, m8 interleaved as quant.cpp
// says), 1 = q8 (pw, d8), 2 = float32 (w [n, K]); bias [n] or none, added after the matmul.
Linear::Linear(int64_t kind, torch::Tensor a, torch::Tensor b, torch::Tensor c, c10::optional<torch::Tensor> bias,
               int64_t n)
    : kind(kind), a(a.contiguous()), b(b.contiguous()), c(c.contiguous()), bias(bias), n(n) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "linear kind must be 0 (q4), 1 (q8) or 2 (float32)");
}

torch::Tensor Linear::operator()(const torch::Tensor& x) const {
  // x [M, K] float contiguous -> [M, N]
  torch::Tensor y = kind == 0 ? q4_matmul(x, a, b, c, n) : kind == 1 ? q8_matmul(x, a, b, n) : f32_matmul(x, a);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// x [B, T, H] float (already normed); qkv, o: the block's projections (n_q + 2 n_kv heads of hd out; n_q hd
// in); cos, sin [Bc, 1, T, hd] (Bc 1 or B); own_k, own_v [B, n_kv, A, hd]: the cache's storage for this
// layer, written at slots lo..lo+T; prefix_k, prefix_v [1, n_kv, >= P, hd]: slots [0, P) shared from a
// parent (P = 0: none); the queries sit at slots start..start+T; mask as ops.cpp's attention.
// -> the block's attention output [B, T, H] (partial when the block holds some of the layer's groups).
torch::Tensor attention_block(torch::Tensor x, const Linear& qkv, const Linear& o, int64_t n_q, int64_t n_kv,
                              torch::Tensor cos, torch::Tensor sin, torch::Tensor own_k, torch::Tensor own_v,
                              int64_t lo, c10::optional<torch::Tensor> prefix_k,
                              c10::optional<torch::Tensor> prefix_v, int64_t P, int64_t start,
                              c10::optional<torch::Tensor> mask) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3, "x must be float [B, T, H]");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), hd = own_k.size(3), heads = n_q + 2 * n_kv;
  TORCH_CHECK(own_k.is_contiguous() && own_v.is_contiguous() && own_k.size(0) == B && own_k.size(1) == n_kv,
              "the cache storage must be contiguous [B, n_kv, A, hd]");
  TORCH_CHECK(lo >= 0 && lo + T <= own_k.size(2) && start == P + lo, "the write does not fit the cache storage");
  torch::Tensor y = qkv(x.reshape({B * T, H}).contiguous());  // [B*T, heads*hd]
  TORCH_CHECK(y.size(1) == heads * hd, "qkv gives ", y.size(1), " columns, not ", heads * hd);
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t cb = cos.size(0) == 1 ? 0 : T * hd;
  const int64_t A = own_k.size(2);
  auto q = torch::empty({B, n_q, T, hd}, x.options());
  const float *yp = y.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = own_k.data_ptr<float>(), *vp = own_v.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* row = yp + (b * T + t) * heads * hd;
      const float *c = cp + b * cb + t * hd, *s = sp + b * cb + t * hd;
      for (int64_t h = 0; h < n_q; ++h) rotate(row + h * hd, c, s, hd, qp + ((b * n_q + h) * T + t) * hd);
      for (int64_t g = 0; g < n_kv; ++g) {
        const int64_t slot = ((b * n_kv + g) * A + lo + t) * hd;
        rotate(row + (n_q + g) * hd, c, s, hd, kp + slot);
        std::copy(row + (n_q + n_kv + g) * hd, row + (n_q + n_kv + g + 1) * hd, vp + slot);
      }
    }
  Keys keys{own_k, own_v, P};
  if (P > 0) {
    TORCH_CHECK(prefix_k.has_value() && prefix_v.has_value(), "P > 0 needs the prefix keys and values");
    keys.prefix_k = *prefix_k;
    keys.prefix_v = *prefix_v;
  }
  torch::Tensor attn = attend_keys(q, keys, start, mask);  // [B, n_q, T, hd]
  return o(attn.transpose(1, 2).reshape({B * T, n_q * hd}).contiguous()).view({B, T, H});
}

// x [B, T, H] float (already normed) -> down(silu(gate(x)) * up(x)) [B, T, H]
torch::Tensor ffn_block(torch::Tensor x, const Linear& gate_up, const Linear& down) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2);
  return down(silu_mul(gate_up(x.reshape({B * T, H}).contiguous()))).view({B, T, H});
}

// x [B, T, H] -> x + attn(norm1(x)) = z, then z + ffn(norm2(z)) [B, T, H]; arguments as attention_block's
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor norm1, torch::Tensor norm2, double eps, const Linear& qkv,
                            const Linear& o, const Linear& gate_up, const Linear& down, int64_t n_q, int64_t n_kv,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor own_k, torch::Tensor own_v,
                            int64_t lo, c10::optional<torch::Tensor> prefix_k,
                            c10::optional<torch::Tensor> prefix_v, int64_t P, int64_t start,
                            c10::optional<torch::Tensor> mask) {
  x = x.contiguous();
  torch::Tensor z = x + attention_block(rms_norm(x, norm1, eps), qkv, o, n_q, n_kv, cos, sin, own_k, own_v, lo,
                                        prefix_k, prefix_v, P, start, mask);
  return z + ffn_block(rms_norm(z, norm2, eps), gate_up, down);
}
