"""What a worker reports of its KV caches with what it already sends the controller: the acks of session
operations (open, fork, commit, HeadSplit's too), a frame of its own after a release (which has no ack), and
its hop record in a forward's result. The controller keeps each worker's latest report (its links' readers
and the pipeline file them) and sums them for /metrics: a worker's pool is not the controller's to count.

    "kv": [used, free, bytes]   blocks holding entries, blocks neither used nor reserved, bytes held
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KVReport:
    """A worker's KV caches: blocks used and free (a layer stage's pool blocks; HeadSplit blocks' units of one KV
    group's slots in one layer, model/head_blocks.py) and the bytes they hold."""

    used: int = 0
    free: int = 0
    nbytes: int = 0

    def fields(self) -> dict[str, list[int]]:
        """The report as a frame's header field."""
        return {"kv": [self.used, self.free, self.nbytes]}

    @classmethod
    def of(cls, header: dict) -> KVReport | None:
        """The report a frame's header carries, or None (none, or not three non-negative integers)."""
        value = header.get("kv")
        if (isinstance(value, list) and len(value) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in value)):
            return cls(*value)
        return None


class KVReports:
    """Each worker's latest report by name: filed by the links' reader threads and the model thread, read by
    whoever scrapes /metrics."""

    def __init__(self) -> None:
        self._latest: dict[str, KVReport] = {}
        self._lock = threading.Lock()

    def file(self, worker: str, header: dict) -> None:
        """Keep the report in `header`, if it carries one, as `worker`'s latest."""
        report = KVReport.of(header)
        if report is not None:
            with self._lock:
                self._latest[worker] = report

    def latest(self, worker: str) -> KVReport:
        """`worker`'s latest report (nothing held before its first)."""
        with self._lock:
            return self._latest.get(worker, KVReport())

    def total(self, workers: Iterable[str]) -> KVReport:
        """The latest reports of these workers, summed."""
        reports = [self.latest(w) for w in workers]
        return KVReport(sum(r.used for r in reports), sum(r.free for r in reports), sum(r.nbytes for r in reports))
