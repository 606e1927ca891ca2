"""The planner's inputs and whole plans: curves, profile files, memory feasibility, heterogeneous devices."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from model_fixtures import smollm2_folder

from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.timing import model_card
from edgespec.planning.plan import InfeasibleError, PlanOptions, even_plan, make_plan
from edgespec.planning.profile import IDLE_MS, ClusterProfile, Curve, DeviceProfile, LinkProfile, ModelCard
from edgespec.planning.split import even_split

GIB = 2**30
CARD = ModelCard("card", n_layers=12, hidden_size=256, n_heads=4, n_kv_heads=4, head_dim=64, layer_params=10**6,
                 ends_params=5 * 10**6, context=1024)  # 2 MB of weights per layer (bf16)


def curve(scale: float = 1.0) -> Curve:
    return Curve((1, 8, 64), (0, 512), ((1.0, 2.0, 8.0), (2.0, 3.0, 12.0))).scaled(lambda n, c: scale)


def profile(speeds: dict[str, float], capacity: int = GIB, rtt_ms: float = 0.1) -> ClusterProfile:
    workers = [DeviceProfile(name, curve(s), capacity, url=f"http://{name}") for name, s in speeds.items()]
    names = ["controller", *speeds]
    links = [LinkProfile(a, b, rtt_ms, 1e9) for a in names for b in names if a < b]
    controller = DeviceProfile("controller", curve(), 16 * GIB, embed_ms=Curve.constant(0.01),
                               head_ms=Curve.constant(0.5))
    return ClusterProfile(CARD, "bfloat16", controller, workers, links)


def test_curve_interpolates_on_the_grid_and_extrapolates_sensibly():
    c = curve()
    assert c(8) == 2.0 and c(64, 512) == 12.0  # grid points exactly
    assert c(4.5) == pytest.approx(1.5)  # halfway between 1 and 8 tokens
    assert c(128) == pytest.approx(16.0)  # past the last token count: in proportion
    assert c(8, 256) == pytest.approx(2.5)  # halfway between the contexts
    assert c(8, 1024) == pytest.approx(4.0)  # past the last context: the same slope
    assert c(0.5) == 1.0  # below the first token count: its time
    with pytest.raises(ValueError):
        Curve((8, 1), (0,), ((1.0, 2.0),))
    with pytest.raises(ValueError):
        Curve((1, 8), (0,), ((1.0,),))


def test_profile_round_trips_through_json(tmp_path):
    p = profile({"a": 1.0, "b": 2.0})
    p.save(tmp_path / "p.json")
    q = ClusterProfile.load(tmp_path / "p.json")
    assert q == p
    assert q.link("b", "a").rtt_ms == 0.1  # one direction stands for both
    assert q.link("a", "a").transfer_ms(10**9) == 0.0
    with pytest.raises(KeyError):
        q.link("a", "nowhere")
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError, match="version"):
        ClusterProfile.load(tmp_path / "bad.json")


def test_model_card_of_smollm2_counts_its_parameters():
    cfg = ModelConfig.from_folder(smollm2_folder())
    card = model_card(cfg, "smollm2", torch.bfloat16, kv=kv_format("float16"))
    total = card.n_layers * card.layer_params + card.ends_params
    assert 134e6 < total < 136e6  # "135M"; the head is tied to the embedding, so counted once
    assert card.kv_bytes_per_token() == 2 * 3 * 64 * 2
    assert card.activation_bytes(1) == 576 * 2


def test_a_mixtures_card_reads_the_experts_its_rows_choose():
    # Qwen3-30B-A3B: a device holds all 128 experts of a layer, a row reads 8 of them (the roofline's bytes, the
    # FLOPs), many rows nearly all; a dense card reads its whole layer whatever the rows
    from edgespec.model.synth import hf_config, load_shape

    card = model_card(ModelConfig.from_hf_dict(hf_config(load_shape("qwen3-30b-a3b"), 0, 1)), "30b", "q4_1")
    assert (card.n_experts, card.experts_per_token, card.expert_params) == (128, 8, 3 * 2048 * 768)
    one = card.layer_read_params(1)
    assert one == pytest.approx(card.layer_params - 120 * card.expert_params)
    assert card.layer_read_params(2) == pytest.approx(one + 8 * (1 - 8 / 128) * card.expert_params)
    assert card.layer_read_params(1000) == pytest.approx(card.layer_params, rel=1e-6)
    assert card.layer_flops(1, 0) == pytest.approx(2 * one + 4 * card.n_heads * card.head_dim)
    assert CARD.layer_read_params(1) == CARD.layer_read_params(64) == CARD.layer_params


def test_slower_device_gets_fewer_layers_and_the_plan_beats_even():
    p = profile({"fast": 1.0, "slow": 3.0})
    plan, even = make_plan(p), even_plan(p)
    held = {s.device: s.last - s.first for s in plan.stages}
    assert held["fast"] > held["slow"] > 0
    assert plan.bounds()[0][0] == 0 and plan.bounds()[-1][1] == CARD.n_layers
    assert all(a[1] == b[0] for a, b in zip(plan.bounds(), plan.bounds()[1:], strict=False))
    assert plan.bottleneck_ms < even.bottleneck_ms
    assert plan.decode_ms_per_token < even.decode_ms_per_token
    assert even.bounds() == even_split(CARD.n_layers, 2)


def test_device_order_is_chosen_when_links_differ():
    # the controller is far from "b" and near "a": starting the pipeline at "a" saves a slow hop
    p = profile({"b": 1.0, "a": 1.0})
    p.links = [LinkProfile("controller", "a", 0.1, 1e9), LinkProfile("controller", "b", 50.0, 1e9),
               LinkProfile("a", "b", 0.1, 1e9)]
    assert make_plan(p).stages[0].device == "a"
    assert make_plan(p, PlanOptions(search_order=False)).stages[0].device == "b"


def test_memory_bounds_the_placement():
    # each layer: 2 MB of weights + KV 2*4*64*2 B * 1024 tokens = 1 MiB
    per_layer = CARD.layer_weight_bytes() + CARD.kv_bytes_per_token() * 1024
    p = profile({"small": 1.0, "big": 2.0}, capacity=GIB)
    p.workers[0] = DeviceProfile("small", curve(1.0), 3 * per_layer)  # fast, but holds three layers at most
    plan = make_plan(p, PlanOptions(context=1024))
    assert {s.device: s.last - s.first for s in plan.stages}["small"] <= 3
    for s in plan.stages:
        assert s.weight_bytes + s.kv_bytes <= s.capacity_bytes


def test_infeasible_placements_name_the_numbers():
    p = profile({"a": 1.0, "b": 1.0}, capacity=10 * 2**20)
    with pytest.raises(InfeasibleError, match=r"needs 0\.\d+ GiB .* devices offer 0\.02 GiB"):
        make_plan(p, PlanOptions(context=1024))
    # the total fits (5 x 2.9 layers) but not in whole layers (5 x 2)
    per_layer = CARD.layer_weight_bytes() + CARD.kv_bytes_per_token() * 1024
    p = profile({f"d{i}": 1.0 for i in range(5)}, capacity=int(2.9 * per_layer))
    with pytest.raises(InfeasibleError, match="hold only 10 whole layers"):
        make_plan(p, PlanOptions(context=1024))
    with pytest.raises(InfeasibleError, match="no workers"):
        make_plan(profile({}))


def test_one_device_and_more_devices_than_layers():
    one = make_plan(profile({"only": 1.0}))
    assert one.bounds() == [(0, CARD.n_layers)]
    many = make_plan(profile({f"d{i}": 1.0 for i in range(CARD.n_layers + 3)}))
    assert len(many.stages) <= CARD.n_layers
    assert sum(s.last - s.first for s in many.stages) == CARD.n_layers


def test_sequence_cuts_cover_the_prompt():
    plan = make_plan(profile({"a": 1.0, "b": 1.5}), PlanOptions(context=1024, quantum=8))
    assert [sp.bucket for sp in plan.prefill] == [128, 256, 512, 1024]
    for sp in plan.prefill:
        assert sp.cuts[-1] == sp.bucket and list(sp.cuts) == sorted(set(sp.cuts))
        assert sp.predicted_ms >= sp.bottleneck_ms > 0
    for n in (1, 5, 100, 300, 1000, 5000):
        cuts = plan.sequence_cuts(n)
        assert cuts[-1] == n and cuts == sorted(set(cuts)) and cuts[0] >= 1
    assert plan.sequence_cuts(0) == []
    assert not math.isnan(plan.predicted_prefill_ms(300))


def test_stages_on_shared_cores_prefill_in_one_pass_each_in_turn():
    own = profile({"a": 1.0, "b": 1.0})
    shared = ClusterProfile(own.model, own.dtype, own.controller,
                            [dataclasses.replace(w, hardware="host/cpus 0,1") for w in own.workers], own.links)
    apart = make_plan(own, PlanOptions(context=1024))
    together = make_plan(shared, PlanOptions(context=1024))
    assert apart.bounds() == together.bounds()
    assert any(len(sp.cuts) > 1 for sp in apart.prefill)  # separate devices overlap segments
    for sp in together.prefill:
        assert sp.cuts == (sp.bucket,)  # shared cores: nothing overlaps, so one segment
        card = shared.model
        stages = sum((last - first) * shared.device(s.device).layer_ms(sp.bucket, 0)
                     + shared.transfer_ms(s.device, nxt, sp.bucket)
                     for s, (first, last), nxt in zip(together.stages, together.bounds(),
                                                      [x.device for x in together.stages[1:]] + ["controller"],
                                                      strict=True))
        first_hop = shared.transfer_ms("controller", together.stages[0].device, sp.bucket)
        ends = shared.controller.embed_ms(sp.bucket) + shared.controller.head_ms(1)
        assert sp.predicted_ms == pytest.approx(ends + first_hop + stages)  # the stages' sum, not their overlap
        assert card.n_layers == together.stages[-1].last


def test_a_decoding_step_pays_each_idle_receivers_wake_up():
    hot = profile({"a": 3.0, "b": 3.0}, rtt_ms=0.2)  # each stage 36 ms: the others idle past IDLE_MS
    idle = ClusterProfile(hot.model, hot.dtype, hot.controller, hot.workers,
                          [dataclasses.replace(lk, rtt_idle_ms=1.2) for lk in hot.links])
    base, woken = make_plan(hot), make_plan(idle)
    assert base.bounds() == woken.bounds()
    # 3 hops (controller -> a -> b -> controller); each receiver idled past IDLE_MS while the others ran
    step = base.decode_ms_per_token
    assert step > IDLE_MS
    assert woken.decode_ms_per_token == pytest.approx(step + 3 * (1.2 - 0.2) * (1 + hot.margin))
    # a receiver idle for less than IDLE_MS pays that share of the wake-up
    lk = idle.link("a", "b")
    assert lk.transfer_ms(0, 0.0, 0.5) == pytest.approx(0.1 + 0.5)
