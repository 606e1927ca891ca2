"""Reads only the tensors a block needs (safetensors through `safe_open`, or GGUF blocks) and builds its
linear layers in the process's weight format through the one seam, `model/linear.py`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from edgespec.model.arch import LLAMA, Architecture
from edgespec.model.config import ModelConfig
from edgespec.model.ffn import Experts
from edgespec.model.linear import WeightFormat, as_format, make_linear
from edgespec.model.quant import cat_rows


class TensorSource:
    """Lazy access to the tensors of a safetensors folder (single file or sharded with an index), in the form the
    blocks use (`Architecture.from_hf`: Gemma's norm weights w as 1 + w)."""

    def __init__(self, folder: Path, arch: Architecture = LLAMA):
        folder = Path(folder)
        self.arch = arch
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: folder / file for name, file in weight_map.items()}
        elif (folder / "model.safetensors").exists():
            with safe_open(folder / "model.safetensors", framework="pt") as f:
                self._where = dict.fromkeys(f.keys(), folder / "model.safetensors")
        else:
            raise FileNotFoundError(f"no model.safetensors (or index) in {folder}")
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.arch.from_hf(name, self._handle(name).get_tensor(name)).to(dtype)

    def rows(self, name: str, ranges: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        """Rows [lo, hi) of each range, concatenated; only those rows are read from disk."""
        sl = self._handle(name).get_slice(name)
        return torch.cat([sl[lo:hi] for lo, hi in ranges], dim=0).to(dtype)

    def cols(self, name: str, ranges: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        sl = self._handle(name).get_slice(name)
        return torch.cat([sl[:, lo:hi] for lo, hi in ranges], dim=1).to(dtype)

    def matrix(self, name: str, rows=None, cols=None) -> torch.Tensor:
        """The matrix `name` as float32 (optionally only some rows or columns); GGUFSource has the same call."""
        if rows is not None:
            return self.rows(name, rows, torch.float32)
        return self.cols(name, cols, torch.float32) if cols is not None else self.get(name, torch.float32)


def open_source(files):
    """The tensor source of a ModelFiles (or a model folder): its GGUF file when it came from one, else its
    safetensors."""
    from edgespec.model.source import ModelFiles, resolve_model

    if not isinstance(files, ModelFiles):
        files = resolve_model(str(files))
    if files.gguf is not None:
        from edgespec.model.gguf_source import GGUFSource

        return GGUFSource(files.gguf, ModelConfig.from_folder(files.folder))
    return TensorSource(files.folder, ModelConfig.from_folder(files.folder).arch)


def _group_ranges(cfg: ModelConfig, groups: Sequence[int]) -> tuple[list, list]:
    """Row ranges of the query heads and of the KV heads that belong to `groups`."""
    hd, qpg = cfg.head_dim, cfg.queries_per_group
    q = [(g * qpg * hd, (g + 1) * qpg * hd) for g in groups]
    kv = [(g * hd, (g + 1) * hd) for g in groups]
    return q, kv


def _in_head_order(cfg: ModelConfig, ranges: list) -> list:
    """Whole heads' row ranges with each head's rows in ModelConfig.qk_head_order (q and k with partial rotary),
    adjacent ranges merged. -> row ranges"""
    hd, order = cfg.head_dim, cfg.qk_head_order()
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        for head in range(lo, hi, hd):
            for a, b in order:
                if out and out[-1][1] == head + a:
                    out[-1] = (out[-1][0], head + b)
                else:
                    out.append((head + a, head + b))
    return out


def _part_sizes(cfg: ModelConfig) -> dict[str, int]:
    # the rows of each projection of a layer, by its Hugging Face name (Architecture.stored stacks them)
    q, kv, inter = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": inter,
            "mlp.up_proj": inter}


def _part(src, cfg: ModelConfig, layer: int, part: str, rows=None, kind: str = "weight"):
    """Rows `rows` (row ranges; None: all) of projection `part` of layer `layer` ('self_attn.k_proj'), read from
    the tensor that holds it (Architecture.stored: its own, or the rows of a stacked one, Phi-3's qkv_proj): its
    matrix for kind 'weight', its float32 bias or None for 'bias'."""
    tensor, above = cfg.arch.stored(part)
    sizes = _part_sizes(cfg)
    offset = sum(sizes[p] for p in above)
    name = f"model.layers.{layer}.{tensor}.{kind}"
    ranges = [(lo + offset, hi + offset) for lo, hi in (rows or [(0, sizes[part])])]
    if kind == "weight":
        return src.matrix(name, rows=ranges)
    return src.rows(name, ranges, torch.float32) if src.has(name) else None


def _bias(src, name: str, ranges=None) -> torch.Tensor | None:
    if not src.has(name):
        return None
    return src.get(name, torch.float32) if ranges is None else src.rows(name, ranges, torch.float32)


def load_attention(block, src, cfg: ModelConfig, layer: int, fmt: WeightFormat | torch.dtype) -> None:
    """Fill an AttentionBlock from `model.layers.{layer}.self_attn.*`, reading only its groups' rows; q and k
    rows in ModelConfig.qk_head_order (the order the rotary tables turn them in), v's and o's as they are."""
    fmt = as_format(fmt)
    p = f"model.layers.{layer}.self_attn."
    q, kv = _group_ranges(cfg, block.groups)
    rows = {"q_proj": _in_head_order(cfg, q), "k_proj": _in_head_order(cfg, kv), "v_proj": kv}
    qkv = cat_rows([_part(src, cfg, layer, "self_attn." + n, r) for n, r in rows.items()])
    bias = None
    if block.qkv.bias is not None:
        bias = torch.cat([_part(src, cfg, layer, "self_attn." + n, r, "bias") for n, r in rows.items()])
    block.qkv = make_linear(qkv, bias, fmt)
    o_bias = _bias(src, p + "o_proj.bias") if block.o.bias is not None else None
    block.o = make_linear(src.matrix(p + "o_proj.weight", cols=q), o_bias, fmt)
    if block.q_norm is not None:  # one weight [head_dim] for every head: each block holds its own copy
        order = torch.cat([torch.arange(a, b) for a, b in cfg.qk_head_order()])  # [hd], as the rows are held
        block.q_norm.weight.copy_(src.get(p + "q_norm.weight", block.q_norm.weight.dtype)[order])
        block.k_norm.weight.copy_(src.get(p + "k_norm.weight", block.k_norm.weight.dtype)[order])


def load_layer(layer_mod, src, cfg: ModelConfig, layer: int, fmt: WeightFormat | torch.dtype) -> None:
    """Fill a DecoderLayer with the weights of layer `layer`; its norms by their places in the architecture's
    layer (Gemma's post_attention_layernorm norms the attention's output, Llama's the FFN's input)."""
    fmt = as_format(fmt)
    p = f"model.layers.{layer}."
    for place, norm in layer_mod.norms().items():
        norm.weight.copy_(src.get(f"{p}{cfg.arch.norms[place]}.weight", norm.weight.dtype))
    load_attention(layer_mod.attn, src, cfg, layer, fmt)
    load_ffn(layer_mod.ffn, src, cfg, layer, fmt)


def load_experts(moe, src, layer: int, fmt: WeightFormat) -> None:
    """Fill a mixture of experts from `model.layers.{layer}.mlp.gate` (the router, [E, H], where it has one) and
    each held expert's `mlp.experts.{e}.gate_proj`, `up_proj` and `down_proj` (the Hugging Face checkpoints'
    layout): only those are read."""
    p = f"model.layers.{layer}.mlp."
    if moe.router is not None:
        moe.router = make_linear(src.matrix(p + "gate.weight"), None, fmt)
    for e, ffn in zip(moe.held, moe.experts, strict=True):
        q = f"{p}experts.{e}."
        gate_up = cat_rows([src.matrix(q + "gate_proj.weight"), src.matrix(q + "up_proj.weight")])
        ffn.gate_up = make_linear(gate_up, None, fmt)
        ffn.down = make_linear(src.matrix(q + "down_proj.weight"), None, fmt)


def load_ffn(ffn, src, cfg: ModelConfig, layer: int, fmt: WeightFormat | torch.dtype) -> None:
    """Fill an FFN block from `model.layers.{layer}.mlp.*` (gate and up from their own tensors or Phi-3's
    gate_up_proj, as Architecture.stored says), or a mixture of experts (load_experts)."""
    fmt = as_format(fmt)
    if isinstance(ffn, Experts):
        load_experts(ffn, src, layer, fmt)
        return
    p = f"model.layers.{layer}.mlp."
    biased = ffn.down.bias is not None
    parts = ("mlp.gate_proj", "mlp.up_proj")
    gate_up = cat_rows([_part(src, cfg, layer, n) for n in parts])
    bias = torch.cat([_part(src, cfg, layer, n, kind="bias") for n in parts]) if biased else None
    ffn.gate_up = make_linear(gate_up, bias, fmt)
    ffn.down = make_linear(src.matrix(p + "down_proj.weight"), _bias(src, p + "down_proj.bias") if biased else None,
                           fmt)
