"""What a program is made of: the values a policy's program yields to the engine and receives back, and the
read-only view of its sequence it decides by.

A policy writes each request as a program: a generator, run on the model thread, that yields the rows it
feeds next (`Rows`: its plan), receives the pass's output (`Out`), yields the KV operation its accept needs
(`Truncate` a rejected draft, `Commit` a tree's accepted path: the engine applies them), a proposer's work it
needs before its next rows (`Propose`), and the events to stream. A `Job` says how the engine starts one: the
prompt its session may find cached, the slots it needs and the program to run on it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from edgespec.engine.session import Session


@dataclass
class Rows:
    """What a sequence feeds next: token ids at cache slots start.. (None: the session's end).

    positions [1, T] default to the slots, mask bool [1, T, start+T] to causal; last_only: the logits of the
    last row only; features: the last layer's hidden states [1, T, H] too (a feature drafter reads them)."""

    ids: list[int]
    start: int | None = None
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    last_only: bool = False
    features: bool = False

    @property
    def plain(self) -> bool:
        """A run of tokens at consecutive slots and positions (with last_only, one that may go in chunks)."""
        return self.positions is None and self.mask is None


@dataclass
class Out:
    """A pass's output for one sequence: logits float32 [1, T or 1, V]; hidden [1, T, H] with features; the
    pass's time, how many sequences and token rows it carried, of those the rows whose logits it computed (a
    prompt's chunk wants its last row's only), and its number (the engine's count of passes: the same in every
    sequence's Out of one pass, so that what they share is counted once)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    seconds: float
    sequences: int
    rows: int
    head_rows: int
    number: int


class Proposer(Protocol):
    """Work a program needs between two steps, batched over the sequences that ask it (Medusa's heads)."""

    def propose_batch(self, requests: list) -> list:
        """Each request's answer, as the request alone would get it."""


@dataclass(frozen=True)
class Propose:
    """A program's request for a proposer's work before its next rows: `proposer.propose_batch(requests)`
    answers the requests of every sequence that asks it between the same two steps, in one call (one read of
    its weights for all of them); the program receives its answer as the value of its `yield`."""

    proposer: Proposer
    request: object


@dataclass(frozen=True)
class Truncate:
    """End the sequence's cache at slot `length` (a rejected draft's slots are written over next)."""

    length: int


@dataclass(frozen=True)
class Commit:
    """Keep the cached slots `kept` (ascending) as slots dest, dest+1, ... and end the cache there (a tree's
    accepted path); `tokens`: the ids now in slots 0.. (a plain run again)."""

    kept: list[int]
    dest: int
    tokens: list[int]


@dataclass(frozen=True)
class Speculate:
    """The sequence's tolerance where its executor speculates between layers (HeadSplit: a layer's early start
    on the previous layer's Z is kept when ||Z - X|| / ||X|| < epsilon; 0 never keeps; None: its rows do not
    speculate, as a prompt's); ignored elsewhere."""

    epsilon: float | None


Program = Generator[Any, Any, None]


class SequenceView:
    """What a program may read of its sequence: the engine's session, read-only."""

    def __init__(self, session: Session, wire: Callable[[], dict[str, tuple[int, int]]],
                 others: Callable[[], int], figures: Callable[[], dict]):
        self._session, self._wire, self._others, self._figures = session, wire, others, figures

    @property
    def id(self) -> str:
        return self._session.id

    @property
    def length(self) -> int:
        """Slots cached now (the next plain rows go there)."""
        return self._session.length

    @property
    def capacity(self) -> int:
        return self._session.capacity

    @property
    def cached(self) -> int:
        """Prompt tokens found cached when the session opened (prefix reuse)."""
        return self._session.cached

    @property
    def passes(self) -> int:
        return self._session.passes

    @property
    def shared_with(self) -> int:
        """Other sequences' rows in this one's passes, summed over them."""
        return self._session.shared_with

    def wire(self) -> dict[str, tuple[int, int]]:
        """Bytes and requests per link that the sequence's passes have put on the network so far."""
        return self._wire()

    def others_running(self) -> int:
        """How many other sequences run in the engine now (whose steps this one's share)."""
        return self._others()

    def figures(self) -> dict:
        """What the executor's stages count of this sequence, for its statistics (HeadSplit's speculations)."""
        return self._figures()


@dataclass(frozen=True)
class Job:
    """A sequence to run: `start(view)` builds its program on the model thread once its session is open with
    room for `capacity` slots; `prompt`, the ids its first rows will write from slot 0, lets the session start
    from cached blocks that hold a prefix of them (None: compute every row, as embeddings need); `lane`, the
    engine's lane it runs on (engine/engine.py: the layer pipeline, or HeadSplit's blocks)."""

    capacity: int
    start: Callable[[SequenceView], Program]
    prompt: list[int] | None = None
    lane: str = "layers"
