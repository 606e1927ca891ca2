"""The parts of the model: a range of decoder layers (what a stage holds) and the token ends
(embedding, final norm, LM head: what the controller holds)."""

from __future__ import annotations

import torch
from torch import nn

from model.blocks import DecoderLayer, RMSNorm, Rotary
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.packed import pack_linears
from model.weights import TensorSource, load_layer


def causal_mask(start: int, t: int) -> torch.Tensor:
    """Bool mask [T, start+T]: the query in slot start+i sees slots 0..start+i."""
    slots = torch.arange(start + t)
    return slots.unsqueeze(0) <= (start + torch.arange(t)).unsqueeze(1)


class LayerStack(nn.Module):
    """Decoder layers [first, last) with their rotary tables; the payload of one pipeline stage."""

    def __init__(self, cfg: ModelConfig, first: int, last: int, dtype: torch.dtype):
        super().__init__()
        if not 0 <= first < last <= cfg.n_layers:
            raise ValueError(f"layer range [{first}, {last}) is outside the model's {cfg.n_layers} layers")
        self.cfg, self.first, self.last, self.dtype = cfg, first, last, dtype
        self.rotary = Rotary(cfg, dtype)
        with torch.device("meta"):  # weights come from the checkpoint: skip random initialisation
            self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(first, last))
        self.layers.to_empty(device="cpu")

    @classmethod
    def load(cls, src: TensorSource, cfg: ModelConfig, first: int, last: int, dtype: torch.dtype) -> LayerStack:
        stack = cls(cfg, first, last, dtype)
        with torch.no_grad():
            for i, layer in enumerate(stack.layers):
                load_layer(layer, src, cfg, first + i, dtype)
        return pack_linears(stack)

    def new_cache(self, capacity: int, rows: int = 1, initial: int | None = None) -> KVCache:
        """A KV cache for these layers; storage for `initial` slots at first (default: all), grown on demand."""
        return KVCache(len(self.layers), self.cfg.n_kv_heads, self.cfg.head_dim, capacity, self.dtype, rows=rows,
                       initial=initial)

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [B, T, H] at RoPE positions [B, T], written to cache slots start..start+T.

        mask: optional bool [B, T, start+T] (or broadcastable) of visible slots; causal by slot if None.
        Returns hidden [B, T, H].
        """
        b, t, _ = hidden.shape
        cache.check_write(start, t, b)
        cache.ensure(start + t)
        if mask is None and t > 1:
            mask = causal_mask(start, t)
        elif mask is not None:
            mask = mask.unsqueeze(1) if mask.dim() == 3 else mask  # broadcast over heads
        rope = self.rotary(positions)
        x = hidden.to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i, start, mask)
        cache.length = start + t
        return x


class TokenEnds(nn.Module):
    """Embedding, final norm and LM head: the token-level ends of the model, held by the controller."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        with torch.device("meta"):
            # _weight skips the random initialisation, which costs a second even on the meta device
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                      _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device="cpu")
        self.requires_grad_(False)

    @classmethod
    def load(cls, src: TensorSource, cfg: ModelConfig, dtype: torch.dtype) -> TokenEnds:
        ends = cls(cfg, dtype)
        with torch.no_grad():
            ends.embed.weight.copy_(src.get("model.embed_tokens.weight", dtype))
            ends.norm.weight.copy_(src.get("model.norm.weight", dtype))
            if cfg.tie_word_embeddings or not src.has("lm_head.weight"):
                ends.lm_head.weight = ends.embed.weight  # tied: one tensor, not two copies
            else:
                ends.lm_head.weight.copy_(src.get("lm_head.weight", dtype))
        return pack_linears(ends)

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, T] -> hidden [B, T, H]
        return self.embed(ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [B, T, H] -> logits [B, T, V] in float32 (sampling math wants full precision)
        return self.lm_head(self.norm(hidden.to(self.dtype))).float()
