"""Profiles for hardware we do not have, derived from one measured profile of this machine by roofline scaling.

The reference is a ClusterProfile written by `edgespec profile` on the development machine: its controller's
`layer_ms`, `embed_ms` and `head_ms` curves were measured for the reference card (SmolLM2-135M). The device
specifications (memory, DRAM bandwidth, peak FLOP/s, OS reserve) come from config/devices.toml.

For every grid point (tokens n, context c) of a reference curve, and a part (decoder layer, embedding, head):

    roofline(card, spec) = max(bytes(card, n, c) / bandwidth, flops(card, n, c) / peak)
    e                    = max(1, t_ref / roofline(reference card, reference spec))
    t_target             = e * roofline(target card, target spec)

so the measured inefficiency of the reference (kernel launches, imperfect overlap, dispatch) carries over
as a factor, while the memory-bound (decoding) or compute-bound (long prefill) regime is decided afresh
for the target. Bytes and FLOPs per part:

    layer: layer weight bytes read + the K/V of (c + n) tokens;               card.layer_flops(n, c)
           (a mixture's: all but its experts, and the experts n rows are expected to choose)
    embed: n rows of the embedding (n * hidden * weight bytes);               no FLOPs
    head:  vocab * hidden weights (ends_params / 2 for untied cards);         2 * vocab * hidden * n

e is clamped at 1: a tiny reference layer can run from the reference's large L3 cache faster than DRAM
allows, which a 7B layer on an edge board cannot. Not modelled: per-call overhead on the target's slower
CPU (it scales with the reference's factor only), thermal throttling, and the GPU's lower clock in power
modes below the maximum.

Memory capacity is device memory minus its reserve; the controller runs on the environment's first device
and takes the token ends' weights out of that device's worker capacity. Links come from the [links] tables.

    python -m planning.testbeds --reference REF.json --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from edgespec.planning.profile import ClusterProfile, Curve, DeviceProfile, LinkProfile, ModelCard

CONFIG = Path(__file__).resolve().parents[1] / "config"
DEVICES_TOML = CONFIG / "devices.toml"
MODELS_DIR = CONFIG / "models"
GIB = 2**30
SMOLLM2_VOCAB = 49152  # the embedded default model's vocabulary (SmolLM2 ties its head to the embedding)


@dataclass(frozen=True)
class DeviceSpec:
    """One device kind's published numbers (see config/devices.toml)."""

    kind: str
    short: str
    memory_gib: float
    reserve_gib: float
    bandwidth_gb_s: float
    peak_gflops: float
    source: str = ""

    def capacity_bytes(self) -> int:
        return int((self.memory_gib - self.reserve_gib) * GIB)

    def roofline_ms(self, nbytes: float, flops: float) -> float:
        return 1000 * max(nbytes / (self.bandwidth_gb_s * 1e9), flops / (self.peak_gflops * 1e9))


def load_specs(path: Path = DEVICES_TOML) -> dict:
    """The parsed devices.toml: tables `devices`, `links`, `environments`."""
    with open(path, "rb") as f:
        return tomllib.load(f)


def device_spec(specs: dict, kind: str) -> DeviceSpec:
    try:
        d = specs["devices"][kind]
    except KeyError:
        raise ValueError(f"no device kind {kind!r} in the specifications") from None
    return DeviceSpec(kind, d["short"], d["memory_gib"], d["reserve_gib"], d["bandwidth_gb_s"], d["peak_gflops"],
                      d.get("source", ""))


def load_card(path: Path) -> ModelCard:
    """A ModelCard from JSON; keys that are not ModelCard fields (notes, sources) are ignored."""
    d = json.loads(Path(path).read_text())
    names = {f.name for f in dataclasses.fields(ModelCard)}
    return ModelCard(**{k: v for k, v in d.items() if k in names})


def head_params(card: ModelCard, vocab: int | None = None) -> int:
    """Weights of the LM head: vocab x hidden; without a vocabulary, the card is taken to be untied."""
    h = card.hidden_size
    if not vocab:
        return (card.ends_params - h) // 2
    if card.ends_params not in (vocab * h + h, 2 * vocab * h + h):  # tied or untied, plus the final norm
        raise ValueError(f"a vocabulary of {vocab} does not match {card.name}'s {card.ends_params} end parameters")
    return vocab * h


def part_costs(card: ModelCard, vocab: int | None):
    """(bytes, flops) functions of (tokens, context) for the layer, the embedding and the head."""
    w = card.weight_bytes_per_param
    head = head_params(card, vocab)
    return {
        "layer": lambda n, c: (card.layer_read_params(n) * w + card.kv_bytes_per_token() * (c + n),
                               card.layer_flops(n, c)),
        "embed": lambda n, c: (n * card.hidden_size * w, 0.0),
        "head": lambda n, c: (head * w, 2.0 * head * n),
    }


def scale_curve(curve: Curve, ref_cost, ref: DeviceSpec, target_cost, target: DeviceSpec) -> Curve:
    """The reference curve moved to another card and device: each point keeps its efficiency factor."""
    rows = []
    for c, row in zip(curve.contexts, curve.ms, strict=True):
        out = []
        for n, t_ref in zip(curve.tokens, row, strict=True):
            roof_ref = ref.roofline_ms(*ref_cost(n, c))
            e = max(1.0, t_ref / roof_ref) if roof_ref > 0 else 1.0
            out.append(e * target.roofline_ms(*target_cost(n, c)))
        rows.append(tuple(out))
    return Curve(curve.tokens, curve.contexts, tuple(rows))


def derive_device(spec: DeviceSpec, card: ModelCard, reference: ClusterProfile, ref_spec: DeviceSpec,
                  reference_vocab: int | None = None, vocab: int | None = None) -> tuple[Curve, Curve, Curve]:
    """(layer_ms, embed_ms, head_ms) of `card` on `spec`, scaled from the reference controller's curves;
    `vocab`: the card's vocabulary (None: the card is taken to be untied)."""
    ref_costs, costs = part_costs(reference.model, reference_vocab), part_costs(card, vocab)
    ctrl = reference.controller
    measured = {"layer": ctrl.layer_ms, "embed": ctrl.embed_ms, "head": ctrl.head_ms}
    curves = []
    for part in ("layer", "embed", "head"):
        # A reference without an end's curve: the pure roofline (e = 1) on the layer curve's token grid.
        base = measured[part] or Curve(ctrl.layer_ms.tokens, (0,), ((0.0,) * len(ctrl.layer_ms.tokens),))
        curves.append(scale_curve(base, ref_costs[part], ref_spec, costs[part], spec))
    return tuple(curves)


def _link(specs: dict, kind: str, src: str, dst: str) -> LinkProfile:
    try:
        lk = specs["links"][kind]
    except KeyError:
        raise ValueError(f"no link kind {kind!r} in the specifications") from None
    return LinkProfile(src, dst, lk["rtt_ms"], lk["bandwidth_mbit_s"] * 1e6 / 8)


def derive_environment(env_name: str, card: ModelCard, reference: ClusterProfile, specs: dict,
                       reference_device: str = "reference", link: str | None = None,
                       reference_vocab: int | None = None) -> ClusterProfile:
    """The ClusterProfile of `card` on environment `env_name` of `specs` (the parsed devices.toml).

    Workers are named <short>-<i> per kind in list order; the controller shares the first device (see the
    module docstring). `link` overrides the environment's link kind; `reference_vocab` is the reference
    card's vocabulary (its head's size, which a tied card's ends_params does not tell; None: untied).
    """
    try:
        env = specs["environments"][env_name]
    except KeyError:
        raise ValueError(f"no environment {env_name!r}; known: {', '.join(specs.get('environments', {}))}") from None
    ref_spec = device_spec(specs, reference_device)
    link = link or env.get("link", "ethernet")
    ends_bytes = int(card.ends_params * card.weight_bytes_per_param)
    counts: dict[str, int] = {}
    workers, host_curves = [], None
    for i, kind in enumerate(env["devices"]):
        spec = device_spec(specs, kind)
        counts[spec.short] = counts.get(spec.short, 0) + 1
        layer, embed, head = derive_device(spec, card, reference, ref_spec, reference_vocab)
        capacity = spec.capacity_bytes() - (ends_bytes if i == 0 else 0)
        if i == 0:
            host_curves = (spec, layer, embed, head)
        workers.append(DeviceProfile(f"{spec.short}-{counts[spec.short]}", layer, capacity,
                                     source=f"derived: {kind} roofline from {reference.model.name} measured"))
    host, layer, embed, head = host_curves
    controller = DeviceProfile("controller", layer, ends_bytes, embed_ms=embed, head_ms=head,
                               source=f"derived: {host.kind} (shares {workers[0].name}'s board)")
    names = [w.name for w in workers]
    links = [LinkProfile("controller", names[0], *_loopback(specs))]
    links += [_link(specs, link, "controller", n) for n in names[1:]]
    links += [_link(specs, link, a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    dtype = "float16" if card.weight_bytes_per_param == 2 else f"{card.weight_bytes_per_param:g} bytes/weight"
    return ClusterProfile(card, dtype, controller, workers, links, specs.get("links", {}).get("margin", 0.15),
                          datetime.now(UTC).isoformat(timespec="seconds"),
                          f"{env_name}: {env.get('notes', '')}; {link} links; derived by planning.testbeds from "
                          f"{reference.model.name} measured {reference.created or ''} (roofline scaling)")


def _loopback(specs: dict) -> tuple[float, float]:
    lk = specs.get("links", {}).get("loopback", {"rtt_ms": 0.1, "bandwidth_mbit_s": 20000.0})
    return lk["rtt_ms"], lk["bandwidth_mbit_s"] * 1e6 / 8


def noisy_points(curve: Curve, factor: float = 2.0) -> list[tuple[int, int]]:
    """Grid points (tokens, context) slower by `factor` than a point with as many or more tokens and context.

    A layer's time cannot fall as tokens or context grow; such points are interference during profiling
    (another process on the cores), and each one carries its inflated efficiency factor into the target.
    """
    points = [(n, c, t) for c, row in zip(curve.contexts, curve.ms, strict=True)
              for n, t in zip(curve.tokens, row, strict=True)]
    return [(n, c) for n, c, t in points
            if any(n2 >= n and c2 >= c and t > factor * t2 for n2, c2, t2 in points)]


def _summary(profile: ClusterProfile) -> str:
    """One line: DP vs even predicted decode ms/token, or why it does not fit."""
    from edgespec.planning.plan import InfeasibleError, make_plan
    from edgespec.planning.report import even_baseline

    try:
        dp = make_plan(profile)
    except InfeasibleError as exc:
        return f"infeasible: {exc}"
    line = f"DP {dp.decode_ms_per_token:.1f} ms/token over {dp.bounds()}"
    even, why = even_baseline(profile, dp.options)
    if even is None:
        return f"{line}; {why}"
    return (f"{line}; even {even.decode_ms_per_token:.1f} ms/token "
            f"(bottleneck DP/even {dp.bottleneck_ms / even.bottleneck_ms:.2f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m planning.testbeds", description=__doc__.split("\n")[0])
    ap.add_argument("--reference", required=True, help="ClusterProfile JSON measured by `edgespec profile`")
    ap.add_argument("--out", required=True, help="folder for the derived profiles")
    ap.add_argument("--devices", default=str(DEVICES_TOML), help="device specifications (TOML)")
    ap.add_argument("--models", nargs="*", help=f"model card JSON files (default: {MODELS_DIR}/*.json)")
    ap.add_argument("--envs", nargs="*", help="environment names (default: all in the TOML)")
    ap.add_argument("--link", help="link kind for every environment (e.g. wifi); adds a -<link> suffix")
    ap.add_argument("--weight-bytes", type=float, help="bytes per weight (e.g. 1 for int8); adds a -w<B> suffix")
    ap.add_argument("--reference-device", default="reference")
    ap.add_argument("--reference-vocab", type=int,
                    help=f"vocabulary of the reference card (default: {SMOLLM2_VOCAB} where the card is SmolLM2's, "
                         "else the card is taken to be untied)")
    args = ap.parse_args(argv)
    specs, reference = load_specs(Path(args.devices)), ClusterProfile.load(Path(args.reference))
    vocab, ref = args.reference_vocab, reference.model
    if vocab is None and ref.ends_params == SMOLLM2_VOCAB * ref.hidden_size + ref.hidden_size:
        vocab = SMOLLM2_VOCAB  # the embedded default model, tied: its whole ends are one vocab x hidden matrix
    controller = reference.controller
    for part, curve in (("layer_ms", controller.layer_ms), ("embed_ms", controller.embed_ms),
                        ("head_ms", controller.head_ms)):
        if curve is not None and (bad := noisy_points(curve)):
            print(f"warning: {args.reference}: {part} at (tokens, context) {bad} is over 2x slower than at larger "
                  "points: a noisy measurement that the derived profiles inherit; profile again on an idle machine",
                  file=sys.stderr)
    cards = [load_card(Path(p)) for p in (args.models or sorted(MODELS_DIR.glob("*.json")))]
    suffix = (f"-{args.link}" if args.link else "") + (f"-w{args.weight_bytes:g}" if args.weight_bytes else "")
    for env in args.envs or list(specs["environments"]):
        for card in cards:
            path = Path(args.out) / f"{env}-{card.name.lower()}{suffix}.json"
            if args.weight_bytes:
                card = dataclasses.replace(card, name=f"{card.name} ({args.weight_bytes:g} B/weight)",
                                           weight_bytes_per_param=args.weight_bytes)
            profile = derive_environment(env, card, reference, specs, args.reference_device, args.link, vocab)
            profile.save(path)
            print(f"{path}: {_summary(profile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
