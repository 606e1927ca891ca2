"""Drafters: cheap proposals of the next K tokens for speculative decoding.

A drafter sees the whole sequence so far (prompt and output) and returns up to K token ids, and the
distributions it drew them from, or None when its proposals are point masses (no probabilities).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    name: str

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k draft tokens continuing `tokens`, and their distributions [k, V] (or None: point masses)."""


class NgramDrafter:
    """Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first) and propose what followed it. No model; pays off where the output copies from the input."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], None]:
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            tail = tokens[end - n:]
            # latest match first: the most recent context is the likeliest to continue the same way
            for i in range(end - n - 1, -1, -1):
                if tokens[i:i + n] == tail:
                    return tokens[i + n:i + n + k], None
        return [], None
