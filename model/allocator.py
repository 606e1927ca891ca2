"""The C allocator of a serving process (glibc's malloc, which torch's CPU tensors come from).

Measured with the soak (bench/soak.py: 32 streams for 2 minutes, mixed policies and long prompts, the KV pool
committed at load so that RSS shows everything else): with glibc's defaults the controller's RSS grew 5.06%
after warm-up and was still growing at the end (30.9 MiB/min); with at most 2 arenas and a fixed 256 KiB mmap
threshold, 3.4% at its highest and 0.8% at the end. By default glibc raises the mmap threshold (up to 32 MiB)
each time a large block is freed, and keeps up to 8 arenas per core for the event loop's, the model thread's and
the tokenizer's threads.

But a 256 KiB threshold returned every large tensor to the system when it was freed, and page faults paid for
it on the next allocation: a step's activations over a prompt's rows, the logits of a batch or a verification
(9 rows: 1.7 MiB). Measured on a 2-core EPYC with SmolLM2-135M: the first token of a 1106-token prompt took
1256-1306 ms against 874-981 with the fixed 32 MiB threshold below (in-process, without the server: 810-1020),
a fifth of its samples in the kernel's page fault and unmap paths; 8 streams 746 against 885 tokens/s. So
the threshold is fixed at glibc's own largest (the activations of a prompt of about 2.7k tokens fit under it),
and the heap keeps up to TRIM_THRESHOLD of freed space at its top instead of returning it after every layer.
A fixed threshold still never rises, and 2 arenas still bound the heaps: see the soak's figures in
bench/results/issue39-allocator.
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
