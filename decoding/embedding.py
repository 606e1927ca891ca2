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

from edgespec.engine.engine import Engine
from edgespec.engine.program import Job, Rows, SequenceView
from edgespec.model.stack import TokenEnds


async def embed(engine: Engine, inputs: list[list[int]]) -> list[list[float]]:
    """One unit vector of hidden_size floats per input (token ids, each non-empty)."""
    ends = engine.executor.ends
    return list(await asyncio.gather(*(_one(engine, ends, ids) for ids in inputs)))


async def _one(engine: Engine, ends: TokenEnds, ids: list[int]) -> list[float]:
    events = [e async for e in engine.run(Job(len(ids), lambda seq: _program(ends, seq, ids)))]
    vector = events[-1]  # the program's one event
    assert isinstance(vector, list)
    return vector


def _program(ends: TokenEnds, seq: SequenceView, ids: list[int]):
    # the engine's program (on the model thread): the input in one plan, its states pooled
    out = yield Rows(ids, last_only=True, features=True)
    with torch.inference_mode():
        states = ends.norm(out.hidden[0].to(ends.dtype)).float()  # [T, H]
        mean = states.mean(dim=0)  # [H]
        yield (mean / mean.norm().clamp_min(1e-12)).tolist()
