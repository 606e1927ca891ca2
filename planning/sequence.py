"""Jupiter's sequence partition: cut a prompt into segments that flow through the pipeline one after another.

W(1..y, k) = min over l of max(W(1..l, k-1), T*(y-l, l)), with every segment at least b tokens long; k is
chosen by Latency = sum of h_i + (stages - 1) * W. Among the splits that reach W, the one with the least sum
of segment times is taken, which is the least latency for that k.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

REL_TOL = 1e-12  # splits whose bottlenecks differ only by float rounding count as equal
MAX_UNITS = 64  # choose_segments cuts on a grid of at most this many steps, so long prompts stay cheap


def min_segment(ms_of_tokens: Callable[[int], float], grid: Sequence[int], tolerance: float = 0.1) -> int:
    """b: the smallest token count in grid after which the time per token stops falling by tolerance or more.

    That is the first n whose next grid point n' has ms(n')/n' >= (1 - tolerance) * ms(n)/n; grid[-1] when the
    time per token keeps falling over the whole grid; 1 for an empty grid.
    """
    points = sorted({n for n in grid if n >= 1})
    if not points:
        return 1
    per_token = [ms_of_tokens(n) / n for n in points]
    for i in range(len(points) - 1):
        if per_token[i + 1] >= (1 - tolerance) * per_token[i]:
            return points[i]
    return points[-1]


def _graph(length: int, seg: Callable[[int, int], float], b: int, step: int) -> tuple[list[int], list[list]]:
    """Cut positions (0, the multiples of step, length) and, per position p, its (q index, T*(p - q, q)) for
    every earlier position q at least b tokens before it."""
    pos = [*range(0, length, step), length]
    preds = [[(qi, seg(p - q, q)) for qi, q in enumerate(pos[:pi]) if p - q >= b] for pi, p in enumerate(pos)]
    return pos, preds


def _bottlenecks(preds: list[list], max_k: int) -> list[list[float]]:
    """rows[j][p]: the least slowest segment of j segments covering [0, pos[p])."""
    rows = [[-math.inf] + [math.inf] * (len(preds) - 1)]  # no segment covers [0, 0) at no cost
    for _ in range(max_k):
        prev, row = rows[-1], []
        for pp in preds:
            best = math.inf
            for qi, c in pp:
                v = prev[qi] if prev[qi] > c else c
                if v < best:
                    best = v
            row.append(best)
        rows.append(row)
    return rows


def _cheapest(pos: list[int], preds: list[list], k: int, cap: float) -> tuple[list[int], list[float]]:
    """The k-segment split of least total time whose segments all take <= cap: (segment ends, their times)."""
    sums = [[0.0] + [math.inf] * (len(preds) - 1)]
    for _ in range(k):
        prev, row = sums[-1], []
        for pp in preds:
            best = math.inf
            for qi, c in pp:
                if c <= cap and prev[qi] + c < best:
                    best = prev[qi] + c
            row.append(best)
        sums.append(row)
    # Walk back: a predecessor whose sum plus this segment reproduces the same float is on an optimal path.
    ends, times, pi = [], [], len(pos) - 1
    for j in range(k, 0, -1):
        qi, c = next((qi, c) for qi, c in preds[pi] if c <= cap and sums[j - 1][qi] + c == sums[j][pi])
        ends.append(pos[pi])
        times.append(c)
        pi = qi
    return ends[::-1], times[::-1]


def _memo(seg_ms: Callable[[int, int], float]) -> Callable[[int, int], float]:
    cache: dict[tuple[int, int], float] = {}

    def seg(s: int, ctx: int) -> float:
        if (s, ctx) not in cache:
            cache[s, ctx] = float(seg_ms(s, ctx))
        return cache[s, ctx]

    return seg


def partition_sequence(length: int, k: int, seg_ms: Callable[[int, int], float], b: int, step: int
                       ) -> tuple[float, list[int]] | None:
    """Split a prompt of length tokens into exactly k contiguous segments, minimising the slowest one.

    seg_ms(s, l) is T*(s, l): the slowest pipeline stage's time on s tokens after l tokens of context. Cuts
    fall on multiples of step and every segment has at least b tokens, except that k == 1 (the whole prompt)
    is always allowed. Returns (W, cuts), cuts being the segment ends in order (the last is length), the one
    with the least sum of segment times among those reaching W; None when no such split exists.
    """
    if length < 1 or k < 1 or step < 1:
        return None
    seg = _memo(seg_ms)
    if k == 1:
        return seg(length, 0), [length]
    pos, preds = _graph(length, seg, b, step)
    bottleneck = _bottlenecks(preds, k)[k][-1]
    if not math.isfinite(bottleneck):
        return None
    return bottleneck, _cheapest(pos, preds, k, bottleneck + REL_TOL * abs(bottleneck))[0]


def choose_segments(length: int, n_stages: int, seg_ms: Callable[[int, int], float], b: int, max_k: int,
                    quantum: int = 16) -> tuple[int, list[int], float, float]:
    """The number of segments k in 1..max_k, and its split, with the least pipeline latency (ties: smaller k).

    Latency = sum of h_i + (n_stages - 1) * W, h_i being segment i's time and W the largest. Cuts fall on
    multiples of quantum, coarsened so that a prompt has at most 64 steps. Returns (k, cuts, latency, W).
    """
    seg = _memo(seg_ms)
    step = quantum * math.ceil(length / (MAX_UNITS * quantum))
    whole = seg(length, 0)
    best = (1, [length], whole + (n_stages - 1) * whole, whole)
    if max_k < 2:
        return best
    pos, preds = _graph(length, seg, b, step)
    rows = _bottlenecks(preds, max_k)  # the rows for k segments extend those for k - 1: compute them once
    for k in range(2, max_k + 1):
        bottleneck = rows[k][-1]
        if not math.isfinite(bottleneck):
            continue
        cuts, times = _cheapest(pos, preds, k, bottleneck + REL_TOL * abs(bottleneck))
        worst = max(times)
        latency = sum(times) + (n_stages - 1) * worst
        if latency < best[2] - REL_TOL * abs(best[2]):
            best = (k, cuts, latency, worst)
    return best
