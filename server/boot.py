"""Start-up of `edgespec serve`: the model in-process, or over local or listed workers placed by the planner."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from edgespec.decoding.draft_model import DraftModel
from edgespec.decoding.eagle import FeatureDraftModel
from edgespec.decoding.headsplit import HEADSPLIT
from edgespec.decoding.headsplit_profile import load_profile
from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.target_fit import SHIPPED
from edgespec.engine.admission import Admission
from edgespec.engine.engine import LAYERS, Engine
from edgespec.engine.executor import Executor
from edgespec.engine.prefix import PrefixCache
from edgespec.engine.sessions import Sessions
from edgespec.model.config import ModelConfig
from edgespec.model.headsplit import HeadSplitPipeline
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.load import LoadedModel, load_local, load_with_pipeline
from edgespec.model.source import ModelFiles, resolve_model
from edgespec.model.thread import ModelThread
from edgespec.model.timing import model_card
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import head_card, place, profiled_alphas, profiled_devices
from edgespec.planning.plan import PlanOptions
from edgespec.planning.profile import ClusterProfile
from edgespec.server.discovery import find_workers, watching
from edgespec.server.headsplit_cluster import HeadSplitCluster
from edgespec.server.metrics import Metrics
from edgespec.server.replanner import ClusterManager, prefill_cuts
from edgespec.server.settings import ServeSettings
from edgespec.workers.client import RemotePipeline
from edgespec.workers.cluster import ClusterConfig, WorkerSpec, launch_local_workers, parse_ranges, wait_healthy
from edgespec.workers.profiler import Device, ProfileOptions, cache_path, profile_cluster

log = logging.getLogger(__name__)


def obtain_profile(settings: ServeSettings, files: ModelFiles, devices: list[Device], token: str,
                   thread: ModelThread, options: ProfileOptions) -> ClusterProfile:
    """The profile named in the settings, else a cached one for these devices, else a new measurement; its
    model card's KV bytes are those of the served KV format (arithmetic, so any profile's hold)."""
    return _profile(settings, files, devices, token, thread, options).with_kv_bytes(
        kv_format(settings.kv_format).bytes_per_value())


def _profile(settings: ServeSettings, files: ModelFiles, devices: list[Device], token: str, thread: ModelThread,
             options: ProfileOptions) -> ClusterProfile:
    if settings.profile:
        profile = ClusterProfile.load(Path(settings.profile))
        n_layers = ModelConfig.from_folder(files.folder).n_layers
        if profile.model.n_layers != n_layers:
            raise ValueError(f"{settings.profile} profiles {profile.model.name} ({profile.model.n_layers} layers), "
                             f"not the served model ({n_layers} layers)")
        missing = {d.name for d in devices} - {w.name for w in profile.workers}
        if missing:
            raise ValueError(f"{settings.profile} has no profile of worker(s) {', '.join(sorted(missing))}")
        return profile.without({w.name for w in profile.workers} - {d.name for d in devices})
    local = bool(settings.local_workers)
    extra = {"local": local, "cpus": settings.worker_cpus, "threads": settings.worker_threads,
             "budget": settings.worker_memory_budget_gib,
             "urls": [] if local else [d.url for d in devices], "tag": settings.profile_tag}
    path = cache_path(files, settings.dtype, devices, extra)
    if path.exists() and not settings.reprofile:
        log.info("using the cached profile %s", path)
        return ClusterProfile.load(path)
    log.info("profiling the controller and %d worker(s) (cached afterwards in %s)", len(devices), path)
    profile = profile_cluster(files, settings.model, settings.dtype, devices, token, options, thread.run_sync,
                              lambda what: log.debug("profiled %s", what))
    profile.save(path)
    return profile


def prefix_cache(settings: ServeSettings) -> PrefixCache | None:
    """A lane's prefix cache from the settings (None: prefix reuse off)."""
    return PrefixCache(int(settings.prefix_cache_mib * 2**20), settings.prefix_min_tokens) \
        if settings.prefix_cache_mib > 0 else None


def build_engine(settings: ServeSettings, loaded: LoadedModel, cluster: ClusterManager | None) -> Engine:
    """The engine over the loaded model's executor: prefix reuse and admission from the settings; over
    workers, recovery by re-placement; with HeadSplit, its lane (built at its first request)."""
    admission = Admission(settings.max_waiting, settings.queue_timeout_s)
    lanes: dict[str, Callable[[], Sessions]] = \
        {HEADSPLIT: partial(headsplit_lane, settings, loaded, cluster)} if settings.headsplit else {}
    return Engine(loaded.executor, prefix_cache(settings), admission, cluster.recover if cluster is not None else None,
                  lanes)


def observe_engine(engine: Engine, metrics: Metrics) -> None:
    """The engine's counters in /metrics, read when it is scraped."""
    prefix, executor = engine.prefix, engine.executor
    if prefix is not None:
        metrics.prefix_hits.set_function(lambda: prefix.hits)
        metrics.prefix_tokens.set_function(lambda: prefix.reused_tokens)
        metrics.prefix_bytes.set_function(lambda: prefix.nbytes)
    metrics.sessions_rebuilt.set_function(lambda: executor.rebuilt)
    metrics.sequences_running.set_function(lambda: engine.running())
    metrics.shared_passes.set_function(lambda: engine.shared_steps)
    metrics.shared_pass_calls.set_function(lambda: engine.shared_calls)
    metrics.steps.set_function(lambda: executor.steps)
    metrics.step_rows.set_function(lambda: executor.step_rows)
    metrics.program_seconds.set_function(lambda: engine.program_seconds)
    metrics.kv_blocks.labels("used").set_function(lambda: executor.pool_blocks()[0])
    metrics.kv_blocks.labels("free").set_function(lambda: executor.pool_blocks()[1])
    for name in (LAYERS, HEADSPLIT):
        if engine.has_lane(name):
            metrics.observe_lane(name, partial(lane_executor, engine, name))
    metrics.observe_admission(engine.admission)


def lane_executor(engine: Engine, name: str) -> Executor | None:
    """Lane `name`'s executor once the lane is built, else None."""
    lane = engine.built(name)
    return lane.executor if lane is not None else None


async def discover_workers(settings: ServeSettings) -> list[WorkerSpec]:
    """`serve --discover` at start: the workers on the LAN that prove the token, within the settings' bounds."""
    log.info("looking for %d worker(s) on the LAN for up to %.0f s", settings.discover_workers,
             settings.discover_wait_s)
    assert settings.cluster_token is not None, "the settings refuse --discover without a token"
    found = await find_workers(settings.cluster_token, settings.discover_workers, settings.discover_wait_s)
    if not found:
        log.warning("no worker found on the LAN within %.0f s: serving every layer here until workers are found",
                    settings.discover_wait_s)
    elif len(found) < settings.discover_workers:
        log.warning("found %d of %d worker(s) within %.0f s: starting with them; more join when found", len(found),
                    settings.discover_workers, settings.discover_wait_s)
    return found


def load_served_model(settings: ServeSettings, metrics: Metrics
                      ) -> tuple[LoadedModel, Engine, ClusterManager | None]:
    """The served model, the engine that runs requests on it and, over workers, the cluster manager."""
    thread = ModelThread(settings.threads or os.cpu_count() or 1)
    files = resolve_model(settings.model)  # converts a GGUF once, before any worker needs the cache
    if not settings.local_workers and not settings.cluster and not settings.discover:
        loaded = load_local(files, settings.dtype, settings.kv_cache_gib, thread, prefill_cuts(settings, None),
                            settings.kv_prefault, settings.kv_format)
        engine = build_engine(settings, loaded, None)
        observe_engine(engine, metrics)
        return loaded, engine, None
    if settings.local_workers:
        config = launch_local_workers(settings.local_workers, settings.model, settings.worker_threads,
                                      settings.worker_cpus, avoid=settings.port, prefault=settings.kv_prefault,
                                      budget_gib=settings.worker_memory_budget_gib)
    elif settings.discover:  # proven by their /health just now
        assert settings.cluster_token is not None, "the settings refuse --discover without a token"
        config = ClusterConfig(settings.cluster_token, asyncio.run(discover_workers(settings)))
    else:
        assert settings.cluster is not None, "without workers of any kind it returned above"
        config = ClusterConfig.from_file(Path(settings.cluster))
    try:
        if not settings.discover:
            asyncio.run(wait_healthy(config, timeout_s=120))
        devices = [Device(spec.name or f"worker{i}", spec.url) for i, spec in enumerate(config.workers)]
        profile_options = ProfileOptions()
        profile = obtain_profile(settings, files, devices, config.token, thread, profile_options)
        context = min(settings.plan_context, ModelConfig.from_folder(files.folder).max_position_embeddings)
        options = PlanOptions(context=context, concurrency=settings.plan_concurrency)
        remote = RemotePipeline([], config.token, settings.model, settings.dtype, settings.stage_timeout_s,
                                metrics.observe_hop, settings.kv_format)
        if devices:  # routed through the workers once the plan is applied below
            loaded = load_with_pipeline(files, settings.dtype, remote, thread, kv=settings.kv_format)
        else:  # --discover found none: every layer here, as after losing every worker, until one joins
            loaded = load_local(files, settings.dtype, settings.kv_cache_gib, thread, prefill_cuts(settings, None),
                                settings.kv_prefault, settings.kv_format)
        watch = partial(watching, token=config.token) if settings.discover else None
        manager = ClusterManager(settings, config, devices, profile, metrics, options, profile_options,
                                 loaded.executor, remote, watch)
        if devices:
            log.info("placement (%s): %s", settings.placement,
                     ", ".join(f"{s.device} [{s.first}, {s.last})" for s in manager.plan.stages))
            thread.run_sync(manager.apply, manager.plan)
        engine = build_engine(settings, loaded, manager)
        observe_engine(engine, metrics)
    except BaseException:
        config.stop()
        raise
    return loaded, engine, manager


def headsplit_lane(settings: ServeSettings, loaded: LoadedModel, cluster: ClusterManager | None) -> Sessions:
    """The engine's HeadSplit lane, built (blocking) at the first `headsplit` request: the planner's placement
    (from the shipped HeadSplit profile's acceptance at the configured epsilon and block times, and the cluster
    profile's memory and round trips plus its margin) over the workers, or over one in-process device."""
    cfg, dtype = loaded.cfg, weight_format(settings.dtype)
    record = load_profile(loaded.files.name, Path(settings.headsplit_profile) if settings.headsplit_profile else None)
    card = head_card(model_card(cfg, loaded.files.name, dtype, loaded.files.gguf is not None,
                                kv_format(settings.kv_format)))
    context = min(settings.plan_context, cfg.max_position_embeddings)
    alphas = profiled_alphas(record, cfg.n_layers, settings.headsplit_epsilon)
    admission = Admission(settings.max_waiting, settings.queue_timeout_s)
    ends, thread = loaded.executor.ends, loaded.executor.thread
    if cluster is None:
        layers = place(profiled_devices(record, {"local": 2**62}, context), card, alphas, lambda a, b: 0.0, context)
        pipe = HeadSplitPipeline.local(open_source(loaded.files), cfg, dtype, layers, settings.headsplit_epsilon,
                                       int(settings.kv_cache_gib * 2**30), kv_format(settings.kv_format))
        return Sessions(Executor(cfg, ends, pipe, thread), prefix_cache(settings), admission)
    devices = HeadSplitCluster(settings, cluster, record, card, alphas, cfg, context)
    executor = Executor(cfg, ends, devices.pipeline(), thread)
    return Sessions(executor, prefix_cache(settings), admission, partial(devices.recover, executor))


def load_draft_models(settings: ServeSettings, loaded: LoadedModel) -> dict[str, DraftModel | FeatureDraftModel]:
    """The configured drafters' weights, loaded on the model thread; a tokenizer mismatch is an error.
    The trained feature drafter comes first: the plain `speculative` policy's default builds on the first."""
    models: dict[str, DraftModel | FeatureDraftModel] = {}
    run = loaded.executor.thread.run_sync
    ends = loaded.executor.ends
    if settings.eagle == "auto":
        for path in sorted(SHIPPED.glob("*-eagle.safetensors")):  # the first one trained for the served model
            try:
                models["eagle"] = run(FeatureDraftModel.load, "eagle", path, ends)
                log.info("drafter eagle: %s", path.name)
                break
            except ValueError:
                continue
    elif settings.eagle != "off":
        models["eagle"] = run(FeatureDraftModel.load, "eagle", Path(settings.eagle), ends)
    for entry in settings.draft_models:
        name, _, where = entry.rpartition("=")
        name = name or Path(where).stem
        models[name] = run(DraftModel.load, name, where, settings.dtype, loaded.tokenizer)
    if settings.layerskip:
        models["layerskip"] = run(DraftModel.load, "layerskip", settings.model, settings.dtype, None,
                                  sorted(parse_ranges(settings.layerskip)))
    return models


def load_medusa(settings: ServeSettings, loaded: LoadedModel) -> MedusaModel | None:
    """The Medusa heads: --medusa FILE, or with 'auto' the shipped heads trained for the served model, if any."""
    run = loaded.executor.thread.run_sync
    if settings.medusa == "off":
        return None
    if settings.medusa != "auto":
        return run(MedusaModel.load, Path(settings.medusa), loaded.executor.ends)
    for path in sorted(SHIPPED.glob("*-medusa.safetensors")):
        try:
            heads = run(MedusaModel.load, path, loaded.executor.ends)
        except ValueError:
            continue
        log.info("medusa heads: %s (tree of %d nodes)", path.name, len(heads.tree))
        return heads
    return None
