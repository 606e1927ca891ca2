"""A stage's KV pool: every sequence's keys and values live in fixed-size blocks preallocated at load.

The pool is the stage's admission budget. A session reserves, at its open, the blocks its capacity may need, so
a request that does not fit is refused before it starts (the engine queues it, engine/admission.py) and a
running one never runs out mid-stream. Blocks are reference-counted: a session forked from another (prefix
reuse, outline's points after their shared prompt) reads the parent's blocks in place and copies a shared
block only when it first writes into it. Storage is `torch.empty`, so the operating system commits a block's
pages when it is first written, not at load; freed blocks are reused last-in first-out, so the pages in use
stay the hot ones. With `prefault` every page is written at load instead (as llama.cpp clears its KV buffer):
the process then holds its whole budget from the start, so its RSS does not climb with the pool's high water,
and another program on the device cannot take the memory a running stream was promised.
"""

from __future__ import annotations

import math

import torch

from edgespec.model.kv_format import KVFormat

BLOCK_SLOTS = 64  # slots per block (vLLM: 16 on GPUs, 128 on CPUs). Measured on the 2-core EPYC, the served
# model's 30 layers over 16 decoding sequences, the kernels before and after the pool alternated in one process
# (bench/results/issue18-kv-pool/tools): blocks of 16 slots were 0-6% slower than contiguous caches, blocks of 64
# within 2%. A SmolLM2 block of 64 slots is 2.9 MiB in float32.


def block_bytes(n_layers: int, n_kv: int, head_dim: int, fmt: KVFormat, block: int) -> int:
    """Bytes of one block: keys and values of `block` slots in every layer, stored in `fmt`."""
    return 2 * n_layers * n_kv * block * fmt.row(head_dim) * fmt.dtype.itemsize


class CapacityError(RuntimeError):
    """A session's KV cache does not fit the memory budget; the message names the numbers."""


class KVPool:
    """k[layer], v[layer] [n_blocks, n_kv, block, fmt.row(head_dim)] in `fmt`'s storage for `n_layers` layers,
    views of one tensor `kv` [2, n_layers, n_blocks, n_kv, block, row], so that a copy between slots is one op for
    every layer (a Medusa tree's commit, the served model's 30 layers: 476.5 us as 60 indexed copies, 57.3 us as
    one, bench/results/issue39-draft-tree/commit_ab.txt), with each block's reference count, the free list and
    the blocks reserved by open sessions but not yet taken."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, fmt: KVFormat, n_blocks: int,
                 block: int = BLOCK_SLOTS, prefault: bool = False):
        fmt.check(head_dim)
        shape = (n_blocks, n_kv, block, fmt.row(head_dim))
        alloc = torch.zeros if prefault else torch.empty  # zeros writes every page now
        self.kv = alloc((2, n_layers, *shape), dtype=fmt.dtype)
        self.k, self.v = list(self.kv[0]), list(self.kv[1])
        self.fmt, self.block, self.n_blocks = fmt, block, n_blocks
        self.block_bytes = block_bytes(n_layers, n_kv, head_dim, fmt, block)
        self.refs = [0] * n_blocks
        self.free_list = list(range(n_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.reserved = 0

    @classmethod
    def for_bytes(cls, n_layers: int, n_kv: int, head_dim: int, fmt: KVFormat, nbytes: int,
                  block: int = BLOCK_SLOTS, prefault: bool = False) -> KVPool:
        """The pool of as many blocks as `nbytes` holds."""
        per_block = block_bytes(n_layers, n_kv, head_dim, fmt, block)
        return cls(n_layers, n_kv, head_dim, fmt, max(0, nbytes // per_block), block, prefault)

    def blocks_for(self, slots: int) -> int:
        return math.ceil(slots / self.block)

    @property
    def used(self) -> int:
        """Blocks holding some session's entries."""
        return self.n_blocks - len(self.free_list)

    @property
    def available(self) -> int:
        """Blocks neither used nor reserved: what a new session may reserve."""
        return len(self.free_list) - self.reserved

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.n_blocks * self.block_bytes

    def reserve(self, n: int) -> None:
        """Promise n blocks to a session (CapacityError, naming the numbers, when they are not free)."""
        if n > self.available:
            mib = self.block_bytes / 2**20
            raise CapacityError(f"the KV cache needs {n} blocks ({n * mib:.1f} MiB) more but only {self.available} "
                                f"of {self.n_blocks} ({self.available * mib:.1f} of {self.n_blocks * mib:.1f} MiB) "
                                "are free")
        self.reserved += n

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def take(self, reserved: bool) -> int:
        """A free block, counted 1 reference; from the caller's reservation, or else only if one is available."""
        if reserved:
            self.reserved -= 1
        elif self.available < 1:
            raise CapacityError(f"the KV cache is full ({self.n_blocks} blocks of {self.block} slots in use or "
                                "reserved)")
        block = self.free_list.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def drop(self, block: int) -> None:
        """One reference fewer; the block is free at none."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_list.append(block)
