"""The prefix cache: computed KV by content, so that a prompt that starts the way another sequence's tokens do
(a long system prompt sent with every request, the prompt outline's points share, an earlier turn of a chat)
starts from those slots, read in place on every stage, instead of computing them again.

Holders are sessions whose slots hold known tokens: every running sequence (from the moment its session
opens: its prompt is a claim on the slots it is computing), and the blocks of every sequence that ended,
however it ended (finished, cancelled, its client gone, failed, re-planned: what its slots hold is kept), as a
session of those tokens alone. A new session forks the holder sharing its longest prefix (model/kv_pool.py:
the blocks are shared by reference, and a partial block is copied when either side first writes into it); a
request whose prefix another running sequence is still computing waits for it (Sessions.open) instead of
computing it beside it. Kept holders are evicted least recently used: past `max_bytes`, and whenever the pool
needs their blocks for a new session.

Holders' tokens change on the model thread (between passes they are what their slots hold); a running
sequence's claim is made on the event loop as its open begins, so that a request arriving a moment later waits
for it. The event loop reads claims and progress only to decide whether to wait: the open itself matches again
on the model thread. The holders are guarded by a lock, taken by both threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass

from edgespec.engine.session import Session


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def known(session: Session) -> int:
    """Slots of the session whose tokens are known (a tree pass or a failed write leaves fewer)."""
    return min(len(session.tokens), session.length)


@dataclass
class Holder:
    session: Session
    kept: bool  # the blocks of a sequence that ended (evictable), or a running sequence's own session
    claim: tuple[int, ...] = ()  # running: the prompt it is computing
    nbytes: int = 0  # kept: its KV bytes (an estimate where the blocks are shared)


class PrefixCache:
    """Holders by recency; kept ones at most max_bytes of KV in all. Matches of fewer than min_tokens are not
    worth a fork."""

    def __init__(self, max_bytes: int, min_tokens: int = 32):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.holders: OrderedDict[str, Holder] = OrderedDict()
        self.hits = self.reused_tokens = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future | None = None  # set when a holder computed more or ended (event loop)

    @property
    def nbytes(self) -> int:
        """KV bytes of the kept holders."""
        with self._lock:
            return sum(h.nbytes for h in self.holders.values() if h.kept)

    @property
    def kept(self) -> int:
        with self._lock:
            return sum(h.kept for h in self.holders.values())

    # model thread

    def best(self, prompt: list[int], generation: int) -> tuple[Session, int] | None:
        """The holder sharing the longest computed prefix with `prompt` under placement `generation` (at least
        min_tokens, and one prompt token left to compute), and that prefix's length; counted as a hit."""
        found, length = None, 0
        with self._lock:
            for holder in self.holders.values():
                session = holder.session
                if session.generation == generation:
                    n = min(common_prefix(session.tokens[:known(session)], prompt), len(prompt) - 1)
                    if n > length:
                        found, length = holder, n
            if found is None or length < self.min_tokens:
                return None
            self.holders.move_to_end(found.session.id)
        self.hits += 1
        self.reused_tokens += length
        return found.session, length

    def claim(self, session: Session, prompt: list[int] | None) -> None:
        """A running sequence's session, from the start of its open (event loop): a holder from now on,
        computing `prompt`."""
        with self._lock:
            self.holders[session.id] = Holder(session, False, tuple(prompt or ()))

    def progress(self) -> None:
        """Holders computed more (after a step): wake the requests waiting for them, if any."""
        changed, loop = self._changed, self._loop
        if changed is not None and loop is not None and not changed.done():
            self._changed = None  # one wake per wait: the next pending() makes a new future
            loop.call_soon_threadsafe(self._wake, changed)

    def keep(self, kept: Session, nbytes: int) -> list[Session]:
        """A session of an ended sequence's known tokens, sharing its blocks: kept. Returns the kept sessions
        evicted to stay within max_bytes (to release); the new one itself if it alone is over it or too short."""
        if known(kept) < self.min_tokens or nbytes > self.max_bytes:
            return [kept]
        with self._lock:
            self.holders[kept.id] = Holder(kept, True, nbytes=nbytes)
        evicted = []
        while self.nbytes > self.max_bytes and (oldest := self.pop_lru()) is not None:
            evicted.append(oldest)
        return evicted

    def drop(self, session: Session) -> None:
        """The session is released, or its open failed: no longer a holder."""
        with self._lock:
            dropped = self.holders.pop(session.id, None) is not None
        if dropped:
            self.progress()

    def pop_lru(self) -> Session | None:
        """The least recently used kept session (to release when the pool needs its blocks), or None."""
        with self._lock:
            for sid, holder in self.holders.items():
                if holder.kept:
                    del self.holders[sid]
                    return holder.session
        return None

    def stale(self, generation: int) -> list[Session]:
        """The kept sessions cached under another placement (to release: their slots are gone)."""
        with self._lock:
            gone = [h.session for h in self.holders.values() if h.kept and h.session.generation != generation]
            for session in gone:
                del self.holders[session.id]
        return gone

    # event loop

    def pending(self, prompt: list[int], generation: int, besides: frozenset[str] | set[str] = frozenset()
                ) -> asyncio.Future | None:
        """When a running sequence (not one of `besides`) is still computing more of `prompt`'s prefix than any
        holder has computed: a future set when a holder computes more or ends, to match again then. None: open
        now."""
        have, coming = 0, 0
        with self._lock:
            for holder in self.holders.values():
                session = holder.session
                if session.generation != generation:
                    continue
                have = max(have, common_prefix(session.tokens[:known(session)], prompt))
                if holder.claim and session.id not in besides:
                    coming = max(coming, common_prefix(holder.claim, prompt))
        coming = min(coming, len(prompt) - 1)
        if coming < self.min_tokens or coming <= have:
            return None
        self._loop = asyncio.get_running_loop()
        if self._changed is None or self._changed.done():
            self._changed = self._loop.create_future()
        return self._changed

    @staticmethod
    def _wake(changed: asyncio.Future) -> None:
        if not changed.done():
            changed.set_result(None)
