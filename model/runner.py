"""The controller's model: token ends (embedding, norm, head) around a stage pipeline.

Policies drive it through async methods; the tensor work runs on the process's ModelThread, so the event
loop stays free for I/O. Policies run their own tensor work (sampling) there too, through `call`.

Concurrent requests share passes: forward calls of single-row sessions that are waiting at the same time run
as one pass over all their rows (`Stage.forward_batch`), so the matmuls read the weights once for every
stream. Waiting calls are not handed over while a pass is under way (the model thread is busy, and the
sessions in that pass come back right after it); once it is over they wait for the other open sessions'
calls (they are sampling or sending their last token) at most a quarter of the last pass's time, and at
least BATCH_WAIT_S. Each row's result is bitwise what its session alone would get
(tests/test_exact_format.py), so batching changes no answer.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.admission import Admission
from model.config import ModelConfig
from model.prefix import PrefixCache
from model.stack import TokenEnds
from model.stage import BatchEntry, CapacityError
from model.thread import ModelThread


@dataclass
class Session:
    """A sequence (or a batch of rows) with KV caches on every stage."""

    id: str
    capacity: int
    rows: int = 1
    length: int = 0  # cached slots
    generation: int = 0  # the runner's placement generation its caches were built under
    tokens: list[int] | None = field(default_factory=list)  # ids in slots 0..length; None: cannot be replayed
    passes: int = 0  # forward passes run for it
    shared_with: int = 0  # other sessions' calls in those passes, summed


@dataclass(frozen=True)
class RunnerOptions:
    """How a ModelRunner serves: cuts(n), the segment ends for the pipelined prefill of n tokens (None: one
    piece); prefix, finished sessions kept for prefix reuse (None: off); admission, the queue of requests
    waiting for KV room."""

    cuts: Callable[[int], list[int]] | None = None
    prefix: PrefixCache | None = None
    admission: Admission = field(default_factory=Admission)


class SessionLostError(RuntimeError):
    """The placement changed under a session whose cache cannot be rebuilt from its tokens."""


@dataclass
class _Call:
    """A forward call waiting to join a shared pass: _forward's arguments and the future of its result."""

    session: Session
    ids: torch.Tensor
    positions: torch.Tensor | None
    start: int
    mask: torch.Tensor | None
    last_only: bool
    then: Callable[..., Any] | None
    features: bool
    future: asyncio.Future


class ModelRunner:
    """Embedding -> stages -> final norm and head, with per-session KV caches on the stages."""

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
        self.held: set[str] = set()  # every session holding a cache (kept prefixes aside)
        self.open_sessions: set[str] = set()  # single-row sessions that may join a shared pass
        self.waiting: list[_Call] = []  # forward calls not yet handed to the model thread
        self.first_wait = 0.0  # when the oldest of them arrived
        self.flush_due = False  # a check of `waiting` is scheduled on the event loop
        self.running: set[asyncio.Task] = set()  # shared passes under way
        self.passes = self.batched_rows = 0  # shared passes run, and the calls they carried
        self.steps = self.step_rows = 0  # forward passes of any kind, and the token rows they carried
        self.last_pass_s = 0.0  # how long the last pass of waiting calls took
        self.pass_ended = 0.0  # when its results were handed out

    def placement_changed(self) -> None:
        """The stages were re-assigned and hold no sessions: each is rebuilt at its next forward (model thread)."""
        self.generation += 1

    async def call(self, fn, *args):
        """Run fn(*args) on the model thread, in turn with the forward passes (a policy's tensor work)."""
        return await self._run(fn, *args)

    async def open(self, capacity: int, rows: int = 1, prompt: list[int] | None = None) -> Session:
        """A new session with room for `capacity` slots. With `prompt`, the session may start with the KV of a
        kept session that shares a prefix with it: session.length tells how much of the prompt is already
        cached. When the cache does not fit, kept prefixes are dropped, oldest first; then, while other
        sessions hold caches, the request waits for one to be released (model.admission): QueueFullError
        when the queue is full or the wait runs out, CapacityError when nothing else holds room to give."""
        session = Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", capacity, rows, generation=self.generation)
        found = self.prefix.match(prompt, self.generation) if self.prefix and prompt and rows == 1 else None
        joined = None  # when the request joined the admission queue
        try:
            while True:
                try:
                    if found:
                        entry, n = found
                        await self._run(self.pipeline.clone, entry.session.id, session.id, n, capacity)
                        session.length, session.tokens = n, entry.tokens[:n]
                    else:
                        await self._run(self.pipeline.open, session.id, capacity, rows)
                    self.held.add(session.id)
                    if rows == 1:
                        self.open_sessions.add(session.id)
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
        except BaseException:  # a cancelled await may still have opened the cache on the model thread
            if joined is not None:
                self.admission.leave(joined, admitted=False)
            await self.thread.run_shielded(self.pipeline.release, session.id)
            raise

    async def fork(self, parent: Session, prefix_len: int, rows: int, capacity: int) -> Session:
        """A new session of `rows` rows that shares the parent's first prefix_len slots read-only on every stage
        (outline's points after their common prompt); `capacity` counts those slots too. Release it before
        the parent."""
        child = Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", capacity, rows, length=prefix_len,
                        generation=self.generation, tokens=None)
        try:
            await self._run(self.pipeline.fork, parent.id, child.id, prefix_len, rows, capacity)
        except BaseException:
            await self.thread.run_shielded(self.pipeline.release, child.id)
            raise
        self.held.add(child.id)
        return child

    async def release(self, session: Session) -> None:
        """Free the session, or keep it for prefix reuse when it is a plain run of tokens."""
        # Callers release in a `finally` that also runs when the request is cancelled (a client that
        # disconnected mid-stream): shielded, so cancelling it does not leak the session's KV cache.
        self.open_sessions.discard(session.id)
        self.held.discard(session.id)
        freed = [session]
        if self.prefix is not None and session.tokens is not None and session.generation == self.generation:
            tokens = session.tokens[:session.length]
            nbytes = self.pipeline.session_bytes(session.id)  # in-process stages know; workers: None, estimated
            if nbytes is None:
                nbytes = self.cfg.kv_bytes_per_token(dtype=self.ends.dtype) * len(tokens)
            freed = self.prefix.add(session, tokens, nbytes, self.generation)
        for s in freed:
            await self.thread.run_shielded(self.pipeline.release, s.id)
        self.admission.released()

    async def prefill(self, session: Session, prompt: list[int], then: Callable[..., Any] | None = None,
                      features: bool = False):
        """The prompt's tokens not cached yet (see open), with the last position's logits (or then(logits)).

        While other sessions are open, a prompt longer than PREFILL_CHUNK goes in chunks of that many tokens,
        each a call that joins the others' shared pass: a long prompt then delays the running streams by a
        chunk per step, not by its whole prefill. Chunks give the bits one pass gives (every kernel is
        row-invariant and each query row attends over exactly its slots); with `features`, then() still gets
        every prompt position's hidden state."""
        todo = prompt[session.length:]
        if session.rows != 1 or len(todo) <= self.PREFILL_CHUNK or len(self.open_sessions) < 2:
            return await self.forward(session, torch.tensor([todo]), last_only=True, then=then, features=features)
        earlier = []  # hidden [1, chunk, H] of the chunks before the last
        while len(todo) > self.PREFILL_CHUNK:
            chunk, todo = todo[:self.PREFILL_CHUNK], todo[self.PREFILL_CHUNK:]
            earlier.append(await self.forward(session, torch.tensor([chunk]), last_only=True,
                                              then=lambda _, hidden: hidden, features=True))
        last = then
        if then is not None and features:
            def last(logits, hidden):
                return then(logits, torch.cat([*earlier, hidden], dim=1))
        return await self.forward(session, torch.tensor([todo]), last_only=True, then=last, features=features)

    # Prompt tokens per pass while other streams decode. On a 2-core AVX2 EPYC a pass costs about 2.5 ms per
    # row past a few rows: chunks of 64 stretched 4 streams' gap between tokens from 24 to 290 ms while a
    # 485-token prompt went in; with 16 the gap stayed under about 5 steady gaps and the prompt's first token
    # within 2x its idle time (bench/concurrency.py). Smaller chunks trade the one for the other.
    PREFILL_CHUNK = 16

    def _forward(self, session: Session, ids: torch.Tensor, positions, start: int, mask, last_only: bool, then,
                 features: bool = False):
        # ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), float32; or then(logits[, hidden])
        if session.generation != self.generation:
            self._rebuild(session, start)
        plain = self._note_tokens(session, ids, positions, mask, start)
        if positions is None:
            positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
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
                session.tokens = None  # its caches may be half written: never replay or reuse them
                raise
            logits = self.ends.logits(hidden[:, -1:] if last_only else hidden)
            if then is None:
                return logits
            return then(logits, hidden) if features else then(logits)

    @staticmethod
    def _note_tokens(session: Session, ids: torch.Tensor, positions, mask, start: int) -> bool:
        # Record the ids written at slots start.. (a plain run of tokens can be replayed or reused as a prefix);
        # a tree or a batch of rows is not a plain run. Returns whether this write is plain.
        plain = positions is None and mask is None and session.rows == 1
        if session.tokens is not None:
            if plain:
                session.tokens[start:] = ids[0].tolist()
            else:
                session.tokens = None
        return plain

    def _rebuild(self, session: Session, start: int) -> None:
        # The stages were re-assigned (a re-plan) and dropped their caches: prefill the session's tokens again
        # on the new placement. Only plain runs of tokens can be rebuilt this way.
        if session.tokens is None:
            raise SessionLostError("the cluster was re-planned while this request ran and its cache could not be "
                                   "rebuilt; please retry")
        self.pipeline.release(session.id)
        self.pipeline.open(session.id, session.capacity, session.rows)
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
        """Run tokens ids [B, T] written at cache slots start.. (default: the session's end).

        positions [B, T] default to the slots; mask [B, T, start+T] defaults to causal. Returns float32
        logits [B, T, V], or [B, 1, V] for the last position only; with `then`, returns then(logits)
        computed on the model thread (sampling there saves a thread hand-off per token). With `features`,
        then(logits, hidden) also gets the last layer's output hidden [B, T, H] at every position (before the
        final norm; a feature drafter reads it).
        """
        start = session.length if start is None else start
        if session.rows == 1 and ids.shape[0] == 1 and session.id in self.open_sessions and not self._segmented(
                ids, positions, mask, last_only):
            future = asyncio.get_running_loop().create_future()
            self.waiting.append(_Call(session, ids, positions, start, mask, last_only, then, features, future))
            if len(self.waiting) == 1:
                self.first_wait = time.perf_counter()
            self._schedule_flush()
            out = await future
        else:
            out = await self._run(self._forward, session, ids, positions, start, mask, last_only, then, features)
        session.length = start + ids.shape[1]
        session.passes += 1
        return out

    # The least a call may wait for the other open sessions' calls: streams also spend model-thread time between
    # their passes (sampling, a draft, rolling back rejected drafts), and with 2 ms two streams fell out of step
    # and alternated instead of sharing (tests/test_api_http.py's concurrency test, now and then).
    BATCH_WAIT_S = 0.004

    def _segmented(self, ids, positions, mask, last_only) -> bool:
        # a prompt prefilled in pipelined segments runs on its own (its segments are the pipeline's batch)
        return bool(self.cuts) and positions is None and mask is None and last_only and ids.shape[1] > 1 and len(
            self.cuts(ids.shape[1])) > 1

    def _schedule_flush(self) -> None:
        if not self.flush_due:
            self.flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_when_ready)

    def _flush_when_ready(self) -> None:
        # Hand the waiting calls to the model thread once every open session has one (the step's batch is
        # whole), or once no pass is under way and they have waited the bound since the later of their arrival
        # and the last pass's end (the others are busy elsewhere); else look again soon. Handing them over
        # while a pass runs would only queue them behind it, and the sessions of that pass, back a moment
        # later, would miss them: over two workers (a 30 ms pass) 4 streams fell into alternating phases
        # and shared almost no pass (1.12x one stream's speed).
        self.flush_due = False
        live = [c for c in self.waiting if not c.future.cancelled()]
        if not live:
            self.waiting = []
            return
        waited = time.perf_counter() - max(self.first_wait, self.pass_ended)
        bound = max(self.BATCH_WAIT_S, self.last_pass_s / 4)
        if len(live) < len(self.open_sessions) and (self.running or waited < bound):
            self.flush_due = True
            asyncio.get_running_loop().call_later(self.BATCH_WAIT_S / 4, self._flush_when_ready)
            return
        self.waiting = []
        task = asyncio.ensure_future(self._pass(live))
        self.running.add(task)  # a reference until it is done: the loop keeps only weak ones
        task.add_done_callback(self.running.discard)

    async def _pass(self, calls: list[_Call]) -> None:
        try:
            results = await self._run(self._forward_shared, calls)
        except BaseException as exc:  # the model thread's executor is gone (shutdown)
            results = [exc] * len(calls)
        for call, result in zip(calls, results, strict=True):
            if call.future.cancelled():
                continue
            if isinstance(result, BaseException):
                call.future.set_exception(result)
            else:
                call.future.set_result(result)
        self.pass_ended = time.perf_counter()

    def _forward_shared(self, calls: list[_Call]) -> list:
        # On the model thread: the calls' rows in one pass, each call's result (or exception) in order. A call
        # whose request was cancelled meanwhile is left out (its session may be released right after).
        live = [c for c in calls if not c.future.cancelled()]
        out: dict[int, Any] = {}
        began = time.perf_counter()
        if len(live) > 1:
            try:
                for call, result in zip(live, self._forward_rows(live), strict=True):
                    out[id(call)] = result
                    call.session.shared_with += len(live) - 1
                self.passes += 1
                self.batched_rows += len(live)
            except Exception:  # one session's error (its KV budget, say) must not fail the others: alone
                out = {}
        results = []
        for call in calls:
            if id(call) in out:
                results.append(out[id(call)])
                continue
            try:
                results.append(self._forward(call.session, call.ids, call.positions, call.start, call.mask,
                                             call.last_only, call.then, call.features))
            except Exception as exc:
                results.append(exc)
        self.last_pass_s = time.perf_counter() - began
        return results

    def _forward_rows(self, calls: list[_Call]) -> list:
        # _forward for several single-row sessions in one pass: ids [1, T_i] each -> each call's result
        for call in calls:
            if call.session.generation != self.generation:
                self._rebuild(call.session, call.start)
            self._note_tokens(call.session, call.ids, call.positions, call.mask, call.start)
        ids = torch.cat([c.ids[0] for c in calls])  # [M]
        positions = torch.cat([c.positions[0] if c.positions is not None else
                               torch.arange(c.start, c.start + c.ids.shape[1]) for c in calls])  # [M]
        entries = [BatchEntry(c.session.id, c.start, c.ids.shape[1], c.mask) for c in calls]
        self.steps += 1
        self.step_rows += len(ids)
        with torch.inference_mode():
            # A failure leaves no session marked unreplayable: _forward_shared reruns every call alone at once,
            # which rewrites the slots a half-done pass may have written (a failing call marks its own session).
            hidden = self.pipeline.forward_batch(entries, self.ends.embed_tokens(ids[None])[0], positions)
            parts = hidden.split([c.ids.shape[1] for c in calls])  # [T_i, H] each
            picked = [p[-1:] if c.last_only else p for c, p in zip(calls, parts, strict=True)]
            logits = self.ends.logits(torch.cat(picked)[None])[0].split([len(p) for p in picked])
            results = []
            for call, lg, h in zip(calls, logits, parts, strict=True):
                lg = lg[None]  # [1, T or 1, V]
                if call.then is None:
                    results.append(lg)
                else:
                    results.append(call.then(lg, h[None]) if call.features else call.then(lg))
            return results

    @staticmethod
    def truncate(session: Session, length: int) -> None:
        """End the session at slot `length` (a rejected draft). No stage is called: every stage ends a cache
        at the end of each write, and attention reads only up to it, so the next forward (written at
        `length`) truncates it there. Over workers this spares a round trip per worker per verification."""
        session.length = length
        if session.tokens is not None:
            del session.tokens[length:]

    def _commit(self, session: Session, kept: list[int], dest: int) -> None:
        if session.generation == self.generation:  # else the next forward rebuilds the cache from the tokens
            self.pipeline.commit(session.id, kept, dest)

    async def commit(self, session: Session, kept: list[int], dest: int, tokens: list[int] | None = None) -> None:
        """Keep the cached slots `kept` (ascending) as slots dest, dest+1, ... and end the session there (the
        accepted path of a tree pass); `tokens`: the ids now in slots 0.. (a plain run again), if known.
        Slots already in place are not moved: the stale ones after them are never read (attention reads only
        up to the end of each write) and get overwritten, so no stage is called."""
        if kept != list(range(dest, dest + len(kept))):
            await self._run(self._commit, session, kept, dest)
        session.length = dest + len(kept)
        session.tokens = list(tokens) if tokens is not None else None

    def _keep_rows(self, session: Session, rows: list[int]) -> None:
        if session.generation != self.generation:
            raise SessionLostError("the cluster was re-planned while this batch ran; please retry")
        self.pipeline.keep_rows(session.id, rows)

    async def keep_rows(self, session: Session, rows: list[int]) -> None:
        """Keep only the batch rows `rows` (ascending) of a batched session, renumbered 0.. on every stage:
        finished rows retire and later forward passes carry only the others."""
        await self._run(self._keep_rows, session, rows)
        session.rows = len(rows)

    def others_open(self, session: Session) -> int:
        """How many other single-row sessions hold a cache now (streams whose steps share passes with this one)."""
        return len(self.open_sessions) - (session.id in self.open_sessions)

    def wire(self, session: Session) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the session's calls have put on the network so far."""
        return self.pipeline.wire(session.id)

    def kv_bytes(self) -> int:
        return self.pipeline.kv_bytes()

    def close(self) -> None:
        self.thread.shutdown()
        self.pipeline.close()
