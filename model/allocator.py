"""The C allocator of a serving process (glibc's malloc, which torch's CPU tensors come from).

Measured with the soak (bench/soak.py: 32 streams for 2 minutes, mixed policies and long prompts, the KV pool
committed at load so that RSS shows everything else): with glibc's defaults (up to 8 arenas per core, an mmap
threshold that rises with every large block freed) the controller's RSS grew 5.06% after warm-up and was still
growing at the end (30.9 MiB/min); with at most 2 arenas and a fixed 256 KiB mmap threshold, 3.4% at its
highest and 0.8% at the end.

That threshold returned every tensor of 256 KiB or more to the system when it was freed, and page faults paid
for it at the next allocation: each layer's activations over a prompt's rows, the logits of a batch or of a
verification (9 rows: 1.7 MiB). On a 2-core EPYC with SmolLM2-135M the first token of a 1106-token prompt took
1256-1306 ms against 874-981 ms with the thresholds below (the same forward in-process: 810-1020 ms), with a
fifth of the server's samples in the kernel's page-fault and unmap paths; 8 streams 746 against 885 tokens/s.
So the mmap threshold is fixed at glibc's own largest, 32 MiB (a layer's activations for prompts up to about
2.7k tokens come from the heap), and the trim threshold at 64 MiB, what glibc's own rule pairs with it (16 and
32 MiB measured the same). The cost is the freed space the heaps keep: with 2 arenas the soak's RSS grew 4.65%
after warm-up, then held flat for the last 80 s of the load, and bench-peer's servers peaked at 974 MiB against
859 (bench/results/issue39-allocator, issue39-versus-session5).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt parameters, from glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 64 * 2**20  # what glibc's dynamic rule would pair with it (twice the mmap threshold)
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Set glibc's arena count and fixed mmap and trim thresholds for this process; False where libc is not
    glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):  # musl and others have no mallopt: keep their defaults
        log.info("no mallopt in %s: the allocator keeps its defaults", name)
        return False
    return all(mallopt(param, value) for param, value in ((M_ARENA_MAX, ARENA_MAX), (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                                         (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
