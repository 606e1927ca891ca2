"""The architectures edgespec serves, each described in one place: its names in Hugging Face configs and GGUF
files, its tensors' names in both formats, and what its layer adds to the Llama layer the blocks implement.

The rest of the code reads an `Architecture`; no file branches on a model's name. An architecture that is not
here is refused by name at load. What each one is was read from transformers' own modeling code and from
llama.cpp's converter (`convert_hf_to_gguf.py` and its `conversion/*.py`, from the `llama-cpp-python` source
distribution): which tensors exist, how they are named, and which are reordered on the way into a GGUF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch

# GGUF tensor name -> Hugging Face name, per layer ('blk.{i}.' / 'model.layers.{i}.' around them)
LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
QK_NORM_LAYER = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# a mixture's router, and its experts as llama.cpp's converter stacks them (Qwen2MoeModel: each projection of every
# expert in one [E, N, K] tensor, named as transformers 5's merged `mlp.experts.*`; gguf_source reads one expert's
# rows from it under the checkpoints' own `mlp.experts.{e}.*` names)
EXPERTS_LAYER = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                 "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
# Gemma 3's four norms a layer: its `post_attention_layernorm` norms the attention's output (Llama's is the FFN's
# input norm, Gemma's `pre_feedforward_layernorm`), so the same name means another place in the layer
GEMMA3_LAYER = {**LLAMA_LAYER, **QK_NORM_LAYER, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# the norms of a layer by their place: before attention, after it (on its output, before the residual add),
# before the FFN, after it -> their Hugging Face names
LLAMA_NORMS = {"attn_in": "input_layernorm", "ffn_in": "post_attention_layernorm"}
GEMMA3_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                "ffn_in": "pre_feedforward_layernorm", "ffn_out": "post_feedforward_layernorm"}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Phi-3's fused projections: llama.cpp's converter writes them as they are (no q/k permute: NEOX rotary), qkv_proj as
# attn_qkv and gate_up_proj as ffn_up (gguf's TensorNameMap), both halves in the one tensor
PHI3_LAYER = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
PHI3_STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


@dataclass(frozen=True)
class GGUFKeys:
    """Which of the metadata keys that not every architecture gets llama.cpp's converter writes for this one (its
    model class's set_gguf_parameters; model/synth_gguf.py writes a GGUF by them). The rest follow from the config:
    linear rope scaling's keys, the sliding layers' base, longrope's original context and attention factor.

    head_lengths: attention.key_length / value_length (TextModel's, from the config's head_dim).
    vocab_size: the vocabulary's size (LlamaModel's).
    rope_dimension_count: how many of a head's dims are rotated (LlamaModel: head_dim; Phi3MiniModel: the partial
      rotary's share).
    window_always: attention.sliding_window is the config's even where it narrows no layer, 0 where it has none
      (Phi3MiniModel); otherwise it is written where the window narrows layers (Gemma3Model).
    """

    head_lengths: bool = True
    vocab_size: bool = False
    rope_dimension_count: bool = False
    window_always: bool = False


# Granite's multipliers as GraniteModel writes them (GGUF key after '{arch}.' -> config field)
GRANITE_FIELDS = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                  "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
# LlamaModel's keys; Phi3MiniModel writes its own set, without TextModel's key and value lengths
LLAMA_KEYS = GGUFKeys(vocab_size=True, rope_dimension_count=True)
PHI3_KEYS = GGUFKeys(head_lengths=False, rope_dimension_count=True, window_always=True)


@dataclass(frozen=True)
class Architecture:
    """One decoder architecture.

    hf_types: the `model_type` values of its Hugging Face configs; gguf: its `general.architecture` in a GGUF.
    rotary_permuted: llama.cpp's converter reorders the rows of q and k (and of their norms) for its
      interleaved rotary layout (`LlamaModel.permute`); families with NEOX rotary (Qwen) are written as they are.
    qk_norm: an RMSNorm over each head's q and k before the rotary embedding (Qwen3), weights [head_dim].
    bias: (q/k/v, o) biases where the architecture fixes them (Qwen2: q, k and v always, o never); None: the
      config's `attention_bias` for all four.
    layer: GGUF -> Hugging Face names of a layer's tensors (without the 'blk.{i}.' and '.weight' ends).
    norms: a layer's norms by place ('attn_in', 'attn_out', 'ffn_in', 'ffn_out') -> Hugging Face names; 'attn_out'
      and 'ffn_out' (Gemma 3) norm the attention's and the FFN's output before the residual add.
    norm_offset: every RMSNorm multiplies by (norm_offset + w), in float32 and rounded after (Gemma 3: 1). Its
      Hugging Face checkpoints hold w, which the safetensors source turns into norm_offset + w at load
      (`from_hf`); llama.cpp's converter already writes norm_offset + w into a GGUF (`Gemma3Model.norm_shift`).
    embed_scaled: token embeddings are multiplied by sqrt(hidden_size) (Gemma: the tied head's are not).
    gguf_attn_scalar: the GGUF holds no query_pre_attn_scalar, and llama.cpp scales attention by
      key_length**-0.5, or (n_embd / n_head)**-0.5 for a 62-layer model (Gemma 3 27B); see `gguf_config`.
    stacked: checkpoint tensors that hold several projections' rows one after another -> those projections in
      row order (Phi-3: qkv_proj holds [q; k; v], gate_up_proj [gate; up]); the loader reads each projection's
      rows from where `stored` says, so the blocks see the same projections in every architecture.
    window_all_layers: the config's `sliding_window`, where set, narrows every layer (transformers' Phi3Model and
      MistralModel mask every layer with it; the layer_types of Gemma 3's and Ministral's configs say which layers
      instead).
    gguf_keys: the metadata keys llama.cpp's converter writes for it beyond every architecture's (GGUFKeys).
    nope_interval: where a config lists no NoPE layers (SmolLM3's no_rope_layers), every nope_interval-th layer
      turns no rotary embedding (transformers' default no_rope_layer_interval; llama.cpp's fixed
      n_no_rope_layer_step, the only rule its GGUFs of the architecture have); None: every layer turns.
    gguf_by_transformers: transformers' GGUF loader reads its files' config (False: SmolLM3, Granite;
      model/gguf_config.py reads them).
    gguf_fields: its own GGUF keys (after '{gguf}.') -> the config fields they hold, for model/gguf_config.py.
    """

    name: str
    hf_types: tuple[str, ...]
    gguf: str
    rotary_permuted: bool = False
    qk_norm: bool = False
    bias: tuple[bool, bool] | None = None
    layer: dict[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER))
    norms: dict[str, str] = field(default_factory=lambda: dict(LLAMA_NORMS))
    norm_offset: float = 0.0
    embed_scaled: bool = False
    gguf_attn_scalar: bool = False
    stacked: dict[str, tuple[str, ...]] = field(default_factory=dict)
    window_all_layers: bool = False
    gguf_keys: GGUFKeys = field(default_factory=GGUFKeys)
    nope_interval: int | None = None
    gguf_by_transformers: bool = True
    gguf_fields: dict[str, str] = field(default_factory=dict)

    def from_hf(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of a Hugging Face checkpoint as the blocks use it: a norm's w as float32 norm_offset + w
        (transformers' `1.0 + weight.float()`, the same float op, so the same bits), others as they are."""
        if self.norm_offset and hf_name.endswith("norm.weight"):
            return tensor.float() + self.norm_offset
        return tensor

    def gguf_config(self, meta: dict, n_layers: int, hidden: int, n_heads: int) -> dict:
        """Config fields a GGUF implies for this architecture that transformers' GGUF loader leaves at its
        defaults: query_pre_attn_scalar by llama.cpp's rule (see gguf_attn_scalar)."""
        if not self.gguf_attn_scalar:
            return {}
        key_length = meta.get(f"{self.gguf}.attention.key_length") or hidden // n_heads
        return {"query_pre_attn_scalar": hidden // n_heads if n_layers == 62 else int(key_length)}

    def stored(self, part: str) -> tuple[str, tuple[str, ...]]:
        """Where a layer's projection `part` ('self_attn.k_proj') is held: (the checkpoint tensor, the projections
        stacked above it in that tensor), or (part, ()) where it is a tensor of its own."""
        for tensor, parts in self.stacked.items():
            if part in parts:
                return tensor, parts[:parts.index(part)]
        return part, ()

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor ('blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'),
        or None for a tensor edgespec does not read (rope_freqs, for instance)."""
        base, _, kind = gguf_name.rpartition(".")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m and m.group(2) in self.layer:
            return f"model.layers.{m.group(1)}.{self.layer[m.group(2)]}.{kind}"
        return f"{TOP[base]}.{kind}" if base in TOP else None

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF name of a Hugging Face tensor (hf_name's inverse)."""
        top = {v: k for k, v in TOP.items()}
        base, _, kind = hf_name.rpartition(".")
        if base in top:
            return f"{top[base]}.{kind}"
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
        inverse = {v: k for k, v in self.layer.items()}
        if not m or m.group(2) not in inverse:
            raise KeyError(f"{hf_name!r} has no GGUF name in the {self.name} architecture")
        return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{kind}"

    def _permuted_heads(self, hf_name: str, n_heads: int, n_kv_heads: int) -> int | None:
        # how many heads the rows of `hf_name` hold when the converter reorders them, else None
        if not self.rotary_permuted:
            return None
        return {"q_proj": n_heads, "k_proj": n_kv_heads}.get(hf_name.split(".")[-2])

    def to_gguf(self, hf_name: str, rows: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
        """A tensor's rows [N, ...] in the order llama.cpp's converter writes them (`LlamaModel.permute`: each
        head's two halves interleaved, for its rotary layout), or as they are."""
        h = self._permuted_heads(hf_name, n_heads, n_kv_heads)
        if h is None:
            return rows
        return rows.reshape(h, 2, rows.shape[0] // h // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    def from_gguf(self, hf_name: str, rows: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
        """to_gguf undone: rows [N, ...] as a GGUF holds them (floats or whole rows of blocks) in Hugging Face
        order."""
        h = self._permuted_heads(hf_name, n_heads, n_kv_heads)
        if h is None:
            return rows
        n = rows.shape[0]
        return rows[np.arange(n).reshape(h, n // h // 2, 2).swapaxes(1, 2).reshape(n)]


LLAMA = Architecture("llama", ("llama",), "llama", rotary_permuted=True, gguf_keys=LLAMA_KEYS)
ARCHITECTURES = (
    LLAMA,
    # llama.cpp's converter writes Mistral's dense models through LlamaModel, as the llama architecture (without
    # their sliding window, which llama.cpp's llama has not: a GGUF's model sees every position, as llama.cpp's);
    # from a folder the window narrows every layer, as transformers' MistralModel masks them
    Architecture("mistral", ("mistral",), "llama", rotary_permuted=True, gguf_keys=LLAMA_KEYS, window_all_layers=True),
    # Ministral (Ministral-8B): Mistral with sliding and full layers as its config's layer_types say. llama.cpp's
    # converter has no MinistralForCausalLM (it refuses the folder), so no GGUF of it is read as one: its GGUF name
    # is Mistral's
    Architecture("ministral", ("ministral",), "llama", rotary_permuted=True, gguf_keys=LLAMA_KEYS),
    Architecture("qwen2", ("qwen2",), "qwen2", bias=(True, False)),
    Architecture("qwen3", ("qwen3",), "qwen3", qk_norm=True, layer={**LLAMA_LAYER, **QK_NORM_LAYER}),
    # Qwen3-MoE: Qwen3's attention, and in its sparse layers a mixture of experts for the FFN (ffn.Experts; the
    # config's num_experts and the rest, model/config.py)
    Architecture("qwen3_moe", ("qwen3_moe",), "qwen3moe", qk_norm=True,
                 layer={**LLAMA_LAYER, **QK_NORM_LAYER, **EXPERTS_LAYER}),
    # Gemma 3's text model (the text half of Gemma3ForConditionalGeneration has the same layers)
    Architecture("gemma3", ("gemma3_text",), "gemma3", qk_norm=True, layer=GEMMA3_LAYER, norms=GEMMA3_NORMS,
                 norm_offset=1.0, embed_scaled=True, gguf_attn_scalar=True),
    # Phi-3, Phi-3.5 and Phi-4-mini: a Llama layer with fused projections; their longrope scaling and partial
    # rotary (Phi-4-mini) are config fields (model/config.py)
    Architecture("phi3", ("phi3",), "phi3", layer=PHI3_LAYER, stacked=PHI3_STACKED, window_all_layers=True,
                 gguf_keys=PHI3_KEYS),
    # SmolLM3: a Llama layer, every fourth one without rotary embedding (NoPE); the converter's SmolLM3Model is
    # LlamaModel (its keys, q/k reordered) under its own architecture name
    Architecture("smollm3", ("smollm3",), "smollm3", rotary_permuted=True, gguf_keys=LLAMA_KEYS, nope_interval=4,
                 gguf_by_transformers=False),
    # Granite 3.x dense: a Llama layer; its multipliers are config fields (model/config.py), which the converter's
    # GraniteModel (LlamaModel without head_dim) writes as these keys
    Architecture("granite", ("granite",), "granite", rotary_permuted=True, gguf_keys=LLAMA_KEYS,
                 gguf_by_transformers=False, gguf_fields=GRANITE_FIELDS),
)


def gguf_architecture(name: str) -> Architecture | None:
    """The architecture of a GGUF's `general.architecture` where edgespec reads the file's config itself (see
    gguf_by_transformers), else None (transformers' loader reads it)."""
    return next((a for a in ARCHITECTURES if a.gguf == name and not a.gguf_by_transformers), None)


def architecture(model_type: str) -> Architecture:
    """The architecture of a Hugging Face `model_type`; an unknown one is refused by name."""
    for arch in ARCHITECTURES:
        if model_type in arch.hf_types:
            return arch
    known = ", ".join(t for a in ARCHITECTURES for t in a.hf_types)
    raise ValueError(f"model_type {model_type!r} is not supported (supported: {known})")
