"""The controller's model: token ends (embedding, norm, head) around a stage pipeline.

Tokens are produced by the engine (model/engine.py): policies hand it programs that plan each step's rows
and accept its output, and every running sequence's rows go through one pass per step. The runner holds the
sessions (admission, prefix reuse, a rebuild after a re-plan) and runs the passes on the process's
ModelThread, so the event loop stays free for I/O; policies run their own tensor work there too, through
`call`. `forward` runs a pass of one session's own (tools that time passes, and tests' references).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from edgespec.model.admission import Admission
from edgespec.model.config import ModelConfig
from edgespec.model.engine import Engine, Work
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.kv_pool import CapacityError
from edgespec.model.prefix import PrefixCache
from edgespec.model.stack import TokenEnds
from edgespec.model.stage import BatchEntry, ClusterFault, StageFailure
from edgespec.model.thread import ModelThread


@dataclass
class Session:
    """A sequence with KV caches on every stage."""

    id: str
    capacity: int
    length: int = 0  # cached slots
    generation: int = 0  # the runner's placement generation its caches were built under
    # the ids in slots 0..len(tokens), a plain run that can be replayed (a rebuild after a re-plan) or reused as a
    # prefix; shorter than `length` after a tree pass or a failed write, until a commit says what the slots hold
    tokens: list[int] = field(default_factory=list)
    passes: int = 0  # forward passes run for it
    shared_with: int = 0  # other sessions' calls in those passes, summed
    forked: bool = False  # one of a group forked from a parent (outline's points): never kept for prefix reuse


@dataclass(frozen=True)
class RunnerOptions:
    """How a ModelRunner serves: cuts(n), the segment ends for the pipelined prefill of n tokens (None: one
    piece); prefix, finished sessions kept for prefix reuse (None: off); admission, the queue of requests
    waiting for KV room; recover(error, generation), awaited on the event loop when a stage failed in work
    begun under that placement generation (a lost worker): it re-places the stages unless that happened since
    (bumping the generation, so that every session is rebuilt from its tokens) and returns whether the work
    may run again (None: stage failures are final); kv, the stages' KV format (what a kept prefix holds on
    workers, whose pools the controller does not see)."""

    cuts: Callable[[int], list[int]] | None = None
    prefix: PrefixCache | None = None
    admission: Admission = field(default_factory=Admission)
    recover: Callable[[Exception, int], Awaitable[bool]] | None = None
    kv: KVFormat = FLOAT32


class SessionLostError(RuntimeError):
    """The placement changed under a session whose cache cannot be rebuilt from its tokens."""



class ModelRunner:
    """Embedding -> stages -> final norm and head, with per-session KV caches on the stages."""

    RECOVERIES = 3  # re-placements tried for one piece of work before its stage failure is final

    def __init__(self, cfg: ModelConfig, ends: TokenEnds, pipeline, thread: ModelThread,
                 options: RunnerOptions | None = None):
        options = options or RunnerOptions()
        self.cfg = cfg
        self.ends = ends
        self.pipeline = pipeline
        self.thread = thread
        self._run = thread.run
        self._ids = itertools.count()
        self.generation = 0  # bumped (on the model thread) whenever the stages are re-assigned
        self.rebuilt = 0  # sessions prefilled again after a re-assignment
        self.cuts = options.cuts
        self.prefix = options.prefix
        self.admission = options.admission
        self._recover = options.recover
        self.kv = options.kv
        self.held: set[str] = set()  # every session holding a cache (kept prefixes aside)
        self.steps = self.step_rows = 0  # forward passes of any kind, and the token rows they carried
        self.engine = Engine(self)

    def placement_changed(self) -> None:
        """The stages were re-assigned and hold no sessions: each is rebuilt at its next forward (model thread)."""
        self.generation += 1

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

    async def call(self, fn, *args):
        """Run fn(*args) on the model thread, in turn with the forward passes (a policy's tensor work)."""
        return await self._run(fn, *args)

    async def open(self, capacity: int, prompt: list[int] | None = None) -> Session:
        """A new session with room for `capacity` slots, reserved on every stage's KV pool. With `prompt`, the
        session may start from the blocks of a kept session that shares a prefix with it (read in place):
        session.length tells how much of the prompt is already cached. When the pool cannot reserve its
        blocks, kept prefixes are dropped, oldest first; then, while other sessions hold caches, the request
        waits for one to be released (model.admission): QueueFullError when the queue is full or the wait runs
        out, CapacityError when nothing else holds room to give."""
        session = Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", capacity, generation=self.generation)
        found = self.prefix.match(prompt, self.generation) if self.prefix and prompt else None
        joined = None  # when the request joined the admission queue
        failures = 0
        try:
            while True:
                try:
                    session.generation = self.generation
                    if found:
                        entry, n = found
                        await self._run(self.pipeline.fork, entry.session.id, session.id, n, capacity)
                        session.length, session.tokens = n, entry.tokens[:n]
                    else:
                        await self._run(self.pipeline.open, session.id, capacity)
                    self.held.add(session.id)
                    if joined is not None:
                        self.admission.leave(joined, admitted=True)
                    return session
                except CapacityError as exc:
                    evicted = self.prefix.pop_lru() if self.prefix else None
                    if evicted is not None:
                        found = None if found and found[0].session is evicted else found
                        await self.thread.run_shielded(self.pipeline.release, evicted.id)
                        continue
                    if not self.held:
                        raise
                    joined = self.admission.join(exc) if joined is None else joined
                    await self.admission.wait(joined, exc)
                except StageFailure as exc:  # a lost worker: open again on the placement without it
                    failures += 1
                    if failures > self.RECOVERIES:
                        raise
                    await self.recover(exc, session.generation)
                    found = None  # kept prefixes were on the old placement
        except BaseException:  # a cancelled await may still have opened the cache on the model thread
            if joined is not None:
                self.admission.leave(joined, admitted=False)
            await self.thread.run_shielded(self.pipeline.release, session.id)
            raise

    async def fork(self, parent: Session, prefix_len: int, capacity: int) -> Session:
        """A new session that reads the parent's first prefix_len slots in place on every stage (outline's
        points after the prompt they share: its blocks are held once); `capacity` counts those slots too.
        After a re-plan it is rebuilt from its tokens like any session, into blocks of its own."""
        tokens = parent.tokens[:prefix_len]
        child = Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", capacity, length=prefix_len,
                        generation=self.generation, tokens=tokens, forked=True)
        try:
            await self._run(self.pipeline.fork, parent.id, child.id, prefix_len, capacity)
        except BaseException:
            await self.thread.run_shielded(self.pipeline.release, child.id)
            raise
        self.held.add(child.id)
        return child

    async def release(self, session: Session) -> None:
        """Free the session, and keep its tokens' blocks for prefix reuse when it is a plain run of tokens."""
        # Callers release in a `finally` that also runs when the request is cancelled (a client that
        # disconnected mid-stream), and may be cancelled again while it runs: the release is a task of its own
        # that runs to its end, so no cancellation leaves the session's blocks held.
        await asyncio.shield(self._release(session))

    async def release_all(self, sessions: list[Session]) -> None:
        """Release several sessions in one task that runs to its end: under an anyio cancel scope (a streamed
        response whose client left) every await of a `finally` is cancelled again, so releasing them one await
        after another left all but the first held (measured: an abandoned outline stream kept 3-5 blocks)."""
        async def each() -> None:
            for session in sessions:
                await self._release(session)

        await asyncio.shield(each())

    async def _release(self, session: Session) -> None:
        freed = [session]
        if self.prefix is not None and len(session.tokens) == session.length and \
                session.generation == self.generation and not session.forked and \
                session.length >= self.prefix.min_tokens:
            kept = await self._keep(session)
            if kept is not None:
                nbytes = self.pipeline.session_bytes(kept.id)  # in-process stages know; workers: None, estimated
                if nbytes is None:
                    nbytes = self.cfg.kv_bytes_per_token(fmt=self.kv) * kept.length
                freed += self.prefix.add(kept, kept.tokens, nbytes, self.generation)
        for s in freed:
            await self._run(self.pipeline.release, s.id)
        # only now: `open` takes an empty `held` for "nothing else will give room back" (a request that cannot
        # fit even an idle pool), and the blocks were not back in the pool before the release above
        self.held.discard(session.id)
        self.admission.released()

    async def _keep(self, session: Session) -> Session | None:
        # A session of exactly the finished one's tokens, sharing its blocks on every stage: kept for prefix
        # reuse, it holds no reservation for the slots the finished one might still have written. Best effort:
        # None when the fork fails (no room for its one partial block, a worker lost or re-placed meanwhile),
        # and the finished request is not disturbed.
        n = session.length
        kept = Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", n, length=n, generation=self.generation,
                       tokens=session.tokens[:n])
        try:
            await self._run(self.pipeline.fork, session.id, kept.id, n, n)
            if kept.generation == self.generation:
                return kept
        except Exception:  # any failure only costs the reuse
            pass
        await self._run(self.pipeline.release, kept.id)
        return None

    def _forward(self, session: Session, ids: torch.Tensor, positions, start: int, mask, last_only: bool, then,
                 features: bool = False):
        # ids [1, T] -> logits [1, T, V] (or [1, 1, V] with last_only), float32; or then(logits[, hidden])
        if session.generation != self.generation:
            self._rebuild(session, start)
        plain = self._note_tokens(session, ids[0].tolist(), positions, mask, start)
        if positions is None:
            positions = torch.arange(start, start + ids.shape[1])[None]
        # Segments pipeline a prompt's prefill. A verification pass of a few tokens goes in one piece: cut like a
        # prompt (the plan's cuts scale down with its length) it would cost a round trip per token.
        cuts = self.cuts(ids.shape[1]) if self.cuts and plain and last_only and ids.shape[1] > 1 else None
        self.steps += 1
        self.step_rows += ids.numel()
        with torch.inference_mode():
            hidden = self.ends.embed_tokens(ids)
            try:
                if cuts and len(cuts) > 1:  # pipelined over workers, else one segment after another
                    hidden = self.pipeline.forward_segments(session.id, hidden, start, cuts)
                else:
                    hidden = self.pipeline.forward(session.id, hidden, positions, start, mask)
            except BaseException:
                del session.tokens[start:]  # slots start.. may be half written: never replay or reuse them
                raise
            logits = self.ends.logits(hidden[:, -1:] if last_only else hidden)
            if then is None:
                return logits
            return then(logits, hidden) if features else then(logits)

    @staticmethod
    def _note_tokens(session: Session, ids: list[int], positions, mask, start: int) -> bool:
        # Record the ids written at slots start.. (a plain run of tokens can be replayed or reused as a prefix);
        # a tree is not a plain run: the slots before it still are. Returns whether this write is plain.
        plain = positions is None and mask is None
        if plain and len(session.tokens) >= start:
            session.tokens[start:] = ids
        else:
            del session.tokens[start:]
        return plain

    def _rebuild(self, session: Session, start: int) -> None:
        # The stages were re-assigned (a re-plan) and dropped their caches: prefill the session's tokens again
        # on the new placement. Only plain runs of tokens can be rebuilt this way.
        if len(session.tokens) < start:
            raise SessionLostError("the cluster was re-planned while this request ran and its cache could not be "
                                   "rebuilt; please retry")
        self.pipeline.release(session.id)
        self.pipeline.open(session.id, session.capacity)
        session.generation = self.generation
        self.rebuilt += 1
        history = session.tokens[:start]
        if history:
            with torch.inference_mode():
                ids = torch.tensor([history])  # [1, L]
                self.pipeline.forward(session.id, self.ends.embed_tokens(ids), torch.arange(len(history))[None], 0)

    async def forward(
        self,
        session: Session,
        ids: torch.Tensor,
        start: int | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
        then: Callable[..., Any] | None = None,
        features: bool = False,
    ) -> Any:
        """A pass of the session's own for tokens ids [1, T] written at cache slots start.. (default: the
        session's end), outside the engine's steps: for tools that time passes and for tests' references
        (requests decode in the engine).

        positions [1, T] default to the slots; mask [1, T, start+T] defaults to causal. Returns float32
        logits [1, T, V], or [1, 1, V] for the last position only; with `then`, returns then(logits)
        computed on the model thread. With `features`, then(logits, hidden) also gets the last layer's
        output hidden [1, T, H] at every position.
        """
        start = session.length if start is None else start
        out = await self._run(self._forward, session, ids, positions, start, mask, last_only, then, features)
        session.length = start + ids.shape[1]
        session.passes += 1
        return out

    def forward_work(self, work: Work) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's rows in a pass of their own (model thread): (logits, hidden with features)."""
        ids = torch.tensor([work.ids])
        return self._forward(work.session, ids, work.positions, work.start, work.mask, work.last_only,
                             lambda logits, hidden: (logits, hidden if work.features else None), features=True)

    def forward_rows(self, works: list[Work]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several single-row sessions' rows in one pass (model thread): each one's (logits [1, T or 1, V],
        hidden [1, T, H] with features). A failure leaves no session marked unreplayable: the engine reruns
        every work alone at once, which rewrites the slots a half-done pass may have written."""
        for work in works:
            if work.session.generation != self.generation:
                self._rebuild(work.session, work.start)
            self._note_tokens(work.session, work.ids, work.positions, work.mask, work.start)
        ids = torch.tensor([t for w in works for t in w.ids])  # [M]
        positions = torch.cat([w.positions[0] if w.positions is not None else
                               torch.arange(w.start, w.start + len(w.ids)) for w in works])  # [M]
        entries = [BatchEntry(w.session.id, w.start, len(w.ids), w.mask) for w in works]
        self.steps += 1
        self.step_rows += len(ids)
        with torch.inference_mode():
            hidden = self.pipeline.forward_batch(entries, self.ends.embed_tokens(ids[None])[0], positions)
            parts = hidden.split([len(w.ids) for w in works])  # [T_i, H] each
            picked = [p[-1:] if w.last_only else p for w, p in zip(works, parts, strict=True)]
            logits = self.ends.logits(torch.cat(picked)[None])[0].split([len(p) for p in picked])
            return [(lg[None], h[None] if w.features else None) for w, lg, h in zip(works, logits, parts, strict=True)]

    @staticmethod
    def truncate(session: Session, length: int) -> None:
        """End the session at slot `length` (a rejected draft). No stage is called: every stage ends a cache
        at the end of each write, and attention reads only up to it, so the next forward (written at
        `length`) truncates it there. Over workers this spares a round trip per worker per verification."""
        session.length = length
        del session.tokens[length:]

    def commit(self, session: Session, kept: list[int], dest: int, tokens: list[int] | None = None) -> None:
        """Keep the cached slots `kept` (ascending) as slots dest, dest+1, ... and end the session there (the
        accepted path of a tree pass; on the model thread, from a program); `tokens`: the ids now in slots 0..
        (a plain run again), if known. Slots already in place are not moved: the stale ones after them are
        never read (attention reads only up to the end of each write) and get overwritten, so no stage is
        called."""
        moved = kept != list(range(dest, dest + len(kept)))
        if moved and session.generation == self.generation:  # else the next forward rebuilds it from the tokens
            self.pipeline.commit(session.id, kept, dest)
        session.length = dest + len(kept)
        session.tokens = list(tokens) if tokens is not None else session.tokens[:dest]

    def others_running(self, session: Session) -> int:
        """How many other sequences run in the engine now (whose steps this one's share)."""
        return self.engine.running(besides=session)

    def wire(self, session: Session) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the session's calls have put on the network so far."""
        return self.pipeline.wire(session.id)

    def kv_bytes(self) -> int:
        return self.pipeline.kv_bytes()

    def pool_blocks(self) -> tuple[int, int]:
        """The stages' KV pool blocks in use and free (zero where workers hold the pools: see their /info)."""
        return self.pipeline.pool_blocks()

    def close(self) -> None:
        self.thread.shutdown()
        self.pipeline.close()
