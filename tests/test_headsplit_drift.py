"""HeadSplit's profiling on the tiny model (float32): the layer halves compose to the layer, the drift is
||Z - X|| / ||X|| of those halves at every layer and position, alpha is read from the previous layer's drift,
speculation at epsilon 0 is the exact model and a kept speculation changes the outputs, and the block timer
measures every block."""

from __future__ import annotations

import torch

from edgespec.model.blocks import causal_mask
from edgespec.model.drift import acceptance, drift, speculating_forward, time_blocks


def test_drift_is_the_relative_change_the_ffn_makes(tiny_loaded):
    stack = tiny_loaded.executor.pipeline.stages[0].stack
    ids = torch.tensor([[(i * 7) % 50 + 100 for i in range(12)]])
    hidden = tiny_loaded.executor.ends.embed_tokens(ids)  # [1, 12, H]
    got = drift(stack, hidden)
    assert got.shape == (len(stack.layers), 12)
    with torch.inference_mode():  # by hand, from the plain layers
        cache, x = stack.new_cache(12), hidden
        rope, mask = stack.rotary(torch.arange(12).unsqueeze(0)), causal_mask(0, 12)
        for i, layer in enumerate(stack.layers):
            z = x + layer.attn(layer.input_norm(x), rope, cache, i, 0, mask)
            x = layer(x, rope, stack.new_cache(12), i, 0, mask)  # the whole layer, fresh cache: same X
            want = (z - x).norm(dim=-1)[0] / x.norm(dim=-1)[0]
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


def test_alpha_reads_the_previous_layers_drift():
    drifts = [torch.tensor([[0.01, 0.2], [0.3, 0.04], [0.5, 0.5]]), torch.tensor([[0.02], [0.01], [0.9]])]
    assert acceptance(drifts, 0.05) == [0.0, round(2 / 3, 4), round(2 / 3, 4)]
    assert acceptance(drifts, 0.0) == [0.0, 0.0, 0.0]
    assert acceptance(drifts, 1.0) == [0.0, 1.0, 1.0]


def test_every_block_is_timed(tiny_loaded):
    stack = tiny_loaded.executor.pipeline.stages[0].stack
    times = time_blocks(stack, context=16, reps=2)
    assert set(times) == {"group_ms", "proj_ms", "ffn_ms"} and all(v > 0 for v in times.values())


def test_speculation_at_epsilon_zero_is_exact_and_kept_speculation_is_not(tiny_loaded):
    stack = tiny_loaded.executor.pipeline.stages[0].stack
    ids = torch.tensor([[(i * 5) % 60 + 90 for i in range(10)]])
    hidden = tiny_loaded.executor.ends.embed_tokens(ids)
    with torch.inference_mode():
        exact = stack(hidden, torch.arange(10).unsqueeze(0), stack.new_cache(10), 0)
    every = [True] * len(stack.layers)
    out, kept = speculating_forward(stack, hidden, 0.0, every)
    assert torch.equal(out, exact) and kept == [0] * len(stack.layers)
    out, kept = speculating_forward(stack, hidden, float("inf"), every)  # every speculation kept
    assert kept == [0] + [10] * (len(stack.layers) - 1)
    assert not torch.allclose(out, exact, atol=1e-4)
    # a layer that does not speculate keeps nothing, whatever epsilon
    out, kept = speculating_forward(stack, hidden, float("inf"), [False] * len(stack.layers))
    assert torch.equal(out, exact) and sum(kept) == 0
    # the decision is per token: at an epsilon among layer 0's drifts, layer 1 keeps the tokens below it (layer 0
    # is exact in both runs; later layers' drifts move with the kept speculation)
    d = drift(stack, hidden)[0]
    eps = float(d.median())
    _, kept = speculating_forward(stack, hidden, eps, every)
    assert kept[1] == int((d < eps).sum()) and 0 < kept[1] < 10
