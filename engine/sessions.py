"""The engine's sessions on one executor (a lane of the engine: the layer pipeline, or HeadSplit's blocks):
opening one (admission by KV budget, a start from cached blocks), what happens when it ends (its blocks kept
for prefix reuse, then released), however it ends, and the executor's recovery when a stage fails.

An open forks the prefix cache's holder that shares the longest prefix with the prompt (engine/prefix.py), or
waits while a running sequence still computes a longer one. When the stages' pools cannot reserve the new
session's blocks, kept prefixes are dropped, least recently used first; then, while other sessions hold
caches, the request waits for one to be released (engine/admission.py): QueueFullError when the queue is full
or the wait runs out, CapacityError when nothing else holds room to give. A lost worker during an open has the
stages re-placed and the open tried again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from edgespec.engine.admission import Admission
from edgespec.engine.executor import Executor
from edgespec.engine.prefix import PrefixCache, known
from edgespec.engine.session import Session
from edgespec.model.kv_pool import CapacityError
from edgespec.model.stage import ClusterFault, StageFailure

# recover(error, generation): awaited on the event loop when a stage failed in work begun under that placement
# generation (a lost worker): re-places the stages unless that happened since, and returns whether the work may
# run again
Recover = Callable[[Exception, int], Awaitable[bool]]


class Sessions:
    """Every session the engine holds on one executor (kept prefixes aside). prefix: its prefix cache (None:
    every prompt computed); admission: the queue of requests waiting for its KV room; recover: the cluster's
    re-placement after a stage failure (None: stage failures are final)."""

    RECOVERIES = 3  # re-placements tried for one piece of work before its stage failure is final

    def __init__(self, executor: Executor, prefix: PrefixCache | None = None, admission: Admission | None = None,
                 recover: Recover | None = None):
        self.executor, self.prefix, self._recover = executor, prefix, recover
        self.admission = admission or Admission()
        self.held: set[str] = set()

    @property
    def recovers(self) -> bool:
        """Whether a stage failure can be recovered from by re-placing the stages (a cluster with workers)."""
        return self._recover is not None

    async def recover(self, error: Exception, generation: int) -> None:
        """A stage failed with `error` in work begun under placement `generation` (event loop): re-place the
        stages so that the work can run again, or raise ClusterFault when it cannot."""
        if self._recover is None or not isinstance(error, StageFailure):
            raise error
        if not await self._recover(error, generation):
            raise ClusterFault(f"{error}; and no placement of the model fits the devices left") from error

    async def open(self, capacity: int, prompt: list[int] | None,
                   besides: frozenset[str] | set[str] = frozenset()) -> Session:
        """A new session with room for `capacity` slots, reserved on every stage's KV pool; with `prompt`,
        started from the cached blocks holding its longest prefix (session.cached of its slots), after waiting
        for a running sequence (other than those of `besides`) that is computing a longer one."""
        run, prefix = self.executor.thread.run, self.prefix
        joined = None  # when the request joined the admission queue
        failures = 0
        session = None
        try:
            while True:
                if prefix is not None and prompt:
                    while (computing := prefix.pending(prompt, self.executor.generation, besides)) is not None:
                        await computing  # a running sequence is computing more of this prompt: share it
                session = self.executor.new_session(capacity)
                if prefix is not None:  # a request arriving from now on waits for what this one computes
                    prefix.claim(session, prompt)
                try:
                    await run(self._open, session, prompt)
                    self.held.add(session.id)
                    if joined is not None:
                        self.admission.leave(joined, admitted=True)
                    return session
                except CapacityError as exc:
                    if prefix is not None:
                        prefix.drop(session)
                    evicted = prefix.pop_lru() if prefix else None
                    if evicted is not None:
                        await self.executor.thread.run_shielded(self.executor.release, evicted)
                        continue
                    if not self.held:
                        raise
                    joined = self.admission.join(exc) if joined is None else joined
                    await self.admission.wait(joined, exc)
                except StageFailure as exc:  # a lost worker: open again on the placement without it
                    if prefix is not None:
                        prefix.drop(session)
                    failures += 1
                    if failures > self.RECOVERIES:
                        raise
                    await self.recover(exc, session.generation)
        except BaseException:  # a cancelled await may still have opened the cache on the model thread
            if joined is not None:
                self.admission.leave(joined, admitted=False)
            if session is not None:
                await self.executor.thread.run_shielded(self._drop, session)
            raise

    def _open(self, session: Session, prompt: list[int] | None) -> None:
        # model thread: fork the best holder, or open empty
        executor, prefix = self.executor, self.prefix
        for stale in prefix.stale(executor.generation) if prefix is not None else []:
            executor.release(stale)
        found = prefix.best(prompt, executor.generation) if prefix is not None and prompt else None
        if found is not None:
            executor.fork(found[0], session, found[1])
            session.cached = found[1]
        else:
            executor.open(session)

    async def release_all(self, sessions: list[Session]) -> None:
        """End the sessions, however their sequences ended: each one's known tokens' blocks are kept for
        prefix reuse, then it is released. One task that runs to its end: under an anyio cancel scope (a
        streamed response whose client left) every await of a `finally` is cancelled again, so releasing them
        one await after another left all but the first held (measured: an abandoned outline stream kept 3-5
        blocks)."""
        async def each() -> None:
            for session in sessions:
                await self.executor.thread.run(self._release, session)
                # only now: `open` takes an empty `held` for "nothing else will give room back" (a request that
                # cannot fit even an idle pool), and the blocks were not back in the pool before the release
                self.held.discard(session.id)
                self.admission.released()

        await asyncio.shield(each())

    def _release(self, session: Session) -> None:
        # model thread: keep a session of its known tokens (sharing its blocks), then release it
        executor, prefix = self.executor, self.prefix
        session.wire = executor.wire(session)  # the figures its statistics may still read
        freed = [session]
        if prefix is not None:
            prefix.drop(session)
            n = known(session)
            if session.generation == executor.generation and n >= prefix.min_tokens:
                kept = executor.new_session(n)
                try:
                    executor.fork(session, kept, n)
                    freed += prefix.keep(kept, executor.session_bytes(kept))
                except Exception:  # no room for its one partial block, a worker lost: only the reuse is lost
                    freed.append(kept)
        for s in freed:
            executor.release(s)

    def _drop(self, session: Session) -> None:
        # model thread: a session whose open did not complete (cancelled)
        if self.prefix is not None:
            self.prefix.drop(session)
        self.executor.release(session)
