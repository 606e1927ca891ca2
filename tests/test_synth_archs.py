"""Scale models of the architectures past Llama (model/synth.py, model/synth_gguf.py) against references no one
here wrote: the cards of config/models load in transformers as the model they name (its config class, its
rotary frequencies and their attention factor, its layer pattern, its parameter count) and in edgespec alike; a
small version of each shape (its architecture's own fields kept, its sizes tiny) written in float32 runs as
transformers runs it, its norms multiply by 1 in transformers' own modules, and written as a Q8_0 GGUF it holds
what llama.cpp's converter writes from the float32 folder (bench/gguf_writer.py mirrors the converter without
model/arch.py; Phi-3's fused tensors whole, as the converter keeps them), llama.cpp reads it to the logits edgespec
reads from it, and it serves and keeps its hidden states finite."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess import serves_a_chat_completion
from model_fixtures import llama_cpp_logits, load_blocks, load_reference

from edgespec.bench.gguf_writer import write_gguf as converter_gguf
from edgespec.model.config import ModelConfig, rope_attention_factor, rope_inv_freq
from edgespec.model.source import resolve_model
from edgespec.model.synth import GGUF_FILE, hf_config, load_shape, synthesize, write_config
from edgespec.planning.testbeds import MODELS_DIR, load_card

# the shapes of the architectures past Llama 2 / TinyLlama, and transformers' config class for each
SHAPES = {"qwen3-4b": "Qwen3Config", "llama-3.2-3b": "LlamaConfig", "gemma3-1b": "Gemma3TextConfig",
          "gemma3-4b": "Gemma3TextConfig", "phi-4-mini": "Phi3Config", "qwen3-30b-a3b": "Qwen3MoeConfig",
          "qwen3-moe-7b-a1b": "Qwen3MoeConfig"}
VOCAB = 512
# tiny sizes per shape (layers, hidden, heads, KV heads, head_dim): Qwen3's heads wider than hidden / heads as in
# the real model, Gemma 3 with six layers (five sliding, one global) and a window shorter than the prompt,
# Phi-4-mini with an original context shorter than the prompt: transformers turns by the long factors on a pass
# past it, edgespec where the served context is past it, both with the attention factor of their ratio
SMALL = {"qwen3-4b": (2, 64, 4, 2, 32, {"max_window_layers": 2}), "llama-3.2-3b": (2, 64, 4, 2, 16, {}),
         "gemma3-1b": (6, 64, 4, 1, 32, {"sliding_window": 8}),
         "gemma3-4b": (6, 64, 4, 2, 32, {"sliding_window": 8}),
         "phi-4-mini": (2, 128, 4, 2, 32, {"original_max_position_embeddings": 32}),
         "qwen3-30b-a3b": (2, 64, 4, 2, 32, {"max_window_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 32}),
         "qwen3-moe-7b-a1b": (2, 64, 4, 2, 32, {"max_window_layers": 2, "num_experts": 6, "num_experts_per_tok": 3,
                                                "moe_intermediate_size": 32})}
IDS = [1, 17, 100, 255, 300, 450, VOCAB - 1, *range(20, 60)]  # 47 tokens: past the small Gemmas' window


def test_every_new_shape_is_a_card():
    assert set(SHAPES) <= {p.stem for p in MODELS_DIR.glob("*.json")}


def _their_model(folder: Path):
    # transformers' model for the folder's config, on the meta device: shapes without values, in no time
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def _their_inv_freq(rotary, layer_type: str) -> torch.Tensor:
    # Gemma 3 keeps one set of frequencies per layer type, the others one (see _their_served_rotary)
    buffers = dict(rotary.named_buffers())
    return buffers.get(f"{layer_type}_inv_freq", buffers.get("inv_freq"))


def _their_served_rotary(theirs, rotary_class):
    # transformers' rotary embedding after a pass reaching the last position of the served context: longrope turns
    # by its long factors on a pass past the original context (transformers chooses per pass), what edgespec
    # chooses at load where the served context is past it; other rope types are the same on every pass
    rotary = rotary_class(theirs)
    if getattr(rotary, "rope_type", None) == "longrope":
        rotary(torch.zeros(1), torch.tensor([[theirs.max_position_embeddings - 1]]))
    return rotary


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_shape_loads_in_transformers_and_edgespec_alike(shape, tmp_path):
    card = load_shape(shape)
    write_config(card, tmp_path)
    theirs, model = _their_model(tmp_path)
    ours = ModelConfig.from_folder(tmp_path)
    assert type(theirs).__name__ == SHAPES[shape]
    assert theirs.model_type in ours.arch.hf_types
    assert (ours.n_layers, ours.hidden_size, ours.n_heads, ours.n_kv_heads, ours.head_dim) == \
        (theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads,
         theirs.head_dim) == (card["n_layers"], card["hidden_size"], card["n_heads"], card["n_kv_heads"],
                              card["head_dim"])
    assert (ours.intermediate_size, ours.vocab_size, ours.rms_norm_eps, ours.max_position_embeddings,
            ours.tie_word_embeddings) == (theirs.intermediate_size, theirs.vocab_size, theirs.rms_norm_eps,
                                          theirs.max_position_embeddings, theirs.tie_word_embeddings)
    assert ours.max_position_embeddings == card["context"]
    assert (ours.n_experts, ours.experts_per_token, ours.expert_size, ours.norm_topk_prob) == (
        getattr(theirs, "num_experts", 0), getattr(theirs, "num_experts_per_tok", 0),
        getattr(theirs, "moe_intermediate_size", 0), getattr(theirs, "norm_topk_prob", False))
    assert ours.hidden_act == (getattr(theirs, "hidden_activation", None) or theirs.hidden_act)
    assert ours.query_pre_attn_scalar == getattr(theirs, "query_pre_attn_scalar", None)
    # the layer pattern: transformers 5 reads a 4.x config's sliding_window_pattern as layer_types (Llama has none)
    sliding = [t == "sliding_attention" for t in getattr(theirs, "layer_types", None) or [None] * ours.n_layers]
    assert list(ours.sliding_layers or [False] * ours.n_layers) == sliding
    assert ours.sliding_window == (theirs.sliding_window if any(sliding) else None)
    # rotary frequencies with their scaling (Llama 3's, Gemma 3 4B's linear, Phi-4-mini's longrope over the first
    # 3/4 of a head) and attention factor, and the sliding layers' own base
    rotary = _their_served_rotary(theirs, type(model.model.rotary_emb))
    torch.testing.assert_close(rope_inv_freq(ours), _their_inv_freq(rotary, "full_attention"), rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(getattr(rotary, "attention_scaling", 1.0), rel=1e-12)
    assert ours.rotary_dim == int(theirs.head_dim * theirs.rope_parameters.get("partial_rotary_factor", 1.0))
    if any(sliding):
        torch.testing.assert_close(rope_inv_freq(ours, local=True), _their_inv_freq(rotary, "sliding_attention"),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_cards_parameters_are_transformers_own(shape, tmp_path):
    card = load_card(MODELS_DIR / f"{shape}.json")
    write_config(load_shape(shape), tmp_path)
    _, model = _their_model(tmp_path)
    layers = model.model.layers
    assert len(layers) == card.n_layers
    assert {sum(p.numel() for p in layer.parameters()) for layer in layers} == {card.layer_params}
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    assert total - card.n_layers * card.layer_params == card.ends_params


# -- small versions of the shapes -------------------------------------------------------------------------------


def _spread(factors: list[float], n: int) -> list[float]:
    # n of a rope's per-frequency factors, evenly spaced over them, the first and the last kept
    return [factors[round(i * (len(factors) - 1) / (n - 1))] for i in range(n)]


def small_card(shape: str) -> dict:
    """The card of `shape` at a tiny size: its architecture's own fields (model type, activation, norms, rope and
    its scaling, partial rotary, attention scale, layer pattern, tied head) kept, its sizes and window made small;
    the attention scale stays head_dim's, as in the real models, and longrope keeps one factor per rotated
    frequency of the small head (spread over the card's)."""
    card = load_shape(shape)
    n_layers, hidden, heads, kv, head_dim, extra = SMALL[shape]
    hf = {**card["hf"], "intermediate_size": 2 * hidden, "vocab_size": VOCAB, "max_position_embeddings": 256,
          **extra}
    if "query_pre_attn_scalar" in hf:
        hf["query_pre_attn_scalar"] = head_dim
    if "long_factor" in (rope := hf.get("rope_scaling") or {}):
        n = int(head_dim * hf.get("partial_rotary_factor", 1.0)) // 2
        hf["rope_scaling"] = {**rope, "short_factor": _spread(rope["short_factor"], n),
                              "long_factor": _spread(rope["long_factor"], n)}
    small = {**card, "name": f"small {card['name']}", "n_layers": n_layers, "hidden_size": hidden, "n_heads": heads,
             "n_kv_heads": kv, "head_dim": head_dim, "context": 256, "hf": hf}
    cfg = ModelConfig.from_hf_dict(hf_config(small, 0, 0))
    small["layer_params"] = cfg.layer_param_count()
    small["ends_params"] = VOCAB * hidden * (1 if cfg.tie_word_embeddings else 2) + hidden
    return small


@pytest.fixture(scope="module", params=sorted(SHAPES))
def small(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(shape, float32 folder, Q8_0 GGUF folder) of the shape's small version."""
    tmp = tmp_path_factory.mktemp(request.param)
    path = tmp / f"small-{request.param}.json"
    path.write_text(json.dumps(small_card(request.param)))
    return (request.param, synthesize(str(path), tmp / "float32", "float32", 3, progress=False),
            synthesize(str(path), tmp / "q8_0", "q8_0", 3, progress=False))


def test_the_float32_folder_runs_as_transformers_runs_it(small):
    shape, folder, _ = small
    blocks, ref = load_blocks(folder), load_reference(folder)
    assert blocks.cfg.arch.hf_types[0] == json.loads((folder / "config.json").read_text())["model_type"]
    ours = blocks.logits_from_scratch(IDS)
    with torch.inference_mode():
        theirs = ref(torch.tensor([IDS])).logits[0].float()
    assert ours.shape == theirs.shape == (len(IDS), VOCAB)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4, shape


def test_every_norm_multiplies_by_one(small):
    # stored as 0 where the architecture multiplies by 1 + w (Gemma 3), as 1 elsewhere: transformers' own modules
    # tell which is which
    _, folder, _ = small
    ref = load_reference(folder)
    norms = [(name, m) for name, m in ref.named_modules() if name.endswith("norm")]
    n_layers, per_layer = ref.config.num_hidden_layers, len([n for n, _ in norms if ".layers.0." in n])
    assert len(norms) == n_layers * per_layer + 1 and per_layer >= 2
    gen = torch.Generator().manual_seed(0)
    for name, module in norms:
        x = torch.randn(3, module.weight.numel(), generator=gen)
        with torch.inference_mode():
            expected = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=ref.config.rms_norm_eps)
            torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6, msg=name)


def _fields(reader, arch: str) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(f"{arch}.")}


def test_the_gguf_holds_what_the_converter_writes(small, tmp_path):
    """Architecture, keys, tensor names and shapes as the converter writes them from the float32 folder; norms
    (shifted for Gemma 3), Llama 3's rope_freqs and Phi-4-mini's rope factors exactly, matrices within Q8_0's
    rounding (q and k rows in the converter's order: permuted they would be far off; Phi-3's fused qkv and
    gate/up rows in theirs)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    shape, folder, q8 = small
    ours, theirs = GGUFReader(q8 / GGUF_FILE), GGUFReader(converter_gguf(folder, tmp_path / "converter.f32.gguf"))
    arch = theirs.fields["general.architecture"].contents()
    assert ours.fields["general.architecture"].contents() == arch
    assert _fields(ours, arch) == _fields(theirs, arch)
    mine = {t.name: t for t in ours.tensors}
    ref = {t.name: t for t in theirs.tensors}
    assert sorted(mine) == sorted(ref)
    assert ("rope_freqs.weight" in ref) == (shape == "llama-3.2-3b")
    assert ("rope_factors_long.weight" in ref) == ("blk.0.attn_qkv.weight" in ref) == (shape == "phi-4-mini")
    for name, t in ref.items():
        want = np.asarray(t.data, dtype=np.float32)
        got = mine[name]
        if got.tensor_type == GGMLQuantizationType.F32:
            assert np.asarray(got.data).shape == want.shape, name
            np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-6, atol=0, err_msg=name)
            continue
        assert got.tensor_type == GGMLQuantizationType.Q8_0, name
        values = dequantize(np.asarray(got.data), GGMLQuantizationType.Q8_0)
        assert values.shape == want.shape, name
        assert np.abs(values - want).max() <= np.abs(want).max() / 100, name


def test_llama_cpp_reads_the_gguf_as_edgespec_does(small, tmp_path):
    # the tokenizer is in the file too. llama.cpp's logits on the same Q8_0 file, which rounds activations its own
    # way: measured 0.0026-0.0078 of the largest logit (the mixtures 0.0065 and 0.0078; the Gemma 3s 0.019 and
    # 0.022), the same top token at 0.957-1.0 of the positions
    _, _, q8 = small
    theirs = llama_cpp_logits(q8 / GGUF_FILE, IDS, tmp_path)
    ours = load_blocks(q8).logits_from_scratch(IDS)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.9


def test_the_gguf_serves_and_keeps_its_hidden_states_finite(small):
    shape, folder, q8 = small
    assert resolve_model(str(q8)).gguf == q8 / GGUF_FILE
    blocks, exact = load_blocks(q8), load_blocks(folder)
    outputs = []
    blocks.stack.one_by_one()  # layer by layer, so that the hooks see each output (the same bits)
    hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
             for layer in blocks.stack.layers]
    logits = blocks.logits_from_scratch(IDS)
    for h in hooks:
        h.remove()
    assert len(outputs) == blocks.cfg.n_layers
    assert all(out.isfinite().all() for out in outputs)
    reference = exact.logits_from_scratch(IDS)  # the same values before Q8_0
    assert ((logits - reference).abs().max() / reference.abs().max()).item() < 0.05, shape

    serves_a_chat_completion(str(q8), shape, dtype="auto")
