"""The live dashboard: GET /dashboard (one self-contained HTML page) and GET /dashboard/state (the JSON it polls).

The state is read from what the controller already holds: the CompletionService (settings, engine, policies), the
ClusterManager (members, plan, profile) and the Metrics object's prometheus collectors (read with `collect()`, as
a scrape of /metrics would). No tensor code and no transport code here. The page itself is dashboard.html beside
this module: HTML, CSS and JavaScript in one file, no build step, nothing fetched from elsewhere.
"""

from __future__ import annotations

import time
from collections import deque
from importlib import resources
from itertools import pairwise
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from edgespec.decoding.headsplit import HEADSPLIT
from edgespec.model.headsplit import HeadSplitPipeline
from edgespec.planning.experts import n_away

if TYPE_CHECKING:
    from edgespec.server.service import CompletionService

HISTORY = 20  # plan changes and re-plan events the state keeps for the page's log


Mode = Literal["in-process", "workers", "controller"]  # DashboardState.mode


class LayerRange(BaseModel):
    """Decoder layers [first, last) on one device."""

    first: int = Field(description="first layer held")
    last: int = Field(description="one past the last layer held")


class Device(BaseModel):
    """The controller or one worker, with what it holds now."""

    name: str = Field(description="'controller', or the worker's name")
    role: Literal["controller", "worker"]
    url: str | None = Field(None, description="the worker's URL; None for the controller")
    up: bool = Field(description="answering the controller's checks (the controller: always)")
    layers: list[LayerRange] = Field(description="decoder layers held by the current plan's stages")
    head_groups: int = Field(0, description="KV head groups held over all layers by the HeadSplit placement, once "
                             "the headsplit policy has placed its pipeline")
    experts: int = Field(0, description="a mixture of experts' experts the device holds: its sparse layers' own, "
                         "less those placed on other devices, plus those it holds of other devices' layers")
    memory_use: float | None = Field(None, description="weights plus KV caches over the memory budget (workers: "
                                     "as of the last check; in-process: the KV pool over --kv-cache-gib)")
    memory_budget_bytes: int | None = Field(None, description="the budget memory_use is measured against")
    forward_calls: int = Field(0, description="forward calls this stage reported (edgespec_stage_forward_seconds)")
    forward_mean_ms: float | None = Field(None, description="their mean forward time, ms")


class Link(BaseModel):
    """Traffic over one directed link since start (edgespec_wire_bytes / edgespec_wire_requests)."""

    link: str = Field(description="'src->dst'")
    src: str
    dst: str
    bytes: float = Field(description="payload bytes sent")
    messages: float = Field(description="messages sent")
    current: bool = Field(description="on the current plan's route (links of earlier placements stay listed)")


class Requests(BaseModel):
    """What the engine holds now."""

    running: float = Field(description="sequences the engine steps now (edgespec_sequences_running)")
    waiting: float = Field(description="requests waiting for KV cache room (edgespec_sequences_waiting)")
    in_flight: float = Field(description="generations running now (edgespec_requests_in_flight)")


class PolicyFigures(BaseModel):
    """One decoding policy's totals since start."""

    policy: str
    generated_tokens: float = Field(description="completion tokens (edgespec_generated_tokens)")
    acceptance_mean: float | None = Field(None, description="mean accepted share of drafted tokens per request "
                                          "(edgespec_acceptance_rate); None for a policy that does not draft")
    acceptance_requests: int = Field(0, description="requests that mean is over")


class ReplanCount(BaseModel):
    """Re-planning decisions of one reason and outcome since start (edgespec_replans)."""

    reason: str = Field(description="memory, worker_lost, worker_joined, stage_failed or retry")
    outcome: str = Field(description="applied, kept, infeasible, failed or controller")
    count: float


class Event(BaseModel):
    """A change seen between two reads of the state: a re-plan decision or a new placement."""

    time: float = Field(description="Unix time at which it was seen")
    kind: Literal["replan", "placement"]
    text: str = Field(description="'reason: outcome (xN)', or the new layout")


class HeadSplitLayer(BaseModel):
    """Where one layer's HeadSplit blocks run."""

    layer: int
    groups: dict[str, list[int]] = Field(description="device -> the layer's KV head groups it holds")
    proj: str = Field(description="device of the layer's output projection")
    ffn: str = Field(description="device of the layer's FFN")
    speculate: bool = Field(description="its attention speculates on the previous layer's input")


class DashboardState(BaseModel):
    """Everything the dashboard page shows, read at one moment."""

    time: float = Field(description="Unix time of this read: rates are differences between two reads")
    started: float = Field(description="Unix time the dashboard (so, about, the server) started")
    model: str = Field(description="the served model's id")
    mode: Mode = Field(
        description="in-process: no workers; workers: the plan's stages hold the layers; controller: no placement "
        "over the workers left fits and the controller holds every layer until they answer again")
    n_layers: int = Field(description="decoder layers of the model")
    layout: str = Field(description="the current placement in one line")
    placement_generation: int = Field(description="bumped by every re-assignment of the stages")
    predicted_ms_per_token: float | None = Field(None, description="the plan's predicted decode latency")
    memory_threshold: float = Field(description="a worker's memory use that triggers a re-plan (--memory-threshold)")
    devices: list[Device]
    headsplit: list[HeadSplitLayer] | None = Field(None, description="the HeadSplit placement, once placed")
    links: list[Link]
    requests: Requests
    generated_tokens: float = Field(description="completion tokens since start, all policies")
    prompt_tokens: float = Field(description="prompt tokens processed since start")
    policies: list[PolicyFigures]
    replans: list[ReplanCount]
    events: list[Event] = Field(description=f"the last {HISTORY} re-plan decisions and placement changes seen")


def samples(metric, suffix: str = "") -> list[tuple[dict[str, str], float]]:
    """(labels, value) of a prometheus metric's samples named <name><suffix> ('_total', '_sum', '_count'...)."""
    return [(s.labels, s.value) for family in metric.collect() for s in family.samples
            if s.name == family.name + suffix]


def by_label(metric, label: str, suffix: str = "") -> dict[str, float]:
    return {labels[label]: value for labels, value in samples(metric, suffix)}


def gauge(metric) -> float:
    return sum(value for _, value in samples(metric))


def gauge_total(metric) -> float:
    """A counter without labels: its _total sample."""
    return sum(value for _, value in samples(metric, "_total"))


class Dashboard:
    """Reads the state of one controller; remembers the last placement and re-plan counts it saw, so that
    changes between two reads show as events (a page that polls every second sees each as it happens)."""

    def __init__(self, service: CompletionService):
        self.service = service
        self.started = time.time()
        self.events: deque[Event] = deque(maxlen=HISTORY)
        self.layout: str | None = None
        self.replan_counts: dict[tuple[str, str], float] = {}

    @staticmethod
    def page() -> str:
        """The page's HTML (read on each call: small, and an edited file shows without a restart)."""
        return resources.files("edgespec.server").joinpath("dashboard.html").read_text(encoding="utf-8")

    def state(self) -> DashboardState:
        service, metrics = self.service, self.service.metrics
        now = time.time()
        cluster = service.cluster
        n_layers = service.loaded.cfg.n_layers
        stages = [] if cluster is None else list(cluster.plan.stages)
        here = cluster is None or cluster.here is not None  # the controller holds every layer
        mode: Mode = "in-process" if cluster is None else "controller" if here else "workers"
        layout = f"controller [0, {n_layers})" if here else \
            " · ".join(f"{s.device} [{s.first}, {s.last})" for s in stages) or "no placement yet"
        headsplit = self._headsplit()
        devices = self._devices(n_layers, stages, here, headsplit)
        route = {f"{a}->{b}" for a, b in pairwise(["controller", *(s.device for s in stages), "controller"])} \
            if stages else set()
        messages = by_label(metrics.wire_requests, "link", "_total")
        links = [Link(link=name, src=name.partition("->")[0], dst=name.partition("->")[2], bytes=nbytes,
                      messages=messages.get(name, 0), current=name in route)
                 for name, nbytes in sorted(by_label(metrics.wire_bytes, "link", "_total").items())]
        tokens = by_label(metrics.tokens, "policy", "_total")
        accepted_sum = by_label(metrics.acceptance, "policy", "_sum")
        accepted_n = by_label(metrics.acceptance, "policy", "_count")
        policies = [PolicyFigures(policy=p, generated_tokens=tokens.get(p, 0),
                                  acceptance_mean=accepted_sum[p] / accepted_n[p] if accepted_n.get(p) else None,
                                  acceptance_requests=int(accepted_n.get(p, 0)))
                    for p in sorted(set(tokens) | set(accepted_n))]
        replans = [ReplanCount(reason=labels["reason"], outcome=labels["outcome"], count=value)
                   for labels, value in samples(metrics.replans, "_total")]
        self._note_changes(now, layout, replans)
        return DashboardState(
            time=now, started=self.started, model=service.model_id, mode=mode, n_layers=n_layers, layout=layout,
            placement_generation=service.engine.executor.generation,
            predicted_ms_per_token=cluster.plan.decode_ms_per_token if cluster is not None and stages else None,
            memory_threshold=service.settings.memory_threshold, devices=devices, headsplit=headsplit, links=links,
            requests=Requests(running=gauge(metrics.sequences_running), waiting=gauge(metrics.sequences_waiting),
                              in_flight=gauge(metrics.in_flight)),
            generated_tokens=sum(tokens.values()), prompt_tokens=gauge_total(metrics.prompt_tokens),
            policies=policies, replans=replans, events=list(self.events))

    def _devices(self, n_layers: int, stages, here: bool, headsplit: list[HeadSplitLayer] | None) -> list[Device]:
        service, metrics, cluster = self.service, self.service.metrics, self.service.cluster
        forward_sum = by_label(metrics.stage_forward, "stage", "_sum")
        forward_n = by_label(metrics.stage_forward, "stage", "_count")
        groups: dict[str, int] = {}
        for layer in headsplit or []:
            for name, held in layer.groups.items():
                # in-process HeadSplit names its one device "local": it is the controller's process
                name = "controller" if name == "local" else name
                groups[name] = groups.get(name, 0) + len(held)

        def figures(name: str) -> dict:
            n = int(forward_n.get(name, 0))
            return {"forward_calls": n, "forward_mean_ms": 1000 * forward_sum[name] / n if n else None,
                    "head_groups": groups.get(name, 0)}

        # the controller's own KV pool, over --kv-cache-gib, while it holds layers (with workers the pools are
        # theirs, and their rows show their memory use)
        budget = max(1, int(service.settings.kv_cache_gib * 2**30))
        cfg = service.loaded.cfg

        def experts(ranges: list[LayerRange]) -> int:
            return sum(cfg.n_experts for r in ranges for i in range(r.first, r.last) if cfg.sparse(i))

        own = [LayerRange(first=0, last=n_layers)] if here else []
        controller = Device(name="controller", role="controller", up=True, layers=own, experts=experts(own),
                            memory_use=service.engine.executor.kv_bytes() / budget if here else None,
                            memory_budget_bytes=budget if here else None, **figures("controller"))
        if cluster is None:
            return [controller]
        use = by_label(metrics.worker_memory_use, "device")
        ranges: dict[str, list[LayerRange]] = {}
        moved: dict[str, int] = {}  # experts held of other devices' layers, less those of its own held elsewhere
        for s in stages:
            ranges.setdefault(s.device, []).append(LayerRange(first=s.first, last=s.last))
            moved[s.device] = moved.get(s.device, 0) + sum(map(len, s.hosted.values())) - n_away(s.away)
        workers = []
        for m in list(cluster.members.values()):
            try:
                capacity = cluster.profile.device(m.name).memory_capacity_bytes
            except KeyError:  # joined since the profile was read; its budget shows after the re-plan
                capacity = None
            own = ranges.get(m.name, [])
            workers.append(Device(name=m.name, role="worker", url=m.url, up=m.up, layers=own,
                                  experts=experts(own) + moved.get(m.name, 0),
                                  memory_use=use.get(m.name), memory_budget_bytes=capacity, **figures(m.name)))
        return [controller, *workers]

    def _headsplit(self) -> list[HeadSplitLayer] | None:
        # The engine's HeadSplit lane is built at the first headsplit request: until then there is no placement
        lane = self.service.engine.built(HEADSPLIT)
        pipeline = lane.executor.pipeline if lane is not None else None
        if not isinstance(pipeline, HeadSplitPipeline):
            return None
        layers = pipeline.layers
        return [HeadSplitLayer(layer=i, groups={d: list(g) for d, g in lp.groups.items()}, proj=lp.proj, ffn=lp.ffn,
                               speculate=lp.speculate) for i, lp in enumerate(layers)]

    def _note_changes(self, now: float, layout: str, replans: list[ReplanCount]) -> None:
        # the first read is the starting point: what happened before it has no time of its own to show
        first = self.layout is None
        for r in replans:
            key = (r.reason, r.outcome)
            grown = r.count - self.replan_counts.get(key, 0)
            self.replan_counts[key] = r.count
            if grown > 0 and not first:
                times = f" (x{grown:g})" if grown > 1 else ""
                self.events.append(Event(time=now, kind="replan", text=f"{r.reason}: {r.outcome}{times}"))
        if layout != self.layout and not first:
            self.events.append(Event(time=now, kind="placement", text=layout))
        self.layout = layout

