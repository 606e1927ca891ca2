"""Link probing: the round-trip time of a small message and the bandwidth of a large one, measured on a link
(workers/relay.py) the way forward calls use it: a ping frame out, a pong back.

Used by the controller (its links to each worker) and by workers (their links to each other), so that every
hop a hidden state may take has a measured per-message cost.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

from websockets.asyncio.client import connect

from edgespec.planning.profile import IDLE_MS
from edgespec.workers.frames import MAX_HEADER, pack, unpack

SMALL = 64
LARGE = 4 * 2**20


async def measure_link(url: str, token: str, reps: int = 5, large: int = LARGE) -> dict:
    """RTT (ms) of a small message and bandwidth (bytes/s) from the extra time a large one takes, on a new
    link to `url` (a worker's ws(s)://.../link)."""
    ids = itertools.count()
    async with connect(url, additional_headers={"authorization": f"Bearer {token}"}, compression=None,
                       max_size=large + MAX_HEADER + 4, ping_interval=None, open_timeout=30) as link:

        async def ping_ms(body: bytes) -> float:
            mid = next(ids)
            t0 = time.perf_counter()
            await link.send(pack({"op": "ping", "id": mid}, body))
            while True:
                header, _ = unpack(await link.recv())
                if header["op"] == "pong" and header.get("id") == mid:
                    return 1000 * (time.perf_counter() - t0)

        async def idle_ping_ms() -> float:
            await asyncio.sleep(IDLE_MS / 1000)
            return await ping_ms(small_body)

        small_body, large_body = b"\0" * SMALL, b"\0" * large
        await ping_ms(small_body)  # the first message after the handshake warms both ends
        small = statistics.median([await ping_ms(small_body) for _ in range(reps)])
        idle = statistics.median([await idle_ping_ms() for _ in range(reps)])
        big = statistics.median([await ping_ms(large_body) for _ in range(max(2, reps // 2))])
    # on loopback the difference can be tiny or even negative: floor it at 10 GB/s-equivalent time
    extra_s = max((big - small) / 1000, (large - SMALL) / 10e9)
    return {"rtt_ms": round(small, 4), "bandwidth_bytes_per_s": round((large - SMALL) / extra_s, 1),
            "rtt_idle_ms": round(idle, 4)}
