"""Drafters: cheap proposals of the next K tokens for speculative decoding.

A drafter sees the whole sequence so far (prompt and output) and returns up to K token ids, and the
distributions it drew them from, or None when its proposals are point masses (no probabilities). The drafters:
NgramDrafter here, decoding/draft_model.py's ModelDrafter, decoding/eagle.py's FeatureDrafter.
"""

from __future__ import annotations

from typing import Protocol

import torch

from edgespec.decoding.types import SamplingParams


class Drafter(Protocol):
    """What speculative decoding asks of a drafter (decoding/speculative.py)."""

    name: str
    # it computes with a model (on the model thread): skipped in a step shared with others. Else it is a lookup,
    # whose K longest drafts cost what fewer do: asked for the longest before K is chosen (decoding/speculative.py)
    on_model_thread: bool
    reads_features: bool  # it follows the target's last hidden states: the target's passes return them for observe

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to k draft tokens continuing `tokens`, and their distributions [k, V] (or None: point masses)."""

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The target's last-layer outputs hidden [T, H] at positions start..start+T-1 (accepted ones only);
        called only where reads_features."""


class DraftSource(Protocol):
    """Weights that give each request a drafter of its own (decoding/draft_model.py's DraftModel,
    decoding/eagle.py's FeatureDraftModel)."""

    def drafter(self, params: SamplingParams, capacity: int) -> Drafter:
        """One request's drafter (`capacity`: the sequence's slots)."""


class NgramDrafter:
    """Prompt lookup decoding: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first) and propose what followed it. No model; pays off where the output copies from the input.

    One drafter serves one growing sequence: every n-gram is indexed once, by where its latest occurrence
    ends, so a lookup costs the same however long the context is."""

    name = "ngram"
    on_model_thread = False
    reads_features = False

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
            latest = self.latest.get(tuple(tokens[end - n:]))
            if latest is not None:
                return tokens[latest:latest + k], None
        return [], None

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """Reads no features."""
