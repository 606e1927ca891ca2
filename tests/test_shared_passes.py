"""The engine (engine/engine.py): concurrent sequences' steps run as one pass over all their rows, and every
sequence gets exactly what it gets alone. A long prompt beside running sequences is prefilled in chunks
that join their steps, with the same result as one pass (tiny model, float32, the compiled row-invariant
kernels)."""

from __future__ import annotations

import asyncio

import torch

from edgespec.engine.engine import Engine
from edgespec.engine.program import Job, Propose, Rows


def greedy_program(prompt: list[int], n: int, out_tokens: list[int]):
    """A program of n greedy tokens after `prompt`; the tokens go to out_tokens, and the last yield is them."""
    out = yield Rows(prompt, last_only=True)
    for _ in range(n):
        out_tokens.append(int(out.logits[0, -1].argmax()))
        out = yield Rows([out_tokens[-1]])
    yield list(out_tokens)


def greedy_job(prompt: list[int], n: int, capacity: int | None = None) -> Job:
    return Job(capacity or len(prompt) + n + 1, lambda seq: greedy_program(prompt, n, []))


async def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    events = [e async for e in engine.run(greedy_job(prompt, n))]
    return events[-1]


def prompts(vocab: int) -> list[list[int]]:
    return [[(i * 7 + s) % vocab for i in range(5 + 3 * s)] for s in range(4)]


def test_concurrent_sequences_share_steps_and_decode_as_alone(tiny_loaded):
    engine = Engine(tiny_loaded.executor)  # not closed: it would close the shared model's executor
    ps = prompts(engine.cfg.vocab_size)
    alone = [asyncio.run(greedy(engine, p, 12)) for p in ps]
    steps, calls = engine.shared_steps, engine.shared_calls

    async def together():
        return await asyncio.gather(*(greedy(engine, p, 12) for p in ps))

    assert asyncio.run(together()) == alone
    assert engine.shared_steps > steps and engine.shared_calls - calls > engine.shared_steps - steps  # several each


def test_a_long_prompt_beside_running_sequences_prefills_in_chunks_with_the_bits_of_one_pass(tiny_loaded):
    engine = Engine(tiny_loaded.executor)  # no prefix cache: a cold prompt both times
    vocab = engine.cfg.vocab_size
    long_prompt = [(i * 13 + 1) % vocab for i in range(3 * (engine.STEP_ROWS - 2) + 5)]

    def prefill_program(seq, got: list):
        out = yield Rows(long_prompt, last_only=True, features=True)
        got.append((out.logits, out.hidden, seq.passes))

    async def prefill(with_others: bool):
        # the others' sessions open (and they start decoding) before the long prompt's: run_group opens in turn
        others = [greedy_job([3, 4], 30, capacity=64) for _ in range(2 if with_others else 0)]
        got: list = []
        job = Job(len(long_prompt) + 1, lambda seq: prefill_program(seq, got))
        async for _ in engine.run_group([*others, job]):
            pass
        return got[0]

    whole, whole_hidden, one = asyncio.run(prefill(False))
    chunked, chunked_hidden, chunks = asyncio.run(prefill(True))
    assert (one, chunks) == (1, 4)  # alone in one pass; beside 2 decode rows, in chunks of STEP_ROWS - 2
    assert torch.equal(chunked, whole)  # the first token's logits
    assert chunked_hidden.shape == whole_hidden.shape == (1, len(long_prompt), engine.cfg.hidden_size)
    assert torch.equal(chunked_hidden, whole_hidden)  # every prompt position's features (a feature drafter's)


def test_a_prompts_chunk_fills_the_step_to_a_multiple_of_step_rows(tiny_loaded):
    engine = Engine(tiny_loaded.executor)
    rows, least = engine.STEP_ROWS, engine.MIN_CHUNK
    assert engine._chunk(2, 1) == rows - 2  # what the others leave of one step
    assert engine._chunk(0, 2) == rows // 2  # two prompts share it
    assert engine._chunk(rows - least, 1) == least
    # more others than leave a chunk: the step goes to the next multiple (a second tile costs the same full)
    assert engine._chunk(rows - least + 1, 1) == rows + least - 1
    assert engine._chunk(rows, 1) == rows
    assert engine._chunk(rows, 2) == rows // 2


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
    engine = Engine(tiny_loaded.executor)
    ps = [p[:5] for p in prompts(engine.cfg.vocab_size)[:3]]  # three prompts fill one step (STEP_ROWS)
    proposer = Counter()

    async def run(program):
        return [e async for e in engine.run(Job(64, lambda seq: program))][-1]

    async def together():
        # a group starts in one step (three gathered runs may open a step apart on a busy machine), so the three
        # ask between the same two steps every time
        jobs = [Job(64, lambda seq, p=p: asking_program(p, 5, proposer, [])) for p in ps]
        return [item async for _, item in engine.run_group(jobs)]

    assert asyncio.run(together()) == [[0, 2, 4, 6, 8]] * 3
    assert proposer.calls == [3] * 5  # one call per gap between steps, all three asking

    failing = Counter(fail_on=2)

    async def mixed():
        return await asyncio.gather(run(asking_program(ps[0], 5, failing, [])), greedy(engine, ps[1], 5),
                                    return_exceptions=True)

    bad, good = asyncio.run(mixed())
    assert isinstance(bad, ValueError) and good == asyncio.run(greedy(engine, ps[1], 5))
