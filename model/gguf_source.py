"""Reads a GGUF file's tensors in the file's own quantization, by Hugging Face names, memory-mapped.

A stage asks for the matrices of its layers only and gets their blocks (model/quant.py) without a
dequantized copy: the 135M default holds 210 Q4_1 matrices, the Q8_0 embedding (tied with the head) and
61 F32 norms. For the architectures it writes through LlamaModel, llama.cpp's converter permutes the rows of q
and k (weights and biases) for its rotary layout; they are permuted back here (whole rows, so blocks stay
intact), as transformers' GGUF loader does. Names and that reordering come from the model's Architecture.
"""

from __future__ import annotations

import contextlib
import mmap
import re
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgespec.model.config import ModelConfig
from edgespec.model.gguf_blocks import exact_kinds, read_blocks
from edgespec.model.quant import Matrix, dequantized, quantize_q8, take_cols


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str  # GGML type name: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # rows first (numpy order), as GGUFReader reports `data.shape`
    offset: int  # absolute, in the file
    nbytes: int


# GGUF metadata value types whose size is fixed: type id -> struct format
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFIndex:
    """What read_index finds: the tensors by GGUF name, the data's alignment, and the metadata's scalar and string
    values by key (arrays, such as the tokenizer's, are skipped unless asked for: then a list)."""

    tensors: dict[str, TensorInfo]
    alignment: int
    meta: dict[str, object]


def read_index(path: Path, arrays: Collection[str] = ()) -> GGUFIndex:
    """The tensor index and scalar metadata of a GGUF file, without building the metadata's arrays as Python
    objects but those whose keys are in `arrays` (as lists): gguf's GGUFReader turns the tokenizer's 100k strings
    into arrays, which cost 3.5 s and 160 MB of resident memory for the 135M default; its tokenizer is read by
    transformers instead."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        def unpack(fmt: str):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def string() -> str:
            return f.read(unpack("Q")).decode("utf-8", errors="replace")

        def skip(kind: int, keep: bool = False) -> object:
            if kind in _SCALARS:
                return unpack(_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:  # array: element type, count, elements
                sub, n = unpack("I"), unpack("Q")
                if keep and sub in _SCALARS:
                    return list(struct.unpack(f"<{n}{_SCALARS[sub]}", f.read(n * struct.calcsize("<" + _SCALARS[sub]))))
                if keep:
                    return [skip(sub, keep) for _ in range(n)]
                if sub in _SCALARS:
                    f.seek(n * struct.calcsize("<" + _SCALARS[sub]), 1)
                else:
                    for _ in range(n):
                        skip(sub)
                return None
            raise ValueError(f"{path.name}: unknown GGUF metadata type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        unpack("I")  # version
        n_tensors, n_kv = unpack("Q"), unpack("Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            if (value := skip(unpack("I"), key in arrays)) is not None:
                meta[key] = value
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int):
            raise ValueError(f"{path.name}: general.alignment is {alignment!r}, not an integer")
        raw = []
        for _ in range(n_tensors):
            name = string()
            dims = [unpack("Q") for _ in range(unpack("I"))]
            kind, offset = GGMLQuantizationType(unpack("I")), unpack("Q")
            raw.append((name, dims, kind, offset))
        start = (f.tell() + alignment - 1) // alignment * alignment
    index = {}
    for name, dims, kind, offset in raw:
        block, size = GGML_QUANT_SIZES[kind]
        row_bytes = dims[0] // block * size  # GGUF lists the fastest dimension first
        shape = tuple(reversed(dims)) if kind.name == "F32" else (*reversed(dims[1:]), row_bytes)  # else in bytes
        nbytes = row_bytes * int(np.prod(dims[1:], dtype=np.int64))
        index[name] = TensorInfo(name, kind.name, shape, start + offset, nbytes)
    return GGUFIndex(index, alignment, meta)


# a mixture's stacked experts by their Hugging Face name (Architecture.hf_name of ffn_*_exps)
STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\w+_proj\.weight)")


class GGUFSource:
    """The tensors of a GGUF file by Hugging Face name: `matrix` in their own blocks, `get` dequantized."""

    def __init__(self, path: Path, cfg: ModelConfig):
        self.path, self.cfg = Path(path), cfg
        index = read_index(self.path).tensors
        self._tensors = {n: t for t in index.values() if (n := cfg.arch.hf_name(t.name))}
        # one expert's projection by the checkpoints' name (`mlp.experts.3.gate_proj.weight`) -> the stacked
        # tensor that holds every expert's (`mlp.experts.gate_proj.weight`, [E, N, K]) and its index there
        self._experts: dict[str, tuple[str, int]] = {}
        for name, t in self._tensors.items():
            if m := STACKED_EXPERTS.fullmatch(name):
                self._experts.update({f"{m[1]}.{e}.{m[2]}": (name, e) for e in range(t.shape[0])})
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")  # only what is read is paged in

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._experts

    def kind(self, name: str) -> str:
        return self._tensor(name).kind

    def _tensor(self, name: str):
        try:
            return self._tensors[self._experts[name][0] if name in self._experts else name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path.name}") from None

    def _raw_rows(self, name: str) -> np.ndarray:
        # [N, bytes per row] (quantized) or [N, K] / [N] (float), rows in Hugging Face order; one expert's rows
        # of a stacked tensor
        if name in self._experts:
            stacked, e = self._experts[name]
            return self._raw_rows(stacked)[e]
        t = self._tensor(name)
        data = self._map[t.offset:t.offset + t.nbytes]
        data = (data.view(np.float32) if t.kind == "F32" else data).reshape(t.shape)
        return self.cfg.arch.from_gguf(name, data, self.cfg.n_heads, self.cfg.n_kv_heads)

    def matrix(self, name: str, rows: Sequence[tuple[int, int]] | None = None,
               cols: Sequence[tuple[int, int]] | None = None) -> Matrix:
        """The matrix `name` [N, K] in the file's own blocks (Q4, Q8) or as float32, optionally only some rows
        or whole-block columns. The types of model/gguf_blocks.py come back holding the file's values exactly;
        the others (the IQ types below 4 bits) as Q8_0 blocks of their values."""
        raw = self._raw_rows(name)
        if rows is not None:
            raw = np.concatenate([raw[lo:hi] for lo, hi in rows])
        kind = self.kind(name)
        w: Matrix
        if kind in exact_kinds():
            w = read_blocks(raw, kind)
        else:
            w = self._dequantized(raw, kind)
            if kind not in ("F32", "F16", "BF16"):
                w = quantize_q8(w)
        self._drop_pages(self._tensor(name))
        return w if cols is None else take_cols(w, cols)

    def _drop_pages(self, t) -> None:
        # Every tensor is copied into the kernels' layout, so its pages of the mapped file are not needed again:
        # dropping them keeps them out of the process's resident memory (about 100 MB of a 135M model's peak).
        mapped = getattr(self._map, "_mmap", None)
        if mapped is None or not hasattr(mapped, "madvise"):
            return
        lo = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):  # a platform without it keeps the pages: no harm
            mapped.madvise(mmap.MADV_DONTNEED, lo, t.offset + t.nbytes - lo)

    def _dequantized(self, raw: np.ndarray, kind: str) -> torch.Tensor:
        # raw rows: float32 for F32, bytes otherwise -> float32 [N, K] (or [N] for a norm)
        if kind == "F32":
            return torch.from_numpy(np.array(raw, dtype=np.float32))
        if kind == "F16":
            return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))
        if kind == "BF16":
            bits = np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16
            return torch.from_numpy(bits.view(np.float32))
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor dequantized to `dtype` (norms, and the float reference formats)."""
        w = self.matrix(name) if len(self._tensor(name).shape) == 2 else self._dequantized(self._raw_rows(name), "F32")
        return dequantized(w).to(dtype)

    def rows(self, name: str, ranges, dtype: torch.dtype) -> torch.Tensor:
        return dequantized(self.matrix(name, rows=ranges)).to(dtype)

    def cols(self, name: str, ranges, dtype: torch.dtype) -> torch.Tensor:
        return dequantized(self.matrix(name, cols=ranges)).to(dtype)


