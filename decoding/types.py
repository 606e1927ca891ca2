"""The internal request and the streamed unit shared by every decoding policy.

Policies know nothing about OpenAI: the HTTP layer turns its requests into a GenerationRequest and renders
TokenEvents as OpenAI JSON or SSE chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgespec.decoding.decide import Route, Trigger
    from edgespec.decoding.grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off; >1 makes the tokens generated so far less likely (llama.cpp's rule)
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: prompt token ids in, at most max_tokens new tokens out."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    policy: str = "naive"
    policy_options: dict = field(default_factory=dict)
    grammar: Grammar | None = None  # what the output must match (tools, response_format); None: free text
    trigger: Trigger | None = None  # tool_choice auto: a score before decoding may switch to a call
    route: Route | None = None  # several tools: which one a call opens with, scored before decoding


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token and of the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class TokenEvent:
    """What one decoding step yields: new token ids, the text they complete, and maybe the end.

    `text` may be empty (a partial UTF-8 character, or text held back while it may start a stop string).
    `stats` is set on the last event of a generation.
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: dict | None = None
