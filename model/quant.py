"""Block-quantized weight matrices as the kernels take them, read from GGUF blocks or quantized at load.

Both kinds keep a matrix [N, K] in blocks of 32 consecutive elements of a row:
- Q4: 4-bit q in 0..15 with w = d q + m (Q4_1 as is; Q4_0 is m = -8 d; Q4_K's sub-blocks map the same way).
  qs [N, K/2] uint8: in each block's 16 bytes, element i is the low nibble of byte i, element i + 16 the high
  nibble (GGUF's own Q4_0/Q4_1 order). d, m [N, K/32] float32 (GGUF stores fp16: widening is exact).
- Q8: int8 q with w = d q. qs [N, K] int8, d [N, K/32] float32, one scale per block (Q8_0, Q5_0, IQ4_NL, IQ4_XS),
  or d [N, K/16], one per half block (Q6_K, Q3_K: their sub-blocks of 16 each have a scale); affine where it has
  offsets m shaped as d, w = d q + m (Q5_1, Q5_K per block, Q2_K per half block, and a Q4 widened to 8 bits).
model/gguf_blocks.py reads each GGUF type into one of these, exactly: the same values as the file's.
Rows can be taken and concatenated (a stage's KV groups), and columns in whole blocks (a group's share of the
output projection), without dequantizing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    d: torch.Tensor  # [N, K/32] or [N, K/16] float32: a scale per block or per half block
    m: torch.Tensor | None = None  # offsets shaped as d, or None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    @property
    def sub(self) -> int:
        """Elements per scale: 32 or 16."""
        return self.qs.shape[1] // self.d.shape[1]

    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)

    def halves(self) -> Q8:
        """The same values with a scale (and offset) per half block: each block's twice."""
        if self.sub == QK // 2:
            return self
        d = self.d.repeat_interleave(2, dim=1)
        return Q8(self.qs, d, None if self.m is None else self.m.repeat_interleave(2, dim=1))

    def affine(self) -> Q8:
        """The same values with offsets (zero where it had none)."""
        return self if self.m is not None else Q8(self.qs, self.d, torch.zeros_like(self.d))

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(torch.arange(self.qs.shape[0]))

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [...] -> [..., K] float32 (an embedding lookup: exact, d q (+ m) in float32)
        k, sub = self.qs.shape[1], self.sub
        q = self.qs[ids].float().view(*ids.shape, k // sub, sub)
        w = q * self.d[ids][..., None]
        return (w if self.m is None else w + self.m[ids][..., None]).reshape(*ids.shape, k)


GROUP = 8  # weight rows per interleaved group (the kernels' layout)


@dataclass(frozen=True)
class Interleaved:
    """A Q4 or Q8 matrix in the layout the kernels read (model/kernels/quant.cpp): rows in groups of 8 (zero
    rows pad the last group) and, for each group and block, each row's 4-byte words side by side, so that one
    32-byte load holds 4 elements of 8 rows. The bytes are the plain matrix's, moved, not re-encoded."""

    words: torch.Tensor  # [G, K/32, W, 8] int32: W = 4 for Q4 (nibbles), 8 for Q8
    d: torch.Tensor  # [G, K/32, 8] float32 ([G, K/16, 8] for a Q8 with a scale per half block)
    m: torch.Tensor | None  # offsets shaped as d: Q4's, an affine Q8's; None for Q8 without
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
        return cls(words, grouped(w.d), None if w.m is None else grouped(w.m), n)

    @property
    def q4(self) -> bool:
        return self.words.shape[2] == 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.words.shape[1] * QK

    def plain(self) -> Q4 | Q8:
        """The matrix as Q4 / Q8 in rows (analysis, row selection; not the serving path)."""
        n = self.n

        def ungrouped(t: torch.Tensor) -> torch.Tensor:
            # [G, nb, ..., 8] -> [N, nb * ...]
            t = t.movedim(-1, 1)
            return t.reshape(t.shape[0] * GROUP, -1)[:n].contiguous()

        qs = ungrouped(self.words)
        if self.q4:
            assert self.m is not None, "Q4 blocks always have offsets"
            return Q4(qs.view(torch.uint8), ungrouped(self.d), ungrouped(self.m))
        return Q8(qs.view(torch.int8), ungrouped(self.d), None if self.m is None else ungrouped(self.m))

    def dequantize(self) -> torch.Tensor:
        return self.plain().dequantize()

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [...] as floats [..., K] without unpacking the rest (a tied embedding's lookup); Q8 only,
        the same values as Q8.dequantize_rows."""
        assert not self.q4, "row lookup is for Q8 tables"
        from edgespec.model.kernels import load  # compiled: the same lookup in torch ops took 100 us per token

        return load().q8_rows(self.words, self.d, self.m, ids.reshape(-1)).view(*ids.shape, self.shape[1])


Matrix = Q4 | Q8 | torch.Tensor


def dequantized(w: Matrix) -> torch.Tensor:
    """The matrix as float32 values (a dense one as it is)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def _fields(w: Q4 | Q8) -> dict[str, torch.Tensor]:
    return {"qs": w.qs, "d": w.d} | ({} if w.m is None else {"m": w.m})


def take_cols(w: Matrix, ranges: Sequence[tuple[int, int]]) -> Matrix:
    """Columns [lo, hi) of each range, concatenated; quantized matrices only in whole blocks."""
    if isinstance(w, torch.Tensor):
        return torch.cat([w[:, lo:hi] for lo, hi in ranges], dim=1)
    if any(lo % QK or hi % QK for lo, hi in ranges):
        raise ValueError(f"columns of a block-quantized matrix must be cut at multiples of {QK}, got {ranges}")
    scales = QK // w.sub if isinstance(w, Q8) else 1
    per = {"qs": 16 if isinstance(w, Q4) else QK, "d": scales, "m": scales}
    return type(w)(**{k: torch.cat([v[:, lo // QK * per[k]:hi // QK * per[k]] for lo, hi in ranges], dim=1).contiguous()
                      for k, v in _fields(w).items()})


def cat_rows(ws: Sequence[Matrix]) -> Matrix:
    """Matrices of one kind stacked by rows (q, k and v into one qkv)."""
    # mixed formats (a GGUF may keep v at more bits) become one that holds every value exactly: floats where
    # one is dense, else 8-bit blocks
    if any(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat([dequantized(w) for w in ws])
    blocks: Sequence[Q4 | Q8] = [w for w in ws if not isinstance(w, torch.Tensor)]  # all of them
    if len({type(w) for w in blocks}) != 1:
        blocks = [widened(w) for w in blocks]
    q8s = [w for w in blocks if isinstance(w, Q8)]
    if len(q8s) == len(blocks):  # a scale per half block for all, offsets for all where some have them
        if len({w.sub for w in q8s}) > 1:
            q8s = [w.halves() for w in q8s]
        if len({w.m is None for w in q8s}) > 1:
            q8s = [w.affine() for w in q8s]
        blocks = q8s
    first = blocks[0]
    return type(first)(**{k: torch.cat([_fields(w)[k] for w in blocks]) for k in _fields(first)})


def widened(w: Q4 | Q8) -> Q8:
    """A Q4 matrix as an affine Q8 holding the same values (its nibbles as bytes, its scales and offsets); a Q8
    as it is."""
    if isinstance(w, Q8):
        return w
    n, k = w.shape
    blocks = w.qs.view(n, k // QK, 16)
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).view(torch.int8).reshape(n, k)  # [N, K] in 0..15
    return Q8(q.contiguous(), w.d, w.m)


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
