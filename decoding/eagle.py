"""A feature drafter (EAGLE, Li et al. 2024): one small decoder layer that predicts the target's next final
hidden state from its current one and the next token, read out through the target's own head.

The target's final hidden states come for free with every forward pass (the controller applies the final norm
and head itself, also when the layers run on workers), so this drafter sees what the target "thinks" at each
accepted position, not only its tokens, and it predicts the target's next token far better than a standalone
model of its size would.

Feature space: g = the target's final norm applied to its last layer's output, i.e. what the head reads.
At draft index i the drafter reads (g_{i-1}, embedding of x_i) and predicts g_i, whose head logits give x_{i+1}.
The head is restricted to the `vocab` ids the target most often emits (its full 49k-row head costs as much as
eight of its layers); drafts outside it are simply never proposed, which keeps the rule exact.

Trained by `edgespec train-drafter` (decoding/training/train_drafter.py); the file holds the fc and layer weights,
the vocabulary ids and a fingerprint of the target's embedding, checked at load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from edgespec.decoding.draft_model import draft_sampler
from edgespec.decoding.target_fit import check_target, restricted_head, target_metadata
from edgespec.decoding.types import SamplingParams
from edgespec.model.blocks import CompiledLayers, DecoderLayer, Rotary, SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.kv_cache import KVCache
from edgespec.model.kv_format import FLOAT32
from edgespec.model.linear import pack_linears
from edgespec.model.stack import TokenEnds


class FeatureNet(nn.Module):
    """fc([g_prev, emb(x)]) -> one decoder layer -> (the target's final norm) -> predicted g; trainable, and
    the inference module. The target's own final norm gives the prediction the scale the head expects."""

    vocab: torch.Tensor  # the buffer

    def __init__(self, cfg: ModelConfig, vocab: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype)
        self.layer = DecoderLayer(cfg, dtype)
        self.rotary = Rotary(cfg, dtype)
        self.register_buffer("vocab", vocab.long())  # [N] target ids the head may propose

    def block(self, g_prev: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Training forward, causal over whole sequences: g_prev, emb [B, T, H], positions [B, T] -> the layer's
        output [B, T, H] (the target's final norm of it is the predicted g)."""
        layer, attn = self.layer, self.layer.attn
        x = self.fc(torch.cat([g_prev, emb], dim=-1))
        b, t, _ = x.shape
        heads = attn.n_q + 2 * attn.n_kv
        qkv = attn.qkv(layer.input_norm(x)).view(b, t, heads, attn.hd).transpose(1, 2)  # [B, heads, T, hd]
        qk = self.rotary(positions)(qkv[:, :attn.n_q + attn.n_kv])
        q, k, v = qk[:, :attn.n_q], qk[:, attn.n_q:], qkv[:, attn.n_q + attn.n_kv:]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, n_q, T, hd]
        x = x + attn.o(out.transpose(1, 2).reshape(b, t, -1))
        return x + layer.ffn(layer.post_norm(x))

    def save(self, path: Path, ends: TokenEnds, record: dict) -> None:
        """Weights (bf16: halves the file, and serving runs bf16) and metadata, with the training record."""
        tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata=target_metadata(ends))
        path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


class FeatureDraftModel:
    """A trained FeatureNet bound to the served model's token ends; shared by every request."""

    def __init__(self, name: str, net: FeatureNet, ends: TokenEnds):
        self.name, self.net, self.ends, self.cfg = name, net, ends, ends.cfg
        self.head = restricted_head(ends, net.vocab)  # [..., H] -> [..., N]
        self.ids = net.vocab.tolist()  # the head's row -> its token id
        # the layer as one compiled call with its weights gathered once where it compiles (float32 activations),
        # else its modules. With the rotation sliced from the tables (Rotary.span) and the pick read from a list,
        # a proposal right after a pass of the model took 1.104 / 1.829 / 3.119 ms for 1 / 2 / 4 drafts against
        # 1.251 / 2.015 / 3.45 with the layer's own call, a rotation gathered and a tensor indexed per draft (the
        # same drafts; a 2-core Xeon with AMX, medians of 200, interleaved: bench/results/issue39-drafter-session14)
        self.layer = CompiledLayers([net.layer]) if net.layer.compiled else None

    def drafter(self, params: SamplingParams, capacity: int) -> FeatureDrafter:
        """One request's drafter over these weights."""
        return FeatureDrafter(self, params, capacity)

    @classmethod
    def load(cls, name: str, path: Path, ends: TokenEnds) -> FeatureDraftModel:
        """Weights from `path`; a clear error when they were trained for another model."""
        check_target(f"drafter {name!r}", path, ends)
        cfg = ends.cfg
        state = load_file(str(path))
        net = FeatureNet(cfg, state["vocab"], ends.dtype)
        net.load_state_dict({k: v.to(ends.dtype) if v.is_floating_point() else v for k, v in state.items()},
                            strict=True)
        net.requires_grad_(False)
        return cls(name, pack_linears(net.eval()), ends)


class FeatureDrafter:
    """One request's drafter: its own one-layer KV cache, and the target's features at accepted positions."""

    on_model_thread = True
    reads_features = True

    def __init__(self, model: FeatureDraftModel, params: SamplingParams, capacity: int):
        self.model, self.name = model, model.name
        self.greedy = params.greedy
        self.sampler = draft_sampler(params, model.cfg.vocab_size)
        cfg = model.cfg
        self.cache = KVCache.alone(1, cfg.n_kv_heads, cfg.head_dim, capacity, FLOAT32)  # a drafter's: float32
        self.g = torch.empty(capacity, cfg.hidden_size, dtype=model.ends.dtype)  # [capacity, H] target features
        self.first: int | None = None  # first position with a feature (a cached prompt prefix has none)
        self.known = 0  # features known for positions first..known-1
        self.normed = 0  # of those, the ones before this position are normed in g (the rest as observed)
        self.fed = 0  # draft indices first+1..first+fed are in the cache from true features

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The target's last-layer outputs hidden [T, H] at positions start..start+T-1 (accepted ones only),
        kept as they come and normed when a proposal reads them: beside other streams this drafter is not asked,
        and with a norm per sequence and step the speculative program's Python took 116 us a token at 16 streams
        against 98 (edgespec_program_seconds, bench/results/issue39-serial-work). A copy, so no inference mode
        around it: entering one cost 1.4 us of the 2.9 a copy took (bench/results/issue39-program-python)."""
        if self.first is None:
            self.first = self.known = self.normed = start
        self.g[start:start + len(hidden)] = hidden  # in g's dtype, as hidden.to(g.dtype)
        self.known = start + len(hidden)
        self.normed = min(self.normed, start)
        self.fed = min(self.fed, self.known - self.first - 1)  # positions past them were drafts: re-feed

    def _normed(self, n: int) -> None:
        # the features before position n normed in g (the norm takes each row on its own: the same bits however
        # many rows go at once)
        if self.normed < n:
            self.g[self.normed:n] = self.model.ends.norm(self.g[self.normed:n])
            self.normed = n

    def _step(self, g_prev: torch.Tensor, ids: list[int], start: int, first: int) -> torch.Tensor:
        # g_prev [T, H] with ids [T] at draft indices start..start+T-1 -> predicted g at the last one [1, 1, H];
        # first: self.first, known by then
        net, t = self.model.net, len(ids)
        rope = net.rotary.span(start, start + t)
        emb = self.model.ends.embed_tokens(torch.tensor([ids]))  # [1, T, H]
        x = net.fc(torch.cat([g_prev.unsqueeze(0), emb], dim=-1))  # [1, T, H]
        slot = start - first - 1
        self.cache.check_write(slot, t)  # its blocks were all its own from the start (KVCache.alone)
        if self.model.layer is not None:  # causal by slot, as with no mask below
            x = self.model.layer(x[0], rope, [SeqRows(self.cache, slot, t)])[None]
        else:
            x = net.layer(x, rope, self.cache, 0, slot, None)
        self.cache.length = slot + t
        return self.model.ends.norm(x[:, -1:])

    def _pick(self, g: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        # predicted g [1, 1, H] -> (draft id, its distribution over the full vocabulary [V]; None when greedy)
        small = self.model.head(g)[0, 0]  # [N]
        if self.greedy:  # a point mass: no distribution to build over the 49k ids
            return self.model.ids[int(small.argmax())], None
        logits = torch.full((self.model.cfg.vocab_size,), float("-inf"))
        logits[self.model.net.vocab] = small.float()
        q = self.sampler.probs(logits)
        return self.sampler.sample(q), q

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        n = self.known  # pairs (g_{i-1}, x_i) for draft indices i = first+1..n, x_n the newest token
        if self.first is None or n < self.first + 1 or len(tokens) < n + 1:
            return [], None
        self._normed(n)
        self.cache.truncate(self.fed)
        a = self.first + 1 + self.fed  # first draft index not fed yet
        g = self._step(self.g[a - 1:n], tokens[a:n + 1], a, self.first)
        self.fed = n - self.first
        drafts: list[int] = []
        qs: list[torch.Tensor] = []  # the draws' distributions [V] (none when greedy)
        for i in range(k):
            token, q = self._pick(g)
            drafts.append(token)
            if q is not None:
                qs.append(q)
            if i + 1 < k:
                g = self._step(g[0], [token], n + 1 + i, self.first)
        return drafts, None if self.greedy else torch.stack(qs)  # [k, V]
