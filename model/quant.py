"""Block-quantized weight matrices as the kernels take them, read from GGUF blocks or quantized at load.

Both kinds keep a matrix [N, K] in blocks of 32 consecutive elements of a row:
- Q4: 4-bit q in 0..15 with w = d q + m (Q4_1 as is; Q4_0 is m = -8 d; Q4_K's sub-blocks map the same way).
  qs [N, K/2] uint8: in each block's 16 bytes, element i is the low nibble of byte i, element i + 16 the high
  nibble (GGUF's own Q4_0/Q4_1 order). d, m [N, K/32] float32 (GGUF stores fp16: widening is exact).
- Q8: int8 q with w = d q (Q8_0). qs [N, K] int8, d [N, K/32] float32.
Rows can be taken and concatenated (a stage's KV groups), and columns in whole blocks (a group's share of the
output projection), without dequantizing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # elements per block


@dataclass(frozen=True)
class Q4:
    qs: torch.Tensor  # [N, K/2] uint8
    d: torch.Tensor  # [N, K/32] float32
    m: torch.Tensor  # [N, K/32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + self.m.nbytes

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        blocks = self.qs.view(n, k // QK, 16)  # low nibbles are elements 0..15 of a block, high ones 16..31
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).float()  # [N, K/32, 32]
        return (q * self.d[..., None] + self.m[..., None]).reshape(n, k)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [...] -> [..., K] float32 (an embedding lookup: d q + m in float32, as llama.cpp's get_rows)
        k = self.shape[1]
        blocks = self.qs[ids].view(*ids.shape, k // QK, 16)
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).float()  # [..., K/32, 32]
        return (q * self.d[ids][..., None] + self.m[ids][..., None]).reshape(*ids.shape, k)


@dataclass(frozen=True)
class Q8:
    qs: torch.Tensor  # [N, K] int8
    d: torch.Tensor  # [N, K/32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qs.shape)

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return (self.qs.view(n, k // QK, QK).float() * self.d[..., None]).reshape(n, k)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [...] -> [..., K] float32 (an embedding lookup: exact, d q in float32)
        k = self.qs.shape[1]
        q = self.qs[ids].float().view(*ids.shape, k // QK, QK)
        return (q * self.d[ids][..., None]).reshape(*ids.shape, k)


GROUP = 8  # weight rows per interleaved group (the kernels' layout)


@dataclass(frozen=True)
class Interleaved:
    """A Q4 or Q8 matrix in the layout the kernels read (model/kernels/quant.cpp): rows in groups of 8 (zero
    rows pad the last group) and, for each group and block, each row's 4-byte words side by side, so that one
    32-byte load holds 4 elements of 8 rows. The bytes are the plain matrix's, moved, not re-encoded."""

    words: torch.Tensor  # [G, K/32, W, 8] int32: W = 4 for Q4 (nibbles), 8 for Q8
    d: torch.Tensor  # [G, K/32, 8] float32
    m: torch.Tensor | None  # [G, K/32, 8] float32 for Q4, None for Q8
    n: int  # rows of the matrix (the last group may hold fewer)

    @classmethod
    def of(cls, w: Q4 | Q8) -> Interleaved:
        n, k = w.shape
        g = -(-n // GROUP)

        def grouped(t: torch.Tensor) -> torch.Tensor:
            # [N, nb, ...] -> [G, nb, ..., 8]
            t = torch.cat([t, t.new_zeros(g * GROUP - n, *t.shape[1:])])
            return t.view(g, GROUP, *t.shape[1:]).movedim(1, -1).contiguous()

        words = grouped(w.qs.contiguous().view(torch.int32).view(n, k // QK, -1))
        return cls(words, grouped(w.d), grouped(w.m) if isinstance(w, Q4) else None, n)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.d.shape[1] * QK

    def plain(self) -> Q4 | Q8:
        """The matrix as Q4 / Q8 in rows (analysis, row selection; not the serving path)."""
        n = self.n

        def ungrouped(t: torch.Tensor) -> torch.Tensor:
            # [G, nb, ..., 8] -> [N, nb * ...]
            t = t.movedim(-1, 1)
            return t.reshape(t.shape[0] * GROUP, -1)[:n].contiguous()

        qs = ungrouped(self.words)
        if self.m is None:
            return Q8(qs.view(torch.int8), ungrouped(self.d))
        return Q4(qs.view(torch.uint8), ungrouped(self.d), ungrouped(self.m))

    def dequantize(self) -> torch.Tensor:
        return self.plain().dequantize()

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] as floats [..., K] without unpacking the rest (a tied embedding's lookup); Q8 only,
        the same values as Q8.dequantize_rows."""
        assert self.m is None, "row lookup is for Q8 tables"
        from edgespec.model.kernels import load  # compiled: the same lookup in torch ops took 100 us per token

        return load().q8_rows(self.words, self.d, ids.reshape(-1)).view(*ids.shape, self.shape[1])


Matrix = Q4 | Q8 | torch.Tensor


def dequantized(w: Matrix) -> torch.Tensor:
    """The matrix as float32 values (a dense one as it is)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def _fields(w: Q4 | Q8) -> dict[str, torch.Tensor]:
    return {"qs": w.qs, "d": w.d} | ({"m": w.m} if isinstance(w, Q4) else {})


def take_cols(w: Matrix, ranges: Sequence[tuple[int, int]]) -> Matrix:
    """Columns [lo, hi) of each range, concatenated; quantized matrices only in whole blocks."""
    if isinstance(w, torch.Tensor):
        return torch.cat([w[:, lo:hi] for lo, hi in ranges], dim=1)
    if any(lo % QK or hi % QK for lo, hi in ranges):
        raise ValueError(f"columns of a block-quantized matrix must be cut at multiples of {QK}, got {ranges}")
    per = {"qs": 16 if isinstance(w, Q4) else QK, "d": 1, "m": 1}
    return type(w)(**{k: torch.cat([v[:, lo // QK * per[k]:hi // QK * per[k]] for lo, hi in ranges], dim=1).contiguous()
                      for k, v in _fields(w).items()})


def cat_rows(ws: Sequence[Matrix]) -> Matrix:
    """Matrices of one kind stacked by rows (q, k and v into one qkv)."""
    kinds = {type(w) for w in ws}
    if len(kinds) != 1:  # mixed formats (a GGUF may keep v at more bits): the finer one for all
        ws = [as_q8(w) if not isinstance(w, torch.Tensor) else w for w in ws]
        if len({type(w) for w in ws}) != 1:
            ws = [dequantized(w) for w in ws]
    first = ws[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(ws))
    return type(first)(**{k: torch.cat([_fields(w)[k] for w in ws]) for k in _fields(first)})


def quantize_q4(w: torch.Tensor) -> Q4:
    """Q4_1-style min/max quantization of a float matrix [N, K] (K a multiple of 32)."""
    n, k = w.shape
    b = w.float().reshape(n, k // QK, QK)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((b - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)  # [N, K/32, 32]
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return Q4(qs.contiguous(), d.contiguous(), lo.contiguous())


def quantize_q8(w: torch.Tensor) -> Q8:
    """Q8_0 quantization of a float matrix [N, K]: d = max|w| / 127 per block."""
    n, k = w.shape
    b = w.float().reshape(n, k // QK, QK)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (b * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Q8(q.reshape(n, k).contiguous(), d.contiguous())


def as_q8(w: Matrix) -> Q8:
    """A matrix at 8 bits: Q8 as is; Q4 and dense matrices by Q8_0 quantization of their values (from Q4 blocks
    that is a second rounding: `edgespec eval-formats` measures q8_0 of the Q4_1 GGUF below Q4_1 itself)."""
    if isinstance(w, Q8):
        return w
    return quantize_q8(w.dequantize() if isinstance(w, Q4) else w)


# --- GGUF blocks -----------------------------------------------------------------------------------------

def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def q4_from_gguf(raw: np.ndarray, kind: str) -> Q4:
    """GGUF rows of Q4_0 (18 bytes per block: d, qs) or Q4_1 (20: d, m, qs), raw [N, bytes] -> Q4."""
    n = raw.shape[0]
    size = 18 if kind == "Q4_0" else 20
    blocks = raw.reshape(n, -1, size)
    d = _f16(blocks[..., 0:2]).view(n, -1)
    m = -8 * d if kind == "Q4_0" else _f16(blocks[..., 2:4]).view(n, -1)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., size - 16:]).reshape(n, -1))
    return Q4(qs, d.contiguous(), m.contiguous())


def q8_from_gguf(raw: np.ndarray) -> Q8:
    """GGUF rows of Q8_0 (34 bytes per block: d, 32 int8), raw [N, bytes] -> Q8."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    d = _f16(blocks[..., 0:2]).view(n, -1)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1))
    return Q8(qs, d.contiguous())


def q4_from_q4k(raw: np.ndarray) -> Q4:
    """GGUF rows of Q4_K (144 bytes per 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles)
    -> Q4 with one (d sc, -dmin mn) pair per 32 elements: the same values, in fp32."""
    from gguf.quants import Q4_K

    n = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)  # [B, 8 sub-blocks, 32]: sub-block 2j low nibbles, 2j+1 high
    packed = q[..., :16] | (q[..., 16:] << 4)
    return Q4(torch.from_numpy(np.ascontiguousarray(packed).reshape(n, -1)),
              torch.from_numpy((d * sc.astype(np.float32)).reshape(n, -1)).contiguous(),
              torch.from_numpy((-dmin * mn.astype(np.float32)).reshape(n, -1)).contiguous())
