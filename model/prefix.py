"""Prefix reuse: finished sessions kept with their KV caches, so that a later prompt that starts the same way
(a long system prompt sent with every request) copies that prefix's KV instead of computing it again.

Bookkeeping only (token ids, sessions, byte estimates); the runner does the KV work. Used from the event
loop's thread only. Bounded in bytes, evicted least recently used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Entry:
    session: object  # model.runner.Session, its cache on every stage
    tokens: list[int]  # the ids in its slots 0..len(tokens)
    nbytes: int
    generation: int  # the placement it was cached under


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Finished sessions by recency, at most max_bytes of KV in all."""

    def __init__(self, max_bytes: int, min_tokens: int = 32):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.hits = self.reused_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def match(self, prompt: list[int], generation: int) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with `prompt` (at least min_tokens, and at least one prompt token
        left to compute), and that prefix's length; marks it used."""
        best, length = None, 0
        for entry in self.entries.values():
            if entry.generation == generation:
                n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
                if n > length:
                    best, length = entry, n
        if best is None or length < self.min_tokens:
            return None
        self.entries.move_to_end(best.session.id)
        self.hits += 1
        self.reused_tokens += length
        return best, length

    def add(self, session, tokens: list[int], nbytes: int, generation: int) -> list:
        """Keep a finished session; returns the sessions evicted to stay within the bound (to be released),
        the new one itself if it alone is over the bound or too short."""
        if len(tokens) < self.min_tokens or nbytes > self.max_bytes:
            return [session]
        self.entries[session.id] = Entry(session, tokens, nbytes, generation)
        evicted = []
        while self.nbytes > self.max_bytes:
            evicted.append(self.entries.popitem(last=False)[1].session)
        return evicted

    def pop_lru(self):
        """The least recently used session (to release when memory runs short), or None."""
        return self.entries.popitem(last=False)[1].session if self.entries else None
