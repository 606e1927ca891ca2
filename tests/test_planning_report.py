"""Derived testbed profiles (planning/testbeds.py) and `edgespec plan` (planning/cli.py, planning/report.py).

The reference profile is synthetic: SmolLM2-135M's card with times made of a fixed overhead plus a multiple of
the reference machine's roofline, so the derivation has a known efficiency factor to carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json

import pytest
from rich.console import Console

from edgespec.planning.cli import add_plan_parser, run_plan
from edgespec.planning.plan import GIB, InfeasibleError, PlanOptions, make_plan
from edgespec.planning.profile import ClusterProfile, Curve, DeviceProfile, ModelCard
from edgespec.planning.report import even_baseline, plan_summary, plan_table
from edgespec.planning.testbeds import MODELS_DIR, derive_environment, device_spec, load_card, load_specs, noisy_points
from edgespec.planning.testbeds import main as derive_cli

# SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads of 64, MLP 1536, tied 49152-token embedding
SMOL = ModelCard("SmolLM2-135M", 30, 576, 9, 3, 64, 576 * (576 + 192 + 192 + 576) + 3 * 576 * 1536 + 2 * 576,
                 49152 * 576 + 576, 8192)
TOKENS, CONTEXTS = (1, 4, 16, 64, 256), (0, 512, 2048)


@pytest.fixture(scope="module")
def specs():
    return load_specs()


@pytest.fixture(scope="module")
def cards():
    return {p.stem: load_card(p) for p in MODELS_DIR.glob("*.json")}


@pytest.fixture(scope="module")
def reference(specs):
    ref = device_spec(specs, "reference")

    def roof(nbytes, flops):
        return ref.roofline_ms(nbytes, flops)

    def layer(n, c):  # 0.05 ms of dispatch plus 1.5x the roofline
        nbytes = SMOL.layer_weight_bytes() + SMOL.kv_bytes_per_token() * (c + n)
        return 0.05 + 1.5 * roof(nbytes, SMOL.layer_flops(n, c))

    def curve(f, contexts=CONTEXTS):
        return Curve(TOKENS, contexts, tuple(tuple(f(n, c) for n in TOKENS) for c in contexts))

    head = 49152 * 576
    ctrl = DeviceProfile("controller", curve(layer), 20 * GIB, embed_ms=curve(lambda n, c: 0.02, (0,)),
                         head_ms=curve(lambda n, c: 0.05 + 1.2 * roof(2 * head, 2 * head * n), (0,)))
    return ClusterProfile(SMOL, "bfloat16", ctrl, [], created="synthetic")


@pytest.fixture(scope="module")
def derived(specs, cards, reference):
    return {(env, name): derive_environment(env, card, reference, specs, reference_vocab=49152)
            for env in ("jupiter-a", "jupiter-b", "pi") for name, card in cards.items()}


def test_derived_devices_are_physically_sensible(derived, specs, cards):
    b7 = derived["jupiter-b", "llama-2-7b"]
    nx, tx2, nano = b7.device("nx-1"), b7.device("tx2-1"), b7.device("nano-1")
    assert [w.name for w in b7.workers] == ["nx-1", "tx2-1", "tx2-2", "nano-1"]
    # decoding is memory-bound: per-layer time follows bandwidth (NX 51.2 GB/s < TX2 59.7, Nano 25.6)
    assert tx2.layer_ms(1) < nx.layer_ms(1) < nano.layer_ms(1)
    assert nano.layer_ms(1) / nx.layer_ms(1) == pytest.approx(51.2 / 25.6, rel=0.01)
    # long prefill is compute-bound: the tensor-core NX is far ahead of the TX2
    assert nx.layer_ms(256) < tx2.layer_ms(256) / 3
    # roofline floor: a 7B layer cannot stream its 0.38 GiB of weights faster than the NX's DRAM
    card = cards["llama-2-7b"]
    assert nx.layer_ms(1) >= 1000 * card.layer_weight_bytes() / 51.2e9
    # the Pi is the slowest per layer; context makes every layer slower
    pi = derived["pi", "llama-2-7b"].device("pi-1")
    assert pi.layer_ms(1) > nano.layer_ms(1)
    assert nx.layer_ms(1, 2048) > nx.layer_ms(1, 0)
    # capacities: memory minus reserve; the controller's board also holds the token ends
    ends = int(card.ends_params * 2)
    assert nano.memory_capacity_bytes == int((4.0 - 1.2) * GIB)
    assert tx2.memory_capacity_bytes == int((8.0 - 1.5) * GIB)
    assert nx.memory_capacity_bytes == int((8.0 - 1.5) * GIB) - ends
    assert b7.controller.memory_capacity_bytes == ends
    # links: loopback to the controller's own board, the router elsewhere
    assert b7.link("controller", "nx-1").rtt_ms < b7.link("controller", "tx2-1").rtt_ms == 1.0
    assert b7.link("nano-1", "tx2-2").bandwidth_bytes_per_s == pytest.approx(940e6 / 8)
    assert b7.controller.head_ms(1) > 0 and b7.controller.embed_ms(1) > 0


def test_profiles_round_trip_through_json(derived, tmp_path):
    p = derived["jupiter-a", "llama-2-13b"]
    p.save(tmp_path / "a.json")
    q = ClusterProfile.load(tmp_path / "a.json")
    assert q.model == p.model and q.workers == p.workers and q.links == p.links


def _layers_that_fit(profile: ClusterProfile, context: int) -> int:
    card = profile.model
    per_layer = card.layer_weight_bytes() + card.kv_bytes_per_token() * context
    return sum(w.memory_capacity_bytes // per_layer for w in profile.workers)


@pytest.mark.parametrize("env", ["jupiter-a", "jupiter-b", "pi"])
@pytest.mark.parametrize("name", ["llama-2-7b", "llama-2-13b"])
def test_feasibility_follows_the_memory_arithmetic(derived, env, name):
    profile, options = derived[env, name], PlanOptions(context=2048, buckets=(128,))  # one bucket: fast
    fits = _layers_that_fit(profile, 2048) >= profile.model.n_layers
    if fits:
        plan = make_plan(profile, options)
        assert plan.stages[-1].last == profile.model.n_layers
        assert all(s.weight_bytes + s.kv_bytes <= s.capacity_bytes for s in plan.stages)
    else:
        with pytest.raises(InfeasibleError, match=r"\d+\.\d\d GiB"):
            make_plan(profile, options)


def test_llama_13b_does_not_fit_environment_b_in_fp16(derived):
    # 40 layers x 0.591 GiB of weights + 40 x 2048 x 20 KiB of KV = 25.2 GiB; B offers
    # 3 x 6.5 + 2.8 - 0.61 (the head and embedding on the NX) = 21.7 GiB
    profile = derived["jupiter-b", "llama-2-13b"]
    need = 40 * (profile.model.layer_weight_bytes() + profile.model.kv_bytes_per_token() * 2048) / GIB
    offer = sum(w.memory_capacity_bytes for w in profile.workers) / GIB
    assert need == pytest.approx(25.2, abs=0.05) and offer == pytest.approx(21.7, abs=0.05)
    with pytest.raises(InfeasibleError, match=f"{need:.2f} GiB.*{offer:.2f} GiB"):
        make_plan(profile, PlanOptions(context=2048))


def test_dp_beats_even_on_the_heterogeneous_environment(specs, cards, reference, derived):
    # In fp16 the even split (8 layers each) does not fit the Nano: 8 x 0.41 GiB > 2.8 GiB
    options = PlanOptions(context=2048, buckets=(128, 512))
    even, why = even_baseline(derived["jupiter-b", "llama-2-7b"], options)
    assert even is None and "nano-1" in why and "2.80 GiB" in why
    # with int8 weights it fits, and the DP is faster: the Nano is half as fast and gets fewer layers
    card = dataclasses.replace(cards["llama-2-7b"], weight_bytes_per_param=1.0)
    profile = derive_environment("jupiter-b", card, reference, specs, reference_vocab=49152)
    dp, (even, why) = make_plan(profile, options), even_baseline(profile, options)
    assert why == "" and even is not None
    assert dp.bottleneck_ms < even.bottleneck_ms
    assert dp.decode_ms_per_token <= even.decode_ms_per_token * 1.0001
    summary = plan_summary(dp, even)
    assert summary["ratios"]["bottleneck_ms"] < 1
    json.dumps(summary, allow_nan=False)
    console = Console(file=io.StringIO(), width=160)
    console.print(plan_table(dp, even))
    text = console.file.getvalue()
    assert all(s.device in text for s in dp.stages) and "even split" in text and "DP/even" in text


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="edgespec")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    return run_plan(parser.parse_args(argv))


def test_plan_cli_json_and_png(derived, tmp_path, capsys):
    path, png = tmp_path / "b7.json", tmp_path / "b7.png"
    derived["jupiter-b", "llama-2-7b"].save(path)
    assert _run(["plan", "--profile", str(path), "--json", "--png", str(png), "--context", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    stages = out["stages"]
    assert stages[0]["first"] == 0 and stages[-1]["last"] == 32
    assert all(a["last"] == b["first"] for a, b in itertools.pairwise(stages))
    assert out["options"]["context"] == 1024 and "even split does not fit: nano-1" in out["even"]["note"]
    assert png.stat().st_size > 1000
    assert _run(["plan", "--profile", str(path), "--no-compare-even"]) == 0
    assert "ms/token" in capsys.readouterr().out


def test_plan_cli_infeasible_exits_2_with_gib(derived, tmp_path, capsys):
    path = tmp_path / "b13.json"
    derived["jupiter-b", "llama-2-13b"].save(path)
    assert _run(["plan", "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgespec plan: ") and "GiB" in err
    assert _run(["plan", "--profile", str(tmp_path / "missing.json")]) == 2


def test_testbeds_cli_writes_named_profiles(reference, tmp_path, capsys):
    ref = tmp_path / "ref.json"
    reference.save(ref)
    assert derive_cli(["--reference", str(ref), "--out", str(tmp_path / "out"), "--envs", "jupiter-b",
                          "--models", str(MODELS_DIR / "llama-2-7b.json"), "--weight-bytes", "1"]) == 0
    profile = ClusterProfile.load(tmp_path / "out" / "jupiter-b-llama-2-7b-w1.json")
    assert profile.model.weight_bytes_per_param == 1.0 and len(profile.workers) == 4
    assert "DP" in capsys.readouterr().out


def test_noisy_reference_points_are_found():
    curve = Curve((1, 4), (0, 512), ((5.0, 1.0), (1.2, 1.5)))  # (1, 0) took 5 ms, more than (4, 512)
    assert noisy_points(curve) == [(1, 0)]
