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

A step of several sessions (the engine's shared step) runs the schedule once: each device call carries every
session's rows, each session attends over its own caches, and each decoding session keeps or discards a
speculation by its own drift and epsilon (model/head_schedule.py); every row gets the bits it gets alone. A
session's caches are a device's own (no block is shared): a fork copies the parent's slots (prefix reuse).

The devices are HeadBlocks in this process, or proxies of the same calls to workers over their links
(workers/head_client.py). A device call is started (`start_attend`, `start_ffn`) and its result taken later,
so the calls the schedule starts together run at once: a layer's group calls, and at a speculating layer also
the previous layer's FFN call with this layer's speculative group calls. A remote call is sent when started; an
in-process one computes when its result is taken, after the remote ones went out. Over workers, the projection
worker of a layer runs this same schedule itself (GatheringDevice.run), its own blocks directly and its peers'
over its links to them, so a step reaches the controller only at its end or where the projection device
changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from edgespec.model.blocks import RMSNorm
from edgespec.model.config import ModelConfig
from edgespec.model.head_blocks import GroupKV, HeadBlocks, StepRows, attn_out_norms
from edgespec.model.head_schedule import HeadDevice, Part, SpeculationStats, run_schedule
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.linear import WeightFormat
from edgespec.model.stage import BatchEntry, SessionError, WireFigures, segments_in_turn
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


class SessionDevice(HeadDevice, Protocol):
    """A device as the pipeline drives it: the schedule's calls, each session's caches, the figures of its
    caches, and its blocks' moves (HeadBlocks; a worker's RemoteHeads)."""

    def open(self, session: str, capacity: int) -> None:
        """Caches of `capacity` slots for the session's groups here (CapacityError past the device's budget)."""

    def fork(self, session: str, child: str, length: int, capacity: int, step: int) -> None:
        """Open `child` holding a copy of the session's first `length` slots, as the session's pass `step`."""

    def commit(self, session: str, kept: list[int], dest: int, step: int) -> None:
        """Move the slots `kept` to dest, dest+1, ... and end the session's caches there, as its pass `step`."""

    def release(self, session: str) -> None:
        """Free the session's caches (an unknown session is ignored)."""

    def kv_bytes(self) -> int:
        """Bytes of the caches here (a worker's: as it last reported them)."""

    def pool_blocks(self) -> tuple[int, int]:
        """(used, free) blocks of one KV group's BLOCK_SLOTS slots in one layer (HeadBlocks.pool_blocks)."""

    def memory_bytes(self) -> int:
        """Bytes of the blocks' weights and the caches."""

    def export(self, groups: dict[int, list[int]]) -> GroupKV:
        """Every session's keys and values of these groups, to move them with the groups."""

    def reshape(self, groups: dict[int, list[int]], ffns: list[int], incoming: GroupKV) -> None:
        """Hold exactly these groups and FFNs from now on (HeadBlocks.reshape)."""


class GatheringDevice(SessionDevice, Protocol):
    """A worker that runs the schedule itself from the layers it gathers (workers/head_client.py)."""

    def run(self, parts: Sequence[Part], first: int, x: torch.Tensor, positions: torch.Tensor,
            wire: dict[str, dict[str, list[int]]]) -> tuple[torch.Tensor, int]:
        """Layers first.. at this projection worker for the parts' rows x [M, H] -> (the last one's output
        [M, H], the next layer to run); speculation counts add to the parts' stats, traffic to `wire`."""

    def set_placement(self, layers: list[LayerPlace]) -> None:
        """The placement its schedule follows from now on."""


class HeadSplitPipeline(WireFigures):
    """The HeadSplit schedule over a placement's devices (HeadBlocks in-process, or worker proxies with the same
    calls: SessionDevice), as the executor's StagePipeline: open, fork, commit and release every device's caches
    of a session, and a step of one or several sessions run through the schedule once (model/head_schedule.py).
    With `gathered`, the devices are workers that run the schedule themselves (GatheringDevice.run at each
    layer's projection device, which calls its peers directly): the controller hands a step to the first layer's
    projection worker and gets the last layer's output back, with one more hop only where the projection device
    changes. `close()` frees what reaching the devices holds.

    attn_out: every layer's norm of the attention's output (head_blocks.attn_out_norms) where the architecture
    has them (Gemma 3): the sum of a layer's group partials is normed before the residual add. Needed wherever
    this pipeline gathers layers itself (not `gathered`: the projection workers then hold their own)."""

    def __init__(self, devices: Mapping[str, SessionDevice], layers: list[LayerPlace], cfg: ModelConfig,
                 epsilon: float = 0.05, close: Callable[[], None] | None = None, gathered: bool = False,
                 attn_out: dict[int, RMSNorm] | None = None):
        check_placement(layers, cfg)
        self.attn_out = attn_out or {}
        if "attn_out" in cfg.arch.norms and not gathered and sorted(self.attn_out) != list(range(cfg.n_layers)):
            raise ValueError(f"the {cfg.arch.name} architecture norms the attention's output: the pipeline that "
                             "gathers its layers needs every layer's norm (attn_out)")
        self.devices = dict(devices)
        self.layers, self.cfg, self.epsilon = layers, cfg, epsilon
        self._close = close
        self.gathered = gathered
        self.stats: dict[str, SpeculationStats] = {}
        self.epsilons: dict[str, float | None] = {}  # None: the session's rows do not speculate now
        self.wire_stats: dict[str, dict[str, list[int]]] = {}  # session -> link -> [bytes, requests]
        self.lengths: dict[str, int] = {}  # session -> slots written
        self.steps: dict[str, int] = {}  # session -> the number of its last pass or KV operation
        self.memory: MemoryWatch | None = None
        self.replacements = 0
        self.carried: dict[str, tuple] = {}  # session -> (epsilon, stats, wire) taken over from a lost placement

    def watch(self, memory: MemoryWatch) -> None:
        """From now on, re-place the blocks when a device passes the watch's threshold (checked between steps)."""
        self.memory = memory

    @classmethod
    def local(cls, src: TensorSource, cfg: ModelConfig, dtype: WeightFormat | torch.dtype, layers: list[LayerPlace],
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

    def _on_every_device(self, session: str, call: Callable[[SessionDevice], None]) -> None:
        # a session's caches made on every device, or on none: a device that refuses (its budget) has the
        # others' released
        done = []
        try:
            for device in self.devices.values():
                call(device)
                done.append(device)
        except BaseException:
            for device in done:
                device.release(session)
            raise

    def _track(self, session: str, epsilon: float | None, stats: SpeculationStats | None, wire: dict | None,
               length: int) -> None:
        self.stats[session] = stats or SpeculationStats([0] * self.cfg.n_layers, [0] * self.cfg.n_layers)
        self.epsilons[session] = epsilon
        self.wire_stats[session] = wire or {}
        self.lengths[session] = length
        self.steps[session] = 0

    def open(self, session: str, capacity: int, epsilon: float | None = None) -> None:
        self._on_every_device(session, lambda device: device.open(session, capacity))
        kept_eps, stats, wire = self.carried.pop(session, (self.epsilon, None, None))
        self._track(session, kept_eps if epsilon is None else epsilon, stats, wire, 0)

    def fork(self, session: str, child: str, prefix_len: int, capacity: int) -> None:
        """Open `child` holding a copy of the session's first prefix_len slots on every device (prefix reuse,
        outline's points after their shared prompt); it starts with the session's tolerance."""
        step = self._step(session)
        self._on_every_device(child, lambda device: device.fork(session, child, prefix_len, capacity, step))
        self._track(child, self.epsilons[session], None, None, prefix_len)

    def commit(self, session: str, kept: list[int], dest: int) -> None:
        """Move the slots `kept` (ascending) to dest, dest+1, ... on every device and end the caches there."""
        step = self._step(session)
        for device in self.devices.values():
            device.commit(session, kept, dest, step)
        self.lengths[session] = dest + len(kept)

    def _step(self, session: str) -> int:
        if session not in self.steps:
            raise SessionError(f"unknown session {session!r}")
        self.steps[session] += 1
        return self.steps[session]

    def adopt(self, old: HeadSplitPipeline) -> None:
        """Take over the sessions of `old`, a placement that lost a device: when the executor opens them here again
        to rebuild them from their tokens, their tolerance, speculation counts and wire figures carry on."""
        self.carried = {s: (old.epsilons[s], old.stats[s], old.wire_stats.get(s)) for s in old.stats}

    def speculate(self, session: str, epsilon: float | None) -> None:
        """The session's speculation tolerance from now on (a request's `epsilon`; None: its rows do not
        speculate, as while its prompt goes in)."""
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
        """The devices' (used, free) blocks, each of one KV group's BLOCK_SLOTS slots in one layer: a device's
        caches hold whole blocks of each session's capacity from its open (HeadBlocks.pool_blocks)."""
        used, free = 0, 0
        for device in self.devices.values():
            u, f = device.pool_blocks()
            used, free = used + u, free + f
        return used, free

    def close(self) -> None:
        """Free what reaching the devices holds (connections, threads)."""
        if self._close:
            self._close()

    def forward(self, session: str, hidden: torch.Tensor, positions: torch.Tensor, start: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [1, T, H] at positions [1, T], cached at slots start.. -> the last layer's output [1, T, H]."""
        entry = BatchEntry(session, start, hidden.shape[1], mask)
        return self.forward_batch([entry], hidden[0], positions[0])[None]

    @torch.inference_mode()
    def forward_batch(self, entries: Sequence[BatchEntry], hidden: torch.Tensor, positions: torch.Tensor
                      ) -> torch.Tensor:
        """A step of several sessions' rows through the schedule once: hidden [M, H] holds each entry's rows in
        turn at positions [M] -> the last layer's output [M, H]; every row as its session alone gets it."""
        for e in entries:
            if e.session not in self.steps:
                raise SessionError(f"unknown session {e.session!r}")
        parts = []
        for e in entries:
            mask = None if e.mask is None else e.mask.reshape(1, e.length, e.start + e.length)
            rows = StepRows(e.session, e.start, e.length, mask, self._step(e.session))
            parts.append(Part(rows, self.epsilons[e.session], self.stats[e.session]))
        if not self.gathered:
            out = self.run(parts, 0, hidden, positions)[0]
        else:
            layer, out = 0, hidden
            while layer < len(self.layers):  # each projection worker runs the layers it gathers, then hands back
                gatherer = cast(GatheringDevice, self.devices[self.layers[layer].proj])
                out, layer = gatherer.run(parts, layer, out, positions, self.wire_stats)
        for e in entries:
            self.lengths[e.session] = e.start + e.length  # a write ends the caches there
        if self.memory is not None and self.memory.due():
            self.check_memory()
        return out

    def run(self, parts: Sequence[Part], first: int, hidden: torch.Tensor, positions: torch.Tensor,
            here: str | None = None) -> tuple[torch.Tensor, int]:
        """Layers first.. of the parts' rows hidden [M, H] at positions [M], while their projection device is
        `here` (None: all of them) -> (the output [M, H] of the last layer run, the next layer to run)."""
        return run_schedule(self.devices, self.layers, self.cfg, self.attn_out, parts, first, hidden, positions,
                            here)

    def check_memory(self) -> bool:
        """Re-place the blocks when a device's memory use has crossed the threshold (between steps): the
        planner's new placement for the slots the sessions hold, doubled for growth, within the threshold of
        every device. False when nothing is hot or no placement fits (the caches then grow until one is full)."""
        watch = self.memory
        if watch is None:
            return False
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
        for name, holder in self.devices.items():
            groups, ffns = blocks_of(layers, name)
            incoming: dict = {}
            for layer, gs in groups.items():
                for g in gs:
                    src = owner[layer, g]
                    if src != name:
                        for session, by_layer in exported[src].items():
                            incoming.setdefault(session, {}).setdefault(layer, {})[g] = by_layer[layer][g]
            holder.reshape(groups, ffns, incoming)
        if self.gathered:
            for gathering in self.devices.values():
                cast(GatheringDevice, gathering).set_placement(layers)
        self.layers = layers
        self.replacements += 1
        log.info("HeadSplit blocks re-placed (%d groups moved)", sum(len(g) for d in leaving.values()
                                                                      for g in d.values()))
