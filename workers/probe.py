"""Link probing: round-trip time and bandwidth from here to a worker's /probe/sink.

Used by the controller (its links to each worker) and by workers (their links to each other), so that
every hop a hidden state may take has a measured cost.
"""

from __future__ import annotations

import statistics
import time

import httpx

SMALL = 64
LARGE = 4 * 2**20


async def _post_ms(client: httpx.AsyncClient, url: str, body: bytes, headers: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post(url, content=body, headers=headers)
    r.raise_for_status()
    return 1000 * (time.perf_counter() - t0)


async def measure_link(client: httpx.AsyncClient, target: str, token: str, reps: int = 5,
                       large: int = LARGE) -> dict:
    """RTT (ms) of a small request and bandwidth (bytes/s) from the extra time a large body takes."""
    url = target.rstrip("/") + "/probe/sink"
    headers = {"authorization": f"Bearer {token}", "content-type": "application/octet-stream"}
    small_body, large_body = b"\0" * SMALL, b"\0" * large
    await _post_ms(client, url, small_body, headers)  # open the connection first
    small = statistics.median([await _post_ms(client, url, small_body, headers) for _ in range(reps)])
    big = statistics.median([await _post_ms(client, url, large_body, headers) for _ in range(max(2, reps // 2))])
    # on loopback the difference can be tiny or even negative: floor it at 10 GB/s-equivalent time
    extra_s = max((big - small) / 1000, (large - SMALL) / 10e9)
    return {"rtt_ms": round(small, 4), "bandwidth_bytes_per_s": round((large - SMALL) / extra_s, 1)}
