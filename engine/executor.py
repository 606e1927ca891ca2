"""The executor: the token ends (embedding, final norm, head) around the stage pipeline, and the one way to
change the pipeline (`replace`: a re-plan, a lost worker, HeadSplit's re-placement).

It runs the engine's passes on the model thread: one sequence's rows (`forward_work`) or several sequences'
rows in one pass (`forward_rows`), and applies the KV operations the engine hands it (open, fork, truncate,
commit, release). A session built under an earlier placement is rebuilt from its tokens at its next pass, so
a re-placement costs a stream a prefill, not its answer. `forward` is a pass of a session's own outside the
engine's steps: for tools that time passes and for tests' references.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from edgespec.engine.session import Session
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.stack import TokenEnds
from edgespec.model.stage import BatchEntry, StagePipeline
from edgespec.model.thread import ModelThread

Cuts = Callable[[int], list[int]]


class SessionLostError(RuntimeError):
    """The placement changed under a session whose cache cannot be rebuilt from its tokens."""


@dataclass(frozen=True)
class Work:
    """One sequence's rows in a pass, resolved: ids at slots start.., positions [1, T] or None (the slots),
    mask [1, T, start+T] or None (causal)."""

    session: Session
    ids: list[int]
    start: int
    positions: torch.Tensor | None
    mask: torch.Tensor | None
    last_only: bool
    features: bool


class Executor:
    """Embedding -> stages -> final norm and head, with per-session KV caches on the stages. cuts(n): the
    segment ends of a pipelined prefill of n tokens (None: one piece); kv: the stages' KV format (what a
    session holds on workers, whose pools the controller does not see)."""

    def __init__(self, cfg: ModelConfig, ends: TokenEnds, pipeline: StagePipeline, thread: ModelThread,
                 cuts: Cuts | None = None, kv: KVFormat = FLOAT32):
        self.cfg, self.ends, self.thread, self.kv = cfg, ends, thread, kv
        self.pipeline, self.cuts = pipeline, cuts
        self.generation = 0  # bumped (on the model thread) whenever the stages are re-assigned
        self.rebuilt = 0  # sessions prefilled again after a re-assignment
        self.steps = self.step_rows = 0  # forward passes of any kind, and the token rows they carried
        self._ids = itertools.count()

    def replace(self, pipeline: StagePipeline | None = None, cuts: Cuts | None = None) -> None:
        """The stages were re-assigned (model thread): route through `pipeline` (None: the same one, its
        stages re-assigned) with prefill `cuts`; every session is rebuilt from its tokens at its next pass."""
        if pipeline is not None and pipeline is not self.pipeline:
            self.pipeline = pipeline
        self.cuts = cuts
        self.generation += 1

    async def call(self, fn, *args):
        """Run fn(*args) on the model thread, in turn with the forward passes."""
        return await self.thread.run(fn, *args)

    # sessions (model thread)

    def new_session(self, capacity: int, length: int = 0, tokens: list[int] | None = None) -> Session:
        """A session object of this placement (nothing is opened on the stages)."""
        return Session(f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}", capacity, length, self.generation,
                       list(tokens or []))

    def open(self, session: Session) -> None:
        self.pipeline.open(session.id, session.capacity)

    def fork(self, parent: Session, child: Session, length: int) -> None:
        """Open `child` reading the parent's first `length` slots in place on every stage."""
        self.pipeline.fork(parent.id, child.id, length, child.capacity)
        child.length, child.tokens, child.generation = length, parent.tokens[:length], self.generation

    def release(self, session: Session) -> None:
        self.pipeline.release(session.id)

    @staticmethod
    def truncate(session: Session, length: int) -> None:
        """End the session at slot `length` (a rejected draft). No stage is called: every stage ends a cache
        at the end of each write, and attention reads only up to it, so the next forward (written at
        `length`) truncates it there. Over workers this spares a round trip per worker per verification."""
        session.length = length
        del session.tokens[length:]

    def commit(self, session: Session, kept: list[int], dest: int, tokens: list[int]) -> None:
        """Keep the cached slots `kept` (ascending) as slots dest, dest+1, ... and end the session there; tokens:
        the ids now in slots 0... Slots already in place are not moved: the stale ones after them are never read
        (attention reads only up to the end of each write) and get overwritten, so no stage is called."""
        moved = kept != list(range(dest, dest + len(kept)))
        if moved and session.generation == self.generation:  # else the next forward rebuilds it from the tokens
            self.pipeline.commit(session.id, kept, dest)
        session.length = dest + len(kept)
        session.tokens = list(tokens)

    def speculate(self, session: Session, epsilon: float | None) -> None:
        """The session's tolerance where the stages speculate between layers (HeadSplit)."""
        self.pipeline.speculate(session.id, epsilon)

    def figures(self, session: Session) -> dict:
        """What the stages count of the session, for its statistics."""
        return self.pipeline.figures(session.id)

    def session_bytes(self, session: Session) -> int:
        """The session's KV bytes: the stages' count where they keep one, else estimated from its length."""
        nbytes = self.pipeline.session_bytes(session.id)
        return self.cfg.kv_bytes_per_token(fmt=self.kv) * session.length if nbytes is None else nbytes

    # passes (model thread)

    def _forward(self, session: Session, ids: torch.Tensor, positions, start: int, mask, last_only: bool):
        # ids [1, T] -> (logits [1, T, V] (or [1, 1, V] with last_only) float32, hidden [1, T, H])
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
            return self.ends.logits(hidden[:, -1:] if last_only else hidden), hidden

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

    def forward_work(self, work: Work) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One sequence's rows in a pass of their own: (logits, hidden with features)."""
        logits, hidden = self._forward(work.session, torch.tensor([work.ids]), work.positions, work.start, work.mask,
                                       work.last_only)
        return logits, hidden if work.features else None

    def forward_rows(self, works: list[Work]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several sequences' rows in one pass: each one's (logits [1, T or 1, V], hidden [1, T, H] with
        features). A failure leaves no session marked unreplayable: the engine reruns every work alone at once,
        which rewrites the slots a half-done pass may have written."""
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

    # a session of a tool's own (model thread jobs, awaited)

    async def open_own(self, capacity: int) -> Session:
        """A session outside the engine (no admission, no prefix reuse): for tools that time passes and tests."""
        session = self.new_session(capacity)
        await self.thread.run(self.open, session)
        return session

    async def release_own(self, session: Session) -> None:
        await self.thread.run_shielded(self.release, session)

    async def forward(self, session: Session, ids: torch.Tensor, start: int | None = None,
                      positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                      last_only: bool = False, then: Callable[..., Any] | None = None, features: bool = False) -> Any:
        """A pass of the session's own for tokens ids [1, T] written at cache slots start.. (default: the
        session's end). positions [1, T] default to the slots; mask [1, T, start+T] to causal. Returns float32
        logits [1, T, V], or [1, 1, V] for the last position only; with `then`, then(logits) computed on the
        model thread, or then(logits, hidden [1, T, H]) with `features`."""
        start = session.length if start is None else start

        def run():
            logits, hidden = self._forward(session, ids, positions, start, mask, last_only)
            if then is None:
                return logits
            return then(logits, hidden) if features else then(logits)

        out = await self.thread.run(run)
        session.length = start + ids.shape[1]
        session.passes += 1
        return out

    # figures

    def wire(self, session: Session) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the session's calls have put on the network so far."""
        return self.pipeline.wire(session.id)

    def kv_bytes(self) -> int:
        return self.pipeline.kv_bytes()

    def pool_blocks(self) -> tuple[int, int]:
        """The stages' KV pool blocks in use and free."""
        return self.pipeline.pool_blocks()

    def close(self) -> None:
        self.thread.shutdown()
        self.pipeline.close()
