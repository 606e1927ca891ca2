"""A stage's kernel weights in huge pages: one private anonymous mapping advised as transparent huge pages.

A pass reads every weight once; in 4 KiB pages the served model's 80 MiB of layer weights are 20k pages a token,
far more than the core's TLB holds, and the hardware prefetchers stop at each page's end. Copied into one mapping
advised with MADV_HUGEPAGE (2 MiB pages where the kernel has them free), on a 2-core Zen 4 EPYC, both copies of
the stack alternated in one process (bench/results/issue39-huge-pages): the layer matmuls 0.957x and 0.923x the
time at one row in two runs, 0.984x and 0.926x at 16; a decoding step of the 30 layers 0.942x and 0.918x at one
sequence, 0.983x and 0.979x at 16. Linux's default policy (`madvise`) gives huge pages only to memory that asks,
and torch's allocator asks only under THP_MEM_ALLOC_ENABLE and then only for tensors of 2 MiB or more (no
projection of a small model is). The KV pool measured no different in huge pages (`kv_ab.py` there: attention's
reads are bound elsewhere), so it keeps torch's allocations. Where the platform has no MADV_HUGEPAGE (not Linux)
the weights stay where they are.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

from edgespec.model.linear import Kernel

HUGE_PAGE = 2 * 2**20  # x86-64's and aarch64's (4 KiB granule) transparent huge page
ALIGN = 64  # each copy starts on a cache line


class HugePages:
    """A fixed-size mapping advised MADV_HUGEPAGE (Linux only) handing out tensor copies in order (no freeing: the
    copies live as long as it does, and it as long as any copy)."""

    def __init__(self, nbytes: int):
        # one huge page more than asked, so that the first copy can start on a huge page's boundary
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` open
        self.used = (-self.bytes.data_ptr()) % HUGE_PAGE
        self.size = nbytes + self.used

    @staticmethod
    def footprint(t: torch.Tensor) -> int:
        """Bytes a copy of `t` takes here (rounded up to ALIGN)."""
        return -(-t.numel() * t.element_size() // ALIGN) * ALIGN

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` in this mapping."""
        end = self.used + self.footprint(t)
        if end > self.size:
            raise ValueError(f"a copy of {self.footprint(t)} bytes does not fit: {self.size - self.used} left")
        out = self.bytes[self.used:self.used + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used = end
        return out


def hold_in_huge_pages(kernels: Sequence[Kernel]) -> None:
    """Move every kernel's weight into one HugePages mapping, kernel by kernel, so that at most one kernel's
    weight is held twice at a time (a weight shared with something else stays held there too)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not kernels:
        return
    pages = HugePages(sum(HugePages.footprint(t) for k in kernels for t in k.weight_tensors()))
    for k in kernels:
        k.use([pages.copy(t) for t in k.weight_tensors()])
