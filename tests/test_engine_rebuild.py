"""A re-assignment of the stages in the middle of a generation: the session's cache is rebuilt from its tokens
on the new stages and decoding continues exactly as if nothing had happened (tiny model, float32)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgespec.model.config import ModelConfig
from edgespec.model.engine import Rows
from edgespec.model.runner import SessionLostError
from edgespec.model.stack import LayerStack
from edgespec.model.stage import ClusterFault, LocalStage, Pipeline, StageFailure
from edgespec.model.weights import open_source


def split_pipeline(folder, cut: int) -> Pipeline:
    cfg = ModelConfig.from_folder(folder)
    src = open_source(folder)
    return Pipeline([LocalStage(LayerStack.load(src, cfg, 0, cut, torch.float32), 2**30),
                     LocalStage(LayerStack.load(src, cfg, cut, cfg.n_layers, torch.float32), 2**30)])


async def greedy(runner, prompt: list[int], n: int, on_step=None) -> list[int]:
    session = await runner.open(64)
    try:
        logits = await runner.forward(session, torch.tensor([prompt]), last_only=True)
        out = []
        for i in range(n):
            out.append(int(logits[0, -1].argmax()))
            if on_step:
                await on_step(i, session)
            logits = await runner.forward(session, torch.tensor([[out[-1]]]))
        return out
    finally:
        await runner.release(session)


def test_decoding_continues_exactly_after_a_replacement(tiny_loaded):
    runner, folder = tiny_loaded.runner, tiny_loaded.files.folder
    prompt = [5, 17, 42, 99, 3]
    original = runner.pipeline
    want = asyncio.run(greedy(runner, prompt, 12))

    async def replan(i, session):
        if i == 5:  # as ClusterManager.apply does on the model thread: new stages, every cache gone
            def swap():
                runner.pipeline = split_pipeline(folder, 1)
                runner.placement_changed()
            await runner.call(swap)
        if i == 8:  # a truncation (a rejected draft) on the new placement, then the same token again
            runner.truncate(session, session.length - 1)
            await runner.forward(session, torch.tensor([[want[i - 1]]]))

    try:
        rebuilt = runner.rebuilt
        got = asyncio.run(greedy(runner, prompt, 12, replan))
        assert got == want
        assert runner.rebuilt == rebuilt + 1
    finally:
        runner.pipeline = original
        runner.placement_changed()


def test_a_session_with_a_custom_mask_ends_with_a_clear_error(tiny_loaded):
    runner = tiny_loaded.runner

    async def run():
        session = await runner.open(32)
        try:
            await runner.forward(session, torch.tensor([[1, 2, 3]]))
            mask = torch.ones(1, 2, 5, dtype=torch.bool)  # a tree: not a plain run of tokens
            await runner.forward(session, torch.tensor([[4, 5]]), mask=mask)
            await runner.call(runner.placement_changed)
            with pytest.raises(SessionLostError, match="re-planned"):
                await runner.forward(session, torch.tensor([[6]]))
        finally:
            await runner.release(session)

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


async def decode_together(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = [[] for _ in prompts]

    async def one(prompt, out):
        session = await runner.open(64)
        try:
            async for _ in runner.engine.run(session, greedy_program(prompt, n, out)):
                pass
        finally:
            await runner.release(session)

    await asyncio.gather(*(one(p, o) for p, o in zip(prompts, outs, strict=True)))
    return outs


@pytest.mark.parametrize("fail", [{3}, {4, 5, 9}], ids=["once", "thrice"])
def test_a_failed_step_is_re_placed_and_the_streams_go_on_exactly(tiny_loaded, fail):
    """A stage failure mid-generation (a lost worker) voids the step; the runner's recover hook re-places the
    stages, every session is rebuilt from its tokens, and the same tokens come out, for sequences alone and
    batched in one step."""
    runner, folder = tiny_loaded.runner, tiny_loaded.files.folder
    prompts = [[5, 17, 42, 99, 3], [7, 7, 8]]
    want = asyncio.run(decode_together(runner, prompts, 10))
    original, rebuilt = runner.pipeline, runner.rebuilt
    faulty, seen = Faulty(original, fail), []

    async def recover(error, generation):
        seen.append(str(error))

        def swap():  # as ClusterManager.apply: the stages without the lost worker, every cache gone
            faulty.inner = split_pipeline(folder, 1 + len(seen) % 2)
            runner.placement_changed()

        await runner.call(swap)
        return True

    runner.pipeline, runner._recover = faulty, recover
    try:
        assert asyncio.run(decode_together(runner, prompts, 10)) == want
        assert len(seen) == len(fail) and all("unreachable" in e for e in seen)
        assert runner.rebuilt >= rebuilt + 2  # both sessions were prefilled again on the new stages
    finally:
        runner.pipeline, runner._recover = original, None
        runner.placement_changed()


def test_a_failed_step_with_no_placement_left_ends_with_a_clear_error(tiny_loaded):
    runner = tiny_loaded.runner
    original = runner.pipeline

    async def recover(error, generation):
        return False  # no placement fits the devices left

    runner.pipeline, runner._recover = Faulty(original, {3}), recover
    try:
        with pytest.raises(ClusterFault, match="no placement"):
            asyncio.run(decode_together(runner, [[5, 17, 42]], 10))
    finally:
        runner.pipeline, runner._recover = original, None
