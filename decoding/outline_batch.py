"""Batched expansion: n sequences that share a prompt prefix decode together, one forward pass per step.

The prefix is prefilled once; the rows fork from it on every stage and share its KV read-only. Each row's own
suffix (its point's instruction) may be shorter than the longest: it is left-padded, and the pad slots are
hidden from that row by its attention mask for the rest of the batch, so every row computes exactly what it
would alone (its tokens at their own positions, seeing the prefix, its suffix and its own output). A row
retires on end-of-sequence or its token budget and leaves the batch (`keep_rows` on every stage), so it stops
costing compute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import torch

from model.runner import ModelRunner

PAD = 0  # any id: pad slots are never seen by a real token


class Rows:
    """Bookkeeping of the live rows (model thread for the tensors): each row's pad count, its next position,
    and the mask of what it sees. Slots: [0, prefix) shared, then the suffix block of width L, then outputs."""

    def __init__(self, prefix: int, lengths: list[int]):
        self.prefix, self.width = prefix, max(lengths)
        self.pads = [self.width - n for n in lengths]  # [n] leading pad slots of each row's suffix
        self.ids = list(range(len(lengths)))  # the original index of each live row

    def first_pass(self, suffixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [n, L], positions [n, L] and mask [n, L, prefix + L] of the padded suffixes."""
        n, width, p = len(suffixes), self.width, self.prefix
        ids = torch.tensor([[PAD] * pad + s for pad, s in zip(self.pads, suffixes, strict=True)])
        j = torch.arange(width)
        pads = torch.tensor(self.pads).unsqueeze(1)  # [n, 1]
        positions = p + (j.unsqueeze(0) - pads).clamp(min=0)  # [n, L]: real tokens at p, p+1, ...
        real = j.unsqueeze(0) >= pads  # [n, L] which block slots hold real tokens
        causal = j.unsqueeze(0) <= j.unsqueeze(1)  # [L, L] query a sees block slot b <= a
        block = causal.unsqueeze(0) & real.unsqueeze(1)  # [n, L, L]
        block |= torch.eye(width, dtype=torch.bool).unsqueeze(0)  # a pad query sees itself (no empty rows)
        mask = torch.cat([torch.ones(n, width, p, dtype=torch.bool), block], dim=2)
        return ids, positions, mask

    def step(self, done: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, 1] and mask [B, 1, S] of the live rows' next tokens, after `done` generated steps."""
        p, width = self.prefix, self.width
        pads = torch.tensor([self.pads[i] for i in self.ids])  # [B]
        positions = (p + width - pads + done).unsqueeze(1)  # [B, 1]
        slots = torch.arange(p + width + done + 1)
        hidden_pad = (slots >= p).unsqueeze(0) & (slots < p + pads.unsqueeze(1))  # [B, S]
        return positions, (~hidden_pad).unsqueeze(1)


async def expand(model: ModelRunner, prefix: list[int], suffixes: list[list[int]], budgets: list[int],
                 choose: Callable[[int, torch.Tensor], int], stop_ids: frozenset[int]
                 ) -> AsyncIterator[list[tuple[int, int]]]:
    """Decode len(suffixes) rows after the shared `prefix` together. choose(row, logits [V]) picks a row's next
    token (on the model thread: a per-row sampler). Yields, per step, (row, token) for every row still live;
    a row ends after a token in stop_ids or after budgets[row] tokens."""
    capacity = len(prefix) + max(map(len, suffixes)) + max(budgets)
    parent = await model.open(len(prefix) + 1, prompt=prefix)
    batch = None
    try:
        if parent.length < len(prefix):
            await model.prefill(parent, prefix, then=lambda logits: None)
        rows = Rows(len(prefix), [len(s) for s in suffixes])
        batch = await model.fork(parent, len(prefix), len(suffixes), capacity)
        ids, positions, mask = await model.call(rows.first_pass, suffixes)
        made = [0] * len(suffixes)

        def pick(logits):  # [B, T, V] -> the live rows' next tokens
            return [choose(row, logits[b, -1]) for b, row in enumerate(rows.ids)]

        tokens = await model.forward(batch, ids, len(prefix), positions, mask, then=pick)
        done = 0
        while True:
            yield list(zip(rows.ids, tokens, strict=True))
            keep = []
            for b, (row, token) in enumerate(zip(rows.ids, tokens, strict=True)):
                made[row] += 1
                if token not in stop_ids and made[row] < budgets[row]:
                    keep.append(b)
            if not keep:
                return
            if len(keep) < len(rows.ids):  # retire the finished rows on every stage
                await model.keep_rows(batch, keep)
                rows.ids = [rows.ids[b] for b in keep]
                tokens = [tokens[b] for b in keep]
            positions, mask = await model.call(rows.step, done)
            start = len(prefix) + rows.width + done
            tokens = await model.forward(batch, torch.tensor(tokens).unsqueeze(1), start, positions, mask,
                                         then=pick)
            done += 1
    finally:
        if batch is not None:
            await model.release(batch)
        await model.release(parent)
