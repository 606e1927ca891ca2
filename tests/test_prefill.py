"""Prefill in segments and prefix reuse, in-process (tiny model, float32): every way of cutting a prompt, on
1 to 4 stages, gives the first token and greedy continuation of one monolithic pass; a prompt that reuses a
kept prefix gives what a cold run gives; the prefix cache's bookkeeping (engine/prefix.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgespec.engine.engine import Engine
from edgespec.engine.prefix import PrefixCache, common_prefix
from edgespec.engine.program import Job, Rows
from edgespec.engine.session import Session
from edgespec.model.config import ModelConfig
from edgespec.model.kv_pool import CapacityError
from edgespec.model.stack import LayerStack
from edgespec.model.stage import LocalStage, Pipeline
from edgespec.model.weights import open_source

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(37)]  # 37 tokens: no cut size below divides it


def stages(folder, bounds: list[int], budget: int = 2**30) -> Pipeline:
    cfg = ModelConfig.from_folder(folder)
    src = open_source(folder)
    return Pipeline([LocalStage(LayerStack.load(src, cfg, a, b, torch.float32), budget)
                     for a, b in zip([0, *bounds], [*bounds, cfg.n_layers], strict=True)])


async def greedy(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after `prompt` as one engine job (its session may start from a kept prefix), and the
    logits of the first, float32 [V]."""
    out, first = [], []

    def program(seq):
        o = yield Rows(prompt[seq.length:], last_only=True)  # what the prefix cache did not hold
        first.append(o.logits[0, -1].clone())
        out.append(int(first[0].argmax()))
        while len(out) < n:
            o = yield Rows([out[-1]])
            out.append(int(o.logits[0, -1].argmax()))

    async for _ in engine.run(Job(len(prompt) + n, program, prompt)):
        pass
    return out, first[0]


@pytest.fixture(scope="module")
def monolithic(tiny_loaded):
    return asyncio.run(greedy(Engine(tiny_loaded.executor), PROMPT, 10))


CUTS = {
    "ones": lambda n: list(range(1, n + 1)),  # every segment one token long
    "fives": lambda n: [*range(5, n, 5), n],  # 37 = 7 x 5 + 2
    "uneven": lambda n: sorted({1, 2, 9, 30, n}),
    "halves": lambda n: [n // 2, n],
}


@pytest.mark.parametrize("cuts", sorted(CUTS))
@pytest.mark.parametrize("bounds", [[], [2], [1, 3], [1, 2, 3]], ids=["1-stage", "2-stages", "3-stages", "4-stages"])
def test_segmented_prefill_equals_one_pass(tiny_loaded, monolithic, cuts, bounds):
    executor = tiny_loaded.executor
    original, saved = executor.pipeline, executor.cuts
    executor.replace(stages(tiny_loaded.files.folder, bounds), CUTS[cuts])
    try:
        out, first = asyncio.run(greedy(Engine(executor), PROMPT, 10))
    finally:
        executor.replace(original, saved)
    assert out == monolithic[0]
    assert torch.allclose(first, monolithic[1], atol=1e-4)


def held(name: str, tokens: list[int], generation: int = 0) -> Session:
    """A session whose slots hold `tokens` (no stage is called: the cache's bookkeeping only)."""
    return Session(name, len(tokens), len(tokens), generation, list(tokens))


def test_prefix_cache_bookkeeping():
    cache = PrefixCache(max_bytes=300, min_tokens=3)
    a, b, c = held("a", [1, 2, 3, 4, 5]), held("b", [1, 2, 3, 9]), held("c", [5, 5, 5, 5])
    assert cache.keep(a, 100) == [] and cache.keep(b, 100) == []
    short, big = held("short", [1, 2]), held("big", [7, 7, 7, 7])
    assert cache.keep(short, 10) == [short]  # too short to be worth keeping
    assert cache.keep(big, 301) == [big]  # alone over max_bytes
    assert (cache.kept, cache.nbytes) == (2, 200)
    assert cache.best([1, 2, 3, 4, 7], 0) == (a, 4)  # the longest shared prefix wins
    assert cache.best([1, 2, 3, 4, 5], 0) == (a, 4)  # one prompt token is always left to compute
    assert cache.best([1, 2, 3, 4, 5], 1) is None  # cached under another placement
    assert cache.best([1, 2, 8], 0) is None  # shorter than min_tokens
    assert (cache.hits, cache.reused_tokens) == (2, 8)
    # only slots both computed and of known tokens match: not the rows of a pass in flight (noted before it
    # runs), nor a tree pass's slots
    flight, tree = Session("flight", 8, 4, 0, [8] * 6), Session("tree", 8, 6, 0, [6] * 4)
    cache.claim(flight, [8] * 6), cache.claim(tree, [6] * 6)
    assert cache.best([8] * 7, 0) == (flight, 4) and cache.best([6] * 7, 0) == (tree, 4)
    cache.drop(flight), cache.drop(tree)
    assert (cache.hits, cache.reused_tokens) == (4, 16)
    # a running sequence is a holder from its open: matched by what it computed so far, never evicted
    running = Session("running", 16, 2, 0, [1, 2])
    cache.claim(running, [1, 2, 3, 4, 5, 6, 7])
    assert cache.best([1, 2, 3, 4, 5, 6], 0)[0] is a
    running.length, running.tokens = 6, [1, 2, 3, 4, 5, 6]
    assert cache.best([1, 2, 3, 4, 5, 6, 9], 0) == (running, 6)
    assert cache.kept == 2 and cache.nbytes == 200  # a running holder is not kept bytes
    assert cache.keep(c, 150) == [b]  # over 300 bytes: the least recently used kept one goes
    assert cache.nbytes == 250
    assert cache.pop_lru() is a and cache.pop_lru() is c and cache.pop_lru() is None  # not the running one
    assert list(cache.holders) == ["running"]
    cache.drop(running)
    assert not cache.holders
    # a re-placement: the kept sessions of the old placement are stale (their slots are gone)
    old, new = held("old", [1, 2, 3, 4], generation=0), held("new", [1, 2, 3, 4], generation=1)
    cache.keep(old, 10), cache.keep(new, 10)
    assert cache.stale(1) == [old] and list(cache.holders) == ["new"] and cache.stale(1) == []
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


def test_a_prompt_a_running_sequence_computes_waits_for_it():
    """pending: a request whose prefix a running sequence is computing (its claim) waits until that sequence
    computes more or ends, instead of computing it beside it; none waits for what is already computed."""
    cache = PrefixCache(max_bytes=300, min_tokens=3)

    async def main():
        running = Session("running", 16, 0, 0, [])
        cache.claim(running, [1, 2, 3, 4, 5, 6])
        assert cache.pending([1, 2], 0) is None  # too short to share
        assert cache.pending([1, 2, 3, 4, 5, 6, 7], 1) is None  # another placement's
        waiting = cache.pending([1, 2, 3, 4, 5, 6, 7], 0)
        assert waiting is not None and not waiting.done()
        running.length, running.tokens = 6, [1, 2, 3, 4, 5, 6]
        cache.progress()  # after a step
        await asyncio.wait_for(waiting, 5)
        assert cache.pending([1, 2, 3, 4, 5, 6, 7], 0) is None  # computed now: open at once
        cache.claim(other := Session("other", 16, 0, 0, []), [9, 9, 9, 9])
        waiting = cache.pending([9, 9, 9, 9, 1], 0)
        cache.drop(other)  # it ended (its blocks would be kept)
        await asyncio.wait_for(waiting, 5)

    asyncio.run(main())


def test_prefix_reuse_equals_a_cold_run(tiny_loaded, monolithic):
    executor = tiny_loaded.executor
    engine = Engine(executor, PrefixCache(2**30, min_tokens=8))
    prefix = engine.prefix
    system = PROMPT[:30]
    try:
        asyncio.run(greedy(engine, [*system, 1, 2, 3], 4))  # kept for reuse when it ends
        assert prefix.kept == len(prefix.holders) == 1
        hits = prefix.hits
        out, first = asyncio.run(greedy(engine, PROMPT, 10))  # shares 30 tokens with it
        assert prefix.hits == hits + 1 and prefix.reused_tokens >= 30
        assert out == monolithic[0]
        assert torch.allclose(first, monolithic[1], atol=1e-4)
        # the same prompt again reuses all but its last token, and the answer's tokens too next time
        assert asyncio.run(greedy(engine, PROMPT, 10))[0] == monolithic[0]
        assert prefix.best(PROMPT + monolithic[0][:5], executor.generation)[1] == len(PROMPT) + 4
    finally:
        for holder in list(prefix.holders.values()):
            executor.thread.run_sync(executor.release, holder.session)


def test_a_prompt_being_computed_is_shared_with_a_request_arriving_meanwhile(tiny_loaded, monolithic):
    """A request that arrives while a running sequence computes its prompt starts from that sequence's slots
    (it waits for them rather than computing them beside it), and both answers are a cold run's."""
    executor = tiny_loaded.executor
    engine = Engine(executor, PrefixCache(2**30, min_tokens=8))
    prefix = engine.prefix

    async def meanwhile():
        while not prefix.holders:  # the first one's session is open: its prompt is claimed
            await asyncio.sleep(0)
        return await greedy(engine, PROMPT, 10)

    async def both():
        return await asyncio.gather(greedy(engine, PROMPT, 10), meanwhile())

    try:
        (first, logits), (second, _) = asyncio.run(both())
        assert first == second == monolithic[0]
        assert torch.allclose(logits, monolithic[1], atol=1e-4)
        assert (prefix.hits, prefix.reused_tokens) == (1, len(PROMPT) - 1)
    finally:
        for holder in list(prefix.holders.values()):
            executor.thread.run_sync(executor.release, holder.session)


def test_full_memory_evicts_kept_prefixes(tiny_loaded, monolithic):
    executor = tiny_loaded.executor
    original, saved = executor.pipeline, executor.cuts
    cfg = ModelConfig.from_folder(tiny_loaded.files.folder)
    slot = cfg.kv_bytes_per_token()  # float32, all layers
    # two blocks of 64 slots: a kept prefix holds one and reserves the other (a copy of its partial block), so
    # a new session needs its room
    executor.replace(stages(tiny_loaded.files.folder, [], budget=150 * slot), saved)
    engine = Engine(executor, PrefixCache(2**30, min_tokens=8))
    prefix = engine.prefix
    try:
        asyncio.run(greedy(engine, [9] * 20, 3))
        assert prefix.kept == 1
        out, _ = asyncio.run(greedy(engine, PROMPT, 10))  # needs the room: the kept session goes
        assert out == monolithic[0]
        assert prefix.hits == 0 and prefix.kept == 1  # the second one's blocks are kept in its place
        assert [h.session.tokens[:len(PROMPT)] for h in prefix.holders.values()] == [PROMPT]
        with pytest.raises(CapacityError):
            executor.thread.run_sync(executor.pipeline.open, "x", 300)  # sanity: the budget is what binds
    finally:
        for holder in list(prefix.holders.values()):
            executor.thread.run_sync(executor.release, holder.session)
        executor.replace(original, saved)
