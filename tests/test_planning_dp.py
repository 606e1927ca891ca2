"""The planning DPs (planning/layers.py, planning/sequence.py) against brute force on small random instances."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter

import pytest
from hypothesis import assume, find, given, settings
from hypothesis import strategies as st

from edgespec.planning.layers import partition_layers
from edgespec.planning.sequence import choose_segments, min_segment, partition_sequence

TOL = 1e-12
MAX_CUT_SETS = 1000  # brute force enumerates this many cut sets at most per instance


def close(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# layer partition


@st.composite
def layer_instances(draw):
    """(n_layers, n_devices, stage_ms): per-device per-layer costs plus a fixed cost, some devices capped."""
    n_layers = draw(st.integers(1, 9))
    n_devices = draw(st.integers(1, 5))
    # small integers make many exact ties, where a wrong tie-break shows; floats exercise rounding
    cost = st.one_of(st.integers(0, 5).map(float), st.floats(0.0, 10.0, allow_nan=False))
    per_layer = [draw(st.lists(cost, min_size=n_layers, max_size=n_layers)) for _ in range(n_devices)]
    fixed = draw(st.lists(cost, min_size=n_devices, max_size=n_devices))
    caps = draw(st.lists(st.none() | st.integers(0, n_layers), min_size=n_devices, max_size=n_devices))

    def stage_ms(i: int, first: int, last: int) -> float:
        if caps[i] is not None and last - first > caps[i]:
            return math.inf
        return fixed[i] + sum(per_layer[i][first:last])

    return n_layers, n_devices, stage_ms


def brute_layers(n_layers, n_devices, stage_ms):
    """(bottleneck, least total among partitions reaching it) over every composition, or None."""
    found = []
    for cuts in itertools.combinations(range(1, n_layers), n_devices - 1):
        ends = [0, *cuts, n_layers]
        times = [stage_ms(i, ends[i], ends[i + 1]) for i in range(n_devices)]
        if all(math.isfinite(t) for t in times):
            found.append((max(times), sum(times)))
    if n_devices < 1 or not found:
        return None
    bottleneck = min(m for m, _ in found)
    return bottleneck, min(s for m, s in found if m <= bottleneck + TOL * abs(bottleneck))


def check_layers(solver, n_layers, n_devices, stage_ms) -> None:
    """Raise AssertionError unless solver's answer matches brute force."""
    got, want = solver(n_layers, n_devices, stage_ms), brute_layers(n_layers, n_devices, stage_ms)
    assert (got is None) == (want is None), (got, want)
    if got is None:
        return
    bottleneck, total, bounds = got
    assert close(bottleneck, want[0]) and close(total, want[1]), (got, want)
    assert len(bounds) == n_devices and bounds[0][0] == 0 and bounds[-1][1] == n_layers
    assert all(first < last for first, last in bounds)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    times = [stage_ms(i, first, last) for i, (first, last) in enumerate(bounds)]
    assert close(max(times), bottleneck) and close(sum(times), total), (times, got)


@settings(max_examples=300, deadline=None)
@given(layer_instances())
def test_partition_layers_matches_brute_force(instance):
    n_layers, n_devices, stage_ms = instance
    calls = Counter()

    def counted(i, first, last):
        calls[i, first, last] += 1
        return stage_ms(i, first, last)

    partition_layers(n_layers, n_devices, counted)
    assert all(c == 1 for c in calls.values()), "a stage time was evaluated twice"
    check_layers(partition_layers, n_layers, n_devices, stage_ms)


def sum_dp(n_layers, n_devices, stage_ms):
    """A wrong layer DP: it minimises the sum of stage times, not the slowest stage."""
    best = {(0, 0): (0.0, [])}
    for i in range(n_devices):
        for last in range(i + 1, n_layers + 1):
            options = [(best[i, f][0] + stage_ms(i, f, last), [*best[i, f][1], (f, last)])
                       for f in range(i, last) if (i, f) in best]
            best[i + 1, last] = min(options, key=lambda o: o[0])
    total, bounds = best.get((n_devices, n_layers), (math.inf, []))
    if not math.isfinite(total):
        return None
    return max(stage_ms(i, f, la) for i, (f, la) in enumerate(bounds)), total, bounds


def lexicographic_dp(n_layers, n_devices, stage_ms):
    """A tempting but inexact layer DP: one pass keeping the (max, sum)-least prefix per position."""
    best = {(0, 0): (-math.inf, 0.0, [])}
    for i in range(n_devices):
        for last in range(i + 1, n_layers + 1):
            options = [(max(best[i, f][0], t), best[i, f][1] + t, [*best[i, f][2], (f, last)])
                       for f in range(i, last) if (i, f) in best for t in [stage_ms(i, f, last)]]
            best[i + 1, last] = min(options, key=lambda o: o[:2])
    bottleneck, total, bounds = best[n_devices, n_layers]
    return (bottleneck, total, bounds) if math.isfinite(bottleneck) else None


def test_the_layer_check_rejects_a_dp_that_minimises_the_sum():
    def passes(instance):
        try:
            check_layers(sum_dp, *instance)
        except AssertionError:
            return False
        return True

    instance = find(layer_instances(), lambda inst: not passes(inst), settings=settings(max_examples=2000))
    with pytest.raises(AssertionError):
        check_layers(sum_dp, *instance)
    check_layers(partition_layers, *instance)


def test_the_layer_check_rejects_a_lexicographic_single_pass():
    # devices 0 and 1 on layers [0, 3): (3, 3) has the smaller max, (4, 1) the smaller sum; device 2's fixed
    # 5 then sets the bottleneck, so only the smaller-sum prefix gives the least total (10, not 11)
    table = {(0, 0, 1): 3.0, (1, 1, 3): 3.0, (0, 0, 2): 4.0, (1, 2, 3): 1.0, (2, 3, 4): 5.0}

    def stage_ms(i, first, last):
        return table.get((i, first, last), math.inf)

    assert partition_layers(4, 3, stage_ms) == (5.0, 10.0, [(0, 2), (2, 3), (3, 4)])
    assert lexicographic_dp(4, 3, stage_ms)[1] == 11.0
    with pytest.raises(AssertionError):
        check_layers(lexicographic_dp, 4, 3, stage_ms)


def test_layer_edge_cases():
    def per_layer(i, first, last):
        return (i + 1) * (last - first)

    assert partition_layers(5, 1, per_layer) == (5, 5, [(0, 5)])
    assert partition_layers(1, 1, per_layer) == (1, 1, [(0, 1)])
    assert partition_layers(3, 4, per_layer) is None
    assert partition_layers(3, 0, per_layer) is None
    assert partition_layers(4, 2, lambda i, f, la: math.inf) is None
    # each device holds at most one layer: three layers cannot fit on two devices
    assert partition_layers(3, 2, lambda i, f, la: 1.0 if la - f == 1 else math.inf) is None
    assert partition_layers(2, 2, per_layer) == (2, 3, [(0, 1), (1, 2)])


def test_layer_partition_is_fast_for_80_layers_on_8_devices():
    rng = random.Random(0)
    cost = [[rng.uniform(0.5, 2.0) for _ in range(80)] for _ in range(8)]
    calls = Counter()

    def stage_ms(i, first, last):
        calls[i, first, last] += 1
        return 0.3 + sum(cost[i][first:last])

    start = time.perf_counter()
    bottleneck, total, bounds = partition_layers(80, 8, stage_ms)
    assert time.perf_counter() - start < 2.0  # about 0.02 s; loose so a loaded machine passes
    assert max(calls.values()) == 1 and len(calls) <= 8 * 80 * 81 // 2
    assert len(bounds) == 8 and bounds[-1][1] == 80 and bottleneck <= total


# sequence partition


@st.composite
def seg_functions(draw):
    """T*(s, l) > 0: either a*s + c*s*l + d (the usual shape) or a pseudo-random, non-monotone one."""
    if draw(st.booleans()):
        a, c, d = draw(st.floats(0.01, 5)), draw(st.floats(0, 0.2)), draw(st.floats(0, 10))
        return lambda s, ctx: a * s + c * s * ctx + d
    seed, integral = draw(st.integers(0, 2**30)), draw(st.booleans())

    def noisy(s, ctx):
        v = random.Random((seed * 1_000_003 + s) * 1_000_003 + ctx).uniform(0.1, 10)
        return float(math.ceil(v)) if integral else v  # integers: exact ties between splits

    return noisy


def cut_sets(length, k, b, step):
    """Every valid list of segment ends with exactly k segments."""
    grid = range(step, length, step)
    for cuts in itertools.combinations(grid, k - 1):
        ends = [*cuts, length]
        if k == 1 or all(e - s >= b for s, e in zip([0, *cuts], ends, strict=True)):
            yield ends


def seg_times(ends, seg_ms):
    return [seg_ms(e - s, s) for s, e in zip([0, *ends[:-1]], ends, strict=True)]


def brute_sequence(length, k, seg_ms, b, step):
    """(W, least sum among splits reaching W) over every cut set, or None."""
    found = [(max(t), sum(t)) for t in (seg_times(e, seg_ms) for e in cut_sets(length, k, b, step))]
    if not found:
        return None
    w = min(m for m, _ in found)
    return w, min(s for m, s in found if m <= w + TOL * abs(w))


def check_sequence(solver, length, k, seg_ms, b, step) -> None:
    got, want = solver(length, k, seg_ms, b, step), brute_sequence(length, k, seg_ms, b, step)
    assert (got is None) == (want is None), (got, want)
    if got is None:
        return
    w, ends = got
    assert close(w, want[0]), (got, want)
    assert ends in list(cut_sets(length, k, b, step)), ends
    times = seg_times(ends, seg_ms)
    assert close(max(times), w) and close(sum(times), want[1]), (times, want)


def n_cut_sets(length, k, step):
    return math.comb(max(0, math.ceil(length / step) - 1), k - 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), seg_functions(), st.integers(1, 6), st.integers(1, 4))
def test_partition_sequence_matches_brute_force(length, k, seg_ms, b, step):
    assume(n_cut_sets(length, k, step) <= MAX_CUT_SETS)
    check_sequence(partition_sequence, length, k, seg_ms, b, step)


def test_the_sequence_check_rejects_a_dp_that_minimises_the_sum():
    def wrong(length, k, seg_ms, b, step):
        # the least-sum split in place of the least-bottleneck one
        best = min(cut_sets(length, k, b, step), key=lambda e: sum(seg_times(e, seg_ms)), default=None)
        return None if best is None else (max(seg_times(best, seg_ms)), best)

    def passes(instance):
        try:
            check_sequence(wrong, *instance)
        except AssertionError:
            return False
        return True

    small = st.tuples(st.integers(1, 12), st.integers(1, 4), seg_functions(), st.integers(1, 3), st.integers(1, 2))
    instance = find(small, lambda inst: not passes(inst), settings=settings(max_examples=2000))
    with pytest.raises(AssertionError):
        check_sequence(wrong, *instance)
    check_sequence(partition_sequence, *instance)


def brute_choose(length, n_stages, seg_ms, b, max_k, quantum):
    step = quantum * math.ceil(length / (64 * quantum))
    best = None
    for k in range(1, max_k + 1):
        want = brute_sequence(length, k, seg_ms, b, step)
        if want is not None:
            latency = want[1] + (n_stages - 1) * want[0]
            if best is None or latency < best[1] - TOL * abs(best[1]):
                best = (k, latency)
    return best


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 30), st.integers(1, 6), seg_functions(), st.integers(1, 6), st.integers(1, 6),
       st.integers(1, 3))
def test_choose_segments_picks_the_least_latency(length, n_stages, seg_ms, b, max_k, quantum):
    assume(sum(n_cut_sets(length, k, quantum) for k in range(1, max_k + 1)) <= MAX_CUT_SETS)
    k, ends, latency, w = choose_segments(length, n_stages, seg_ms, b, max_k, quantum)
    want_k, want_latency = brute_choose(length, n_stages, seg_ms, b, max_k, quantum)
    assert k == want_k and close(latency, want_latency), (k, ends, latency, want_k, want_latency)
    assert len(ends) == k and ends in list(cut_sets(length, k, b, quantum))
    times = seg_times(ends, seg_ms)
    assert close(w, max(times)) and close(latency, sum(times) + (n_stages - 1) * w)


def test_choose_segments_coarsens_the_grid_for_long_prompts():
    calls = Counter()

    def seg_ms(s, ctx):
        calls[s, ctx] += 1
        return 0.5 + 0.01 * s + 1e-6 * s * ctx

    start = time.perf_counter()
    k, ends, latency, _ = choose_segments(8192, 9, seg_ms, 16, 20)
    assert time.perf_counter() - start < 2.0  # about 0.02 s
    assert max(calls.values()) == 1 and len(calls) <= 65 * 64 // 2 + 1
    assert ends[-1] == 8192 and all(e % 128 == 0 for e in ends) and 1 < k <= 20
    assert latency < choose_segments(8192, 9, seg_ms, 16, 1)[2]


def test_sequence_edge_cases():
    def linear(s, ctx):
        return float(s)

    assert partition_sequence(5, 1, linear, 10, 4) == (5.0, [5])  # one segment ignores b
    assert partition_sequence(5, 2, linear, 3, 1) is None  # two segments of >= 3 tokens need 6
    assert partition_sequence(5, 6, linear, 1, 1) is None
    assert partition_sequence(8, 2, linear, 1, 4) == (4.0, [4, 8])
    assert partition_sequence(9, 2, linear, 1, 4) == (5.0, [4, 9])  # cuts only on multiples of step
    assert choose_segments(1, 4, linear, 1, 8) == (1, [1], 4.0, 1.0)
    assert choose_segments(100, 4, linear, 200, 8)[0] == 1  # b longer than the prompt: one segment


# min_segment


def test_min_segment_finds_where_the_time_per_token_stops_falling():
    grid = [1, 2, 4, 8, 16, 32]
    assert min_segment(lambda n: max(8.0, float(n)), grid) == 8  # fixed cost until 8 tokens, then linear
    assert min_segment(lambda n: 5.0, grid) == 32  # keeps falling: the last grid point
    assert min_segment(lambda n: 2.0 * n, grid) == 1  # flat from the start
    assert min_segment(lambda n: 5.0, grid, tolerance=0.5) == 1  # halving is exactly the 50% threshold
    assert min_segment(lambda n: max(8.0, float(n)), [32, 4, 8, 1, 16, 2]) == 8
    assert min_segment(lambda n: 1.0, []) == 1
