"""The parts of the model: a range of decoder layers (what a stage holds) and the token ends
(embedding, final norm, LM head: what the controller holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.model.blocks import CompiledLayers, DecoderLayer, Rotary, SeqRows, norm
from edgespec.model.config import ModelConfig
from edgespec.model.expert_split import Away, ExpertLinks, check_experts, split_layer_rows
from edgespec.model.huge_pages import hold_in_huge_pages
from edgespec.model.kv_cache import KVCache
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.kv_pool import KVPool
from edgespec.model.linear import F32Linear, Kernel, Linear, Q8Linear, WeightFormat, as_format, head_matrix, make_linear
from edgespec.model.module_list import ModuleList
from edgespec.model.quant import Q4, Q8, Interleaved, Matrix
from edgespec.model.weights import load_layer


class LayerStack(nn.Module):
    """Decoder layers [first, last) with their rotary tables; the payload of one pipeline stage. Its KV caches
    store keys and values in `kv` (model/kv_format.py). `away[layer]` names the experts of a sparse layer that
    the planner placed on other devices (device -> expert ids), reached over `links` (model/expert_split.py):
    the stack holds the rest."""

    def __init__(self, cfg: ModelConfig, first: int, last: int, dtype: torch.dtype, kv: KVFormat = FLOAT32,
                 away: Mapping[int, Away] | None = None, links: ExpertLinks | None = None):
        super().__init__()
        if not 0 <= first < last <= cfg.n_layers:
            raise ValueError(f"layer range [{first}, {last}) is outside the model's {cfg.n_layers} layers")
        away = {i: a for i, a in (away or {}).items() if any(a.values())}
        check_experts(cfg, first, last, away, {})
        if away and links is None:
            raise ValueError("a stack with experts placed away needs the links to them")
        kv.check(cfg.head_dim)
        self.cfg, self.first, self.last, self.dtype, self.kv = cfg, first, last, dtype, kv
        # each split layer's ids elsewhere as the tensors a pass tests its rows' choices against
        self.away = {i: {d: torch.tensor(list(ids), dtype=torch.long) for d, ids in a.items()} for i, a in away.items()}
        self.links = links
        self.rotary = Rotary(cfg, dtype)
        with torch.device("meta"):  # weights come from the checkpoint: skip random initialisation
            self.layers = ModuleList(DecoderLayer(cfg, dtype, i, self._held(i)) for i in range(first, last))
        self.layers.to_empty(device="cpu")
        # runs of compiled layers as one call each, once their weights are in (load)
        self.runs: list[CompiledLayers | int] = list(range(last - first))

    def _held(self, layer: int) -> list[int] | None:
        """The experts of `layer` held here (None: all of them, or a dense layer)."""
        if layer not in self.away:
            return None
        elsewhere = {e for ids in self.away[layer].values() for e in ids.tolist()}
        return [e for e in range(self.cfg.n_experts) if e not in elsewhere]

    @classmethod
    def load(cls, src, cfg: ModelConfig, first: int, last: int, fmt: WeightFormat | torch.dtype,
             kv: KVFormat = FLOAT32, away: Mapping[int, Away] | None = None,
             links: ExpertLinks | None = None) -> LayerStack:
        """Layers [first, last) from a tensor source, in weight format `fmt` (or the dense format of a dtype),
        their caches in KV format `kv`; without the experts placed `away` (read only where they are held)."""
        fmt = as_format(fmt)
        stack = cls(cfg, first, last, fmt.act, kv, away, links)
        with torch.no_grad():
            for i, layer in enumerate(stack.layers):
                load_layer(layer, src, cfg, first + i, fmt)
        hold_in_huge_pages([m for m in stack.modules() if isinstance(m, Kernel)])
        stack.runs = stack._runs()
        return stack

    def _runs(self) -> list[CompiledLayers | int]:
        """The layers in passes: each run of compiled layers as one call (layer.cpp's decoder_stack), a layer
        that is not compiled or has experts placed away by itself (its index)."""
        runs: list[CompiledLayers | int] = []
        together: list[int] = []
        for i, layer in enumerate(self.layers):
            if layer.compiled:
                together.append(i)
                continue
            if together:
                runs.append(CompiledLayers([self.layers[j] for j in together], together[0]))
                together = []
            runs.append(i)
        if together:
            runs.append(CompiledLayers([self.layers[j] for j in together], together[0]))
        return runs

    def one_by_one(self) -> None:
        """Run each layer as a call of its own from now on (the same bits: a probe's hooks see every layer)."""
        self.runs = list(range(len(self.layers)))

    def new_pool(self, nbytes: int, prefault: bool = False) -> KVPool:
        """A KV pool for these layers of as many blocks as `nbytes` holds (a stage's); prefault: see KVPool."""
        return KVPool.for_bytes(len(self.layers), self.cfg.n_kv_heads, self.cfg.head_dim, self.kv, nbytes,
                                prefault=prefault)

    def new_cache(self, capacity: int) -> KVCache:
        """A KV cache for these layers over a pool of its own (a drafter's, a tool's, a test's)."""
        return KVCache.alone(len(self.layers), self.cfg.n_kv_heads, self.cfg.head_dim, capacity, self.kv)

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence's hidden [1, T, H] at RoPE positions [1, T], written to cache slots start..start+T.

        mask: optional bool [1, T, start+T] (or broadcastable) of visible slots; causal by slot if None.
        Returns hidden [1, T, H].
        """
        b, t, _ = hidden.shape
        if b != 1:
            raise ValueError(f"a KV cache holds one sequence, the pass has {b} rows")
        return self.forward_rows(hidden[0], positions[0], [SeqRows(cache, start, t, mask)])[None]

    @torch.inference_mode()
    def forward_rows(self, hidden: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqRows]) -> torch.Tensor:
        """One pass over the rows of several sequences (a batch step): hidden [M, H] holds each sequence's
        rows in turn at RoPE positions [M], each written to its own cache. Every row's output is bitwise what
        its sequence gets in a pass of its own. Returns hidden [M, H]."""
        for s in seqs:
            s.cache.check_write(s.start, s.length)
            s.cache.ensure(s.start, s.start + s.length)
        rope = self.rotary(positions[None])  # [1, 1, M, hd]
        x = hidden.to(self.dtype)
        for run in self.runs:
            if isinstance(run, CompiledLayers):
                x = run(x, rope, seqs)
            elif self.first + run in self.away:
                assert self.links is not None  # the constructor's check
                x = split_layer_rows(self.layers[run], x, rope, seqs, run, self.first + run,
                                     self.away[self.first + run], self.links)
            elif len(seqs) == 1:  # the module's own call, so that its hooks see it (the same bits as rows)
                s = seqs[0]
                x = self.layers[run](x[None], rope, s.cache, run, s.start, s.mask)[0]
            else:
                x = self.layers[run].rows(x, rope, seqs, run)
        for s in seqs:
            s.cache.length = s.start + s.length
        return x


class Embedding(nn.Module):
    """Token embedding over a table [V, H] held as the source has it (a GGUF's Q8_0 or 4-bit blocks, or floats),
    or as a tied Q8 head holds it (Interleaved: the head's own tensors). scale: what the rows are multiplied by
    (ModelConfig.embed_scale: Gemma's sqrt(hidden_size), Granite's embedding_multiplier; rounded to the model's
    dtype as transformers rounds it), or None."""

    weight: torch.Tensor  # the buffer of a dense table

    def __init__(self, table: Matrix, dtype: torch.dtype, scale: float | None = None):
        super().__init__()
        self.table, self.dtype = table, dtype
        self.scale = None if scale is None else torch.tensor(scale).to(dtype)
        if isinstance(table, torch.Tensor):
            self.register_buffer("weight", table, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, T] -> [B, T, H]; quantized rows are d q (+ m) in float32, exact
        if isinstance(self.table, Q4 | Q8 | Interleaved):
            rows = self.table.dequantize_rows(ids).to(self.dtype)
        else:
            rows = F.embedding(ids, self.weight)
        return rows if self.scale is None else rows * self.scale

    def dense(self) -> torch.Tensor:
        """The table as floats [V, H] (training code)."""
        return self.table.dequantize() if isinstance(self.table, Q4 | Q8 | Interleaved) else self.weight


class TokenEnds(nn.Module):
    """Embedding, final norm and LM head: the token-level ends of the model, held by the controller.

    With tied embeddings (SmolLM2) the head computes over the embedding's own tensors, not a copy."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, embed: Embedding, lm_head: Linear):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed, self.lm_head = embed, lm_head
        self.norm = norm(cfg, cfg.hidden_size, dtype)
        self.requires_grad_(False)

    @classmethod
    def load(cls, src, cfg: ModelConfig, fmt: WeightFormat | torch.dtype) -> TokenEnds:
        fmt = as_format(fmt)
        table = src.matrix("model.embed_tokens.weight")
        tied = cfg.tie_word_embeddings or not src.has("lm_head.weight")
        if tied:
            table = head_matrix(table, fmt)
        if isinstance(table, torch.Tensor):
            table = table.to(fmt.act).contiguous()
        head = make_linear(table if tied else src.matrix("lm_head.weight"), None, fmt, role="head")
        if isinstance(head, Kernel):
            hold_in_huge_pages([head])  # before the embedding takes the head's tensors: it reads the moved ones
        if tied and isinstance(head, Q8Linear):
            table = head.interleaved()  # one copy of the table: the head's layout serves lookups too
        elif tied and isinstance(head, F32Linear):
            table = head.weight  # the same tensor, as before the move
        ends = cls(cfg, fmt.act, Embedding(table, fmt.act, cfg.embed_scale), head)
        with torch.no_grad():
            ends.norm.weight.copy_(src.get("model.norm.weight", ends.norm.weight.dtype))
        return ends

    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, T] -> hidden [B, T, H]
        return self.embed(ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [B, T, H] -> logits [B, T, V] in float32 (sampling math wants full precision), divided by
        # Granite's logits_scaling where it has one (transformers' float32 division, so the same bits)
        logits = self.lm_head(self.norm(hidden.to(self.dtype))).float()
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling
