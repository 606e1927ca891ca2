"""The C allocator of a serving process (glibc's malloc, which torch's CPU tensors come from).

Measured with the soak (bench/soak.py: 32 streams for 2 minutes, mixed policies and long prompts, the KV pool
committed at load so that RSS shows everything else): with glibc's defaults the controller's RSS grew 5.06%
after warm-up and was still growing at the end (30.9 MiB/min); with at most 2 arenas and a fixed 256 KiB mmap
threshold, 3.4% at its highest and 0.8% at the end. By default glibc raises the mmap threshold (up to 32 MiB)
each time a large block is freed, so the step-sized tensors of later steps (logits of a batch, a long prompt's
activations) come from the heap instead, where a small live chunk above them keeps the freed space from ever
going back; and it keeps up to 8 arenas per core for the event loop's, the model thread's and the tokenizer's
threads. A fixed threshold returns every large tensor to the system when it is freed; the cost, page faults on
its next allocation, is paid only by tensors of 256 KiB or more (a single stream's logits are 192 KiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 * 2**10
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Set glibc's arena count and a fixed mmap threshold for this process; False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):  # musl and others have no mallopt: keep their defaults
        log.info("no mallopt in %s: the allocator keeps its defaults", name)
        return False
    return bool(mallopt(M_ARENA_MAX, ARENA_MAX)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
