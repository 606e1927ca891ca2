"""A re-assignment of the stages in the middle of a generation: the session's cache is rebuilt from its tokens
on the new stages and decoding continues exactly as if nothing had happened (tiny model, float32)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgespec.model.config import ModelConfig
from edgespec.model.runner import SessionLostError
from edgespec.model.stack import LayerStack
from edgespec.model.stage import LocalStage, Pipeline
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
