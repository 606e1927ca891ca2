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
    first) and propose what followed it. No model; pays off where the output copies from the input.

    One drafter serves one growing sequence: every n-gram is indexed once, by where its latest occurrence
    ends, so a lookup costs the same however long the context is."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence with a follower
        self.indexed = 0  # n-grams ending before this position are in `latest`

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], None]:
        end = len(tokens)
        # index the n-grams ending at positions that have a following token (all but the sequence's end)
        for e in range(max(self.indexed, 1), end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.latest[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            e = self.latest.get(tuple(tokens[end - n:]))
            if e is not None:
                return tokens[e:e + k], None
        return [], None


class LookupFirst:
    """n-gram prompt lookup where the sequence's last n tokens occurred before (a copy in progress), else the
    model drafter `fallback`. Which one proposed is a per-step choice, so the rule stays exact either way."""

    def __init__(self, fallback, n: int = 3):
        self.fallback, self.lookup = fallback, NgramDrafter(max_n=n, min_n=n)
        self.name = f"{fallback.name}+ngram"
        self.on_model_thread = getattr(fallback, "on_model_thread", False)
        if hasattr(fallback, "observe"):  # a feature drafter follows the target's hidden states either way
            self.observe = fallback.observe

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        drafts, q = self.lookup.propose(tokens, k)
        return (drafts, q) if drafts else self.fallback.propose(tokens, k)
