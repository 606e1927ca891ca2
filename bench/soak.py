"""Load and soak (issue 20, deliverable 4): many concurrent clients against one `edgespec serve` for minutes,
then the server must be as it was: no errors but documented 503s, RSS flat after warm-up, KV memory back to
its idle level, /metrics consistent with what the clients saw.

    python -m edgespec.bench.soak --out bench/results/issue20-soak [--duration-s 120 --streams 32]
        [--local-workers N] [--serve-args "--kv-cache-gib 1"]

It starts the server itself (own process group, stopped whatever happens), warms it up with one request of
each shape and policy, flushes the prefix cache and records the idle baseline (RSS of the controller and its
workers from /proc, KV blocks and bytes from /metrics or the workers' /info). Then --streams clients loop for
--duration-s over a random mix (bench/soak_load.py: chat, Home Assistant tools, json_schema, completions,
responses, long prompts, embeddings; every policy; streamed or not; greedy or sampled; some streams abandoned
mid-way), while RSS and /metrics are sampled every second. After the load it waits for the server to go idle,
flushes the prefix cache again and compares. Writes DIR/results.json (measured values and a pass/fail per
check), DIR/requests.jsonl (every request the soak made and how it ended), DIR/soak.png and DIR/serve.log. A
benchmark, not a CI test: measure alone, the machine's load changes the request rates (the checks do not
depend on them).

Flushing the prefix cache: finished prompts' KV stays in the pool for reuse (engine/prefix.py), so the pool's
used blocks at idle depend on what ran last. To compare like with like the soak flushes it through the API, by
memory pressure: enough concurrent completions that each reserve the whole context (max_tokens: what the
context leaves) and end at their first token (a logit bias on the end token) to exceed the pool, which drops
every kept prefix (engine/sessions.py, Sessions.open); their own sessions are too short to be kept. Then an
idle pool holds nothing, and used blocks must be exactly the baseline's.

The server runs with --kv-prefault: by default a KV pool's pages are committed when first written, so a pool
that reaches a new high water after warm-up grows RSS by up to --kv-cache-gib without leaking anything (the
first soak, before the flag, measured 99.6% of RSS growth that way). With every page written at load, RSS
measures everything else exactly, and the check is on RSS as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from edgespec.bench.soak_load import Mix, Request, new_record, send, stream_loop
from edgespec.workers.cluster import free_port

RSS_LIMIT_PCT = 5.0  # the bar: no RSS growth beyond 5% after warm-up
IDLE_GAUGES = ("edgespec_requests_in_flight", "edgespec_sequences_running", "edgespec_sequences_waiting")
KV_USED, KV_FREE = 'edgespec_kv_pool_blocks{state="used"}', 'edgespec_kv_pool_blocks{state="free"}'


# ---------------------------------------------------------------- processes


class Server:
    """`edgespec serve` in a process group of its own (its local workers inherit it), so that stop() ends every
    process it started, whatever state they are in."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "edgespec.server.cli", "serve", "--port", str(self.port), *args]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        """Start and wait for /health; returns the seconds it took."""
        began = time.monotonic()
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while time.monotonic() - began < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"edgespec serve exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"edgespec serve not healthy in {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> dict:
        """SIGTERM to the group, SIGKILL to what is left after 30 s; how it went."""
        if self.proc is None:
            return {"started": False}
        group = self.proc.pid  # start_new_session: the group's id is the leader's pid
        result = {"exit_code": self.proc.poll(), "needed_sigkill": False}
        began = time.monotonic()
        if result["exit_code"] is None:
            _signal_group(group, signal.SIGTERM)
            try:
                result["exit_code"] = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                result["needed_sigkill"] = True
        result["stop_s"] = round(time.monotonic() - began, 2)
        left = _group_members(group)
        if left or result["needed_sigkill"]:  # workers that outlived the controller, or a controller that hung
            result["left_after_sigterm"] = len(left)
            _signal_group(group, signal.SIGKILL)
            self.proc.wait(15)
        return result


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # the fields after the command name: state, ppid, pgrp, ...


def _group_members(group: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[2]) == group \
                and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def descendants(root: int) -> list[int]:
    """The processes below `root` (its local workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process, from /proc/PID/status (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_workers(root: int) -> dict[str, dict]:
    """The controller's `edgespec worker` children by name: pid, and the URL and token of their /info. The token
    is the one the controller made for the workers it started and handed them on their command line."""
    found = {}
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "worker" not in argv:
            continue
        opt = {}  # --name VALUE and --name=VALUE alike
        for i, arg in enumerate(argv):
            if arg.startswith("--") and "=" in arg:
                opt.setdefault(*arg.split("=", 1))
            elif arg.startswith("--") and i + 1 < len(argv):
                opt.setdefault(arg, argv[i + 1])
        if "--port" not in opt:
            continue
        found[opt.get("--name", f"worker-{pid}")] = {"pid": pid, "url": f"http://127.0.0.1:{opt['--port']}",
                                                      "token": opt.get("--token", "")}
    return found


def rss_now(server: Server, workers: dict[str, dict]) -> dict[str, int]:
    """RSS of the controller and each worker, bytes."""
    out = {"controller": rss_bytes(server.proc.pid)}
    out |= {name: rss_bytes(w["pid"]) for name, w in workers.items()}
    return {k: v for k, v in out.items() if v is not None}


# ---------------------------------------------------------------- metrics


def parse_metrics(text: str) -> tuple[dict[str, float], set[str]]:
    """Prometheus text -> {sample with labels: value}, and the samples that may only grow: counters, histogram
    buckets, counts and sums, and the gauges server/metrics.py documents as counted "since start"."""
    values, growing = {}, set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue  # a timestamp, not a measurement
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            values[key] = s.value
            if family.type in ("counter", "histogram") or "since start" in family.documentation:
                growing.add(key)
    return values, growing


async def scrape(client: httpx.AsyncClient) -> tuple[dict[str, float], set[str]]:
    r = await client.get("/metrics")
    r.raise_for_status()
    return parse_metrics(r.text)


async def worker_kv(client: httpx.AsyncClient, workers: dict[str, dict]) -> dict[str, dict]:
    """Each worker's KV pool and sessions, from its /info."""
    out = {}
    for name, w in workers.items():
        info = (await client.get(w["url"] + "/info", headers={"authorization": f"Bearer {w['token']}"})).json()
        mem = info["memory"]
        out[name] = {"used_blocks": mem["kv_blocks"]["used"], "free_blocks": mem["kv_blocks"]["free"],
                     "kv_bytes": mem["kv_bytes"], "sessions": info["sessions"]}
    return out


async def kv_state(client: httpx.AsyncClient, workers: dict[str, dict]) -> dict:
    """The KV pool as /metrics reports it (in-process stages), or as each worker's /info does."""
    values, _ = await scrape(client)
    state = {"used_blocks": values.get(KV_USED, 0), "free_blocks": values.get(KV_FREE, 0),
             "kv_cache_bytes": values.get("edgespec_kv_cache_bytes", 0),
             "prefix_cache_bytes": values.get("edgespec_prefix_cache_bytes", 0)}
    state |= {name.removeprefix("edgespec_"): values.get(name, 0) for name in IDLE_GAUGES}
    if workers:
        state["workers"] = await worker_kv(client, workers)
        state["used_blocks"] = sum(w["used_blocks"] for w in state["workers"].values())
        state["free_blocks"] = sum(w["free_blocks"] for w in state["workers"].values())
    return state


async def wait_idle(client: httpx.AsyncClient, timeout_s: float) -> float | None:
    """Seconds until nothing runs, waits or is in flight; None if that did not happen within timeout_s."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        values, _ = await scrape(client)
        if all(values.get(name, 0) == 0 for name in IDLE_GAUGES):
            return round(time.monotonic() - began, 2)
        await asyncio.sleep(0.5)
    return None


class Sampler:
    """RSS every second (from /proc, whatever the server is doing) and /metrics every second (a scrape waits
    for the server's event loop: its latency is recorded too)."""

    def __init__(self, server: Server, workers: dict[str, dict], t0: float):
        self.server, self.workers, self.t0 = server, workers, t0
        self.rss: list[dict] = []
        self.metrics: list[dict] = []
        self.growing: set[str] = set()
        self.stopped = asyncio.Event()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def run(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(self._rss(), self._metrics(client))

    async def _rss(self) -> None:
        while not self.stopped.is_set():
            self.rss.append({"t": self.now(), **rss_now(self.server, self.workers)})
            await self._pause(1.0)

    async def _metrics(self, client: httpx.AsyncClient) -> None:
        while not self.stopped.is_set():
            began = time.monotonic()
            try:
                values, growing = await scrape(client)
                scraped = time.monotonic() - began
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                self.metrics.append({"t": self.now(), "error": f"{type(exc).__name__}: {exc}"})
            else:
                self.growing |= growing
                self.metrics.append({"t": self.now(), "scrape_s": round(scraped, 3), "values": values})
            await self._pause(max(0.0, 1.0 - (time.monotonic() - began)))

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopped.wait(), seconds)


# ---------------------------------------------------------------- phases


async def warm_up(client: httpx.AsyncClient, mix: Mix, t0: float, ledger: list[dict]) -> dict:
    """One request per policy and per shape, streamed and not, so that whatever loads on first use (drafters,
    Medusa heads, grammars, the router) has loaded before the baseline; and one long prompt, whose usage sets
    the characters per token of the long prompts."""
    rng = random.Random("warm-up")
    requests = []
    for i, policy in enumerate(mix.policies):
        req = mix.build("chat", rng, stream=bool(i % 2))
        req.body |= {"decoding": policy, "max_tokens": 8}
        req.policy = policy
        requests.append(req)
    for i, kind in enumerate(("tools", "json", "completions", "responses", "embeddings")):
        requests.append(mix.build(kind, rng, stream=bool(i % 2)))
    began = time.monotonic()
    for req in requests:
        req.disconnect_after = None
        ledger.append(await send(client, req, t0))
    long = mix.build("long", rng, stream=False)
    long.body["max_tokens"] = 1
    rec = await send(client, long, t0)
    ledger.append(rec)
    if rec["outcome"] == "ok" and rec["prompt_tokens"]:
        mix.chars_per_token = len(long.body["messages"][0]["content"]) / rec["prompt_tokens"]
    return {"requests": len(requests) + 1, "seconds": round(time.monotonic() - began, 1),
            "chars_per_token": round(mix.chars_per_token, 3),
            "errors": sum(r["outcome"] == "error" for r in ledger)}


def eos_token_id(model: str | None) -> int:
    """The served model's end-of-sequence token (its config.json), for the flush's one-token completions."""
    from edgespec.model.source import resolve_model

    config = json.loads((resolve_model(model).folder / "config.json").read_text())
    eos = config["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


async def flush_prefixes(client: httpx.AsyncClient, body: dict, concurrent: int, t0: float, ledger: list[dict],
                         attempts: int = 5) -> dict:
    """Drop every kept prefix by memory pressure (see the module's docstring): `concurrent` completions at once
    that reserve the whole context each and end at their first token; again while the prefix cache holds any.
    The server opens them as their requests arrive, and the first may be done before the last is read: three
    times the pool's worth makes enough of them hold their blocks at once."""
    for attempt in range(1, attempts + 1):
        recs = await asyncio.gather(*(send(client, Request("flush", "/v1/completions", dict(body), "naive"), t0)
                                      for _ in range(concurrent)))
        ledger.extend(recs)
        await wait_idle(client, 60)
        values, _ = await scrape(client)
        if values.get("edgespec_prefix_cache_bytes", 0) == 0:
            return {"flushed": True, "attempts": attempt, "requests_each": concurrent}
    return {"flushed": False, "attempts": attempts, "requests_each": concurrent}


def write_requests(out: Path, ledger: list[dict]) -> None:
    """Every request's record, to look into what failed or lagged."""
    with (out / "requests.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ledger)


def pool_size(state: dict) -> float:
    """Blocks of the smallest KV pool, read at start (nothing is used or reserved yet)."""
    if state.get("workers"):
        return min(w["used_blocks"] + w["free_blocks"] for w in state["workers"].values())
    return state["used_blocks"] + state["free_blocks"]


async def soak(args, server: Server, out: Path) -> dict:
    """Every phase against the running server; the results with their checks."""
    from edgespec.bench import soak_checks as checks
    from edgespec.model.kv_pool import BLOCK_SLOTS

    t0 = time.monotonic()
    ledger: list[dict] = []  # every /v1 request the soak made, for the comparison with /metrics
    timeout = httpx.Timeout(args.request_timeout_s, connect=30)
    async with httpx.AsyncClient(base_url=server.url, timeout=timeout) as client, \
            httpx.AsyncClient(base_url=server.url, timeout=30) as probe:
        r = await client.get("/v1/models")
        ledger.append(new_record(Request("models", "/v1/models", {}), t0) | {
            "status": r.status_code, "outcome": "ok" if r.status_code == 200 else "error", "t_end": 0})
        card = r.json()["data"][0]
        policies = tuple(p for p in args.policies.split(",") if p)
        if missing := set(policies) - set(card["policies"]):
            raise SystemExit(f"the server has no policy {sorted(missing)} (it has {card['policies']})")
        workers = local_workers(server.proc.pid)
        start = await kv_state(probe, workers)
        pool = pool_size(start)
        mix = Mix.load(card["id"], policies, max_tokens=tuple(args.max_tokens), disconnect_p=args.disconnect_p,
                       long_tokens=tuple(args.long_tokens))
        flush_body = {"model": card["id"], "prompt": "Hi", "temperature": 0, "decoding": "naive", "max_tokens": 1,
                      "logit_bias": {str(eos_token_id(args.model)): 100}}  # its first token ends it
        probe_rec = await send(client, Request("flush", "/v1/completions", dict(flush_body), "naive"), t0)
        ledger.append(probe_rec)
        # as many tokens as the context leaves: the request reserves the whole context (completions default to 16)
        flush_body["max_tokens"] = card["context_length"] - (probe_rec["prompt_tokens"] or 1)
        concurrent = 3 * math.ceil(pool / math.ceil(card["context_length"] / BLOCK_SLOTS)) + 1 if pool else 24
        sampler = Sampler(server, workers, t0)
        sampling = asyncio.create_task(sampler.run(probe))
        phases: dict = {}
        try:
            phases["warm_up"] = await warm_up(client, mix, t0, ledger)
            flushes = {"idle": await flush_prefixes(client, flush_body, concurrent, t0, ledger)}
            idle = await kv_state(probe, workers)
            idle_rss = rss_now(server, workers)
            print(f"idle: {idle} rss {idle_rss}; load {args.streams} streams x {args.duration_s:g} s", flush=True)
            load: list[dict] = []
            load_start = time.monotonic() - t0
            stop_at = time.monotonic() + args.duration_s
            await asyncio.gather(*(stream_loop(server.url, mix, random.Random(f"{args.seed}:{i}"), stop_at, t0,
                                               args.request_timeout_s, load) for i in range(args.streams)))
            load_end = time.monotonic() - t0
            ledger += load
            write_requests(out, ledger)
            if server.proc.poll() is not None:
                raise RuntimeError(f"edgespec serve exited with {server.proc.returncode} during the load; see "
                                   f"{server.log} and {out / 'requests.jsonl'}")
            idle_after_s = await wait_idle(probe, args.idle_timeout_s)
            before_flush = await kv_state(probe, workers)
            flushes["after"] = await flush_prefixes(client, flush_body, concurrent, t0, ledger)
            after = await kv_state(probe, workers)
            after_rss = rss_now(server, workers)
            await asyncio.sleep(1.5)  # one more RSS sample after the flush
            final, _ = await scrape(probe)
        finally:
            sampler.stopped.set()
            await sampling
    # kv_cache_full is documented for a request that could not fit even an idle server: every request here
    # fits the context, so when the context fits the pool it is no such request
    if pool and math.ceil(card["context_length"] / BLOCK_SLOTS) <= pool:
        for r in ledger:
            if r["outcome"] == "busy" and r["code"] == "kv_cache_full":
                r.update(outcome="error", detail=f"a request that fits the idle pool ({pool:g} blocks): {r['detail']}")
    max_waiting = int(args.serve_args[args.serve_args.index("--max-waiting") + 1]) \
        if "--max-waiting" in args.serve_args else 64  # the README's default
    results = {
        "checks": {
            "no_errors_but_documented_503": checks.errors_check(ledger),
            "rss_growth_after_warmup": checks.rss_check(sampler.rss, load_start, args.warmup_s, RSS_LIMIT_PCT),
            "kv_back_to_idle": checks.kv_check(idle, before_flush, after, flushes, pool),
            "metrics_consistent": checks.metrics_check(ledger, sampler.metrics, sampler.growing, final, pool,
                                                       max_waiting),
            "back_to_idle_after_load": {"pass": idle_after_s is not None, "seconds": idle_after_s,
                                        "timeout_s": args.idle_timeout_s},
            "no_tracebacks_in_server_log": checks.log_check(server.log),
        },
        "summary": checks.summary(load, load_end - load_start, args.streams),
        "phases": phases | {"load_start_s": round(load_start, 2), "load_end_s": round(load_end, 2)},
        "rss_mib": {"idle": {k: round(v / 2**20, 1) for k, v in idle_rss.items()},
                    "after": {k: round(v / 2**20, 1) for k, v in after_rss.items()}},
        "model": card["id"], "context_length": card["context_length"],
    }
    results["timeline"] = checks.timeline(load, sampler.rss, sampler.metrics, load_start)
    write_requests(out, ledger)
    checks.plot(out / "soak.png", results["timeline"], load_end - load_start, args.warmup_s,
                f"{card['id']}: {args.streams} streams x {args.duration_s:g} s, mixed policies and shapes")
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--duration-s", type=float, default=120)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--warmup-s", type=float, default=30, help="the load's first seconds, before RSS is compared")
    ap.add_argument("--local-workers", type=int, default=0, help="serve through N local worker processes")
    ap.add_argument("--model", help="model to serve (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--policies", default="naive,speculative,medusa,outline,auto")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    ap.add_argument("--long-tokens", type=int, nargs=2, default=[1000, 2000], metavar=("MIN", "MAX"),
                    help="length of the long prompts, tokens")
    ap.add_argument("--disconnect-p", type=float, default=0.2, help="share of streams the client abandons")
    ap.add_argument("--request-timeout-s", type=float, default=900,
                    help="the longest wait for a byte of an answer: longer is a hang, counted as an error (a stream "
                         "gets a ping every 15 s)")
    ap.add_argument("--idle-timeout-s", type=float, default=120, help="how long the server may take to go idle")
    ap.add_argument("--start-timeout-s", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", type=shlex.split, default=[], help="more `edgespec serve` options, quoted")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    serve = ["--log-level", "warning", "--kv-prefault", *(["--model", args.model] if args.model else []),
             *(["--local-workers", str(args.local_workers)] if args.local_workers else []), *args.serve_args]
    server = Server(serve, args.out / "serve.log")
    # a SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the finally below still stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        started_s = server.start(args.start_timeout_s)
        print(f"serving at {server.url} after {started_s:.0f} s", flush=True)
        results = asyncio.run(soak(args, server, args.out))
    finally:
        stopped = server.stop()
    results = {"pass": all(c["pass"] for c in results["checks"].values()), **results,
               "server": {"argv": server.argv[3:], "start_s": round(started_s, 1), "stop": stopped},
               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": {"cpus": os.cpu_count(), "load_average_1m_at_end": os.getloadavg()[0]}}
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    for name, check in results["checks"].items():
        print(f"{'PASS' if check['pass'] else 'FAIL'}  {name}")
    print(json.dumps(results["summary"], indent=1))
    print(f"{'PASS' if results['pass'] else 'FAIL'}; wrote {args.out / 'results.json'} and soak.png")


if __name__ == "__main__":
    main()
