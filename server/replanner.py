"""The controller's cluster manager: places layers by the plan, watches the workers, re-plans.

Re-planning happens when a worker's memory use (weights plus KV caches over its budget) crosses the
threshold, when a worker is lost (two missed checks; or at once, when a forward call fails mid-generation:
`recover`), and when one joins (or comes back empty; a local worker whose process died is started again). A
new placement is applied on the model thread between forward passes: every worker of the new plan is assigned
its layers (which drops its caches), then each open session prefills its tokens again on the new placement at
its next step (Executor.replace), so a stream continues with the tokens it would have had. When no
placement over the workers left fits, the controller holds every layer itself while its memory allows, until
workers answer again. No tensor code here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace

import httpx

from edgespec.engine.executor import Executor
from edgespec.model.load import local_pipeline
from edgespec.model.source import resolve_model
from edgespec.model.stage import StagePipeline
from edgespec.planning.plan import InfeasibleError, Plan, PlanOptions, StagePlan, even_plan, make_plan
from edgespec.planning.profile import ClusterProfile
from edgespec.server.metrics import Metrics
from edgespec.server.settings import ServeSettings
from edgespec.workers.client import RemotePipeline, WorkerRef
from edgespec.workers.cluster import ClusterConfig
from edgespec.workers.host import available_memory_bytes
from edgespec.workers.profiler import Device, ProfileOptions, profile_workers

log = logging.getLogger(__name__)
MISSES_TO_LOSE = 2
RESTARTS = 5


# an async context manager factory run beside the checks (LAN discovery: server/discovery.py's watching)
Watch = Callable[["ClusterManager"], AbstractAsyncContextManager]


@dataclass
class Member:
    name: str
    url: str
    up: bool = True
    misses: int = 0
    instance: str | None = None
    hot: bool = False  # memory above the threshold, already acted on
    restarts: int = 0  # times a local worker's process was started again


def prefill_cuts(settings: ServeSettings, plan: Plan | None):
    """Segment ends for a prefill of n tokens: a fixed segment length if set, else the plan's sequence
    partition when pipelined prefill is on and there are workers; None: one pass."""
    if settings.prefill_segment:
        size = settings.prefill_segment
        return lambda n: [*range(size, n, size), n]
    if plan is not None and settings.pipelined_prefill:
        return plan.sequence_cuts
    return None


class ClusterManager:
    """Membership, profile and placement of a distributed controller."""

    def __init__(self, settings: ServeSettings, config: ClusterConfig, devices: list[Device], profile: ClusterProfile,
                 metrics: Metrics, options: PlanOptions, profile_options: ProfileOptions, executor: Executor,
                 pipeline: RemotePipeline, watch: Watch | None = None):
        """executor: the controller's, routed through `pipeline` (the workers) once a plan is applied (`apply`),
        or through an in-process pipeline of every layer while there are no workers (`serve --discover` found
        none yet); watch: an async context manager factory run beside the checks (LAN discovery)."""
        self.settings, self.config, self.profile, self.metrics = settings, config, profile, metrics
        self.options, self.profile_options = options, profile_options
        # the workers' URLs now (a cached profile may name old ones of the same workers)
        self.members = {d.name: Member(d.name, d.url) for d in devices}
        self.plan: Plan = self.make_plan(profile) if devices else Plan(profile.model.name, [], 0.0, 0.0, 0.0, 0)
        self.executor, self.pipeline, self.watch = executor, pipeline, watch
        # the in-process pipeline of every layer, while no placement over workers fits
        self.here: StagePipeline | None = executor.pipeline if executor.pipeline is not pipeline else None
        self.pending_joins: list[Device] = []
        self.broken = False  # the last placement failed to apply: try again at the next check
        self.lock = asyncio.Lock()
        self.recovering = asyncio.Lock()
        self.wake = asyncio.Event()  # nudge(): check now, not at the next interval

    # planning

    def make_plan(self, profile: ClusterProfile, options: PlanOptions | None = None) -> Plan:
        make = even_plan if self.settings.placement == "even" else make_plan
        return make(profile, options or self.options)

    def refs(self, plan: Plan) -> list[WorkerRef]:
        url = {name: m.url for name, m in self.members.items()}
        return [WorkerRef(url[s.device], s.device, s.first, s.last,
                          {layer: {url[d]: ids for d, ids in where.items()} for layer, where in s.away.items()},
                          s.hosted) for s in plan.stages]

    def apply(self, plan: Plan) -> None:
        """Assign every worker of the plan its layers and route through them (on the model thread)."""
        refs = self.refs(plan)
        if self.here is not None:  # back from serving every layer here
            self.here.close()
            self.here = None
        try:
            for ref in refs:
                self.pipeline.assign(ref)
            self.broken = False
        except BaseException:
            # set only on failure: a check that comes while an assignment is under way must not take it for a
            # failed one (it re-planned again, and every session was prefilled twice)
            self.broken = True
            raise
        finally:
            # Even after a failed assignment the old routing is void (some workers hold new layers): route by
            # the new plan, whose sessions' opens check each worker's layers, until the next check re-plans.
            self.pipeline.replace(refs)
            self.executor.replace(self.pipeline, prefill_cuts(self.settings, plan))
            self.plan = plan
        for s in plan.stages:
            log.info("worker %s (%s) holds layers [%d, %d)", s.device, self.members[s.device].url, s.first, s.last)
            for layer, where in s.away.items():
                log.info("  layer %d's experts %s", layer, "; ".join(f"{ids} on {d}" for d, ids in where.items()))
            self.members[s.device].restarts = 0  # serving again: a later death is not part of a crash loop
        self._gauges()

    def _gauges(self) -> None:
        held = {s.device: s.last - s.first for s in self.plan.stages}
        for name in self.members:
            self.metrics.placement_layers.labels(name).set(held.get(name, 0))
        self.metrics.workers_up.set(sum(m.up for m in self.members.values()))

    async def replan(self, reason: str, options: PlanOptions | None = None, force: bool = False) -> bool:
        """Plan again over the workers that are up; apply the plan if it differs (or if forced)."""
        async with self.lock:
            down = {m.name for m in self.members.values() if not m.up}
            try:
                plan = self.make_plan(self.profile.without(down), options)
            except InfeasibleError as exc:
                if reason in ("worker_lost", "stage_failed") and await self._serve_here(exc):
                    self.metrics.replans.labels(reason, "controller").inc()
                    return True
                log.error("re-plan (%s) found no placement; keeping the current one: %s", reason, exc)
                self.metrics.replans.labels(reason, "infeasible").inc()
                return False
            same = [(s.device, s.first, s.last) for s in plan.stages] == \
                   [(s.device, s.first, s.last) for s in self.plan.stages]
            if same and not force and self.here is None:
                log.info("re-plan (%s) kept the placement", reason)
                self.metrics.replans.labels(reason, "kept").inc()
                return False
            try:
                await self.executor.call(self.apply, plan)
            except Exception as exc:
                log.error("re-plan (%s) could not be applied: %s", reason, exc)
                self.metrics.replans.labels(reason, "failed").inc()
                return False
            if options is not None:
                self.options = options
            layout = ", ".join(f"{s.device} [{s.first}, {s.last})" for s in plan.stages)
            log.warning("re-planned (%s): %s; predicted %.2f ms/token", reason, layout, plan.decode_ms_per_token)
            self.metrics.replans.labels(reason, "applied").inc()
            return True

    async def recover(self, error: Exception, generation: int) -> bool:
        """A forward call failed (`error`) in work begun under placement `generation` (Engine.recover):
        look at every worker now, re-plan without those that do not answer (or, when all answer, assign the
        same placement again, which clears whatever the failure left half done), so that the work runs again on
        the new placement. False when no placement fits the workers left."""
        async with self.recovering:  # one look at a time; the others find the placement changed
            if self.executor.generation != generation:
                return True
            log.warning("a stage failed (%s): checking the workers", error)
            alive = await self.answering(list(self.members), self.probe_s)
            lost = [m.name for m in self.members.values() if m.name not in alive and m.up]
            for m in self.members.values():
                if m.name not in alive:
                    m.up, m.misses = False, max(m.misses, MISSES_TO_LOSE)
            if lost:
                log.warning("lost worker(s) %s mid-generation", ", ".join(lost))
            replanned = await self.replan("worker_lost" if lost else "stage_failed", force=True)
            self._gauges()
            if not replanned and self.executor.generation == generation and self._restarting(lost):
                replanned = await self._await_restart(lost, generation)
            return replanned or self.executor.generation != generation

    def _restarting(self, names: list[str]) -> bool:
        """Whether some of these lost workers are local ones this controller starts again (not in a crash loop)."""
        config = self.config
        local = {w.name for w, proc in zip(config.workers, config.processes, strict=False) if proc is not None}
        return config.respawn is not None and any(n in local and self.members[n].restarts < RESTARTS for n in names)

    async def _await_restart(self, names: list[str], generation: int) -> bool:
        """No placement fits without the lost local workers `names` (no other has room for what they held): wait,
        up to restart_wait_s, for the monitor's checks to start them again and plan them back in (a new placement
        generation), so that the work runs again rather than fails: a scale model whose every worker holds a
        share no other has room for loses the restart's time, not the stream (bench/scale.py's killed_worker)."""
        log.warning("no placement fits without %s: waiting up to %.0f s for it to be started again",
                    ", ".join(names), self.settings.restart_wait_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.restart_wait_s
        while self.executor.generation == generation and loop.time() < deadline:
            self.nudge()
            await asyncio.sleep(min(0.5, self.settings.monitor_interval_s))
        return self.executor.generation != generation

    @property
    def probe_s(self) -> float:
        """How long a worker has to answer after a failed call before it counts as lost."""
        return min(self.settings.stage_timeout_s, self.settings.recover_probe_s)

    async def _serve_here(self, why: InfeasibleError) -> bool:
        """No placement over the workers left fits: the controller takes every layer itself, when its free
        memory holds their weights and the KV the placement was planned for. Workers that answer again are
        planned back in (apply)."""
        if self.here is not None:
            return True
        card, options = self.profile.model, self.options
        need = card.n_layers * (card.layer_weight_bytes() + options.context * options.concurrency *
                                card.kv_bytes_per_token())
        free = available_memory_bytes()
        if self.settings.worker_memory_budget_gib is not None:  # a device as small as the workers (a scale model)
            free = min(free, int(self.settings.worker_memory_budget_gib * 2**30))
        if need > free:
            log.error("no placement over the workers left (%s), and this controller's free memory (%.2f GiB) "
                      "cannot hold every layer (%.2f GiB)", why, free / 2**30, need / 2**30)
            return False
        log.warning("no placement over the workers left (%s): the controller serves every layer itself", why)

        def take_over() -> None:  # on the model thread, between steps
            files = resolve_model(self.settings.model)
            self.here = local_pipeline(files, self.settings.dtype, self.settings.kv_cache_gib,
                                       prefault=self.settings.kv_prefault, kv=self.settings.kv_format)
            self.pipeline.replace([])
            self.executor.replace(self.here, None)

        await self.executor.call(take_over)
        self.plan = replace(self.plan, stages=[])
        return True

    # watching

    def request_join(self, url: str, name: str) -> None:
        """A worker announced itself; it is profiled and planned in at the next check."""
        self.pending_joins.append(Device(name, url.rstrip("/")))

    def nudge(self) -> None:
        """Check the workers now rather than at the next interval."""
        self.wake.set()

    def depart(self, name: str) -> None:
        """A worker said it is leaving (its DNS-SD service went away): the check comes now, and one more miss
        makes it lost (planned out); a worker that still answers stays."""
        m = self.members.get(name)
        if m is not None and m.up:
            m.misses = max(m.misses, MISSES_TO_LOSE - 1)
        self.nudge()

    async def monitor(self) -> None:
        """Check the workers every monitor_interval_s, or at once when nudged; `watch` runs meanwhile."""
        async with self.watch(self) if self.watch is not None else contextlib.nullcontext():
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.settings.monitor_interval_s)
                self.wake.clear()
                try:
                    await self.check()
                except Exception:  # the watch must go on whatever one check met
                    log.exception("cluster check failed")

    async def _info(self, client: httpx.AsyncClient, m: Member) -> dict | None:
        try:
            r = await client.get(m.url + "/info")
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def answering(self, names: list[str], timeout_s: float) -> set[str]:
        """Which of these workers answer /info within timeout_s now."""
        members = [self.members[n] for n in names if n in self.members]
        async with httpx.AsyncClient(headers=self._auth(), timeout=timeout_s) as client:
            infos = await asyncio.gather(*(self._info(client, m) for m in members))
        return {m.name for m, info in zip(members, infos, strict=True) if info is not None}

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.config.token}"}

    async def check(self) -> None:
        """One look at every worker; re-plan for whatever changed."""
        members = list(self.members.values())
        # A worker computing a long prefill segment answers late (its tensor work runs on its event loop): only
        # a refused connection or a call as slow as a stage timeout counts as a miss.
        async with httpx.AsyncClient(headers=self._auth(), timeout=self.settings.stage_timeout_s) as client:
            infos = await asyncio.gather(*(self._info(client, m) for m in members))
        placed = {s.device: s for s in self.plan.stages}
        lost: list[str] = []
        back: list[str] = []
        hot: list[tuple[str, int, StagePlan]] = []  # (worker, its KV bytes, its stage)
        for m, info in zip(members, infos, strict=True):
            if info is None:
                m.misses += 1
                if m.up and m.misses >= MISSES_TO_LOSE:
                    m.up = False
                    lost.append(m.name)
                continue
            m.misses = 0
            restarted = m.instance is not None and info["instance"] != m.instance
            m.instance = info["instance"]
            if not m.up or (m.name in placed and (restarted or info["holds"] is None)):
                m.up = True
                back.append(m.name)
            mem = info["memory"]
            use = (mem["weight_bytes"] + mem["kv_bytes"]) / mem["budget_bytes"]
            self.metrics.worker_memory_use.labels(m.name).set(use)
            if use >= self.settings.memory_threshold and not m.hot and m.name in placed:
                m.hot = True
                hot.append((m.name, mem["kv_bytes"], placed[m.name]))
            elif use < self.settings.memory_threshold:
                m.hot = False
        self._restart_local()
        joined = await self._take_joins()
        if lost:
            log.warning("lost worker(s) %s", ", ".join(lost))
            await self.replan("worker_lost")
        elif back or joined:
            await self.replan("worker_joined", force=bool(back))
        elif hot:
            await self.replan("memory", self._options_for(hot))
        elif self.broken:
            await self.replan("retry", force=True)
        self._gauges()

    def _restart_local(self) -> None:
        # A local worker whose process died is started again, on a new port: once it answers it is back, and
        # planned in. One that dies RESTARTS times before it serves again (a crash loop) is left down.
        respawn = self.config.respawn
        if respawn is None:  # workers this controller did not start (it has no processes of theirs)
            return
        for i, proc in enumerate(self.config.processes):
            name = self.config.workers[i].name
            m = self.members.get(name) if name is not None else None
            if m is None or m.up or proc is None or proc.poll() is None or m.restarts > RESTARTS:
                continue
            m.restarts += 1
            if m.restarts > RESTARTS:
                log.error("local worker %s died %d times before it served again: not started again", m.name,
                          RESTARTS)
                continue
            respawn(i)
            m.url = self.config.workers[i].url
            log.warning("local worker %s exited (%s); started again at %s", m.name, proc.returncode, m.url)

    def _options_for(self, hot: list[tuple[str, int, StagePlan]]) -> PlanOptions:
        # Hold the KV the busiest worker has now with room to grow (caches double as they fill), and keep
        # every device under the threshold.
        card = self.profile.model
        held = max(kv / ((stage.last - stage.first) * card.kv_bytes_per_token()) for _, kv, stage in hot)
        context = max(self.options.context, math.ceil(1.5 * held / self.options.concurrency))
        log.warning("memory use of %s passed %.0f%%: planning for %d tokens x %d sessions",
                    ", ".join(n for n, _, _ in hot), 100 * self.settings.memory_threshold, context,
                    self.options.concurrency)
        return replace(self.options, context=context, memory_fraction=self.settings.memory_threshold)

    async def _take_joins(self) -> list[str]:
        joined = []
        while self.pending_joins:
            d = self.pending_joins.pop(0)
            peers = [Device(m.name, m.url) for m in self.members.values() if m.up and m.name != d.name]
            try:
                devices, links = await profile_workers([d], self.config.token, self.settings.model,
                                                       self.settings.dtype, self.profile_options, peers=peers)
            except Exception as exc:
                log.error("worker %s (%s) could not join: %s", d.name, d.url, exc)
                continue
            kept = [w for w in self.profile.workers if w.name != d.name]
            links = [lk for lk in self.profile.links if d.name not in (lk.src, lk.dst)] + links
            self.profile = replace(self.profile, workers=[*kept, *devices], links=links)
            self.members[d.name] = Member(d.name, d.url)
            log.warning("worker %s (%s) joined", d.name, d.url)
            joined.append(d.name)
        return joined
