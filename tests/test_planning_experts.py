"""Expert placement (planning/experts.py): a mixture whose whole layers do not fit the devices, though its total
does, is placed with the fewest, least used experts away from their layers, gathered in the layers that already
call out, each layer's on the nearest device with room; every device within its capacity; a model that fits keeps
every expert with its layer; the routing frequencies measured over calibration text (model/routing.py)."""

from __future__ import annotations

import dataclasses

import pytest

from edgespec.bench.gguf_writer import tiny_model
from edgespec.model.config import ModelConfig
from edgespec.model.routing import expert_use
from edgespec.model.source import resolve_model
from edgespec.planning.experts import expert_bytes, shed
from edgespec.planning.plan import InfeasibleError, PlanOptions, make_plan
from edgespec.planning.profile import ClusterProfile, Curve, DeviceProfile, LinkProfile, ModelCard

# 8 layers of 16 experts, 2 a token: each expert 0.75 MB (bf16), a layer 12.5 MB of experts + 2 MB of the rest
CARD = ModelCard("mixture", n_layers=8, hidden_size=256, n_heads=4, n_kv_heads=4, head_dim=64,
                 layer_params=16 * 3 * 256 * 512 + 10**6, ends_params=5 * 10**6, context=1024, n_experts=16,
                 experts_per_token=2, expert_params=3 * 256 * 512)
OPTIONS = PlanOptions(context=256, search_order=False)
MB = 10**6


def profile(capacities: dict[str, float], card: ModelCard = CARD, rtt: dict[tuple[str, str], float] | None = None
            ) -> ClusterProfile:
    curve = Curve((1, 8), (0, 512), ((1.0, 2.0), (1.5, 2.5)))
    workers = [DeviceProfile(n, curve, int(c * MB), url=f"http://{n}") for n, c in capacities.items()]
    names = ["controller", *capacities]
    links = [LinkProfile(a, b, (rtt or {}).get((a, b), 0.5), 1e9) for a in names for b in names if a < b]
    return ClusterProfile(card, "bfloat16", DeviceProfile("controller", curve, 16 * 2**30), workers, links)


def layer_bytes(card: ModelCard = CARD) -> int:
    return card.layer_weight_bytes() + card.kv_bytes_per_token() * OPTIONS.context


def test_a_model_that_fits_keeps_every_expert_with_its_layer():
    plan = make_plan(profile({"a": 70, "b": 70}), OPTIONS)
    assert all(not s.away and not s.hosted for s in plan.stages)


def test_whole_layers_that_do_not_fit_shed_the_least_used_experts_to_devices_with_room():
    whole = layer_bytes() / MB  # about 14.8 MB
    # 8.5 layers' room in all, but 3 + 2 + 1 whole layers
    caps = {"a": 3.8 * whole, "b": 2.8 * whole, "c": 1.9 * whole}
    with pytest.raises(InfeasibleError):
        make_plan(profile(caps, dataclasses.replace(CARD, n_experts=0, experts_per_token=0)), OPTIONS)
    use = [[0.125] * 16 for _ in range(8)]
    use[1][9] = use[4][2] = use[4][11] = 0.01  # rarely chosen experts (the rest 0.125: 2 of 16)
    card = dataclasses.replace(CARD, expert_use=tuple(map(tuple, use)))
    plan = make_plan(profile(caps, card), OPTIONS)
    size = expert_bytes(card)
    for s in plan.stages:
        held = (s.last - s.first) * layer_bytes(card) \
            - size * sum(len(ids) for w in s.away.values() for ids in w.values()) \
            + size * sum(map(len, s.hosted.values()))
        assert held <= s.capacity_bytes, s
        assert s.weight_bytes + s.kv_bytes == held
    away = {layer: where for s in plan.stages for layer, where in s.away.items()}
    assert away, "some experts go apart"
    shed_ids = {(layer, e) for layer, where in away.items() for ids in where.values() for e in ids}
    cold = {(1, 9), (4, 2), (4, 11)}
    stage_of = {layer: s.device for s in plan.stages for layer in range(s.first, s.last)}
    for layer, where in away.items():
        assert stage_of[layer] not in where  # away means on another device
        assert len(where) == 1  # a layer's experts together: one round trip
        if any(stage_of[c[0]] == stage_of[layer] for c in cold):  # the stage's cold experts go first
            assert {c for c in cold if stage_of[c[0]] == stage_of[layer]} <= shed_ids
    hosted = {(layer, e) for s in plan.stages for layer, ids in s.hosted.items() for e in ids}
    assert hosted == shed_ids  # each shed expert held by exactly one other device
    # the wait for them is in the prediction
    bare = sum(s.ms_per_token for s in plan.stages)
    assert bare > sum((s.last - s.first) * 1.0 for s in plan.stages)


def test_the_greedy_gathers_shed_experts_in_the_layers_that_call_out_already():
    # equal use: a second away expert of a layer costs less than a first one of another layer
    assert shed(CARD, 0, 4, 3) == {3: [13, 14, 15]}
    use = tuple(tuple(0.5 if e == 0 else 0.1 for e in range(16)) for _ in range(8))
    assert shed(dataclasses.replace(CARD, expert_use=use), 0, 2, 2) == {1: [14, 15]}  # expert 0 is hot


def test_a_nearer_device_takes_the_experts():
    whole = layer_bytes() / MB
    caps = {"a": 3.6 * whole, "b": 2.5 * whole, "c": 2.5 * whole}
    near = {("a", "c"): 0.05, ("a", "b"): 5.0}
    plan = make_plan(profile(caps, rtt=near), OPTIONS)
    a = next(s for s in plan.stages if s.device == "a")
    assert {d for w in a.away.values() for d in w} == {"c"}  # b has the room too, 100 times farther


def test_routing_frequencies_are_measured_layer_by_layer(tmp_path):
    shape = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "max_position_embeddings": 512, "tie_word_embeddings": False}
    folder = tiny_model("qwen3_moe", tmp_path, 1, shape, mlp_only_layers=[1])
    cfg = ModelConfig.from_folder(folder)
    use = expert_use(resolve_model(str(folder)), "q4_1")
    assert len(use) == 3 and use[1] == ()  # the dense layer has none
    for row in (use[0], use[2]):
        assert len(row) == cfg.n_experts and sum(row) == pytest.approx(cfg.experts_per_token)
        assert max(row) > min(row)  # the text's tokens do not choose evenly


def test_more_context_past_the_memory_threshold_sheds_more_experts():
    """The re-plan on the memory threshold (server/replanner.py) plans for a longer context: more KV on each
    device, so more experts go apart, and none past the point where the total no longer fits."""
    whole = layer_bytes() / MB
    caps = {"a": 3.8 * whole, "b": 2.8 * whole, "c": 1.9 * whole}

    def away(context: int) -> int:
        plan = make_plan(profile(caps), dataclasses.replace(OPTIONS, context=context))
        return sum(len(ids) for s in plan.stages for w in s.away.values() for ids in w.values())

    assert 0 < away(256) < away(512)
    with pytest.raises(InfeasibleError):
        away(8192)
