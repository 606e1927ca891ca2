"""Batched expansion on the tiny model (float32): rows with suffixes of different lengths after one shared
prefix give each row exactly the greedy tokens it gets alone, and finished rows retire."""

from __future__ import annotations

import asyncio

import torch

from decoding.naive import NaivePolicy
from decoding.outline_batch import expand
from decoding.types import GenerationRequest, SamplingParams

PREFIX = [(i % 11) + 200 for i in range(40)]
SUFFIXES = [[300, 301, 302], [310, 311, 312, 313, 314, 315, 316], [320], [330, 331, 332, 333, 334]]
BUDGETS = [10, 4, 12, 7]


def alone(loaded, prompt: list[int], n: int) -> list[int]:
    request = GenerationRequest(prompt, n, SamplingParams(temperature=0.0))

    async def run():
        return [t async for e in NaivePolicy().generate(request, loaded.runner, loaded.tokenizer) for t in e.token_ids]

    return asyncio.run(run())


def test_batched_rows_equal_each_row_alone_and_retire(tiny_loaded):
    steps, seen = [], {row: [] for row in range(len(SUFFIXES))}

    def choose(row, logits):  # logits [V]: kept to compare with the row computed alone
        seen[row].append(logits.clone())
        return int(logits.argmax())

    async def run():
        async for step in expand(tiny_loaded.runner, PREFIX, SUFFIXES, BUDGETS, choose, frozenset()):
            steps.append(step)

    asyncio.run(run())
    got = {row: [t for step in steps for r, t in step if r == row] for row in range(len(SUFFIXES))}
    runner = tiny_loaded.runner

    async def plain(seq: list[int]) -> torch.Tensor:
        session = await runner.open(len(seq))
        try:
            return (await runner.forward(session, torch.tensor([seq])))[0]
        finally:
            await runner.release(session)

    for row, (suffix, budget) in enumerate(zip(SUFFIXES, BUDGETS, strict=True)):
        assert got[row] == alone(tiny_loaded, PREFIX + suffix, budget), row
        # the logits too (greedy tokens of a tiny random model barely depend on positions)
        want = asyncio.run(plain(PREFIX + suffix + got[row][:-1]))[-budget:]
        torch.testing.assert_close(torch.stack(seen[row]), want, atol=1e-4, rtol=1e-4)
    assert [len(s) for s in steps] == [4] * 4 + [3] * 3 + [2] * 3 + [1] * 2  # rows leave as they finish


def test_a_stop_token_retires_its_row(tiny_loaded):
    first = alone(tiny_loaded, PREFIX + SUFFIXES[0], 3)
    steps = []

    async def run():
        async for step in expand(tiny_loaded.runner, PREFIX, SUFFIXES[:2], [8, 8],
                                 lambda row, logits: int(logits.argmax()), frozenset({first[1]})):
            steps.append(step)

    asyncio.run(run())
    row0 = [t for step in steps for r, t in step if r == 0]
    assert row0 == first[:2] or first[0] == first[1]  # ends at the stop token (inclusive)
    assert torch.tensor([len(s) for s in steps]).le(2).all()
