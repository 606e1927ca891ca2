"""HeadSplit blocks on a worker: KV groups and FFN blocks of any layers, loaded alone (model/headsplit.py's
HeadBlocks), and the schedule itself where this worker gathers (HeadHost); and the HTTP routes that control
them. The per-step calls (attend, ffn, run) and session open/release travel on links (workers/head_relay.py).

    POST   /heads/assign    {"groups": {"LAYER": [GROUP, ...]}, "ffns": [LAYER], "dtype", "model",
                             "name", "placement": [LayerPlace...], "peers": {NAME: URL}}
    GET    /heads/memory                   -> {"used_bytes"}: blocks and caches
    POST   /heads/export    {"groups": {"LAYER": [GROUP]}} -> safetensors SESSION/LAYER/GROUP/k|v of every session
    POST   /heads/reshape   header X-Blocks {"groups", "ffns"}, safetensors of the arriving groups' caches
    POST   /heads/placement [LayerPlace...]: the placement this worker's schedule follows from now on
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from fastapi import FastAPI, Request, Response
from pydantic import ValidationError

from edgespec.model.config import ModelConfig
from edgespec.model.head_blocks import HeadBlocks, StepRows, attn_out_norms
from edgespec.model.head_schedule import Part, Schedule, SpeculationStats
from edgespec.model.headsplit import blocks_of, check_placement, devices_named
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stage import SessionError
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace
from edgespec.workers.bodies import HeadAssignBody, HeadBlocksBody, HeadGroupsBody, PlaceBody
from edgespec.workers.head_client import LinkHeads
from edgespec.workers.host import NotAssignedError
from edgespec.workers.kv_report import KVReport
from edgespec.workers.relay import ws_url
from edgespec.workers.wire import decode_group_kv, encode_group_kv


class HeadHost:
    """The worker's HeadSplit blocks, and the schedule over them and its peers where it gathers. A peer's blocks
    are reached through `peer(name, url)`, a device proxy over this worker's link to it
    (workers/head_relay.py)."""

    def __init__(self, default_model: str | None, peer: Callable[[str, str], LinkHeads],
                 memory_budget_bytes: int | None = None):
        """memory_budget_bytes: the worker's bound of weights plus caches (its --memory-budget-gib)."""
        self.default_model = default_model
        self.peer = peer
        self.memory_budget_bytes = memory_budget_bytes
        self.blocks: HeadBlocks | None = None
        self.schedule: Schedule | None = None  # where this worker gathers: the placement's devices, peers by link
        self.peers: dict[str, LinkHeads] = {}
        self.name: str | None = None

    def assign(self, model: str | None, groups: dict[int, list[int]], ffns: list[int], dtype: str,
               name: str | None = None, placement: list[dict] | None = None, peers: dict[str, str] | None = None,
               kv: str = "float32") -> dict:
        fmt = weight_format(dtype)
        files = resolve_model(model if model is not None else self.default_model)
        cfg = ModelConfig.from_folder(files.folder)
        self.check_blocks(cfg, groups, ffns)
        layers = [LayerPlace(**lp) for lp in placement] if placement is not None else None
        if layers is not None:
            if name is None:
                raise ValueError("a placement needs this worker's name in it")
            if blocks_of(layers, name) != ({k: sorted(v) for k, v in groups.items() if v}, sorted(ffns)):
                raise ValueError(f"the groups and FFNs assigned are not {name}'s blocks in the placement")
            missing = devices_named(layers) - {name, *(peers or {})}
            if missing:
                raise ValueError(f"the placement names devices with no URL: {sorted(missing)}")
            for url in (peers or {}).values():
                ws_url(url)  # a ValueError now rather than at the first step
        self.close()  # free the old blocks first
        src = open_source(files)
        self.blocks = HeadBlocks(src, cfg, fmt, groups, ffns, kv_format(kv))
        if self.memory_budget_bytes is not None:  # the caches get what the blocks' weights leave
            self.blocks.limit_kv(self.memory_budget_bytes - self.blocks.memory_bytes())
        if layers is not None and name is not None:  # the peer links are the worker's own, kept across assignments
            self.peers = {peer: self.peer(peer, url) for peer, url in (peers or {}).items() if peer != name}
            self.schedule = Schedule({**self.peers, name: self.blocks}, layers, cfg, attn_out_norms(src, cfg, fmt))
        self.name = name
        return {"groups": {str(k): v for k, v in groups.items()}, "ffns": ffns}

    @staticmethod
    def check_blocks(cfg: ModelConfig, groups: dict[int, list[int]], ffns: list[int]) -> None:
        for layer, gs in groups.items():
            if not 0 <= layer < cfg.n_layers or not set(gs) <= set(range(cfg.n_kv_heads)) or len(set(gs)) != len(gs):
                raise ValueError(f"layer {layer}: {gs} is not a set of the model's {cfg.n_kv_heads} KV groups")
        if not set(ffns) <= set(range(cfg.n_layers)):
            raise ValueError(f"FFN layers {ffns} are outside the model's {cfg.n_layers} layers")

    def set_placement(self, placement: list[dict]) -> None:
        """The placement this worker's schedule follows (after a re-placement); its own blocks must match."""
        if self.schedule is None:
            raise NotAssignedError("this worker was assigned no placement to run")
        layers = [LayerPlace(**lp) for lp in placement]
        check_placement(layers, self.schedule.cfg)
        if self.name is None or blocks_of(layers, self.name) != blocks_of_held(self.held()):
            raise ValueError(f"the placement does not give {self.name} the blocks it holds")
        unknown = devices_named(layers) - set(self.schedule.devices)
        if unknown:
            raise ValueError(f"the placement names devices with no URL: {sorted(unknown)}")
        self.schedule.layers = layers

    def close(self) -> None:
        self.blocks = self.schedule = None
        self.peers = {}

    def run(self, rows: list[StepRows], epsilons: list[float | None], first: int, x: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Layers first.. of the sessions' rows x [M, H] at positions [M] while this worker gathers them, each
        session at its tolerance -> (the last one's output [M, H], {next, kept, discarded, wire}: the next layer
        to run, each session's speculation counts per layer, and the bytes and calls to its peers)."""
        if self.schedule is None:
            raise NotAssignedError("this worker was assigned no placement to run")
        n = self.held().cfg.n_layers
        for r in rows:
            if r.session not in self.held().sessions:  # a 404 before any peer is called
                raise SessionError(f"no session {r.session!r} here")
        parts = [Part(r, eps, SpeculationStats([0] * n, [0] * n)) for r, eps in zip(rows, epsilons, strict=True)]
        peers = list(self.peers.values())
        before = [(*d.payload, d.calls) for d in peers]
        out, nxt = self.schedule.run(parts, first, x, positions, self.name)
        sent = sum(d.payload[0] + d.payload[1] - b[0] - b[1] for d, b in zip(peers, before, strict=True))
        calls = sum(d.calls - b[2] for d, b in zip(peers, before, strict=True))
        return out, {"next": nxt, "kept": [p.stats.kept for p in parts],
                     "discarded": [p.stats.discarded for p in parts], "wire": [sent, calls]}

    def kv_report(self) -> KVReport:
        """The blocks' caches as the worker reports them with its acks (workers/kv_report.py)."""
        if self.blocks is None:
            return KVReport()
        used, free = self.blocks.pool_blocks()
        return KVReport(used, free, self.blocks.kv_bytes())

    def held(self) -> HeadBlocks:
        if self.blocks is None:
            raise NotAssignedError("this worker holds no HeadSplit blocks: assign them first")
        return self.blocks


def blocks_of_held(blocks: HeadBlocks) -> tuple[dict[int, list[int]], list[int]]:
    """What a device holds, in blocks_of's form."""
    return {layer: block.groups for layer, (_, block) in sorted(blocks.attn.items())}, sorted(blocks.ffn)


def add_head_routes(app: FastAPI, host: HeadHost, auth: list) -> None:
    """The /heads routes, behind the cluster token."""

    @app.post("/heads/assign", dependencies=auth)
    async def assign(body: HeadAssignBody):
        placement = None if body.placement is None else [p.model_dump() for p in body.placement]
        return host.assign(body.model, body.groups, body.ffns, body.dtype, body.name, placement, body.peers,
                           body.kv_format)

    @app.get("/heads/memory", dependencies=auth)
    async def memory():
        return {"used_bytes": host.blocks.memory_bytes() if host.blocks is not None else 0}

    @app.post("/heads/export", dependencies=auth)
    async def export(body: HeadGroupsBody):
        held = host.held()
        for layer, gs in body.groups.items():
            if layer not in held.attn or not set(gs) <= set(held.attn[layer][1].groups):
                raise ValueError(f"layer {layer}: groups {gs} are not all held here")
        return Response(encode_group_kv(held.export(body.groups)), media_type="application/octet-stream")

    @app.post("/heads/reshape", dependencies=auth)
    async def reshape(request: Request):
        try:
            blocks = HeadBlocksBody.model_validate_json(request.headers.get("x-blocks", ""))
        except ValidationError as exc:
            raise ValueError(f"header X-Blocks: {exc}") from exc
        held = host.held()
        host.check_blocks(held.cfg, blocks.groups, blocks.ffns)
        held.reshape(blocks.groups, blocks.ffns, decode_group_kv(await request.body()))
        return {"ok": True}

    @app.post("/heads/placement", dependencies=auth)
    async def placement(body: list[PlaceBody]):
        host.set_placement([p.model_dump() for p in body])
        return {"ok": True}
