"""Preallocated, slot-indexed KV cache of one session over the layers one stage holds.

Slots are cache positions. Writing at a slot overwrites it, so rolling back a rejected draft is a length
change (`truncate`), a Medusa tree written into scratch slots is compacted into place with `commit`, and
`fork` makes rows that read a shared prefix without copying it.
"""

from __future__ import annotations

import torch


class KVCacheError(ValueError):
    """An operation that does not fit the cache (capacity, slots, rows)."""


class KVCache:
    """K and V for `n_layers` layers, `rows` sequences and `capacity` slots.

    Storage: k[layer], v[layer] [rows, n_kv, allocated - prefix_len, head_dim], one tensor per layer (fewer
    indexing ops per decoding step). Storage starts at `initial` slots and doubles when a write needs
    more, up to `capacity`: a request that may run to the whole context but stops early costs what it
    used. A forked cache reads slots [0, prefix_len) from its parent's row 0 and owns the rest.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        rows: int = 1,
        prefix: tuple[KVCache, int] | None = None,
        initial: int | None = None,
    ):
        self.prefix, self.prefix_len = prefix if prefix else (None, 0)
        own = capacity - self.prefix_len
        if own < 0:
            raise KVCacheError(f"capacity {capacity} is below the shared prefix length {self.prefix_len}")
        alloc = own if initial is None else max(0, min(own, initial - self.prefix_len))
        shape = (rows, n_kv, alloc, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(n_layers)]
        self.capacity = capacity
        self.rows = rows
        self.length = self.prefix_len  # valid slots, shared prefix included

    @property
    def allocated(self) -> int:
        """Slots that have storage now (shared prefix included)."""
        return self.prefix_len + self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes this cache owns (a shared prefix is counted once, in its parent)."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)

    def _grown_slots(self, end: int) -> int:
        """Own slots to allocate so that slot end-1 has storage (doubling, capped at capacity)."""
        own = self.k[0].shape[2]
        need = end - self.prefix_len
        return own if need <= own else min(self.capacity - self.prefix_len, max(need, 2 * own))

    def growth_bytes(self, end: int) -> int:
        """Bytes that writing up to slot end-1 would add."""
        rows, n_kv, own, hd = self.k[0].shape
        slot_bytes = 2 * len(self.k) * rows * n_kv * hd * self.k[0].element_size()
        return (self._grown_slots(end) - own) * slot_bytes

    def ensure(self, end: int) -> None:
        """Grow the storage so that slots up to end-1 exist (kept contents are copied)."""
        slots = self._grown_slots(end)
        if slots == self.k[0].shape[2]:
            return
        used = self.length - self.prefix_len
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = old.new_zeros(old.shape[0], old.shape[1], slots, old.shape[3])
                new[:, :, :used] = old[:, :, :used]
                store[i] = new

    def check_write(self, start: int, n: int, rows: int) -> None:
        """Validate a write of `n` slots from `start` before any layer touches the cache."""
        if rows != self.rows:
            raise KVCacheError(f"batch has {rows} rows, the session's cache has {self.rows}")
        if not self.prefix_len <= start <= self.length:
            raise KVCacheError(f"write at slot {start} but the cache holds {self.length} slots (no gaps allowed)")
        if start + n > self.capacity:
            raise KVCacheError(f"{start + n} slots needed, the session's cache holds {self.capacity}")

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [rows, n_kv, T, hd] at slots start..start+T of `layer`.

        Returns keys and values for slots [0, start+T), each [rows, n_kv, start+T, hd].
        """
        lo = start - self.prefix_len
        hi = lo + k.shape[2]
        own_k, own_v = self.k[layer], self.v[layer]
        own_k[:, :, lo:hi] = k
        own_v[:, :, lo:hi] = v
        keys, values = own_k[:, :, :hi], own_v[:, :, :hi]
        if self.prefix is not None:
            pk, pv = self.prefix.read(layer, self.prefix_len)  # [1, n_kv, P, hd]
            shape = (self.rows, -1, -1, -1)
            keys = torch.cat([pk.expand(shape), keys], dim=2)
            values = torch.cat([pv.expand(shape), values], dim=2)
        return keys, values

    def storage(self, layer: int, start: int):
        """What a compiled attention call writes and reads for `layer` (model/kernels/layer.cpp): own k, v
        [rows, n_kv, allocated - P, hd], the slot `start` maps to in them, and the shared prefix's k, v
        [1, n_kv, P, hd] (None without one) with P. Reading the prefix in place spares write()'s per-step
        concatenation."""
        pk = pv = None
        if self.prefix is not None:
            pk, pv = self.prefix.read(layer, self.prefix_len)
        return self.k[layer], self.v[layer], start - self.prefix_len, pk, pv, self.prefix_len

    def read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of row 0 for slots [0, n) of `layer`: [1, n_kv, n, hd]."""
        if n <= self.prefix_len:
            return self.prefix.read(layer, n)
        k, v = self.k[layer][:1, :, : n - self.prefix_len], self.v[layer][:1, :, : n - self.prefix_len]
        if self.prefix is not None:
            pk, pv = self.prefix.read(layer, self.prefix_len)
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        return k, v

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (a rejected draft)."""
        if not self.prefix_len <= length <= self.length:
            raise KVCacheError(
                f"cannot truncate to {length}: cache holds {self.length}, shared prefix {self.prefix_len}"
            )
        self.length = length

    def commit(self, kept: list[int], dest: int) -> None:
        """Copy the slots `kept` (ascending, all >= dest) to dest, dest+1, ... and end the cache there.

        Used for a Medusa tree: the accepted path's entries move from scratch slots into place.
        """
        if any(s >= self.length or s < dest for s in kept) or kept != sorted(kept):
            raise KVCacheError(f"kept slots {kept} must be ascending, >= {dest} and below {self.length}")
        if dest < self.prefix_len:
            raise KVCacheError(f"cannot commit into the shared prefix (dest {dest} < {self.prefix_len})")
        src = torch.tensor(kept, dtype=torch.long) - self.prefix_len
        lo = dest - self.prefix_len
        for t in (*self.k, *self.v):
            t[:, :, lo : lo + len(kept)] = t[:, :, src]
        self.length = dest + len(kept)

    def fork(self, prefix_len: int, rows: int, capacity: int, initial: int | None = None) -> KVCache:
        """A new cache of `rows` rows that reads this cache's slots [0, prefix_len) in place."""
        if prefix_len > self.length:
            raise KVCacheError(f"prefix of {prefix_len} slots but the cache holds {self.length}")
        _, n_kv, _, hd = self.k[0].shape
        return KVCache(len(self.k), n_kv, hd, capacity, self.k[0].dtype, rows=rows, prefix=(self, prefix_len),
                       initial=initial)

    def clone_prefix(self, prefix_len: int, capacity: int, initial: int | None = None) -> KVCache:
        """A new one-row cache holding a copy of this cache's slots [0, prefix_len) of row 0 (prefix reuse:
        a copy once, where a fork would concatenate the shared prefix at every step)."""
        if not 0 < prefix_len <= self.length:
            raise KVCacheError(f"prefix of {prefix_len} slots but the cache holds {self.length}")
        _, n_kv, _, hd = self.k[0].shape
        child = KVCache(len(self.k), n_kv, hd, capacity, self.k[0].dtype,
                        initial=max(prefix_len, initial or 0))
        for layer in range(len(self.k)):
            k, v = self.read(layer, prefix_len)  # [1, n_kv, P, hd]
            child.k[layer][:, :, :prefix_len] = k
            child.v[layer][:, :, :prefix_len] = v
        child.length = prefix_len
        return child
