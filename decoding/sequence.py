"""What a policy that decodes one sequence offers (naive, speculative, medusa, headsplit), and its one way to
run a request alone.

Such a policy says how many cache slots a request needs (`capacity`) and, for a session that is open and may
already hold part of the prompt (prefix reuse, or a fork of a shared prompt), builds the engine program that
decodes the rest (`prepare`). Run alone, the request opens its own session; outline runs the same programs
for its points on sessions forked from the prompt they share, so every point decodes exactly as its policy
decodes a request alone.
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
from edgespec.model.engine import Program
from edgespec.model.runner import ModelRunner


@dataclass
class Prepared:
    """A request made ready to decode: its engine program, the statistics it keeps and the TextStream its
    tokens go through (whose max_tokens a caller sharing a budget may lower while it runs)."""

    program: Program
    stats: StepStats
    text: TextStream


class SequencePolicy(Protocol):
    name: str

    def capacity(self, request: GenerationRequest, model: ModelRunner) -> int:
        """Cache slots the request may write: its prompt, its tokens and any scratch rows (drafts, a tree)."""

    async def prepare(self, request: GenerationRequest, model: ModelRunner, tokenizer, session
                      ) -> Prepared:
        """The engine program that decodes the request on the open `session` (its prompt from slot
        session.length on)."""


async def start(name: str, request: GenerationRequest, model: ModelRunner, tokenizer, session
                ) -> tuple[Sampler, TextStream, StepStats]:
    """What every such program starts from: the request's Sampler (built on the model thread), the TextStream
    its tokens go through, and statistics tied to the session."""
    sampler = await model.call(Sampler, request.sampling, model.cfg.vocab_size, request.grammar)
    text = TextStream(tokenizer, request.stop, request.stop_token_ids, request.max_tokens)
    stats = StepStats(name)
    stats.session = session
    stats.cached_prompt_tokens = session.length
    return sampler, text, stats


async def run_alone(policy: SequencePolicy, request: GenerationRequest, model: ModelRunner, tokenizer):
    """Decode the request on a session of its own: its TokenEvents. The session is released whatever happens
    (a client that disconnects frees it at once). A request with a tool trigger or route is decided first
    (decoding/decide.py)."""
    capacity = policy.capacity(request, model)
    if request.trigger is not None:
        capacity = max(capacity, len(request.prompt_ids) + len(request.trigger.ids))
    session = await model.open(capacity, prompt=request.prompt_ids)
    try:
        decided = None
        if request.trigger is not None or request.route is not None:
            request, decided = await decide(request, model, session)
        prepared = await policy.prepare(request, model, tokenizer, session)
        if decided is not None:
            prepared.stats.extra["tool_choice"] = decided
        # closed here, not when collected: the engine stops the program before the session is released
        async with aclosing(model.engine.run(session, prepared.program)) as events:
            async for event in events:
                yield event
    finally:
        await model.release(session)

