"""Per-generation statistics: the `decoding` object of every response."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from edgespec.decoding.text import TextStream
from edgespec.decoding.types import TokenEvent

if TYPE_CHECKING:
    from edgespec.engine.program import SequenceView


class StepStats:
    """Timestamps and counts of one generation, folded into the response's `decoding` object."""

    def __init__(self, policy: str):
        self.policy = policy
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.steps = 0  # decoding steps after the prefill that produced the first token
        self.tokens = 0
        self.proposed = 0  # drafted tokens offered for verification (draft-and-verify policies)
        self.accepted = 0
        self.prefill_wire: dict[str, tuple[int, int]] = {}  # wire counts when the first token came
        self.cached_prompt_tokens = 0  # prompt tokens whose KV came from an earlier request (prefix reuse)
        self.drafter: str | None = None  # draft-and-verify policies: which drafter, and its time
        self.drafter_s = 0.0
        self.accepted_lengths: dict[int, int] | None = None  # tree policies: steps by accepted length
        self.exact: bool | None = None  # set by policies with a non-exact option: whether this request was exact
        # the engine's view of the generation's sequence: how many others shared its passes
        self.sequence: SequenceView | None = None
        self.extra: dict = {}  # more figures for the `decoding` object (a tool trigger's score)

    def tokens_emitted(self, n: int, wire: dict[str, tuple[int, int]]) -> None:
        """Count n new tokens; `wire` is the session's (bytes, requests) per link so far."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.prefill_wire = wire
        else:
            self.steps += 1
        self.tokens += n

    def as_dict(self, wire: dict[str, tuple[int, int]]) -> dict:
        """The statistics so far; `wire` maps each link to (bytes, requests) sent over it."""
        end = time.perf_counter()
        first = self.first_token_at or end
        decoded = self.tokens - 1  # tokens after the first one, produced by the decoding steps
        decode_s = end - first

        def per_token(x: int) -> float:
            return round(x / self.tokens, 3) if self.tokens else 0.0

        drafting = {"drafter": self.drafter, "drafter_ms": round(self.drafter_s * 1000, 3)} if self.drafter else {}
        if self.accepted_lengths is not None:
            drafting["accepted_length_histogram"] = {str(n): c for n, c in sorted(self.accepted_lengths.items())}
        if self.exact is not None:
            drafting["exact"] = self.exact
        if self.sequence is not None and self.sequence.passes:
            # other sequences in this one's forward passes, on average (concurrent requests share passes)
            drafting["shared_with_mean"] = round(self.sequence.shared_with / self.sequence.passes, 3)
        return {
            **self.extra,
            "policy": self.policy,
            **drafting,
            "steps": self.steps,
            "tokens_per_step": round(decoded / self.steps, 4) if self.steps else None,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "ttft_ms": round((first - self.start) * 1000, 3),
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "decode_tokens_per_s": round(decoded / decode_s, 3) if decoded > 0 and decode_s > 0 else None,
            "wire_bytes_per_token": per_token(sum(b for b, _ in wire.values())),
            "wire_requests_per_token": per_token(sum(n for _, n in wire.values())),
            # per link; decode_bytes_per_token leaves out the prompt's prefill
            "wire_links": {link: {"bytes_per_token": per_token(b), "requests_per_token": per_token(n),
                                  "decode_bytes_per_token": round((b - self.prefill_wire.get(link, (0, 0))[0])
                                                                  / decoded, 3) if decoded > 0 else None}
                           for link, (b, n) in wire.items()},
        }


def push_run(text: TextStream, step: list, stats: StepStats, wire: dict) -> TokenEvent:
    """Feed a step's (token, logprob) pairs one at a time, so that a stop or max_tokens inside the run ends it
    exactly; the event carries the statistics when the generation ends."""
    ids, parts, logprobs = [], [], []
    for token, logprob in step:
        pushed = text.push(token)
        ids.append(token)
        parts.append(pushed.text)
        if logprob:
            logprobs.append(logprob)
        if pushed.finish_reason:
            stats.tokens_emitted(len(ids), wire)
            return TokenEvent(ids, "".join(parts), pushed.finish_reason, logprobs, stats.as_dict(wire))
    stats.tokens_emitted(len(ids), wire)
    return TokenEvent(ids, "".join(parts), None, logprobs)
