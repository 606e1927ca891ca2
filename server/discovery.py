"""The controller's side of LAN discovery (`edgespec serve --discover`): browse mDNS/DNS-SD for workers' services
(workers/discovery.py announces them), adopt the workers that prove the cluster token, and report those whose
service goes away. No tensor code here.

A found service is resolved to its addresses and port, and the worker's GET /health is called there with a
random challenge: a worker of this cluster answers its details with the HMAC of the challenge under the token
(workers/auth.py, proof), so the token itself never goes to whatever announces the service type. Any other
answer (a wrong proof, no proof) is refused and logged, never adopted. Once adopted, the controller's calls and
links carry the token as every cluster call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from edgespec.workers.auth import proof_ok
from edgespec.workers.cluster import WorkerSpec
from edgespec.workers.discovery import SERVICE_TYPE

log = logging.getLogger(__name__)

RESOLVE_MS = 3000  # a service's SRV, TXT and A records: answers on a LAN come within milliseconds
HEALTH_TIMEOUT_S = 3.0  # one address's /health; an announced address this host cannot reach costs this much
VERIFY_TRIES, VERIFY_RETRY_S = 20, 0.5  # a worker announces while it starts: its port may not listen yet
QUIET_S = 1.5  # at start, the answers to one query come together: wait this long after the last for more

Interfaces = InterfaceChoice | list[str]


@dataclass(frozen=True)
class Proof:
    """What a found service's /health said to the cluster token: `url` and `name` when it is ours."""

    url: str | None = None
    name: str | None = None
    refusal: str | None = None  # why it is not ours (None and no url: nobody answered)


async def prove(client: httpx.AsyncClient, token: str, addresses: list[str], port: int) -> Proof:
    """Challenge each announced address's /health to prove the token; the first that answers decides."""
    challenge = secrets.token_hex(16)
    for address in addresses:
        url = f"http://{address}:{port}"
        try:
            r = await client.get(url + "/health", params={"challenge": challenge})
        except httpx.HTTPError:
            continue  # another of its addresses may be reachable from here
        try:
            body = r.json() if r.status_code == 200 else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        if "proof" in body and not proof_ok(token, challenge, body["proof"]):
            return Proof(refusal=f"{url} does not know this cluster's token (a wrong proof)")
        if isinstance(body.get("name"), str) and "instance" in body and "proof" in body:
            return Proof(url, body["name"])
        return Proof(refusal=f"{url} answered {r.status_code} without a worker's details")
    return Proof()


class Discovery:
    """Browses for `_edgespec._tcp.local.` while open (`async with`). A worker that proves the token is reported
    by on_found(url, name) (awaited when it returns an awaitable); when an adopted worker's service goes away,
    on_lost(name) is called."""

    def __init__(self, token: str, on_found: Callable[[str, str], Awaitable[None] | None],
                 on_lost: Callable[[str], None] | None = None, interfaces: Interfaces = InterfaceChoice.All):
        self.token, self.on_found, self.on_lost, self.interfaces = token, on_found, on_lost, interfaces
        self.adopted: dict[str, str] = {}  # service instance name -> worker name
        self.refused: set[str] = set()  # logged once, until the service goes away
        self.checking: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self.zc: AsyncZeroconf | None = None
        self.browser: AsyncServiceBrowser | None = None
        self.client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Discovery:
        self.zc = AsyncZeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        self.client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        self.browser = AsyncServiceBrowser(self.zc.zeroconf, SERVICE_TYPE, handlers=[self._changed])
        return self

    async def __aexit__(self, *exc) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.browser.async_cancel()
        with contextlib.suppress(Exception):
            await self.zc.async_close()
        await self.client.aclose()

    def _changed(self, zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        # called on the event loop by the browser
        if state_change is ServiceStateChange.Removed:
            self.refused.discard(name)
            worker = self.adopted.pop(name, None)
            if worker is not None:
                log.warning("worker %s left the LAN (its service %s went away)", worker, name)
                if self.on_lost is not None:
                    self.on_lost(worker)
            return
        if name in self.checking or (state_change is ServiceStateChange.Updated and name in self.refused):
            return
        self.checking.add(name)
        task = asyncio.get_running_loop().create_task(self._check(name))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _check(self, name: str) -> None:
        try:
            proof, announced = await self._verify(name)
            if proof is None:
                return
            if proof.url is None and proof.refusal is None:
                log.warning("found %s, but none of its addresses answered", name)
                return
            if proof.refusal is None and announced and announced != proof.name:
                proof = Proof(refusal=f"it announces the name {announced!r} but {proof.url} is {proof.name!r}")
            if proof.refusal is not None:
                if name not in self.refused:
                    log.warning("refused the service %s: %s", name, proof.refusal)
                self.refused.add(name)
                return
            self.refused.discard(name)
            self.adopted[name] = proof.name
            log.info("found worker %s at %s", proof.name, proof.url)
            done = self.on_found(proof.url, proof.name)
            if done is not None:
                await done
        except Exception:  # one service's trouble must not stop the browsing
            log.exception("checking the service %s failed", name)
        finally:
            self.checking.discard(name)

    async def _verify(self, name: str) -> tuple[Proof | None, str]:
        # (None, _): the service could not be resolved; else the proof after retries, and the TXT name
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self.zc.zeroconf, RESOLVE_MS):
            log.warning("found %s, but could not resolve its address", name)
            return None, ""
        addresses = info.parsed_addresses(IPVersion.V4Only)
        announced = (info.properties.get(b"name") or b"").decode(errors="replace")
        proof = Proof()
        for _ in range(VERIFY_TRIES):
            proof = await prove(self.client, self.token, addresses, info.port)
            if proof.url is not None or proof.refusal is not None:
                break
            await asyncio.sleep(VERIFY_RETRY_S)
        return proof, announced


async def find_workers(token: str, want: int, wait_s: float, interfaces: Interfaces = InterfaceChoice.All
                       ) -> list[WorkerSpec]:
    """The workers of this cluster on the LAN at start-up: once `want` of them are adopted and no more came for
    QUIET_S, or at wait_s with those found so far (maybe none)."""
    found: dict[str, WorkerSpec] = {}
    changed = asyncio.Event()

    def on_found(url: str, name: str) -> None:
        found[name] = WorkerSpec(url, name)
        changed.set()

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with Discovery(token, on_found, interfaces=interfaces):
        while (left := deadline - loop.time()) > 0:
            enough = len(found) >= want
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), min(QUIET_S, left) if enough else left)
            except TimeoutError:
                if enough:
                    break
    return list(found.values())


@contextlib.asynccontextmanager
async def watching(manager, token: str, interfaces: Interfaces = InterfaceChoice.All) -> AsyncIterator[None]:
    """While serving (ClusterManager.monitor): workers found later join through the manager's join path (profiled,
    then planned in); an adopted worker whose service goes away is checked at once (ClusterManager.depart).
    Without mDNS here the controller serves on, by its checks alone."""
    stack = contextlib.AsyncExitStack()
    try:
        await stack.enter_async_context(Discovery(token, lambda url, name: adopt(manager, url, name),
                                                  manager.depart, interfaces))
    except OSError as exc:
        log.error("LAN discovery is not available here (%s): workers found later will not join", exc)
    async with stack:
        yield


async def adopt(manager, url: str, name: str) -> None:
    """A worker proved the token: plan it in, unless it is a member already (the manager's checks watch those,
    and plan one back in when it answers again: a lost one found again is checked at once) or another live
    worker holds its name."""
    member = manager.members.get(name)
    if member is not None and member.url == url:
        if not member.up:
            manager.nudge()
        return
    if any(d.name == name for d in manager.pending_joins):
        return
    if member is not None and member.up and name in await manager.answering([name], HEALTH_TIMEOUT_S):
        log.error("two workers are named %s (%s and %s): the one at %s is not adopted", name, member.url, url, url)
        return
    log.warning("discovered worker %s at %s: it joins", name, url)
    manager.request_join(url, name)
    manager.nudge()
