"""bench/concurrency.py's arithmetic: the steady-use window's tokens."""

from __future__ import annotations

from edgespec.bench.concurrency import window_tokens


def test_window_tokens_share_each_run_by_its_chunks_characters():
    runs = [{"tokens": 10, "chunk_times": [0.5, 1.5, 2.5, 3.5], "chunk_chars": [1, 1, 1, 1]},  # half inside
            {"tokens": 6, "chunk_times": [1.2, 2.9], "chunk_chars": [10, 20]},  # all inside
            {"tokens": 4, "chunk_times": [2.0, 3.0], "chunk_chars": [3, 1]},  # 3 of 4 characters: the end is out
            {"tokens": 1, "chunk_times": [], "chunk_chars": []}]  # no text at all
    assert window_tokens(runs, (1.0, 3.0)) == 10 * 0.5 + 6 + 4 * 0.75
