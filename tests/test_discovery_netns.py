"""Zero-config discovery on an emulated LAN: three workers (and a stranger with another token), each in a network
namespace of its own on a bridge (bench/netem.py's Lan), and a controller with `serve --discover` and no cluster
file in another. The controller forms a cluster of the three, refuses the stranger, serves a chat completion;
then one worker is stopped (SIGTERM: its service says goodbye) and the controller re-plans over the two left at
once, long before its next check, and serves the same greedy answer. A controller that finds no worker at start
serves in-process, and plans in the first worker found later. Needs root and `ip netns`."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time

import httpx
import pytest
from processes import greedy
from test_replanning import layers, replans, wait_for, write_profile

from edgespec.bench.netem import Lan, sh, spawn, stop

pytestmark = pytest.mark.slow

PREFIX, SUBNET = "esdisc", "10.232.0"  # apart from bench/netem's own runs (es-*, 10.231.0)
ROOT_IP = f"{SUBNET}.2"
PORT = 9100
PROMPT = "Name three rivers."


def netns_refusal() -> str | None:
    """Why this test cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    try:
        probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return "no `ip` command"
    if probe.returncode != 0:
        return f"`ip netns` is not available or not permitted here: {probe.stderr.strip()}"
    sh("ip", "netns", "del", f"{PREFIX}-probe", check=False)
    return None


def wait_up(url: str, procs: dict, logs: dict, headers: dict | None = None, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{logs[name].read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not healthy in {timeout_s} s")
        time.sleep(0.5)


def test_discovered_cluster_forms_serves_and_replans(tiny, tmp_path, monkeypatch):
    why = netns_refusal()
    if why:
        pytest.skip(why)
    token = secrets.token_urlsafe(16)
    workers = ["w0", "w1", "w2"]
    lan = Lan(["ctl", *workers, "stranger"], "1gbit", 0, prefix=PREFIX, subnet=SUBNET)
    procs: dict[str, subprocess.Popen] = {}
    logs = {d: tmp_path / f"{d}.log" for d in lan.devices}
    lan.down()  # what a run that was killed left behind
    try:
        lan.up()
        lan.join_root(ROOT_IP)  # this process reaches every device through the bridge
        for d in [*workers, "stranger"]:
            secret = token if d != "stranger" else secrets.token_urlsafe(16)
            # binding a LAN address: the worker announces itself by default
            procs[d] = spawn(lan.ns(d), ["worker", "--host", lan.ip(d), "--port", str(PORT), f"--token={secret}",
                                         "--name", d, "--threads", "1", "--model", tiny, "--log-level", "info"],
                             logs[d])
        for d in [*workers, "stranger"]:
            wait_up(f"http://{lan.ip(d)}:{PORT}", procs, logs)
        # equal speeds, room for every layer anywhere: an even split uses all three workers, then the two left
        profile = write_profile(tmp_path / "profile.json", tiny, dict.fromkeys(workers, 2**30))
        monkeypatch.setenv("EDGESPEC_CLUSTER_TOKEN", token)  # the environment, not the process list
        procs["ctl"] = spawn(lan.ns("ctl"), [
            "serve", "--host", lan.ip("ctl"), "--port", "8000", "--model", tiny, "--discover",
            "--discover-workers", "3", "--discover-wait-s", "120", "--profile", str(profile), "--placement", "even",
            "--plan-context", "256", "--plan-concurrency", "1", "--monitor-interval-s", "60",
            "--log-level", "info"], logs["ctl"])
        url = f"http://{lan.ip('ctl')}:8000"
        wait_up(url, procs, logs)

        assert sorted(layers(url)) == workers, logs["ctl"].read_text()[-4000:]
        wait_for(lambda: "refused the service stranger" in logs["ctl"].read_text(), what="the stranger refused")
        first = greedy(url, PROMPT, 16)
        assert first

        procs["w1"].send_signal(signal.SIGTERM)  # its lifespan unregisters the service: a goodbye on the LAN
        procs["w1"].wait(30)
        left = time.monotonic()
        # the next check would come only in 60 s: a re-plan within a few seconds is the departure's doing
        wait_for(lambda: replans(url, "worker_lost") >= 1, timeout_s=20, what="a re-plan after the departure")
        assert time.monotonic() - left < 20
        assert sorted(layers(url)) == ["w0", "w2"]
        assert "worker w1 left the LAN" in logs["ctl"].read_text()
        assert greedy(url, PROMPT, 16) == first
    finally:
        stop([procs.pop("ctl")] if "ctl" in procs else [])  # first: workers leaving would make it re-plan
        stop(list(procs.values()))
        lan.down()


def test_no_worker_at_start_serves_in_process_until_one_is_found(tiny, tmp_path, monkeypatch):
    why = netns_refusal()
    if why:
        pytest.skip(why)
    token = secrets.token_urlsafe(16)
    lan = Lan(["ctl", "w0"], "1gbit", 0, prefix=PREFIX, subnet=SUBNET)
    procs: dict[str, subprocess.Popen] = {}
    logs = {d: tmp_path / f"{d}.log" for d in lan.devices}
    lan.down()
    try:
        lan.up()
        lan.join_root(ROOT_IP)
        profile = write_profile(tmp_path / "profile.json", tiny, {"w0": 2**30})
        monkeypatch.setenv("EDGESPEC_CLUSTER_TOKEN", token)
        procs["ctl"] = spawn(lan.ns("ctl"), [
            "serve", "--host", lan.ip("ctl"), "--port", "8000", "--model", tiny, "--discover", "--discover-wait-s",
            "1", "--profile", str(profile), "--monitor-interval-s", "60", "--log-level", "info"], logs["ctl"])
        url = f"http://{lan.ip('ctl')}:8000"
        wait_up(url, procs, logs)
        assert layers(url) == {}  # every layer here
        alone = greedy(url, PROMPT, 16)
        procs["w0"] = spawn(lan.ns("w0"), ["worker", "--host", lan.ip("w0"), "--port", str(PORT), f"--token={token}",
                                           "--name", "w0", "--threads", "1", "--model", tiny], logs["w0"])
        # found, profiled and planned in without waiting for the next check (60 s)
        wait_for(lambda: replans(url, "worker_joined") >= 1, timeout_s=120, what="the found worker planned in")
        assert layers(url) == {"w0": [0, 4]}
        assert greedy(url, PROMPT, 16) == alone
    finally:
        stop([procs.pop("ctl")] if "ctl" in procs else [])
        stop(list(procs.values()))
        lan.down()
