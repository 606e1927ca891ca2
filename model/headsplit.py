"""HeadSplit execution (issue 9's groundwork): a placement's blocks on named devices, and the schedule every
decoding step follows, with inter-layer speculation.

Each device holds, for the layers the placement gives it, some KV groups (their q, k and v rows, their
projection columns, the input norm, and their own KV cache) and some FFN blocks (post-attention norm, FFN),
loaded alone from the checkpoint. A layer runs as: every group device computes its partial attention output
from the layer's input; the projection device sums the partials (and norms the sum where the architecture norms
the attention's output: Gemma 3) and adds the residual into Z; the FFN device adds the FFN of Z into X, the
layer's output.

At a speculating layer l (decoding passes of one token), the group devices start from Z_(l-1) before
X_(l-1) exists, writing their keys and values into the session's cache as staged entries. When X_(l-1) is
there, the speculation is kept if ||Z - X|| / ||X|| < epsilon: the staged entries stand (commit). Otherwise
the groups run again from X_(l-1), overwriting the staged entries (discard), so the step's result and cache
are the exact ones. Epsilon 0 never keeps: the exact model.

The devices are HeadBlocks in this process, or proxies of the same calls to workers over their links
(workers/head_client.py). A device call is started (`start_attend`, `start_ffn`) and its result taken later,
so the calls the schedule starts together run at once: a layer's group calls, and at a speculating layer also
the previous layer's FFN call with this layer's speculative group calls. A remote call is sent when started; an
in-process one computes when its result is taken, after the remote ones went out. Over workers, the projection
worker of a layer runs this same schedule itself (`run`), its own blocks directly and its peers' over its links
to them, so a step reaches the controller only at its end or where the projection device changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from edgespec.model.blocks import RMSNorm
from edgespec.model.config import ModelConfig
from edgespec.model.drift import relative_drift
from edgespec.model.head_blocks import HeadBlocks, attn_out_norms
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.stage import WireFigures, forward_each, segments_in_turn
from edgespec.model.weights import TensorSource
from edgespec.planning.headsplit import LayerPlace

log = logging.getLogger(__name__)


def blocks_of(layers: list[LayerPlace], device: str) -> tuple[dict[int, list[int]], list[int]]:
    """What a placement gives one device: its KV groups by layer, and the layers whose FFN it runs."""
    return ({i: sorted(lp.groups[device]) for i, lp in enumerate(layers) if lp.groups.get(device)},
            [i for i, lp in enumerate(layers) if lp.ffn == device])


def devices_named(layers: list[LayerPlace]) -> set[str]:
    """Every device a placement gives a block to."""
    return {d for lp in layers for d in [*lp.groups, lp.proj, lp.ffn]}


def check_placement(layers: list[LayerPlace], cfg: ModelConfig) -> None:
    """A ValueError unless the placement covers every layer and each layer's KV groups exactly once."""
    if len(layers) != cfg.n_layers:
        raise ValueError(f"the placement has {len(layers)} layers, the model {cfg.n_layers}")
    for i, lp in enumerate(layers):
        placed = sorted(g for gs in lp.groups.values() for g in gs)
        if placed != list(range(cfg.n_kv_heads)):
            raise ValueError(f"layer {i}: groups {placed} are not each of the {cfg.n_kv_heads} KV groups once")


def results(pending: list) -> list[torch.Tensor]:
    """Every started call's result, in order. When one fails, the others are still waited for (no call of this
    step is left running into the next, or into a re-placement) and then the first failure is raised."""
    out, error = [], None
    for call in pending:
        try:
            out.append(call.result())
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error
    return out


@dataclass
class MemoryWatch:
    """When to re-place: a device's blocks and caches past `threshold` of its capacity (checked every `every`
    steps); `replan(slots)` gives the placement for `slots` cached tokens in all."""

    capacities: dict[str, int]
    replan: Callable[[int], list[LayerPlace]]
    threshold: float = 0.85
    every: int = 16
    steps: int = 0

    def due(self) -> bool:
        self.steps += 1
        return self.steps % self.every == 0


@dataclass
class SpeculationStats:
    """Per session: speculations kept and discarded, per layer."""

    kept: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)


class HeadSplitPipeline(WireFigures):
    """The HeadSplit schedule over a placement's devices (HeadBlocks in-process, or worker proxies with the same
    calls), with the Stage seam's open / forward / release.

    A device has `start_attend(session, layer, x, positions, start, mask, step)` and `start_ffn(layer, z)`, each
    returning a pending call whose `result()` is the tensor (or raises the device's failure), and `open`,
    `release`, `kv_bytes` (0 for a worker's: the worker counts its own).
    With `gathered`, the devices are workers that run the schedule themselves (`run` at each layer's
    projection device, which calls its peers directly): the controller hands a step to the first layer's
    projection worker and gets the last layer's output back, with one more hop only where the projection device
    changes. `close()` frees what reaching the devices holds.

    attn_out: every layer's norm of the attention's output (head_blocks.attn_out_norms) where the architecture
    has them (Gemma 3): the sum of a layer's group partials is normed before the residual add. Needed wherever
    this pipeline gathers layers itself (not `gathered`: the projection workers then hold their own)."""

    def __init__(self, devices: dict, layers: list[LayerPlace], cfg: ModelConfig, epsilon: float = 0.05,
                 close=None, gathered: bool = False, attn_out: dict[int, RMSNorm] | None = None):
        check_placement(layers, cfg)
        self.attn_out = attn_out or {}
        if "attn_out" in cfg.arch.norms and not gathered and sorted(self.attn_out) != list(range(cfg.n_layers)):
            raise ValueError(f"the {cfg.arch.name} architecture norms the attention's output: the pipeline that "
                             "gathers its layers needs every layer's norm (attn_out)")
        self.devices, self.layers, self.cfg, self.epsilon = devices, layers, cfg, epsilon
        self._close = close
        self.gathered = gathered
        self.stats: dict[str, SpeculationStats] = {}
        self.epsilons: dict[str, float] = {}
        self.wire_stats: dict[str, dict[str, list[int]]] = {}  # session -> link -> [bytes, requests]
        self.lengths: dict[str, int] = {}  # session -> slots written
        self.steps: dict[str, int] = {}  # session -> its forward passes so far (the step number of the last)
        self.memory: MemoryWatch | None = None
        self.replacements = 0
        self.carried: dict[str, tuple] = {}  # session -> (epsilon, stats, wire) taken over from a lost placement

    @classmethod
    def local(cls, src: TensorSource, cfg: ModelConfig, dtype: torch.dtype, layers: list[LayerPlace],
              epsilon: float = 0.05, kv_budget_bytes: int | None = None, kv: KVFormat = FLOAT32
              ) -> HeadSplitPipeline:
        """Every device of the placement as HeadBlocks in this process, caches in KV format `kv`;
        kv_budget_bytes: the bound of all their caches (each device gets an equal share: the placement spreads
        the KV groups)."""
        check_placement(layers, cfg)
        names = sorted(devices_named(layers))
        devices = {name: HeadBlocks(src, cfg, dtype, *blocks_of(layers, name), kv) for name in names}
        if kv_budget_bytes is not None:
            for device in devices.values():
                device.limit_kv(kv_budget_bytes // len(devices))
        return cls(devices, layers, cfg, epsilon, attn_out=attn_out_norms(src, cfg, dtype))

    def open(self, session: str, capacity: int, epsilon: float | None = None) -> None:
        for device in self.devices.values():
            device.open(session, capacity)
        kept_eps, stats, wire = self.carried.pop(session, (self.epsilon, None, None))
        self.stats[session] = stats or SpeculationStats([0] * self.cfg.n_layers, [0] * self.cfg.n_layers)
        self.epsilons[session] = kept_eps if epsilon is None else epsilon
        self.wire_stats[session] = wire or {}
        self.lengths[session] = 0
        self.steps[session] = 0

    def adopt(self, old: HeadSplitPipeline) -> None:
        """Take over the sessions of `old`, a placement that lost a device: when the executor opens them here again
        to rebuild them from their tokens, their tolerance, speculation counts and wire figures carry on."""
        self.carried = {s: (old.epsilons[s], old.stats[s], old.wire_stats.get(s)) for s in old.stats}

    def speculate(self, session: str, epsilon: float) -> None:
        """The session's speculation tolerance from now on (a request's `epsilon`)."""
        self.epsilons[session] = epsilon

    def figures(self, session: str) -> dict:
        """The session's tolerance and speculations, and how many layers speculate."""
        stats = self.stats[session]
        return {"headsplit": {"epsilon": self.epsilons[session],
                              "speculating_layers": sum(lp.speculate for lp in self.layers),
                              "speculations_kept": sum(stats.kept),
                              "speculations_discarded": sum(stats.discarded)}}

    def release(self, session: str) -> None:
        for device in self.devices.values():
            device.release(session)
        self.stats.pop(session, None)
        self.epsilons.pop(session, None)
        self.wire_stats.pop(session, None)
        self.lengths.pop(session, None)
        self.steps.pop(session, None)

    def forward_segments(self, session: str, hidden: torch.Tensor, start: int, cuts: list[int]) -> torch.Tensor:
        return segments_in_turn(self, session, hidden, start, cuts)

    def kv_bytes(self) -> int:
        return sum(d.kv_bytes() for d in self.devices.values())

    def pool_blocks(self) -> tuple[int, int]:
        return 0, 0  # a device holds each session's groups in caches of their own (model/head_blocks.py)

    def close(self) -> None:
        """Free what reaching the devices holds (connections, threads)."""
        if self._close:
            self._close()

    @torch.inference_mode()
    def forward(self, session: str, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, H] at positions [B, T], cached at slots start.. -> the last layer's output [B, T, H]."""
        stats, eps = self.stats[session], self.epsilons[session]
        self.steps[session] += 1
        step = self.steps[session]
        if not self.gathered:
            out = self.run(session, 0, hidden, positions, start, mask, eps, stats, step)[0]
        else:
            layer, wire, out = 0, self.wire_stats[session], hidden
            while layer < len(self.layers):  # each projection worker runs the layers it gathers, then hands back
                out, layer = self.devices[self.layers[layer].proj].run(session, layer, out, positions, start, mask,
                                                                       eps, stats, step, wire)
        self.lengths[session] = start + hidden.shape[1]  # a write ends the caches there
        if self.memory is not None and self.memory.due():
            self.check_memory()
        return out

    def forward_batch(self, entries, hidden, positions):
        # the HeadSplit schedule runs one session at a time
        return forward_each(self, entries, hidden, positions)

    def check_memory(self) -> bool:
        """Re-place the blocks when a device's memory use has crossed the threshold (between steps): the
        planner's new placement for the slots the sessions hold, doubled for growth, within the threshold of
        every device. False when nothing is hot or no placement fits (the caches then grow until one is full)."""
        watch = self.memory
        used = {name: device.memory_bytes() for name, device in self.devices.items()}
        if all(used[n] <= watch.threshold * watch.capacities[n] for n in used):
            return False
        try:
            layers = watch.replan(2 * sum(self.lengths.values()))
        except ValueError as exc:  # planning.headsplit.InfeasibleError
            log.warning("a HeadSplit device passed %.0f%% of its memory and no placement fits: %s",
                        100 * watch.threshold, exc)
            return False
        if layers == self.layers:  # nothing better to move to
            return False
        self.move_to(layers)
        return True

    def move_to(self, layers: list[LayerPlace]) -> None:
        """Re-place the blocks: groups that change device take every session's keys and values with them, FFNs
        load where they now run, and the projection workers learn the new placement."""
        check_placement(layers, self.cfg)
        unknown = devices_named(layers) - set(self.devices)
        if unknown:
            raise ValueError(f"the placement names unknown devices {sorted(unknown)}")
        leaving: dict[str, dict[int, list[int]]] = {}  # device -> layer -> groups it gives up
        owner: dict[tuple[int, int], str] = {}  # (layer, group) -> the device that held it
        for layer, (old, new) in enumerate(zip(self.layers, layers, strict=True)):
            for device, gs in old.groups.items():
                for g in gs:
                    owner[layer, g] = device
                    if g not in new.groups.get(device, []):
                        leaving.setdefault(device, {}).setdefault(layer, []).append(g)
        exported = {device: self.devices[device].export(groups) for device, groups in leaving.items()}
        for name, device in self.devices.items():
            groups, ffns = blocks_of(layers, name)
            incoming: dict = {}
            for layer, gs in groups.items():
                for g in gs:
                    src = owner[layer, g]
                    if src != name:
                        for session, by_layer in exported[src].items():
                            incoming.setdefault(session, {}).setdefault(layer, {})[g] = by_layer[layer][g]
            device.reshape(groups, ffns, incoming)
        if self.gathered:
            for device in self.devices.values():
                device.set_placement(layers)
        self.layers = layers
        self.replacements += 1
        log.info("HeadSplit blocks re-placed (%d groups moved)", sum(len(g) for d in leaving.values()
                                                                      for g in d.values()))

    def run(self, session: str, first: int, hidden: torch.Tensor, positions: torch.Tensor, start: int,
            mask: torch.Tensor | None, eps: float, stats: SpeculationStats, step: int, here: str | None = None
            ) -> tuple[torch.Tensor, int]:
        """Layers first.. from their input hidden [1, T, H] of the session's pass number `step`, while their
        projection device is `here` (None: all of them) -> (the output [1, T, H] of the last layer run, the
        next layer to run)."""
        b, t, _ = hidden.shape
        if here is not None and self.layers[first].proj != here:
            raise ValueError(f"layer {first}'s projection runs on {self.layers[first].proj}, not {here}")

        def attend_calls(i: int, src: torch.Tensor) -> list:
            # layer i's group devices' partial outputs from src, each [its groups, T, H] (see group_sum), started
            return [self.devices[d].start_attend(session, i, src, positions, start, mask, step)
                    for d, gs in self.layers[i].groups.items() if gs]

        def group_sum(i: int, partials: list[torch.Tensor]) -> torch.Tensor:
            # the devices' partials -> layer i's attention output [1, T, H]: added one group after another in
            # group order, whichever device computed each, so that the bits do not depend on the placement; then
            # normed where the architecture norms it (DecoderLayer's attn_out_norm, on the whole sum) and scaled
            parts = {g: p[j] for gs, p in zip((gs for gs in self.layers[i].groups.values() if gs), partials,
                                              strict=True) for j, g in enumerate(sorted(gs))}
            out = parts[min(parts)]
            for g in sorted(parts)[1:]:
                out = out + parts[g]
            out = out.unsqueeze(0)
            out = self.attn_out[i](out) if i in self.attn_out else out
            r = self.cfg.residual_multiplier  # Granite's, on the whole sum as DecoderLayer applies it
            return out if r == 1.0 else out * r

        def ffn_call(i: int, z: torch.Tensor):
            return self.devices[self.layers[i].ffn].start_ffn(i, z)

        x, z = hidden, None  # layer i's input X_(i-1), and the previous layer's Z while its FFN is pending
        for i in range(first, len(self.layers)):
            lp = self.layers[i]
            if here is not None and lp.proj != here:  # the next projection device takes over from X_(i-1)
                return ffn_call(i - 1, z).result(), i
            if z is not None and lp.speculate and b == t == 1:
                # the previous layer's FFN and this layer's attention on its Z (staged entries) at once
                x, *staged = results([ffn_call(i - 1, z), *attend_calls(i, z)])
                if float(relative_drift(z, x)) < eps:  # one token
                    stats.kept[i] += 1  # the staged entries stand
                    out = group_sum(i, staged)
                else:
                    stats.discarded[i] += 1  # recomputed from X_(i-1): the staged entries are overwritten
                    out = group_sum(i, results(attend_calls(i, x)))
            else:
                if z is not None:
                    x = ffn_call(i - 1, z).result()
                out = group_sum(i, results(attend_calls(i, x)))
            z = x + out
        return ffn_call(len(self.layers) - 1, z).result(), len(self.layers)
