"""The HeadSplit blocks one device holds: KV groups of some layers (their q, k and v rows, their output
projection columns, the layer's input norm, and each session's cache of those groups) and FFN blocks (the
post-attention norm and the FFN), each loaded alone from the checkpoint. Groups can move to another device
with their caches (`export`, then `reshape` on both devices).

The layer's norms of the attention's and the FFN's outputs (Gemma 3) are RMSNorms over the whole hidden vector,
so no group device can apply the attention's to its share: the device that sums the groups' partials holds it
(`attn_out_norms`, HeadSplitPipeline), and the FFN device the FFN's (FeedForward). A sliding layer's groups
attend within its window, with its own rotary base, and a NoPE layer's groups unrotated, as DecoderLayer's do.

Every KV group is a block of its own, and a device answers a layer with each group's partial output apart:
the projection device adds them in group order (HeadSplitPipeline), so a token's bits do not depend on which
groups share a device. Summed per device, they did: found when a re-placement after a lost worker (issue 20)
moved layer 0's groups from two devices to one and a greedy stream at epsilon 0 changed its 25th token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from edgespec.model.blocks import AttentionBlock, RMSNorm, Rotary, SeqRows, causal_mask, norm, window_mask
from edgespec.model.config import ModelConfig
from edgespec.model.ffn import FFN, Experts
from edgespec.model.kv_cache import KVCache, KVCacheError
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.kv_pool import BLOCK_SLOTS, CapacityError, block_bytes
from edgespec.model.linear import WeightFormat, as_format, linear_bytes
from edgespec.model.module_list import ModuleList
from edgespec.model.stage import SessionError, StepError
from edgespec.model.weights import TensorSource, load_attention, load_ffn

GroupKV = dict[str, dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]  # session -> layer -> group -> (k, v)


def load_norm(src: TensorSource, cfg: ModelConfig, layer: int, place: str, dtype: torch.dtype) -> RMSNorm:
    """Layer `layer`'s norm at `place` (a key of Architecture.norms), as DecoderLayer holds it."""
    out = norm(cfg, cfg.hidden_size, dtype)
    out.weight.copy_(src.get(f"model.layers.{layer}.{cfg.arch.norms[place]}.weight", out.weight.dtype))
    return out


def attn_out_norms(src: TensorSource, cfg: ModelConfig, dtype: WeightFormat | torch.dtype) -> dict[int, RMSNorm]:
    """Every layer's norm of the attention's output by layer, where the architecture has one (Gemma 3), else
    none: what the device that sums a layer's group partials applies to the sum before the residual add."""
    if "attn_out" not in cfg.arch.norms:
        return {}
    act = as_format(dtype).act
    return {layer: load_norm(src, cfg, layer, "attn_out", act) for layer in range(cfg.n_layers)}


@dataclass(frozen=True)
class StepRows:
    """One session's rows in a device call of a step that may carry several sessions: `length` rows written at
    its cache slots start..start+length, seeing the slots of mask bool [1, length, start+length] (None: causal),
    in the session's pass number `step` (HeadBlocks.attend_rows fences a session's cache by it)."""

    session: str
    start: int
    length: int
    mask: torch.Tensor | None
    step: int


class Deferred:
    """An in-process device call, computed when its result is first taken (after the remote calls started beside
    it were sent); the interface of a pending device call: `result()`."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self._fn = fn
        self._done: tuple[torch.Tensor] | None = None

    def result(self) -> torch.Tensor:
        if self._done is None:
            self._done = (self._fn(),)
        return self._done[0]


class GroupBlocks(nn.Module):
    """One layer's KV groups on a device, each an AttentionBlock of its own (group 0's adds the output bias)."""

    def __init__(self, cfg: ModelConfig, groups: list[int], dtype: torch.dtype):
        super().__init__()
        self.groups = list(groups)
        self.n_kv = len(self.groups)
        self.blocks = ModuleList(AttentionBlock(cfg, [g], dtype, with_o_bias=cfg.o_bias and g == 0)
                                    for g in self.groups)

    def forward(self, x: torch.Tensor, rope, seqs: Sequence[SeqRows]) -> torch.Tensor:
        # x [M, H] (normed), each sequence's rows in turn -> each group's partial output [n_kv, M, H]; a
        # sequence's cache of the layer holds group i as "layer" i
        return torch.stack([block.rows(x, rope, seqs, i) for i, block in enumerate(self.blocks)])


class FeedForward(nn.Module):
    """A layer's FFN as its device holds it: the FFN's input norm, the FFN, and the norm of the FFN's output
    where the architecture has one (Gemma 3); z [B, T, H] -> the layer's output z + out_norm(ffn(in_norm(z))),
    DecoderLayer's second half with the same ops in the same order."""

    def __init__(self, src: TensorSource, cfg: ModelConfig, fmt: WeightFormat, layer: int):
        super().__init__()
        self.in_norm = load_norm(src, cfg, layer, "ffn_in", fmt.act)
        self.ffn = Experts(cfg, fmt.act) if cfg.sparse(layer) else FFN(cfg, fmt.act)  # the whole block on its device
        load_ffn(self.ffn, src, cfg, layer, fmt)
        self.out_norm = load_norm(src, cfg, layer, "ffn_out", fmt.act) if "ffn_out" in cfg.arch.norms else None
        self.residual = cfg.residual_multiplier  # Granite's, as DecoderLayer applies it

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.ffn(self.in_norm(z))
        out = out if self.out_norm is None else self.out_norm(out)
        return z + (out if self.residual == 1.0 else out * self.residual)


class HeadBlocks:
    """The blocks one device holds, groups[l] of layer l's KV groups and the FFN of the layers in `ffns`, with
    each session's caches of those groups. The device interface HeadSplitPipeline drives (a worker's proxy makes
    the same calls over a link: workers/head_client.py)."""

    def __init__(self, src: TensorSource, cfg: ModelConfig, dtype: WeightFormat | torch.dtype,
                 groups: dict[int, list[int]], ffns: list[int], kv: KVFormat = FLOAT32):
        kv.check(cfg.head_dim)
        self.src, self.cfg, self.fmt, self.kv = src, cfg, as_format(dtype), kv
        self.dtype = dtype = self.fmt.act
        self.rotary = Rotary(cfg, dtype)
        self.attn: dict[int, tuple[RMSNorm, GroupBlocks]] = {}
        self.ffn: dict[int, FeedForward] = {}
        self.sessions: dict[str, dict[int, KVCache]] = {}  # session -> layer -> the cache of its groups here
        self.capacity: dict[str, int] = {}  # session -> its slots
        self.steps: dict[str, int] = {}  # session -> the step number of its last attend here
        self.kv_budget_bytes: int | None = None  # the bound of the caches here (limit_kv); None: none
        self.held_bytes = 0  # bytes of the sessions' caches, counted on every change (read by /metrics' thread)
        self.reshape(groups, ffns, {})

    @torch.no_grad()
    def reshape(self, groups: dict[int, list[int]], ffns: list[int], incoming: GroupKV) -> None:
        """Hold exactly these groups and FFNs from now on: layers whose groups change are loaded again, and each
        session's cache of such a layer is rebuilt from what it held of the groups that stay and from `incoming`
        (every session's keys and values [1, 1, length, hd] of the groups that arrive)."""
        groups = {layer: sorted(gs) for layer, gs in groups.items() if gs}
        for layer in sorted(set(self.attn) | set(groups)):
            before = self.attn[layer][1].groups if layer in self.attn else []
            after = groups.get(layer, [])
            if before == after:
                continue
            for session, caches in self.sessions.items():
                kept = {g: self._group_kv(caches[layer], before.index(g)) for g in after if g in before}
                moved = incoming.get(session, {}).get(layer, {})
                missing = [g for g in after if g not in kept and g not in moved]
                if missing:
                    raise ValueError(f"session {session!r}: no keys and values for layer {layer}'s groups {missing}")
                caches.pop(layer, None)
                if after:
                    caches[layer] = self._cache_of(session, [kept.get(g) or moved[g] for g in after])
            self.attn.pop(layer, None)
            if after:
                block = GroupBlocks(self.cfg, after, self.dtype)
                for one in block.blocks:
                    load_attention(one, self.src, self.cfg, layer, self.fmt)
                self.attn[layer] = (load_norm(self.src, self.cfg, layer, "attn_in", self.dtype), block)
        self._count()
        for layer in set(self.ffn) - set(ffns):
            del self.ffn[layer]
        for layer in sorted(set(ffns) - set(self.ffn)):
            self.ffn[layer] = FeedForward(self.src, self.cfg, self.fmt, layer)

    @staticmethod
    def _group_kv(cache: KVCache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the cached keys and values of the cache's index-th group: each [1, 1, length, hd] (copies)
        return cache.read(index, cache.length)

    def _new_cache(self, n_kv: int, capacity: int) -> KVCache:
        # one layer's cache of n_kv groups, each as a "layer" of one KV head, its whole capacity held from the
        # start (a pool of its own)
        return KVCache.alone(n_kv, 1, self.cfg.head_dim, capacity, self.kv)

    def _cache_of(self, session: str, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> KVCache:
        # a cache of len(kv) groups holding their keys and values (each [1, 1, length, hd])
        length = kv[0][0].shape[2]
        cache = self._new_cache(len(kv), self.capacity[session])
        if length:
            cache.ensure(0, length)
            for i, (k, v) in enumerate(kv):
                cache.write(i, 0, k, v)
        cache.length = length
        return cache

    def export(self, groups: dict[int, list[int]]) -> GroupKV:
        """Every session's keys and values of these groups (held here), to move them with the groups."""
        out: GroupKV = {}
        for session, caches in self.sessions.items():
            for layer, gs in groups.items():
                held = self.attn[layer][1].groups
                out.setdefault(session, {})[layer] = {g: self._group_kv(caches[layer], held.index(g)) for g in gs}
        return out

    def limit_kv(self, nbytes: int) -> None:
        """Bound the bytes this device's caches may hold (a session's whole capacity is held from its open):
        an open that would cross it is refused with the layer pipeline's CapacityError."""
        self.kv_budget_bytes = nbytes

    def _hold(self, session: str, capacity: int, caches: dict[int, KVCache]) -> None:
        # a new session's caches, within the budget (CapacityError, naming the numbers, past it)
        if self.kv_budget_bytes is not None:
            used, nbytes = self.kv_bytes(), sum(c.pool.nbytes for c in caches.values())
            if used + nbytes > self.kv_budget_bytes:
                raise CapacityError(f"the KV cache needs {nbytes / 2**20:.1f} MiB more but only "
                                    f"{(self.kv_budget_bytes - used) / 2**20:.1f} of "
                                    f"{self.kv_budget_bytes / 2**20:.1f} MiB are free")
        self.capacity[session] = capacity
        self.sessions[session] = caches
        self.steps[session] = 0
        self._count()

    def open(self, session: str, capacity: int) -> None:
        self._hold(session, capacity, {layer: self._new_cache(block.n_kv, capacity)
                                       for layer, (_, block) in self.attn.items()})

    def _applied(self, session: str, step: int) -> bool:
        # a KV operation's step: True when it is the session's last one (a retry, applied already); StepError for
        # an older one
        last = self.steps[session]
        if step < last:
            raise StepError(f"step {step} of session {session!r} is older than the last one here, {last}")
        return step == last

    def fork(self, session: str, child: str, length: int, capacity: int, step: int) -> None:
        """Open `child` holding a copy of the session's first `length` slots in caches of its own (each cache has
        a pool of its own: no block is shared), as the session's pass number `step`: a retry of it changes
        nothing."""
        parent = self._caches(session)
        if self._applied(session, step) and child in self.sessions:
            return
        if child in self.sessions:
            raise KVCacheError(f"session {child!r} is already open")
        caches = {}
        for layer, cache in parent.items():
            caches[layer] = self._new_cache(self.attn[layer][1].n_kv, capacity)
            caches[layer].copy_from(cache, length)
        self._hold(child, capacity, caches)
        self.steps[session] = step

    def commit(self, session: str, kept: list[int], dest: int, step: int) -> None:
        """Move the slots `kept` (ascending) to dest, dest+1, ... in every cache of the session and end them there
        (KVCache.commit), as its pass number `step`: a retry of it changes nothing."""
        caches = self._caches(session)
        if self._applied(session, step):
            return
        for cache in caches.values():
            cache.commit(kept, dest)
        self.steps[session] = step

    def release(self, session: str) -> None:
        self.sessions.pop(session, None)
        self.capacity.pop(session, None)
        self.steps.pop(session, None)
        self._count()

    def _count(self) -> None:
        self.held_bytes = sum(c.pool.nbytes for caches in self.sessions.values() for c in caches.values())

    def kv_bytes(self) -> int:
        """Bytes of every session's caches here."""
        return self.held_bytes

    @property
    def block_bytes(self) -> int:
        """The unit of pool_blocks: one KV group's keys and values of BLOCK_SLOTS slots in one layer."""
        return block_bytes(1, 1, self.cfg.head_dim, self.kv, BLOCK_SLOTS)

    def pool_blocks(self) -> tuple[int, int]:
        """(used, free) in blocks of one group's BLOCK_SLOTS slots in one layer: what the sessions' caches hold
        (a session holds its whole capacity from its open), and what the budget leaves (0 without one)."""
        used = self.kv_bytes()
        free = max(0, self.kv_budget_bytes - used) if self.kv_budget_bytes is not None else 0
        return used // self.block_bytes, free // self.block_bytes

    def memory_bytes(self) -> int:
        """Bytes of the blocks' weights and the caches."""
        modules = [m for pair in self.attn.values() for m in pair] + list(self.ffn.values())
        return sum(linear_bytes(m) for m in modules) + self.kv_bytes()

    def _caches(self, session: str) -> dict[int, KVCache]:
        if session not in self.sessions:
            raise SessionError(f"no session {session!r} here")
        return self.sessions[session]

    def attend(self, session: str, layer: int, x: torch.Tensor, positions: torch.Tensor, start: int,
               mask: torch.Tensor | None, step: int) -> torch.Tensor:
        """One session's attend_rows: x [1, T, H] at positions [1, T], mask [1, T, start+T] or None -> the
        partial output of each of the layer's groups here [n_groups, T, H]."""
        return self.attend_rows(layer, x[0], positions[0], [StepRows(session, start, x.shape[1], mask, step)])

    @torch.inference_mode()
    def attend_rows(self, layer: int, x: torch.Tensor, positions: torch.Tensor, rows: Sequence[StepRows]
                    ) -> torch.Tensor:
        """x [M, H] (the layer's input) holds each session's rows in turn, at positions [M], their keys and values
        cached in each session's caches at its slots -> the partial attention output of each of the layer's
        groups here, in group order [n_groups, M, H]. The projections run once over all M rows and attention
        per session over its own cache (AttentionBlock.rows): every row gets the bits it gets alone. A sliding
        layer's groups see only its window (narrowing each session's mask) and rotate by its own base, as
        DecoderLayer's attention does.

        A session's `step` numbers its forward passes (HeadSplitPipeline): a call of a step older than the last
        one seen here is refused with StepError before anything is written (a late or retried call from before a
        rollback would overwrite slots written since). Calls of the same step (every layer's, a speculation's
        recompute, a retry) are applied: each rewrites its slots from the same input, so a repeat changes no
        bits."""
        if layer not in self.attn:
            raise ValueError(f"layer {layer} has no KV groups here")
        if sum(r.length for r in rows) != x.shape[0] or len({r.session for r in rows}) != len(rows):
            raise ValueError(f"the sessions' rows are not x's {x.shape[0]}, each session once")
        caches = [self._caches(r.session)[layer] for r in rows]
        for r, cache in zip(rows, caches, strict=True):
            if r.step < self.steps[r.session]:
                raise StepError(f"step {r.step} of session {r.session!r} is older than the last one here, "
                                f"{self.steps[r.session]}")
            cache.check_write(r.start, r.length)
        window = self.cfg.window(layer)
        # DecoderLayer's sliding layer: its rotary base, its window of the mask; its NoPE layer: no rotation
        rope = self.rotary(positions[None]).for_layer(window is not None, self.cfg.rotates(layer))
        seqs, a = [], 0
        for r, cache in zip(rows, caches, strict=True):
            self.steps[r.session] = r.step
            cache.ensure(r.start, r.start + r.length)
            mask = r.mask
            if window is not None:
                mask = window_mask(mask, rope.rows(a, a + r.length).positions, r.start, r.length, window)
            if mask is None and r.length > 1:
                mask = causal_mask(r.start, r.length)
            seqs.append(SeqRows(cache, r.start, r.length, mask))
            a += r.length
        norm, block = self.attn[layer]
        out = block(norm(x.to(self.dtype)), rope, seqs)
        for r, cache in zip(rows, caches, strict=True):
            cache.length = r.start + r.length
        return out

    def start_attend(self, layer: int, x: torch.Tensor, positions: torch.Tensor, rows: Sequence[StepRows]
                     ) -> Deferred:
        """`attend_rows`, computed when its result is taken (HeadSplitPipeline starts the remote calls first)."""
        return Deferred(lambda: self.attend_rows(layer, x, positions, rows))

    def start_ffn(self, layer: int, z: torch.Tensor) -> Deferred:
        """`feed_forward`, computed when its result is taken."""
        return Deferred(lambda: self.feed_forward(layer, z))

    @torch.inference_mode()
    def feed_forward(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Z [B, T, H] -> the layer's output X [B, T, H]."""
        if layer not in self.ffn:
            raise ValueError(f"layer {layer}'s FFN is not here")
        return self.ffn[layer](z.to(self.dtype))
