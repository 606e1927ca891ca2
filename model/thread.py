"""The one thread that does all of a process's tensor work.

PyTorch's CPU kernels run OpenMP parallel regions, and each thread that starts one gets its own team of
OpenMP threads. When two threads do tensor work (say, loading and sampling on the event loop, forward
passes elsewhere), the teams compete for the cores: measured here, a 3072x576 bf16 matrix-vector product
took 300 instead of 190 us and attention 87 instead of 23 us, and decoding fell from 37 to 25 tokens/s.
So loading, forward passes, sampling and wire encoding all run here, one job at a time; the event loop
only awaits them.

The thread count adapts to other processes on the cores (model/cpu_share.py): the governor is asked before
each job and between the engine's steps, which run back to back in one job while nothing else waits.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from edgespec.model.cpu_share import ThreadGovernor


class ModelThread:
    def __init__(self, threads: int, adaptive: bool = True):
        """`threads` torch threads when the cores are free; with `adaptive`, fewer while other processes
        take cores (see model/cpu_share.py)."""
        self._threads = threads
        self.governor = ThreadGovernor(threads, torch.set_num_threads) if adaptive else None
        self._ident: int | None = None  # the model thread's id, once it started
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model", initializer=self._init)
        self._submitted = self._started = 0  # jobs handed in, and jobs begun: the difference waits

    def pending(self) -> int:
        """Jobs waiting for the thread (the engine yields it between steps when there are any). Asked on the
        model thread between steps, it is also where the thread count is revised during a long job."""
        if self.governor is not None and threading.get_ident() == self._ident:
            self.governor.tick()
        return self._submitted - self._started

    def _submit(self, fn, *args):
        self._submitted += 1

        def job():
            self._started += 1
            if self.governor is not None:
                self.governor.tick()
            return fn(*args)

        future = self._executor.submit(job)
        future.add_done_callback(self._count_cancelled)
        return future

    def _count_cancelled(self, future) -> None:
        if future.cancelled():  # it will never begin (a cancelled caller, or shutdown)
            self._started += 1

    def _init(self) -> None:
        self._ident = threading.get_ident()
        torch.set_num_threads(self._threads)

    def run_sync(self, fn, *args):
        """Run fn(*args) on the model thread and wait for it (start-up, outside any event loop)."""
        return self._submit(fn, *args).result()

    async def run(self, fn, *args):
        """Run fn(*args) on the model thread, in turn with every other job."""
        return await asyncio.wrap_future(self._submit(fn, *args))

    async def run_shielded(self, fn, *args):
        """Like run, but the job is queued before the first await and survives the caller's cancellation
        (used for releasing a session's cache from a `finally` of a cancelled request)."""
        await asyncio.shield(asyncio.wrap_future(self._submit(fn, *args)))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
