"""LAN discovery on loopback: a worker's DNS-SD service and TXT record as a controller resolves them (no token in
them), the token proof (a worker of this cluster is adopted, a stranger with another token refused), a worker's
goodbye reported as its departure, and how a found worker joins a controller's cluster. Everything stays on the
loopback interface; the whole cluster over namespaces on a bridge is tests/test_discovery_netns.py."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from processes import free_port
from zeroconf import IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from edgespec.server.discovery import Discovery, adopt, find_workers
from edgespec.workers.discovery import SERVICE_TYPE, announced, announces
from edgespec.workers.settings import WorkerSettings

LOOPBACK = ["127.0.0.1"]


def test_announcing_defaults_to_reachable_addresses():
    assert not announces(WorkerSettings(port=9001, token="t"))  # loopback: a controller's local worker is quiet
    assert announces(WorkerSettings(port=9001, token="t", host="127.0.0.1", announce=True))
    assert announces(WorkerSettings(port=9001, token="t", announce_address="192.0.2.7"))
    assert not announces(WorkerSettings(port=9001, token="t", host="192.0.2.7", announce=False))
    with pytest.raises(ValueError):
        WorkerSettings(port=9001, token="t", announce_address="::1")


def test_service_and_txt_round_trip_without_the_token():
    token = secrets.token_urlsafe(16)
    settings = WorkerSettings(port=free_port(), token=token, host="127.0.0.1", announce=True)
    name = f"w-{secrets.token_hex(3)}"

    async def resolve() -> AsyncServiceInfo:
        async with announced(settings, name):
            zc = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
            try:
                info = AsyncServiceInfo(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}")
                deadline = time.monotonic() + 10
                while not await info.async_request(zc.zeroconf, 1000):  # registration probes for about 1 s
                    assert time.monotonic() < deadline, "the worker's service never resolved"
                return info
            finally:
                await zc.async_close()

    info = asyncio.run(resolve())
    assert info.port == settings.port
    assert info.parsed_addresses(IPVersion.V4Only) == ["127.0.0.1"]
    assert info.properties == {b"txtvers": b"1", b"name": name.encode()}
    published = [info.name, info.server, *(k.decode() for k in info.properties),
                 *(v.decode() for v in info.properties.values() if v)]
    assert not any(token in text for text in published)


class WorkerThread:
    """A real worker app (its lifespan announces it) served by uvicorn on loopback in a thread."""

    def __init__(self, settings: WorkerSettings):
        from edgespec.workers.app import create_worker_app

        self.server = uvicorn.Server(uvicorn.Config(create_worker_app(settings), host=settings.host,
                                                    port=settings.port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the worker did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_token_proof_adopts_ours_refuses_a_stranger_and_reports_the_goodbye(caplog):
    caplog.set_level(logging.INFO, logger="edgespec.server.discovery")
    token, port = secrets.token_urlsafe(16), free_port()
    name = f"w-{secrets.token_hex(3)}"
    worker = WorkerThread(WorkerSettings(port=port, token=token, host="127.0.0.1", name=name, announce=True))

    async def scenario():
        found, lost = asyncio.Queue(), asyncio.Queue()
        ours = Discovery(token, lambda url, n: found.put_nowait((url, n)), lost.put_nowait, LOOPBACK)
        async with ours:
            stranger = await find_workers("another-clusters-token", 1, 4, LOOPBACK)
            adopted = await asyncio.wait_for(found.get(), 15)
            await asyncio.to_thread(worker.stop)  # its lifespan says goodbye
            departed = await asyncio.wait_for(lost.get(), 15)
        return stranger, adopted, departed

    try:
        stranger, adopted, departed = asyncio.run(scenario())
    finally:
        worker.stop()
    assert stranger == []
    assert any("refused" in r.message and "wrong proof" in r.message for r in caplog.records)
    assert adopted == (f"http://127.0.0.1:{port}", name)
    assert departed == name


def test_adopt_joins_new_workers_only():
    joined, nudged = [], []

    async def answering(names, timeout_s):
        return {"busy"}  # the member named "busy" still answers at its old address

    members = {"w0": ("http://a:1", True), "busy": ("http://b:1", True), "gone": ("http://c:1", True),
               "back": ("http://d:1", False)}
    manager = SimpleNamespace(
        members={name: SimpleNamespace(url=url, up=up) for name, (url, up) in members.items()},
        pending_joins=[SimpleNamespace(name="queued")], answering=answering,
        request_join=lambda url, name: joined.append((url, name)), nudge=lambda: nudged.append(True))

    async def run():
        await adopt(manager, "http://a:1", "w0")  # a member already: its checks watch it
        await adopt(manager, "http://q:1", "queued")  # joining already
        await adopt(manager, "http://x:1", "busy")  # a second live worker of that name
        await adopt(manager, "http://c:2", "gone")  # moved: its old address no longer answers
        await adopt(manager, "http://n:1", "new")
        await adopt(manager, "http://d:1", "back")  # lost, found again where it was: checked now, no new join

    asyncio.run(run())
    assert joined == [("http://c:2", "gone"), ("http://n:1", "new")]
    assert len(nudged) == 3
