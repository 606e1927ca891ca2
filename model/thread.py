"""The one thread that does all of a process's tensor work.

PyTorch's CPU kernels run OpenMP parallel regions, and each thread that starts one gets its own team of
OpenMP threads. When two threads do tensor work (say, loading and sampling on the event loop, forward
passes elsewhere), the teams compete for the cores: measured here, a 3072x576 bf16 matrix-vector product
took 300 instead of 190 us and attention 87 instead of 23 us, and decoding fell from 37 to 25 tokens/s.
So loading, forward passes, sampling and wire encoding all run here, one job at a time; the event loop
only awaits them.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch


class ModelThread:
    def __init__(self, threads: int):
        self._threads = threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model", initializer=self._init)

    def _init(self) -> None:
        torch.set_num_threads(self._threads)

    def run_sync(self, fn, *args):
        """Run fn(*args) on the model thread and wait for it (start-up, outside any event loop)."""
        return self._executor.submit(fn, *args).result()

    async def run(self, fn, *args):
        """Run fn(*args) on the model thread, in turn with every other job."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run_shielded(self, fn, *args):
        """Like run, but the job is queued before the first await and survives the caller's cancellation
        (used for releasing a session's cache from a `finally` of a cancelled request)."""
        await asyncio.shield(asyncio.wrap_future(self._executor.submit(fn, *args)))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
