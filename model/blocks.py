"""Blocks of a Llama-family decoder: norm, rotary embedding, KV-group attention, decoder layer (its FFN or
mixture of experts: model/ffn.py).

A layer is split into blocks so that a stage can hold whole layers or only some KV groups of a layer:
an AttentionBlock owns a set of KV groups (each a KV head with its query heads) and the matching columns
of the output projection, so the outputs of the blocks of one layer sum to the layer's attention output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.model.config import ModelConfig, rope_attention_factor, rope_inv_freq
from edgespec.model.ffn import FFN, Experts
from edgespec.model.kv_cache import KVCache
from edgespec.model.linear import Kernel, compiled, kernels_take


@dataclass(frozen=True)
class SeqRows:
    """One sequence's share of a pass over several sequences: `length` rows written to `cache` at slots
    start..start+length; mask: bool [length, start+length] of visible slots, or None (causal)."""

    cache: KVCache
    start: int
    length: int
    mask: torch.Tensor | None = None


def fused(width: int) -> bool:
    # the kernels' vector loops take rows in multiples of 8 floats
    return width % 8 == 0


class RMSNorm(nn.Module):
    """RMS norm with its statistics in float32 (bf16 ones derail the model). In bf16 the normalised
    values are cast back before the weight multiplies them, as the reference does: the order of those
    roundings changes SmolLM2's greedy output. A float32 weight in a bf16 model (`norm()`: Gemma's) multiplies
    first and the product is rounded, as Gemma's reference does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., H] -> [..., H]
        # the kernel takes float32 rows and a float32 weight; float32 rows against a bf16 weight (a bf16 model's
        # norm fed float32 activations) take torch's, which widens the weight
        if x.dtype == self.weight.dtype == torch.float32 and fused(x.shape[-1]) and kernels_take(x, self.weight):
            return compiled().rms_norm(x, self.weight, self.eps)
        # torch.rms_norm, not F.rms_norm: the functional wrapper's checks cost more than the math here
        if x.dtype == torch.float32 or self.weight.dtype == torch.float32:
            return torch.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return self.weight * torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def norm(cfg: ModelConfig, size: int, dtype: torch.dtype) -> RMSNorm:
    """An RMSNorm of the architecture: its weight in float32 where the norm multiplies in float32 (norm_offset,
    Gemma), else in the model's dtype."""
    return RMSNorm(size, cfg.rms_norm_eps, torch.float32 if cfg.arch.norm_offset else dtype)


class Rotary(nn.Module):
    """Rotary position embedding: cos/sin tables looked up by position id.

    Called with positions [B, T], it returns the function that rotates q or k [B, heads, T, hd] at those
    positions, with the sliding layers' own rotation beside it where their base differs (Gemma 3). Every pass
    size uses the same elementwise ops, so a position's rotated q and k are bitwise the same alone or in a
    pass of many tokens (a matrix form for single tokens was faster in bf16 but rounded differently from the
    elementwise form, which broke the exact policies in the served format).

    With partial rotary (Phi-4-mini) the q and k rows are held in ModelConfig.qk_head_order, so the rotated pairs
    are (i, i + hd/2) for i < rotary_dim/2 as for a full head, and the dims that pass through get cos 1 and sin 0.
    longrope's attention factor multiplies the rotated dims' cos and sin (transformers' attention_scaling).
    """

    cos: torch.Tensor  # buffers [P, hd]
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, local: bool = False):
        super().__init__()
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        inv = rope_inv_freq(cfg, local)  # [r/2]
        still = cfg.head_dim // 2 - len(inv)  # dims per half that pass through
        freqs = torch.outer(t, torch.cat([inv, torch.zeros(still)]))  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        turns = torch.cat([torch.ones(len(inv), dtype=torch.bool), torch.zeros(still, dtype=torch.bool)]).repeat(2)
        scale = 1.0 if local else rope_attention_factor(cfg)  # x * 1.0 is x: full rotary keeps its bits
        cos = torch.where(turns, emb.cos() * scale, 1.0)  # exactly 1 and 0 where dims pass through
        sin = torch.where(turns, emb.sin() * scale, 0.0)
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self.local = Rotary(cfg, dtype, local=True) if cfg.rope_local_theta is not None and not local else None

    def forward(self, positions: torch.Tensor) -> Rope:
        # positions [B, T] -> the rotation at those positions ([B, 1, T, hd] tables each)
        local = self.local(positions) if self.local is not None else None
        return Rope(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1), positions, local)

    def span(self, start: int, end: int) -> Rope:
        """forward(positions start..end-1 of one sequence): the same tables as views of the buffers (the
        lookup's gather took ~90 us a call right after a pass of the model, in a feature drafter's steps)."""
        local = self.local.span(start, end) if self.local is not None else None
        return Rope(self.cos[None, None, start:end], self.sin[None, None, start:end], torch.arange(start, end)[None],
                    local)


class Rope:
    """The rotary tables cos, sin [B, 1, T, hd] of one pass at positions [B, T]; called on x [B, heads, T, hd] it
    rotates x (the fused blocks read cos and sin themselves). local: the sliding layers' Rope, or None (theirs
    is this one)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                 local: Rope | None = None):
        self.cos, self.sin, self.positions, self.local = cos, sin, positions, local

    def rows(self, a: int, b: int) -> Rope:
        """The rotation of rows a..b of a pass over several sequences' rows (tables [1, 1, M, hd])."""
        local = self.local.rows(a, b) if self.local is not None else None
        pos = self.positions[..., a:b] if self.positions is not None else None
        return Rope(self.cos[:, :, a:b], self.sin[:, :, a:b], pos, local)

    def for_layer(self, sliding: bool, rotates: bool = True) -> Rope:
        """The rotation of a layer: a sliding layer's own (its base) where it has one, none at all for a layer that
        does not rotate (SmolLM3's NoPE layers: tables of cos 1 and sin 0, so x * 1 + y * 0 is x exactly, and the
        fused kernels run such a layer as any other)."""
        if not rotates:
            return Rope(torch.ones_like(self.cos), torch.zeros_like(self.sin), self.positions)
        return self.local if sliding and self.local is not None else self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cos.dtype == torch.float32 and fused(self.cos.shape[-1]) and kernels_take(x, self.cos):
            return compiled().rope(x, self.cos, self.sin)
        return apply_rotary(x, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, hd]; rotate-half convention of the Hugging Face Llama weights.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class AttentionBlock(nn.Module):
    """Attention of the KV groups `groups` of one layer, and their share of the output projection; with the
    architecture's per-head q and k norms (Qwen3: one weight [head_dim] for every head) where it has them."""

    def __init__(self, cfg: ModelConfig, groups: Sequence[int], dtype: torch.dtype, with_o_bias: bool):
        super().__init__()
        self.groups = list(groups)
        self.hd = cfg.head_dim
        self.n_kv = len(self.groups)
        self.n_q = self.n_kv * cfg.queries_per_group
        out = (self.n_q + 2 * self.n_kv) * self.hd
        self.qkv = nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias, dtype=dtype)
        self.o = nn.Linear(self.n_q * self.hd, cfg.hidden_size, bias=with_o_bias, dtype=dtype)
        qk_norm = cfg.arch.qk_norm
        self.q_norm = norm(cfg, self.hd, dtype) if qk_norm else None
        self.k_norm = norm(cfg, self.hd, dtype) if qk_norm else None
        self.scale = cfg.attn_scale  # None: head_dim**-0.5
        self.requires_grad_(False)

    @property
    def compiled(self) -> bool:
        """Whether the block runs as one call (layer.cpp): both projections are compiled kernels, the q/k norms
        (where there are any) float32, and the logits scaled by head_dim**-0.5, as layer.cpp scales them."""
        norms = [n.weight for n in (self.q_norm, self.k_norm) if n is not None]
        return (isinstance(self.qkv, Kernel) and isinstance(self.o, Kernel) and fused(self.hd)
                and all(w.dtype == torch.float32 for w in norms) and self.scale is None)

    def weights(self):
        """The block's weights as layer.cpp's Attn (`compiled` must hold)."""
        q, k = self.q_norm, self.k_norm
        return compiled().Attn(self.qkv.kernel, self.o.kernel, self.n_q, self.n_kv, None if q is None else q.weight,
                               None if k is None else k.weight, 0.0 if q is None else q.eps)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache, layer: int, start: int, mask) -> torch.Tensor:
        # x [1, T, H] (already normed; one sequence: the cache's) -> partial attention output [1, T, H]
        if self.compiled:
            return compiled().attention_block(x.float(), self.weights(), rope.cos, rope.sin, *cache.storage(layer),
                                             start, _heads_mask(mask))
        b, t, _ = x.shape
        heads = self.n_q + 2 * self.n_kv
        qkv = self.qkv(x)  # [B, T, heads * hd]
        # -> [B, heads, T, hd]; with one token that is a plain view (fewer ops on the decoding path)
        qkv = qkv.view(b, heads, 1, self.hd) if t == 1 else qkv.view(b, t, heads, self.hd).transpose(1, 2)
        qk = qkv[:, : self.n_q + self.n_kv]
        # each head's q and k normed over head_dim (row by row: any pass shape); the architecture has both or none
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.n_q].contiguous()), self.k_norm(qk[:, self.n_q :].contiguous())],
                           dim=1)
        qk = rope(qk)  # q and k rotated together
        q, k, v = qk[:, : self.n_q], qk[:, self.n_q :], qkv[:, self.n_q + self.n_kv :]
        keys, values = (t.to(q.dtype) for t in cache.write(layer, start, k, v))  # [1, n_kv, S, hd]
        attn = attend(q, keys, values, start, mask, self.n_q != self.n_kv, self.scale)  # [B, n_q, T, hd]
        out = attn.reshape(b, 1, self.n_q * self.hd) if t == 1 else attn.transpose(1, 2).reshape(b, t, -1)
        return self.o(out)

    def rows(self, x: torch.Tensor, rope: Rope, seqs: Sequence[SeqRows], layer: int) -> torch.Tensor:
        """The block over the rows of several sequences in one pass: x [M, H] (normed) holds each sequence's
        rows in turn, rope their rotation [1, 1, M, hd], each sequence's keys and values written to its own
        cache's `layer`. Compiled, the q/k/v and output projections run once over all M rows and attention per
        sequence (layer.cpp's attention_rows, which attention_block runs for one sequence): every row gets the
        bits it gets alone. Otherwise each sequence runs on its own. -> the partial output [M, H]"""
        if self.compiled:
            hd = rope.cos.shape[-1]
            return compiled().attention_rows(x.float(), self.weights(), rope.cos.reshape(-1, hd),
                                             rope.sin.reshape(-1, hd), seq_kv(seqs, layer))
        return per_sequence(x, rope, seqs, lambda rows, r, s: self(rows, r, s.cache, layer, s.start, s.mask))


def seq_kv(seqs: Sequence[SeqRows], layer: int) -> list:
    """The sequences' caches of `layer` as the compiled calls take them (layer.cpp's SeqKV)."""
    k = compiled()
    return [k.SeqKV(*s.cache.storage(layer), s.start, s.length, _heads_mask(s.mask)) for s in seqs]


def per_sequence(x: torch.Tensor, rope: Rope, seqs: Sequence[SeqRows], fn) -> torch.Tensor:
    """fn(rows [1, T, H], their Rope, their SeqRows) -> [1, T, H] over each sequence's rows of x [M, H] in turn
    -> [M, H]."""
    outs, a = [], 0
    for s in seqs:
        b = a + s.length
        outs.append(fn(x[None, a:b], rope.rows(a, b), s)[0])
        a = b
    return torch.cat(outs)


def causal_mask(start: int, t: int) -> torch.Tensor:
    """Bool mask [T, start+T]: the query in slot start+i sees slots 0..start+i."""
    slots = torch.arange(start + t)
    return slots.unsqueeze(0) <= (start + torch.arange(t)).unsqueeze(1)


def window_mask(mask, positions: torch.Tensor | None, start: int, t: int, window: int):
    """`mask` (None: causal by slot) narrowed to a sliding window: the query at position p sees no key at a
    position <= p - window (transformers' sliding_window_overlay; llama.cpp's standard SWA). A slot before `start`
    holds position = slot (a committed prefix), the pass's slots its rows' positions [1, T] (a tree pass puts
    nodes at other slots). -> the same mask where no query reaches past its window, else bool [.., T, start+T]."""
    if positions is None or (start + t <= window and mask is None):
        return mask
    q = positions.reshape(-1)[-t:]  # [T]
    if int(q.max()) - window < 0:  # every key a query could see is within its window
        return mask
    keys = torch.cat([torch.arange(start), q])  # [S] the position each slot holds
    inside = keys.unsqueeze(0) > (q - window).unsqueeze(1)  # [T, S]
    if mask is None:
        return inside & causal_mask(start, t)
    return mask & inside[..., : mask.shape[-1]]


def _heads_mask(mask):
    # [T, S], [B or 1, T, S] or [B or 1, 1, T, S] -> [B or 1, 1, T, S] (None stays None: causal)
    return None if mask is None else mask.view(-1, 1, *mask.shape[-2:])


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, mask, gqa: bool,
           scale: float | None = None) -> torch.Tensor:
    """Attention of queries q [B, n_q, T, hd] at slots start.. over keys, values [B, n_kv, start+T, hd].

    mask: bool [T, start+T], [B or 1, T, start+T] or [B or 1, 1, T, start+T] of visible slots, or None
    (causal by slot). In float32 each query row attends in its own fixed order over exactly the slots it
    sees (model/kernels/ops.cpp): the same arithmetic as when that position is decoded alone. One SDPA call
    over all rows with a mask splits and sums the softmax differently by pass length (and, measured here,
    by a row's place in a batch), so a verification pass of K tokens rounded differently from K single-token
    steps and flipped near-ties. bf16 and fp16 keep that one call: they are not exact across pass shapes.
    scale: the logits' scale (Gemma's query_pre_attn_scalar**-0.5); None: head_dim**-0.5. The kernel scales by
    head_dim**-0.5, so q is scaled by the ratio first (a rounding apart from scaling the logits).
    """
    mask = _heads_mask(mask)
    if q.dtype == torch.float32 and fused(q.shape[-1]) and kernels_take(q, keys, values):
        if scale is not None:
            q = q * (scale * q.shape[-1] ** 0.5)
        return compiled().attention(q, keys, values, start, mask)
    if mask is None and q.shape[2] > 1:
        mask = causal_mask(start, q.shape[2])
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer holding all of its KV groups; with the architecture's norms of the attention's
    and the FFN's outputs where it has them (Gemma 3), a sliding window where the config makes layer `index`
    a sliding one (its own rotary base and a windowed mask), and no rotation where it makes it a NoPE layer."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0, experts: Sequence[int] | None = None):
        """experts: the experts of a sparse layer held here (every one by default; the planner's placement)."""
        super().__init__()
        norms = cfg.arch.norms
        self.input_norm = norm(cfg, cfg.hidden_size, dtype)
        self.attn = AttentionBlock(cfg, range(cfg.n_kv_heads), dtype, with_o_bias=cfg.o_bias)
        self.attn_out_norm = norm(cfg, cfg.hidden_size, dtype) if "attn_out" in norms else None
        self.post_norm = norm(cfg, cfg.hidden_size, dtype)  # the FFN's input norm
        self.ffn: FFN | Experts = Experts(cfg, dtype, experts) if cfg.sparse(index) else FFN(cfg, dtype)
        self.ffn_out_norm = norm(cfg, cfg.hidden_size, dtype) if "ffn_out" in norms else None
        self.window = cfg.window(index)
        self.rotates = cfg.rotates(index)
        self.residual = cfg.residual_multiplier  # Granite's: each block's output times it before the residual add

    def norms(self) -> dict[str, RMSNorm]:
        """The layer's norms by place (the keys of Architecture.norms)."""
        places = {"attn_in": self.input_norm, "attn_out": self.attn_out_norm, "ffn_in": self.post_norm,
                  "ffn_out": self.ffn_out_norm}
        return {k: v for k, v in places.items() if v is not None}

    @property
    def compiled(self) -> bool:
        """Whether the layer runs as one compiled call (layer.cpp's decoder_layer / decoder_layer_rows)."""
        return self.attention_compiled and self.ffn.compiled and self.ffn_out_norm is None and \
            (not isinstance(self.ffn, Experts) or self.ffn.whole)

    @property
    def attention_compiled(self) -> bool:
        """Whether the layer's first half runs as layer.cpp's attention_rows (its norms as rms_norm)."""
        return (self.attn.compiled and fused(self.input_norm.weight.shape[0]) and self.attn_out_norm is None
                and self.window is None and self.residual == 1.0)

    def attention(self, x, rope: Rope, cache: KVCache, layer: int, start: int, mask) -> torch.Tensor:
        """x [1, T, H] (the layer's input, not normed) -> the attention's output [1, T, H], normed where the
        architecture norms it and times the residual multiplier (Granite), before the residual add; a sliding layer
        attends within its window."""
        rope = rope.for_layer(self.window is not None, self.rotates)
        if self.window is not None:
            mask = window_mask(mask, rope.positions, start, x.shape[1], self.window)
        out = self.attn(self.input_norm(x), rope, cache, layer, start, mask)
        out = out if self.attn_out_norm is None else self.attn_out_norm(out)
        return out if self.residual == 1.0 else out * self.residual

    def feed_forward(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, T, H] (the post-attention state) -> the FFN's output, normed where the architecture norms it and
        times the residual multiplier (Granite), before the residual add."""
        out = self.ffn(self.post_norm(z))
        out = out if self.ffn_out_norm is None else self.ffn_out_norm(out)
        return out if self.residual == 1.0 else out * self.residual

    def forward(self, x, rope: Rope, cache: KVCache, layer: int, start: int, mask) -> torch.Tensor:
        # x [1, T, H] (one sequence: the cache's) -> [1, T, H]
        if self.compiled:
            # one call: the same kernels in the same order as the blocks below, without ~20 dispatches
            rope = rope.for_layer(False, self.rotates)
            return compiled().decoder_layer(x.float(), self.weights(), rope.cos, rope.sin, *cache.storage(layer),
                                           start, _heads_mask(mask))
        x = x + self.attention(x, rope, cache, layer, start, mask)
        return x + self.feed_forward(x)

    def weights(self):
        """The layer's weights as layer.cpp's LayerWeights (for CompiledLayers; `compiled` must hold)."""
        return compiled().LayerWeights(self.input_norm.weight, self.post_norm.weight, self.input_norm.eps,
                                       self.attn.weights(), self.ffn.weights())

    def rows(self, x: torch.Tensor, rope: Rope, seqs: Sequence[SeqRows], layer: int) -> torch.Tensor:
        """The layer over the rows of several sequences in one pass: x [M, H] holds each sequence's rows in
        turn, rope their rotation [1, 1, M, hd]. Compiled, the projections and the FFN run once over all M
        rows, attention per sequence (layer.cpp's decoder_layer_rows): every row gets the bits it gets alone; a
        mixture's experts each read their weights once for every row that chose them (ffn.cpp). Otherwise each
        sequence runs on its own, a mixture's experts still once over all M rows. -> [M, H]"""
        if self.compiled:
            cos, sin = self._rows_rope(rope)
            return compiled().decoder_layer_rows(x.float(), self.weights(), cos, sin, seq_kv(seqs, layer))
        if isinstance(self.ffn, Experts):  # the experts once over every sequence's rows
            z = self.post_attention_rows(x, rope, seqs, layer)
            return z + self.feed_forward(z[None])[0]
        return per_sequence(x, rope, seqs, lambda rows, r, s: self(rows, r, s.cache, layer, s.start, s.mask))

    def post_attention_rows(self, x: torch.Tensor, rope: Rope, seqs: Sequence[SeqRows], layer: int) -> torch.Tensor:
        """Z, the post-attention state [M, H], of the rows of several sequences (arguments as rows'): compiled,
        decoder_layer_rows' first half op for op (so the same bits); otherwise each sequence on its own."""
        if self.attention_compiled:
            cos, sin = self._rows_rope(rope)
            x = x.float()
            return x + compiled().attention_rows(self.input_norm(x), self.attn.weights(), cos, sin, seq_kv(seqs, layer))
        return per_sequence(x, rope, seqs,
                            lambda rows, r, s: rows + self.attention(rows, r, s.cache, layer, s.start, s.mask))

    def _rows_rope(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's rotation of a pass's rows as the compiled calls take it: cos, sin [M, hd]."""
        hd, rope = rope.cos.shape[-1], rope.for_layer(False, self.rotates)
        return rope.cos.reshape(-1, hd), rope.sin.reshape(-1, hd)

    def parts(self, x, rope, cache: KVCache, layer: int, start: int, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() in its two halves: Z, the post-attention state [B, T, H], and X, the layer's output."""
        z = x + self.attention(x, rope, cache, layer, start, mask)
        return z, z + self.feed_forward(z)


class CompiledLayers:
    """Decoder layers that are all `compiled`, run as one call (layer.cpp's decoder_stack): the arithmetic of
    DecoderLayer.rows layer by layer, so the same bits, without a Python call per layer (SmolLM2-135M's 30 layers
    on a 2-core EPYC, medians of 60 alternated passes over a 100-token cache: 3.5 ms against 4.3 at one row, 5.0
    against 5.8 at four). Their weights are gathered once: build it after the layers' weights are loaded
    (LayerStack.load)."""

    def __init__(self, layers: Sequence[DecoderLayer], first: int = 0):
        """layers: consecutive layers of a stack, the first of them its layer `first` (their caches' index)."""
        if not all(layer.compiled for layer in layers):
            raise ValueError("every layer must be compiled")
        self.weights = [layer.weights() for layer in layers]
        self.rotates = [layer.rotates for layer in layers]
        self.first = first

    def __call__(self, x: torch.Tensor, rope: Rope, seqs: Sequence[SeqRows]) -> torch.Tensor:
        """x [M, H] holds each sequence's rows in turn, rope their rotation [1, 1, M, hd] -> [M, H]."""
        k, hd = compiled(), rope.cos.shape[-1]
        tables = {r: rope.for_layer(False, r) for r in set(self.rotates)}
        cos = {r: t.cos.reshape(-1, hd) for r, t in tables.items()}
        sin = {r: t.sin.reshape(-1, hd) for r, t in tables.items()}
        a, b = self.first, self.first + len(self.weights)
        kv = []
        for s in seqs:
            keys, values, table = s.cache.every_layer()
            kv.append(k.SeqLayers(keys[a:b], values[a:b], table, s.start, s.length, _heads_mask(s.mask)))
        return k.decoder_stack(x.float(), self.weights, [cos[r] for r in self.rotates], [sin[r] for r in self.rotates],
                               kv)
