"""Candidates for outline's batched point expansion (decoding/outline_batch.py): after each step, a proposer
gives the next pass's tree and, for every live row, the tokens its nodes hold, the row's last token at the root.
The pass verifies every row's candidates at once and each row keeps the path its own sampler walks, so any
proposer is exact; a better one only makes more tokens per pass.

On a CPU a pass costs about linearly in the tokens it holds (issue 7's measurements: 1 token 26.6 ms, 5 tokens
33.7, 16 tokens 56.7), so candidates pay only while the batch is small: a pass holds at most `pass_tokens`
tokens, and the rows share them. With many points live, a step is one token per row; as points finish, the
remaining rows get candidates.
"""

from __future__ import annotations

import torch

from edgespec.decoding.drafters import NgramDrafter
from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.medusa_tree import Tree

# (row, root, hidden [H], history): a live row, the token it chose last (not cached yet), the last layer's output
# where that token was chosen, and the row's tokens so far (prompt, instruction and output, the root last)
Root = tuple[int, int, torch.Tensor, list[int]]


class RootOnly:
    """No candidates: every step is one token per row."""

    name = "none"
    max_nodes = 1

    def propose(self, roots: list[Root]) -> tuple[Tree, list[list[int]]]:
        return Tree([]), [[root] for _, root, _, _ in roots]


class MedusaRows:
    """Medusa's heads propose each row's tree from its hidden state. Every row gets the same first m nodes of
    `tree` (by depth, then rank: a tree too), m = pass_tokens // rows, at least the root."""

    name = "medusa"

    def __init__(self, heads: MedusaModel, tree: Tree, pass_tokens: int):
        self.heads, self.pass_tokens = heads, pass_tokens
        self.trees = [Tree(tree.paths[:m]) for m in range(len(tree))]  # trees[m] has m + 1 nodes
        self.max_nodes = len(tree)

    def propose(self, roots: list[Root]) -> tuple[Tree, list[list[int]]]:
        tree = self.trees[max(0, min(self.pass_tokens // len(roots), self.max_nodes) - 1)]
        if not tree.top:
            return tree, [[root] for _, root, _, _ in roots]
        candidates = self.heads.candidates(torch.stack([h for _, _, h, _ in roots]), tree.top)  # [B, K, top]
        return tree, [tree.tokens(root, c) for (_, root, _, _), c in zip(roots, candidates, strict=True)]


class NgramRows:
    """Prompt lookup per row (decoding/drafters.py's NgramDrafter on the row's own tokens): a chain as long as
    the longest proposal, at most k and at most pass_tokens // rows - 1. Shorter proposals are padded with
    their last token; a padded node is verified like any other (kept only if the target draws it)."""

    name = "speculative"

    def __init__(self, rows: int, k: int, pass_tokens: int):
        self.drafters = [NgramDrafter() for _ in range(rows)]
        self.k, self.pass_tokens = k, pass_tokens
        self.chains = [Tree([[0] * d for d in range(1, n + 1)]) for n in range(k + 1)]  # chains[n]: n deep
        self.max_nodes = k + 1

    def propose(self, roots: list[Root]) -> tuple[Tree, list[list[int]]]:
        room = min(self.k, self.pass_tokens // len(roots) - 1)
        drafts = [self.drafters[row].propose(history, room)[0] if room > 0 else []
                  for row, _, _, history in roots]
        depth = max(map(len, drafts))
        nodes = [[root, *d, *[(d or [root])[-1]] * (depth - len(d))] for (_, root, _, _), d in zip(roots, drafts,
                                                                                                     strict=True)]
        return self.chains[depth], nodes
