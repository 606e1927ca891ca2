"""HeadSplit placement (SPAWC'26): which layers speculate, and where each layer's blocks run.

Pure arithmetic over block times, memory and links: no torch, no HTTP. The blocks of layer l are its KV
groups (a KV head, its query heads, their columns of the output projection and their cache), its projection
block (gathers the groups' outputs and adds the residual: Z, the post-attention state) and its FFN block
(post-attention norm, FFN and residual: X, the layer's output).

Speculation (DESIGN.md section 7): layer l's attention may start on Z of layer l-1 while that layer's FFN runs;
the FFN device compares Z with X and keeps the speculation when they are close. With per-layer acceptance
probability alpha_l from offline profiling, layer l speculates when

    alpha_l >= alpha_min  and  min(T_FFN(l-1), T_attn(l)) - (1 - alpha_l) * T_attn(l) > 0

evaluated on a preliminary placement (groups spread evenly, every FFN on the median-capacity device).

Placement is greedy: projection and FFN blocks first, layer by layer, each to the device with room where it adds
least to a token's time, its work plus the round trip of its input and output (a projection from the previous
layer's projection device, an FFN from this layer's), and among equals to the least-loaded device. For one
stream of tokens the layers run one after another, so spreading the FFNs by load alone would add a round trip
per layer and balance nothing; the load decides between devices the links do not separate, and memory spreads
the blocks once a device is full. The projection device runs the step's schedule (model/headsplit.py), so it
changes only when the links or memory say so. Then each layer's KV groups, one at a time, go to the device that
keeps the layer's attention time (slowest device's groups plus its round trip from and to the projection
device) least; a speculating layer's groups avoid the device computing the previous FFN, and the speculation
test is taken again with the attention time of the groups as placed (the overlap it gains is at most the
previous FFN time: min(T_FFN, T_attn)); a layer that fails it is placed as a plain one. Link times are the
measured round trips plus the profile's 15% margin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edgespec.planning.profile import ModelCard

ALPHA_MIN = 0.7


@dataclass(frozen=True)
class HeadDevice:
    """One device's block times for one decoding token (ms) and its memory for blocks."""

    name: str
    group_ms: float  # attention of one KV group, its projection columns included
    proj_ms: float  # gathering the groups' outputs and adding the residual
    ffn_ms: float  # post-attention norm, FFN, residual
    capacity_bytes: int


@dataclass(frozen=True)
class HeadCard:
    """Block sizes of a model, in bytes."""

    n_layers: int
    n_groups: int  # KV heads per layer
    group_bytes: int  # weights of one KV group (q, k, v rows and its projection columns)
    group_kv_bytes_per_token: int  # one KV group's cache per token
    proj_bytes: int
    ffn_bytes: int
    activation_bytes: int  # one token's hidden state on the wire


def group_params(card: ModelCard) -> int:
    """Weights of one KV group: its query, key and value rows and its columns of the output projection."""
    q = card.n_heads // card.n_kv_heads * card.head_dim  # query rows of the group
    return (q + 2 * card.head_dim) * card.hidden_size + card.hidden_size * q


def head_card(card: ModelCard) -> HeadCard:
    """The block sizes of a model card. The projection block only sums the groups' outputs (their projection
    columns travel with the groups): it holds no weights."""
    group = int(group_params(card) * card.weight_bytes_per_param)
    return HeadCard(card.n_layers, card.n_kv_heads, group, round(2 * card.head_dim * card.kv_bytes_per_value), 0,
                    card.layer_weight_bytes() - card.n_kv_heads * group, card.activation_bytes(1))


@dataclass
class LayerPlace:
    """Where one layer's blocks run, and whether its attention speculates on the previous layer's Z."""

    groups: dict[str, list[int]]  # device -> its KV groups of this layer
    proj: str
    ffn: str
    speculate: bool = False


Link = Callable[[str, str], float]  # ms to send one token's hidden state from one device to another


def worthwhile(alpha: float, t_ffn_prev: float, t_attn: float, alpha_min: float = ALPHA_MIN) -> bool:
    """The speculation test for one layer: likely enough to be kept, and a gain in expectation."""
    return alpha >= alpha_min and min(t_ffn_prev, t_attn) - (1 - alpha) * t_attn > 0


def attention_ms(groups: dict[str, list[int]], devices: dict[str, HeadDevice], proj: str, link: Link) -> float:
    """A layer's attention time: its slowest device's groups and their round trip from and to the projection
    device (which sends each group device the layer's input and sums the partial outputs)."""
    return max((len(g) * devices[d].group_ms + link(proj, d) + link(d, proj) for d, g in groups.items() if g),
               default=0.0)


def spread(n_groups: int, names: list[str]) -> dict[str, list[int]]:
    """KV groups dealt round-robin over the devices."""
    out: dict[str, list[int]] = {d: [] for d in names}
    for g in range(n_groups):
        out[names[g % len(names)]].append(g)
    return out


def speculating_layers(devices: list[HeadDevice], card: HeadCard, alphas: list[float], link: Link,
                       alpha_min: float = ALPHA_MIN) -> list[bool]:
    """Per layer, whether it speculates, decided on the preliminary placement (groups spread evenly, FFN and
    projection on the median-capacity device). Layer 0 has no previous FFN to overlap."""
    by_name = {d.name: d for d in devices}
    median = sorted(devices, key=lambda d: d.capacity_bytes)[(len(devices) - 1) // 2]
    groups = spread(card.n_groups, [d.name for d in devices])
    t_attn = attention_ms(groups, by_name, median.name, link)
    return [layer > 0 and worthwhile(alphas[layer], median.ffn_ms, t_attn, alpha_min) for layer in range(card.n_layers)]


class InfeasibleError(ValueError):
    """The blocks do not fit the devices' memory."""


def place(devices: list[HeadDevice], card: HeadCard, alphas: list[float], link: Link, context: int,
          alpha_min: float = ALPHA_MIN) -> list[LayerPlace]:
    """The greedy HeadSplit placement for `context` tokens of KV cache per group (see the module docstring)."""
    if len(alphas) != card.n_layers:
        raise ValueError(f"{len(alphas)} acceptance probabilities for {card.n_layers} layers")
    by_name = {d.name: d for d in devices}
    spec = speculating_layers(devices, card, alphas, link, alpha_min)
    load = dict.fromkeys(by_name, 0.0)  # ms of work per token placed on each device
    room = {d.name: d.capacity_bytes for d in devices}

    def take(nbytes: int, ms: Callable[[HeadDevice], float], what: str, hop: Callable[[str], float]) -> str:
        # the device with room where the block adds least to the token's time (its work and the round trip of
        # its input and output), the least-loaded one among equals
        fits = [d for d in devices if room[d.name] >= nbytes]
        if not fits:
            raise InfeasibleError(f"no device has room for {what} ({nbytes} bytes)")
        best = min(fits, key=lambda d: (ms(d) + hop(d.name), load[d.name] + ms(d), d.name))
        room[best.name] -= nbytes
        load[best.name] += ms(best)
        return best.name

    def round_trip(a: str | None):
        return lambda b: 0.0 if a is None else link(a, b) + link(b, a)

    layers: list[LayerPlace] = []
    for layer in range(card.n_layers):
        # the projection from where the previous layer gathered; the FFN from this layer's projection device
        proj = take(card.proj_bytes, lambda d: d.proj_ms, f"layer {layer}'s projection",
                    round_trip(layers[-1].proj if layers else None))
        ffn = take(card.ffn_bytes, lambda d: d.ffn_ms, f"layer {layer}'s FFN", round_trip(proj))
        layers.append(LayerPlace({}, proj, ffn))
    group_bytes = card.group_bytes + card.group_kv_bytes_per_token * context

    def place_groups(lp: LayerPlace, layer: int, busy: str | None) -> dict[str, list[int]]:
        # the layer's groups one at a time where its attention time grows least; `busy` (the previous layer's
        # FFN device, computing while a speculating layer's attention runs) takes them only when no other has room
        groups: dict[str, list[int]] = {}
        for g in range(card.n_groups):
            fits = [d for d in devices if room[d.name] - group_bytes * len(groups.get(d.name, [])) >= group_bytes]
            fits = [d for d in fits if d.name != busy] or fits
            if not fits:
                raise InfeasibleError(f"no device has room for KV group {g} of layer {layer} ({group_bytes} bytes)")

            def after(d: HeadDevice, g=g) -> float:
                return attention_ms({**groups, d.name: [*groups.get(d.name, []), g]}, by_name, lp.proj, link)

            best = min(fits, key=lambda d: (after(d), load[d.name] + d.group_ms * len(groups.get(d.name, [])),
                                            d.name))
            groups.setdefault(best.name, []).append(g)
        return groups

    for layer, lp in enumerate(layers):
        groups = place_groups(lp, layer, layers[layer - 1].ffn if spec[layer] else None)
        # the speculation test again, on this placement's times: a layer whose attention the previous FFN hides
        # too little of to pay for the redos is placed as a plain layer
        lp.speculate = spec[layer] and worthwhile(alphas[layer], by_name[layers[layer - 1].ffn].ffn_ms,
                                                  attention_ms(groups, by_name, lp.proj, link), alpha_min)
        if spec[layer] and not lp.speculate:
            groups = place_groups(lp, layer, None)
        lp.groups = groups
        for name, gs in groups.items():
            room[name] -= group_bytes * len(gs)
            load[name] += by_name[name].group_ms * len(gs)
    return layers


def profiled_alphas(record: dict | None, n_layers: int, epsilon: float) -> list[float]:
    """Per-layer acceptance at `epsilon` from an offline profile (`edgespec profile-headsplit`): the largest
    profiled tolerance not above it (alpha grows with epsilon, so this errs towards not speculating); zeros
    without a profile or below every profiled tolerance."""
    table = {float(k): v for k, v in (record or {}).get("alpha", {}).items()}
    below = [e for e in table if e <= epsilon]
    return list(table[max(below)]) if below else [0.0] * n_layers


def profiled_devices(record: dict | None, capacities: dict[str, int], context: int = 0) -> list[HeadDevice]:
    """Devices (name -> memory for blocks) with the profile's block times at the nearest profiled context not
    above `context` (one device type: the machine that profiled; unit times without a profile)."""
    by_context = (record or {}).get("block_ms", {}).get("by_context", {})
    fits = [int(c) for c in by_context if int(c) <= context] or [min(map(int, by_context), default=0)]
    ms = by_context.get(str(max(fits)), {"group_ms": 1.0, "proj_ms": 0.0, "ffn_ms": 1.0})
    return [HeadDevice(name, ms["group_ms"], ms["proj_ms"], ms["ffn_ms"], cap) for name, cap in capacities.items()]
