"""The one seam for how a linear layer computes: a weight format picks its kernel here.

Formats (`--weights`, and the workers' `dtype` field):
- `auto`: the source's own form. A GGUF's Q4_0 / Q4_1 / Q4_K matrices run as Q4 blocks; Q8_0, Q5_x, Q6_K,
  Q3_K, Q2_K, IQ4_NL and IQ4_XS as Q8 blocks holding the file's values (model/gguf_blocks.py; with offsets
  for Q5_1, Q5_K and Q2_K); F32 / F16 / BF16 as dense float32; a Hugging Face folder's matrices run dense in
  float32. Activations and norms are float32 (the KV cache: `--kv-format`).
- `q4_1` / `q8_0`: every layer matrix quantized at load (from a GGUF's blocks, or a folder's floats) to Q4 or
  Q8 blocks; the LM head stays at 8 bits in both (a 4-bit head cost top-1 agreement: 0.82-0.88 measured).
- `float32`, `bfloat16`, `float16`: everything dequantized to that dtype (the reference formats).

Kernels: Q4, Q8 and dense float32 run the compiled row-invariant kernels of `model/kernels` (llama.cpp's
integer dot products of 8-bit activations, AVX2 where the CPU has it, portable C++ loops elsewhere), so a
position's output does not depend on the rows in its pass: that is what makes the exact policies exact in
the default format. bfloat16 runs oneDNN's packed kernel where the CPU supports it (about 1.45x F.linear on
AVX-512 machines; it refuses to pack without AVX-512 or AVX-NE-CONVERT), else F.linear; neither is
row-invariant, so in bfloat16 the exact policies are exact only up to rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.model.quant import Q4, Q8, Interleaved, Matrix, as_q8, dequantized, quantize_q4


@dataclass(frozen=True)
class WeightFormat:
    """How a process holds and computes its weights."""

    name: str
    act: torch.dtype  # activations, norms and the KV cache
    layers: str  # "source", "q4", "q8" or "dense": what the layers' matrices become
    head: str  # the same for the LM head


FORMATS = {
    "auto": WeightFormat("auto", torch.float32, "source", "source"),
    "q4_1": WeightFormat("q4_1", torch.float32, "q4", "q8"),
    "q8_0": WeightFormat("q8_0", torch.float32, "q8", "q8"),
    "float32": WeightFormat("float32", torch.float32, "dense", "dense"),
    "bfloat16": WeightFormat("bfloat16", torch.bfloat16, "dense", "dense"),
    "float16": WeightFormat("float16", torch.float16, "dense", "dense"),
}


def as_format(fmt: WeightFormat | torch.dtype | str) -> WeightFormat:
    """A format from a format, its name, or a torch dtype (the dense format of that dtype)."""
    if isinstance(fmt, WeightFormat):
        return fmt
    if isinstance(fmt, torch.dtype):
        return weight_format(str(fmt).removeprefix("torch."))
    return weight_format(fmt)


def weight_format(name: str) -> WeightFormat:
    """The format named `name`; ValueError naming the valid ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; valid: {', '.join(FORMATS)}") from None


@functools.cache
def compiled():
    """The module of compiled kernels (built once per machine: model/kernels)."""
    from edgespec.model.kernels import load

    return load()


def kernels_take(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernels may take these operands: on the CPU, and no gradient wanted (the kernels have
    no backward: the drafter's training runs torch's own ops, on any device)."""
    return all(t.device.type == "cpu" for t in tensors) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU (it needs AVX-512 or AVX-NE-CONVERT): tried once."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class Kernel(nn.Module):
    """Base of the compiled-kernel linears: x [..., K] -> [..., N] float32, bias added after. `kernel` is the
    weight's handle in model/kernels (layer.cpp's Linear), which the fused blocks call without Python."""

    KIND = -1  # layer.cpp's Linear kind: 0 q4, 1 q8, 2 float32, 3 affine q8
    TENSORS: tuple[str, ...] = ("words", "d", "m")  # the buffers holding the weight, in the kernel's order
    bias: torch.Tensor | None  # buffers (register_buffer), declared for the type checker

    def __init__(self, n: int, k: int, bias: torch.Tensor | None, *tensors: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = k, n
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(), persistent=False)
        for name, t in zip(self.TENSORS, tensors, strict=True):
            self.register_buffer(name, t.contiguous(), persistent=False)
        self.kernel = self._handle()

    def _handle(self):
        tensors = self.weight_tensors()
        a, b, c = (*tensors, *[tensors[0]] * (3 - len(tensors)))  # unused operands: any tensor
        return compiled().Linear(self.KIND, a, b, c, self.bias, self.out_features)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The buffers holding the weight, in the kernel's order (TENSORS)."""
        return [getattr(self, name) for name in self.TENSORS]

    def use(self, tensors: list[torch.Tensor]) -> None:
        """Hold the weight in `tensors` from now on: equal copies of weight_tensors() (model/huge_pages.py's),
        which the kernel handle then reads; the old ones are dropped here."""
        for name, t in zip(self.TENSORS, tensors, strict=True):
            setattr(self, name, t)  # a registered buffer's slot
        self.kernel = self._handle()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features).float().contiguous())  # [M, N]
        return y.view(*lead, self.out_features)

    def dense(self) -> torch.Tensor:
        """The weight as floats [N, K] (training and analysis code, not the serving path)."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> Kernel:
        """The same kind of linear over the output rows `ids` only (a drafter's head restricted to its
        vocabulary computes exactly as the served head does there)."""
        raise NotImplementedError

    def _bias_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias[ids]


class Blocks(Kernel):
    """Q4 or Q8 blocks, held interleaved as the kernels read them (model/quant.py's Interleaved)."""

    words: torch.Tensor  # buffers, as in Interleaved
    d: torch.Tensor
    m: torch.Tensor | None

    def __init__(self, w: Q4 | Q8 | Interleaved, bias=None):
        w = w if isinstance(w, Interleaved) else Interleaved.of(w)
        super().__init__(*w.shape, bias, w.words, w.d, *([] if w.m is None else [w.m]))
        if w.m is None:  # a Q8 without offsets: `m` is None, as in Interleaved
            self.register_buffer("m", None, persistent=False)

    def interleaved(self) -> Interleaved:
        """The weight's tensors (shared, not copied)."""
        return Interleaved(self.words, self.d, self.m, self.out_features)

    def dense(self):
        return self.interleaved().dequantize()

    def rows(self, ids):
        w = self.interleaved().plain()
        if isinstance(w, Q4):
            return type(self)(Q4(w.qs[ids], w.d[ids], w.m[ids]), self._bias_rows(ids))
        return type(self)(Q8(w.qs[ids], w.d[ids], None if w.m is None else w.m[ids]), self._bias_rows(ids))


class Q4Linear(Blocks):
    KIND = 0


class Q8Linear(Blocks):
    KIND = 1
    TENSORS: tuple[str, ...] = ("words", "d")


class AffineQ8Linear(Q8Linear):
    """Q8 blocks with offsets (w = d q + m): Q5_1, Q5_K, Q2_K, and Q4 rows fused with 8-bit ones."""

    KIND = 3
    TENSORS = ("words", "d", "m")


def q8_linear(w: Q8, bias: torch.Tensor | None = None) -> Blocks:
    """The kernel linear of a Q8 matrix, affine or not."""
    return (Q8Linear if w.m is None else AffineQ8Linear)(w, bias)


class F32Linear(Kernel):
    KIND = 2
    TENSORS = ("weight",)
    weight: torch.Tensor  # the buffer

    def __init__(self, w: torch.Tensor, bias=None):
        super().__init__(*w.shape, bias, w.float())

    def dense(self):
        return self.weight

    def rows(self, ids):
        return F32Linear(self.weight[ids], self._bias_rows(ids))


class DenseLinear(nn.Module):
    """bf16 / fp16 weights: oneDNN's packed bf16 kernel where the CPU has it, else F.linear."""

    weight: torch.Tensor  # buffers
    bias: torch.Tensor | None

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        w = w.to(dtype)
        self.packed = dtype == torch.bfloat16 and onednn_bf16()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(w, 1) if self.packed else w,
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in] -> [..., out]
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense(self) -> torch.Tensor:
        if not self.packed:
            return self.weight
        return self(torch.eye(self.in_features, dtype=self.weight.dtype)).T.contiguous()  # [N, K]

    def rows(self, ids: torch.Tensor) -> DenseLinear:
        w = self.dense()[ids]
        return DenseLinear(w, None if self.bias is None else self.bias[ids], w.dtype)


Linear = Kernel | DenseLinear  # what make_linear builds: x [..., K] -> [..., N], with dense() and rows()


def bytes_per_param(fmt: WeightFormat, from_gguf: bool) -> float:
    """Bytes a layer matrix's parameter takes in `fmt`, before loading (the planner's and a worker's budget
    check): Q4 blocks hold 16 bytes of nibbles and two float32 per 32 (0.75), Q8 32 + 4 (1.125). `auto` on a GGUF
    counts Q4 (the common download); after loading, workers report the bytes their tensors really hold."""
    kind = fmt.layers if fmt.layers != "source" else ("q4" if from_gguf else "dense")
    return {"q4": 0.75, "q8": 1.125}.get(kind, torch.finfo(fmt.act).bits / 8)


def make_linear(w: Matrix, bias: torch.Tensor | None, fmt: WeightFormat, role: str = "layers") -> Linear:
    """The linear layer for matrix `w` [N, K] (as the source holds it) in format `fmt`; role "layers" or "head"."""
    want = fmt.layers if role == "layers" else fmt.head
    if want == "dense" and fmt.act != torch.float32:
        return DenseLinear(dequantized(w), bias, fmt.act)
    k = w.shape[1]
    if k % 32:  # blocks need K in multiples of 32; the dense kernel needs 8
        want = "dense"
    if want == "source":
        want = "q4" if isinstance(w, Q4) else "q8" if isinstance(w, Q8) else "dense"
    if want == "q4":
        return Q4Linear(w if isinstance(w, Q4) else quantize_q4(dequantized(w)), bias)
    if want == "q8":
        return q8_linear(as_q8(w), bias)
    dense = dequantized(w)
    if k % 8:
        return DenseLinear(dense, bias, torch.float32)
    return F32Linear(dense, bias)


def head_matrix(w: Matrix, fmt: WeightFormat) -> Matrix:
    """What an embedding table shared with the head is held as: Q8 when the head runs at 8 bits."""
    if fmt.head == "q8" or (fmt.head == "source" and not isinstance(w, torch.Tensor)):
        return as_q8(w)
    return dequantized(w)


def linear_bytes(module: nn.Module) -> int:
    """Bytes of the weights under `module`, as held (packed or quantized), counted from the tensors."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t is None:
            continue
        # oneDNN's packed bf16 weights (DenseLinear on a CPU with AVX-512 bf16) are opaque: no storage to share
        key = t.data_ptr() if t.layout == torch.strided else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


M = TypeVar("M", bound=nn.Module)


def pack_linears(module: M) -> M:
    """Replace every nn.Linear under `module` (a drafter's or Medusa's layers), in place, by a kernel linear:
    float32 ones by Q8 blocks where K allows (a draft need not be exact, and it then runs the served
    kernels: one call per layer instead of torch's ~20 ops, and 3.6x fewer bytes than float32), bf16 ones by
    a DenseLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
            setattr(module, name, DenseLinear(child.weight.detach(), child.bias, torch.bfloat16))
        elif isinstance(child, nn.Linear) and child.weight.dtype == torch.float32 and child.in_features % 32 == 0:
            bias = None if child.bias is None else child.bias.detach()
            setattr(module, name, Q8Linear(as_q8(child.weight.detach()), bias))
        else:
            pack_linears(child)
    return module
