"""A re-assignment of the stages in the middle of a generation (engine/executor.py, Executor.replace): the
session's cache is rebuilt from its tokens on the new stages and decoding continues exactly as if nothing had
happened, for a session of a tool's own and for the engine's sequences, through a stage failure the engine
re-places (tiny model, float32)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgespec.engine.engine import Engine
from edgespec.engine.executor import Executor, SessionLostError
from edgespec.engine.program import Job, Rows
from edgespec.model.config import ModelConfig
from edgespec.model.stack import LayerStack
from edgespec.model.stage import ClusterFault, LocalStage, Pipeline, StageFailure
from edgespec.model.weights import open_source


def split_pipeline(folder, cut: int) -> Pipeline:
    cfg = ModelConfig.from_folder(folder)
    src = open_source(folder)
    return Pipeline([LocalStage(LayerStack.load(src, cfg, 0, cut, torch.float32), 2**30),
                     LocalStage(LayerStack.load(src, cfg, cut, cfg.n_layers, torch.float32), 2**30)])


async def greedy(executor: Executor, prompt: list[int], n: int, on_step=None) -> list[int]:
    session = await executor.open_own(64)
    try:
        logits = await executor.forward(session, torch.tensor([prompt]), last_only=True)
        out = []
        for i in range(n):
            out.append(int(logits[0, -1].argmax()))
            if on_step:
                await on_step(i, session)
            logits = await executor.forward(session, torch.tensor([[out[-1]]]))
        return out
    finally:
        await executor.release_own(session)


def test_decoding_continues_exactly_after_a_replacement(tiny_loaded):
    executor, folder = tiny_loaded.executor, tiny_loaded.files.folder
    prompt = [5, 17, 42, 99, 3]
    original, cuts = executor.pipeline, executor.cuts
    want = asyncio.run(greedy(executor, prompt, 12))

    async def replan(i, session):
        if i == 5:  # as ClusterManager.apply does on the model thread: new stages, every cache gone
            await executor.call(executor.replace, split_pipeline(folder, 1), cuts)
        if i == 8:  # a truncation (a rejected draft) on the new placement, then the same token again
            Executor.truncate(session, session.length - 1)
            await executor.forward(session, torch.tensor([[want[i - 1]]]))

    try:
        rebuilt = executor.rebuilt
        got = asyncio.run(greedy(executor, prompt, 12, replan))
        assert got == want
        assert executor.rebuilt == rebuilt + 1
    finally:
        executor.replace(original, cuts)


def test_a_session_with_a_custom_mask_ends_with_a_clear_error(tiny_loaded):
    executor = tiny_loaded.executor

    async def run():
        session = await executor.open_own(32)
        try:
            await executor.forward(session, torch.tensor([[1, 2, 3]]))
            mask = torch.ones(1, 2, 5, dtype=torch.bool)  # a tree: not a plain run of tokens
            await executor.forward(session, torch.tensor([[4, 5]]), mask=mask)
            await executor.call(executor.replace, executor.pipeline, executor.cuts)  # the same stages re-assigned
            with pytest.raises(SessionLostError, match="re-planned"):
                await executor.forward(session, torch.tensor([[6]]))
        finally:
            await executor.release_own(session)

    asyncio.run(run())


class Faulty:
    """A pipeline that fails the forward calls numbered in `fail` (as a lost worker's would), else delegates."""

    def __init__(self, inner, fail: set[int]):
        self.inner, self.fail, self.calls = inner, fail, 0

    def _maybe_fail(self):
        self.calls += 1
        if self.calls in self.fail:
            raise StageFailure(f"worker w1 is unreachable (call {self.calls})", 503)

    def forward(self, *args, **kwargs):
        self._maybe_fail()
        return self.inner.forward(*args, **kwargs)

    def forward_batch(self, *args):
        self._maybe_fail()
        return self.inner.forward_batch(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def greedy_program(prompt: list[int], n: int, out: list[int]):
    """A naive decoding program for the engine: the prompt, then one row per token."""
    o = yield Rows(prompt, last_only=True)
    for _ in range(n):
        out.append(int(o.logits[0, -1].argmax()))
        o = yield Rows([out[-1]])


async def decode_together(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = [[] for _ in prompts]

    async def one(prompt, out):
        async for _ in engine.run(Job(64, lambda seq: greedy_program(prompt, n, out))):
            pass

    await asyncio.gather(*(one(p, o) for p, o in zip(prompts, outs, strict=True)))
    return outs


@pytest.mark.parametrize("fail", [{3}, {4, 5, 9}], ids=["once", "thrice"])
def test_a_failed_step_is_re_placed_and_the_streams_go_on_exactly(tiny_loaded, fail):
    """A stage failure mid-generation (a lost worker) voids the step; the engine's recover hook re-places the
    stages, every session is rebuilt from its tokens, and the same tokens come out, for sequences alone and
    batched in one step."""
    executor, folder = tiny_loaded.executor, tiny_loaded.files.folder
    prompts = [[5, 17, 42, 99, 3], [7, 7, 8]]
    want = asyncio.run(decode_together(Engine(executor), prompts, 10))
    original, cuts, rebuilt = executor.pipeline, executor.cuts, executor.rebuilt
    faulty, seen = Faulty(original, fail), []

    async def recover(error, generation):
        seen.append(str(error))

        def swap():  # as ClusterManager.apply: the stages without the lost worker, every cache gone
            faulty.inner = split_pipeline(folder, 1 + len(seen) % 2)
            executor.replace(faulty, cuts)

        await executor.call(swap)
        return True

    executor.replace(faulty, cuts)
    try:
        assert asyncio.run(decode_together(Engine(executor, recover=recover), prompts, 10)) == want
        assert len(seen) == len(fail) and all("unreachable" in e for e in seen)
        assert executor.rebuilt >= rebuilt + 2  # both sessions were prefilled again on the new stages
    finally:
        executor.replace(original, cuts)


def test_a_failed_step_with_no_placement_left_ends_with_a_clear_error(tiny_loaded):
    executor = tiny_loaded.executor
    original, cuts = executor.pipeline, executor.cuts

    async def recover(error, generation):
        return False  # no placement fits the devices left

    executor.replace(Faulty(original, {3}), cuts)
    try:
        with pytest.raises(ClusterFault, match="no placement"):
            asyncio.run(decode_together(Engine(executor, recover=recover), [[5, 17, 42]], 10))
    finally:
        executor.replace(original, cuts)
