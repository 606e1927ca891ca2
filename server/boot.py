"""Start-up of `edgespec serve`: the model in-process, or over local or listed workers."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from model.config import ModelConfig
from model.load import LoadedModel, load_local, load_with_pipeline
from model.source import resolve_model
from model.thread import ModelThread
from planning.split import even_split
from server.metrics import Metrics
from server.settings import ServeSettings
from workers.client import RemotePipeline, ResultMailbox, WorkerRef
from workers.cluster import ClusterConfig, launch_local_workers, wait_healthy

log = logging.getLogger(__name__)


@dataclass
class ClusterHandle:
    """The workers behind a distributed controller."""

    config: ClusterConfig
    mailbox: ResultMailbox
    pipeline: RemotePipeline


def load_served_model(settings: ServeSettings, metrics: Metrics) -> tuple[LoadedModel, ClusterHandle | None]:
    thread = ModelThread(settings.threads or os.cpu_count() or 1)
    files = resolve_model(settings.model)  # converts a GGUF once, before any worker needs the cache
    if not settings.local_workers and not settings.cluster:
        return load_local(files, settings.dtype, settings.kv_cache_gib, thread), None
    if settings.local_workers:
        config = launch_local_workers(settings.local_workers, settings.model, settings.worker_threads)
    else:
        config = ClusterConfig.from_file(Path(settings.cluster))
    try:
        asyncio.run(wait_healthy(config, timeout_s=120))
        n_layers = ModelConfig.from_folder(files.folder).n_layers
        refs = [WorkerRef(spec.url, spec.name or f"worker{i}", first, last)
                for i, (spec, (first, last)) in enumerate(zip(config.workers, even_split(n_layers, len(config.workers)),
                                                            strict=True))]
        host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
        base = settings.advertise_url or config.controller_url or f"http://{host}:{settings.port}"
        mailbox = ResultMailbox()
        pipeline = RemotePipeline(refs, config.token, base.rstrip("/") + "/internal/stage-result", mailbox,
                                  settings.model, settings.dtype, settings.stage_timeout_s, metrics.observe_hop)
        for ref in refs:
            pipeline.assign(ref)
            log.info("worker %s (%s) holds layers [%d, %d)", ref.name, ref.url, ref.first, ref.last)
        loaded = load_with_pipeline(files, settings.dtype, pipeline, thread)
    except BaseException:
        config.stop()
        raise
    return loaded, ClusterHandle(config, mailbox, pipeline)
