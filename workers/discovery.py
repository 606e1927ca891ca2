"""A worker's DNS-SD announcement on the LAN (mDNS, `_edgespec._tcp.local.`), for `edgespec serve --discover`.

What is published: the service instance (the worker's name), a host record of its own, the addresses and port
at which the worker answers, and a TXT record with `txtvers` and `name`. Never the cluster token: a controller
proves that a found worker is one of its cluster by calling the worker's /health with the token it already
holds (server/discovery.py); a worker answers the details only to the right token.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import secrets
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import ifaddr
from zeroconf import InterfaceChoice, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from edgespec.workers.settings import WorkerSettings

log = logging.getLogger(__name__)

SERVICE_TYPE = "_edgespec._tcp.local."
TXT_VERSION = "1"
ANY = {"", "0.0.0.0", "::"}  # bind addresses that mean every interface


def announces(settings: WorkerSettings) -> bool:
    """Whether this worker announces itself: --announce / --no-announce, else when what it would announce is
    reachable from other devices (a worker on loopback, such as a controller's local worker, stays quiet)."""
    if settings.announce is not None:
        return settings.announce
    addresses, _ = announced_endpoint(settings)
    return any(not ipaddress.ip_address(a).is_loopback for a in addresses)


def _bound_addresses(host: str) -> list[str]:
    # the IPv4 addresses a bind host stands for: every interface's, or what the name resolves to
    if host in ANY:
        return lan_addresses()
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def lan_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (loopback alone when it has no other)."""
    found = [ip.ip for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)]
    outside = [a for a in found if not ipaddress.ip_address(a).is_loopback]
    return list(dict.fromkeys(outside or ["127.0.0.1"]))


def announced_endpoint(settings: WorkerSettings) -> tuple[list[str], int]:
    """The IPv4 addresses and port to publish: --announce-address if given, else --advertise-url's host when it
    is an IPv4 address, else the address the worker binds (the host's LAN addresses when it binds them all);
    the port is --advertise-url's if it names one, else the one the worker binds."""
    advertised = urlsplit(settings.advertise_url) if settings.advertise_url else None
    port = (advertised.port if advertised else None) or settings.port
    if settings.announce_address:
        return list(settings.announce_address), port
    if advertised and advertised.hostname and _is_ipv4(advertised.hostname):
        return [advertised.hostname], port
    return _bound_addresses(settings.host), port


def _is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def instance_label(name: str) -> str:
    """A DNS-SD instance label for a worker name: dots would split the label, and a label holds 63 bytes."""
    label = re.sub(r"[.\x00-\x1f]", "-", name) or "worker"
    return label.encode()[:63].decode(errors="ignore")


def service_info(name: str, addresses: list[str], port: int) -> AsyncServiceInfo:
    """The service a worker publishes. Its host record is named at random: workers on one machine (or in network
    namespaces of one kernel, which share a host name) must not answer for each other's addresses."""
    label = instance_label(name)
    return AsyncServiceInfo(
        SERVICE_TYPE, f"{label}.{SERVICE_TYPE}", port=port,
        addresses=[socket.inet_aton(a) for a in addresses],
        properties={"txtvers": TXT_VERSION, "name": name},
        server=f"edgespec-{secrets.token_hex(4)}.local.")


def interfaces_for(settings: WorkerSettings) -> InterfaceChoice | list[str]:
    """Where to answer queries: the interface of the address the worker binds, else every interface."""
    bound = [] if settings.host in ANY else _bound_addresses(settings.host)
    return bound or InterfaceChoice.All


@contextlib.asynccontextmanager
async def announced(settings: WorkerSettings, name: str) -> AsyncIterator[None]:
    """Publish this worker for its lifetime (when announces(settings)); any failure is logged, never fatal.
    Registration (mDNS probing, about a second) runs in the background so as not to hold up start-up."""
    if not announces(settings):
        yield
        return
    addresses, port = announced_endpoint(settings)
    if not addresses or not port:
        log.warning("not announced: no IPv4 address or port to publish (host %r, port %s)", settings.host, port)
        yield
        return
    try:
        zc = AsyncZeroconf(interfaces=interfaces_for(settings), ip_version=IPVersion.V4Only)
    except OSError as exc:
        log.warning("not announced: mDNS is not available here (%s)", exc)
        yield
        return
    info = service_info(name, addresses, port)

    async def register() -> bool:
        try:
            # allow_name_change: another worker of the same name on the LAN (another cluster's) gets " (2)"
            sent = await zc.async_register_service(info, allow_name_change=True)  # probed: the name is ours
            await sent  # the announcements went out
            log.info("announced as %s at %s port %d", info.name, ", ".join(addresses), port)
            return True
        except Exception as exc:  # a worker serves without its announcement rather than not at all
            log.warning("could not announce %s: %s", info.name, exc)
            return False

    task = asyncio.create_task(register())
    try:
        yield
    finally:
        task.cancel()  # still probing: nothing to take back
        await asyncio.wait([task])  # (a cancellation of this lifespan itself still propagates)
        with contextlib.suppress(Exception):
            if not task.cancelled() and task.result():
                # goodbye packets (records with TTL 0): controllers check this worker at once, not at their next look
                await (await zc.async_unregister_service(info))
        with contextlib.suppress(Exception):
            await zc.async_close()
