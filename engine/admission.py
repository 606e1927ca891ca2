"""Admission by KV budget: a request whose cache does not fit waits for room instead of failing.

The budget a stage's caches may hold is the admission budget. A session that cannot open, even after every
kept prefix is dropped, waits in a bounded queue while other sessions hold caches (they will release theirs);
past the queue's length or its time it is refused with QueueFullError, which the HTTP layer answers with 503
and a Retry-After. A session that could not fit with nothing else open is refused at once: waiting would not
help it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from edgespec.model.kv_pool import CapacityError


class QueueFullError(CapacityError):
    """The admission queue is full, or a request waited its whole time for KV room: the server is busy."""


@dataclass
class Admission:
    """The queue of opens waiting for KV room, woken together whenever a session releases its cache."""

    max_waiting: int = 64
    timeout_s: float = 60.0
    # the queue's state and counters, not settings
    waiting: int = field(default=0, init=False)  # requests waiting for room now
    admitted: int = field(default=0, init=False)  # requests that waited and then fit, since start
    refused: int = field(default=0, init=False)  # requests turned away by a full queue or a wait that ran out
    waited_s: float = field(default=0.0, init=False)  # the admitted requests' time in the queue, summed
    _wakeups: list[asyncio.Future] = field(default_factory=list, init=False)

    def join(self, reason: CapacityError) -> float:
        """Queue the request that just got `reason`; returns when it joined (time.monotonic). Every join is
        followed by one leave, whatever happens."""
        if self.waiting >= self.max_waiting:
            self.refused += 1
            raise QueueFullError(f"{self.waiting} requests already wait for KV cache room ({reason}); "
                                 "retry later") from reason
        self.waiting += 1
        return time.monotonic()

    async def wait(self, joined: float, reason: CapacityError) -> None:
        """Until the next release; QueueFullError once the request has waited timeout_s since it joined."""
        future = asyncio.get_running_loop().create_future()
        self._wakeups.append(future)
        try:
            await asyncio.wait_for(future, max(0.0, joined + self.timeout_s - time.monotonic()))
        except TimeoutError:
            self.refused += 1
            raise QueueFullError(f"no KV cache room came free within {self.timeout_s:g} s ({reason}); "
                                 "retry later") from reason
        finally:
            if future in self._wakeups:
                self._wakeups.remove(future)

    def leave(self, joined: float, admitted: bool) -> None:
        """The request left the queue, with its cache open or not."""
        self.waiting -= 1
        if admitted:
            self.admitted += 1
            self.waited_s += time.monotonic() - joined

    def released(self) -> None:
        """A session released its cache: every waiting request tries again, in the order they came."""
        wakeups, self._wakeups = self._wakeups, []
        for future in wakeups:
            if not future.done():
                future.set_result(None)
