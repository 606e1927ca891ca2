"""What a policy that decodes one sequence offers (naive, speculative, medusa, headsplit), and its one way to
run a request alone.

Such a policy says how many cache slots a request needs (`capacity`) and, on the model thread, for the
request's session once the engine has opened it (it may already hold part of the prompt: prefix reuse), builds
the engine program that decodes the rest (`prepare`). Run alone, the request is one engine job; outline runs the
same programs for its points, so every point decodes exactly as its policy decodes a request alone.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from edgespec.decoding.decide import decide
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.stats import StepStats
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest
from edgespec.engine.engine import Engine
from edgespec.engine.program import Job, Program, SequenceView
from edgespec.model.config import ModelConfig


@dataclass
class Prepared:
    """A request made ready to decode: its engine program and the statistics it keeps."""

    program: Program
    stats: StepStats


class SequencePolicy(Protocol):
    name: str
    lane: str  # the engine's lane its jobs run on (engine/engine.py)

    def capacity(self, request: GenerationRequest, cfg: ModelConfig) -> int:
        """Cache slots the request may write: its prompt, its tokens and any scratch rows (drafts, a tree)."""

    def prepare(self, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView, text: TextStream
                ) -> Prepared:
        """The engine program that decodes the request on its open session `seq` (its prompt from slot
        seq.length on), its tokens going through `text` (model thread)."""


def text_stream(request: GenerationRequest, tokenizer) -> TextStream:
    """The TextStream a request's tokens go through (whose max_tokens a caller sharing a budget may lower)."""
    return TextStream(tokenizer, request.stop, request.stop_token_ids, request.max_tokens)


def start(name: str, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView) -> tuple[Sampler, StepStats]:
    """What every such program starts from (model thread): the request's Sampler, and statistics tied to the
    sequence."""
    return Sampler(request.sampling, cfg.vocab_size, request.grammar), StepStats(name, seq)


def job(policy: SequencePolicy, request: GenerationRequest, cfg: ModelConfig, text: TextStream,
        prepared: list[Prepared] | None = None, extra: dict | None = None) -> Job:
    """The engine job of `request` decoded by `policy`; what it prepares is appended to `prepared` (a caller
    that sums its statistics), with `extra` figures in its statistics."""
    def begin(seq: SequenceView) -> Program:
        ready = policy.prepare(request, cfg, seq, text)
        ready.stats.extra.update(extra or {})
        if prepared is not None:
            prepared.append(ready)
        return ready.program

    return Job(policy.capacity(request, cfg), begin, request.prompt_ids, policy.lane)


async def run_alone(policy: SequencePolicy, request: GenerationRequest, engine: Engine, tokenizer):
    """Decode the request as an engine job of its own: its TokenEvents. A request with a tool trigger or route
    is decided first (decoding/decide.py)."""
    decided = None
    if request.trigger is not None or request.route is not None:
        request, decided = await decide(request, engine)
    extra = {"tool_choice": decided} if decided is not None else None
    job_ = job(policy, request, engine.cfg, text_stream(request, tokenizer), extra=extra)
    async with aclosing(engine.run(job_)) as events:
        async for event in events:
            yield event
