"""The fault benchmark's workers in Linux network namespaces (`python -m edgespec.bench.faults --netem`).

bench/netem.py's Lan puts the controller and each worker in a namespace of its own behind a shaped veth link
(tbf at a rate; netem's delay where the kernel has the netem qdisc); here netem's loss is added to the same
qdisc, and one more veth joins the benchmark's own (root) namespace to the bridge, so that the client and
the /health polls reach the controller directly. Workers are named in a cluster file: the controller does not
start a killed one again, so the benchmark does, on the same address, once the faulted stream has ended.
Needs root; where namespaces are not permitted, netns_refusal() says why and nothing is measured.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import tempfile
from pathlib import Path

from edgespec.bench.faults import serve_options, wait_ready
from edgespec.bench.netem import PORT, PREFIX, SUBNET, Lan, sh, spawn, stop

HOST_IP = f"{SUBNET}.2"  # the benchmark's end of its link to the bridge (devices are .10 and up)
HOST_LINK, BRIDGE_LINK = f"{PREFIX}-fhost", f"{PREFIX}-fbr"


def netns_refusal() -> str | None:
    """Why namespaces cannot be used here (None: they can)."""
    if sh("ip", "netns", "list").stdout.strip().startswith(f"{PREFIX}-"):
        return f"namespaces named {PREFIX}-* exist already (another bench/netem run?)"
    probe = sh("ip", "netns", "add", f"{PREFIX}-probe", check=False)
    if probe.returncode != 0:
        return f"network namespaces are not permitted here ({probe.stderr.strip()})"
    sh("ip", "netns", "del", f"{PREFIX}-probe", check=False)
    return None


class NetemCluster:
    """A controller and N workers, each in its own namespace, joined by shaped links; a cluster file."""

    setting = "netem"

    def __init__(self, workers: int, args, out: Path):
        self.workers, self.args, self.out = workers, args, out
        self.devices = ["ctl"] + [f"w{i}" for i in range(workers)]
        self.lan: Lan | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.token = secrets.token_urlsafe(16)
        self.url = ""
        self.starts = 0
        self.lives: dict[str, int] = {}  # processes started per worker (in this cluster's start)
        self.cluster_file: Path | None = None
        self.notes: list[str] = []

    def start(self) -> dict:
        self.starts += 1
        self.lives = {}
        self.lan = Lan(self.devices, self.args.netem_rate, self.args.netem_delay_ms)
        self.lan.up()
        self._add_loss()
        self._link_host()
        lines = [f'token = "{self.token}"']
        for d in self.devices[1:]:
            lines += ["[[workers]]", f'url = "http://{self.lan.ip(d)}:{PORT}"', f'name = "{d}"']
            self._spawn_worker(d)
        # the file holds the cluster's token: kept out of the results folder, removed by stop()
        fd, name = tempfile.mkstemp(prefix="faults-cluster-", suffix=".toml")
        os.close(fd)
        self.cluster_file = Path(name)
        self.cluster_file.write_text("\n".join(lines) + "\n")
        for d in self.devices[1:]:
            wait_ready(f"http://{self.lan.ip(d)}:{PORT}", list(self.procs.values()), self._log(d), 300)
        self.procs["ctl"] = spawn(f"{PREFIX}-ctl", ["serve", "--host", self.lan.ip("ctl"), "--port", "8000",
                                                   "--cluster", str(self.cluster_file), *serve_options(self.args)],
                                  self._log("ctl"))
        self.url = f"http://{self.lan.ip('ctl')}:8000"
        self.notes += [n for n in self.lan.notes if n not in self.notes]
        return wait_ready(self.url, list(self.procs.values()), self._log("ctl"), self.args.start_timeout_s)

    def _log(self, device: str) -> Path:
        # one file per process: a worker started again after a kill gets the next one (netem.spawn truncates)
        return self.out / "logs" / f"netem-{self.starts}-{device}-{self.lives.get(device, 0)}.log"

    def _spawn_worker(self, device: str) -> None:
        self.lives[device] = self.lives.get(device, 0) + 1
        self.procs[device] = spawn(f"{PREFIX}-{device}", [
            "worker", "--host", self.lan.ip(device), "--port", str(PORT), f"--token={self.token}", "--name", device],
            self._log(device))

    def _add_loss(self) -> None:
        # Lan puts netem (delay) at the root of each link's qdisc where the kernel has it; loss goes on the same
        # qdisc. Without netem (its note says so) the links are shaped by rate only.
        if not self.args.netem_loss_pct:
            return
        if not self.args.netem_delay_ms or self.lan.notes:
            note = f"no loss: netem is not in use on these links ({'; '.join(self.lan.notes) or 'no delay asked'})"
            if note not in self.notes:
                self.notes.append(note)
            return
        netem = ["netem", "delay", f"{self.args.netem_delay_ms}ms", "loss", f"{self.args.netem_loss_pct}%"]
        for d in self.devices:
            sh("tc", "qdisc", "change", "dev", "eth0", "root", "handle", "1:", *netem, ns=f"{PREFIX}-{d}")
            sh("tc", "qdisc", "change", "dev", f"b-{d}", "root", "handle", "1:", *netem, ns=f"{PREFIX}-lan")

    def _link_host(self) -> None:
        # an unshaped veth from the benchmark's namespace to the bridge: the client is not one of the devices
        lan = f"{PREFIX}-lan"
        sh("ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", BRIDGE_LINK)
        sh("ip", "link", "set", BRIDGE_LINK, "netns", lan)
        sh("ip", "link", "set", BRIDGE_LINK, "master", "br0", ns=lan)
        sh("ip", "link", "set", BRIDGE_LINK, "up", ns=lan)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_LINK)
        sh("ip", "link", "set", HOST_LINK, "up")

    def pid(self, worker: dict) -> int:
        """The worker process we started for a /health entry (`ip netns exec` execs it: the same pid)."""
        return self.procs[worker["name"]].pid

    def release(self, worker: dict, pid: int, fault: str) -> None:
        """After the faulted stream: continue a stopped worker; start a killed one again on its address."""
        if fault == "sigstop":
            self.procs[worker["name"]].send_signal(signal.SIGCONT)
            return
        self.procs[worker["name"]].wait(10)
        self._spawn_worker(worker["name"])

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped worker acts on SIGTERM only once continued
        stop(list(self.procs.values()))
        self.procs = {}
        if self.cluster_file is not None:
            self.cluster_file.unlink(missing_ok=True)
            self.cluster_file = None
        if self.lan is not None:
            sh("ip", "link", "del", HOST_LINK, check=False)  # gone with the bridge's namespace anyway
            self.lan.down()
            self.lan = None

