"""Model card: the architecture numbers of a decoder model, read from a Hugging Face config (model/arch.py says
which architectures those are and what each adds to the Llama layer)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgespec.model.arch import LLAMA, Architecture, architecture
from edgespec.model.kv_format import FLOAT32, KVFormat

SUPPORTED_ROPE = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# what some configs set that no block here computes: refused by name rather than served wrong
UNSUPPORTED_IF_SET = ("attn_logit_softcapping", "final_logit_softcapping")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a decoder of one of the architectures in model/arch.py (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)."""

    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    arch: Architecture = LLAMA
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5 (Gemma); None: hd
    sliding_window: int | None = None  # what a sliding layer's queries see: the last `sliding_window` positions
    sliding_layers: tuple[bool, ...] = ()  # per layer: sliding (config.layer_types); empty: none
    rope_local_theta: float | None = None  # the sliding layers' rotary base (unscaled); None: rope_theta's

    @property
    def queries_per_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, n_layers: int | None = None, fmt: KVFormat = FLOAT32) -> int:
        """Bytes of K and V one token occupies over `n_layers` layers (all layers by default) in KV format fmt."""
        layers = self.n_layers if n_layers is None else n_layers
        return 2 * layers * self.n_kv_heads * fmt.row(self.head_dim) * fmt.dtype.itemsize

    @property
    def attn_scale(self) -> float | None:
        """The attention logits' scale where it is not head_dim**-0.5 (Gemma's query_pre_attn_scalar**-0.5)."""
        qpas = self.query_pre_attn_scalar
        return None if qpas is None or qpas == self.head_dim else qpas**-0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (absolute index), or None for a layer that sees every position."""
        sliding = self.sliding_layers and self.sliding_layers[layer]
        return self.sliding_window if sliding else None

    def layer_param_count(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * h
        qk_norms = 2 * hd if self.arch.qk_norm else 0
        return attn + qk_norms + 3 * h * self.intermediate_size + len(self.arch.norms) * h

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        arch = architecture(d.get("model_type", "llama"))
        act = d.get("hidden_activation") or d.get("hidden_act", "silu")  # Gemma names it hidden_activation
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        for key in UNSUPPORTED_IF_SET:
            if d.get(key) is not None:
                raise ValueError(f"{key} = {d[key]} is not supported")
        n_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        # transformers 5 keeps theta and scaling together in rope_parameters (Gemma 3: one dict per layer type,
        # 'full_attention' and 'sliding_attention'); 4.x had them apart.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        local = rope.pop("sliding_attention", None)
        if local is None and d.get("rope_local_base_freq") is not None:  # 4.x Gemma 3 configs (the Hub's files)
            local = {"rope_type": "default", "rope_theta": d["rope_local_base_freq"]}
        rope = dict(rope.pop("full_attention", None) or rope)
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        for kind in (rope_type, (local or {}).get("rope_type", "default")):
            if kind not in SUPPORTED_ROPE:
                raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
        if local and local.get("rope_type", "default") != "default":
            raise ValueError(f"a scaled rope on sliding layers ({local['rope_type']!r}) is not supported")
        layer_types = d.get("layer_types") or ()
        if not layer_types and (pattern := d.get("sliding_window_pattern")):
            # 4.x Gemma 3 configs: every pattern-th layer global, the others sliding (transformers' reading of it)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(d["num_hidden_layers"])]
        kinds = set(layer_types) - {"sliding_attention", "full_attention"}
        if kinds:
            raise ValueError(f"layer types {sorted(kinds)} are not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            hidden_size=hidden,
            n_layers=d["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or hidden // n_heads,
            intermediate_size=d["intermediate_size"],
            vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling={**rope, "rope_type": rope_type},
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=arch.bias[0] if arch.bias else d.get("attention_bias", False),
            o_bias=arch.bias[1] if arch.bias else d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            arch=arch,
            hidden_act=act,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            sliding_window=d.get("sliding_window") if "sliding_attention" in layer_types else None,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_local_theta=float(local["rope_theta"]) if local and "rope_theta" in local else None,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] of the rotary embedding, with the config's scaling applied; local: the
    sliding layers' (their own base, unscaled: Gemma 3's rope_local_base_freq)."""
    hd = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaling = {} if local else cfg.rope_scaling
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, torch.where(wavelen < old_ctx / high, inv, blended))
    return inv.float()
