"""A placement: which device holds which layers, what it costs, and how long prompts are cut.

make_plan searches device orders (and subsets) with the layer DP (planning/layers.py), then precomputes the
sequence partition (planning/sequence.py) per prompt-length bucket. Pure functions of the profile.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

from edgespec.planning.experts import ExpertPlacement, StageRoom, expert_bytes, n_away, place_experts
from edgespec.planning.layers import partition_layers
from edgespec.planning.profile import IDLE_MS, ClusterProfile, DeviceProfile, ModelCard
from edgespec.planning.sequence import choose_segments, min_segment

GIB = 2**30
MAX_ORDERS = 2000  # ordered subsets searched exhaustively up to this many; beyond, fastest-first


class InfeasibleError(ValueError):
    """No placement fits the devices' memory; the message gives the numbers."""


@dataclass(frozen=True)
class PlanOptions:
    """What the placement must hold and what it balances."""

    context: int = 2048  # KV slots per session every stage must hold
    concurrency: int = 1  # sessions at once
    tokens: int = 1  # tokens per pass the layer split balances (1: decoding)
    decode_context: int = 512  # context at which per-token times are predicted
    memory_fraction: float = 1.0  # share of each device's capacity the plan may fill
    search_order: bool = True  # try device orders and subsets, not only the given order
    segments_per_device: int = 4  # k <= this * number of stages
    buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    quantum: int = 16  # sequence cuts fall on multiples of this


@dataclass(frozen=True)
class StagePlan:
    device: str
    url: str | None
    first: int
    last: int  # layers [first, last)
    weight_bytes: int
    kv_bytes: int  # KV for context x concurrency
    capacity_bytes: int
    ms_per_token: float  # decode compute plus sending the output on (and waiting for experts held away)
    # a mixture's experts placed apart (planning/experts.py): those of this stage's layers held by other devices
    # (layer -> device -> ids), and those this device holds of other stages' layers (layer -> ids)
    away: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    hosted: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class SequencePlan:
    bucket: int  # prompts up to this many tokens
    cuts: tuple[int, ...]  # segment ends; the last is the bucket
    bottleneck_ms: float  # W: the slowest segment's slowest stage
    predicted_ms: float  # sum of h_i + (stages - 1) * W


@dataclass
class Plan:
    model: str
    stages: list[StagePlan]
    controller_ms_per_token: float  # embedding, head and the first hop
    bottleneck_ms: float  # slowest stage at options.tokens (the layer DP's objective)
    decode_ms_per_token: float  # predicted: controller plus every stage, in turn
    min_segment: int  # b
    prefill: list[SequencePlan] = field(default_factory=list)
    options: PlanOptions = field(default_factory=PlanOptions)
    method: str = "dp"

    def bounds(self) -> list[tuple[int, int]]:
        return [(s.first, s.last) for s in self.stages]

    def sequence_cuts(self, prompt_len: int) -> list[int]:
        """Segment ends for a prompt: the smallest bucket that holds it, its cuts scaled to the prompt."""
        if prompt_len <= 0:
            return []
        for sp in self.prefill:
            if prompt_len <= sp.bucket:
                break
        else:
            sp = self.prefill[-1] if self.prefill else SequencePlan(prompt_len, (prompt_len,), 0.0, 0.0)
        cuts = sorted({max(1, min(prompt_len, round(c * prompt_len / sp.bucket))) for c in sp.cuts})
        return cuts if cuts[-1] == prompt_len else [*cuts, prompt_len]

    def predicted_prefill_ms(self, prompt_len: int) -> float:
        for sp in self.prefill:
            if prompt_len <= sp.bucket:
                return sp.predicted_ms * prompt_len / sp.bucket
        return math.nan

    def to_dict(self) -> dict:
        return asdict(self)


def room(d: DeviceProfile, options: PlanOptions, card: ModelCard) -> float:
    """What a device's layers may fill: its share of capacity, less what a stage holds besides its layers."""
    return d.memory_capacity_bytes * options.memory_fraction - card.stage_bytes


class _Costs:
    """Stage times and memory for one device order."""

    def __init__(self, profile: ClusterProfile, order: list[DeviceProfile], options: PlanOptions, spill: int = 0):
        """spill: experts of each layer the split counts as held elsewhere (a mixture whose whole layers do not
        fit: planning/experts.py)."""
        self.p, self.order, self.o = profile, order, options
        card = profile.model
        self.whole_layer_bytes = card.layer_weight_bytes() + \
            card.kv_bytes_per_token() * options.context * options.concurrency
        self.layer_bytes = self.whole_layer_bytes - spill * expert_bytes(card)
        # the DP asks for O(L^2) ranges per device: look each device's numbers up once
        self.max_layers = [int(room(d, options, card) // self.layer_bytes) for d in order]
        self.layer_ms = [d.layer_ms(options.tokens, options.decode_context) for d in order]
        names = [d.name for d in order] + [profile.controller.name]
        self.hop_ms = [profile.transfer_ms(a, b, options.tokens) for a, b in itertools.pairwise(names)]

    def stage_ms(self, i: int, first: int, last: int) -> float:
        """Layers [first, last) on device i at the balanced pass size, plus sending the output on."""
        if last - first > self.max_layers[i]:
            return math.inf
        return (last - first) * self.layer_ms[i] + self.hop_ms[i]

    def stage_ms_at(self, i: int, first: int, last: int, tokens: int, context: int) -> float:
        """The same stage on a pass of `tokens` tokens after `context` cached ones."""
        nxt = self.order[i + 1].name if i + 1 < len(self.order) else self.p.controller.name
        return (last - first) * self.order[i].layer_ms(tokens, context) + \
            self.p.transfer_ms(self.order[i].name, nxt, tokens)

    def controller_ms(self, tokens: int, context: int) -> float:
        c = self.p.controller
        own = (c.embed_ms(tokens, context) if c.embed_ms else 0.0) + (c.head_ms(1, context) if c.head_ms else 0.0)
        return own + self.p.transfer_ms(c.name, self.order[0].name, tokens)


def _orders(profile: ClusterProfile, options: PlanOptions) -> list[list[DeviceProfile]]:
    workers = profile.workers
    if not options.search_order:
        return [workers]
    n = len(workers)
    count = sum(math.perm(n, k) for k in range(1, n + 1))
    if count <= MAX_ORDERS:
        return [list(p) for k in range(1, n + 1) for p in itertools.permutations(workers, k)]
    fastest = sorted(workers, key=lambda d: d.layer_ms(options.tokens, options.decode_context))
    return [fastest[:k] for k in range(1, n + 1)]


def _check_memory(profile: ClusterProfile, options: PlanOptions) -> None:
    card = profile.model
    weights = card.n_layers * card.layer_weight_bytes()
    kv = card.n_layers * card.kv_bytes_per_token() * options.context * options.concurrency
    caps = [room(d, options, card) for d in profile.workers]
    need = (f"{card.name} needs {(weights + kv) / GIB:.2f} GiB for its {card.n_layers} layers "
            f"({weights / GIB:.2f} GiB of weights + {kv / GIB:.2f} GiB of KV cache for {options.context} tokens x "
            f"{options.concurrency} sessions)")
    if weights + kv > sum(caps):
        raise InfeasibleError(f"{need} but the {len(caps)} devices offer {sum(caps) / GIB:.2f} GiB")
    per_layer = (weights + kv) / card.n_layers
    held = sum(int(c // per_layer) for c in caps)
    if held < card.n_layers and not card.n_experts:  # whole layers (a mixture's experts may go apart)
        offers = ", ".join(f"{d.name} {c / GIB:.2f}" for d, c in zip(profile.workers, caps, strict=True))
        raise InfeasibleError(f"{need}, {per_layer / GIB:.3f} GiB per layer, but the devices ({offers} GiB) hold "
                              f"only {held} whole layers")


def _ends_ms(c: DeviceProfile, ctx: int) -> float:
    """The controller's embedding and head for one decoded token."""
    return (c.embed_ms(1, ctx) if c.embed_ms else 0.0) + (c.head_ms(1, ctx) if c.head_ms else 0.0)


def _decode_hops(profile: ClusterProfile, costs: _Costs, bounds: list[tuple[int, int]], ctx: int) -> list[float]:
    """Each hop of a decoding step (controller -> first stage, ..., last stage -> controller), with the wake-up
    of its receiver, which has been idle while every other part of the step ran."""
    c = profile.controller
    own = [_ends_ms(c, ctx)]
    own += [(last - first) * costs.order[i].layer_ms(1, ctx) for i, (first, last) in enumerate(bounds)]
    names = [c.name] + [d.name for d in costs.order[:len(bounds)]] + [c.name]
    busy = sum(own) + sum(profile.transfer_ms(a, b, 1) for a, b in itertools.pairwise(names))
    receivers = [*own[1:], own[0]]  # hop j arrives at stage j, the last one back at the controller
    return [profile.transfer_ms(a, b, 1, busy - mine) for (a, b), mine in
            zip(itertools.pairwise(names), receivers, strict=True)]


def shares_hardware(devices: list[DeviceProfile]) -> bool:
    """Whether two of these devices compute on the same cores (local workers on one machine)."""
    seen = [d.hardware for d in devices if d.hardware is not None]
    return len(seen) != len(set(seen))


def _rooms(costs: _Costs, bounds: list[tuple[int, int]]) -> list[StageRoom]:
    return [StageRoom(costs.order[i].name, first, last, (last - first) * costs.whole_layer_bytes,
                      int(room(costs.order[i], costs.o, costs.p.model)))
            for i, (first, last) in enumerate(bounds)]


def _place_experts(profile: ClusterProfile, costs: _Costs, bounds: list[tuple[int, int]]) -> ExpertPlacement | None:
    """Where the stages' whole layers overflow them, the experts they shed and where (planning/experts.py)."""
    rooms = _rooms(costs, bounds)
    if all(r.need_bytes <= r.capacity_bytes for r in rooms):
        return ExpertPlacement()
    if not profile.model.n_experts:
        return None
    # a call's round trip wakes both ends: the host idles until called, the stage's link waits for the answer
    return place_experts(profile.model, rooms, lambda a, b: profile.transfer_ms(a, b, 1, IDLE_MS) +
                         profile.transfer_ms(b, a, 1, IDLE_MS), {d.name: d.split_ms for d in profile.workers})


def _finish(profile: ClusterProfile, costs: _Costs, bounds: list[tuple[int, int]], experts: ExpertPlacement,
            options: PlanOptions, method: str) -> Plan:
    card, ctx = profile.model, options.decode_context
    hops = _decode_hops(profile, costs, bounds, ctx)
    stages = []
    for i, (first, last) in enumerate(bounds):
        d = costs.order[i]
        away, hosted = experts.away_of(first, last), experts.hosted(d.name)
        moved = n_away(away) - sum(map(len, hosted.values()))
        stages.append(StagePlan(d.name, d.url, first, last,
                                (last - first) * card.layer_weight_bytes() - moved * expert_bytes(card),
                                (last - first) * card.kv_bytes_per_token() * options.context * options.concurrency,
                                d.memory_capacity_bytes,
                                (last - first) * d.layer_ms(1, ctx) + hops[i + 1] + experts.wait_ms.get(d.name, 0.0),
                                away, hosted))
    controller = _ends_ms(profile.controller, ctx) + hops[0]
    bottleneck = max(costs.stage_ms(i, f, last) for i, (f, last) in enumerate(bounds))
    plan = Plan(card.name, stages, controller, bottleneck, controller + sum(s.ms_per_token for s in stages), 1,
                options=options, method=method)

    def seg_ms(s: int, ctx: int) -> float:
        # T*(s, l): the slowest stage (the controller included) on a segment of s tokens after ctx
        return max(costs.controller_ms(s, ctx), *(costs.stage_ms_at(i, f, last, s, ctx)
                                                  for i, (f, last) in enumerate(bounds)))

    grid = sorted({n for d in [profile.controller, *profile.workers] for n in d.layer_ms.tokens})
    plan.min_segment = min_segment(lambda n: seg_ms(n, 0), grid)
    # Stages on shared cores cannot overlap: a prompt goes through them in one pass, each stage in turn (three
    # local workers on two cores took 10.2 s for a 558-token prompt in 12 segments, predicted 3.6 s as if overlapped)
    shared = shares_hardware(costs.order[:len(bounds)])
    max_k = options.segments_per_device * len(bounds)
    for bucket in (b for b in options.buckets if b <= card.context):
        if shared:
            stages_ms = [costs.stage_ms_at(i, f, last, bucket, 0) for i, (f, last) in enumerate(bounds)]
            one = costs.controller_ms(bucket, 0)
            plan.prefill.append(SequencePlan(bucket, (bucket,), max(one, *stages_ms), one + sum(stages_ms)))
            continue
        _, cuts, latency, worst = choose_segments(bucket, len(bounds), seg_ms, plan.min_segment, max_k,
                                                  options.quantum)
        plan.prefill.append(SequencePlan(bucket, tuple(cuts), worst, latency))
    return plan


def make_plan(profile: ClusterProfile, options: PlanOptions | None = None) -> Plan:
    """The placement minimising the slowest stage (then the sum of stages) over device orders and subsets."""
    options = options or PlanOptions()
    if not profile.workers:
        raise InfeasibleError("there are no workers to place layers on")
    _check_memory(profile, options)
    card = profile.model
    for spill in _spills(profile, options):
        best = None
        for order in _orders(profile, options):
            if len(order) > card.n_layers:
                continue
            costs = _Costs(profile, order, options, spill)
            found = partition_layers(card.n_layers, len(order), costs.stage_ms)
            if found is None:
                continue
            bottleneck, total, bounds = found
            experts = _place_experts(profile, costs, bounds)
            if experts is None:  # the experts its stages shed find no room
                continue
            key = (max(bottleneck, costs.controller_ms(options.tokens, options.decode_context)), total)
            if best is None or key < best[0]:
                best = (key, costs, bounds, experts)
        if best is not None:
            return _finish(profile, *best[1:], options, "dp")
    cap = max(room(d, options, card) for d in profile.workers)
    raise InfeasibleError(f"no order of the {len(profile.workers)} devices fits {card.name}: each layer needs "
                          f"{_Costs(profile, profile.workers, options).layer_bytes / GIB:.4f} GiB and the "
                          f"largest device offers {cap / GIB:.4f} GiB" +
                          (" (with room left for the experts its layers shed)" if card.n_experts else ""))


def _spills(profile: ClusterProfile, options: PlanOptions) -> list[int]:
    """The experts per layer the layer split may count as held elsewhere, tried in turn: none, then (a mixture)
    each count that lets the devices hold more layers than the one before, from the first that holds them all."""
    card = profile.model
    spills = [0]
    if not card.n_experts:
        return spills
    whole = _Costs(profile, profile.workers, options).whole_layer_bytes
    caps = [room(d, options, card) for d in profile.workers]
    held = sum(int(c // whole) for c in caps)
    for s in range(1, card.n_experts + 1):
        now = sum(int(c // (whole - s * expert_bytes(card))) for c in caps)
        if now > held and now >= card.n_layers:
            spills.append(s)
        held = max(held, now)
    return spills


def even_plan(profile: ClusterProfile, options: PlanOptions | None = None) -> Plan:
    """Layers split evenly over all workers in the given order (the baseline the DP is compared with)."""
    from edgespec.planning.split import even_split

    options = options or PlanOptions()
    card, n = profile.model, len(profile.workers)
    if not 1 <= n <= card.n_layers:
        raise InfeasibleError(f"{n} workers cannot split {card.n_layers} layers evenly")
    costs = _Costs(profile, list(profile.workers), options)
    bounds = even_split(card.n_layers, n)
    for d, most, (first, last) in zip(profile.workers, costs.max_layers, bounds, strict=True):
        if last - first > most:
            raise InfeasibleError(f"even split does not fit: {d.name} would hold {last - first} layers, "
                                  f"{(last - first) * costs.layer_bytes / GIB:.2f} GiB, of "
                                  f"{d.memory_capacity_bytes * options.memory_fraction / GIB:.2f} GiB")
    return _finish(profile, costs, bounds, ExpertPlacement(), options, "even")
