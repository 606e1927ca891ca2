"""The engine (model/engine.py): concurrent sequences' steps run as one pass over all their rows, and every
sequence gets exactly what it gets alone. A long prompt beside running sequences is prefilled in chunks
that join their steps, with the same result as one pass (tiny model, float32, the compiled row-invariant
kernels)."""

from __future__ import annotations

import asyncio

import torch

from edgespec.model.engine import Propose, Rows


def greedy_program(prompt: list[int], n: int, out_tokens: list[int]):
    """A program of n greedy tokens after `prompt`; the tokens go to out_tokens, and the last yield is them."""
    out = yield Rows(prompt, last_only=True)
    for _ in range(n):
        out_tokens.append(int(out.logits[0, -1].argmax()))
        out = yield Rows([out_tokens[-1]])
    yield list(out_tokens)


async def greedy(runner, prompt: list[int], n: int) -> list[int]:
    session = await runner.open(len(prompt) + n + 1)
    try:
        events = [e async for e in runner.engine.run(session, greedy_program(prompt, n, []))]
        return events[-1]
    finally:
        await runner.release(session)


def prompts(vocab: int) -> list[list[int]]:
    return [[(i * 7 + s) % vocab for i in range(5 + 3 * s)] for s in range(4)]


def test_concurrent_sequences_share_steps_and_decode_as_alone(tiny_loaded):
    runner = tiny_loaded.runner
    ps = prompts(runner.cfg.vocab_size)
    alone = [asyncio.run(greedy(runner, p, 12)) for p in ps]
    engine = runner.engine
    steps, calls = engine.shared_steps, engine.shared_calls

    async def together():
        return await asyncio.gather(*(greedy(runner, p, 12) for p in ps))

    assert asyncio.run(together()) == alone
    assert engine.shared_steps > steps and engine.shared_calls - calls > engine.shared_steps - steps  # several each


def test_a_long_prompt_beside_running_sequences_prefills_in_chunks_with_the_bits_of_one_pass(tiny_loaded):
    runner = tiny_loaded.runner
    vocab = runner.cfg.vocab_size
    long_prompt = [(i * 13 + 1) % vocab for i in range(3 * (runner.engine.STEP_ROWS - 2) + 5)]

    def prefill_program(got: list):
        out = yield Rows(long_prompt, last_only=True, features=True)
        got.append((out.logits, out.hidden))

    async def prefill(with_others: bool):
        others = [await runner.open(64) for _ in range(2 if with_others else 0)]
        session = await runner.open(len(long_prompt) + 1)
        got: list = []
        try:
            streams = [runner.engine.run(s, greedy_program([3, 4], 30, [])) for s in others]
            drain = [asyncio.ensure_future(_drain(s)) for s in streams]
            async for _ in runner.engine.run(session, prefill_program(got)):
                pass
            await asyncio.gather(*drain)
            return got[0][0], got[0][1], session.passes
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
    assert (one, chunks) == (1, 4)  # alone in one pass; beside 2 decode rows, in chunks of STEP_ROWS - 2
    assert torch.equal(chunked, whole)  # the first token's logits
    assert chunked_hidden.shape == whole_hidden.shape == (1, len(long_prompt), runner.cfg.hidden_size)
    assert torch.equal(chunked_hidden, whole_hidden)  # every prompt position's features (a feature drafter's)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


class Counter:
    """A batched proposer that answers each request with its double and records each call's size."""

    def __init__(self, fail_on: int | None = None):
        self.calls: list[int] = []
        self.fail_on = fail_on

    def propose_batch(self, requests: list[int]) -> list[int]:
        self.calls.append(len(requests))
        if self.fail_on in requests:
            raise ValueError("a proposer failure")
        return [2 * r for r in requests]


def asking_program(prompt: list[int], n: int, proposer: Counter, answers: list[int]):
    """Greedy tokens, asking the proposer between every two steps."""
    out = yield Rows(prompt, last_only=True)
    for i in range(n):
        answers.append((yield Propose(proposer, i)))
        out = yield Rows([int(out.logits[0, -1].argmax())])
    yield list(answers)


def test_the_proposals_of_sequences_between_two_steps_are_answered_in_one_call(tiny_loaded):
    """Medusa's heads go through this: every sequence that asks a proposer between the same two steps gets its
    answer from one batched call, and a proposer's failure fails only the sequences that asked it."""
    runner = tiny_loaded.runner
    ps = prompts(runner.cfg.vocab_size)[:3]
    proposer = Counter()

    async def run(program):
        session = await runner.open(64)
        try:
            return [e async for e in runner.engine.run(session, program)][-1]
        finally:
            await runner.release(session)

    async def together():
        return await asyncio.gather(*(run(asking_program(p, 5, proposer, [])) for p in ps))

    assert asyncio.run(together()) == [[0, 2, 4, 6, 8]] * 3
    assert max(proposer.calls) == 3 and sum(proposer.calls) == 15  # all three asked together (most steps)

    failing = Counter(fail_on=2)

    async def mixed():
        return await asyncio.gather(run(asking_program(ps[0], 5, failing, [])), greedy(runner, ps[1], 5),
                                    return_exceptions=True)

    bad, good = asyncio.run(mixed())
    assert isinstance(bad, ValueError) and good == asyncio.run(greedy(runner, ps[1], 5))
