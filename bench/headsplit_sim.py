"""Predicted per-token decoding latency of layer-based partitioning, head-level partitioning and HeadSplit on a
testbed we do not have (by default the HeadSplit paper's: five Raspberry Pi 4 on 802.11ac Wi-Fi, TinyLlama-1.1B).

    python -m bench.headsplit_sim --out DIR [--profile config/profiles/smollm2-135m-instruct-headsplit.json]

Block times: each block's roofline time on the target (config/devices.toml) times the efficiency factor the
same block showed on the reference machine, e = max(1, measured / roofline), from `edgespec profile-headsplit`'s
block times (as planning/testbeds.py scales whole layers). Links: the environment's link, one token's hidden
state per message, plus the 15% margin. The controller (embedding, head) runs on the first device.

Per token, with F the FFN device, P the projection device and G the group devices of a layer:
- layer-based: contiguous layer ranges, evenly over the devices; the sum of the layers' times and one
  message per hop around the ring.
- head-level: layer l's groups start when X_(l-1) reaches them; Z_l is ready at P_l when every partial output
  and the residual X_(l-1) have arrived and been summed; X_l = Z_l's FFN at F_l.
- HeadSplit: at a speculating layer, the groups start on Z_(l-1) as soon as it is at P_(l-1) (a group device
  that is also F_(l-1) waits for its FFN); kept (probability alpha), Z_l is ready once the speculative partials
  and X_(l-1) are at P_l; rejected, as head-level. The expected time is the alpha-weighted mean.
Blocks are placed by planning/headsplit.py; nothing else contends for a device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgespec.bench.plot import bar_chart
from edgespec.planning.headsplit import HeadDevice, LayerPlace, group_params, head_card, place
from edgespec.planning.profile import LinkProfile, ModelCard
from edgespec.planning.testbeds import CONFIG, MODELS_DIR, DeviceSpec, device_spec, head_params, load_card, load_specs

PROFILE = CONFIG / "profiles" / "smollm2-135m-instruct-headsplit.json"


def block_costs(card: ModelCard, context: int) -> dict[str, tuple[float, float]]:
    """(bytes read, FLOPs) of one decoding token after `context` cached ones, per block of a layer."""
    h, hd, w = card.hidden_size, card.head_dim, card.weight_bytes_per_param
    q = card.n_heads // card.n_kv_heads * hd  # query rows of one KV group
    group = group_params(card)
    ffn = card.layer_params - card.n_kv_heads * group - 2 * h  # the rest of the layer but its norms
    kv = 2 * hd * (context + 1) * card.kv_bytes_per_value
    return {"group_ms": (group * w + kv, 2 * group + 4 * q * (context + 1)),
            "proj_ms": ((card.n_kv_heads + 1) * h * card.activation_bytes_per_value, card.n_kv_heads * h),
            "ffn_ms": (ffn * w, 2 * ffn)}


def scaled_blocks(measured: dict[str, float], ref_card: ModelCard, ref: DeviceSpec, card: ModelCard,
                  target: DeviceSpec, context: int) -> dict[str, float]:
    """The target's block times at `context`: its roofline times the efficiency factor of the reference's block,
    measured for one token after an empty cache."""
    ref_costs, costs = block_costs(ref_card, 0), block_costs(card, context)
    out = {}
    for block, t_ref in measured.items():
        e = max(1.0, t_ref / ref.roofline_ms(*ref_costs[block]))
        out[block] = e * target.roofline_ms(*costs[block])
    return out


def layer_based_ms(card: ModelCard, blocks: dict[str, float], n_devices: int, hop_ms: float, ends_ms: float) -> float:
    """Even contiguous layer ranges on identical devices: every layer in turn, one hop per stage boundary and
    one back to the controller."""
    layer = card.n_kv_heads * blocks["group_ms"] + blocks["proj_ms"] + blocks["ffn_ms"]
    hops = n_devices if min(card.n_layers, n_devices) > 1 else 0
    return ends_ms + card.n_layers * layer + hops * hop_ms


def timeline_ms(layers: list[LayerPlace], devices: dict[str, HeadDevice], link, alphas: list[float],
                controller: str, ends_ms: float) -> float:
    """Expected per-token time of a head-level placement; layers with `speculate` use alphas (see above)."""
    x_at, t_x = controller, 0.0  # where and when the previous layer's output X is
    z_at, t_z = controller, 0.0  # where and when its post-attention state Z is
    for layer, lp in enumerate(layers):

        def z_ready(src: str, t0: float, busy: dict[str, float], lp=lp, x_at=x_at, t_x=t_x) -> float:
            # Z of this layer at its projection device, the groups starting from src's state at t0 (a device
            # busy until busy[d] starts then): every partial and the residual X summed there
            done = max(max(t0 + link(src, d), busy.get(d, 0.0)) + len(g) * devices[d].group_ms + link(d, lp.proj)
                       for d, g in lp.groups.items() if g)
            return max(done, t_x + link(x_at, lp.proj)) + devices[lp.proj].proj_ms

        exact = z_ready(x_at, t_x, {})
        if lp.speculate:
            kept = z_ready(z_at, t_z, {x_at: t_x})  # on Z_(l-1); the FFN device joins when its FFN is done
            t_z = alphas[layer] * kept + (1 - alphas[layer]) * exact
        else:
            t_z = exact
        z_at = lp.proj
        t_x, x_at = t_z + link(lp.proj, lp.ffn) + devices[lp.ffn].ffn_ms, lp.ffn
    return t_x + link(x_at, controller) + ends_ms


def depth_alphas(alphas: list[float], n_layers: int) -> list[float]:
    """Per-layer acceptance profiled on one model, mapped onto a model of `n_layers` by relative depth: layer i
    (depth i / (n_layers - 1)) takes the linear interpolation of the profiled layers at the same depth. Both
    ends map to both ends (layer 0 keeps the profile's first value, 0: it has no previous layer)."""
    if not alphas:
        return [0.0] * n_layers
    if n_layers == 1 or len(alphas) == 1:
        return [float(alphas[0])] * n_layers
    out = []
    for i in range(n_layers):
        pos = i * (len(alphas) - 1) / (n_layers - 1)
        lo = min(int(pos), len(alphas) - 2)
        f = pos - lo
        out.append(round((1 - f) * alphas[lo] + f * alphas[lo + 1], 4))
    return out


CONTROLLER = "controller"


def predict_setting(card: ModelCard, blocks: dict[str, float], names: list[str], hop_ms: float, ends_ms: float,
                    modes: dict[str, tuple[list[LayerPlace], list[float], bool]]) -> dict[str, float]:
    """Predicted ms per token of a measured setting: identical devices `names` (`blocks`: one device's group/
    proj/ffn ms), every message hop_ms, and a controller (embedding, head: ends_ms) on a device of its own, whose
    messages cost hop_ms too. "layer": even layer ranges, one message per hop of the chain controller ->
    devices -> controller; each of `modes` (label -> (placement, alphas, gathered)) by timeline_ms, with the
    controller as every layer's projection device where not `gathered`."""
    devices = {d: HeadDevice(d, blocks["group_ms"], blocks["proj_ms"], blocks["ffn_ms"], 0)
               for d in [*names, CONTROLLER]}

    def link(a: str, b: str) -> float:
        return 0.0 if a == b else hop_ms

    chain = (len(names) + 1) * hop_ms  # controller -> first device -> ... -> last device -> controller
    out = {"layer": round(layer_based_ms(card, blocks, len(names), 0.0, ends_ms) + chain, 3)}
    for label, (layers, alphas, gathered) in modes.items():
        if not gathered:
            layers = [LayerPlace(lp.groups, CONTROLLER, lp.ffn, lp.speculate) for lp in layers]
        out[label] = round(timeline_ms(layers, devices, link, alphas, CONTROLLER, ends_ms), 3)
    return out


def simulate(card: ModelCard, spec: DeviceSpec, n_devices: int, link_profile: LinkProfile, margin: float,
             measured: dict[str, float], ref_card: ModelCard, ref: DeviceSpec, alphas: list[float],
             context: int) -> dict:
    """The three modes' predicted ms per token on n identical devices, with per-layer acceptance `alphas`."""
    blocks = scaled_blocks(measured, ref_card, ref, card, spec, context)
    hop = link_profile.transfer_ms(card.activation_bytes(1), margin)
    w = card.weight_bytes_per_param
    head = head_params(card)
    ends_ms = spec.roofline_ms(head * w, 2 * head) + spec.roofline_ms(card.hidden_size * w, 0)
    names = [f"{spec.short}-{i}" for i in range(n_devices)]
    devices = {n: HeadDevice(n, blocks["group_ms"], blocks["proj_ms"], blocks["ffn_ms"], spec.capacity_bytes())
               for n in names}
    hcard = head_card(card)

    def link(a: str, b: str) -> float:
        return 0.0 if a == b else hop

    speculating = place(list(devices.values()), hcard, alphas, link, context)
    plain = place(list(devices.values()), hcard, [0.0] * card.n_layers, link, context)
    layer = layer_based_ms(card, blocks, n_devices, hop, ends_ms)
    head_level = timeline_ms(plain, devices, link, alphas, names[0], ends_ms)
    headsplit = timeline_ms(speculating, devices, link, alphas, names[0], ends_ms)
    # what no placement beats with free links: groups spread evenly (head-level), and also every attention hidden
    # behind the previous FFN (HeadSplit with every speculation kept); the FFN runs whole on one device either way
    groups_ms = -(-card.n_kv_heads // n_devices) * blocks["group_ms"]
    free_head = card.n_layers * (groups_ms + blocks["proj_ms"] + blocks["ffn_ms"]) + ends_ms
    free_split = card.n_layers * (max(groups_ms, blocks["ffn_ms"]) + blocks["proj_ms"]) + ends_ms
    return {"block_ms": {k: round(v, 4) for k, v in blocks.items()}, "hop_ms": round(hop, 4),
            "ends_ms": round(ends_ms, 4), "speculating_layers": sum(lp.speculate for lp in speculating),
            "ms_per_token": {"layer": round(layer, 3), "head": round(head_level, 3), "headsplit": round(headsplit, 3)},
            "speedup_over_layer": {"head": round(layer / head_level, 3), "headsplit": round(layer / headsplit, 3)},
            "bound_without_link_costs": {"attention_share_of_layer": round(
                card.n_kv_heads * blocks["group_ms"] / (card.n_kv_heads * blocks["group_ms"] + blocks["proj_ms"]
                                                        + blocks["ffn_ms"]), 4),
                "head_speedup": round(layer / free_head, 3), "headsplit_speedup": round(layer / free_split, 3)}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile", type=Path, default=PROFILE, help="from `edgespec profile-headsplit`")
    ap.add_argument("--model", type=Path, default=MODELS_DIR / "tinyllama-1.1b.json", help="the target's card")
    ap.add_argument("--environment", default="headsplit", help="devices and link, from config/devices.toml")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.7, 0.8, 0.9, 1.0],
                    help="acceptance of every layer after the first (the target's own cannot be measured here)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens when the token is decoded")
    args = ap.parse_args(argv)
    specs = load_specs()
    env = specs["environments"][args.environment]
    kinds = set(env["devices"])
    if len(kinds) != 1:
        raise SystemExit("the simulation takes identical devices")
    spec = device_spec(specs, kinds.pop())
    lk = specs["links"][env["link"]]
    link = LinkProfile("a", "b", lk["rtt_ms"], lk["bandwidth_mbit_s"] * 1e6 / 8)
    profile = json.loads(args.profile.read_text())
    ref_card = ModelCard(**profile["card"])
    measured = profile["block_ms"]["by_context"]["0"]
    card = load_card(args.model)
    results = {str(a): simulate(card, spec, len(env["devices"]), link, specs["links"]["margin"], measured, ref_card,
                                device_spec(specs, "reference"), [a] * card.n_layers, args.context)
               for a in args.alphas}
    summary = {"settings": {"model": card.name, "environment": args.environment, "devices": env["devices"],
                            "link": env["link"], "context": args.context, "reference_profile": args.profile.name,
                            "reference_block_ms": measured},
               "by_alpha": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "headsplit_sim.json").write_text(json.dumps(summary, indent=2) + "\n")
    bar_chart(args.out / "headsplit_sim.png", f"{card.name} on {env.get('notes', args.environment)}: predicted",
              [(f"alpha {a}: ms per token", list(r["ms_per_token"]), list(r["ms_per_token"].values()))
               for a, r in results.items()])
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
