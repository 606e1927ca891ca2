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


def _bias(src, name: str, ranges=None) -> torch.Tensor | None:
    if not src.has(name):
        return None
    return src.get(name, torch.float32) if ranges is None else src.rows(name, ranges, torch.float32)


def load_attention(block, src, cfg: ModelConfig, layer: int, fmt: WeightFormat | torch.dtype) -> None:
    """Fill an AttentionBlock from `model.layers.{layer}.self_attn.*`, reading only its groups' rows."""
    fmt = as_format(fmt)
    p = f"model.layers.{layer}.self_attn."
    q, kv = _group_ranges(cfg, block.groups)
    qkv = cat_rows([src.matrix(p + "q_proj.weight", rows=q), src.matrix(p + "k_proj.weight", rows=kv),
                    src.matrix(p + "v_proj.weight", rows=kv)])
    bias = None
    if block.qkv.bias is not None:
        bias = torch.cat([_bias(src, p + "q_proj.bias", q), _bias(src, p + "k_proj.bias", kv),
                          _bias(src, p + "v_proj.bias", kv)])
    block.qkv = make_linear(qkv, bias, fmt)
    o_bias = _bias(src, p + "o_proj.bias") if block.o.bias is not None else None
    block.o = make_linear(src.matrix(p + "o_proj.weight", cols=q), o_bias, fmt)
    if block.q_norm is not None:  # one weight [head_dim] for every head: each block holds its own copy
        block.q_norm.weight.copy_(src.get(p + "q_norm.weight", block.q_norm.weight.dtype))
        block.k_norm.weight.copy_(src.get(p + "k_norm.weight", block.k_norm.weight.dtype))


def load_layer(layer_mod, src, cfg: ModelConfig, layer: int, fmt: WeightFormat | torch.dtype) -> None:
    """Fill a DecoderLayer with the weights of layer `layer`; its norms by their places in the architecture's
    layer (Gemma's post_attention_layernorm norms the attention's output, Llama's the FFN's input)."""
    fmt = as_format(fmt)
    p = f"model.layers.{layer}."
    for place, norm in layer_mod.norms().items():
        norm.weight.copy_(src.get(f"{p}{cfg.arch.norms[place]}.weight", norm.weight.dtype))
    load_attention(layer_mod.attn, src, cfg, layer, fmt)
    load_ffn(layer_mod.ffn, src, layer, fmt)


def load_ffn(ffn, src, layer: int, fmt: WeightFormat | torch.dtype) -> None:
    """Fill an FFN block from `model.layers.{layer}.mlp.*`."""
    fmt = as_format(fmt)
    p = f"model.layers.{layer}.mlp."
    biased = ffn.down.bias is not None
    gate_up = cat_rows([src.matrix(p + "gate_proj.weight"), src.matrix(p + "up_proj.weight")])
    bias = torch.cat([_bias(src, p + "gate_proj.bias"), _bias(src, p + "up_proj.bias")]) if biased else None
    ffn.gate_up = make_linear(gate_up, bias, fmt)
    ffn.down = make_linear(src.matrix(p + "down_proj.weight"), _bias(src, p + "down_proj.bias") if biased else None,
                           fmt)
