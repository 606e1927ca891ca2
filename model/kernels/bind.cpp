// The Python module of the kernels (quant.cpp: matmuls; ops.cpp: the other per-token ops; layer.cpp: blocks;
// ffn.cpp: feed-forwards, dense and mixtures).
#include <torch/csrc/utils/pybind.h>  // pybind11 with its casters for tensors and optionals
#include "common.h"

bool simd() {
#ifdef ES_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // The tensor work runs without the GIL (its arguments are converted before, its result after): a decoder
  // layer holding it kept the event loop from streaming the tokens of the step before for the whole pass.
  const auto free = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("q4_matmul", &q4_matmul, free, "x [M, K] @ interleaved q4 weight [N, K]^T -> [M, N]");
  mod.def("q8_matmul", &q8_matmul, free, "x [M, K] @ interleaved q8 weight [N, K]^T (offsets m8 or None) -> [M, N]");
  mod.def("q8_rows", &q8_rows, free, "rows ids [n] of an interleaved q8 weight (offsets m8 or None) as floats [n, K]");
  mod.def("f32_matmul", &f32_matmul, free, "x [M, K] @ float weight [N, K]^T -> [M, N]");
  mod.def("rms_norm", &rms_norm, "RMS norm of the rows of x [..., H] times w [H]");
  mod.def("rope", &rope, "rotate-half rotary of x [B, heads, T, hd] by cos, sin [B, 1, T, hd]");
  mod.def("attention", &attention, free, "per-row attention over the slots each query row sees");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of gate_up [..., 2I] -> [..., I]");
  mod.def("kv_encode", &kv_encode, "head vectors x [n, hd] as a KV cache of like's dtype stores them");
  // module_local: the portable build, loaded beside this one in a test, registers its own Linear
  pybind11::class_<Linear>(mod, "Linear", pybind11::module_local(), "a weight in a compiled format: 0 q4, 1 q8, 2 f32, 3 affine q8")
      .def(pybind11::init<int64_t, at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t>())
      .def("__call__", &Linear::operator(), free, "x [M, K] float -> [M, N]");
  pybind11::class_<SeqKV>(mod, "SeqKV", pybind11::module_local(), "one sequence's share of a batch of rows")
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                          c10::optional<at::Tensor>>());
  mod.def("attention_rows", &attention_rows, free, "the attention of several sequences' rows in one call");
  mod.def("decoder_layer_rows", &decoder_layer_rows, free, "a decoder layer over several sequences' rows in one call");
  mod.def("attention_block", &attention_block, free, "a layer's attention (or some of its KV groups) in one call");
  mod.def("decoder_layer", &decoder_layer, free, "a whole decoder layer in one call");
  pybind11::class_<Attn>(mod, "Attn", pybind11::module_local(), "a layer's attention weights (q/k norms or None)")
      .def(pybind11::init<Linear, Linear, int64_t, int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          double>());
  pybind11::class_<Ffn>(mod, "Ffn", pybind11::module_local(), "a layer's SwiGLU FFN: dense, or a mixture of experts")
      .def(pybind11::init<Linear, Linear>(), "gate_up, down")
      .def(pybind11::init<c10::optional<Linear>, std::vector<int64_t>, std::vector<Linear>, std::vector<Linear>,
                          int64_t, int64_t, bool>(),
           "router (or None: an expert host's), the held experts' ids (ascending), each one's gate_up and down, the "
           "number of experts, experts per token, renormalise the top ones")
      .def("__call__", &Ffn::operator(), free, "x [..., H] float (normed) -> [..., H]")
      .def("route", &Ffn::route, free, "x [M, H] float (normed) -> each row's experts int64 [M, k], weights [M, k]")
      .def("experts", &Ffn::experts, free, "x [M, H], ids, weights [M, k] -> the held slots' weighted outputs [M, k, H]")
      .def("combine", &Ffn::combine, free, "ids [M, k], every slot's output [M, k, H] -> [M, H] (ascending experts)");
  pybind11::class_<LayerWeights>(mod, "LayerWeights", pybind11::module_local(), "a compiled decoder layer's weights")
      .def(pybind11::init<at::Tensor, at::Tensor, double, Attn, Ffn>());
  pybind11::class_<SeqLayers>(mod, "SeqLayers", pybind11::module_local(), "one sequence's share of a pass of a stack")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, int64_t, int64_t,
                          c10::optional<at::Tensor>>());
  mod.def("decoder_stack", &decoder_stack, free, "a stack of decoder layers over several sequences' rows in one call");
  mod.def("simd", &simd, "whether the AVX2 path was compiled in");
  mod.def("isa", &isa_name, "the path compiled in: portable, avx2, avx512-vnni or avx-vnni");
}
