"""Reads only the tensors a block needs from a Hugging Face safetensors folder (`safe_open`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from model.config import ModelConfig


class TensorSource:
    """Lazy access to the tensors of a safetensors folder (single file or sharded with an index)."""

    def __init__(self, folder: Path):
        folder = Path(folder)
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
        return self._handle(name).get_tensor(name).to(dtype)

    def rows(self, name: str, ranges: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        """Rows [lo, hi) of each range, concatenated; only those rows are read from disk."""
        sl = self._handle(name).get_slice(name)
        return torch.cat([sl[lo:hi] for lo, hi in ranges], dim=0).to(dtype)

    def cols(self, name: str, ranges: Sequence[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
        sl = self._handle(name).get_slice(name)
        return torch.cat([sl[:, lo:hi] for lo, hi in ranges], dim=1).to(dtype)


def _group_ranges(cfg: ModelConfig, groups: Sequence[int]) -> tuple[list, list]:
    """Row ranges of the query heads and of the KV heads that belong to `groups`."""
    hd, qpg = cfg.head_dim, cfg.queries_per_group
    q = [(g * qpg * hd, (g + 1) * qpg * hd) for g in groups]
    kv = [(g * hd, (g + 1) * hd) for g in groups]
    return q, kv


def load_attention(block, src: TensorSource, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
    """Fill an AttentionBlock from `model.layers.{layer}.self_attn.*`, reading only its groups' rows."""
    p = f"model.layers.{layer}.self_attn."
    q, kv = _group_ranges(cfg, block.groups)
    block.qkv.weight.copy_(
        torch.cat([src.rows(p + "q_proj.weight", q, dtype), src.rows(p + "k_proj.weight", kv, dtype),
                   src.rows(p + "v_proj.weight", kv, dtype)])
    )
    if block.qkv.bias is not None:
        block.qkv.bias.copy_(
            torch.cat([src.rows(p + "q_proj.bias", q, dtype), src.rows(p + "k_proj.bias", kv, dtype),
                       src.rows(p + "v_proj.bias", kv, dtype)])
        )
    block.o.weight.copy_(src.cols(p + "o_proj.weight", q, dtype))
    if block.o.bias is not None:
        block.o.bias.copy_(src.get(p + "o_proj.bias", dtype))


def load_layer(layer_mod, src: TensorSource, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
    """Fill a DecoderLayer with the weights of layer `layer`."""
    p = f"model.layers.{layer}."
    layer_mod.input_norm.weight.copy_(src.get(p + "input_layernorm.weight", dtype))
    layer_mod.post_norm.weight.copy_(src.get(p + "post_attention_layernorm.weight", dtype))
    load_attention(layer_mod.attn, src, cfg, layer, dtype)
    load_ffn(layer_mod.ffn, src, layer, dtype)


def load_ffn(ffn, src: TensorSource, layer: int, dtype: torch.dtype) -> None:
    """Fill an FFN block from `model.layers.{layer}.mlp.*`."""
    p = f"model.layers.{layer}.mlp."
    for kind in ("weight", "bias"):
        if getattr(ffn.down, kind) is None:
            continue
        gate, up = src.get(p + f"gate_proj.{kind}", dtype), src.get(p + f"up_proj.{kind}", dtype)
        getattr(ffn.gate_up, kind).copy_(torch.cat([gate, up]))
        getattr(ffn.down, kind).copy_(src.get(p + f"down_proj.{kind}", dtype))
