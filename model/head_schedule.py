"""HeadSplit's schedule of one step over a placement's devices, for every session the step carries, with
inter-layer speculation (model/headsplit.py's pipeline runs it; a projection worker runs it from its layers on).

A step's sessions share every device call: layer l's group devices each get one call over all the sessions'
rows (one q/k/v and output projection over the rows, attention per session over its own cache: HeadBlocks.
attend_rows), the projection device sums the groups' partials per row, and the FFN device gets one call over
all rows. At a speculating layer, the decoding sessions (one row each, a tolerance set: not a prompt's rows)
start layer l's attention on Z_(l-1) beside layer l-1's FFN; each keeps its staged entries when its own
||Z - X|| / ||X|| is below its own epsilon, and the sessions that discard, with those whose rows are a prompt's
(never speculated, as alone), get their attention from X_(l-1) in one more call. Every kernel is row-invariant,
so each row gets the bits it gets when its session runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from edgespec.model.blocks import RMSNorm
from edgespec.model.config import ModelConfig
from edgespec.model.drift import relative_drift
from edgespec.model.head_blocks import StepRows
from edgespec.planning.headsplit import LayerPlace


@dataclass
class SpeculationStats:
    """Per session: speculations kept and discarded, per layer."""

    kept: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Part:
    """One session's share of a step: its rows (and their step number), its tolerance (None: its rows do not
    speculate), and its counts."""

    rows: StepRows
    epsilon: float | None
    stats: SpeculationStats


class Pending(Protocol):
    """A started device call."""

    def result(self) -> torch.Tensor:
        """Its tensor, once computed; the device's failure raised."""


class HeadDevice(Protocol):
    """A device of the schedule: HeadBlocks in this process (model/head_blocks.py), or a worker's proxy with the
    same calls (workers/head_client.py). A step's calls are started, and their results taken later, so that the
    calls a step starts together run at once."""

    def start_attend(self, layer: int, x: torch.Tensor, positions: torch.Tensor, rows: Sequence[StepRows]
                     ) -> Pending:
        """Layer `layer`'s groups here over the sessions' rows: x [M, H] at positions [M] -> [n_groups, M, H]."""

    def start_ffn(self, layer: int, z: torch.Tensor) -> Pending:
        """Layer `layer`'s FFN: Z [1, M, H] -> X [1, M, H]."""


def results(pending: Sequence[Pending]) -> list[torch.Tensor]:
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
class Schedule:
    """What a step's schedule runs over: the devices by name, the placement's layers, the model's configuration,
    and each layer's norm of the attention's output where the architecture has one (head_blocks.attn_out_norms:
    applied where a layer's group partials are summed)."""

    devices: Mapping[str, HeadDevice]
    layers: list[LayerPlace]
    cfg: ModelConfig
    attn_out: Mapping[int, RMSNorm]

    def run(self, parts: Sequence[Part], first: int, hidden: torch.Tensor, positions: torch.Tensor,
            here: str | None = None) -> tuple[torch.Tensor, int]:
        """Layers first.. from their input hidden [M, H] (each part's rows in turn, at positions [M]), while
        their projection device is `here` (None: all of them) -> (the output [M, H] of the last layer run, the
        next layer to run)."""
        return run_schedule(self.devices, self.layers, self.cfg, self.attn_out, parts, first, hidden, positions,
                            here)


def run_schedule(devices: Mapping[str, HeadDevice], layers: list[LayerPlace], cfg: ModelConfig,
                 attn_out: Mapping[int, RMSNorm], parts: Sequence[Part], first: int, hidden: torch.Tensor,
                 positions: torch.Tensor, here: str | None = None) -> tuple[torch.Tensor, int]:
    """Schedule.run over these."""
    if here is not None and layers[first].proj != here:
        raise ValueError(f"layer {first}'s projection runs on {layers[first].proj}, not {here}")
    lengths = [p.rows.length for p in parts]
    ends = torch.tensor(lengths).cumsum(0).tolist()
    spans = [(b - n, b) for n, b in zip(lengths, ends, strict=True)]
    everyone = list(range(len(parts)))
    # the rows a speculating layer speculates for: a session's one decoding row (never a prompt's rows, however
    # few: a prompt's pass of several rows does not speculate, and its last one alone must give the same bits)
    decoding = [j for j in everyone if lengths[j] == 1 and parts[j].epsilon is not None]

    def attend_calls(i: int, src: torch.Tensor, which: list[int]) -> list[Pending]:
        # layer i's group devices' partial outputs for the parts `which`, from their rows of src [M, H], started
        if which == everyone:
            x, pos = src, positions
        else:
            index = torch.cat([torch.arange(*spans[j]) for j in which])
            x, pos = src[index], positions[index]
        rows = [parts[j].rows for j in which]
        return [devices[d].start_attend(i, x, pos, rows) for d, gs in layers[i].groups.items() if gs]

    def group_sum(i: int, partials: list[torch.Tensor]) -> torch.Tensor:
        # the devices' partials [their groups, m, H] -> layer i's attention output [m, H]: added one group after
        # another in group order, whichever device computed each, so that the bits do not depend on the
        # placement; then normed where the architecture norms it (DecoderLayer's attn_out_norm) and scaled
        by_group = {g: p[j] for gs, p in zip((gs for gs in layers[i].groups.values() if gs), partials, strict=True)
                    for j, g in enumerate(sorted(gs))}
        out = by_group[min(by_group)]
        for g in sorted(by_group)[1:]:
            out = out + by_group[g]
        out = attn_out[i](out) if i in attn_out else out
        r = cfg.residual_multiplier  # Granite's, on the whole sum as DecoderLayer applies it
        return out if r == 1.0 else out * r

    def ffn_call(i: int, z: torch.Tensor | None) -> Pending:
        # layer i's FFN on its Z (every caller comes after layer i's attention set it)
        if z is None:
            raise ValueError(f"layer {i}'s FFN was called before its attention ran")
        return devices[layers[i].ffn].start_ffn(i, z[None])

    x, z = hidden, None  # layer i's input X_(i-1), and the previous layer's Z while its FFN is pending
    for i in range(first, len(layers)):
        lp = layers[i]
        if here is not None and lp.proj != here:  # the next projection device takes over from X_(i-1)
            return ffn_call(i - 1, z).result()[0], i
        if z is not None and lp.speculate and decoding:
            # the previous layer's FFN over every row, and this layer's attention on the decoding rows' Z
            # (staged entries) at once
            xs, *staged = results([ffn_call(i - 1, z), *attend_calls(i, z, decoding)])
            x = xs[0]
            early = dict(zip(decoding, group_sum(i, staged).split(1), strict=True))
            out: dict[int, torch.Tensor] = {}
            for j in decoding:
                a, b = spans[j]
                if float(relative_drift(z[None, a:b], x[None, a:b])) < (parts[j].epsilon or 0.0):  # its one token
                    parts[j].stats.kept[i] += 1  # the staged entries stand
                    out[j] = early[j]
                else:
                    parts[j].stats.discarded[i] += 1  # recomputed from X_(i-1): the staged entries overwritten
            again = [j for j in everyone if j not in out]
            if again:
                late = group_sum(i, results(attend_calls(i, x, again))).split([lengths[j] for j in again])
                out.update(zip(again, late, strict=True))
            attn = torch.cat([out[j] for j in everyone])
        else:
            if z is not None:
                x = ffn_call(i - 1, z).result()[0]
            attn = group_sum(i, results(attend_calls(i, x, everyone)))
        z = x + attn
    return ffn_call(len(layers) - 1, z).result()[0], len(layers)
