"""Blocks of a Llama-family decoder: norm, rotary embedding, KV-group attention, FFN, decoder layer.

A layer is split into blocks so that a stage can hold whole layers or only some KV groups of a layer:
an AttentionBlock owns a set of KV groups (each a KV head with its query heads) and the matching columns
of the output projection, so the outputs of the blocks of one layer sum to the layer's attention output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig, rope_inv_freq
from model.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., H] -> [..., H]; the statistics in float32 like the reference (bf16 ones derail the model)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for rotary position embedding, looked up by position id."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, T] -> cos, sin [B, 1, T, hd] (broadcast over heads)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, hd]; rotate-half convention of the Hugging Face Llama weights.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class AttentionBlock(nn.Module):
    """Attention of the KV groups `groups` of one layer, and their share of the output projection."""

    def __init__(self, cfg: ModelConfig, groups: Sequence[int], dtype: torch.dtype, with_o_bias: bool):
        super().__init__()
        self.groups = list(groups)
        self.hd = cfg.head_dim
        self.n_kv = len(self.groups)
        self.n_q = self.n_kv * cfg.queries_per_group
        out = (self.n_q + 2 * self.n_kv) * self.hd
        self.qkv = nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias, dtype=dtype)
        self.o = nn.Linear(self.n_q * self.hd, cfg.hidden_size, bias=with_o_bias, dtype=dtype)
        self.requires_grad_(False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        layer: int,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        # x [B, T, H] (already normed) -> partial attention output [B, T, H]
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_q + 2 * self.n_kv, self.hd).transpose(1, 2)  # [B, heads, T, hd]
        cos, sin = rope
        qk = apply_rotary(qkv[:, : self.n_q + self.n_kv], cos, sin)  # q and k rotated in one pass
        q, k, v = qk[:, : self.n_q], qk[:, self.n_q :], qkv[:, self.n_q + self.n_kv :]
        keys, values = cache.write(layer, start, k, v)  # [B, n_kv, S, hd]
        # mask None means every cached slot is visible (one query token at the end of the cache).
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.n_q != self.n_kv)
        return self.o(attn.transpose(1, 2).reshape(b, t, self.n_q * self.hd))


class FFN(nn.Module):
    """SwiGLU feed-forward block with the gate and up projections fused into one matrix."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias, dtype=dtype)
        self.down = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, H] -> [B, T, H]
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer holding all of its KV groups."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = AttentionBlock(cfg, range(cfg.n_kv_heads), dtype, with_o_bias=cfg.o_bias)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ffn = FFN(cfg, dtype)

    def forward(self, x, rope, cache: KVCache, layer: int, start: int, mask) -> torch.Tensor:
        # x [B, T, H] -> [B, T, H]
        x = x + self.attn(self.input_norm(x), rope, cache, layer, start, mask)
        return x + self.ffn(self.post_norm(x))
