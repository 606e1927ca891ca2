"""A sequence's session: its KV caches on every stage, and what is known of their slots."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Session:
    """A sequence with KV caches on every stage (the pipeline knows it by `id`)."""

    id: str
    capacity: int
    length: int = 0  # cached slots
    generation: int = 0  # the executor's placement generation its caches were built under
    # the ids in slots 0..len(tokens), a plain run that can be replayed (a rebuild after a re-plan) or reused as a
    # prefix; shorter than `length` after a tree pass or a failed write, until a commit says what the slots hold
    tokens: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens found cached when it opened (prefix reuse)
    passes: int = 0  # forward passes run for it
    shared_with: int = 0  # other sessions' calls in those passes, summed
    wire: dict[str, tuple[int, int]] | None = None  # what its calls put on each link, as at its release
