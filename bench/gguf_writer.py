"""Tiny random models of each architecture, written the way their own tools write them: a Hugging Face folder
by transformers' own class (`tiny_model`, with SmolLM2's tokenizer, so the vocabulary and chat template are
real), and a GGUF file the way llama.cpp's converter writes it (`write_gguf`, `convert_hf_to_gguf.py --outtype
f32`; checked against it, see the README's "Models"): its `TextModel.set_gguf_parameters` keys (the rope
fields of transformers 5 and of 4.x configs read as its `TextModel.__init__` reads them), its `_set_vocab_gpt2`
tokenizer, its tensor names (gguf's own TensorNameMap, which the converter maps through), q and k rows reordered
as its `LlamaModel.permute` does for the architectures it writes through LlamaModel, with LlamaModel's rope_freqs
under Llama 3's rope scaling, Gemma 3's norm weights shifted by 1 with its own keys (`Gemma3Model`: norm_shift,
set_gguf_parameters; not its cut of token_embd to the tokenizer's size), Phi-3's keys and rope factors written
as `Phi3MiniModel` writes them (its set_gguf_parameters, generate_extra_tensors; its fused qkv_proj and
gate_up_proj kept whole as attn_qkv and ffn_up), SmolLM3 as `SmolLM3Model` (LlamaModel under its own name: nothing of
its NoPE layers), Granite as `GraniteModel` (LlamaModel without head_dim, its four multipliers as keys). Ministral
has none: the converter refuses MinistralForCausalLM.
Nothing here is taken from edgespec's own description of an architecture (model/arch.py), so a wrong name or
ordering there fails the tests (tests/test_architectures.py) and shows in bench/gguf_types.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from edgespec.model.synth_gguf import write_tokenizer

# per architecture of model/arch.py: transformers' config and model classes, and what its config adds
# (Qwen3's heads are wider than hidden / heads, as in the real models)
ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # Qwen3-MoE: 8 experts of 32, 2 a row, renormalised (Qwen3-30B-A3B: 128 of 768, 8 a row, renormalised), every
    # layer sparse as llama.cpp's qwen3moe has them (tests/test_experts.py checks a dense layer among them)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "norm_topk_prob": True}),
    # Gemma 3: sliding layers at transformers' (and llama.cpp's) default pattern, every sixth layer global, with
    # a window shorter than the prompts; tied embeddings. query_pre_attn_scalar is head_dim, as llama.cpp assumes
    # for a GGUF, which holds none (test_gemma3_attention_scale checks another value from a folder).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 32, "query_pre_attn_scalar": 32, "num_hidden_layers": 6, "sliding_window": 8,
                "tie_word_embeddings": True, "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # Phi-4-mini's rope: longrope (its factors drawn for the shape, see tiny_config) over the first 3/4 of each
    # head, the original context the whole context, so that transformers and llama.cpp both turn by the short
    # factors; its sliding_window past the context (Phi-4-mini: 262144 of 131072), so it narrows nothing.
    # Phi3Config's pad_token_id, 32000, is past a tiny vocabulary.
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"partial_rotary_factor": 0.75, "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0},
              "sliding_window": 262144, "pad_token_id": None}),
    # SmolLM3: four layers, so that the last is a NoPE layer at transformers' default interval (llama.cpp's fixed
    # rule for its GGUFs); its pad_token_id, 128004, is past a tiny vocabulary
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_hidden_layers": 4, "pad_token_id": None}),
    # Ministral: sliding and full layers in turn (Ministral-8B's configs: every layer sliding, at a window of the
    # whole context), the window shorter than the prompts
    "ministral": ("MinistralConfig", "MinistralForCausalLM",
                  {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                   "sliding_window": 4}),
    # Granite 3.x: its four multipliers as Granite-3.x-2B sets them but the attention's, which replaces head_dim**-0.5
    # (here 0.25) by another value
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.1,
                 "logits_scaling": 8.0}),
}


# Hugging Face model_type -> (the converter's GGUF architecture, whether it writes it through LlamaModel)
CONVERTER = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False),
             "qwen3": ("QWEN3", False), "gemma3_text": ("GEMMA3", False), "phi3": ("PHI3", False),
             "smollm3": ("SMOLLM3", True), "granite": ("GRANITE", True), "qwen3_moe": ("QWEN3MOE", False)}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # LlamaModel.permute: each head's rows from two halves to llama.cpp's interleaved rotary order
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_parameters(hp: dict) -> dict:
    # TextModel.__init__: a config's rope_parameters (transformers 5) or rope_scaling (4.x), with the 4.x fields
    # for the base and the sliding layers' base (Gemma 3's rope_local_base_freq) mirrored into it
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        if (local := hp.get("rope_local_base_freq")) is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        if "rope_theta" not in rope and hp.get("rope_theta") is not None:
            rope["rope_theta"] = hp["rope_theta"]
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
    return rope


def _llama3_rope_factors(hp: dict, rope: dict) -> np.ndarray | None:
    # LlamaModel.generate_extra_tensors: what llama.cpp divides each rotary frequency by, under Llama 3's scaling
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_gguf(folder: Path | str, out: Path | str, kinds: dict[str, str] | None = None,
               name: str | None = None) -> Path:
    """The model in `folder` as the GGUF file `out` (float32 tensors, norms included; `kinds`: GGUF tensor name ->
    GGML type name for tensors to quantize, e.g. {'token_embd.weight': 'Q4_0'}; `name`: general.name, by default
    the folder's, the converter's fallback). Returns `out`.

    llama.cpp keys tokenizer fixes on general.name: one holding 'phi3' or 'phi-3' makes its vocabulary loader look
    up Phi-3's SentencePiece tokens (</s>, <unk>, <s>), which a GPT-2 vocabulary as Phi-4-mini's or SmolLM2's
    lacks, and the file fails to load ('unordered_map::at'); Phi-4-mini's own name, 'Phi 4 Mini Instruct', holds
    neither."""
    import gguf
    from gguf.quants import quantize

    folder, out, kinds = Path(folder), Path(out), kinds or {}
    hp = json.loads((folder / "config.json").read_text())
    arch_name, through_llama = CONVERTER[hp["model_type"]]
    arch = gguf.MODEL_ARCH[arch_name]
    names = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name or folder.name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    extra = _phi3_parameters(w, hp) if hp["model_type"] == "phi3" else _text_parameters(w, hp, through_llama)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    write_tokenizer(w, folder, hp["vocab_size"])
    for gname, data in extra:  # the converter's generate_extra_tensors come before the checkpoint's
        w.add_tensor(gname, data)

    gemma3 = hp["model_type"] == "gemma3_text"
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for name, tensor in _merged_experts(f):
            if name == "lm_head.weight" and hp.get("tie_word_embeddings"):
                continue
            data = tensor.to(torch.float32)
            if gemma3 and name.endswith("norm.weight"):  # Gemma3Model.norm_shift: its norms multiply by 1 + w
                data = data + 1.0
            data = data.numpy()
            if through_llama and name.endswith(("q_proj.weight", "q_proj.bias")):
                data = llama_permute(data, hp["num_attention_heads"])
            elif through_llama and name.endswith(("k_proj.weight", "k_proj.bias")):
                data = llama_permute(data, hp["num_key_value_heads"])
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gname in kinds:
                kind = gguf.GGMLQuantizationType[kinds[gname]]
                w.add_tensor(gname, quantize(data, kind), raw_dtype=kind)
            else:
                w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _merged_experts(f) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by name, each layer's experts merged as Qwen2MoeModel.modify_tensors merges them:
    `mlp.experts.{e}.gate_proj.weight` [I, H] of every e stacked into `mlp.experts.gate_proj.weight` [E, I, H]
    (the GGUF's ffn_gate_exps), the same for up and down, where the layer's experts end."""
    out, experts = [], {}
    for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = f.get_tensor(name)
        else:
            out.append((name, f.get_tensor(name)))
    for (prefix, part), by_expert in experts.items():
        out.append((f"{prefix}.{part}.weight", torch.stack([by_expert[e] for e in sorted(by_expert)])))
    return out


def _text_parameters(w, hp: dict, through_llama: bool) -> list:
    """TextModel.set_gguf_parameters' keys (and LlamaModel's, Gemma3Model's own); LlamaModel's rope_freqs under
    Llama 3's rope scaling, its generate_extra_tensors. -> [(GGUF name, float32 data)]"""
    import gguf

    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = _rope_parameters(hp)
    # TextModel: the global layers' rope (Gemma 3 keeps one dict per layer type): linear scaling's keys (Llama 3's
    # goes into rope_freqs), the base; and the sliding ones' base
    full = rope.get("full_attention", rope)
    if full.get("rope_type") == "linear" and full.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full.get("rope_theta", 10000.0))
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    experts = hp.get("num_local_experts") or hp.get("num_experts")
    if experts:  # TextModel's expert counts, Qwen2MoeModel's expert size
        w.add_expert_count(experts)
        w.add_expert_used_count(hp["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("head_dim") and hp["model_type"] != "granite":  # GraniteModel pops head_dim before TextModel's
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if through_llama:  # LlamaModel's own keys
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if hp["model_type"] == "granite":  # GraniteModel's multipliers, where set (it drops head_dim, as above)
        for key, add in (("attention_multiplier", w.add_attention_scale),
                         ("embedding_multiplier", w.add_embedding_scale),
                         ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
            if hp.get(key):
                add(hp[key])
    if hp["model_type"] == "gemma3_text":  # Gemma3Model's own keys (no query_pre_attn_scalar, no layer types)
        if hp.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(hp["final_logit_softcapping"])
        if hp.get("sliding_window_pattern") != 1:
            w.add_sliding_window(hp["sliding_window"])
    if through_llama and (factors := _llama3_rope_factors(hp, full)) is not None:
        return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors)]
    return []


def _phi3_parameters(w, hp: dict) -> list:
    """Phi3MiniModel.set_gguf_parameters' keys (it writes no TextModel ones: no key_length, no vocab_size) and its
    generate_extra_tensors: the longrope factors as rope_factors_long / _short, with the attention factor from
    the context's ratio to the original one. -> [(GGUF name, float32 data)]"""
    import math

    import gguf

    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
    max_pos = hp["max_position_embeddings"]
    orig = rope.get("original_max_position_embeddings", hp.get("original_max_position_embeddings"))
    rope_dims = int(rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0)) * n_embd) // n_head
    w.add_context_length(max_pos)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    w.add_sliding_window(hp.get("sliding_window") or 0)  # 0: none (Phi-4's)
    if not rope.get("long_factor"):
        return []
    scale = max_pos / orig
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
             np.asarray(rope["long_factor"], dtype=np.float32)),
            (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
             np.asarray(rope["short_factor"], dtype=np.float32))]


def tiny_config(kind: str, base: dict, overrides: dict):
    """transformers' config of a tiny `kind` model: `base` (shape), then the architecture's own settings, then
    `overrides`. A longrope scaling given without factors gets them, one per rotated frequency of the shape
    (short ones 1 + 0.25 i, long ones 2 + i), with the original context the whole context unless given."""
    import transformers

    config_cls, _, extra = ARCH_CLASSES[kind]
    args = {**base, **extra, **overrides}
    if "head_dim" not in args and getattr(getattr(transformers, config_cls), "head_dim", 0) is None:
        # MinistralConfig's head_dim defaults to None, which its attention cannot use: the shape's own
        args["head_dim"] = args["hidden_size"] // args["num_attention_heads"]
    rope = dict(args.get("rope_parameters") or {})
    if rope.get("rope_type") == "longrope" and "short_factor" not in rope:
        head = args.get("head_dim") or args["hidden_size"] // args["num_attention_heads"]
        n = int(head * rope.get("partial_rotary_factor", args.get("partial_rotary_factor", 1.0))) // 2
        rope.update(short_factor=[1.0 + 0.25 * i for i in range(n)], long_factor=[2.0 + i for i in range(n)])
        args = {"original_max_position_embeddings": args["max_position_embeddings"], **args, "rope_parameters": rope}
    return getattr(transformers, config_cls)(**args)


def tiny_model(kind: str, folder: Path | str, seed: int = 0, shape: dict | None = None, std: float = 0.2,
               special_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """A tiny random `kind` model (an ARCH_CLASSES key) from transformers' own class with SmolLM2's tokenizer,
    saved into `folder`: config `shape`, then the architecture's own settings, then `overrides`. Matrices drawn
    N(0, std^2), biases and norms U(0.5, 1.5) (transformers sets them to constants), so a misplaced one shows.
    `special_tokens` are added to the tokenizer as special tokens (another model's end of turn: <|end|>), after
    SmolLM2's vocabulary."""
    import transformers

    from edgespec.model.source import resolve_model

    folder = Path(folder)
    tok = transformers.AutoTokenizer.from_pretrained(resolve_model(None).folder)
    if special_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    config = tiny_config(kind, {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                                "eos_token_id": tok.eos_token_id, **(shape or {})}, overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCH_CLASSES[kind][1])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
