// A decoder layer in one call: attention block (q/k/v projection, rotary, KV write, attention, output
// projection) and SwiGLU FFN, on the kernels of quant.cpp and ops.cpp. Python dispatch between those kernels
// was half of a decoding step once the matmuls were fast (measured on a 2-core EPYC, SmolLM2-135M in Q4_1:
// 14.1 ms per token, of which about 7 outside the matmuls: ~20 torch ops per layer at 5-10 us each). The
// arithmetic is the per-op path's, op for op, so a layer gives the same bits called whole or in blocks (as a
// HeadSplit device calls it), and every output keeps its one fixed order whatever the pass shape.
#include "common.h"
#include "kv.h"

// One linear layer of n output rows in a compiled format: kind 0 = q4 (pw, d8, m8 interleaved as quant.cpp
// says), 1 = q8 (pw, d8), 2 = float32 (w [n, K]), 3 = affine q8 (pw, d8, m8); bias [n] or none, added after.
Linear::Linear(int64_t kind, at::Tensor a, at::Tensor b, at::Tensor c, c10::optional<at::Tensor> bias,
               int64_t n)
    : kind(kind), a(a.contiguous()), b(b.contiguous()), c(c.contiguous()), bias(bias), n(n) {
  TORCH_CHECK(kind >= 0 && kind <= 3, "linear kind must be 0 (q4), 1 (q8), 2 (float32) or 3 (affine q8)");
}

at::Tensor Linear::operator()(const at::Tensor& x) const {
  // x [M, K] float contiguous -> [M, N]
  at::Tensor y = kind == 0   ? q4_matmul(x, a, b, c, n)
                    : kind == 1 ? q8_matmul(x, a, b, c10::nullopt, n)
                    : kind == 3 ? q8_matmul(x, a, b, c, n)
                                : f32_matmul(x, a);
  if (bias.has_value()) add_bias_(y, *bias);
  return y;
}

// The attention of the rows of several sequences in one pass (a batch step): x [M, H] float, already normed,
// holds each sequence's rows in turn (seqs[i].T of them); cos, sin [M, hd] per row. The projections run once
// over all M rows; rotary and the KV write per sequence into its own blocks, then every sequence's attention
// in one run over the threads (attend_seqs). Each output row is computed as when its sequence runs alone (the
// matmuls are row-invariant, attention is per query row), so batching changes no bits. -> [M, H] (partial when
// the block holds some of the layer's groups).
at::Tensor attention_rows(at::Tensor x, const Attn& attn, at::Tensor cos, at::Tensor sin,
                          const std::vector<SeqKV>& seqs) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be float [M, H]");
  const int64_t M = x.size(0), H = x.size(1);
  int64_t rows = 0;
  for (const SeqKV& s : seqs) rows += s.T;
  TORCH_CHECK(rows == M, "the sequences hold ", rows, " rows, x ", M);
  cos = cos.contiguous();
  sin = sin.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == M && sin.sizes() == cos.sizes(), "cos, sin must be [M, hd]");
  const int64_t n_q = attn.n_q, n_kv = attn.n_kv;
  at::Tensor y = attn.qkv(x.contiguous());  // [M, heads*hd]
  const int64_t hd = cos.size(1), heads = n_q + 2 * n_kv;
  const bool qk_norm = attn.q_norm.has_value();
  TORCH_CHECK(qk_norm == attn.k_norm.has_value(), "q and k are normed both or neither");
  for (const auto& w : {attn.q_norm, attn.k_norm})
    TORCH_CHECK(!w || (w->numel() == hd && w->is_contiguous() && w->scalar_type() == at::kFloat),
                "the q and k norms must be contiguous float [hd]");
  const float* qn = qk_norm ? attn.q_norm->data_ptr<float>() : nullptr;
  const float* kn = qk_norm ? attn.k_norm->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(attn.eps);
  TORCH_CHECK(y.size(1) == heads * hd, "qkv gives ", y.size(1), " columns, not ", heads * hd);
  auto q = at::empty({M, n_q, hd}, x.options());  // each row's rotated queries, as attend_seqs reads them
  const float *yp = y.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  int64_t r0 = 0;
  for (const SeqKV& s : seqs) {
    const int64_t T = s.T, BS = s.k.size(2);
    TORCH_CHECK(s.k.is_contiguous() && s.v.is_contiguous() && s.k.dim() == 4 && s.v.sizes() == s.k.sizes() &&
                    s.v.scalar_type() == s.k.scalar_type() && s.k.size(1) == n_kv,
                "a sequence's blocks must be contiguous [N, n_kv, BS, row], keys and values stored alike");
    const KVKind kind = kv_kind(s.k, hd);
    const int64_t row_bytes = s.k.size(3) * s.k.element_size();
    TORCH_CHECK(s.table.scalar_type() == at::kLong && s.table.dim() == 1 && s.table.is_contiguous(),
                "a block table must be contiguous int64 [nb]");
    const int64_t nb = s.table.size(0);
    TORCH_CHECK(s.start >= 0 && s.start + T <= nb * BS, "the write does not fit the sequence's blocks");
    const int64_t* tp = s.table.data_ptr<int64_t>();
    uint8_t *kp = static_cast<uint8_t*>(s.k.data_ptr()), *vp = static_cast<uint8_t*>(s.v.data_ptr());
    std::vector<float> key(hd), normed(hd);
    // a head vector as rotated: normed first where the architecture norms q and k (rms_norm's arithmetic)
    auto head = [&](const float* x, const float* w) {
      if (w == nullptr) return x;
      rms_row(x, w, hd, eps, normed.data());
      return static_cast<const float*>(normed.data());
    };
    for (int64_t t = 0; t < T; ++t) {
      const int64_t m = r0 + t, slot = s.start + t, blk = tp[slot / BS];
      TORCH_CHECK(blk >= 0 && blk < s.k.size(0), "block ", blk, " is not in the pool");
      const float *row = yp + m * heads * hd, *c = cp + m * hd, *sn = sp + m * hd;
      for (int64_t h = 0; h < n_q; ++h) rotate(head(row + h * hd, qn), c, sn, hd, qp + (m * n_q + h) * hd);
      for (int64_t g = 0; g < n_kv; ++g) {
        const int64_t at = ((blk * n_kv + g) * BS + slot % BS) * row_bytes;  // each head vector stored on its own
        rotate(head(row + (n_q + g) * hd, kn), c, sn, hd, key.data());
        kv_write(kind, key.data(), hd, kp + at);
        kv_write(kind, row + (n_q + n_kv + g) * hd, hd, vp + at);
      }
    }
    r0 += T;
  }
  return attn.o(attend_seqs(q, seqs).view({M, n_q * hd}));
}

namespace {

// The one sequence of a single-sequence call: x [1, T, H] -> rows [T, H]; cos, sin [1, 1, T, hd] -> [T, hd]
struct OneSeq {
  at::Tensor x, cos, sin;
  std::vector<SeqKV> seqs;
};

OneSeq one_seq(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& table, int64_t start,
               const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(0) == 1, "x must be float [1, T, H]");
  const int64_t T = x.size(1);
  auto rows = [&](const at::Tensor& t) { return t.reshape({T, t.size(-1)}); };
  return OneSeq{x.reshape({T, x.size(2)}), rows(cos), rows(sin), {SeqKV{k, v, table, start, T, mask}}};
}

}  // namespace

// x [1, T, H] float (already normed); attn: the block's weights; cos, sin [1, 1, T, hd]; k, v [N, n_kv, BS, hd]
// and table [nb]: the sequence's blocks (SeqKV), written at slots start..start+T; mask as ops.cpp's attention.
// -> the block's attention output [1, T, H] (attention_rows over one sequence).
at::Tensor attention_block(at::Tensor x, const Attn& attn, at::Tensor cos, at::Tensor sin,
                           at::Tensor k, at::Tensor v, at::Tensor table, int64_t start,
                           c10::optional<at::Tensor> mask) {
  const OneSeq r = one_seq(x, cos, sin, k, v, table, start, mask);
  return attention_rows(r.x, attn, r.cos, r.sin, r.seqs).view(x.sizes());
}

// x [M, H] -> x + attn(norm1(x)) = z, then z + ffn(norm2(z)) [M, H]: a layer over the rows of several
// sequences, arguments as attention_rows'
at::Tensor decoder_layer_rows(at::Tensor x, const LayerWeights& w, at::Tensor cos, at::Tensor sin,
                              const std::vector<SeqKV>& seqs) {
  x = x.contiguous();
  at::Tensor z = add_rows(x, attention_rows(rms_norm(x, w.norm1, w.eps), w.attn, cos, sin, seqs));
  return add_rows(z, w.ffn(rms_norm(z, w.norm2, w.eps)));
}

// x [1, T, H] -> [1, T, H]: decoder_layer_rows over one sequence; arguments as attention_block's
at::Tensor decoder_layer(at::Tensor x, const LayerWeights& w, at::Tensor cos, at::Tensor sin,
                         at::Tensor k, at::Tensor v, at::Tensor table, int64_t start,
                         c10::optional<at::Tensor> mask) {
  const OneSeq r = one_seq(x, cos, sin, k, v, table, start, mask);
  return decoder_layer_rows(r.x, w, r.cos, r.sin, r.seqs).view(x.sizes());
}

// x [M, H] through every layer in turn (decoder_layer_rows each), rows as decoder_layer_rows takes them: layer
// i's rotation cos[i], sin[i] [M, hd] (a layer that does not rotate has its own), its caches seqs[s].k[i], .v[i].
// One call for the whole stack: called layer by layer from Python, a one-row pass of SmolLM2-135M's 30 layers
// took 4.3 ms against 3.5 in one call (attribute lookups on torch modules, the arguments' conversions, the GIL
// taken back 30 times, from the event loop when it held it). -> [M, H]
at::Tensor decoder_stack(at::Tensor x, const std::vector<LayerWeights>& layers,
                         const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         const std::vector<SeqLayers>& seqs) {
  const size_t L = layers.size();
  TORCH_CHECK(cos.size() == L && sin.size() == L, "a rotation per layer: ", L, " layers, ", cos.size(), " tables");
  for (const SeqLayers& s : seqs)
    TORCH_CHECK(s.k.size() == L && s.v.size() == L, "a sequence must hold keys and values for each of ", L, " layers");
  std::vector<SeqKV> kv(seqs.size());
  for (size_t i = 0; i < L; ++i) {
    for (size_t j = 0; j < seqs.size(); ++j) {
      const SeqLayers& s = seqs[j];
      kv[j] = SeqKV{s.k[i], s.v[i], s.table, s.start, s.T, s.mask};
    }
    x = decoder_layer_rows(x, layers[i], cos[i], sin[i], kv);
  }
  return x;
}
