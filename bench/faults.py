"""A stream survives a lost worker (issue 20, deliverable 2): streams with a worker killed (SIGKILL) or hung
(SIGSTOP) at a random point, against the same streams without the fault.

    python -m edgespec.bench.faults --out bench/results/issue20-faults [--workers 2,3]
        [--policies naive,speculative,medusa] [--prompts FILE --limit 3] [--max-tokens 64] [--netem | --no-local]

For each worker count N it starts `edgespec serve --local-workers N --stage-timeout-s 5 --monitor-interval-s
0.5 --log-level info` (own process group, stopped whatever happens; its log under DIR/logs). First every
(policy, prompt) is streamed greedy without a fault (the reference text). Then, per (policy, prompt), the
same request is streamed twice more: once a random worker of the placement (the controller's /health) gets
SIGKILL after a random number of streamed chunks (2 .. 3/4 of the reference's), once a random worker gets
SIGSTOP the same way and SIGCONT when the stream has ended. Each case records whether the stream completed
(ended with [DONE], no error event), whether its text equals the reference, the longest gap between chunks
(the stall around the fault), when the worker left the placement, and how long it took to be back in it (from
its return: the kill for a local worker, which the controller starts again itself; SIGCONT for a stopped one)
before the next case runs. A worker that is not back in time is recorded so and the cluster is started anew.
A case whose text differs is streamed once more without a fault once the worker is back (`control_same_text`:
whether the new placement alone changes the text).

`--netem` runs the same over workers in Linux network namespaces (bench/netem.py's Lan; bench/faults_netem.py):
every device behind a shaped veth link (tbf at --netem-rate; netem delay and loss where the kernel has the netem
qdisc), the controller given a cluster file. There the controller does not start a killed worker again: the
benchmark does, on the same address, once the stream has ended.

Writes DIR/results.json: per setting (local, netem) the cases and a summary per (workers, policy, fault):
how many cases completed with the reference's text out of how many. A run replaces the sections of the settings
it measured and keeps the others already in the file; DIR/faults.png is drawn from the whole file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from edgespec.bench.faults_report import write
from edgespec.bench.prompts import load_prompts
from edgespec.workers.cluster import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "prompts" / "vicuna80.jsonl"
FAULTS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}


def serve_options(args) -> list[str]:
    """The controller's options for a fault run: short stage timeout and frequent checks, logs at info."""
    return ["--stage-timeout-s", str(args.stage_timeout_s), "--monitor-interval-s", str(args.monitor_interval_s),
            "--log-level", "info", *args.serve_args.split()]


def wait_ready(url: str, procs: list[subprocess.Popen], log: Path, timeout_s: float) -> dict:
    """Poll the controller's /health until it answers 200 (every worker of the placement up and assigned)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited during start-up; see {log}")
        try:
            r = httpx.get(url + "/health", timeout=10)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s; see {log}")


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process group we started (its leader and every child, stopped ones included)."""
    for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped process acts on SIGTERM only once continued
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):  # whatever is left of the group (a worker ignoring SIGTERM)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def worker_pid(controller: int, worker: dict) -> int:
    """The local worker process behind a /health entry: the controller's child started with `--port <its port>`
    (looked up each time: a worker started again has a new port and pid)."""
    port = worker["url"].rsplit(":", 1)[1]
    for task in Path(f"/proc/{controller}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_text().split("\0")
            except OSError:
                continue  # exited meanwhile
            if "--port" in cmd and cmd[cmd.index("--port") + 1] == port:
                return int(child)
    raise LookupError(f"no child of the controller {controller} serves port {port}")


class LocalCluster:
    """`edgespec serve --local-workers N`: the controller starts its workers, and starts a killed one again."""

    setting = "local"

    def __init__(self, workers: int, args, out: Path):
        self.workers, self.args, self.out = workers, args, out
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0
        self.notes: list[str] = []

    def start(self) -> dict:
        self.starts += 1
        port = free_port()
        log = self.out / "logs" / f"local-{self.workers}w-{self.starts}.log"
        cmd = [sys.executable, "-m", "edgespec.server.cli", "serve", "--port", str(port), "--local-workers",
               str(self.workers), *serve_options(self.args)]
        # a session of its own, so that stop() reaches the workers it starts (and starts again) too
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://127.0.0.1:{port}"
        return wait_ready(self.url, [self.proc], log, self.args.start_timeout_s)

    def pid(self, worker: dict) -> int:
        return worker_pid(self.proc.pid, worker)

    def release(self, worker: dict, pid: int, fault: str) -> None:
        """After the faulted stream: continue a stopped worker (a killed one the controller starts itself)."""
        if fault == "sigstop":
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)
            self.proc = None


def stream(url: str, model: str, prompt: str, policy: str, max_tokens: int, timeout_s: float,
           on_chunk=None) -> dict:
    """One greedy streamed chat completion; on_chunk(n) is called after the n-th content chunk. Never raises for
    what the server does: an error event, an HTTP error or a hang (no data for timeout_s) is recorded."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "decoding": policy}
    parts, times = [], []
    done, error, finish = False, None, None
    start = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          timeout=httpx.Timeout(timeout_s, connect=10)) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
            for line in r.iter_lines() if error is None else ():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"error event: {chunk['error'].get('message')}"
                        continue
                    choice = (chunk.get("choices") or [{}])[0]
                    finish = choice.get("finish_reason") or finish
                    if content := (choice.get("delta") or {}).get("content"):
                        parts.append(content)
                        times.append(time.monotonic())
                        if on_chunk is not None:
                            on_chunk(len(parts))
    except httpx.TimeoutException:
        error = f"hang: no data for {timeout_s} s"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    gaps = [b - a for a, b in zip([start, *times], times, strict=False)][1:]  # between chunks, not the first
    return {"text": "".join(parts), "chunks": len(parts), "completed": done and error is None, "error": error,
            "finish_reason": finish, "seconds": round(time.monotonic() - start, 3),
            "stall_s": round(max(gaps, default=0.0), 3), "times": times}


class Watch(threading.Thread):
    """Polls the controller's /health from the fault on, so that when the faulted worker left the placement and
    when it was back in it are known even while the stream still runs."""

    def __init__(self, url: str, name: str, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.url, self.name, self.interval_s = url, name, interval_s
        self.samples: list[tuple[float, dict | None, bool]] = []  # (time, its /health entry, the cluster whole)
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.done.is_set():
                t = time.monotonic()
                try:
                    r = client.get(self.url + "/health")
                    entry = next((w for w in r.json().get("workers", []) if w.get("name") == self.name), None)
                    self.samples.append((t, entry, r.status_code == 200))
                except (httpx.HTTPError, ValueError):
                    self.samples.append((t, None, False))
                self.done.wait(self.interval_s)

    def left_at(self) -> float | None:
        """When the worker was first planned out (no longer listed in the placement)."""
        return next((t for t, e, _ in self.samples if e is None), None)

    def back_at(self, after: float, old_instance: str | None) -> float | None:
        """When the worker was first back (listed, answering, assigned, and the cluster whole) from `after` on;
        with old_instance, only as a new process."""
        for t, e, whole in self.samples:
            if t >= after and e is not None and e.get("status") == "ok" and e.get("assigned") and whole and \
                    (old_instance is None or e.get("instance") != old_instance):
                return t
        return None


def git_state() -> str:
    """The commit the servers run, and whether the working tree differs from it (others edit it meanwhile)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return commit.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def placement(url: str) -> list[dict]:
    return httpx.get(url + "/health", timeout=30).json().get("workers", [])


def fault_case(cluster, model: str, prompt: str, policy: str, reference: dict, fault: str, rng: random.Random,
               args) -> dict:
    """One stream with `fault` sent to a random worker of the placement after a random number of chunks, then
    the wait until that worker is back. Returns the case's record."""
    target = rng.choice(placement(cluster.url))
    pid = cluster.pid(target)
    after = rng.randint(2, max(2, 3 * reference["chunks"] // 4))
    watch = Watch(cluster.url, target["name"])
    sent: list[float] = []

    def on_chunk(n: int) -> None:
        if n == after:
            os.kill(pid, FAULTS[fault])
            sent.append(time.monotonic())
            watch.start()

    run = stream(cluster.url, model, prompt, policy, args.max_tokens, args.stream_timeout_s, on_chunk)
    if not sent:  # the stream ended (or failed) before the chosen chunk: fault it now, so the rejoin is tested
        os.kill(pid, FAULTS[fault])
        sent.append(time.monotonic())
        watch.start()
    fresh = fault == "sigkill"
    returned = sent[0] if fresh and cluster.setting == "local" else time.monotonic()
    cluster.release(target, pid, fault)
    deadline = returned + args.rejoin_timeout_s
    while (back := watch.back_at(returned, target["instance"] if fresh else None)) is None and \
            time.monotonic() < deadline:
        time.sleep(0.25)
    watch.done.set()
    watch.join()
    left = watch.left_at()
    after_fault = [t for t in run["times"] if t > sent[0]]
    record = {"target": target["name"], "target_layers": target.get("layers"), "after_chunks": after,
              "signalled_during_stream": run["chunks"] >= after, "chunks": run["chunks"],
              "reference_chunks": reference["chunks"], "completed": run["completed"], "error": run["error"],
              "finish_reason": run["finish_reason"], "same_text": run["text"] == reference["text"],
              "stall_s": run["stall_s"], "reference_stall_s": reference["stall_s"],
              "next_chunk_after_fault_s": round(after_fault[0] - sent[0], 3) if after_fault else None,
              "seconds": run["seconds"], "reference_seconds": reference["seconds"],
              "left_placement_s": round(left - sent[0], 3) if left is not None else None,
              "rejoined": back is not None, "rejoin_s": round(back - returned, 3) if back is not None else None}
    if run["text"] != reference["text"]:
        record |= {"text": run["text"], "reference_text": reference["text"]}
        if back is not None:  # does the new placement alone change the text?
            control = stream(cluster.url, model, prompt, policy, args.max_tokens, args.stream_timeout_s)
            record["control_same_text"] = control["text"] == reference["text"]
    return record


def run_cluster(cluster, prompts: list[str], policies: list[str], rng: random.Random, args, log) -> list[dict]:
    """Every (policy, prompt): its reference, then the SIGKILL and SIGSTOP cases. The cluster is started anew
    after a worker that did not come back, so that the next case has the whole placement again."""
    cases: list[dict] = []
    try:
        health = cluster.start()
        cluster.notes.append(f"{cluster.workers} workers: the servers ran git {git_state()}")
        base = {"setting": cluster.setting, "workers": cluster.workers}
        log(f"{cluster.setting} {cluster.workers} workers up: "
            + ", ".join(f"{w['name']} {w['layers']}" for w in health["workers"]))
        model = httpx.get(cluster.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        references = {}
        for policy in policies:
            for i, prompt in enumerate(prompts):
                ref = stream(cluster.url, model, prompt, policy, args.max_tokens, args.stream_timeout_s)
                references[policy, i] = ref
                cases.append({**base, "policy": policy, "prompt": i, "fault": "none", "completed": ref["completed"],
                              "error": ref["error"], "chunks": ref["chunks"], "stall_s": ref["stall_s"],
                              "seconds": ref["seconds"], "text": ref["text"]})
                log(f"  reference {policy} prompt {i}: {ref['chunks']} chunks in {ref['seconds']} s"
                    + (f" ERROR {ref['error']}" if ref["error"] else ""))
        for policy in policies:
            for i, prompt in enumerate(prompts):
                ref = references[policy, i]
                if not ref["completed"]:
                    continue  # no reference text to compare with (recorded above)
                for fault in args.faults:
                    record = {**base, "policy": policy, "prompt": i, "fault": fault,
                              **fault_case(cluster, model, prompt, policy, ref, fault, rng, args)}
                    cases.append(record)
                    log(f"  {fault} {record['target']} after {record['after_chunks']} chunks, {policy} prompt {i}: "
                        f"completed={record['completed']} same_text={record['same_text']} stall={record['stall_s']} s "
                        f"rejoin={record['rejoin_s']} s" + (f" ERROR {record['error']}" if record["error"] else ""))
                    if not record["rejoined"]:
                        log(f"  {record['target']} not back in {args.rejoin_timeout_s} s: starting the cluster anew")
                        record["cluster_restarted"] = True
                        cluster.stop()
                        cluster.start()
    except Exception as exc:  # keep what was measured; say why the rest was not
        log(f"{cluster.setting} {cluster.workers} workers: run aborted: {exc!r}")
        cluster.notes.append(f"{cluster.workers} workers: run aborted after {len(cases)} records: {exc!r}")
    finally:
        cluster.stop()
    return cases


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workers", default="2,3", help="local worker counts")
    p.add_argument("--policies", default="naive,speculative,medusa")
    p.add_argument("--faults", default="sigkill,sigstop")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=3, help="prompts from the file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--stage-timeout-s", type=float, default=5)
    p.add_argument("--monitor-interval-s", type=float, default=0.5)
    p.add_argument("--serve-args", default="", help="more options for `edgespec serve`")
    p.add_argument("--stream-timeout-s", type=float, default=180, help="no data for this long: a hang")
    p.add_argument("--rejoin-timeout-s", type=float, default=240)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--local", action=argparse.BooleanOptionalAction, default=True, help="local workers")
    p.add_argument("--netem", action="store_true", help="also over workers in network namespaces")
    p.add_argument("--netem-workers", type=int, default=2)
    p.add_argument("--netem-rate", default="100mbit")
    p.add_argument("--netem-delay-ms", type=float, default=5)
    p.add_argument("--netem-loss-pct", type=float, default=1)
    args = p.parse_args(argv)
    # SIGTERM (and SIGINT, which a background job ignores) end the run through the `finally` blocks that stop
    # every process and namespace it started
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    args.faults = args.faults.split(",")
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts, args.limit)
    policies = args.policies.split(",")
    rng = random.Random(args.seed)
    progress = (args.out / "logs" / "progress.log").open("a")

    def log(line: str) -> None:
        print(line, flush=True)
        progress.write(f"{datetime.datetime.now():%H:%M:%S} {line}\n")
        progress.flush()

    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"settings": {}}
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    runs = []
    if args.local:
        runs += [LocalCluster(int(n), args, args.out) for n in args.workers.split(",") if n]
    if args.netem:
        from edgespec.bench.faults_netem import NetemCluster, netns_refusal

        refusal = netns_refusal()
        if refusal:
            log(f"netem skipped: {refusal}")
            results["settings"]["netem"] = {"skipped": refusal}
        else:
            runs.append(NetemCluster(args.netem_workers, args, args.out))
    measured: dict[str, dict] = {}
    for cluster in runs:
        cases = run_cluster(cluster, prompts, policies, rng, args, log)
        section = measured.setdefault(cluster.setting, {"options": options,
                                                        "when": datetime.datetime.now().isoformat(timespec="seconds"),
                                                        "notes": [], "cases": []})
        section["cases"] += cases
        section["notes"] += [n for n in cluster.notes if n not in section["notes"]]
        write(results, measured, args.out)  # after each cluster: a later one that fails loses nothing before it
    write(results, measured, args.out)
    for setting, section in measured.items():
        log(f"{setting}: " + json.dumps(section["summary"], indent=1))
    log(f"wrote {path} and faults.png")


if __name__ == "__main__":
    main()
