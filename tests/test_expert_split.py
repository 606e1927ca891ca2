"""A layer whose experts are placed on several devices (model/expert_split.py) gives the bits of the layer held
whole: its rows' routes, each device's weighted outputs of the slots it holds, and the sum in ascending expert
order where the router is; in float32 and in the 4-bit format, for a prompt, a tree's verification pass and a
batch step of two sequences. An expert host refuses what it does not hold and malformed rows."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import pytest
import torch
from model_fixtures import tiny_mixture_gguf

from edgespec.bench.gguf_writer import tiny_model
from edgespec.model.blocks import SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.expert_split import ExpertShelf, LocalExperts
from edgespec.model.linear import as_format
from edgespec.model.stack import LayerStack
from edgespec.model.weights import open_source

SHAPE = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}
# layer 0: two experts on "b"; layer 1 (dense: mlp_only_layers) whole; layer 2: experts on "b" and on "c"
AWAY = {0: {"b": [1, 5]}, 2: {"b": [0, 2, 3], "c": [7]}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model("qwen3_moe", tmp_path_factory.mktemp("split"), 3, SHAPE, mlp_only_layers=[1])


def shelves(folder: Path, weights: str, away: Mapping[int, Mapping[str, Sequence[int]]]) -> LocalExperts:
    """The other devices of `away`, in this process."""
    cfg, src = ModelConfig.from_folder(folder), open_source(folder)
    devices = {d for a in away.values() for d in a}
    return LocalExperts({d: ExpertShelf(src, cfg, as_format(weights), {layer: a[d] for layer, a in away.items()
                                                                       if d in a}) for d in devices})


def passes(stack: LayerStack) -> list[torch.Tensor]:
    """A prompt, a tree's verification pass after it, and a batch step of two sequences: each pass's output."""
    torch.manual_seed(0)
    h = stack.cfg.hidden_size
    cache, a, b = stack.new_cache(32), stack.new_cache(32), stack.new_cache(32)
    prompt = stack(torch.randn(1, 9, h), torch.arange(9)[None], cache, 0)
    mask = torch.tril(torch.ones(4, 13, dtype=torch.bool), diagonal=9)
    mask[3, 11] = False  # a branch: row 3 does not see row 2
    tree = stack(torch.randn(1, 4, h), torch.tensor([[9, 10, 10, 11]]), cache, 9, mask[None])
    batch = stack.forward_rows(torch.randn(7, h), torch.cat([torch.arange(4), torch.arange(3)]),
                               [SeqRows(a, 0, 4, None), SeqRows(b, 0, 3, None)])
    return [prompt, tree, batch]


@pytest.mark.parametrize("weights", ["float32", "q4_1"])
def test_experts_placed_apart_give_the_bits_of_the_layer_held_whole(folder, weights):
    cfg = ModelConfig.from_folder(folder)
    whole = LayerStack.load(open_source(folder), cfg, 0, cfg.n_layers, weights)
    links = shelves(folder, weights, AWAY)
    split = LayerStack.load(open_source(folder), cfg, 0, cfg.n_layers, weights, away=AWAY, links=links)
    assert split.layers[0].ffn.held == (0, 2, 3, 4, 6, 7) and split.layers[2].ffn.held == (1, 4, 5, 6)
    assert len(split.runs) == 3  # each split layer apart, the dense one compiled between them
    for ours, theirs in zip(passes(split), passes(whole), strict=True):
        assert torch.equal(ours, theirs)
    assert {d for d, _, _ in links.calls} == {"b", "c"}  # the rows reached the other devices


def test_an_expert_host_refuses_what_it_does_not_hold(folder):
    cfg = ModelConfig.from_folder(folder)
    shelf = ExpertShelf(open_source(folder), cfg, as_format("float32"), {0: [1, 5]})
    rows, chosen, weights = torch.randn(2, cfg.hidden_size), torch.tensor([[1, 2], [5, 1]]), torch.rand(2, 2)
    assert shelf.partials(0, rows, chosen, weights).shape == (3, cfg.hidden_size)  # slots holding 1 or 5
    with pytest.raises(KeyError, match="no experts of layer 2"):
        shelf.partials(2, rows, chosen, weights)
    with pytest.raises(ValueError, match="ids of the 8"):
        shelf.partials(0, rows, torch.tensor([[1, 9], [5, 1]]), weights)
    with pytest.raises(ValueError, match="rows must be float"):
        shelf.partials(0, rows[:, :10], chosen, weights)
    with pytest.raises(ValueError, match="layer 1 has no experts"):
        ExpertShelf(open_source(folder), cfg, as_format("float32"), {1: [0]})  # the dense layer


@pytest.mark.slow
def test_a_mixture_whose_whole_layers_do_not_fit_serves_with_experts_placed_apart(tmp_path):
    """Over three local workers whose budgets each hold one whole layer of four and a bit more: the planner places
    some experts away from their layers, the workers hold and call them, and the stream is the tokens of the same
    file served whole in one process; the dashboard counts each device's experts."""
    from processes import start_server, stream_text, wait_all_back, workers

    # experts of 256 over a width of 256 in Q4_1: about 1.6 MB a layer with its KV for 256 tokens; 2.5 MB a worker
    gguf = tiny_mixture_gguf(tmp_path)
    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    whole, url = start_server(tmp_path, "whole", "--model", str(gguf), "--weights", "q4_1", env=env)
    try:
        want, _ = stream_text(url, "naive", max_tokens=40, min_tokens=40)
    finally:
        whole.stop()
    proc, url = start_server(tmp_path, "split", "--model", str(gguf), "--weights", "q4_1", "--local-workers", "3",
                             "--worker-threads", "1", "--worker-memory-budget-gib", "0.0023", "--plan-context", "256",
                             "--plan-concurrency", "1", env=env)
    try:
        wait_all_back(url, 3)
        assert all(len(range(*w["layers"])) < 3 for w in workers(url))
        devices = [d for d in httpx.get(url + "/dashboard/state", timeout=30).json()["devices"]
                   if d["role"] == "worker"]
        assert sum(d["experts"] for d in devices) == 4 * 8  # each expert held once
        own = [8 * sum(r["last"] - r["first"] for r in d["layers"]) for d in devices]
        assert [d["experts"] for d in devices] != own  # some of a layer's experts are on another worker
        got, payloads = stream_text(url, "naive", max_tokens=40, min_tokens=40)
        assert not any("error" in p for p in payloads)
        assert got == want
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_lost_worker_is_replaced_by_experts_placed_apart(tmp_path):
    """Four local workers each holding one whole layer of four and half a layer's room more: one killed
    mid-stream leaves room for every layer only with experts apart, the planner places them so, and the stream
    goes on with the same tokens."""
    from processes import start_server, stream_text, wait_all_back, worker_pid, workers

    gguf = tiny_mixture_gguf(tmp_path)
    proc, url = start_server(tmp_path, "moe", "--model", str(gguf), "--weights", "q4_1", "--local-workers", "4",
                             "--worker-threads", "1", "--worker-memory-budget-gib", "0.0019", "--plan-context", "256",
                             "--plan-concurrency", "1", "--stage-timeout-s", "4", "--recover-probe-s", "2",
                             "--monitor-interval-s", "0.5", "--log-level", "info",
                             env={"EDGESPEC_CACHE": str(tmp_path / "cache")})
    try:
        wait_all_back(url, 4)
        assert all(len(range(*w["layers"])) == 1 for w in workers(url))  # whole layers, one each
        want, _ = stream_text(url, "naive", max_tokens=40, min_tokens=40)
        victim = worker_pid(proc.proc.pid, workers(url)[1]["url"])
        killed = []
        got, payloads = stream_text(url, "naive", lambda i: i == 5 and killed.append(os.kill(victim, signal.SIGKILL)),
                                    max_tokens=40, min_tokens=40)
        assert killed and not any("error" in p for p in payloads)
        assert got == want
        assert "'s experts [" in (tmp_path / "moe.log").read_text()  # three workers held them with experts apart
    finally:
        proc.stop()


def test_a_worker_answers_calls_for_the_experts_it_holds_and_refuses_the_rest(folder):
    """A worker holding layer 0 and experts 2 and 6 of layer 2 (the tiny mixture's), over its link: an `experts`
    call gets the weighted outputs of the slots it holds, what the experts compute in this process; a call for
    another layer, malformed rows or ids, or a body that is no tensors gets a 4xx ack; every call is answered."""
    from inprocess import LoopClient, on_link

    from edgespec.workers.app import create_worker_app
    from edgespec.workers.frames import pack
    from edgespec.workers.settings import WorkerSettings
    from edgespec.workers.wire import decode, encode

    cfg = ModelConfig.from_folder(folder)
    settings = WorkerSettings(port=0, token="t", model=str(folder), memory_budget_gib=0.25)
    client = LoopClient(create_worker_app(settings), headers={"authorization": "Bearer t"})
    try:
        r = client.post("/assign", json={"first": 0, "last": 1, "dtype": "float32", "hosted": {"2": [2, 6]}})
        assert r.status_code == 200 and r.json()["holds"]["experts"] == {"own": 8, "hosted": 2}
        assert client.post("/assign", json={"first": 0, "last": 1, "hosted": {"0": [1]}}).status_code == 400
        torch.manual_seed(0)
        rows, weights = torch.randn(3, cfg.hidden_size), torch.rand(3, 2)
        chosen = torch.tensor([[2, 0], [5, 6], [6, 2]])
        body = encode({"rows": rows, "chosen": chosen, "weights": weights})
        bad = [({"layer": 0}, body), ({"layer": 2}, encode({"rows": rows[:, :5], "chosen": chosen,
                                                             "weights": weights})),
               ({"layer": 2}, encode({"rows": rows, "chosen": chosen + 8, "weights": weights})),
               ({"layer": 2}, b"not tensors"), ({"layer": -1}, body)]
        sent = on_link(client, pack({"op": "experts", "id": 1, "layer": 2}, body),
                       *[pack({"op": "experts", "id": i + 2, **h}, b) for i, (h, b) in enumerate(bad)])
        assert [h["id"] for h, _ in sent] == list(range(1, len(bad) + 2))
        assert sent[0][0]["ok"]
        shelf = ExpertShelf(open_source(folder), cfg, as_format("float32"), {2: [2, 6]})
        assert torch.equal(decode(sent[0][1], ("out",))["out"], shelf.partials(2, rows, chosen, weights))
        for header, _ in sent[1:]:
            assert not header.get("ok") and 400 <= header["status"] < 500, header
    finally:
        client.close()
