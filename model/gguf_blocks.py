"""GGUF's quantized rows as the kernels' blocks (model/quant.py), exactly: the same values the file defines.

Every type llama.cpp's quantizer writes from Q8_0 down to Q2_K and IQ4_NL / IQ4_XS is a scale times a small
integer, the scale shared by 16 or 32 consecutive elements of a row, and sometimes an offset: Q4_0 / Q4_1 /
Q4_K fit the 4-bit blocks; Q8_0, Q5_0, IQ4_NL, IQ4_XS (a scale per 32), Q6_K and Q3_K (a scale per 16) the 8-bit
ones; Q5_1, Q5_K (an offset per 32) and Q2_K (per 16) the affine 8-bit ones. The scales and offsets are the
file's fp16 d and dmin times its small integer sub-block scales and mins, which float32 holds exactly, so
`dequantize()` of what these return equals gguf's own `dequantize` bit for bit (tests/test_gguf_blocks.py).
Element orders follow gguf-py's `quants.py`, the converter's reference for the block layouts. Only the IQ types
below 4 bits (which llama.cpp writes from an importance matrix) are not `exact_kinds`: gguf_source.py quantizes
their values to Q8_0 blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from edgespec.model.quant import Q4, Q8

QK_K = 256  # elements per K-quant super-block
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low nibbles are elements 0..15, the high ones 16..31 (every 4-bit type)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8(n: int, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> Q8:
    def rows(t):
        return torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32).reshape(n, -1))

    return Q8(torch.from_numpy(np.ascontiguousarray(q.astype(np.int8)).reshape(n, -1)), rows(d),
              None if m is None else rows(m))


def q4_0_1(raw: np.ndarray, kind: str) -> Q4:
    """Q4_0 (18 bytes per 32: d, qs) or Q4_1 (20: d, m, qs) rows, raw [N, bytes] -> Q4 (Q4_0 as m = -8 d)."""
    n = raw.shape[0]
    size = 18 if kind == "Q4_0" else 20
    blocks = raw.reshape(n, -1, size)
    d = torch.from_numpy(_f16(blocks[..., 0:2])).view(n, -1)
    m = -8 * d if kind == "Q4_0" else torch.from_numpy(_f16(blocks[..., 2:4])).view(n, -1)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[..., size - 16:]).reshape(n, -1))
    return Q4(qs, d.contiguous(), m.contiguous())


def q4_k(raw: np.ndarray) -> Q4:
    """Q4_K rows (144 bytes per 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) -> Q4 with
    one (d sc, -dmin mn) pair per 32 elements."""
    from gguf.quants import Q4_K

    n = raw.shape[0]
    blocks = raw.reshape(-1, 144)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)  # [B, 8 sub-blocks, 32]: sub-block 2j low nibbles, 2j+1 high
    packed = q[..., :16] | (q[..., 16:] << 4)
    return Q4(torch.from_numpy(np.ascontiguousarray(packed).reshape(n, -1)),
              torch.from_numpy((d * sc.astype(np.float32)).reshape(n, -1)).contiguous(),
              torch.from_numpy((-dmin * mn.astype(np.float32)).reshape(n, -1)).contiguous())


def q8_0(raw: np.ndarray) -> Q8:
    """Q8_0 rows (34 bytes per 32: d, 32 int8)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 34)
    return _q8(n, blocks[..., 2:].view(np.int8), _f16(blocks[..., 0:2]))


def q5_0(raw: np.ndarray) -> Q8:
    """Q5_0 rows (22 bytes per 32: d, 32 high bits, 16 bytes of nibbles): q - 16 in -16..15."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 22)
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [N, nb, 32]
    q = _nibbles(blocks[..., 6:]).astype(np.int16) | ((high & 1).astype(np.int16) << 4)
    return _q8(n, q - 16, _f16(blocks[..., 0:2]))


def q5_1(raw: np.ndarray) -> Q8:
    """Q5_1 rows (24 bytes per 32: d, m, 32 high bits, 16 bytes of nibbles): q in 0..31, w = d q + m."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 24)
    high = np.ascontiguousarray(blocks[..., 4:8]).view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [N, nb, 32]
    q = _nibbles(blocks[..., 8:]) | ((high & 1).astype(np.uint8) << 4)
    return _q8(n, q, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]))


def q5_k(raw: np.ndarray) -> Q8:
    """Q5_K rows (176 bytes per 256: d, dmin, 12 bytes of 6-bit scales and mins as Q4_K's, 32 bytes of high bits,
    128 of nibbles): q in 0..31, a scale d sc and an offset -dmin mn per 32."""
    from gguf.quants import Q4_K

    n = raw.shape[0]
    blocks = raw.reshape(-1, 176)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each
    low = (blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.reshape(-1, QK_K) | (high.reshape(-1, QK_K) << 4)
    return _q8(n, q, d * sc.astype(np.float32), -dmin * mn.astype(np.float32))


def q2_k(raw: np.ndarray) -> Q8:
    """Q2_K rows (84 bytes per 256: 16 bytes of 4-bit scale and min pairs, 64 of 2-bit q, d, dmin): q in 0..3, a
    scale d sc and an offset -dmin mn per 16."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 84)
    scales, d, dmin = blocks[:, :16], _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    q = (blocks[:, 16:80].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    return _q8(n, q, d * (scales & 0x0F).astype(np.float32), -dmin * (scales >> 4).astype(np.float32))


def iq4_nl(raw: np.ndarray) -> Q8:
    """IQ4_NL rows (18 bytes per 32: d, 16 bytes of nibbles indexing llama.cpp's 16 non-linear values)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 18)
    return _q8(n, IQ4_VALUES[_nibbles(blocks[..., 2:])], _f16(blocks[..., 0:2]))


def iq4_xs(raw: np.ndarray) -> Q8:
    """IQ4_XS rows (136 bytes per 256: d, 2 + 4 bytes of 6-bit sub-block scales ls, 128 bytes of nibbles): a scale
    d (ls - 32) per 32."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 136)
    d = _f16(blocks[:, 0:2])  # [B, 1]
    high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))  # [B, 8]
    low = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(-1, 8) & 0x0F
    ls = (low | ((high & 3).astype(np.uint8) << 4)).astype(np.int8) - 32
    q = IQ4_VALUES[_nibbles(blocks[:, 8:].reshape(-1, 8, 16))]  # [B, 8, 32]
    return _q8(n, q, d * ls.astype(np.float32))


def q6_k(raw: np.ndarray) -> Q8:
    """Q6_K rows (210 bytes per 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d): q - 32 in
    -32..31, a scale d sc per 16."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 210)
    ql = (blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (ql.reshape(-1, QK_K) | (qh.reshape(-1, QK_K) << 4)).astype(np.int16) - 32
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    return _q8(n, q, _f16(blocks[:, 208:210]) * sc)


def q3_k(raw: np.ndarray) -> Q8:
    """Q3_K rows (110 bytes per 256: 32 bytes of high-bit masks, 64 of 2-bit pairs, 12 of 6-bit scales, d): q in
    -4..3 (4 subtracted where the mask bit is 0), a scale d (sc - 32) per 16."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, 110)
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
    low = (scales[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    high = (scales[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).astype(np.int8) - 32
    ql = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = ql.reshape(-1, QK_K).astype(np.int16) - ((qh.reshape(-1, QK_K) ^ 1).astype(np.int16) << 2)
    return _q8(n, q, d * sc.astype(np.float32))


# kind -> reader of its rows [N, bytes]; every other quantized kind is dequantized and requantized to Q8_0
READERS: dict[str, Callable[[np.ndarray], Q4 | Q8]] = {
    "Q4_0": lambda raw: q4_0_1(raw, "Q4_0"), "Q4_1": lambda raw: q4_0_1(raw, "Q4_1"), "Q4_K": q4_k,
    "Q8_0": q8_0, "Q5_0": q5_0, "Q5_1": q5_1, "Q5_K": q5_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs,
    "Q6_K": q6_k, "Q3_K": q3_k, "Q2_K": q2_k}


def exact_kinds() -> frozenset[str]:
    """The GGUF types read into blocks holding exactly the file's values."""
    return frozenset(READERS)


def read_blocks(raw: np.ndarray, kind: str) -> Q4 | Q8:
    """Rows raw [N, bytes] of a quantized GGUF tensor of type `kind` (one of exact_kinds()) as Q4 or Q8."""
    return READERS[kind](raw)
