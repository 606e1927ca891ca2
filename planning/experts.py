"""Expert placement: which experts of a mixture's layers live away from their layer's device, and where.

A layer's experts stay with its layer wherever the devices' memory allows: a pass that needs an expert held
elsewhere waits a round trip for it (on this 2-core EPYC a one-row pass of the 7B-A1B mixture's experts takes
0.36 ms a layer, a loopback round trip about as much, a home network's several times that), so spreading
experts for parallel compute would lose time on every layer. Placement is memory's answer: where whole layers
do not fit the devices (the total does), the layer split (planning/plan.py) is planned with each layer
`spill` experts lighter, and then each stage over its capacity sheds just enough experts to fit, the ones whose
absence costs least, to the devices with room left.

The cost of a shed set is the expected number of round trips per token: a token needs layer l's away experts
with probability P_l = 1 - prod(1 - f_e) over them, f_e the share of tokens whose top-k holds expert e (the
measured routing frequency, model/routing.py; k/E each where none was measured). Shedding greedily the expert
whose marginal cost (1 - P_l) f_e is least picks rarely used experts, and gathers them in the layers that
already call out (a second away expert of a layer costs less than a first one of another). Each layer's shed
experts go to one device where one has the room, the nearest first (the measured round trip), so a token waits
at most one round trip per layer; its expected cost, P_l times that round trip (both ends woken: the host idles
until called), and the device's measured cost of running such a layer in steps (DeviceProfile.split_ms) are
added to the stage's time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from edgespec.planning.profile import ModelCard


@dataclass(frozen=True)
class StageRoom:
    """One stage as expert placement sees it: its device, its layers [first, last), the bytes they need whole
    (weights and KV) and the device's capacity."""

    device: str
    first: int
    last: int
    need_bytes: int
    capacity_bytes: int


@dataclass
class ExpertPlacement:
    """away[layer] = {device: expert ids} held away from the layer's stage; the expected extra milliseconds per
    decoded token each stage waits for them."""

    away: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    wait_ms: dict[str, float] = field(default_factory=dict)

    def hosted(self, device: str) -> dict[int, list[int]]:
        """The experts `device` holds of other stages' layers."""
        return {layer: ids for layer, where in self.away.items() for d, ids in where.items() if d == device}

    def away_of(self, first: int, last: int) -> dict[int, dict[str, list[int]]]:
        """The away experts of layers [first, last)."""
        return {layer: where for layer, where in self.away.items() if first <= layer < last}


def n_away(away: Mapping[int, Mapping[str, Sequence[int]]]) -> int:
    """How many experts a placement's `away` (layer -> device -> ids) puts on other devices."""
    return sum(len(ids) for where in away.values() for ids in where.values())


def expert_bytes(card: ModelCard) -> int:
    """One expert's weights."""
    return int(card.expert_params * card.weight_bytes_per_param)


def use_of(card: ModelCard, layer: int) -> Sequence[float]:
    """Layer `layer`'s measured routing frequency per expert (the share of tokens choosing each), else k/E."""
    if card.expert_use:
        return card.expert_use[layer]
    return [card.experts_per_token / card.n_experts] * card.n_experts


def shed(card: ModelCard, first: int, last: int, count: int) -> dict[int, list[int]]:
    """The `count` experts of layers [first, last) whose absence costs least (the module docstring's greedy):
    layer -> ascending ids. Ties go to the later layer and the higher id, so a plan is the same every time."""
    kept = {layer: dict(enumerate(use_of(card, layer))) for layer in range(first, last)}
    stay = {layer: 1.0 for layer in range(first, last)}  # 1 - P_l: no away expert of l needed
    out: dict[int, list[int]] = {}
    for _ in range(count):
        options = [(stay[layer] * f, -layer, -e) for layer, use in kept.items() for e, f in use.items()]
        if not options:
            break
        _, neg_layer, neg_e = min(options)
        layer, e = -neg_layer, -neg_e
        stay[layer] *= 1 - min(1.0, kept[layer].pop(e))
        out.setdefault(layer, []).append(e)
    return {layer: sorted(ids) for layer, ids in sorted(out.items())}


def place_experts(card: ModelCard, stages: Sequence[StageRoom], round_trip_ms: Callable[[str, str], float],
                  split_ms: Mapping[str, float]) -> ExpertPlacement | None:
    """Each stage over its capacity sheds the fewest experts that fit it (`shed`), placed on the stages with
    room left, each layer's together on the nearest one that holds them, else spread nearest first. None when the
    room left does not hold them. A stage's wait: each split layer's `split_ms` of its device (the layer in
    steps), and each call's probability times its round trip."""
    size = expert_bytes(card)
    room = {s.device: s.capacity_bytes - s.need_bytes for s in stages}
    placement = ExpertPlacement()
    for s in stages:
        over = s.need_bytes - s.capacity_bytes
        if over <= 0:
            continue
        room[s.device] = 0
        gone = shed(card, s.first, s.last, math.ceil(over / size))
        if sum(map(len, gone.values())) * size < over:
            return None  # every expert of its layers would not do
        wait = 0.0
        for layer, ids in sorted(gone.items(), key=lambda kv: -len(kv[1])):
            hosts = sorted((d for d in room if d != s.device and room[d] >= size),
                           key=lambda d: (round_trip_ms(s.device, d), -room[d], d))
            whole = [d for d in hosts if room[d] >= len(ids) * size]
            order = whole[:1] or hosts
            where: dict[str, list[int]] = {}
            left = list(ids)
            for d in order:
                take = left[:room[d] // size]
                left = left[len(take):]
                if take:
                    where[d] = take
                    room[d] -= len(take) * size
            if left:
                return None
            placement.away[layer] = where
            wait += split_ms.get(s.device, 0.0)
            use = use_of(card, layer)
            for d, taken in where.items():
                p = 1 - math.prod(1 - min(1.0, use[e]) for e in taken)
                wait += p * round_trip_ms(s.device, d)
        placement.wait_ms[s.device] = wait
    return placement
