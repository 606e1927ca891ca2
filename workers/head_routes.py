"""HeadSplit blocks on a worker: KV groups and FFN blocks of any layers, loaded alone (model/headsplit.py's
HeadBlocks), the calls HeadSplitPipeline makes on a device, and the schedule itself where this worker gathers.

    POST   /heads/assign    {"groups": {"LAYER": [GROUP, ...]}, "ffns": [LAYER], "dtype", "model",
                             "name", "placement": [LayerPlace...], "peers": {NAME: URL}}
    POST   /heads/sessions/{sid}/open      {"capacity"}
    DELETE /heads/sessions/{sid}
    POST   /heads/sessions/{sid}/attend?layer=L&start=S&step=N   safetensors {x, positions[, mask]} -> {out}
    POST   /heads/ffn?layer=L                              safetensors {z} -> {x}
    POST   /heads/sessions/{sid}/run?layer=L&start=S&epsilon=E&step=N   safetensors {x, positions[, mask]}
           -> {x, next, kept, discarded, wire}: layers L.. while this worker is their projection device, calling
           its peers (named in the assignment, with this worker's own token) for their groups and FFNs
    GET    /heads/memory                   -> {"used_bytes"}: blocks and caches
    POST   /heads/export    {"groups": {"LAYER": [GROUP]}} -> safetensors SESSION/LAYER/GROUP/k|v of every session
    POST   /heads/reshape   header X-Blocks {"groups", "ffns"}, safetensors of the arriving groups' caches
    POST   /heads/placement [LayerPlace...]: the placement this worker's schedule follows from now on

Tensor work of attend and ffn runs inline on the event loop's thread, as the layer routes' does; a run waits on
its peers, so it runs on a thread of its own and the loop stays free to answer them. Attend and run calls carry
the session's step number N: a call older than the last step a device saw is refused with 409 (HeadBlocks.attend),
so a late call cannot overwrite slots written since; a retry of the same step recomputes the same bits, and a
retried ffn is stateless.
"""

from __future__ import annotations

import asyncio
import math

import torch
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgespec.model.config import ModelConfig
from edgespec.model.head_blocks import HeadBlocks
from edgespec.model.headsplit import HeadSplitPipeline, SpeculationStats, blocks_of, check_placement, devices_named
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stage import SessionError
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace
from edgespec.workers.host import NotAssignedError
from edgespec.workers.wire import WireError, decode, decode_group_kv, encode, encode_group_kv


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlaceBody(Strict):
    """One layer's LayerPlace (planning/headsplit.py), checked before the schedule reads it."""

    groups: dict[str, list[int]]
    proj: str
    ffn: str
    speculate: bool = False


class HeadAssignBody(Strict):
    model: str | None = None
    groups: dict[int, list[int]] = Field(default_factory=dict)
    ffns: list[int] = Field(default_factory=list)
    dtype: str = "float32"
    name: str | None = Field(None, description="this worker's device name in the placement")
    placement: list[PlaceBody] | None = Field(None, description="every layer's LayerPlace; with it, this worker "
                                              "can run the schedule where it is the projection device")
    peers: dict[str, str] = Field(default_factory=dict, description="the other devices' URLs by name")


class HeadBlocksBody(Strict):
    groups: dict[int, list[int]] = Field(default_factory=dict)
    ffns: list[int] = Field(default_factory=list)


class HeadGroupsBody(Strict):
    groups: dict[int, list[int]]


class HeadOpenBody(Strict):
    capacity: int = Field(ge=1, lt=2**62)


class HeadHost:
    """The worker's HeadSplit blocks, and the schedule over them and its peers where it gathers. Peers are
    reached through `connect(threads)` (workers/head_client.py's Reach, with this worker's token)."""

    def __init__(self, default_model: str | None, connect, memory_budget_bytes: int | None = None):
        """memory_budget_bytes: the worker's bound of weights plus caches (its --memory-budget-gib)."""
        self.default_model = default_model
        self.connect = connect
        self.memory_budget_bytes = memory_budget_bytes
        self.blocks: HeadBlocks | None = None
        self.pipeline: HeadSplitPipeline | None = None
        self.name: str | None = None

    def assign(self, model: str | None, groups: dict[int, list[int]], ffns: list[int], dtype: str,
               name: str | None = None, placement: list[dict] | None = None, peers: dict[str, str] | None = None
               ) -> dict:
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
        self.close()  # free the old blocks and connections first
        self.blocks = HeadBlocks(open_source(files), cfg, fmt, groups, ffns)
        if self.memory_budget_bytes is not None:  # the caches get what the blocks' weights leave
            self.blocks.limit_kv(self.memory_budget_bytes - self.blocks.memory_bytes())
        self.name = name
        if layers is not None:
            reach = self.connect(len(peers or {}) + 2)  # a thread per device, and the previous layer's FFN
            devices = {peer: reach.device(peer, url) for peer, url in (peers or {}).items() if peer != name}
            self.pipeline = HeadSplitPipeline({**devices, name: self.blocks}, layers, cfg, fan_out=reach.fan_out,
                                              close=reach.close)
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
        if self.pipeline is None:
            raise NotAssignedError("this worker was assigned no placement to run")
        layers = [LayerPlace(**lp) for lp in placement]
        check_placement(layers, self.pipeline.cfg)
        if blocks_of(layers, self.name) != blocks_of_held(self.held()):
            raise ValueError(f"the placement does not give {self.name} the blocks it holds")
        unknown = devices_named(layers) - set(self.pipeline.devices)
        if unknown:
            raise ValueError(f"the placement names devices with no URL: {sorted(unknown)}")
        self.pipeline.layers = layers

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
        self.blocks = self.pipeline = None

    def run(self, session: str, first: int, x: torch.Tensor, positions: torch.Tensor, start: int,
            mask: torch.Tensor | None, epsilon: float, step: int) -> dict[str, torch.Tensor]:
        """Layers first.. while this worker gathers them; the peers' traffic it caused comes back in `wire`."""
        if self.pipeline is None:
            raise NotAssignedError("this worker was assigned no placement to run")
        n = self.held().cfg.n_layers
        if session not in self.held().sessions:  # a 404 before any peer is called
            raise SessionError(f"no session {session!r} here")
        stats = SpeculationStats([0] * n, [0] * n)
        peers = [d for name, d in self.pipeline.devices.items() if name != self.name]
        before = [(*d.payload, d.calls) for d in peers]
        out, nxt = self.pipeline.run(session, first, x, positions, start, mask, epsilon, stats, step, self.name)
        sent = sum(d.payload[0] + d.payload[1] - b[0] - b[1] for d, b in zip(peers, before, strict=True))
        calls = sum(d.calls - b[2] for d, b in zip(peers, before, strict=True))
        return {"x": out, "next": torch.tensor([nxt]), "kept": torch.tensor(stats.kept),
                "discarded": torch.tensor(stats.discarded), "wire": torch.tensor([sent, calls])}

    def held(self) -> HeadBlocks:
        if self.blocks is None:
            raise NotAssignedError("this worker holds no HeadSplit blocks: assign them first")
        return self.blocks


def blocks_of_held(blocks: HeadBlocks) -> tuple[dict[int, list[int]], list[int]]:
    """What a device holds, in blocks_of's form."""
    return {layer: block.groups for layer, (_, block) in sorted(blocks.attn.items())}, sorted(blocks.ffn)


def _int(request: Request, name: str) -> int:
    value = request.query_params.get(name, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 18):  # below 2**62: no overflow downstream
        raise ValueError(f"query parameter {name!r} must be a non-negative integer, got {value[:40]!r}")
    return int(value)


def _sid(sid: str) -> str:
    if not 0 < len(sid) <= 128:
        raise ValueError("a session id has 1 to 128 characters")
    return sid


def _hidden(t: torch.Tensor, name: str, hidden_size: int) -> torch.Tensor:
    if t.dim() != 3 or t.shape[-1] != hidden_size or not t.is_floating_point():
        raise WireError(f"{name} must be float [B, T, {hidden_size}], got {t.dtype} {list(t.shape)}")
    return t


def add_head_routes(app: FastAPI, host: HeadHost, auth: list) -> None:
    """The /heads routes, behind the cluster token."""

    @app.post("/heads/assign", dependencies=auth)
    async def assign(body: HeadAssignBody):
        placement = None if body.placement is None else [p.model_dump() for p in body.placement]
        return host.assign(body.model, body.groups, body.ffns, body.dtype, body.name, placement, body.peers)

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

    @app.post("/heads/sessions/{sid}/open", dependencies=auth)
    async def open_session(sid: str, body: HeadOpenBody):
        held = host.held()
        if body.capacity > held.cfg.max_position_embeddings:  # a cache past the context could only overflow
            raise ValueError(f"capacity {body.capacity} exceeds the model's context of "
                             f"{held.cfg.max_position_embeddings}")
        held.open(_sid(sid), body.capacity)
        return {"ok": True}

    @app.delete("/heads/sessions/{sid}", dependencies=auth)
    async def release(sid: str):
        if host.blocks is not None:
            host.blocks.release(sid)
        return {"ok": True}

    async def step_input(request: Request) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
        # x [B, T, H], positions [B, T], start, mask [B, T, start + T] of an attend or run call, checked
        cfg = host.held().cfg
        t = decode(await request.body(), ("x", "positions"), ("mask",))
        x = _hidden(t["x"], "x", cfg.hidden_size)
        positions, mask = t["positions"], t.get("mask")
        if positions.dtype != torch.int64 or positions.shape != x.shape[:2]:
            raise WireError(f"positions must be int64 {list(x.shape[:2])}, got {positions.dtype} "
                            f"{list(positions.shape)}")
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < \
                cfg.max_position_embeddings:
            raise WireError("positions are outside the model's context")
        start = _int(request, "start")
        if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [*x.shape[:2], start + x.shape[1]]):
            raise WireError(f"mask must be bool [B, T, start + T], got {mask.dtype} {list(mask.shape)}")
        return x, positions, start, mask

    @app.post("/heads/sessions/{sid}/attend", dependencies=auth)
    async def attend(sid: str, request: Request):
        x, positions, start, mask = await step_input(request)
        out = host.held().attend(_sid(sid), _int(request, "layer"), x, positions, start, mask, _int(request, "step"))
        return Response(encode({"out": out}), media_type="application/octet-stream")

    @app.post("/heads/sessions/{sid}/run", dependencies=auth)
    async def run(sid: str, request: Request):
        x, positions, start, mask = await step_input(request)
        layer = _int(request, "layer")
        if layer >= host.held().cfg.n_layers:
            raise ValueError(f"layer {layer} is outside the model's {host.held().cfg.n_layers} layers")
        try:
            epsilon = float(request.query_params.get("epsilon", ""))
        except ValueError:
            epsilon = math.nan
        if not epsilon >= 0:
            raise ValueError("query parameter 'epsilon' must be a number >= 0")
        out = await asyncio.to_thread(host.run, _sid(sid), layer, x, positions, start, mask, epsilon,
                                      _int(request, "step"))
        return Response(encode(out), media_type="application/octet-stream")

    @app.post("/heads/ffn", dependencies=auth)
    async def ffn(request: Request):
        blocks = host.held()
        z = _hidden(decode(await request.body(), ("z",))["z"], "z", blocks.cfg.hidden_size)
        return Response(encode({"x": blocks.feed_forward(_int(request, "layer"), z)}),
                        media_type="application/octet-stream")
