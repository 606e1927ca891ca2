"""Qwen3-MoE's mixture of experts (model/ffn.py's Experts) beyond test_architectures' all-sparse model: a dense
layer among sparse ones (mlp_only_layers) equals transformers; the router's choice and a row's output do not
depend on the rows beside it (alone, in a batch step of several sequences, in the 4-bit format); the config's
sparse layers are transformers'; a tiny one serves a chat completion, and over two worker processes one of which is
killed mid-stream gives the same text; llama.cpp reads the GGUF written as its
converter writes one (experts stacked in ffn_*_exps) to the logits edgespec reads from it; and each expert's rows
of a quantized stack are what gguf-py reads."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from inprocess import LoopClient, controller_app, serves_a_chat_completion
from model_fixtures import llama_cpp_logits, load_blocks, load_reference, tiny_mixture_gguf

from edgespec.bench.gguf_writer import tiny_model, write_gguf
from edgespec.model.blocks import CompiledLayers, SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.ffn import Experts
from edgespec.model.quant import dequantized
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack
from edgespec.model.weights import open_source

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"), 0, SHAPE, mlp_only_layers=[1])


def test_a_dense_layer_among_sparse_ones_equals_transformers(folder):
    ids = list(range(200, 230))
    ours = load_blocks(folder).logits_from_scratch(ids)
    with torch.inference_mode():
        theirs = load_reference(folder)(torch.tensor([ids])).logits[0].float()
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_sparse_layers_are_transformers(folder):
    cfg = ModelConfig.from_folder(folder)  # mlp_only_layers [1]: the second layer dense
    assert (cfg.n_experts, cfg.experts_per_token, cfg.expert_size, cfg.norm_topk_prob) == (8, 2, 32, True)
    assert cfg.sparse_layers == (True, False)
    d = json.loads((folder / "config.json").read_text())
    d.update(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)
    assert ModelConfig.from_hf_dict(d).sparse_layers == (False, True, False, True)


@pytest.mark.parametrize("weights", ["float32", "q4_1"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(folder, weights):
    cfg = ModelConfig.from_folder(folder)
    stack = LayerStack.load(open_source(folder), cfg, 0, cfg.n_layers, weights)
    moe = stack.layers[0].ffn
    assert isinstance(moe, Experts)
    assert len(stack.runs) == 1 and isinstance(stack.runs[0], CompiledLayers)  # the stack in one call (ffn.cpp)
    torch.manual_seed(0)
    rows = torch.randn(9, cfg.hidden_size)
    together = moe(rows[None])[0]
    chosen, _ = moe.route(rows)
    assert len(chosen.unique()) > 2  # the rows spread over the experts
    for i in range(len(rows)):
        assert torch.equal(moe(rows[None, i:i + 1])[0], together[i:i + 1]), i
    # a batch step of three sequences gives each the bits of its own pass
    prompts = [torch.randn(1, n, cfg.hidden_size) for n in (5, 1, 3)]
    alone = []
    for p in prompts:
        cache = stack.new_cache(16)
        alone.append(stack(p, torch.arange(p.shape[1])[None], cache, 0)[0])
    caches = [stack.new_cache(16) for _ in prompts]
    positions = torch.cat([torch.arange(p.shape[1]) for p in prompts])
    step = stack.forward_rows(torch.cat([p[0] for p in prompts]), positions,
                              [SeqRows(c, 0, p.shape[1]) for c, p in zip(caches, prompts, strict=True)])
    assert torch.equal(step, torch.cat(alone))


def test_a_tiny_mixture_serves_a_chat_completion(folder):
    serves_a_chat_completion(str(folder), "tiny-moe")


def test_the_dashboard_shows_the_experts_a_device_holds(folder):
    app, service = controller_app(str(folder))
    client = LoopClient(app)
    try:
        controller = client.get("/dashboard/state").json()["devices"][0]
    finally:
        client.close()
        service.engine.close()
    assert controller["name"] == "controller" and controller["experts"] == 8  # 8 experts; the second layer dense


@pytest.mark.slow
def test_a_worker_killed_mid_stream_costs_a_mixtures_stream_nothing(tmp_path):
    from processes import start_server, stream_text, wait_all_back, worker_pid, workers

    # experts of 256 over a width of 256 in Q4_1: 1.3 MB a layer. Each worker's budget (4.3 MB) holds two or three
    # of the four layers with their KV, not four, and the controller's room is a worker's: no placement fits without the
    # killed worker, so the stream waits for it to be started again and planned back in (--restart-wait-s)
    gguf = tiny_mixture_gguf(tmp_path)
    proc, url = start_server(tmp_path, "moe", "--model", str(gguf), "--weights", "q4_1", "--local-workers", "2",
                             "--worker-threads", "1", "--worker-memory-budget-gib", "0.004", "--plan-context", "256",
                             "--plan-concurrency", "1", "--stage-timeout-s", "4", "--recover-probe-s", "2",
                             "--monitor-interval-s", "0.5", env={"EDGESPEC_CACHE": str(tmp_path / "cache")})
    try:
        wait_all_back(url, 2)
        assert all(0 < len(range(*w["layers"])) < 4 for w in workers(url))  # no worker holds every layer
        want, _ = stream_text(url, "naive", max_tokens=40, min_tokens=40)
        victim = worker_pid(proc.proc.pid, workers(url)[-1]["url"])
        killed = []
        got, payloads = stream_text(url, "naive", lambda i: i == 5 and killed.append(os.kill(victim, signal.SIGKILL)),
                                    max_tokens=40, min_tokens=40)
        assert killed and not any("error" in p for p in payloads)
        assert got == want
        assert "no placement fits without" in (tmp_path / "moe.log").read_text()  # it waited for the restart
        wait_all_back(url, 2)  # started again and planned back in
        assert stream_text(url, "naive", max_tokens=40, min_tokens=40)[0] == want
    finally:
        proc.stop()


def test_llama_cpp_reads_the_gguf_as_edgespec_does(tmp_path):
    # float32: with quantized experts llama.cpp's own rounding of the activations (it quantizes them for Q8_0
    # weights) moves routing near-ties in a random model, 0.139 of the largest logit against edgespec's 0.013 from
    # transformers; the quantized experts' layout is checked tensor by tensor below
    folder = tiny_model("qwen3_moe", tmp_path / "folder", 0, SHAPE)  # every layer sparse, as llama.cpp's qwen3moe
    gguf = write_gguf(folder, tmp_path / "moe.gguf", name="tiny")
    ids = list(range(100, 140))
    theirs = llama_cpp_logits(gguf, ids, tmp_path)
    ours = load_blocks(resolve_model(str(gguf)).folder).logits_from_scratch(ids)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-3  # measured 0.00075


def test_a_token_reads_its_share_of_the_experts_in_the_roofline(tmp_path):
    # bench-peer's bytes per token (bench/roofline.py): of a mixture's stacked experts the k of E a token chooses
    from gguf import GGUFReader

    from edgespec.bench.roofline import edgespec_bytes_per_token, gguf_bytes_per_token
    from edgespec.bench.versus import model_gguf

    folder = tiny_model("qwen3_moe", tmp_path / "folder", 0, SHAPE)  # 8 experts, 2 a row; an untied head
    gguf = write_gguf(folder, tmp_path / "moe.gguf", name="tiny")
    assert model_gguf(str(gguf)) == gguf
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(gguf).tensors}
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    assert experts > 0
    assert gguf_bytes_per_token(gguf) == sum(sizes.values()) - sizes["token_embd.weight"] - experts * 6 // 8
    held = edgespec_bytes_per_token("float32", str(gguf))  # float32: the file's floats as held
    assert held == pytest.approx(gguf_bytes_per_token(gguf) + sizes["token_embd.weight"], rel=0.01)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_each_experts_rows_of_a_stacked_tensor_are_gguf_pys(kind, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    folder = tiny_model("qwen3_moe", tmp_path / "folder", 0, SHAPE)
    gguf = write_gguf(folder, tmp_path / "moe.gguf", {f"blk.{i}.ffn_{p}_exps.weight": kind
                                                       for i in range(2) for p in ("gate", "up", "down")})
    src = open_source(str(gguf))
    stacked = [t for t in GGUFReader(gguf).tensors if "_exps." in t.name]
    assert len(stacked) == 6
    for t in stacked:
        layer, part = t.name.split(".")[1], t.name.split(".")[2].split("_")[1]
        every = dequantize(t.data, t.tensor_type)  # [E, N, K], gguf-py's own reading
        assert every.shape[0] == 8
        for e, rows in enumerate(every):
            ours = dequantized(src.matrix(f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"))
            assert torch.equal(ours, torch.from_numpy(rows)), (t.name, e)
