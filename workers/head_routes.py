"""HeadSplit blocks on a worker (issue 9, in progress): KV groups and FFN blocks of any layers, loaded alone
(model/headsplit.py's HeadBlocks), and the calls HeadSplitPipeline makes on a device, over HTTP.

    POST   /heads/assign                   {"groups": {"LAYER": [GROUP, ...]}, "ffns": [LAYER], "dtype", "model"}
    POST   /heads/sessions/{sid}/open      {"capacity", "rows"}
    POST   /heads/sessions/{sid}/truncate  {"length"}
    DELETE /heads/sessions/{sid}
    POST   /heads/sessions/{sid}/attend?layer=L&start=S   safetensors {x, positions[, mask]} -> {out}
    POST   /heads/ffn?layer=L                              safetensors {z} -> {x}

Tensor work runs inline on the event loop's thread, as the layer routes' does. Calls carry no step numbers
yet: a retried attend rewrites the same slots, a retried ffn is stateless.
"""

from __future__ import annotations

import torch
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from model.config import ModelConfig
from model.headsplit import HeadBlocks
from model.load import DTYPES
from model.source import resolve_model
from model.weights import TensorSource
from workers.host import NotAssignedError
from workers.wire import WireError, decode, encode


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HeadAssignBody(Strict):
    model: str | None = None
    groups: dict[int, list[int]] = Field(default_factory=dict)
    ffns: list[int] = Field(default_factory=list)
    dtype: str = "float32"


class HeadOpenBody(Strict):
    capacity: int = Field(ge=1)
    rows: int = Field(1, ge=1)


class HeadTruncateBody(Strict):
    length: int = Field(ge=0)


class HeadHost:
    """The worker's HeadSplit blocks (no HTTP)."""

    def __init__(self, default_model: str | None):
        self.default_model = default_model
        self.blocks: HeadBlocks | None = None

    def assign(self, model: str | None, groups: dict[int, list[int]], ffns: list[int], dtype: str) -> dict:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
        files = resolve_model(model if model is not None else self.default_model)
        cfg = ModelConfig.from_folder(files.folder)
        for layer, gs in groups.items():
            if not 0 <= layer < cfg.n_layers or not gs or not set(gs) <= set(range(cfg.n_kv_heads)) or \
                    len(set(gs)) != len(gs):
                raise ValueError(f"layer {layer}: {gs} is not a set of the model's {cfg.n_kv_heads} KV groups")
        if not set(ffns) <= set(range(cfg.n_layers)):
            raise ValueError(f"FFN layers {ffns} are outside the model's {cfg.n_layers} layers")
        self.blocks = None  # free the old blocks first
        self.blocks = HeadBlocks(TensorSource(files.folder), cfg, DTYPES[dtype], groups, ffns)
        return {"groups": {str(k): v for k, v in groups.items()}, "ffns": ffns}

    def held(self) -> HeadBlocks:
        if self.blocks is None:
            raise NotAssignedError("this worker holds no HeadSplit blocks: assign them first")
        return self.blocks


def _int(request: Request, name: str) -> int:
    value = request.query_params.get(name, "")
    if not value.isdigit():
        raise ValueError(f"query parameter {name!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _hidden(t: torch.Tensor, name: str, hidden_size: int) -> torch.Tensor:
    if t.dim() != 3 or t.shape[-1] != hidden_size or not t.is_floating_point():
        raise WireError(f"{name} must be float [B, T, {hidden_size}], got {t.dtype} {list(t.shape)}")
    return t


def add_head_routes(app: FastAPI, host: HeadHost, auth: list) -> None:
    """The /heads routes, behind the cluster token."""

    @app.post("/heads/assign", dependencies=auth)
    async def assign(body: HeadAssignBody):
        return host.assign(body.model, body.groups, body.ffns, body.dtype)

    @app.post("/heads/sessions/{sid}/open", dependencies=auth)
    async def open_session(sid: str, body: HeadOpenBody):
        host.held().open(sid, body.capacity, body.rows)
        return {"ok": True}

    @app.post("/heads/sessions/{sid}/truncate", dependencies=auth)
    async def truncate(sid: str, body: HeadTruncateBody):
        host.held().truncate(sid, body.length)
        return {"ok": True}

    @app.delete("/heads/sessions/{sid}", dependencies=auth)
    async def release(sid: str):
        if host.blocks is not None:
            host.blocks.release(sid)
        return {"ok": True}

    @app.post("/heads/sessions/{sid}/attend", dependencies=auth)
    async def attend(sid: str, request: Request):
        blocks = host.held()
        t = decode(await request.body(), ("x", "positions"), ("mask",))
        x = _hidden(t["x"], "x", blocks.cfg.hidden_size)
        positions, mask = t["positions"], t.get("mask")
        if positions.dtype != torch.int64 or positions.shape != x.shape[:2]:
            raise WireError(f"positions must be int64 {list(x.shape[:2])}, got {positions.dtype} "
                            f"{list(positions.shape)}")
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < \
                blocks.cfg.max_position_embeddings:
            raise WireError("positions are outside the model's context")
        start = _int(request, "start")
        if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [*x.shape[:2], start + x.shape[1]]):
            raise WireError(f"mask must be bool [B, T, start + T], got {mask.dtype} {list(mask.shape)}")
        out = blocks.attend(sid, _int(request, "layer"), x, positions, start, mask)
        return Response(encode({"out": out}), media_type="application/octet-stream")

    @app.post("/heads/ffn", dependencies=auth)
    async def ffn(request: Request):
        blocks = host.held()
        z = _hidden(decode(await request.body(), ("z",))["z"], "z", blocks.cfg.hidden_size)
        return Response(encode({"x": blocks.feed_forward(_int(request, "layer"), z)}),
                        media_type="application/octet-stream")
