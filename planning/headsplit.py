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

Placement is greedy: FFN and projection blocks first, each to the least-loaded device (by time) with room;
then each layer's KV groups, one at a time, to the device that keeps the layer's attention time (slowest
device's groups plus its link to the projection device) least, where a speculating layer's attention must fit
in the previous layer's FFN time (a layer that cannot is placed without speculation) and avoids the device
computing that FFN. Link times are the
measured round trips plus the profile's 15% margin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planning.profile import ModelCard

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
    return HeadCard(card.n_layers, card.n_kv_heads, group, 2 * card.head_dim * card.kv_bytes_per_value, 0,
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
    """A layer's attention time: its slowest device's groups and their hop to the projection device."""
    return max((len(g) * devices[d].group_ms + link(d, proj) for d, g in groups.items() if g), default=0.0)


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

    def take(nbytes: int, ms: Callable[[HeadDevice], float], what: str) -> str:
        fits = [d for d in devices if room[d.name] >= nbytes]
        if not fits:
            raise InfeasibleError(f"no device has room for {what} ({nbytes} bytes)")
        best = min(fits, key=lambda d: (load[d.name] + ms(d), d.name))
        room[best.name] -= nbytes
        load[best.name] += ms(best)
        return best.name

    layers = []
    for layer in range(card.n_layers):
        ffn = take(card.ffn_bytes, lambda d: d.ffn_ms, f"layer {layer}'s FFN")
        proj = take(card.proj_bytes, lambda d: d.proj_ms, f"layer {layer}'s projection")
        layers.append(LayerPlace({}, proj, ffn))
    group_bytes = card.group_bytes + card.group_kv_bytes_per_token * context
    for layer, lp in enumerate(layers):
        budget = by_name[layers[layer - 1].ffn].ffn_ms if spec[layer] else float("inf")
        groups: dict[str, list[int]] = {}
        # the previous layer's FFN device computes while a speculating layer's attention would run: it takes
        # this layer's groups only when no other device has room
        busy = layers[layer - 1].ffn if spec[layer] else None
        for g in range(card.n_groups):
            fits = [d for d in devices if room[d.name] >= group_bytes]
            fits = [d for d in fits if d.name != busy] or fits
            if not fits:
                raise InfeasibleError(f"no device has room for KV group {g} of layer {layer} ({group_bytes} bytes)")

            def after(d: HeadDevice, g=g, groups=groups, proj=lp.proj) -> float:
                trial = {**groups, d.name: [*groups.get(d.name, []), g]}
                return attention_ms(trial, by_name, proj, link)

            best = min(fits, key=lambda d: (after(d), load[d.name], d.name))
            groups.setdefault(best.name, []).append(g)
            room[best.name] -= group_bytes
            load[best.name] += best.group_ms
        lp.groups = groups
        lp.speculate = spec[layer] and attention_ms(groups, by_name, lp.proj, link) <= budget
    return layers
