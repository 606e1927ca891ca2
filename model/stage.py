"""The Stage seam: what a policy's forward pass goes through, in-process or on a worker.

A stage holds decoder layers and one KV cache per session. All calls are synchronous; the controller
runs them on its model thread, one at a time.
"""

from __future__ import annotations

from typing import Protocol

import torch

from model.kv_cache import KVCache, KVCacheError
from model.stack import LayerStack


class CapacityError(RuntimeError):
    """A session's KV cache does not fit the memory budget; the message names the numbers."""


class SessionError(KeyError):
    """An operation names a session the stage does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


class Stage(Protocol):
    """Decoder layers plus per-session KV caches."""

    def open(self, session: str, capacity: int, rows: int = 1) -> None:
        """Reserve a KV cache of `capacity` slots and `rows` rows for `session`."""

    def forward(
        self, session: str, hidden: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [B, T, H] at RoPE positions [B, T], cached at slots start..start+T -> hidden [B, T, H]."""

    def truncate(self, session: str, length: int) -> None:
        """Drop cached slots from `length` on."""

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        """Move the slots `kept` to dest, dest+1, ... (Medusa tree commit) and end the cache there."""

    def keep_rows(self, session: str, rows: list[int]) -> None:
        """Keep only the batch rows `rows` of the session's cache (retired rows stop costing compute)."""

    def fork(self, session: str, child: str, prefix_len: int, rows: int, capacity: int) -> None:
        """Open `child` with `rows` rows sharing `session`'s first prefix_len slots read-only."""

    def clone(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        """Open `child` with a copy of `session`'s first prefix_len slots (prefix reuse)."""

    def release(self, session: str) -> None:
        """Free the session's cache (unknown sessions are ignored)."""

    def kv_bytes(self) -> int:
        """Bytes held by KV caches now."""


class LocalStage:
    """An in-process stage over a LayerStack, with a bound on the bytes its KV caches may hold.

    A session's cache starts with room for INITIAL_SLOTS and grows as it is written, so the bound counts
    what sessions use, not the context they might reach; a write that would cross it is refused with a
    CapacityError that names the numbers, and the session's earlier slots stay intact.
    """

    INITIAL_SLOTS = 256

    def __init__(self, stack: LayerStack, kv_budget_bytes: int):
        self.stack = stack
        self.kv_budget_bytes = kv_budget_bytes
        self.caches: dict[str, KVCache] = {}

    def _cache(self, session: str) -> KVCache:
        try:
            return self.caches[session]
        except KeyError:
            raise SessionError(f"unknown session {session!r}") from None

    def _check_room(self, nbytes: int) -> None:
        if nbytes == 0:  # most decoding steps write into storage they have: no sum over every cache
            return
        used = self.kv_bytes()
        if used + nbytes > self.kv_budget_bytes:
            raise CapacityError(
                f"the KV cache needs {nbytes / 2**20:.1f} MiB more but only "
                f"{(self.kv_budget_bytes - used) / 2**20:.1f} of {self.kv_budget_bytes / 2**20:.1f} MiB are free"
            )

    def _add(self, session: str, make) -> None:
        if session in self.caches:
            raise KVCacheError(f"session {session!r} is already open")
        cache = make()
        self._check_room(cache.nbytes)
        self.caches[session] = cache

    def open(self, session: str, capacity: int, rows: int = 1) -> None:
        self._add(session, lambda: self.stack.new_cache(capacity, rows, initial=self.INITIAL_SLOTS))

    def forward(self, session, hidden, positions, start, mask=None):
        cache = self._cache(session)
        cache.check_write(start, hidden.shape[1], hidden.shape[0])
        self._check_room(cache.growth_bytes(start + hidden.shape[1]))
        return self.stack(hidden, positions, cache, start, mask)

    def truncate(self, session: str, length: int) -> None:
        self._cache(session).truncate(length)

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        self._cache(session).commit(kept, dest)

    def keep_rows(self, session: str, rows: list[int]) -> None:
        self._cache(session).keep_rows(rows)

    def fork(self, session: str, child: str, prefix_len: int, rows: int, capacity: int) -> None:
        parent = self._cache(session)
        self._add(child, lambda: parent.fork(prefix_len, rows, capacity, initial=prefix_len + self.INITIAL_SLOTS))

    def clone(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        parent = self._cache(session)
        self._add(child, lambda: parent.clone_prefix(prefix_len, capacity, initial=prefix_len + self.INITIAL_SLOTS))

    def release(self, session: str) -> None:
        self.caches.pop(session, None)

    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def session_bytes(self, session: str) -> int:
        return self.caches[session].nbytes if session in self.caches else 0


class Pipeline:
    """Stages in layer order, used as one stage: each stage's output is the next one's input."""

    def __init__(self, stages: list):
        self.stages = stages

    def forward(self, session, hidden, positions, start, mask=None):
        for stage in self.stages:
            hidden = stage.forward(session, hidden, positions, start, mask)
        return hidden

    def __getattr__(self, name):
        # open, truncate, commit, keep_rows, fork, clone, release: applied to every stage in order.
        if name not in ("open", "truncate", "commit", "keep_rows", "fork", "clone", "release"):
            raise AttributeError(name)

        def each(*args, **kwargs):
            for stage in self.stages:
                getattr(stage, name)(*args, **kwargs)

        return each

    def kv_bytes(self) -> int:
        return sum(s.kv_bytes() for s in self.stages)

    def session_bytes(self, session: str) -> int:
        return sum(s.session_bytes(session) for s in self.stages)

    def wire(self, session: str) -> dict:
        return {}  # in-process: nothing crosses a network
