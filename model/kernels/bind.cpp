// The Python module of the kernels (quant.cpp: matmuls; ops.cpp: the other per-token ops).
#include "common.h"

bool simd() {
#ifdef ES_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_matmul", &q4_matmul, "x [M, K] @ q4 weight [N, K]^T -> [M, N]");
  mod.def("q8_matmul", &q8_matmul, "x [M, K] @ q8 weight [N, K]^T -> [M, N]");
  mod.def("f32_matmul", &f32_matmul, "x [M, K] @ float weight [N, K]^T -> [M, N]");
  mod.def("rms_norm", &rms_norm, "RMS norm of the rows of x [..., H] times w [H]");
  mod.def("rope", &rope, "rotate-half rotary of x [B, heads, T, hd] by cos, sin [B, 1, T, hd]");
  mod.def("attention", &attention, "per-row attention over the slots each query row sees");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of gate_up [..., 2I] -> [..., I]");
  mod.def("simd", &simd, "whether the AVX2 path was compiled in");
}
