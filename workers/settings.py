"""The one validated settings object of a worker process (environment EDGESPEC_WORKER_*, then CLI flags)."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def comma_separated(v) -> list[str]:
    """A list setting's items, given as a flag repeated (a list), comma-separated (a string), or both; spaces
    trimmed, empty items dropped."""
    items = [] if v is None else [v] if isinstance(v, str) else list(v)
    return [a.strip() for item in items for a in str(item).split(",") if a.strip()]


class WorkerSettings(BaseSettings):
    """Settings of `edgespec worker`."""

    model_config = SettingsConfigDict(env_prefix="EDGESPEC_WORKER_", extra="forbid")

    port: int = Field(ge=0, le=65535)
    token: str = Field(min_length=1, description="the cluster's shared token; every call must carry it")
    host: str = "127.0.0.1"
    name: str | None = Field(None, description="device name shown by /info; default: host name and port")
    memory_budget_gib: float = Field(4.0, gt=0, description="bound for this worker's weights plus KV caches")
    model: str | None = Field(None, description="local copy of the model (folder or .gguf); default: embedded")
    threads: int = Field(0, ge=0, description="torch threads; 0: all cores")
    kv_prefault: bool = Field(False, description="commit the KV pool's memory when layers are assigned")
    adapt_threads: bool = Field(True, description="run fewer torch threads while other processes take cores")
    max_body_bytes: int = Field(64 * 2**20, gt=0)
    max_header_bytes: int = Field(32 * 2**10, ge=1024, description="bound of a request's line and headers "
                                  "together (a longer head is refused with 431)")
    downstream_timeout_s: float = Field(120.0, gt=0)
    join: str | None = Field(None, description="controller URL to announce this worker to at start-up")
    advertise_url: str | None = Field(None, description="URL at which the controller reaches this worker")
    announce: bool | None = Field(None, description="announce this worker on the LAN by mDNS/DNS-SD (never the "
                                  "token) for `serve --discover`; default: when what it would announce is not loopback")
    announce_address: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="IPv4 addresses to announce (the flag repeated, or comma-separated); "
        "default: the bound address, or the host's LAN addresses when bound to 0.0.0.0")
    log_level: str = "warning"

    @field_validator("announce_address", mode="before")
    @classmethod
    def _ipv4_addresses(cls, v):
        addresses = comma_separated(v)
        for a in addresses:  # published as A records: IPv4 only
            ipaddress.IPv4Address(a)  # ValueError: the settings are refused at start
        return addresses
