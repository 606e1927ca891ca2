"""Emulated home network for benchmarks: every device (controller and workers) in its own Linux network
namespace, joined through a bridge by veth links shaped with `tc` (tbf for the rate; netem for a delay
where the kernel has it). Starts the workers and the controller inside, runs `edgespec bench` per rate,
and always tears everything down.

    python -m bench.netem --workers 2 --rates 100mbit,1gbit --prompts FILE --max-tokens 64 --out DIR

Needs root (ip netns). Where namespaces are not permitted it says so and exits 0 without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from edgespec.bench.plot import bar_chart

PREFIX = "es"  # namespace and link names: es-lan, es-ctl, es-w0, ...
SUBNET = "10.231.0"
PORT = 9100


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True)


class Lan:
    """A bridge namespace plus one namespace per device, each linked by a shaped veth pair. `prefix` names the
    namespaces (PREFIX-lan, PREFIX-DEVICE), so that two Lans can exist at once; `subnet` is their /24."""

    def __init__(self, devices: list[str], rate: str, delay_ms: float, prefix: str = PREFIX, subnet: str = SUBNET):
        self.devices, self.rate, self.delay_ms, self.prefix, self.subnet = devices, rate, delay_ms, prefix, subnet
        self.namespaces = [f"{prefix}-lan"] + [self.ns(d) for d in devices]
        self.notes: list[str] = []

    def ns(self, device: str) -> str:
        return f"{self.prefix}-{device}"

    def ip(self, device: str) -> str:
        return f"{self.subnet}.{10 + self.devices.index(device)}"

    def up(self) -> None:
        lan = f"{self.prefix}-lan"
        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=lan)
        sh("ip", "link", "set", "br0", "up", ns=lan)
        for d in self.devices:
            ns, outer = self.ns(d), f"b-{d}"
            sh("ip", "link", "add", "eth0", "type", "veth", "peer", "name", outer, ns=ns)
            sh("ip", "link", "set", outer, "netns", lan, ns=ns)
            sh("ip", "addr", "add", f"{self.ip(d)}/24", "dev", "eth0", ns=ns)
            sh("ip", "link", "set", "eth0", "up", ns=ns)
            sh("ip", "link", "set", outer, "master", "br0", ns=lan)
            sh("ip", "link", "set", outer, "up", ns=lan)
            # shape both directions of the device's link
            self._shape("eth0", ns)
            self._shape(outer, lan)

    def _shape(self, dev: str, ns: str | None) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", "32kbit", "latency", "50ms"]
        if self.delay_ms:
            r = sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms",
                   ns=ns, check=False)
            if r.returncode == 0:
                sh("tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf, ns=ns)
                return
            note = f"no delay: this kernel has no netem qdisc ({r.stderr.strip()})"
            if note not in self.notes:
                self.notes.append(note)
        sh("tc", "qdisc", "add", "dev", dev, "root", *tbf, ns=ns)

    def join_root(self, address: str, shaped: bool = False) -> None:
        """A veth from the calling (root) namespace to the bridge, at `address` in the subnet (devices are .10 and
        up), so that this process reaches the devices directly; `shaped`: both its directions shaped as a
        device's link (the root namespace is then one more device, e.g. the controller); down() removes it."""
        host, bridge = f"{self.prefix}-host", f"{self.prefix}-br"
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", bridge)
        sh("ip", "link", "set", bridge, "netns", f"{self.prefix}-lan")
        sh("ip", "link", "set", bridge, "master", "br0", ns=f"{self.prefix}-lan")
        sh("ip", "link", "set", bridge, "up", ns=f"{self.prefix}-lan")
        sh("ip", "addr", "add", f"{address}/24", "dev", host)
        sh("ip", "link", "set", host, "up")
        if shaped:
            self._shape(host, None)
            self._shape(bridge, f"{self.prefix}-lan")

    def down(self) -> None:
        sh("ip", "link", "del", f"{self.prefix}-host", check=False)  # join_root's; gone with the bridge anyway
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)


def spawn(ns: str, args: list[str], log: Path, cpus: set[int] | None = None) -> subprocess.Popen:
    """`edgespec ARGS` inside namespace `ns` (pinned to `cpus` if given), in a session of its own for stop()."""
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "edgespec.server.cli", *args]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def wait_health(ns: str, url: str, timeout_s: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = sh(sys.executable, "-c", f"import httpx,sys; sys.exit(httpx.get('{url}/health').status_code != 200)",
               ns=ns, check=False)
        if r.returncode == 0:
            return
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited during start-up; see the logs in the output folder")
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def netns_problem(prefix: str = PREFIX) -> str | None:
    """Why network namespaces cannot be made here (ip's message), or None where they can."""
    try:
        probe = subprocess.run(["ip", "netns", "add", f"{prefix}-probe"], capture_output=True, text=True,
                               check=False)
    except FileNotFoundError:
        return "no `ip` command"
    if probe.returncode != 0:
        return probe.stderr.strip() or f"ip netns add exited {probe.returncode}"
    subprocess.run(["ip", "netns", "del", f"{prefix}-probe"], capture_output=True, check=False)
    return None


def run_rate(args, rate: str, out: Path) -> dict:
    devices = ["ctl"] + [f"w{i}" for i in range(args.workers)]
    lan = Lan(devices, rate, args.delay_ms)
    procs: list[subprocess.Popen] = []
    token = secrets.token_urlsafe(16)
    try:
        lan.up()
        cluster = out / f"cluster-{rate}.toml"
        lines = [f'token = "{token}"']
        for i in range(args.workers):
            d = f"w{i}"
            lines += ["[[workers]]", f'url = "http://{lan.ip(d)}:{PORT}"', f'name = "{d}"']
            procs.append(spawn(f"{PREFIX}-{d}", ["worker", "--host", lan.ip(d), "--port", str(PORT), f"--token={token}",
                                                 "--name", d], out / f"{d}-{rate}.log"))
        cluster.write_text("\n".join(lines) + "\n")
        procs.append(spawn(f"{PREFIX}-ctl", ["serve", "--host", lan.ip("ctl"), "--port", "8000", "--cluster",
                                             str(cluster), "--dtype", args.dtype, "--log-level", "warning"],
                           out / f"ctl-{rate}.log"))
        url = f"http://{lan.ip('ctl')}:8000"
        wait_health(f"{PREFIX}-ctl", url, 300, procs)
        bench_out = out / rate
        sh(sys.executable, "-m", "edgespec.server.cli", "bench", "--url", url, "--prompts", args.prompts, "--policies",
           "naive", "--max-tokens", str(args.max_tokens), "--out", str(bench_out),
           *(["--limit", str(args.limit)] if args.limit else []), ns=f"{PREFIX}-ctl")
        result = json.loads((bench_out / "results.json").read_text())["policies"]["naive"]
        return {"rate": rate, "delay_ms": args.delay_ms, "notes": lan.notes, **result}
    finally:
        stop(procs)
        lan.down()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--limit", type=int)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    problem = netns_problem(PREFIX)
    if problem:
        print(f"skipped: network namespaces are not permitted here ({problem})")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_rate(args, rate, out) for rate in args.rates.split(",")]
    base = rows[-1]["median_decode_tokens_per_s"]
    for row in rows:
        rate = row["median_decode_tokens_per_s"]
        row["ms_per_token"] = round(1000 / rate, 3) if rate else None
        row["latency_ratio_to_last"] = round(base / rate, 4) if rate and base else None
    (out / "netem.json").write_text(json.dumps(rows, indent=2))
    bar_chart(out / "netem.png", f"{args.workers} workers, each link shaped in both directions", [
        ("median ms per decoded token", [r["rate"] for r in rows], [r["ms_per_token"] or 0 for r in rows])])
    for row in rows:
        print(f"{row['rate']:>8}: {row['median_decode_tokens_per_s']} tok/s, {row['ms_per_token']} ms/token, "
              f"latency x{row['latency_ratio_to_last']} of {rows[-1]['rate']} {' '.join(row['notes'])}")


if __name__ == "__main__":
    main()
