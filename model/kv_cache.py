"""One sequence's KV cache: a block table over a KV pool (model/kv_pool.py).

Slot s of the sequence lives in block table[s // B] at offset s % B. Writing at a slot overwrites it, so
rolling back a rejected draft is a length change (`truncate`), and a Medusa tree written into scratch slots is
compacted into place with `commit`. A cache forked from another shares the parent's blocks of its first
prefix_len slots, read in place (a block that both may still write is copied on the first write into it).
"""

from __future__ import annotations

import torch

from edgespec.model.kv_format import KVFormat
from edgespec.model.kv_pool import BLOCK_SLOTS, KVPool


class KVCacheError(ValueError):
    """An operation that does not fit the cache (capacity, slots)."""


class KVCache:
    """`capacity` slots of one sequence over `pool`. At creation it reserves the blocks its capacity may
    still need (CapacityError when the pool cannot promise them), so writes within the capacity never fail;
    `free()` gives its blocks and what is left of its reservation back."""

    def __init__(self, pool: KVPool, capacity: int, shared: tuple[KVCache, int] | None = None):
        parent, length = shared if shared else (None, 0)
        if capacity < length:
            raise KVCacheError(f"capacity {capacity} is below the shared prefix length {length}")
        self.pool, self.capacity, self.length = pool, capacity, length
        # blocks it may take: those of its slots beyond the shared full blocks (a shared partial block is copied)
        self.reserve = pool.blocks_for(capacity) - length // pool.block
        pool.reserve(self.reserve)
        self.table: list[int] = parent.table[:pool.blocks_for(length)] if parent else []
        for block in self.table:
            pool.share(block)
        self._table: torch.Tensor | None = None  # the table as a tensor, rebuilt after it changes

    @classmethod
    def alone(cls, n_layers: int, n_kv: int, head_dim: int, capacity: int, fmt: KVFormat) -> KVCache:
        """A cache over a pool of its own, every block of its capacity in its table from the start (a drafter's,
        a HeadSplit device's group cache, a tool's: what layers called one by one write into)."""
        cache = cls(KVPool(n_layers, n_kv, head_dim, fmt, -(-capacity // BLOCK_SLOTS)), capacity)
        cache.ensure(0, capacity)
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks it holds (a shared block counts in every cache that holds it)."""
        return len(self.table) * self.pool.block_bytes

    def table_tensor(self) -> torch.Tensor:
        """The block table, int64 [nb] (what the compiled kernels read)."""
        if self._table is None:
            self._table = torch.tensor(self.table, dtype=torch.long)
        return self._table

    def check_write(self, start: int, n: int) -> None:
        """Validate a write of `n` slots from `start` before any layer touches the cache."""
        if not 0 <= start <= self.length:
            raise KVCacheError(f"write at slot {start} but the cache holds {self.length} slots (no gaps allowed)")
        if start + n > self.capacity:
            raise KVCacheError(f"{start + n} slots needed, the session's cache holds {self.capacity}")

    def _take(self) -> int:
        reserved = self.reserve > 0
        self.reserve -= reserved
        return self.pool.take(reserved)

    def ensure(self, start: int, end: int) -> None:
        """Give slots [start, end) blocks of this cache's own: new ones past the table, a copy of a shared one."""
        pool = self.pool
        first, last = start // pool.block, pool.blocks_for(end)
        for i in range(first, last):
            if i == len(self.table):
                self.table.append(self._take())
            elif pool.refs[self.table[i]] > 1:
                old, new = self.table[i], self._take()
                pool.kv[:, :, new] = pool.kv[:, :, old]
                pool.drop(old)
                self.table[i] = new
            else:
                continue
            self._table = None

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a compiled attention call writes and reads for `layer` (model/kernels/layer.cpp): the pool's
        k, v [N, n_kv, B, row] in its format's storage and the block table [nb]."""
        return self.pool.k[layer], self.pool.v[layer], self.table_tensor()

    def every_layer(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """storage() for every layer at once (a compiled stack's one call): the pool's k, v per layer and the
        block table."""
        return self.pool.k, self.pool.v, self.table_tensor()

    def _where(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # slots [n] -> their blocks and offsets, each [n]
        return self.table_tensor()[slots // self.pool.block], slots % self.pool.block

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [1, n_kv, T, hd] at slots start..start+T of `layer` (ensure them first), converted to the
        pool's format. Returns keys and values for slots [0, start+T) as read(), each [1, n_kv, start+T, hd]."""
        blocks, offsets = self._where(torch.arange(start, start + k.shape[2]))
        encode = self.pool.fmt.encode
        self.pool.k[layer][blocks, :, offsets] = encode(k[0].transpose(0, 1))  # [T, n_kv, row]
        self.pool.v[layer][blocks, :, offsets] = encode(v[0].transpose(0, 1))
        return self.read(layer, start + k.shape[2])

    def read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, n) of `layer` as float32 (the format's decoded values, what the compiled
        kernels compute with): [1, n_kv, n, hd] each (copies)."""
        table = self.table_tensor()[:self.pool.blocks_for(n)]

        def gather(store: torch.Tensor) -> torch.Tensor:
            blocks = store[table]  # [nb, n_kv, B, row]
            rows = blocks.transpose(0, 1).reshape(blocks.shape[1], -1, blocks.shape[3])[None, :, :n]
            return self.pool.fmt.decode(rows)

        return gather(self.pool.k[layer]), gather(self.pool.v[layer])

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (a rejected draft); the blocks stay for the next writes."""
        if not 0 <= length <= self.length:
            raise KVCacheError(f"cannot truncate to {length}: the cache holds {self.length}")
        self.length = length

    def commit(self, kept: list[int], dest: int) -> None:
        """Copy the slots `kept` (ascending, all >= dest) to dest, dest+1, ... and end the cache there.

        Used for a Medusa tree: the accepted path's entries move from scratch slots into place.
        """
        if any(s >= self.length or s < dest for s in kept) or kept != sorted(kept):
            raise KVCacheError(f"kept slots {kept} must be ascending, >= {dest} and below {self.length}")
        self.ensure(dest, dest + len(kept))
        placed = next((i for i, s in enumerate(kept) if s != dest + i), len(kept))  # those already in place
        if placed < len(kept):
            src_b, src_o = self._where(torch.tensor(kept[placed:], dtype=torch.long))
            dst_b, dst_o = self._where(torch.arange(dest + placed, dest + len(kept)))
            kv = self.pool.kv  # [2, layers, blocks, n_kv, block, row]: every layer's keys and values at once
            kv[:, :, dst_b, :, dst_o] = kv[:, :, src_b, :, src_o]  # the source is gathered first: overlaps are safe
        self.length = dest + len(kept)

    def copy_from(self, other: KVCache, n: int) -> None:
        """Hold `other`'s first n slots of every layer as this cache's slots 0..n, their stored bits as they are
        (a cache over a pool of its own cannot share blocks: a HeadSplit device's fork). The pools' layouts must
        match; this cache ends at slot n."""
        if n > other.length:
            raise KVCacheError(f"prefix of {n} slots but the cache holds {other.length}")
        self.check_write(0, n)
        if n:
            self.ensure(0, n)
            nb = self.pool.blocks_for(n)  # whole blocks: the slots past n in the last one are never read
            src, dst = other.table_tensor()[:nb], self.table_tensor()[:nb]
            self.pool.kv[:, :, dst] = other.pool.kv[:, :, src]
        self.length = n

    def fork(self, prefix_len: int, capacity: int) -> KVCache:
        """A cache over the same pool that shares this one's first prefix_len slots."""
        if prefix_len > self.length:
            raise KVCacheError(f"prefix of {prefix_len} slots but the cache holds {self.length}")
        return KVCache(self.pool, capacity, shared=(self, prefix_len))

    def free(self) -> None:
        """Give the blocks and the rest of the reservation back to the pool (once)."""
        for block in self.table:
            self.pool.drop(block)
        self.pool.unreserve(self.reserve)
        self.table, self.reserve, self._table = [], 0, None
