"""Which path of a verified Medusa tree to keep, and the token that follows it.

`descend` is exact for any sampling settings: at each node it draws the target's next token through the
request's Sampler (penalties see the tokens drawn before it), moves to the child that holds that token,
and stops at a node where no child does; the last draw is the step's final token. Every emitted token is
thus a draw from the target given the tokens before it, as naive decoding's; at temperature 0 each draw is
the argmax, so the tokens are naive's greedy tokens.

`typical` is Medusa's typical acceptance, an opt-in that is not exact: a candidate is kept when the target
gives it more than min(threshold, alpha * exp(-entropy)) of its probability at the parent; the longest kept
path wins (ties by likelihood), and the final token is drawn from the target at its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edgespec.decoding.medusa_tree import Tree
from edgespec.decoding.sampling import Sampler


@dataclass
class TreeVerdict:
    tokens: list[int]  # the accepted candidates, then the target's next token
    path: list[int]  # the tree nodes kept: 0 (the root), then the accepted candidates' nodes

    @property
    def accepted(self) -> int:
        return len(self.path) - 1


def descend(sampler: Sampler, tree: Tree, node_tokens: list[int], logits: torch.Tensor) -> TreeVerdict:
    """logits [T, V] float32 of the tree's nodes; node_tokens [T] the ids they hold. Exact (see above)."""
    node, path, out = 0, [0], []
    while True:
        token = sampler.choose(logits[node])
        out.append(token)
        child = next((c for c in tree.children[node] if node_tokens[c] == token), None)
        if child is None:
            return TreeVerdict(out, path)
        node = child
        path.append(node)


def typical(sampler: Sampler, tree: Tree, node_tokens: list[int], logits: torch.Tensor, threshold: float,
            alpha: float) -> TreeVerdict:
    """Typical acceptance (not exact; see above). At temperature 0 it keeps only argmax tokens: greedy."""
    kept = {0: 0.0}  # node -> log-likelihood of its path under the target
    for node in range(len(tree)):
        if node not in kept or not tree.children[node]:
            continue
        p = sampler.probs(logits[node]).double()  # [V]
        entropy = -float((p * torch.log(p + 1e-12)).sum())
        bar = min(threshold, alpha * math.exp(-entropy))
        for child in tree.children[node]:
            pc = float(p[node_tokens[child]])
            if pc > bar:
                kept[child] = kept[node] + math.log(pc)
    best = max(kept, key=lambda n: (tree.depths[n], kept[n]))
    path = [best]
    while path[-1] != 0:
        path.append(tree.parent[path[-1]])
    path.reverse()
    out = [node_tokens[n] for n in path[1:]]
    for token in out:
        sampler.observe(token)
    out.append(sampler.choose(logits[best]))
    return TreeVerdict(out, path)
