"""Model card: the architecture numbers of a decoder model, read from a Hugging Face config (model/arch.py says
which architectures those are and what each adds to the Llama layer)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from edgespec.model.arch import LLAMA, Architecture, architecture
from edgespec.model.kv_format import FLOAT32, KVFormat

SUPPORTED_ROPE = ("default", "linear", "llama3", "longrope")
ROPE_ALIASES = {"su": "longrope"}  # the name of longrope in older Phi-3 configs (transformers and llama.cpp agree)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# what some configs set that no block here computes: refused by name rather than served wrong
UNSUPPORTED_IF_SET = ("attn_logit_softcapping", "final_logit_softcapping")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a decoder of one of the architectures in model/arch.py (Llama 2/3, Mistral, Ministral, Qwen2, Qwen3,
    Qwen3-MoE, Gemma 3, Phi-3, SmolLM3, Granite), with its rope: scaled (linear, llama3, longrope), partial
    (Phi-4-mini), on no layer (SmolLM3's NoPE layers), windowed where the config says; and its experts where it
    has them."""

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
    partial_rotary_factor: float = 1.0  # the share of each head's dims the rotary embedding turns (Phi-4-mini: 0.75)
    nope_layers: tuple[bool, ...] = ()  # per layer: no rotary embedding at all (SmolLM3's NoPE layers); empty: none
    # Granite's multipliers: of the token embeddings (None: 1, or Gemma's sqrt(hidden)), the attention logits'
    # scale in place of head_dim**-0.5, of each block's output before its residual add; the logits divided by
    # logits_scaling
    embedding_multiplier: float | None = None
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # a mixture of experts (Qwen3-MoE): each sparse layer's FFN is n_experts SwiGLU experts of expert_size, of which
    # a router picks experts_per_token for each row (their weights renormalised to sum 1 where norm_topk_prob);
    # sparse_layers per layer (empty: every layer dense)
    n_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()

    @property
    def queries_per_group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, n_layers: int | None = None, fmt: KVFormat = FLOAT32) -> int:
        """Bytes of K and V one token occupies over `n_layers` layers (all layers by default) in KV format fmt."""
        layers = self.n_layers if n_layers is None else n_layers
        return 2 * layers * self.n_kv_heads * fmt.row(self.head_dim) * fmt.dtype.itemsize

    @property
    def rotary_dim(self) -> int:
        """How many of a head's dims are rotated: the first rotary_dim of the model's own order (transformers'
        int(head_dim * partial_rotary_factor)); the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    def qk_head_order(self) -> list[tuple[int, int]]:
        """The order in which each head's q and k dims are held, as ranges of the model's own dims: the kernels
        rotate pairs (i, i + head_dim/2), the model pairs (i, i + rotary_dim/2) among its first rotary_dim dims,
        so with partial rotary the rotated halves are moved to [0, r/2) and [hd/2, hd/2 + r/2) and the dims that
        pass through fill the rest (the rotary tables give those cos 1 and sin 0: x * 1 + y * 0 is x exactly).
        The same order in q and k leaves every q.k, so attention, as it is; v keeps its order. [(0, hd)]: none."""
        hd, r = self.head_dim, self.rotary_dim
        if r == hd:
            return [(0, hd)]
        rest = (hd - r) // 2
        return [(0, r // 2), (r, r + rest), (r // 2, r), (r + rest, hd)]

    @property
    def attn_scale(self) -> float | None:
        """The attention logits' scale where it is not head_dim**-0.5 (Gemma's query_pre_attn_scalar**-0.5,
        Granite's attention_multiplier)."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        qpas = self.query_pre_attn_scalar
        return None if qpas is None or qpas == self.head_dim else qpas**-0.5

    @property
    def embed_scale(self) -> float | None:
        """What token embeddings are multiplied by (Gemma: sqrt(hidden_size); Granite: embedding_multiplier), or
        None (the tied head's rows are not scaled in either)."""
        return self.hidden_size**0.5 if self.arch.embed_scaled else self.embedding_multiplier

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (absolute index), or None for a layer that sees every position."""
        sliding = self.sliding_layers and self.sliding_layers[layer]
        return self.sliding_window if sliding else None

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` (absolute index) turns q and k by the rotary embedding (a NoPE layer does not)."""
        return not (self.nope_layers and self.nope_layers[layer])

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer` (absolute index) has a mixture of experts for its FFN."""
        return bool(self.sparse_layers and self.sparse_layers[layer])

    @property
    def expert_params(self) -> int:
        """Parameters of one expert of a mixture (its gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_size

    def layer_param_count(self) -> int:
        """Parameters of a layer (the largest: a sparse one where the model has any, every expert counted)."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * h
        qk_norms = 2 * hd if self.arch.qk_norm else 0
        ffn = (self.n_experts * (self.expert_params + h) if any(self.sparse_layers)
               else 3 * h * self.intermediate_size)
        return attn + qk_norms + ffn + len(self.arch.norms) * h

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
        head_dim = d.get("head_dim") or hidden // n_heads
        # transformers 5 keeps theta and scaling together in rope_parameters (Gemma 3: one dict per layer type,
        # 'full_attention' and 'sliding_attention'); 4.x had them apart.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        local = rope.pop("sliding_attention", None)
        if local is None and d.get("rope_local_base_freq") is not None:  # 4.x Gemma 3 configs (the Hub's files)
            local = {"rope_type": "default", "rope_theta": d["rope_local_base_freq"]}
        rope = dict(rope.pop("full_attention", None) or rope)
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        rope_type = rope.pop("rope_type", None) or rope.pop("type", "default")
        rope_type = ROPE_ALIASES.get(rope_type, rope_type)
        partial = float(rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0)
        if not 2 <= int(head_dim * partial) <= head_dim or int(head_dim * partial) % 2:
            raise ValueError(f"partial_rotary_factor {partial} of a head of {head_dim} rotates no whole pairs of dims")
        if rope_type == "longrope":
            rope = longrope_parameters(rope, d)
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
        window = d.get("sliding_window")
        if arch.window_all_layers and not layer_types and window and window < d.get("max_position_embeddings", 2048):
            layer_types = ["sliding_attention"] * d["num_hidden_layers"]  # a window past the context narrows nothing
        kinds = set(layer_types) - {"sliding_attention", "full_attention"}
        if kinds:
            raise ValueError(f"layer types {sorted(kinds)} are not supported")
        n_layers = d["num_hidden_layers"]
        # SmolLM3's no_rope_layers: 1 where a layer turns q and k, 0 where it does not; without them every
        # interval-th layer does not (transformers' default, and llama.cpp's fixed rule for its GGUFs)
        rope_flags = d.get("no_rope_layers")
        if rope_flags is None and arch.nope_interval is not None:
            interval = d.get("no_rope_layer_interval") or arch.nope_interval
            rope_flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
        if rope_flags is not None and len(rope_flags) < n_layers:
            raise ValueError(f"no_rope_layers has {len(rope_flags)} entries for {n_layers} layers")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers' Qwen3MoeDecoderLayer: a layer is sparse unless listed in mlp_only_layers, every
        # decoder_sparse_step-th one, where the model has experts (the Hub's configs name them num_experts,
        # transformers 5 writes num_local_experts)
        experts = d.get("num_experts") or d.get("num_local_experts") or 0
        step, dense = d.get("decoder_sparse_step") or 1, d.get("mlp_only_layers") or ()
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n_layers))
        return cls(
            hidden_size=hidden,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
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
            sliding_window=window if "sliding_attention" in layer_types else None,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_local_theta=float(local["rope_theta"]) if local and "rope_theta" in local else None,
            partial_rotary_factor=partial,
            embedding_multiplier=_multiplier(d, "embedding_multiplier"),
            attention_multiplier=d.get("attention_multiplier"),
            residual_multiplier=_multiplier(d, "residual_multiplier") or 1.0,
            logits_scaling=_multiplier(d, "logits_scaling") or 1.0,
            nope_layers=tuple(not flag for flag in rope_flags[:n_layers]) if rope_flags and not all(rope_flags) else (),
            n_experts=experts,
            experts_per_token=(d.get("num_experts_per_tok") or 0) if experts else 0,
            expert_size=(d.get("moe_intermediate_size") or 0) if experts else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob")) if experts else False,
            sparse_layers=sparse if any(sparse) else (),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """The config of a Hugging Face folder; its end ids those of config.json and of generation_config.json,
        which transformers' generate stops on too (Phi-3's and Phi-4-mini's end of turn, <|end|>, is only
        there: their config.json names <|endoftext|>)."""
        cfg = cls.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()))
        generation = Path(folder) / "generation_config.json"
        eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
        more = [i for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])
                if i not in cfg.eos_token_ids]
        return replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(more)) if more else cfg


def _multiplier(d: dict, key: str) -> float | None:
    # a Granite multiplier of config `d`, None where it is absent or 1 (multiplying by 1 changes nothing)
    value = d.get(key)
    return None if value is None or value == 1.0 else float(value)


def longrope_parameters(rope: dict, d: dict) -> dict:
    """A longrope config's scaling as rope_inv_freq and rope_attention_factor read it: its short and long factors
    (one per rotated frequency), original_max_position_embeddings (in rope_parameters, or the config's own field in
    Phi-3's configs) and the attention factor, transformers' rule where the config gives none: from `factor`, else
    from max_position_embeddings / original_max_position_embeddings (what llama.cpp's converter writes, too)."""
    original = rope.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if original is None or not rope.get("short_factor") or not rope.get("long_factor"):
        raise ValueError("a longrope config needs short_factor, long_factor and original_max_position_embeddings")
    factor = rope.get("factor") or d.get("max_position_embeddings", 2048) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"short_factor": [float(f) for f in rope["short_factor"]],
            "long_factor": [float(f) for f in rope["long_factor"]],
            "original_max_position_embeddings": int(original), "attention_factor": float(attention)}


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What the rotary embedding's cos and sin are multiplied by (longrope's attention factor), else 1."""
    return cfg.rope_scaling.get("attention_factor", 1.0) if cfg.rope_scaling.get("rope_type") == "longrope" else 1.0


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] of the rotary embedding, with the config's scaling applied; local: the
    sliding layers' (their own base, unscaled: Gemma 3's rope_local_base_freq).

    longrope divides each frequency by its own factor, the long ones where the served context
    (max_position_embeddings: the positions the rotary tables hold) exceeds original_max_position_embeddings,
    else the short ones: llama.cpp's rule (`get_rope_factors`), chosen once at load. transformers instead switches
    per pass on the pass's last position, so the same position would rotate differently in passes of other
    lengths; here a position's rotation never depends on the pass it is in (model/blocks.py: Rotary)."""
    r = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    assert theta is not None, "local tables are built only for a config with rope_local_theta"
    inv = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    scaling = {} if local else cfg.rope_scaling
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":
        longer = cfg.max_position_embeddings > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if longer else "short_factor"], dtype=torch.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"longrope has {len(factors)} factors for {len(inv)} rotary frequencies")
        inv = inv / factors
    elif kind == "linear":
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
