"""Embeddings from the served model: its last layer's hidden states after the final norm, mean-pooled over every
token of the input and scaled to unit length.

A causal LM has no pooling head; the mean over all positions (rather than the last token's state alone) is what
sentence-embedding work with decoder models found the more robust default. Each input is one sequence of the
engine, so the inputs of a request, and other requests' steps, share passes. Its prefill is computed whole
(opened without prefix reuse): the mean needs every position's state.
"""

from __future__ import annotations

import asyncio

import torch

from edgespec.model.engine import Rows


async def embed(runner, inputs: list[list[int]]) -> list[list[float]]:
    """One unit vector of hidden_size floats per input (token ids, each non-empty)."""
    return list(await asyncio.gather(*(_one(runner, ids) for ids in inputs)))


async def _one(runner, ids: list[int]) -> list[float]:
    session = await runner.open(len(ids))
    try:
        events = [e async for e in runner.engine.run(session, _program(runner, ids))]
        return events[-1]
    finally:
        await runner.release(session)


def _program(runner, ids: list[int]):
    # the engine's program (on the model thread): the input in one plan, its states pooled
    out = yield Rows(ids, last_only=True, features=True)
    with torch.inference_mode():
        states = runner.ends.norm(out.hidden[0].to(runner.ends.dtype)).float()  # [T, H]
        mean = states.mean(dim=0)  # [H]
        yield (mean / mean.norm().clamp_min(1e-12)).tolist()
