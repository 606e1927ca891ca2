"""The Stage seam: what a policy's forward pass goes through, in-process or on a worker.

A stage holds decoder layers and one KV cache per session. All calls are synchronous; the controller
runs them on its model thread, one at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from edgespec.model.blocks import SeqRows
from edgespec.model.kv_cache import KVCache, KVCacheError
from edgespec.model.stack import LayerStack


class StageFailure(RuntimeError):
    """A stage failed, timed out or could not be reached (a worker, say); `status` is the HTTP status to report,
    `code` the worker's own error code where a worker refused (workers/errors.py: "not_assigned", say)."""

    def __init__(self, message: str, status: int = 502, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class ClusterFault(StageFailure):
    """A stage failed and the stages could not be re-placed (no placement fits the devices left, or the work
    kept failing): final for the work it hit."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message, status)


class StepError(ValueError):
    """A call whose step number is older than the last one applied to its session (a stale or reordered
    call: applying it could overwrite slots written since)."""


class SessionError(KeyError):
    """An operation names a session the stage does not hold."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class BatchEntry:
    """One session's rows in a pass shared by several sessions: `length` rows written at cache slots
    start..start+length; mask: bool [1, length, start+length] of visible slots, or None (causal)."""

    session: str
    start: int
    length: int
    mask: torch.Tensor | None = None


def segments_in_turn(stage, session: str, hidden: torch.Tensor, start: int, cuts: list[int]) -> torch.Tensor:
    """forward_segments as one forward call per segment, in turn: hidden [1, T, H] at slots start.., cut at
    `cuts` (relative, the last == T). Each segment attends to the KV the earlier ones cached, so the result
    equals one pass."""
    outs = [stage.forward(session, hidden[:, a:b], torch.arange(start + a, start + b)[None], start + a)
            for a, b in itertools.pairwise([0, *cuts])]
    return torch.cat(outs, dim=1)


class WireFigures:
    """The per-session figures of a pipeline whose devices may be workers (workers/client.py's RemotePipeline,
    model/headsplit.py's HeadSplitPipeline): what its steps sent over each link, counted by the pipeline in
    `wire_stats`, and no per-session KV bytes (the caches are spread over the devices: the executor estimates)."""

    wire_stats: dict[str, dict[str, list[int]]]  # session -> link -> [bytes, requests]

    def wire(self, session: str) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the session's steps have sent so far (workers only)."""
        return {link: (b, n) for link, (b, n) in self.wire_stats.get(session, {}).items()}

    def session_bytes(self, session: str) -> None:
        """Not known here: the executor estimates."""
        return None


class Stage(Protocol):
    """Decoder layers plus per-session KV caches: what a Pipeline chains."""

    def open(self, session: str, capacity: int) -> None:
        """Open a KV cache of `capacity` slots for `session`, its blocks reserved (CapacityError if they do not
        fit)."""

    def forward(
        self, session: str, hidden: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [B, T, H] at RoPE positions [B, T], cached at slots start..start+T -> hidden [B, T, H]."""

    def forward_batch(self, entries: Sequence[BatchEntry], hidden: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        """One pass over several sessions' rows (a batch step): hidden [M, H] holds each entry's rows in turn,
        at RoPE positions [M] -> hidden [M, H]; every row as its session alone would get it."""

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        """Move the slots `kept` to dest, dest+1, ... (Medusa tree commit) and end the cache there."""

    def fork(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        """Open `child` sharing `session`'s first prefix_len slots (prefix reuse; outline's points after the
        prompt they share): their blocks are read in place, and either session may be released first."""

    def release(self, session: str) -> None:
        """Free the session's cache (unknown sessions are ignored)."""

    def kv_bytes(self) -> int:
        """Bytes held by KV caches now."""

    def pool_blocks(self) -> tuple[int, int]:
        """The KV pool's blocks in use and free (neither used nor reserved), summed over the stages."""

    def session_bytes(self, session: str) -> int | None:
        """The session's KV bytes (None: not tracked here)."""


class StagePipeline(Stage, Protocol):
    """Every stage of the model, as the executor drives it (engine/executor.py): the in-process Pipeline, the
    workers' RemotePipeline (workers/client.py) and the HeadSplitPipeline (model/headsplit.py)."""

    def forward_segments(self, session: str, hidden: torch.Tensor, start: int, cuts: list[int]) -> torch.Tensor:
        """A prompt's prefill in segments ending at `cuts` (relative; the last == T), pipelined where the stages
        can overlap them: hidden [1, T, H] at slots start.. -> [1, T, H], the same bits as one pass."""

    def wire(self, session: str) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the session's calls have put on the network so far."""

    def speculate(self, session: str, epsilon: float | None) -> None:
        """The session's tolerance where the stages speculate between layers (HeadSplit; None: its rows do not
        speculate); others ignore it."""

    def figures(self, session: str) -> dict:
        """What the stages count of the session, for its statistics (HeadSplit's speculations; {} elsewhere)."""

    def close(self) -> None:
        """Free what reaching the stages holds (connections, threads)."""


class LocalStage:
    """An in-process stage over a LayerStack, its sessions' KV caches in one pool of `kv_budget_bytes`
    (model/kv_pool.py): a session reserves its capacity's blocks at its open, so the pool's size is the
    admission budget and a session that opened never runs out of room mid-stream."""

    def __init__(self, stack: LayerStack, kv_budget_bytes: int, prefault: bool = False):
        self.stack = stack
        self.pool = stack.new_pool(kv_budget_bytes, prefault)
        self.caches: dict[str, KVCache] = {}

    def _cache(self, session: str) -> KVCache:
        try:
            return self.caches[session]
        except KeyError:
            raise SessionError(f"unknown session {session!r}") from None

    def _add(self, session: str, make) -> None:
        if session in self.caches:
            raise KVCacheError(f"session {session!r} is already open")
        self.caches[session] = make()

    def open(self, session: str, capacity: int) -> None:
        self._add(session, lambda: KVCache(self.pool, capacity))

    def forward(self, session, hidden, positions, start, mask=None):
        return self.stack(hidden, positions, self._cache(session), start, mask)

    def forward_batch(self, entries, hidden, positions):
        seqs = [SeqRows(self._cache(e.session), e.start, e.length, e.mask) for e in entries]
        return self.stack.forward_rows(hidden, positions, seqs)

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        self._cache(session).commit(kept, dest)

    def fork(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        parent = self._cache(session)
        self._add(child, lambda: parent.fork(prefix_len, capacity))

    def release(self, session: str) -> None:
        cache = self.caches.pop(session, None)
        if cache is not None:
            cache.free()

    def kv_bytes(self) -> int:
        return self.pool.used * self.pool.block_bytes

    def pool_blocks(self) -> tuple[int, int]:
        return self.pool.used, self.pool.available

    def session_bytes(self, session: str) -> int:
        return self.caches[session].nbytes if session in self.caches else 0


class Pipeline:
    """Stages in layer order, used as one stage: each stage's output is the next one's input."""

    def __init__(self, stages: list[LocalStage]):
        self.stages = stages

    def forward(self, session, hidden, positions, start, mask=None):
        for stage in self.stages:
            hidden = stage.forward(session, hidden, positions, start, mask)
        return hidden

    def forward_batch(self, entries, hidden, positions):
        for stage in self.stages:
            hidden = stage.forward_batch(entries, hidden, positions)
        return hidden

    def open(self, session: str, capacity: int) -> None:
        for stage in self.stages:
            stage.open(session, capacity)

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        for stage in self.stages:
            stage.commit(session, kept, dest)

    def fork(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        for stage in self.stages:
            stage.fork(session, child, prefix_len, capacity)

    def release(self, session: str) -> None:
        for stage in self.stages:
            stage.release(session)

    def forward_segments(self, session: str, hidden: torch.Tensor, start: int, cuts: list[int]) -> torch.Tensor:
        return segments_in_turn(self, session, hidden, start, cuts)  # in-process nothing overlaps them

    def close(self) -> None:
        """Nothing to free in-process."""

    def kv_bytes(self) -> int:
        return sum(s.kv_bytes() for s in self.stages)

    def pool_blocks(self) -> tuple[int, int]:
        used, free = zip(*(s.pool_blocks() for s in self.stages), strict=True)
        return sum(used), sum(free)

    def session_bytes(self, session: str) -> int:
        return sum(s.session_bytes(session) for s in self.stages)

    def wire(self, session: str) -> dict:
        return {}  # in-process: nothing crosses a network

    def speculate(self, session: str, epsilon: float | None) -> None:
        """Nothing speculates in the layer pipeline."""

    def figures(self, session: str) -> dict:
        return {}
