"""GGUF block types read into the kernels' blocks hold exactly the file's values: gguf-py's own `dequantize` (the
converter's reference for every layout) gives the same floats bit for bit, and a served matrix of each type
computes with those values; rows of different kinds fused into one matrix keep their values too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from edgespec.model.gguf_blocks import exact_kinds, read_blocks
from edgespec.model.linear import make_linear, weight_format
from edgespec.model.quant import Q8, cat_rows

N, K = 12, 512  # two K-quant super-blocks per row

# where each type keeps its fp16 scales (byte offsets in a block): set to finite values, every other byte random
FP16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q5_K": [0, 2],
           "IQ4_NL": [0], "IQ4_XS": [0], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82]}


def random_rows(kind: str, seed: int) -> np.ndarray:
    """N rows of K elements of `kind` [N, bytes]: random bytes (any bit pattern is a valid block) with finite
    scales."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N * K // block, size), dtype=np.uint8)
    for at in FP16_AT[kind]:
        raw[:, at:at + 2] = rng.uniform(-0.05, 0.05, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(N, -1)


def test_every_exact_kind_has_its_scales_listed():
    assert exact_kinds() == set(FP16_AT)


@pytest.mark.parametrize("kind", sorted(FP16_AT))
def test_blocks_hold_the_files_values_exactly(kind):
    raw = random_rows(kind, seed=len(kind))
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))  # [N, K]
    w = read_blocks(raw, kind)
    assert torch.equal(w.dequantize(), ref)
    if kind in ("Q6_K", "Q3_K"):  # their sub-blocks of 16 each keep a scale
        assert isinstance(w, Q8) and w.sub == 16
    # served as it is (weights auto): the compiled kernel with the file's values, 8-bit activations
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    y, exact = make_linear(w, None, weight_format("auto"))(x), x @ ref.T
    assert ((y - exact).norm() / exact.norm()).item() < 1e-2


def test_rows_of_mixed_kinds_fuse_without_changing_a_value():
    # Q4_K_M's attention: q and k in Q4_K, v in Q6_K (a scale per 16), fused into one qkv matrix
    parts = [read_blocks(random_rows(kind, seed), kind) for seed, kind in enumerate(["Q4_K", "Q4_K", "Q6_K", "Q5_1"])]
    fused = cat_rows(parts)
    assert isinstance(fused, Q8) and fused.sub == 16 and fused.m is not None
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(1))
    y, exact = make_linear(fused, None, weight_format("auto"))(x), x @ fused.dequantize().T
    assert ((y - exact).norm() / exact.norm()).item() < 1e-2
