"""Layer splits that need no profile."""

from __future__ import annotations


def even_split(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Layer ranges [first, last) of n_stages stages, as even as possible (earlier stages take the extra)."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    bounds, first = [], 0
    for i in range(n_stages):
        last = first + base + (i < extra)
        bounds.append((first, last))
        first = last
    return bounds
