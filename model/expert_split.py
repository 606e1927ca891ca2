"""A layer whose experts the planner placed on several devices (planning/experts.py), and the experts a device
holds for other devices' layers.

The layer's own device holds its attention, its router and the experts not placed away. A pass of it runs as
one device's would, in three steps: the router chooses each row's experts and weights (`Experts.route`); every
device computes the weighted outputs of the (row, slot) choices whose expert it holds (`Experts.partials`: here
for the experts held here, and on each other device for the rows that chose one of its experts, the calls sent
first so the devices compute at once); and the layer's device adds each row's slots in ascending expert order
(`Experts.combine`). The matmuls are row-invariant and the sum's order is fixed by the expert ids alone, so the
bits are the one-device bits whatever the placement (tests/test_expert_split.py compares them bitwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from edgespec.model.blocks import DecoderLayer, Rope, SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.ffn import Experts
from edgespec.model.linear import WeightFormat, linear_bytes
from edgespec.model.weights import load_experts

Away = Mapping[str, Sequence[int]]  # one layer's experts held elsewhere: device -> expert ids


def check_experts(cfg: ModelConfig, first: int, last: int, away: Mapping[int, Away],
                  hosted: Mapping[int, Sequence[int]]) -> None:
    """A ValueError unless the experts placed `away` from layers [first, last) are of its sparse layers, and those
    `hosted` of other layers' are of sparse layers outside it; every id once, of the model's experts."""
    def ids(layer: int, held: Sequence[int], what: str) -> None:
        if not (0 <= layer < cfg.n_layers and cfg.sparse(layer)):
            raise ValueError(f"{what}: layer {layer} has no experts")
        if len(set(held)) != len(held) or not all(0 <= e < cfg.n_experts for e in held):
            raise ValueError(f"{what}: layer {layer}'s experts {list(held)[:16]} are not distinct ids of the "
                             f"{cfg.n_experts}")

    for layer, where in away.items():
        if not first <= layer < last:
            raise ValueError(f"experts placed away must be of layers [{first}, {last}), not of layer {layer}")
        ids(layer, [e for held in where.values() for e in held], "experts placed away")
    for layer, held in hosted.items():
        if first <= layer < last:
            raise ValueError(f"layer {layer} is held here whole: its experts are not another's to host")
        ids(layer, held, "hosted experts")


class ExpertCall(Protocol):
    def result(self) -> torch.Tensor:
        """The weighted outputs [n, H] of the slots the device holds, in row-major slot order."""


class ExpertLinks(Protocol):
    """The devices that hold experts of this device's layers, as a pass calls them."""

    def start(self, device: str, layer: int, rows: torch.Tensor, chosen: torch.Tensor,
              weights: torch.Tensor) -> ExpertCall:
        """Send layer `layer`'s rows [m, H] (normed) with their experts int64 [m, k] and weights float32 [m, k]
        to `device`, which holds some of those experts (ExpertShelf.partials there)."""


def split_layer_rows(layer: DecoderLayer, x: torch.Tensor, rope: Rope, seqs: Sequence[SeqRows], index: int,
                     absolute: int, away: Mapping[str, torch.Tensor], links: ExpertLinks) -> torch.Tensor:
    """DecoderLayer.rows of a sparse layer (`index` in its stack, `absolute` in the model) some of whose experts
    are on the devices `away` names (device -> int64 ids): x [M, H] -> [M, H], the bits of the layer held whole."""
    if not isinstance(layer.ffn, Experts) or layer.ffn_out_norm is not None or layer.residual != 1.0:
        raise ValueError(f"layer {absolute} cannot have its experts placed apart: only a plain mixture can")
    moe = layer.ffn
    z = layer.post_attention_rows(x, rope, seqs, index)  # [M, H]
    h = layer.post_norm(z)
    chosen, weights = moe.route(h)  # [M, k] each
    calls = []
    for device, ids in away.items():
        mask = torch.isin(chosen, ids)  # [M, k]: the slots it computes
        rows = mask.any(dim=1)
        if rows.any():
            calls.append((device, mask, links.start(device, absolute, h[rows], chosen[rows], weights[rows])))
    parts = moe.partials(h, chosen, weights)  # [M, k, H]: here while the others compute theirs
    for device, mask, call in calls:
        got = call.result()
        n = int(mask.sum())
        if got.shape != (n, h.shape[1]):
            raise ValueError(f"{device} answered layer {absolute}'s experts with {list(got.shape)}, not [{n}, "
                             f"{h.shape[1]}]")
        parts[mask] = got.to(parts.dtype)
    return z + moe.combine(chosen, parts)


class ExpertShelf:
    """The experts a device holds of other devices' layers (hosted[layer] = their ids), loaded alone from the
    checkpoint, without the layers' routers."""

    def __init__(self, src, cfg: ModelConfig, fmt: WeightFormat, hosted: Mapping[int, Sequence[int]]):
        check_experts(cfg, 0, 0, {}, hosted)
        self.cfg = cfg
        self.experts: dict[int, Experts] = {}
        self.ids = {layer: torch.tensor(sorted(ids), dtype=torch.long) for layer, ids in hosted.items()}
        for layer, ids in hosted.items():
            with torch.device("meta"):
                moe = Experts(cfg, fmt.act, ids, router=False)
            moe.to_empty(device="cpu")
            with torch.no_grad():
                load_experts(moe, src, layer, fmt)
            self.experts[layer] = moe

    def partials(self, layer: int, rows: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [m, H] (normed), their experts int64 [m, k] and weights [m, k] -> the weighted outputs [n, H] of
        the slots whose expert is held here, in row-major slot order (ExpertCall.result)."""
        moe = self.experts.get(layer)
        if moe is None:
            raise KeyError(f"this device holds no experts of layer {layer}")
        h, k = self.cfg.hidden_size, moe.top_k
        if rows.dim() != 2 or rows.shape[1] != h or not rows.is_floating_point():
            raise ValueError(f"rows must be float [m, {h}], got {rows.dtype} {list(rows.shape)}")
        m = rows.shape[0]
        if chosen.dtype != torch.long or list(chosen.shape) != [m, k] or weights.dtype != torch.float32 or \
                list(weights.shape) != [m, k]:
            raise ValueError(f"experts must be int64 [{m}, {k}] and weights float32 [{m}, {k}]")
        if m and (int(chosen.min()) < 0 or int(chosen.max()) >= self.cfg.n_experts):
            raise ValueError(f"experts must be ids of the {self.cfg.n_experts}")
        mask = torch.isin(chosen, self.ids[layer])
        return moe.partials(rows, chosen, weights)[mask]

    def nbytes(self) -> int:
        """The bytes of the experts held here."""
        return sum(linear_bytes(moe) for moe in self.experts.values())


class LocalExperts:
    """ExpertLinks to shelves in this process (device -> its ExpertShelf), computed when called: the profile's
    measurement of a layer run in steps (model/timing.py), and tests."""

    def __init__(self, shelves: Mapping[str, ExpertShelf]):
        self.shelves = shelves
        self.calls: list[tuple[str, int, int]] = []  # (device, layer, rows) of each call

    def start(self, device: str, layer: int, rows: torch.Tensor, chosen: torch.Tensor,
              weights: torch.Tensor) -> ExpertCall:
        self.calls.append((device, layer, rows.shape[0]))
        return Answered(self.shelves[device].partials(layer, rows, chosen, weights))


class Answered:
    """An ExpertCall already answered."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def result(self) -> torch.Tensor:
        return self.out
