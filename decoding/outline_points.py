"""The token budget outline's points share. Each point is a sequence of its own (decoding/outline.py), and
this budget watches every token each point's TextStream takes (its `until`).

A point that ends early leaves its tokens to the others: each point's fair share is what the budget leaves
after the points that ended, divided among the live ones, and past SOFT of it a point ends at the next token
that closes a sentence or a line rather than being cut mid-sentence (equal fixed shares cut five of six
points mid-sentence: bench/results/issue8-outline/side_by_side.md). Hard caps (each stream's max_tokens) keep
the total within the budget; as the last tokens are divided each live point may still take one, so the
expansions end at most one token per point past it.

What a point is granted depends on how far the others have got when it takes a token: the tokens a point
emits are always its policy's own (a prefix of what it would write alone), but where it ends can move with
how many tokens a step gives each point (a verifying policy's steps give several).
"""

from __future__ import annotations

from functools import partial

SOFT = 0.75
SENTENCE_ENDS = (".", "!", "?")


def ends_sentence(text: str) -> bool:
    """Whether `text` (the end of a point's output) closes a sentence or a line."""
    return text.endswith("\n") or text.rstrip(" ").endswith(SENTENCE_ENDS)


class SharedBudget:
    """`total` tokens for the points whose TextStreams are `streams` (used on the model thread only)."""

    def __init__(self, total: int, streams: list):
        self.total, self.streams = total, streams
        self.made = [0] * len(streams)
        self.live = set(range(len(streams)))
        self.ended_early = 0  # points ended at a sentence end, past their share
        for point, stream in enumerate(streams):
            stream.until = partial(self.until, point)
        self._cap()

    def fair(self) -> float:
        """Each live point's share: the budget less what the ended points took, divided among the live ones."""
        ended = sum(m for i, m in enumerate(self.made) if i not in self.live)
        return (self.total - ended) / max(1, len(self.live))

    def until(self, point: int, stream) -> bool:
        """After each token of a point (its TextStream asks): True when the point ends here though its policy
        would go on."""
        self.made[point] = len(stream.ids)
        end = not stream.finished and self.made[point] >= SOFT * self.fair() and ends_sentence(stream.tail())
        if end or stream.finished:
            self.live.discard(point)
            self.ended_early += end
        self._cap()
        return end

    def _cap(self) -> None:
        # Every live point may take an equal part of what is left (the earlier ones the remainder), and no
        # more, whatever its policy's own max_tokens.
        left = self.total - sum(self.made)
        live = sorted(self.live)
        for rank, i in enumerate(live):
            part = left // len(live) + (rank < left % len(live))
            self.streams[i].max_tokens = self.made[i] + max(1, part)
