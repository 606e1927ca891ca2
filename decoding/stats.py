"""Per-generation statistics: the `decoding` object of every response."""

from __future__ import annotations

import time


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
        self.wire_bytes = 0
        self.wire_requests = 0

    def tokens_emitted(self, n: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        else:
            self.steps += 1
        self.tokens += n

    def as_dict(self) -> dict:
        end = time.perf_counter()
        first = self.first_token_at or end
        decoded = self.tokens - 1  # tokens after the first one, produced by the decoding steps
        decode_s = end - first
        return {
            "policy": self.policy,
            "steps": self.steps,
            "tokens_per_step": round(decoded / self.steps, 4) if self.steps else None,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            "ttft_ms": round((first - self.start) * 1000, 3),
            "decode_tokens_per_s": round(decoded / decode_s, 3) if decoded > 0 and decode_s > 0 else None,
            "wire_bytes_per_token": round(self.wire_bytes / self.tokens, 3) if self.tokens else 0.0,
            "wire_requests_per_token": round(self.wire_requests / self.tokens, 4) if self.tokens else 0.0,
        }
