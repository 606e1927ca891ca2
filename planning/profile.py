"""What the planner plans from: a model card, device profiles and link profiles, stored as one JSON file.

Pure data and arithmetic: no torch, no HTTP. The profiler (workers/profiler.py) measures these; derived
profiles for hardware we do not have (planning/testbeds.py) are computed from published specifications.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

PROFILE_VERSION = 1
IDLE_MS = 30.0  # the idle time before the probe of LinkProfile.rtt_idle_ms


@dataclass(frozen=True)
class ModelCard:
    """The numbers of a decoder-only model that placement depends on."""

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer_params: int  # parameters of one decoder layer
    ends_params: int  # embedding, final norm and head: held by the controller
    context: int  # the model's maximum context
    weight_bytes_per_param: float = 2.0  # 2 for bf16/fp16, 1 for int8, about 0.56 for 4-bit
    kv_bytes_per_value: float = 2.0  # 4 float32, 2 float16, 1.0625 q8_0 (its blocks' scales included)
    activation_bytes_per_value: int = 2  # hidden states on the wire
    # a mixture of experts (Qwen3-MoE): each layer's FFN is n_experts experts of expert_params each (layer_params
    # counts them all: a device holds them all), of which a row reads experts_per_token; 0: a dense model
    n_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    # each layer's routing frequency per expert (the share of calibration tokens whose top-k holds it: model/
    # routing.py); empty: not measured (k/E each)
    expert_use: tuple[tuple[float, ...], ...] = ()
    stage_bytes: int = 0  # what a stage holds besides its layers: the rotary tables (40960 positions: 42 MB)

    def layer_weight_bytes(self) -> int:
        return int(self.layer_params * self.weight_bytes_per_param)

    def layer_read_params(self, tokens: int) -> float:
        """Parameters a pass of `tokens` rows reads in one layer: all of a dense layer's; of a mixture's, all but
        its experts, and the experts its rows choose, expected E (1 - (1 - k/E)^tokens) for rows that each choose
        k of E at random (a row reads k; many rows read nearly all E)."""
        if not self.n_experts:
            return self.layer_params
        e, k = self.n_experts, self.experts_per_token
        chosen = e * (1 - (1 - k / e) ** tokens)
        return self.layer_params - (e - chosen) * self.expert_params

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return round(2 * self.n_kv_heads * self.head_dim * self.kv_bytes_per_value)

    def activation_bytes(self, tokens: int) -> int:
        """One hidden state [tokens, hidden] crossing a link."""
        return tokens * self.hidden_size * self.activation_bytes_per_value

    def layer_flops(self, tokens: int, context: int) -> float:
        """Floating-point operations of one layer for `tokens` new tokens after `context` cached ones."""
        attention = 4 * self.n_heads * self.head_dim * tokens * (context + (tokens + 1) / 2)
        return 2 * self.layer_read_params(1) * tokens + attention  # each row through its own experts


@dataclass(frozen=True)
class Curve:
    """Milliseconds as a function of tokens in the pass and of context length, measured on a grid.

    ms[i][j] is the time at contexts[i] and tokens[j]. Between grid points the time is interpolated
    linearly; past the last token count it grows in proportion to the tokens, past the last context
    linearly with the last two contexts' slope (attention's cost grows linearly with context).
    """

    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]

    def __post_init__(self):
        if not self.tokens or list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError(f"curve tokens must be increasing and >= 1, got {self.tokens}")
        if not self.contexts or list(self.contexts) != sorted(set(self.contexts)) or self.contexts[0] < 0:
            raise ValueError(f"curve contexts must be increasing and >= 0, got {self.contexts}")
        if len(self.ms) != len(self.contexts) or any(len(row) != len(self.tokens) for row in self.ms):
            raise ValueError("curve ms must have one row per context and one value per token count")

    @classmethod
    def constant(cls, ms_per_token: float) -> Curve:
        return cls((1,), (0,), ((ms_per_token,),))

    def _row(self, row: tuple[float, ...], n: float) -> float:
        toks = self.tokens
        if n >= toks[-1]:
            return row[-1] * n / toks[-1]
        if n <= toks[0]:
            return row[0]
        j = bisect.bisect_right(toks, n)
        t0, t1 = toks[j - 1], toks[j]
        return row[j - 1] + (row[j] - row[j - 1]) * (n - t0) / (t1 - t0)

    def __call__(self, n: float, context: float = 0) -> float:
        ctxs = self.contexts
        if len(ctxs) == 1:
            return self._row(self.ms[0], n)
        i = min(max(bisect.bisect_right(ctxs, context), 1), len(ctxs) - 1)
        c0, c1 = ctxs[i - 1], ctxs[i]
        a, b = self._row(self.ms[i - 1], n), self._row(self.ms[i], n)
        return max(a + (b - a) * (max(context, 0) - c0) / (c1 - c0), 0.0)

    def scaled(self, factor_for) -> Curve:
        """A curve with each point multiplied by factor_for(tokens, context)."""
        return Curve(self.tokens, self.contexts,
                     tuple(tuple(v * factor_for(n, c) for n, v in zip(self.tokens, row, strict=True))
                           for c, row in zip(self.contexts, self.ms, strict=True)))


@dataclass(frozen=True)
class DeviceProfile:
    """One device: its time per decoder layer, memory, and (for the controller) embedding and head time."""

    name: str
    layer_ms: Curve
    memory_capacity_bytes: int  # what weights plus KV caches may use on this device
    memory_used_bytes: int = 0  # in use when profiled (by anything)
    url: str | None = None  # None for the controller
    embed_ms: Curve | None = None
    head_ms: Curve | None = None  # final norm and head over the last position
    source: str = "measured"
    # The hardware it computes on (host and CPU set): devices with the same one share their cores, so their
    # stages cannot overlap (local workers on one machine); None: its own.
    hardware: str | None = None
    # what a mixture's sparse layer costs it more at one row run in steps, some experts held elsewhere (model/
    # timing.py's time_split), beside the calls' round trips
    split_ms: float = 0.0


@dataclass(frozen=True)
class LinkProfile:
    """A directed link between two devices."""

    src: str
    dst: str
    rtt_ms: float
    bandwidth_bytes_per_s: float
    # the round trip when the far end has been idle IDLE_MS, as a pipeline stage is while the others compute
    # (its wake-up: 0.85 ms against 0.15 ms back to back, measured between two local workers); None: unmeasured
    rtt_idle_ms: float | None = None

    def transfer_ms(self, nbytes: int, margin: float = 0.0, idle: float = 0.0) -> float:
        """One message of nbytes: half a round trip plus its serialisation time, inflated by the margin;
        `idle` in [0, 1]: the share of IDLE_MS the receiver has been idle, whose wake-up the message waits for."""
        wake = idle * max(0.0, (self.rtt_idle_ms or self.rtt_ms) - self.rtt_ms)
        return (self.rtt_ms / 2 + wake + 1000 * nbytes / self.bandwidth_bytes_per_s) * (1 + margin)


@dataclass
class ClusterProfile:
    """Everything the planner needs about a model on a set of devices."""

    model: ModelCard
    dtype: str
    controller: DeviceProfile
    workers: list[DeviceProfile]
    links: list[LinkProfile] = field(default_factory=list)
    margin: float = 0.15  # safety margin on link times
    created: str = ""
    notes: str = ""

    def with_kv_bytes(self, per_value: float) -> ClusterProfile:
        """This profile with the model card's KV cache at `per_value` bytes a value (the served KV format)."""
        return replace(self, model=replace(self.model, kv_bytes_per_value=per_value))

    def device(self, name: str) -> DeviceProfile:
        for d in [self.controller, *self.workers]:
            if d.name == name:
                return d
        raise KeyError(f"no device named {name!r} in the profile")

    def link(self, src: str, dst: str) -> LinkProfile:
        """The link src -> dst; a device to itself is free; a missing direction uses the other one."""
        if src == dst:
            return LinkProfile(src, dst, 0.0, float("inf"))
        found = {(lk.src, lk.dst): lk for lk in self.links}
        lk = found.get((src, dst)) or found.get((dst, src))
        if lk is None:
            raise KeyError(f"the profile has no link between {src!r} and {dst!r}")
        return lk

    def transfer_ms(self, src: str, dst: str, tokens: int, idle_ms: float = 0.0) -> float:
        """Time to send a hidden state of `tokens` tokens from src to dst, with the profile's margin; `idle_ms`:
        how long dst has been idle (its wake-up is part of the message's time)."""
        idle = min(1.0, max(0.0, idle_ms) / IDLE_MS)
        return self.link(src, dst).transfer_ms(self.model.activation_bytes(tokens), self.margin, idle)

    def without(self, names: set[str]) -> ClusterProfile:
        """The profile minus some workers (lost ones)."""
        return ClusterProfile(self.model, self.dtype, self.controller, [w for w in self.workers if w.name not in names],
                              self.links, self.margin, self.created, self.notes)

    # storage

    def to_dict(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> ClusterProfile:
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')!r} is not {PROFILE_VERSION}")

        def curve(c):
            return None if c is None else Curve(tuple(c["tokens"]), tuple(c["contexts"]),
                                                tuple(tuple(r) for r in c["ms"]))

        def device(x):
            return DeviceProfile(**{**x, "layer_ms": curve(x["layer_ms"]), "embed_ms": curve(x.get("embed_ms")),
                                    "head_ms": curve(x.get("head_ms"))})

        card = ModelCard(**{**d["model"], "expert_use": tuple(map(tuple, d["model"].get("expert_use", ())))})
        return cls(card, d["dtype"], device(d["controller"]), [device(w) for w in d["workers"]],
                   [LinkProfile(**lk) for lk in d.get("links", [])], d.get("margin", 0.15), d.get("created", ""),
                   d.get("notes", ""))

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ClusterProfile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a valid profile ({type(exc).__name__}: {exc})") from exc
