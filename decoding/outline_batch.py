"""Batched expansion: n sequences that share a prompt prefix decode together, one forward pass per step.

The prefix is prefilled once; the rows fork from it on every stage and share its KV read-only. Each row's own
suffix (its point's instruction) may be shorter than the longest: it is left-padded, and the pad slots are
hidden from that row by its attention mask, so every row computes exactly what it would alone (its tokens at
their own positions, seeing the prefix, its suffix and its own output).

Every step is a tree pass (decoding/medusa_tree.py): each live row feeds its last token and, with a proposer
(decoding/outline_verify.py), candidate continuations after it; all rows' nodes go in one forward pass, and
each row keeps the path its own sampler walks (`descend`, exact). Without a proposer the tree is the root alone
and a step is one token per row. Every pass writes its nodes at the same slots for all rows; a row's rejected
nodes stay in the cache but are masked out of its view for good, so no compaction call is needed (a few wasted
slots cost far less than a round trip per worker). A row retires on end-of-sequence or its token budget and
leaves the batch (`keep_rows` on every stage), so it stops costing compute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from edgespec.decoding.medusa_tree import Tree
from edgespec.decoding.medusa_verify import descend
from edgespec.decoding.outline_verify import RootOnly
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.stats import StepStats
from edgespec.decoding.types import TokenLogprob
from edgespec.model.runner import ModelRunner

PAD = 0  # any id: pad slots are never seen by a real token


class Rows:
    """Bookkeeping of the rows (built and used on the model thread): the slots each row sees, its next position,
    and which rows are live. Slots: [0, prefix) shared, the suffix block of width L, then one tree pass after
    another."""

    def __init__(self, prefix: int, lengths: list[int], capacity: int):
        self.prefix, self.width = prefix, max(lengths)
        self.pads = [self.width - n for n in lengths]  # [n] leading pad slots of each row's suffix
        self.ids = list(range(len(lengths)))  # the original index of each live row
        self.seen = torch.zeros(len(lengths), capacity, dtype=torch.bool)  # [n, S] slots each row attends to
        self.seen[:, :prefix] = True
        for row, pad in enumerate(self.pads):
            self.seen[row, prefix + pad:prefix + self.width] = True
        self.next = [prefix + n for n in lengths]  # each row's next position
        self.end = prefix + self.width  # slots written so far

    def first_pass(self, suffixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [n, L], positions [n, L] and mask [n, L, prefix + L] of the padded suffixes."""
        n, width, p = len(suffixes), self.width, self.prefix
        ids = torch.tensor([[PAD] * pad + s for pad, s in zip(self.pads, suffixes, strict=True)])
        j = torch.arange(width)
        pads = torch.tensor(self.pads).unsqueeze(1)  # [n, 1]
        positions = p + (j.unsqueeze(0) - pads).clamp(min=0)  # [n, L]: real tokens at p, p+1, ...
        causal = j.unsqueeze(0) <= j.unsqueeze(1)  # [L, L] query a sees block slot b <= a
        block = causal.unsqueeze(0) & self.seen[:, p:p + width].unsqueeze(1)  # [n, L, L]
        block |= torch.eye(width, dtype=torch.bool).unsqueeze(0)  # a pad query sees itself (no empty rows)
        mask = torch.cat([torch.ones(n, width, p, dtype=torch.bool), block], dim=2)
        return ids, positions, mask

    def tree_pass(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] and mask [B, T, end + T] of a pass of `tree` for every live row, at slot `end`."""
        depths = torch.tensor(tree.depths)  # [T]
        positions = torch.tensor([self.next[r] for r in self.ids]).unsqueeze(1) + depths  # [B, T]
        b, t = len(self.ids), len(tree)
        seen = self.seen[self.ids, :self.end].unsqueeze(1).expand(b, t, self.end)  # [B, T, end]
        return positions, torch.cat([seen, tree.mask(0).expand(b, t, t)], dim=2)

    def keep(self, b: int, path: list[int]) -> None:
        """Batch row b keeps the nodes `path` of the pass just written at slot `end` (before `end` moves past it)."""
        row = self.ids[b]
        self.seen[row, [self.end + n for n in path]] = True
        self.next[row] += len(path)


async def expand(model: ModelRunner, prefix: list[int], suffixes: list[list[int]], budgets: list[int],
                 samplers: list[Sampler], stop_ids: frozenset[int], proposer=None, stats: StepStats | None = None
                 ) -> AsyncIterator[list[tuple[int, list[int], list[TokenLogprob]]]]:
    """Decode len(suffixes) rows after the shared `prefix` together, row i drawing through samplers[i].
    Yields, per step, (row, tokens, logprobs) for every row still live: one token, or more where a proposer's
    candidates were accepted; logprobs where the row's sampler asks for them. A row ends after a token in
    stop_ids or after budgets[row] tokens (its last step is cut there). `stats` (optional) counts the
    candidates proposed and accepted."""
    proposer = proposer or RootOnly()
    capacity = len(prefix) + max(map(len, suffixes)) + max(budgets) * proposer.max_nodes
    parent = await model.open(len(prefix) + 1, prompt=prefix)
    batch = None
    made = [0] * len(suffixes)
    history = [prefix + s for s in suffixes]  # each row's tokens so far (the n-gram proposer reads them)
    try:
        if parent.length < len(prefix):
            await model.prefill(parent, prefix, then=lambda logits: None)
        rows = await model.call(Rows, len(prefix), [len(s) for s in suffixes], capacity)
        batch = await model.fork(parent, len(prefix), len(suffixes), capacity)

        def judge(logits, hidden, tree, nodes, written=True):
            # logits [B, T, V] and hidden [B, T, H] of a pass of `tree` holding nodes[b] for live row b (model
            # thread): each row's tokens, the rows that go on, and the next pass's tree and nodes. `written`:
            # the pass wrote the tree at slot rows.end (the first pass wrote the suffixes, all seen already).
            out, keep, roots = [], [], []
            for b, row in enumerate(rows.ids):
                verdict = descend(samplers[row], tree, nodes[b], logits[b])
                if written:
                    rows.keep(b, verdict.path)
                    if stats is not None:
                        stats.proposed += tree.depth
                        stats.accepted += verdict.accepted
                tokens, ended = [], False
                for token in verdict.tokens:  # cut at a stop token or the budget
                    tokens.append(token)
                    made[row] += 1
                    ended = token in stop_ids or made[row] >= budgets[row]
                    if ended:
                        break
                history[row] += tokens
                lps = [samplers[row].logprob(logits[b, n], t) for n, t in zip(verdict.path, tokens, strict=False)
                       ] if samplers[row].params.logprobs else []
                if not ended:  # the row goes on from its last token
                    keep.append(b)
                    roots.append((row, tokens[-1], hidden[b, verdict.path[-1]], history[row]))
                out.append((row, tokens, lps))
            if written:
                rows.end += len(tree)
            rows.ids = [rows.ids[b] for b in keep]
            return out, keep, proposer.propose(roots) if keep else None

        ids, positions, mask = await model.call(rows.first_pass, suffixes)
        out, keep, nxt = await model.forward(
            batch, ids, len(prefix), positions, mask, last_only=True, features=True,
            then=lambda logits, hidden: judge(logits, hidden[:, -1:], Tree([]), [[PAD]] * len(suffixes), False))
        while True:
            yield out
            if nxt is None:
                return
            if len(keep) < batch.rows:  # retire the finished rows on every stage
                await model.keep_rows(batch, keep)
            tree, nodes = nxt
            positions, mask = await model.call(rows.tree_pass, tree)
            out, keep, nxt = await model.forward(
                batch, torch.tensor(nodes), rows.end, positions, mask, features=True,
                then=lambda logits, hidden, tree=tree, nodes=nodes: judge(logits, hidden, tree, nodes))
    finally:
        if batch is not None:
            await model.release(batch)
        await model.release(parent)
