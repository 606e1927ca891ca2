"""The JSON bodies of a worker's HTTP routes (workers/app.py, workers/head_routes.py), strict: a field the route
does not know is refused (400), not ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from edgespec.model.kv_format import KVFormatName
from edgespec.model.timing import CONTEXTS, TOKENS


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AssignBody(Strict):
    model: str | None = None
    first: int = Field(ge=0, lt=2**31)
    last: int = Field(ge=1, lt=2**31)
    dtype: str = "float32"
    kv_format: KVFormatName = "float32"
    away: dict[int, dict[str, list[int]]] = Field(
        default_factory=dict, description="experts of this worker's layers placed on other workers: layer -> "
        "that worker's URL -> expert ids (planning/experts.py)")
    hosted: dict[int, list[int]] = Field(default_factory=dict, description="experts this worker holds of other "
                                         "workers' layers: layer -> expert ids")


class ProfileBody(Strict):
    model: str | None = None
    dtype: str = "float32"
    tokens: list[int] = Field(default_factory=lambda: list(TOKENS), min_length=1, max_length=32)
    contexts: list[int] = Field(default_factory=lambda: list(CONTEXTS), min_length=1, max_length=16)
    reps: int = Field(3, ge=1, le=50)


class LinkBody(Strict):
    target: str = Field(min_length=1, description="base URL of another worker")
    reps: int = Field(5, ge=1, le=50)


# HeadSplit blocks (workers/head_routes.py)

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
    kv_format: KVFormatName = "float32"
    name: str | None = Field(None, description="this worker's device name in the placement")
    placement: list[PlaceBody] | None = Field(None, description="every layer's LayerPlace; with it, this worker "
                                              "can run the schedule where it is the projection device")
    peers: dict[str, str] = Field(default_factory=dict, description="the other devices' URLs by name")


class HeadBlocksBody(Strict):
    groups: dict[int, list[int]] = Field(default_factory=dict)
    ffns: list[int] = Field(default_factory=list)


class HeadGroupsBody(Strict):
    groups: dict[int, list[int]]
