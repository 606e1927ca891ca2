"""The HeadSplit simulator (bench/headsplit_sim.py, no model): block scaling, and the three modes' timelines
on hand-checkable cases."""

from __future__ import annotations

import pytest

from edgespec.bench.headsplit_sim import (
    block_costs,
    depth_alphas,
    layer_based_ms,
    predict_setting,
    scaled_blocks,
    timeline_ms,
)
from edgespec.planning.headsplit import HeadDevice, LayerPlace
from edgespec.planning.profile import ModelCard
from edgespec.planning.testbeds import DeviceSpec

CARD = ModelCard("m", n_layers=3, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16, layer_params=40_000,
                 ends_params=10_000, context=256)
SPEC = DeviceSpec("d", "d", 8.0, 1.0, 10.0, 100.0)


def test_blocks_scale_by_their_measured_efficiency():
    ref_times = {block: 3 * SPEC.roofline_ms(*cost) for block, cost in block_costs(CARD, 0).items()}
    # the same card on the same device: the measured times come back
    assert scaled_blocks(ref_times, CARD, SPEC, CARD, SPEC, 0) == pytest.approx(ref_times)
    # faster than the roofline is clamped to it (e >= 1)
    fast = {block: t / 10 for block, t in ref_times.items()}
    want = {block: SPEC.roofline_ms(*cost) for block, cost in block_costs(CARD, 0).items()}
    assert scaled_blocks(fast, CARD, SPEC, CARD, SPEC, 0) == pytest.approx(want)


def devices(group_ms=1.0, proj_ms=0.1, ffn_ms=4.0):
    return {n: HeadDevice(n, group_ms, proj_ms, ffn_ms, 10**9) for n in ("a", "b")}


def layers(speculate: bool) -> list[LayerPlace]:
    return [LayerPlace({"a": [0], "b": [1]}, "a", "b", speculate and i > 0) for i in range(3)]


def test_head_level_timeline_by_hand():
    hop = 0.5

    def link(x, y):
        return 0.0 if x == y else hop

    # layer 0: X at a (controller) -> groups on a (1.0) and b (0.5 + 1.0 + 0.5 back) -> 2.0, + proj 0.1 = 2.1;
    # Z at a -> FFN on b: + 0.5 + 4.0 = 6.6. Later layers start from X at b: a's group 0.5 + 1.0 = 1.5,
    # b's 1.0 + 0.5 = 1.5, X to a 0.5: Z = 6.6 + 1.5 + 0.1 = 8.2; X = 8.2 + 4.5 = 12.7; then 18.8; back: 19.3
    got = timeline_ms(layers(False), devices(), link, [0.0] * 3, "a", ends_ms=0.0)
    assert got == pytest.approx(19.3)
    assert layer_based_ms(CARD, {"group_ms": 1.0, "proj_ms": 0.1, "ffn_ms": 4.0}, 2, hop, 0.0) == \
        pytest.approx(3 * (2 * 1.0 + 0.1 + 4.0) + 2 * hop)


def test_speculation_helps_in_proportion_to_alpha():
    link = lambda x, y: 0.0 if x == y else 0.5  # noqa: E731
    three = {**devices(), "c": HeadDevice("c", 1.0, 0.1, 4.0, 10**9)}
    plan = [LayerPlace({"a": [0], "c": [1]}, "a", "b", i > 0) for i in range(3)]  # groups off the FFN device
    plain = [LayerPlace(lp.groups, lp.proj, lp.ffn) for lp in plan]
    head = timeline_ms(plain, three, link, [0.0] * 3, "a", 0.0)
    by_alpha = [timeline_ms(plan, three, link, [a] * 3, "a", 0.0) for a in (0.0, 0.5, 1.0)]
    # head-level: Z0 = 2.1 at a, X0 = 6.6 at b; Z1 = 6.6 + 0.5 + 1.0 + 0.5 + 0.1 = 8.7, X1 = 13.2; Z2 = 15.3,
    # X2 = 19.8; back at a 20.3
    assert head == pytest.approx(20.3) and by_alpha[0] == pytest.approx(head)
    # alpha 1: layer 1's groups start on Z0 at 2.1 and are done by 4.1, so Z1 waits only for X0 at a (7.1):
    # 7.2, X1 = 11.7; Z2 = 12.3, X2 = 16.8; back at a 17.3
    assert by_alpha[2] == pytest.approx(17.3)
    assert by_alpha[1] == pytest.approx((by_alpha[0] + by_alpha[2]) / 2, abs=0.6) and by_alpha[2] < by_alpha[1] < head


def test_alpha_mapped_by_relative_depth():
    assert depth_alphas([0.0, 1.0], 3) == pytest.approx([0.0, 0.5, 1.0])
    profiled = [0.0, 0.0] + [0.8 + 0.005 * i for i in range(28)]  # 30 layers, as SmolLM2's profile
    mapped = depth_alphas(profiled, 22)
    assert len(mapped) == 22 and mapped[0] == 0.0 and mapped[-1] == pytest.approx(profiled[-1])
    assert mapped == sorted(mapped)  # a rising profile stays rising
    assert depth_alphas([0.0, 0.9, 0.9, 0.9], 8)[3:] == pytest.approx([0.9] * 5)
    assert depth_alphas([], 4) == [0.0] * 4 and depth_alphas([0.3], 2) == [0.3, 0.3]


def test_measured_setting_predicted_with_a_controller_of_its_own():
    blocks = {"group_ms": 1.0, "proj_ms": 0.1, "ffn_ms": 4.0}
    plan = layers(False)  # groups a:[0], b:[1]; projection at a, FFN at b
    got = predict_setting(CARD, blocks, ["a", "b"], 0.5, 0.0, {"head": (plan, [0.0] * 3, True),
                                                               "star": (plan, [0.0] * 3, False)})
    # layer-based: 3 layers of 6.1 ms and the chain controller -> a -> b -> controller, three messages
    assert got["layer"] == pytest.approx(3 * 6.1 + 3 * 0.5)
    # gathered at a: as the hand-checked timeline above, the controller's X reaching a's groups one message
    # later (0.5 + 1.0 = 1.5, under b's 2.0): 19.3
    assert got["head"] == pytest.approx(19.3)
    # the controller gathers: a's groups now also send their partial back (2.0); layer 1 and 2's residual comes
    # from b to the controller: Z1 = 6.6 + 2.0 + 0.1 = 8.7, X1 = 13.2, X2 = 19.8, back 20.3
    assert got["star"] == pytest.approx(20.3)
