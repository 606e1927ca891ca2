"""Medusa's candidate tree: its layout, and the attention mask and positions of a tree pass (train-medusa
chooses the default one: decoding/training/train_medusa.py).

A tree is a list of paths of top-k ranks: [1, 0] is "head 1's second-best token, then head 2's best". Node 0
is the root, the token the target chose last (not cached yet); node i > 0 is paths[i - 1] in the order
below (by depth, then rank), so every node comes after its parent. One forward pass writes all nodes into
consecutive scratch slots; each attends to the cached prefix and to its own ancestors only, at position
start + depth, so every node sees exactly the sequence its path spells out.
"""

from __future__ import annotations

import torch


class Tree:
    """A candidate tree over head ranks. T = 1 + len(paths) nodes, the root first."""

    def __init__(self, paths: list[list[int]]):
        if not isinstance(paths, list) or not all(isinstance(p, list) and p for p in paths) or len(paths) > 256:
            raise ValueError("a tree is a list of at most 256 non-empty paths of top-k ranks, e.g. "
                             "[[0], [1], [0, 0]]")
        if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 64 for p in paths for r in p):
            raise ValueError("tree ranks must be integers from 0 to 63")
        keys = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        if len(keys) != len(paths):
            raise ValueError("the tree lists a path twice")
        index = {(): 0} | {p: i + 1 for i, p in enumerate(keys)}
        missing = [list(p[:-1]) for p in keys if p[:-1] not in index]
        if missing:
            raise ValueError(f"every path's parent must be in the tree too; missing {missing[0]}")
        self.paths = [list(p) for p in keys]
        self.parent = [-1] + [index[p[:-1]] for p in keys]  # [T]
        self.depths = [0] + [len(p) for p in keys]  # [T]
        self.ranks = [-1] + [p[-1] for p in keys]  # [T] rank within its head's top-k
        self.depth = max(self.depths)  # heads used
        self.top = 1 + max(self.ranks)  # how many candidates per head
        self.children: list[list[int]] = [[] for _ in index]
        for node in range(1, len(index)):
            self.children[self.parent[node]].append(node)
        # plain Python so far: requests are validated on the event loop, where no tensor op may run
        self.ancestors = [[0]]  # per node, the nodes it sees: its ancestors and itself
        for node in range(1, len(index)):
            self.ancestors.append([*self.ancestors[self.parent[node]], node])
        self._block: torch.Tensor | None = None  # [T, T] the tree part of the mask, built at first use

    def __len__(self) -> int:
        return len(self.depths)

    def tokens(self, root: int, candidates: torch.Tensor | None) -> list[int]:
        """Node ids: the root, then for each path its last head's candidate at its rank. candidates [K, top]
        (None for a tree of the root alone)."""
        table = candidates.tolist() if candidates is not None else []
        return [root] + [table[d - 1][r] for d, r in zip(self.depths[1:], self.ranks[1:], strict=True)]

    def mask(self, start: int) -> torch.Tensor:
        """Attention mask of a tree pass written at slots start..start+T-1: bool [1, T, start + T]."""
        t = len(self)
        if self._block is None:
            block = torch.zeros(t, t, dtype=torch.bool)
            for node, seen in enumerate(self.ancestors):
                block[node, seen] = True
            self._block = block
        return torch.cat([torch.ones(t, start, dtype=torch.bool), self._block], dim=1).unsqueeze(0)

    def positions(self, start: int) -> torch.Tensor:
        """RoPE positions of the nodes: [1, T], start + depth."""
        return (start + torch.tensor(self.depths)).unsqueeze(0)
