"""The engine's prefix cache by content (engine/prefix.py, engine/sessions.py), in-process (tiny model, float32):
a sequence's blocks stay cached however it ends (finished, cancelled after its first token, failed), a request
that arrives while another computes the same prompt waits for it and starts from its blocks, and every answer
that starts from cached blocks is a cold run's, bit for bit."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
import torch

from edgespec.engine.engine import Engine
from edgespec.engine.prefix import PrefixCache
from edgespec.engine.program import Job, Rows

SYSTEM = [(11 * i + 5) % 700 + 20 for i in range(150)]  # a shared "system prompt" of 150 tokens
QUESTIONS = [[31, 32, 33, 34], [41, 42, 43], [51, 52, 53, 54, 55]]


def greedy_job(prompt: list[int], n: int, seen: dict, fail_after: int | None = None) -> Job:
    """n greedy tokens after `prompt`, each yielded as an event; seen gets the session's cached prompt tokens and
    the first token's logits. fail_after: raise after that many tokens (a failed request)."""
    def program(seq):
        seen["cached"] = seq.cached
        out = yield Rows(prompt[seq.length:], last_only=True)
        seen["logits"] = out.logits[0, -1].clone()
        token = int(out.logits[0, -1].argmax())
        for i in range(n):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("a failure of the request's own")
            yield token
            out = yield Rows([token])
            token = int(out.logits[0, -1].argmax())

    return Job(len(prompt) + n + 1, program, prompt)


async def collect(engine: Engine, job: Job) -> list[int]:
    return [t async for t in engine.run(job)]


@pytest.fixture(scope="module")
def cold(tiny_loaded):
    """Every question's greedy tokens and first logits with nothing cached."""
    engine = Engine(tiny_loaded.executor)
    out = {}
    for i, q in enumerate(QUESTIONS):
        seen: dict = {}
        out[i] = (asyncio.run(collect(engine, greedy_job(SYSTEM + q, 6, seen))), seen["logits"])
    return out


def test_a_stream_closed_after_its_first_token_leaves_its_prompt_cached(tiny_loaded, cold):
    engine = Engine(tiny_loaded.executor, PrefixCache(2**30, min_tokens=8))

    async def scenario():
        first: dict = {}
        async with aclosing(engine.run(greedy_job(SYSTEM + QUESTIONS[0], 6, first))) as events:
            async for _ in events:
                break  # the client reads one token and goes away
        seen: dict = {}
        tokens = await collect(engine, greedy_job(SYSTEM + QUESTIONS[1], 6, seen))  # sent at once
        return first, seen, tokens

    first, seen, tokens = asyncio.run(scenario())
    assert first["cached"] == 0 and seen["cached"] == len(SYSTEM)
    assert tokens == cold[1][0] and torch.equal(seen["logits"], cold[1][1])
    assert engine.sessions.held == set()


def test_a_failed_request_leaves_its_prompt_cached(tiny_loaded, cold):
    engine = Engine(tiny_loaded.executor, PrefixCache(2**30, min_tokens=8))
    with pytest.raises(RuntimeError, match="of the request's own"):
        asyncio.run(collect(engine, greedy_job(SYSTEM + QUESTIONS[0], 6, {}, fail_after=2)))
    seen: dict = {}
    tokens = asyncio.run(collect(engine, greedy_job(SYSTEM + QUESTIONS[2], 6, seen)))
    assert seen["cached"] == len(SYSTEM) and tokens == cold[2][0] and torch.equal(seen["logits"], cold[2][1])


def test_requests_sent_together_compute_the_shared_prompt_once(tiny_loaded, cold):
    engine = Engine(tiny_loaded.executor, PrefixCache(2**30, min_tokens=8))
    rows_before = tiny_loaded.executor.step_rows

    async def together():
        seen = [{} for _ in QUESTIONS]
        tokens = await asyncio.gather(*(collect(engine, greedy_job(SYSTEM + q, 6, s))
                                        for q, s in zip(QUESTIONS, seen, strict=True)))
        return seen, tokens

    seen, tokens = asyncio.run(together())
    assert sorted(s["cached"] for s in seen) == [0, len(SYSTEM), len(SYSTEM)]  # the later ones waited for it
    for i, (q, s) in enumerate(zip(QUESTIONS, seen, strict=True)):
        assert tokens[i] == cold[i][0] and torch.equal(s["logits"], cold[i][1]), q
    # the system prompt's rows were computed once: then every prompt's own rows and 6 decoding rows each
    assert tiny_loaded.executor.step_rows - rows_before == len(SYSTEM) + sum(len(q) + 6 for q in QUESTIONS)


def test_without_a_prefix_cache_nothing_is_shared(tiny_loaded, cold):
    engine = Engine(tiny_loaded.executor)
    seen: dict = {}
    assert asyncio.run(collect(engine, greedy_job(SYSTEM + QUESTIONS[0], 6, seen))) == cold[0][0]
    assert seen["cached"] == 0


def test_kept_blocks_are_evicted_least_recently_used_when_the_pool_needs_them(tiny_loaded, cold):
    prefix = PrefixCache(2**30, min_tokens=8)
    engine = Engine(tiny_loaded.executor, prefix)
    for q in QUESTIONS:  # three kept sessions, each of its own prompt and tokens
        asyncio.run(collect(engine, greedy_job([q[0]] * 70 + q, 2, {})))
    assert prefix.kept == 3
    oldest = next(iter(prefix.holders))
    evicted = prefix.pop_lru()
    assert evicted.id == oldest and prefix.kept == 2
    tiny_loaded.executor.thread.run_sync(tiny_loaded.executor.release, evicted)
    for holder in list(prefix.holders.values()):
        tiny_loaded.executor.thread.run_sync(tiny_loaded.executor.release, holder.session)


def test_a_wait_leaves_nothing_behind_for_later_event_loops(tiny_loaded, cold):
    # a request that waited for another's prompt, then a job on a new event loop (tools and tests run an engine
    # under several asyncio.run calls): no step may post to the loop that is gone
    engine = Engine(tiny_loaded.executor, PrefixCache(2**30, min_tokens=8))

    async def both():
        return await asyncio.gather(*(collect(engine, greedy_job(SYSTEM + q, 6, {})) for q in QUESTIONS[:2]))

    assert asyncio.run(both()) == [cold[0][0], cold[1][0]]
    assert asyncio.run(collect(engine, greedy_job(SYSTEM + QUESTIONS[2], 6, {}))) == cold[2][0]


def test_a_group_starts_together_and_its_members_do_not_wait_for_each_other(tiny_loaded, cold):
    # outline's points: what a group makes must not depend on when its opens ran, and a member never waits for
    # the prompt another member will compute (they would wait for each other: none starts before all are open)
    engine = Engine(tiny_loaded.executor, PrefixCache(2**30, min_tokens=8))
    started: list[int] = []
    seen = [{} for _ in QUESTIONS]

    def job(i: int) -> Job:
        inner = greedy_job(SYSTEM + QUESTIONS[i], 6, seen[i])

        def start(seq):
            started.append(tiny_loaded.executor.steps)
            return inner.start(seq)

        return Job(inner.capacity, start, inner.prompt)

    async def group():
        tokens: dict[int, list[int]] = {i: [] for i in range(len(QUESTIONS))}
        async with aclosing(engine.run_group([job(i) for i in range(len(QUESTIONS))])) as events:
            async for i, token in events:
                tokens[i].append(token)
        return tokens

    tokens = asyncio.run(group())
    assert len(set(started)) == 1 and [s["cached"] for s in seen] == [0, 0, 0]
    assert [tokens[i] for i in range(len(QUESTIONS))] == [cold[i][0] for i in range(len(QUESTIONS))]
