"""Prefill in segments and prefix reuse, in-process (tiny model, float32): every way of cutting a prompt, on
1 to 4 stages, gives the first token and greedy continuation of one monolithic pass; a prompt that reuses a
kept prefix gives what a cold run gives."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgespec.model.config import ModelConfig
from edgespec.model.kv_pool import CapacityError
from edgespec.model.prefix import PrefixCache, common_prefix
from edgespec.model.stack import LayerStack
from edgespec.model.stage import LocalStage, Pipeline
from edgespec.model.weights import open_source

PROMPT = [(7 * i + 3) % 500 + 10 for i in range(37)]  # 37 tokens: no cut size below divides it


def stages(folder, bounds: list[int], budget: int = 2**30) -> Pipeline:
    cfg = ModelConfig.from_folder(folder)
    src = open_source(folder)
    return Pipeline([LocalStage(LayerStack.load(src, cfg, a, b, torch.float32), budget)
                     for a, b in zip([0, *bounds], [*bounds, cfg.n_layers], strict=True)])


async def greedy(runner, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    session = await runner.open(len(prompt) + n, prompt=prompt)
    try:
        logits = await runner.forward(session, torch.tensor([prompt[session.length:]]), last_only=True)
        first = logits[0, -1].clone()
        out = [int(first.argmax())]
        for _ in range(n - 1):
            logits = await runner.forward(session, torch.tensor([[out[-1]]]))
            out.append(int(logits[0, -1].argmax()))
        return out, first
    finally:
        await runner.release(session)


@pytest.fixture(scope="module")
def monolithic(tiny_loaded):
    return asyncio.run(greedy(tiny_loaded.runner, PROMPT, 10))


CUTS = {
    "ones": lambda n: list(range(1, n + 1)),  # every segment one token long
    "fives": lambda n: [*range(5, n, 5), n],  # 37 = 7 x 5 + 2
    "uneven": lambda n: sorted({1, 2, 9, 30, n}),
    "halves": lambda n: [n // 2, n],
}


@pytest.mark.parametrize("cuts", sorted(CUTS))
@pytest.mark.parametrize("bounds", [[], [2], [1, 3], [1, 2, 3]], ids=["1-stage", "2-stages", "3-stages", "4-stages"])
def test_segmented_prefill_equals_one_pass(tiny_loaded, monolithic, cuts, bounds):
    runner = tiny_loaded.runner
    original = runner.pipeline
    runner.pipeline, runner.cuts = stages(tiny_loaded.files.folder, bounds), CUTS[cuts]
    try:
        out, first = asyncio.run(greedy(runner, PROMPT, 10))
    finally:
        runner.pipeline, runner.cuts = original, None
    assert out == monolithic[0]
    assert torch.allclose(first, monolithic[1], atol=1e-4)


def test_prefix_cache_bookkeeping():
    class S:
        def __init__(self, i):
            self.id = f"s{i}"

    cache = PrefixCache(max_bytes=300, min_tokens=3)
    a, b, c = S(1), S(2), S(3)
    assert cache.add(a, [1, 2, 3, 4, 5], 100, 0) == []
    assert cache.add(b, [1, 2, 3, 9], 100, 0) == []
    assert cache.add(S(9), [1, 2], 10, 0)[0].id == "s9"  # too short to be worth keeping
    entry, n = cache.match([1, 2, 3, 4, 7], 0)
    assert (entry.session, n) == (a, 4)
    assert cache.match([1, 2, 3, 4, 5], 0)[1] == 4  # one prompt token is always left to compute
    assert cache.match([1, 2, 3, 4, 5], 1) is None  # cached under another placement
    assert cache.match([1, 2, 8], 0) is None  # shorter than min_tokens
    assert cache.add(c, [5, 5, 5, 5], 150, 0) == [b]  # over 300 bytes: the least recently used goes
    assert cache.pop_lru() is a and cache.pop_lru() is c and cache.pop_lru() is None
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


def test_prefix_reuse_equals_a_cold_run(tiny_loaded, monolithic):
    runner = tiny_loaded.runner
    system = PROMPT[:30]
    runner.prefix = PrefixCache(2**30, min_tokens=8)
    try:
        asyncio.run(greedy(runner, [*system, 1, 2, 3], 4))  # kept for reuse when it ends
        assert len(runner.prefix.entries) == 1
        hits = runner.prefix.hits
        out, first = asyncio.run(greedy(runner, PROMPT, 10))  # shares 30 tokens with it
        assert runner.prefix.hits == hits + 1 and runner.prefix.reused_tokens >= 30
        assert out == monolithic[0]
        assert torch.allclose(first, monolithic[1], atol=1e-4)
        # the same prompt again reuses all but its last token, and the answer's tokens too next time
        assert asyncio.run(greedy(runner, PROMPT, 10))[0] == monolithic[0]
        assert runner.prefix.match(PROMPT + monolithic[0][:5], runner.generation)[1] == len(PROMPT) + 4
    finally:
        for entry in list(runner.prefix.entries.values()):
            runner.thread.run_sync(runner.pipeline.release, entry.session.id)
        runner.prefix = None


def test_full_memory_evicts_kept_prefixes(tiny_loaded, monolithic):
    runner = tiny_loaded.runner
    original = runner.pipeline
    cfg = ModelConfig.from_folder(tiny_loaded.files.folder)
    slot = cfg.kv_bytes_per_token()  # float32, all layers
    runner.pipeline = stages(tiny_loaded.files.folder, [], budget=300 * slot)  # room for one 256-slot cache
    runner.prefix = PrefixCache(2**30, min_tokens=8)
    try:
        asyncio.run(greedy(runner, [9] * 20, 3))
        assert len(runner.prefix.entries) == 1
        out, _ = asyncio.run(greedy(runner, PROMPT, 10))  # needs the room: the kept session goes
        assert out == monolithic[0]
        assert list(runner.prefix.entries) != [] and runner.prefix.hits == 0
        with pytest.raises(CapacityError):
            runner.thread.run_sync(runner.pipeline.open, "x", 300)  # sanity: the budget is what binds
    finally:
        runner.pipeline, runner.prefix = original, None
