"""HeadSplit placement (planning/headsplit.py, no model): the speculation test, the preliminary decision,
memory limits, the timing constraint of a speculating layer, and FFN blocks spread by load."""

from __future__ import annotations

import itertools

import pytest

from edgespec.planning.headsplit import (
    HeadCard,
    HeadDevice,
    InfeasibleError,
    attention_ms,
    place,
    speculating_layers,
    worthwhile,
)

CARD = HeadCard(n_layers=4, n_groups=4, group_bytes=100, group_kv_bytes_per_token=1, proj_bytes=50, ffn_bytes=400,
                activation_bytes=8)


def link(ms: float = 1.0):
    return lambda a, b: 0.0 if a == b else ms


def devices(n: int, capacity: int = 10_000, group_ms: float = 2.0, ffn_ms: float = 10.0) -> list[HeadDevice]:
    return [HeadDevice(f"d{i}", group_ms, 0.5, ffn_ms, capacity) for i in range(n)]


@pytest.mark.parametrize("alpha, ffn, attn, want", [
    (0.9, 10.0, 4.0, True),  # 4 - 0.1 * 4 > 0
    (0.69, 10.0, 4.0, False),  # below alpha_min
    (0.7, 1.0, 4.0, False),  # min(1, 4) - 0.3 * 4 = -0.2: the FFN hides too little of a likely redo
    (0.8, 1.0, 4.0, True),  # 1 - 0.2 * 4 = 0.2
])
def test_the_speculation_test(alpha, ffn, attn, want):
    assert worthwhile(alpha, ffn, attn) is want


def test_layers_speculate_where_alpha_is_high_and_never_the_first():
    got = speculating_layers(devices(3), CARD, [0.99, 0.95, 0.5, 0.8], link())
    assert got == [False, True, False, True]


def test_every_block_is_placed_within_memory():
    # d0 can hold only a few groups: the rest go elsewhere; every group of every layer is placed once
    devs = [HeadDevice("d0", 1.0, 0.5, 10.0, 350), *devices(2)[1:], HeadDevice("d2", 2.0, 0.5, 10.0, 10_000)]
    layers = place(devs, CARD, [0.9] * 4, link(), context=50)
    used = {d.name: 0 for d in devs}
    for lp in layers:
        assert sorted(g for gs in lp.groups.values() for g in gs) == list(range(CARD.n_groups))
        used[lp.ffn] += CARD.ffn_bytes
        used[lp.proj] += CARD.proj_bytes
        for d, gs in lp.groups.items():
            used[d] += len(gs) * (CARD.group_bytes + 50 * CARD.group_kv_bytes_per_token)
    assert all(used[d.name] <= d.capacity_bytes for d in devs)
    assert used["d0"] > 0  # it did take what fitted


def test_too_little_memory_is_infeasible():
    with pytest.raises(InfeasibleError):
        place(devices(2, capacity=500), CARD, [0.9] * 4, link(), context=50)


def test_a_speculating_layer_passes_the_speculation_test_on_its_placement():
    layers = place(devices(4), CARD, [0.9] * 4, link(), context=10)
    by_name = {d.name: d for d in devices(4)}
    for prev, lp in itertools.pairwise(layers):
        if lp.speculate:
            assert worthwhile(0.9, by_name[prev.ffn].ffn_ms, attention_ms(lp.groups, by_name, lp.proj, link()))
    assert any(lp.speculate for lp in layers)
    # an FFN too short to hide enough of the attention: no layer may speculate, though alpha is high
    slow = devices(4, group_ms=20.0, ffn_ms=3.0)
    assert not any(lp.speculate for lp in place(slow, CARD, [0.8] * 4, link(), context=10))  # 3 - 0.2 * 22 < 0


def test_groups_spread_to_cut_the_layer_attention_time_and_ffns_by_load():
    layers = place(devices(4), CARD, [0.0] * 4, link(0.0), context=10)
    assert all(max(map(len, lp.groups.values())) == 1 for lp in layers)  # 4 groups over 4 equal devices
    assert len({lp.ffn for lp in layers}) == 4  # the FFNs go to the least-loaded device each time


def test_a_speculating_layer_keeps_its_groups_off_the_busy_ffn_device():
    layers = place(devices(3), CARD, [0.9] * 4, link(), context=10)
    for prev, lp in itertools.pairwise(layers):
        if lp.speculate:
            assert prev.ffn not in lp.groups
    assert any(lp.speculate for lp in layers)


def test_projection_stays_put_and_a_layer_that_cannot_speculate_is_placed_as_a_plain_one():
    # The preliminary placement (two 2 ms groups per device, 5 ms links: 14 ms of attention) lets layers
    # speculate behind a 1.6 ms FFN (1.6 - 0.1 * 14 > 0). Placed, the FFNs sit with the projection (no round
    # trip) and a speculating layer's four groups would have to leave that busy device: 8 + 10 ms, and
    # 1.6 - 0.1 * 18 < 0. So every layer is placed plain, all four groups at the projection device (8 ms).
    devs = {d.name: d for d in devices(2, ffn_ms=1.6)}
    assert speculating_layers(list(devs.values()), CARD, [0.9] * 4, link(5.0)) == [False, True, True, True]
    layers = place(list(devs.values()), CARD, [0.9] * 4, link(5.0), context=10)
    assert len({lp.proj for lp in layers}) == 1 and not any(lp.speculate for lp in layers)
    assert all(lp.groups == {lp.proj: [0, 1, 2, 3]} and lp.ffn == lp.proj for lp in layers)
