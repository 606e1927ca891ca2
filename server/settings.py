"""The one validated settings object of a controller process (environment EDGESPEC_*, then CLI flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServeSettings(BaseSettings):
    """Settings of `edgespec serve`."""

    model_config = SettingsConfigDict(env_prefix="EDGESPEC_", extra="forbid")

    model: str | None = Field(None, description="Hugging Face folder or .gguf file; default: embedded SmolLM2")
    served_model_name: str | None = Field(None, description="model id in the API; default: the model's name")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' on /v1 routes")
    policy: str = Field("naive", description="default decoding policy")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    threads: int = Field(0, ge=0, description="torch threads for the model; 0: all cores")
    kv_cache_gib: float = Field(2.0, gt=0, description="memory bound for all sessions' KV caches")
    max_request_bytes: int = Field(4 * 2**20, gt=0)
    local_workers: int = Field(0, ge=0, description="start N worker processes on loopback and serve through them")
    cluster: str | None = Field(None, description="TOML file naming running workers (see config/)")
    advertise_url: str | None = Field(None, description="URL at which workers reach this controller")
    stage_timeout_s: float = Field(60.0, gt=0, description="timeout of one call to a worker")
    worker_threads: int = Field(0, ge=0, description="torch threads of each local worker; 0: all cores")
    log_level: str = "info"
