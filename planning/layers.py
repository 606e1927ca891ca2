"""Jupiter's layer partition: contiguous layer ranges over devices in a fixed order, minimising the slowest stage.

A(1..y, D_n) = min over l of max(A(1..l, D_(n-1)), T(l+1..y, d_n)), then, among the partitions that reach that
bottleneck, the one with the least sum of stage times. O(L^2 |D|) time, each stage time evaluated once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Two partitions with the same bottleneck may compute it by different float sums; count them as equal.
REL_TOL = 1e-12


def _stage_table(n_layers: int, n_devices: int, stage_ms: Callable[[int, int, int], float]) -> list[dict]:
    """cost[i][(first, last)] for every range device i can hold in a full partition.

    Device i needs i layers before it and one layer per device after it, so first >= i and
    last <= n_layers - (n_devices - 1 - i); the first device starts at 0 and the last ends at n_layers.
    """
    table = []
    for i in range(n_devices):
        firsts = [0] if i == 0 else range(i, n_layers - (n_devices - i) + 1)
        top = n_layers - (n_devices - 1 - i)
        row = {}
        for first in firsts:
            lasts = [n_layers] if i == n_devices - 1 else range(first + 1, top + 1)
            for last in lasts:
                row[first, last] = float(stage_ms(i, first, last))
        table.append(row)
    return table


def _min_bottleneck(n_layers: int, n_devices: int, cost: list[dict]) -> float:
    # best[y]: the least bottleneck of devices 0..i holding layers [0, y)
    best = [math.inf] * (n_layers + 1)
    for (_, last), t in cost[0].items():
        best[last] = t
    for i in range(1, n_devices):
        nxt = [math.inf] * (n_layers + 1)
        for (first, last), t in cost[i].items():
            v = best[first] if best[first] > t else t
            if v < nxt[last]:
                nxt[last] = v
        best = nxt
    return best[n_layers]


def _min_total(n_layers: int, n_devices: int, cost: list[dict], cap: float) -> list[list[float]]:
    """sums[i][y]: the least sum of stage times of devices 0..i on layers [0, y), every stage <= cap."""
    sums = [[math.inf] * (n_layers + 1) for _ in range(n_devices)]
    for (_, last), t in cost[0].items():
        if t <= cap:
            sums[0][last] = t
    for i in range(1, n_devices):
        prev, row = sums[i - 1], sums[i]
        for (first, last), t in cost[i].items():
            if t <= cap:
                v = prev[first] + t
                if v < row[last]:
                    row[last] = v
    return sums


def partition_layers(n_layers: int, n_devices: int, stage_ms: Callable[[int, int, int], float]
                     ) -> tuple[float, float, list[tuple[int, int]]] | None:
    """Split layers [0, n_layers) into one non-empty contiguous range per device, devices in order 0..n-1.

    stage_ms(i, first, last) is device i's time for layers [first, last), math.inf where they do not fit.
    Returns (bottleneck, total, bounds): bottleneck is the least possible slowest stage; among the partitions
    that reach it (within a relative 1e-12), total is the least sum of stage times and bounds is such a
    partition, [(first, last), ...] per device. None when no partition is finite, n_devices < 1 or
    n_devices > n_layers.
    """
    if n_devices < 1 or n_devices > n_layers:
        return None
    cost = _stage_table(n_layers, n_devices, stage_ms)
    bottleneck = _min_bottleneck(n_layers, n_devices, cost)
    if not math.isfinite(bottleneck):
        return None
    # A lexicographic (max, sum) key in one DP is not exact: it drops a prefix with a larger max but a smaller
    # sum, which is the better one when a later stage sets the bottleneck. A second DP capped at it is exact.
    cap = bottleneck + REL_TOL * abs(bottleneck)
    sums = _min_total(n_layers, n_devices, cost, cap)
    total = sums[n_devices - 1][n_layers]
    # Walk back: a predecessor whose sum plus this stage reproduces the same float is on an optimal path.
    bounds, last = [], n_layers
    for i in range(n_devices - 1, 0, -1):
        first = next(f for (f, la), t in cost[i].items()
                     if la == last and t <= cap and sums[i - 1][f] + t == sums[i][last])
        bounds.append((first, last))
        last = first
    bounds.append((0, last))
    return bottleneck, total, bounds[::-1]
