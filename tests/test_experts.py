"""Qwen3-MoE's mixture of experts (model/blocks.py's Experts) beyond test_architectures' logits: the router's
choice and a row's output do not depend on the rows beside it (alone, in a batch step of several sequences, in
the 4-bit format), the config's sparse layers are transformers', a tiny one serves a chat completion, and its GGUF
is refused by name until the stacked expert tensors are read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from inprocess import serves_a_chat_completion

from edgespec.bench.gguf_writer import tiny_model
from edgespec.model.blocks import Experts, SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.stack import LayerStack
from edgespec.model.weights import open_source

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"), 0, SHAPE)


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


def test_its_gguf_is_refused_by_name(folder, tmp_path, monkeypatch):
    from edgespec.model import source

    fake = tmp_path / "moe.gguf"
    fake.write_bytes(b"")
    monkeypatch.setattr(source, "resolve_model", lambda _: source.ModelFiles(folder, "moe", fake))
    with pytest.raises(ValueError, match="stacked expert tensors"):
        open_source(str(fake))
