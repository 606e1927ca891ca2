"""A scale model's GGUF file (model/synth.py), written as llama.cpp's converter writes the model's architecture
(`convert_hf_to_gguf.py` and its `conversion/*.py`, from the `llama-cpp-python` source distribution):

- metadata: `general.architecture` the architecture's GGUF name, and the keys `TextModel.set_gguf_parameters`
  writes for the config (block count, lengths, heads, rope base and linear scaling, the sliding layers' rope
  base, norm epsilon, key and value lengths, file type), with those model/arch.py's GGUFKeys say its converter
  class adds or leaves out (`LlamaModel`'s vocabulary size and rope dimensions, `Gemma3Model`'s sliding window,
  `Phi3MiniModel`'s set: no key lengths, the partial rotary's dimensions, its window always) and longrope's
  original context and attention factor (`Phi3MiniModel`); the folder's tokenizer as a gpt2-style vocabulary
  (edgespec reads the folder's config.json and tokenizer; llama.cpp needs it in the file);
- tensors: GGUF names from model/arch.py (fused projections, Phi-3's qkv_proj and gate_up_proj, whole as
  attn_qkv and ffn_up), q and k rows reordered where the architecture's rotary is permuted (`LlamaModel.permute`),
  norms shifted by the architecture's norm_offset (`Gemma3Model.norm_shift`: its norms multiply by 1 + w), and
  the tensors the converter's generate_extra_tensors adds: `LlamaModel`'s rope_freqs for Llama 3's rope scaling,
  `Phi3MiniModel`'s rope_factors_long / _short for longrope;
- formats: layer matrices in the file's blocks (a mixture's stacked experts too), the embedding and head in Q8_0,
  norms and a mixture's router F32 (llama.cpp's quantizer leaves ffn_gate_inp so).

tests/test_synth_archs.py checks this against bench/gguf_writer.py, which mirrors the converter without reading
model/arch.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgespec.model.config import ModelConfig, rope_inv_freq

if TYPE_CHECKING:
    from edgespec.model.synth import Tensor

ROPE_FREQS = "rope_freqs.weight"
# a mixture's router (ffn_gate_inp), written in F32
ROUTER = ".mlp.gate.weight"
ROPE_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def write_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The folder's tokenizer (SmolLM2's byte-level BPE, as the tests' and the scale models' folders hold it) as
    the converter writes a gpt2-style one: every id up to `vocab_size` (ids past the tokenizer's as unused
    [PADi]), its token types, merges and special ids, so that llama.cpp loads the file too."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if i in added and added[i].special
                         else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)


def write_metadata(writer, cfg: ModelConfig, window: int | None, name: str, weights: str) -> None:
    """The converter's keys for a model of `cfg` whose layers are in `weights` blocks (q4_1 / q8_0); `window`:
    its config's sliding_window as written there (cfg keeps it only where it narrows layers)."""
    import gguf

    keys = cfg.arch.gguf_keys
    writer.add_type("model")
    writer.add_name(name)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    rope = cfg.rope_scaling
    if rope["rope_type"] == "linear":  # llama3's scaling goes into rope_freqs instead
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "longrope":  # Phi3MiniModel's; its factors go into rope_factors_long / _short
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(rope["attention_factor"])
    writer.add_rope_freq_base(cfg.rope_theta)
    if cfg.rope_local_theta is not None:
        writer.add_rope_freq_base_swa(cfg.rope_local_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if keys.head_lengths:
        writer.add_key_length(cfg.head_dim)  # the config names head_dim (hf_config writes it)
        writer.add_value_length(cfg.head_dim)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{weights.upper()}"])
    if keys.vocab_size:
        writer.add_vocab_size(cfg.vocab_size)
    if keys.rope_dimension_count:
        writer.add_rope_dimension_count(cfg.rotary_dim)
    if cfg.n_experts:  # TextModel's expert counts, Qwen2MoeModel's expert size
        writer.add_expert_count(cfg.n_experts)
        writer.add_expert_used_count(cfg.experts_per_token)
        writer.add_expert_feed_forward_length(cfg.expert_size)
    if keys.window_always:
        writer.add_sliding_window(window or 0)
    elif cfg.sliding_window is not None:  # Gemma3Model's (the layer pattern is llama.cpp's own: not written)
        writer.add_sliding_window(cfg.sliding_window)


def extra_tensors(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Tensors the converter adds that no checkpoint holds (edgespec reads the second kind only): LlamaModel's
    rope_freqs under Llama 3's rope scaling, per rotary frequency what llama.cpp divides it by [head_dim / 2];
    Phi3MiniModel's longrope factors, long then short [rotary_dim / 2]."""
    rope = cfg.rope_scaling
    if rope["rope_type"] == "longrope":
        return {name: np.asarray(rope[key], dtype=np.float32) for key, name in ROPE_FACTORS.items()}
    if not cfg.arch.rotary_permuted or rope["rope_type"] != "llama3":
        return {}
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling={"rope_type": "default"}))
    return {ROPE_FREQS: (plain / rope_inv_freq(cfg)).numpy()}


def write_gguf(plan: Sequence[Tensor], path: Path, config: dict, name: str, weights: str, seed: int,
               advance: Callable[[int], None]) -> None:
    """The tensors of `plan` (Hugging Face names and values) as one GGUF file, layer matrices in `weights` blocks.
    Tensor infos go first in a GGUF, so sizes are worked out before any values are drawn."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quant_shape_to_byte_shape, quantize

    cfg = ModelConfig.from_hf_dict(config)
    arch = cfg.arch
    layer_kind = GGMLQuantizationType[weights.upper()]
    writer = GGUFWriter(path, arch.gguf)
    write_metadata(writer, cfg, config.get("sliding_window"), f"synthetic {name}", weights)
    write_tokenizer(writer, path.parent, cfg.vocab_size)  # write_config put the tokenizer beside it
    extra = extra_tensors(cfg)

    def kind(t: Tensor) -> GGMLQuantizationType | None:  # None: F32 (the norms, a mixture's router)
        if t.std is None or t.name.endswith(ROUTER):
            return None
        return layer_kind if ".layers." in t.name else GGMLQuantizationType.Q8_0

    for gguf_name, values in extra.items():
        writer.add_tensor_info(gguf_name, values.shape, np.dtype(np.float32), values.nbytes)
    for t in plan:
        k = kind(t)
        if k is None:
            writer.add_tensor_info(arch.gguf_name(t.name), t.shape, np.dtype(np.float32), 4 * math.prod(t.shape))
        else:
            shape = quant_shape_to_byte_shape(t.shape, k)
            writer.add_tensor_info(arch.gguf_name(t.name), shape, np.dtype(np.uint8), math.prod(shape), raw_dtype=k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for values in extra.values():
        writer.write_tensor_data(values)
    heads = cfg.n_heads, cfg.n_kv_heads
    for t in plan:
        w = t.values(seed).numpy()
        k = kind(t)
        if k is not None:
            writer.write_tensor_data(quantize(arch.to_gguf(t.name, w, *heads), k))
        elif t.std is None:  # a norm: the converter writes norm_offset + w, what the norm multiplies by
            writer.write_tensor_data(w + np.float32(arch.norm_offset))
        else:  # a mixture's router, as it is
            writer.write_tensor_data(w)
        advance(w.size)
    writer.close()
