"""The `headsplit` policy: one token per step, as `naive`, through the HeadSplit schedule (model/headsplit.py)
instead of the layer pipeline: every device works on every layer's attention, and a layer the placement lets
speculate starts on the previous layer's Z and keeps it when ||Z - X|| / ||X|| < epsilon.

Request options: `epsilon` (default: the server's `headsplit_epsilon`; 0 is exactly naive). The placement,
and so which layers speculate, is fixed when the blocks are first loaded (at the first request), from the
configured epsilon's profiled acceptance; a request's epsilon changes only the test.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from contextlib import aclosing

from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.types import GenerationRequest
from edgespec.model.runner import ModelRunner
from edgespec.planning.headsplit import LayerPlace


class LazyRunner:
    """A ModelRunner over HeadSplit blocks, built by `build()` (blocking: on a thread) on first use."""

    def __init__(self, build: Callable[[], ModelRunner]):
        self.build = build
        self.runner: ModelRunner | None = None
        self.lock = asyncio.Lock()

    async def get(self) -> ModelRunner:
        async with self.lock:
            if self.runner is None:
                self.runner = await asyncio.to_thread(self.build)
            return self.runner

    def placement(self) -> list[LayerPlace] | None:
        """Where the blocks are now (re-placements included); None until the runner is built."""
        return None if self.runner is None else self.runner.pipeline.layers

    def close(self) -> None:
        if self.runner is not None:
            self.runner.pipeline.close()


class HeadSplitPolicy(NaivePolicy):
    name = "headsplit"
    options = frozenset({"epsilon"})

    def __init__(self, runner: LazyRunner | None, epsilon: float = 0.05):
        self.runner, self.epsilon = runner, epsilon

    def check(self, options: dict) -> None:
        if self.runner is None:
            raise ValueError("this server was started without HeadSplit (--no-headsplit)")
        eps = options.get("epsilon", self.epsilon)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"epsilon must be a finite number >= 0, got {eps!r}")

    def placement(self) -> list[LayerPlace] | None:
        """Where the blocks are now; None until the first request built them, or without HeadSplit."""
        return None if self.runner is None else self.runner.placement()

    def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        return self._generate(request, tokenizer)

    async def _generate(self, request: GenerationRequest, tokenizer):
        runner = await self.runner.get()
        async with aclosing(super().generate(request, runner, tokenizer)) as events:  # releases on disconnect
            async for event in events:
                yield event

    async def prepare(self, request: GenerationRequest, model: ModelRunner, tokenizer, session):
        await model.call(model.pipeline.set_epsilon, session.id, float(request.policy_options.get("epsilon",
                                                                                                  self.epsilon)))
        return await super().prepare(request, model, tokenizer, session)

    def summary(self, model: ModelRunner, session) -> dict:
        pipe = model.pipeline
        stats = pipe.stats[session.id]
        return {"headsplit": {"epsilon": pipe.epsilons[session.id],
                              "speculating_layers": sum(lp.speculate for lp in pipe.layers),
                              "speculations_kept": sum(stats.kept),
                              "speculations_discarded": sum(stats.discarded)}}
