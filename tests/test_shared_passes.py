"""Concurrent requests share forward passes (model/runner.py): the steps of sessions waiting at the same moment
run as one pass over all their rows, and every session gets exactly what it gets alone. A long prompt beside
running streams is prefilled in chunks that join their passes, with the same result as one pass (tiny model,
float32, the compiled row-invariant kernels)."""

from __future__ import annotations

import asyncio

import torch


async def greedy(runner, prompt: list[int], n: int) -> list[int]:
    session = await runner.open(len(prompt) + n + 1, prompt=None)
    try:
        logits = await runner.prefill(session, prompt)
        out = []
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = await runner.forward(session, torch.tensor([[out[-1]]]))
        return out
    finally:
        await runner.release(session)


def prompts(vocab: int) -> list[list[int]]:
    return [[(i * 7 + s) % vocab for i in range(5 + 3 * s)] for s in range(4)]


def test_concurrent_streams_share_passes_and_decode_as_alone(tiny_loaded):
    runner = tiny_loaded.runner
    ps = prompts(runner.cfg.vocab_size)
    alone = [asyncio.run(greedy(runner, p, 12)) for p in ps]
    passes, calls = runner.passes, runner.batched_rows

    async def together():
        return await asyncio.gather(*(greedy(runner, p, 12) for p in ps))

    assert asyncio.run(together()) == alone
    assert runner.passes > passes and runner.batched_rows - calls > runner.passes - passes  # several per pass


def test_a_long_prompt_beside_running_streams_prefills_in_chunks_with_the_bits_of_one_pass(tiny_loaded):
    runner = tiny_loaded.runner
    vocab = runner.cfg.vocab_size
    long_prompt = [(i * 13 + 1) % vocab for i in range(3 * runner.PREFILL_CHUNK + 5)]

    async def prefill(with_others: bool):
        others = [await runner.open(64) for _ in range(2 if with_others else 0)]
        session = await runner.open(len(long_prompt) + 1)
        try:
            logits, hidden = await runner.prefill(session, long_prompt, then=lambda lg, h: (lg, h), features=True)
            return logits, hidden, session.passes
        finally:
            for s in [session, *others]:
                await runner.release(s)

    prefix = runner.prefix
    runner.prefix = None  # a cold prompt both times
    try:
        whole, whole_hidden, one = asyncio.run(prefill(False))
        chunked, chunked_hidden, chunks = asyncio.run(prefill(True))
    finally:
        runner.prefix = prefix
    assert (one, chunks) == (1, 4)  # alone in one pass; beside others in chunks of PREFILL_CHUNK
    assert torch.equal(chunked, whole)  # the first token's logits
    assert chunked_hidden.shape == whole_hidden.shape == (1, len(long_prompt), runner.cfg.hidden_size)
    assert torch.equal(chunked_hidden, whole_hidden)  # every prompt position's features (a feature drafter's)
