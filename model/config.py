"""Model card: the architecture numbers of a decoder model, read from a Hugging Face config (model/arch.py says
which architectures those are and what each adds to the Llama layer)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgespec.model.arch import LLAMA, Architecture, architecture

SUPPORTED_ROPE = ("default", "linear", "llama3")


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

    @property
    def queries_per_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, n_layers: int | None = None, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of K and V one token occupies over `n_layers` layers (all layers by default)."""
        layers = self.n_layers if n_layers is None else n_layers
        return 2 * layers * self.n_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8

    def layer_param_count(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * h
        return attn + 3 * h * self.intermediate_size + 2 * h

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        arch = architecture(d.get("model_type", "llama"))
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        n_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        # transformers 5 keeps theta and scaling together in rope_parameters; 4.x had them apart.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})")
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
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] of the rotary embedding, with the config's scaling applied."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    scaling = cfg.rope_scaling
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
