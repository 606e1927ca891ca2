"""`edgespec profile`: measure the controller (this process), the workers and the links, with a progress bar."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.source import resolve_model
from edgespec.planning.profile import ClusterProfile
from edgespec.workers.cluster import ClusterConfig, launch_local_workers, wait_healthy
from edgespec.workers.profiler import Device, ProfileOptions, profile_cluster, steps


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if not text else tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


def summary(profile: ClusterProfile) -> Table:
    """Per device: ms per layer for 1 and 128 tokens, memory; per link: RTT and bandwidth."""
    t = Table(title=f"profile of {profile.model.name} ({profile.dtype})")
    for col in ("device", "ms/layer, 1 token", "ms/layer, 128 tokens", "memory budget GiB", "in use GiB"):
        t.add_column(col, justify="right" if col != "device" else "left")
    for d in [profile.controller, *profile.workers]:
        t.add_row(d.name, f"{d.layer_ms(1):.3f}", f"{d.layer_ms(128):.3f}", f"{d.memory_capacity_bytes / 2**30:.2f}",
                  f"{d.memory_used_bytes / 2**30:.2f}")
    links = Table(title="links")
    for col in ("link", "RTT ms", "MB/s"):
        links.add_column(col)
    for lk in profile.links:
        links.add_row(f"{lk.src} -> {lk.dst}", f"{lk.rtt_ms:.3f}", f"{lk.bandwidth_bytes_per_s / 1e6:.0f}")
    grid = Table.grid()
    grid.add_row(t)
    grid.add_row(links)
    return grid


def run_profile(args: argparse.Namespace) -> None:
    console = Console(stderr=True)
    files = resolve_model(args.model)
    kv_bytes = kv_format(args.kv_format).bytes_per_value()  # a bad name refused before any worker starts
    options = ProfileOptions(tokens=_ints(args.tokens, ProfileOptions.tokens),
                             contexts=_ints(args.contexts, ProfileOptions.contexts), reps=args.reps,
                             margin=args.margin)
    if args.local_workers:
        config = launch_local_workers(args.local_workers, args.model, args.worker_threads, args.worker_cpus,
                                      budget_gib=args.worker_memory_budget_gib)
    else:
        config = ClusterConfig.from_file(Path(args.cluster))
    try:
        asyncio.run(wait_healthy(config, timeout_s=120))
        devices = [Device(spec.name or f"worker{i}", spec.url) for i, spec in enumerate(config.workers)]
        cfg = ModelConfig.from_folder(files.folder)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("profiling", total=steps(cfg, len(devices), options))
            profile = profile_cluster(files, args.model, args.dtype, devices, config.token, options,
                                      step=lambda what: progress.update(task, advance=1, description=what))
    finally:
        config.stop()
    profile = profile.with_kv_bytes(kv_bytes)  # the card counts the cache in that format
    profile.save(Path(args.out))
    console.print(summary(profile))
    console.print(f"wrote {args.out}")
