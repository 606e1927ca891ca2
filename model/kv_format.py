"""How the KV cache stores keys and values: float32, float16 or q8_0 (`--kv-format`).

Every head vector [head_dim] of a slot is converted when it is written and on its own, so what a slot holds
depends only on the values written there, never on the pass that wrote them: the exactness across pass shapes
(a row gets the same bits alone, batched, in a chunk of a prompt) holds in every format. Readers see the stored
values as float32 (`decode`): a float16 value widened, a q8_0 value as `float(d) * q` (one rounded product), and
attention computes with those floats as it does with a float32 cache. The compiled kernels
(model/kernels/ops.cpp, layer.cpp) read the stored bytes in place with the same conversions and write with
`encode`'s arithmetic, bit for bit (tests/test_kv_format.py compares them).

- float32: the values as computed. 4 bytes a value.
- float16: rounded to nearest even (IEEE half). 2 bytes a value.
- q8_0: llama.cpp's block_q8_0 over each 32 values of a head vector: d = max|x| / 127 stored as a half, then
  the 32 values as int8 round(x / d) (to nearest even, x times the float 1/d, as ggml's quantize_row_q8_0 does
  with its own rounding). 34 bytes per 32 values: 1.0625 bytes a value, 0.266 of float32's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

KVFormatName = Literal["float32", "float16", "q8_0"]  # what settings and worker requests accept
Q8_BLOCK = 32  # values per q8_0 block
Q8_BYTES = 2 + Q8_BLOCK  # a half scale and 32 int8 values


@dataclass(frozen=True)
class KVFormat:
    """One storage format of the KV cache. A head vector of `head_dim` floats is stored as `row(head_dim)`
    elements of `dtype` (the last dim of the pool's tensors)."""

    name: str
    dtype: torch.dtype  # of the stored elements

    def row(self, head_dim: int) -> int:
        """Stored elements per head vector."""
        if self.name == "q8_0":
            return head_dim // Q8_BLOCK * Q8_BYTES
        return head_dim

    def bytes_per_value(self) -> float:
        """Bytes one key or value element takes (q8_0: its share of the block's scale included)."""
        return Q8_BYTES / Q8_BLOCK if self.name == "q8_0" else self.dtype.itemsize

    def check(self, head_dim: int) -> None:
        """ValueError where the format cannot hold heads of this size (q8_0 needs whole blocks of 32)."""
        if self.name == "q8_0" and head_dim % Q8_BLOCK:
            raise ValueError(f"the q8_0 KV cache needs head_dim % {Q8_BLOCK} == 0, the model's is {head_dim}")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hd] (any float dtype: widened to float32 first) -> stored [..., row(hd)] in `dtype`."""
        x = x.float()
        if self.name == "float16":
            return x.half()
        if self.name != "q8_0":
            return x
        blocks = x.reshape(*x.shape[:-1], -1, Q8_BLOCK)  # [..., nb, 32]
        d = blocks.abs().amax(-1, keepdim=True) / 127  # [..., nb, 1]
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = torch.round(blocks * inv).clamp_(-127, 127).to(torch.int8)
        out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [..., nb, 34]
        return out.reshape(*x.shape[:-1], -1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """stored [..., row] -> float32 [..., hd], the values every reader computes with."""
        if self.name != "q8_0":
            return stored.float()
        blocks = stored.reshape(*stored.shape[:-1], -1, Q8_BYTES)  # [..., nb, 34]
        d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [..., nb, 32]
        return (d * q).reshape(*stored.shape[:-1], -1)


FLOAT32 = KVFormat("float32", torch.float32)
KV_FORMATS = {f.name: f for f in (FLOAT32, KVFormat("float16", torch.float16), KVFormat("q8_0", torch.uint8))}
assert tuple(KV_FORMATS) == get_args(KVFormatName)


def kv_format(name: str | KVFormat) -> KVFormat:
    """The format named `name`; ValueError naming the valid ones."""
    if isinstance(name, KVFormat):
        return name
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; valid: {', '.join(KV_FORMATS)}") from None
