"""Reading a streamed HTTP answer in the benchmarks: the JSON of each server-sent event."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def events(client: httpx.Client, path: str, body: dict) -> Iterator[Iterator[dict]]:
    """POST `body` to `path` streamed; yields the iterator of its events (each `data: {...}` line's JSON). The
    stream closes when the block ends, however it is left (a benchmark that stops at the first token breaks out).
    RuntimeError with the status and body when the answer is not a 200."""
    with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        yield (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
