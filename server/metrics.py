"""Prometheus metrics of one controller process (own registry, no module-level collectors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest


class KVFigures(Protocol):
    """What a lane's KV figures are read from (engine/executor.py's Executor)."""

    def pool_blocks(self) -> tuple[int, int]:
        """Blocks used and free."""

    def kv_bytes(self) -> int:
        """Bytes held."""


class Metrics:
    """Counters and histograms served at GET /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends
        self.requests = Counter("edgespec_requests", "HTTP API requests by route and status", ["route", "status"],
                                registry=r)
        self.in_flight = Gauge("edgespec_requests_in_flight", "generations running now", registry=r)
        self.tokens = Counter("edgespec_generated_tokens", "completion tokens by policy", ["policy"], registry=r)
        self.prompt_tokens = Counter("edgespec_prompt_tokens", "prompt tokens processed", registry=r)
        self.ttft = Histogram("edgespec_time_to_first_token_seconds", "time to first token", ["policy"], registry=r,
                              buckets=(0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
        self.decode_rate = Histogram("edgespec_decode_tokens_per_second", "decode speed per request", ["policy"],
                                     registry=r, buckets=(1, 5, 10, 20, 30, 40, 50, 75, 100, 150, 200, 400))
        self.tokens_per_step = Histogram("edgespec_tokens_per_step", "tokens per decoding step per request",
                                         ["policy"], registry=r, buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8))
        self.acceptance = Histogram("edgespec_acceptance_rate", "accepted share of drafted tokens per request",
                                    ["policy"], registry=r, buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1))
        self.accepted_length = Histogram("edgespec_accepted_length", "candidates accepted per tree step (medusa)",
                                         ["policy"], registry=r, buckets=(0, 1, 2, 3, 4, 5, 6, 8))
        self.drafter_seconds = Counter("edgespec_drafter_seconds", "time spent drafting", ["policy", "drafter"],
                                       registry=r)
        self.wire_bytes = Counter("edgespec_wire_bytes", "payload bytes sent over each link", ["link"], registry=r)
        self.wire_requests = Counter("edgespec_wire_requests", "messages over each link", ["link"], registry=r)
        self.stage_forward = Histogram("edgespec_stage_forward_seconds", "forward time per stage call", ["stage"],
                                       registry=r, buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 2))
        self.kv_bytes = Gauge("edgespec_kv_cache_bytes", "bytes held by KV caches", registry=r)
        self.kv_blocks = Gauge("edgespec_kv_pool_blocks", "the layer pipeline's KV pool blocks, in-process or on "
                               "workers: used (holding entries) and free (neither used nor reserved by an open "
                               "session)", ["state"], registry=r)
        self.lane_kv_blocks = Gauge("edgespec_kv_blocks", "KV blocks of each lane of the engine, used (held by "
                                    "sessions) and free (what the budget leaves): layers, the layer pipeline's pools "
                                    "(as edgespec_kv_pool_blocks: 64 slots of a stage's layers); headsplit, "
                                    "HeadSplit's devices (64 slots of one KV group in one layer, a session's whole "
                                    "capacity held from its open)", ["lane", "state"], registry=r)
        self.lane_kv_bytes = Gauge("edgespec_kv_lane_bytes", "bytes held by each lane's KV caches (summed over "
                                   "lanes: the KV memory in use)", ["lane"], registry=r)
        self.replans = Counter("edgespec_replans", "re-planning decisions by reason and outcome",
                               ["reason", "outcome"], registry=r)
        self.placement_layers = Gauge("edgespec_placement_layers", "decoder layers each worker holds", ["device"],
                                      registry=r)
        self.sessions_rebuilt = Gauge("edgespec_sessions_rebuilt", "sessions prefilled again after a re-plan, "
                                      "since start", registry=r)
        self.prefix_hits = Gauge("edgespec_prefix_cache_hits", "requests that reused a cached prompt prefix, "
                                 "since start", registry=r)
        self.prefix_tokens = Gauge("edgespec_prefix_cache_reused_tokens", "prompt tokens whose KV was reused, "
                                   "since start", registry=r)
        self.prefix_bytes = Gauge("edgespec_prefix_cache_bytes", "KV bytes kept for prefix reuse (estimate)",
                                  registry=r)
        self.sequences_running = Gauge("edgespec_sequences_running", "sequences the engine steps now", registry=r)
        self.shared_passes = Gauge("edgespec_shared_passes", "engine steps that carried several sequences' rows, "
                                   "since start", registry=r)
        self.shared_pass_calls = Gauge("edgespec_shared_pass_calls", "sequences those steps carried, since "
                                       "start (over edgespec_shared_passes: requests per shared pass)", registry=r)
        self.steps = Gauge("edgespec_steps", "forward passes run, since start", registry=r)
        self.step_rows = Gauge("edgespec_step_rows", "token rows those passes carried, since start (over "
                               "edgespec_steps: rows per step)", registry=r)
        self.program_seconds = Gauge("edgespec_program_seconds", "model-thread CPU seconds the requests' programs "
                                     "took after the passes (sampling, drafting, verifying, text), since start "
                                     "(over edgespec_generated_tokens_total: per token)", registry=r)
        self.sequences_waiting = Gauge("edgespec_sequences_waiting", "requests waiting for KV cache room now",
                                       registry=r)
        self.queue_admitted = Gauge("edgespec_queue_admitted", "requests that waited for KV cache room and then "
                                    "fit, since start", registry=r)
        self.queue_refused = Gauge("edgespec_queue_refused", "requests refused with 503 by a full queue or a wait "
                                   "that ran out, since start", registry=r)
        self.queue_wait = Gauge("edgespec_queue_wait_seconds", "time admitted requests spent waiting, summed since "
                                "start (over edgespec_queue_admitted: the mean wait)", registry=r)
        self.workers_up = Gauge("edgespec_workers_up", "workers answering the controller's checks", registry=r)
        self.worker_memory_use = Gauge("edgespec_worker_memory_use_ratio",
                                       "weights plus KV caches over each worker's memory budget", ["device"],
                                       registry=r)

    def observe_generation(self, stats: dict, tokens: int) -> None:
        policy = stats["policy"]
        self.tokens.labels(policy).inc(tokens)
        self.ttft.labels(policy).observe(stats["ttft_ms"] / 1000)
        if stats["decode_tokens_per_s"]:
            self.decode_rate.labels(policy).observe(stats["decode_tokens_per_s"])
        if stats["tokens_per_step"]:
            self.tokens_per_step.labels(policy).observe(stats["tokens_per_step"])
        if stats["acceptance_rate"] is not None:
            self.acceptance.labels(policy).observe(stats["acceptance_rate"])
        for length, steps in stats.get("accepted_length_histogram", {}).items():
            for _ in range(steps):
                self.accepted_length.labels(policy).observe(int(length))
        if stats.get("drafter"):
            self.drafter_seconds.labels(policy, stats["drafter"]).inc(stats["drafter_ms"] / 1000)

    def observe_admission(self, admission) -> None:
        """The admission queue's figures (engine.admission.Admission), read when /metrics is scraped."""
        self.sequences_waiting.set_function(lambda: admission.waiting)
        self.queue_admitted.set_function(lambda: admission.admitted)
        self.queue_refused.set_function(lambda: admission.refused)
        self.queue_wait.set_function(lambda: admission.waited_s)

    def observe_lane(self, lane: str, figures: Callable[[], KVFigures | None]) -> None:
        """A lane's KV figures, read when /metrics is scraped: figures() is the lane's executor once the lane is
        built, else None (nothing held)."""
        def read(pick: Callable[[KVFigures], int]) -> Callable[[], int]:
            return lambda: pick(f) if (f := figures()) is not None else 0

        self.lane_kv_blocks.labels(lane, "used").set_function(read(lambda f: f.pool_blocks()[0]))
        self.lane_kv_blocks.labels(lane, "free").set_function(read(lambda f: f.pool_blocks()[1]))
        self.lane_kv_bytes.labels(lane).set_function(read(lambda f: f.kv_bytes()))

    def observe_hop(self, link: str, nbytes: int, stage: str | None, forward_ms: float | None) -> None:
        """One link crossed by a forward call (called on the model thread; prometheus-client is thread-safe)."""
        self.wire_bytes.labels(link).inc(nbytes)
        self.wire_requests.labels(link).inc()
        if stage is not None and forward_ms:
            self.stage_forward.labels(stage).observe(forward_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
