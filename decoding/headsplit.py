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
from edgespec.decoding.sequence import Prepared
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest
from edgespec.engine.engine import Engine
from edgespec.engine.program import SequenceView
from edgespec.model.config import ModelConfig
from edgespec.model.headsplit import HeadSplitPipeline


class LazyEngine:
    """An engine over HeadSplit blocks, built by `build()` (blocking: on a thread) on first use."""

    def __init__(self, build: Callable[[], Engine]):
        self.build = build
        self.engine: Engine | None = None
        self.lock = asyncio.Lock()

    async def get(self) -> Engine:
        async with self.lock:
            if self.engine is None:
                self.engine = await asyncio.to_thread(self.build)
            return self.engine

    @property
    def pipeline(self) -> HeadSplitPipeline | None:
        """The HeadSplit blocks the engine's executor runs now (None until built; a re-placement swaps them)."""
        if self.engine is None:
            return None
        pipe = self.engine.executor.pipeline
        assert isinstance(pipe, HeadSplitPipeline)
        return pipe

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


class HeadSplitPolicy(NaivePolicy):
    name = "headsplit"
    options = frozenset({"epsilon"})

    def __init__(self, lazy: LazyEngine | None, epsilon: float = 0.05):
        self.lazy, self.epsilon = lazy, epsilon

    def check(self, options: dict) -> None:
        if self.lazy is None:
            raise ValueError("this server was started without HeadSplit (--no-headsplit)")
        eps = options.get("epsilon", self.epsilon)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"epsilon must be a finite number >= 0, got {eps!r}")

    def generate(self, request: GenerationRequest, engine: Engine, tokenizer):
        return self._generate(request, tokenizer)

    async def _generate(self, request: GenerationRequest, tokenizer):
        engine = await self.lazy.get()
        async with aclosing(super().generate(request, engine, tokenizer)) as events:  # releases on disconnect
            async for event in events:
                yield event

    def prepare(self, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView, text: TextStream
                ) -> Prepared:
        self.lazy.pipeline.set_epsilon(seq.id, float(request.policy_options.get("epsilon", self.epsilon)))
        return super().prepare(request, cfg, seq, text)

    def summary(self, seq: SequenceView) -> dict:
        pipe = self.lazy.pipeline
        stats = pipe.stats[seq.id]
        return {"headsplit": {"epsilon": pipe.epsilons[seq.id],
                              "speculating_layers": sum(lp.speculate for lp in pipe.layers),
                              "speculations_kept": sum(stats.kept),
                              "speculations_discarded": sum(stats.discarded)}}
