"""The controller's model: token ends (embedding, norm, head) around a stage pipeline.

Policies drive it through async methods; the tensor work runs on the process's ModelThread, so concurrent
requests interleave step by step (each with its own KV cache) and the event loop stays free for I/O.
Policies run their own tensor work (sampling) there too, through `call`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from model.config import ModelConfig
from model.prefix import PrefixCache
from model.stack import TokenEnds
from model.stage import CapacityError
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


class SessionLostError(RuntimeError):
    """The placement changed under a session whose cache cannot be rebuilt from its tokens."""


class ModelRunner:
    """Embedding -> stages -> final norm and head, with per-session KV caches on the stages."""

    def __init__(self, cfg: ModelConfig, ends: TokenEnds, pipeline, thread: ModelThread):
        self.cfg = cfg
        self.ends = ends
        self.pipeline = pipeline
        self.thread = thread
        self._run = thread.run
        self._ids = itertools.count()
        self.generation = 0  # bumped (on the model thread) whenever the stages are re-assigned
        self.rebuilt = 0  # sessions prefilled again after a re-assignment
        self.cuts: Callable[[int], list[int]] | None = None  # segment ends for pipelined prefill of n tokens
        self.prefix: PrefixCache | None = None  # finished sessions kept for prefix reuse

    def placement_changed(self) -> None:
        """The stages were re-assigned and hold no sessions: each is rebuilt at its next forward (model thread)."""
        self.generation += 1

    async def call(self, fn, *args):
        """Run fn(*args) on the model thread, in turn with the forward passes (a policy's tensor work)."""
        return await self._run(fn, *args)

    async def open(self, capacity: int, rows: int = 1, prompt: list[int] | None = None) -> Session:
        """A new session with room for `capacity` slots; CapacityError when it does not fit even after
        releasing every kept prefix. With `prompt`, the session may start with the KV of a kept session
        that shares a prefix with it: session.length tells how much of the prompt is already cached."""
        session = Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", capacity, rows, generation=self.generation)
        found = self.prefix.match(prompt, self.generation) if self.prefix and prompt and rows == 1 else None
        try:
            while True:
                try:
                    if found:
                        entry, n = found
                        await self._run(self.pipeline.clone, entry.session.id, session.id, n, capacity)
                        session.length, session.tokens = n, entry.tokens[:n]
                    else:
                        await self._run(self.pipeline.open, session.id, capacity, rows)
                    return session
                except CapacityError:
                    evicted = self.prefix.pop_lru() if self.prefix else None
                    if evicted is None:
                        raise
                    found = None if found and found[0].session is evicted else found
                    await self.thread.run_shielded(self.pipeline.release, evicted.id)
        except BaseException:  # a cancelled await may still have opened the cache on the model thread
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
        return child

    async def release(self, session: Session) -> None:
        """Free the session, or keep it for prefix reuse when it is a plain run of tokens."""
        # Callers release in a `finally` that also runs when the request is cancelled (a client that
        # disconnected mid-stream): shielded, so cancelling it does not leak the session's KV cache.
        freed = [session]
        if self.prefix is not None and session.tokens is not None and session.generation == self.generation:
            tokens = session.tokens[:session.length]
            exact = getattr(self.pipeline, "session_bytes", None)  # in-process stages know; workers: estimate
            nbytes = exact(session.id) if exact else self.cfg.kv_bytes_per_token(dtype=self.ends.dtype) * len(tokens)
            freed = self.prefix.add(session, tokens, nbytes, self.generation)
        for s in freed:
            await self.thread.run_shielded(self.pipeline.release, s.id)

    async def prefill(self, session: Session, prompt: list[int], then: Callable[..., Any] | None = None,
                      features: bool = False):
        """The prompt's tokens not cached yet (see open), with the last position's logits (or then(logits))."""
        return await self.forward(session, torch.tensor([prompt[session.length:]]), last_only=True, then=then,
                                  features=features)

    def _forward(self, session: Session, ids: torch.Tensor, positions, start: int, mask, last_only: bool, then,
                 features: bool = False):
        # ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), float32; or then(logits[, hidden])
        if session.generation != self.generation:
            self._rebuild(session, start)
        plain = positions is None and mask is None and session.rows == 1
        if session.tokens is not None:
            if plain:
                session.tokens[start:] = ids[0].tolist()
            else:  # a tree or a batch of rows: its cache is not a plain run of tokens
                session.tokens = None
        if positions is None:
            positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        # Segments pipeline a prompt's prefill. A verification pass of a few tokens goes in one piece: cut like a
        # prompt (the plan's cuts scale down with its length) it would cost a round trip per token.
        cuts = self.cuts(ids.shape[1]) if self.cuts and plain and last_only and ids.shape[1] > 1 else None
        with torch.inference_mode():
            hidden = self.ends.embed_tokens(ids)
            try:
                if cuts and len(cuts) > 1:
                    hidden = self._segments(session, hidden, positions, start, cuts)
                else:
                    hidden = self.pipeline.forward(session.id, hidden, positions, start, mask)
            except BaseException:
                session.tokens = None  # its caches may be half written: never replay or reuse them
                raise
            logits = self.ends.logits(hidden[:, -1:] if last_only else hidden)
            if then is None:
                return logits
            return then(logits, hidden) if features else then(logits)

    def _segments(self, session: Session, hidden: torch.Tensor, positions, start: int, cuts: list[int]):
        # hidden [1, T, H] in segments ending at cuts: pipelined over workers, else one after another (each
        # segment attends to the KV the earlier ones cached, so the result equals one pass)
        if hasattr(self.pipeline, "forward_segments"):
            return self.pipeline.forward_segments(session.id, hidden, start, cuts)
        outs = [self.pipeline.forward(session.id, hidden[:, a:b], positions[:, a:b], start + a)
                for a, b in itertools.pairwise([0, *cuts])]
        return torch.cat(outs, dim=1)

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
        out = await self._run(self._forward, session, ids, positions, start, mask, last_only, then, features)
        session.length = start + ids.shape[1]
        return out

    def _truncate(self, session: Session, length: int) -> None:
        if session.generation == self.generation:  # else the next forward rebuilds the cache, shorter
            self.pipeline.truncate(session.id, length)

    async def truncate(self, session: Session, length: int) -> None:
        await self._run(self._truncate, session, length)
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

    def wire(self, session: Session) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the session's calls have put on the network so far."""
        return self.pipeline.wire(session.id)

    def kv_bytes(self) -> int:
        return self.pipeline.kv_bytes()

    def close(self) -> None:
        self.thread.shutdown()
        if hasattr(self.pipeline, "close"):
            self.pipeline.close()
