"""HeadSplit execution (issue 9's groundwork): a placement's blocks on named devices, and the schedule every
decoding step follows, with inter-layer speculation.

Each device holds, for the layers the placement gives it, some KV groups (their q, k and v rows, their
projection columns, the input norm, and their own KV cache) and some FFN blocks (post-attention norm, FFN),
loaded alone from the checkpoint. A layer runs as: every group device computes its partial attention output
from the layer's input; the projection device sums the partials and the residual into Z; the FFN device adds
the FFN of Z into X, the layer's output.

At a speculating layer l (decoding passes of one token), the group devices start from Z_(l-1) before
X_(l-1) exists, writing their keys and values into the session's cache as staged entries. When X_(l-1) is
there, the speculation is kept if ||Z - X|| / ||X|| < epsilon: the staged entries stand (commit). Otherwise
the groups run again from X_(l-1), overwriting the staged entries (discard), so the step's result and cache
are the exact ones. Epsilon 0 never keeps: the exact model.

The devices are HeadBlocks in this process, or proxies of the same calls to workers (workers/head_client.py),
where the calls handed to `fan_out` together run at once: a layer's group calls, and at a speculating layer
also the previous layer's FFN call with this layer's speculative group calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.blocks import FFN, AttentionBlock, RMSNorm, Rotary
from model.config import ModelConfig
from model.drift import relative_drift
from model.kv_cache import KVCache
from model.packed import pack_linears
from model.stack import causal_mask
from model.stage import SessionError
from model.weights import TensorSource, load_attention, load_ffn
from planning.headsplit import LayerPlace


class HeadBlocks:
    """The blocks one device holds, groups[l] of layer l's KV groups and the FFN of the layers in `ffns`, with
    each session's caches of those groups. The device interface HeadSplitPipeline drives (a worker proxies the
    same calls over HTTP)."""

    def __init__(self, src: TensorSource, cfg: ModelConfig, dtype: torch.dtype, groups: dict[int, list[int]],
                 ffns: list[int]):
        self.cfg, self.dtype = cfg, dtype
        self.rotary = Rotary(cfg, dtype)
        self.attn: dict[int, tuple[RMSNorm, AttentionBlock]] = {}
        self.ffn: dict[int, tuple[RMSNorm, FFN]] = {}
        self.sessions: dict[str, dict[int, KVCache]] = {}  # session -> layer -> the cache of its groups here
        with torch.no_grad():
            for layer, gs in groups.items():
                norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
                norm.weight.copy_(src.get(f"model.layers.{layer}.input_layernorm.weight", dtype))
                block = AttentionBlock(cfg, sorted(gs), dtype, with_o_bias=cfg.o_bias and 0 in gs)  # bias added once
                load_attention(block, src, cfg, layer, dtype)
                self.attn[layer] = (norm, pack_linears(block))
            for layer in ffns:
                norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
                norm.weight.copy_(src.get(f"model.layers.{layer}.post_attention_layernorm.weight", dtype))
                ffn = FFN(cfg, dtype)
                load_ffn(ffn, src, layer, dtype)
                self.ffn[layer] = (norm, pack_linears(ffn))

    def open(self, session: str, capacity: int, rows: int = 1) -> None:
        self.sessions[session] = {layer: KVCache(1, block.n_kv, self.cfg.head_dim, capacity, self.dtype, rows=rows)
                                  for layer, (_, block) in self.attn.items()}

    def release(self, session: str) -> None:
        self.sessions.pop(session, None)

    def truncate(self, session: str, length: int) -> None:
        for cache in self._caches(session).values():
            cache.truncate(length)

    def _caches(self, session: str) -> dict[int, KVCache]:
        if session not in self.sessions:
            raise SessionError(f"no session {session!r} here")
        return self.sessions[session]

    @torch.inference_mode()
    def attend(self, session: str, layer: int, x: torch.Tensor, positions: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, H] (the layer's input) at positions [B, T], its keys and values cached at slots start.. ->
        this device's partial attention output [B, T, H]. mask [B, T, start+T] (None: causal)."""
        if layer not in self.attn:
            raise ValueError(f"layer {layer} has no KV groups here")
        cache = self._caches(session)[layer]
        b, t, _ = x.shape
        cache.check_write(start, t, b)
        cache.ensure(start + t)
        if mask is None and t > 1:
            mask = causal_mask(start, t)
        elif mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # broadcast over heads
        norm, block = self.attn[layer]
        out = block(norm(x.to(self.dtype)), self.rotary(positions), cache, 0, start, mask)
        cache.length = start + t
        return out

    @torch.inference_mode()
    def feed_forward(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """Z [B, T, H] -> the layer's output X [B, T, H]."""
        if layer not in self.ffn:
            raise ValueError(f"layer {layer}'s FFN is not here")
        norm, ffn = self.ffn[layer]
        z = z.to(self.dtype)
        return z + ffn(norm(z))


def blocks_of(layers: list[LayerPlace], device: str) -> tuple[dict[int, list[int]], list[int]]:
    """What a placement gives one device: its KV groups by layer, and the layers whose FFN it runs."""
    return ({i: lp.groups[device] for i, lp in enumerate(layers) if lp.groups.get(device)},
            [i for i, lp in enumerate(layers) if lp.ffn == device])


def check_placement(layers: list[LayerPlace], cfg: ModelConfig) -> None:
    """A ValueError unless the placement covers every layer and each layer's KV groups exactly once."""
    if len(layers) != cfg.n_layers:
        raise ValueError(f"the placement has {len(layers)} layers, the model {cfg.n_layers}")
    for i, lp in enumerate(layers):
        placed = sorted(g for gs in lp.groups.values() for g in gs)
        if placed != list(range(cfg.n_kv_heads)):
            raise ValueError(f"layer {i}: groups {placed} are not each of the {cfg.n_kv_heads} KV groups once")


@dataclass
class SpeculationStats:
    """Per session: speculations kept and discarded, per layer."""

    kept: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)


class HeadSplitPipeline:
    """The HeadSplit schedule over a placement's devices (HeadBlocks in-process, or worker proxies with the same
    calls), with the Stage seam's open / forward / truncate / release. `fan_out(fns)` runs one layer's group
    calls (default: one after another; over workers, at once); `close()` frees what reaching them holds."""

    def __init__(self, devices: dict, layers: list[LayerPlace], cfg: ModelConfig, epsilon: float = 0.05,
                 fan_out=None, close=None):
        check_placement(layers, cfg)
        self.devices, self.layers, self.cfg, self.epsilon = devices, layers, cfg, epsilon
        self.fan_out = fan_out or (lambda fns: [fn() for fn in fns])
        self._close = close
        self.stats: dict[str, SpeculationStats] = {}
        self.epsilons: dict[str, float] = {}

    @classmethod
    def local(cls, src: TensorSource, cfg: ModelConfig, dtype: torch.dtype, layers: list[LayerPlace],
              epsilon: float = 0.05) -> HeadSplitPipeline:
        """Every device of the placement as HeadBlocks in this process."""
        check_placement(layers, cfg)
        names = sorted({d for lp in layers for d in [*lp.groups, lp.ffn]})
        return cls({name: HeadBlocks(src, cfg, dtype, *blocks_of(layers, name)) for name in names}, layers, cfg,
                   epsilon)

    def open(self, session: str, capacity: int, rows: int = 1, epsilon: float | None = None) -> None:
        for device in self.devices.values():
            device.open(session, capacity, rows)
        self.stats[session] = SpeculationStats([0] * self.cfg.n_layers, [0] * self.cfg.n_layers)
        self.epsilons[session] = self.epsilon if epsilon is None else epsilon

    def release(self, session: str) -> None:
        for device in self.devices.values():
            device.release(session)
        self.stats.pop(session, None)
        self.epsilons.pop(session, None)

    def truncate(self, session: str, length: int) -> None:
        for device in self.devices.values():
            device.truncate(session, length)

    def close(self) -> None:
        """Free what reaching the devices holds (connections, threads)."""
        if self._close:
            self._close()

    @torch.inference_mode()
    def forward(self, session: str, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] at positions [B, T], cached at slots start.. -> the last layer's output [B, T, H]."""
        stats, eps = self.stats[session], self.epsilons[session]
        b, t, _ = hidden.shape

        def attend_calls(i: int, src: torch.Tensor) -> list:
            # layer i's group devices' partial outputs from src (summed at the projection device)
            return [lambda d=d: self.devices[d].attend(session, i, src, positions, start, mask)
                    for d, gs in self.layers[i].groups.items() if gs]

        def ffn_call(i: int, z: torch.Tensor):
            return lambda: self.devices[self.layers[i].ffn].feed_forward(i, z)

        x, z = hidden, None  # layer i's input X_(i-1), and the previous layer's Z while its FFN is pending
        for i, lp in enumerate(self.layers):
            if z is not None and lp.speculate and b == t == 1:
                # the previous layer's FFN and this layer's attention on its Z (staged entries) at once
                x, *staged = self.fan_out([ffn_call(i - 1, z), *attend_calls(i, z)])
                if float(relative_drift(z, x)) < eps:  # one token
                    stats.kept[i] += 1  # the staged entries stand
                    out = sum(staged)
                else:
                    stats.discarded[i] += 1  # recomputed from X_(i-1): the staged entries are overwritten
                    out = sum(self.fan_out(attend_calls(i, x)))
            else:
                if z is not None:
                    x = ffn_call(i - 1, z)()
                out = sum(self.fan_out(attend_calls(i, x)))
            z = x + out
        return ffn_call(len(self.layers) - 1, z)()
