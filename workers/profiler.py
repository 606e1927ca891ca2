"""The profiler: measures the controller and every worker, and the links between them, into a ClusterProfile.

Workers time their own layers (POST /profile) and probe their links to each other (POST /probe/link);
the controller times its own layers, embedding and head, and probes its link to each worker. Profiles
are cached on disk by what they depend on and reused.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from edgespec.model.config import ModelConfig
from edgespec.model.linear import weight_format
from edgespec.model.routing import expert_use
from edgespec.model.source import ModelFiles
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.timing import CONTEXTS, PROFILE_LAYERS, TOKENS, model_card, profile_points, time_ends, time_layers
from edgespec.model.weights import open_source
from edgespec.planning.profile import ClusterProfile, Curve, DeviceProfile, LinkProfile
from edgespec.workers.host import resident_bytes, total_memory_bytes
from edgespec.workers.probe import measure_link
from edgespec.workers.relay import ws_url

CONTROLLER = "controller"


@dataclass(frozen=True)
class ProfileOptions:
    tokens: tuple[int, ...] = TOKENS
    contexts: tuple[int, ...] = CONTEXTS
    reps: int = 3
    margin: float = 0.15  # safety margin on link times, applied by the planner
    link_reps: int = 5


@dataclass(frozen=True)
class Device:
    """A worker to profile."""

    name: str
    url: str


def steps(cfg: ModelConfig, n_workers: int, options: ProfileOptions) -> int:
    """Progress steps of a whole profile: the controller's timed points and its ends, each worker, each link."""
    points = profile_points(cfg, options.tokens, options.contexts)
    return points + 1 + n_workers + n_workers * n_workers


def profile_controller(files: ModelFiles, dtype: str, options: ProfileOptions,
                       step: Callable[[], None] | None = None) -> DeviceProfile:
    """This process's layer, embedding and head times (tensor work: call it on the model thread)."""
    cfg = ModelConfig.from_folder(files.folder)
    src, torch_dtype = open_source(files), weight_format(dtype)
    stack = LayerStack.load(src, cfg, 0, min(PROFILE_LAYERS, cfg.n_layers), torch_dtype)
    layer_ms = time_layers(stack, options.tokens, options.contexts, options.reps, step)
    del stack
    embed_ms, head_ms = time_ends(TokenEnds.load(src, cfg, torch_dtype), options.tokens, options.reps)
    if step:
        step()
    return DeviceProfile(CONTROLLER, layer_ms, total_memory_bytes(), resident_bytes(), None, embed_ms, head_ms)


def _curve(d: dict) -> Curve:
    return Curve(tuple(d["tokens"]), tuple(d["contexts"]), tuple(tuple(r) for r in d["ms"]))


async def profile_workers(devices: list[Device], token: str, model: str | None, dtype: str, options: ProfileOptions,
                          step: Callable[[str], None] | None = None, peers: Sequence[Device] = ()
                          ) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """Each device's layer times and memory, the controller's links to them, and their links to each other and
    to already-profiled peers (both ways)."""
    headers = {"authorization": f"Bearer {token}"}
    body = {"model": model, "dtype": dtype, "tokens": list(options.tokens), "contexts": list(options.contexts),
            "reps": options.reps}
    profiles, links = [], []

    def done(what: str) -> None:
        if step:
            step(what)

    async with httpx.AsyncClient(headers=headers, timeout=600) as client:
        for d in devices:
            ans = await _layers(client, d, body)
            mem = ans["memory"]
            profiles.append(DeviceProfile(d.name, _curve(ans["layer_ms"]), mem["budget_bytes"], mem["resident_bytes"],
                                          d.url, hardware=ans.get("hardware"), split_ms=ans.get("split_ms", 0.0)))
            done(f"layers on {d.name}")
        for d in devices:
            links.append(LinkProfile(CONTROLLER, d.name, **await measure_link(ws_url(d.url), token, options.link_reps)))
            done(f"link {CONTROLLER}->{d.name}")
            others = [o for o in [*devices, *peers] if o is not d]
            pairs = [(d, o) for o in others] + [(o, d) for o in peers]
            for src, dst in pairs:
                r = await client.post(src.url + "/probe/link", json={"target": dst.url, "reps": options.link_reps})
                _check(r, src)
                links.append(LinkProfile(src.name, dst.name, **r.json()))
                done(f"link {src.name}->{dst.name}")
    return profiles, links


async def _layers(client: httpx.AsyncClient, d: Device, body: dict) -> dict:
    r = await client.post(d.url + "/profile", json=body)
    _check(r, d)
    return r.json()


def _check(r: httpx.Response, d: Device) -> None:
    if r.status_code != 200:
        raise RuntimeError(f"worker {d.name} ({d.url}) answered {r.status_code}: {r.text[:300]}")


def assemble(files: ModelFiles, dtype: str, controller: DeviceProfile, workers: list[DeviceProfile],
             links: list[LinkProfile], options: ProfileOptions,
             expert_use: tuple[tuple[float, ...], ...] = ()) -> ClusterProfile:
    """expert_use: a mixture's routing frequencies (model/routing.py), for its card."""
    cfg = ModelConfig.from_folder(files.folder)
    card = replace(model_card(cfg, Path(files.folder).name, dtype, files.gguf is not None), expert_use=expert_use)
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return ClusterProfile(card, dtype, controller, workers, links, options.margin, created,
                          f"measured on {platform.node()} ({platform.machine()})")


def profile_cluster(files: ModelFiles, model: str | None, dtype: str, devices: list[Device], token: str,
                    options: ProfileOptions, run_tensor=None, step: Callable[[str], None] | None = None
                    ) -> ClusterProfile:
    """Profile the controller (through run_tensor, e.g. the model thread's run_sync) and every worker."""
    run_tensor = run_tensor or (lambda fn, *a: fn(*a))
    controller = run_tensor(profile_controller, files, dtype, options, (lambda: step("controller")) if step else None)
    # a mixture's routing frequencies, for placing its experts (a layer at a time: the controller need not hold it)
    use = run_tensor(expert_use, files, dtype) if ModelConfig.from_folder(files.folder).n_experts else ()
    workers, links = asyncio.run(profile_workers(devices, token, model, dtype, options, step))
    return assemble(files, dtype, controller, workers, links, options, use)


# how stages talk and what a profile holds: a profile of the HTTP calls before it measured another link cost, and
# one without the idle round trip and the devices' hardware predicts no wake-ups and overlaps shared cores
LINKS = "websocket-idle"


def cache_path(files: ModelFiles, dtype: str, devices: list[Device], extra: dict) -> Path:
    """Where a profile of this model, dtype and device set (plus anything else it depends on) is cached."""
    key = json.dumps({"model": str(files.folder), "dtype": dtype, "devices": [d.name for d in devices],
                      "host": platform.node(), "links": LINKS, **extra}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "edgespec" / "profiles" / f"{Path(files.folder).name}-{dtype}-{digest}.json"
