"""Decode speed while another process takes a core: edgespec against llama.cpp's server, in one run.

    python -m edgespec.bench.busy --out bench/results/issue20-busy [--limit 6] [--max-tokens 128] [--rounds 1]
        [--no-workers] [--llama-python PATH]

Starts, all at once (one computes at a time): llama.cpp's OpenAI server (llama-cpp-python, 2 threads) on the
embedded GGUF, `edgespec serve` (the default model and threads), `edgespec serve --threads 1` (a fixed one-thread
reference) and `edgespec serve --local-workers 1` (the layers in a worker process). Then per round three
phases: calm; a CPU-bound process (`while True: pass`) pinned to the last core; the same process at nice 19.
In each phase every prompt goes to every server in turn, streamed, at temperature 0, naive decoding, the same
max_tokens. Every process it starts (servers, their workers, the hog) is stopped on the way out, on errors too.

Writes DIR/results.json (per server: median decode tokens/s per phase and the ratios hog/calm and nice/calm;
per phase the hog's CPU share and the load of processes not ours; the thread changes edgespec logged),
DIR/requests.jsonl (every request), DIR/busy.png and DIR/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from edgespec.bench.llamacpp import ServerProcess, child_pids, free_port, llama_python, llamacpp_argv, llamacpp_version
from edgespec.bench.prompts import load_prompts
from edgespec.bench.versus import LLAMA_REQUEST, WARMUP_PROMPT, WARMUP_TOKENS, edgespec_argv, machine_info, stream_chat

REPO = Path(__file__).resolve().parents[1]
PHASES = ("calm", "hog", "nice")
HOG = "while True: pass"
SETTLE_S = 1.0  # after starting the hog, before the first request
GOVERNOR_LINE = "torch threads"  # what model/cpu_share.py logs when it changes the count
NOTES = [
    "decode tokens/s per request = (tokens - 1) / (time of the last content chunk - time of the first), client "
    "side; medians over the prompts (and rounds) of a phase; ratio = median of the phase / median calm",
    "hog: one `while True: pass` process pinned to the last core (nice 0); nice: the same at nice 19",
    "all servers are up at once and take the prompts in turn, one request at a time; edgespec runs naive "
    "decoding; llama.cpp requests send repeat_penalty 1.0 (greedy)",
    "others_cores: CPU the machine spent on processes other than this benchmark's (servers, workers, hog), "
    "in cores, over the phase; the machine is shared, so calm is only as calm as this says",
    "governor_changes: thread-count changes edgespec logged during the phase (controller and workers)",
]


def ticks_s() -> float:
    return 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds of these processes (those gone count 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(f"/proc/{pid}/stat").read_text()
            fields = text[text.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])
    return total * ticks_s()


def machine_busy_seconds() -> float:
    """CPU seconds every process took, all cores (everything in /proc/stat but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) * ticks_s()


class Hog:
    """A CPU-bound process pinned to one core, at a nice level, in its own session; stop() ends it."""

    def __init__(self, cpu: int, nice: int):
        def setup() -> None:
            with contextlib.suppress(OSError, AttributeError):  # SIGKILL when this benchmark dies, however (Linux)
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
            os.sched_setaffinity(0, {cpu})
            os.nice(nice)

        self.cpu, self.nice = cpu, nice
        self.proc = subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=setup, start_new_session=True,
                                     stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)


def our_pids(servers: list[ServerProcess], hog: Hog | None) -> list[int]:
    pids = [os.getpid()]
    for s in servers:
        pids += [s.proc.pid, *child_pids(s.proc.pid)]
    return pids + ([hog.proc.pid] if hog else [])


def governor_changes(log: Path, start: int) -> int:
    try:
        with open(log, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").count(GOVERNOR_LINE)
    except OSError:
        return 0


def log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarise(records: list[dict], labels: list[str]) -> list[dict]:
    """One row per server: median decode tokens/s per phase and each busy phase's ratio to calm."""
    rows = []
    for label in labels:
        row = {"server": label}
        for phase in PHASES:
            runs = [r for r in records if r["server"] == label and r["phase"] == phase]
            row[f"{phase}_requests"] = len(runs)
            row[f"{phase}_median_decode_tokens_per_s"] = _median(r["decode_tokens_per_s"] for r in runs)
            row[f"{phase}_median_tokens"] = _median(r["tokens"] for r in runs)
        calm = row["calm_median_decode_tokens_per_s"]
        for phase in PHASES[1:]:
            rate = row[f"{phase}_median_decode_tokens_per_s"]
            row[f"ratio_{phase}_to_calm"] = round(rate / calm, 3) if calm and rate else None
        rows.append(row)
    return rows


def plot(results: dict, path: Path) -> None:
    """Bars per server: calm, hog and nice-19 hog decode speed, the busy/calm ratios written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["configurations"]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(rows) + 1), 4.8))
    width = 0.8 / len(PHASES)
    colors = {"calm": "tab:green", "hog": "tab:red", "nice": "tab:orange"}
    for i, phase in enumerate(PHASES):
        values = [r[f"{phase}_median_decode_tokens_per_s"] or 0 for r in rows]
        xs = [x + (i - 1) * width for x in range(len(rows))]
        label = {"calm": "calm", "hog": "hog on a core", "nice": "hog at nice 19"}[phase]
        ax.bar(xs, values, width, label=label, color=colors[phase])
        for x, v, r in zip(xs, values, rows, strict=True):
            ratio = r.get(f"ratio_{phase}_to_calm")
            ax.annotate(f"{v:.1f}" + (f"\n{ratio:.2f}x" if ratio else ""), (x, v), ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(range(len(rows)), [r["server"].replace(" --", "\n--") for r in rows])
    ax.set_ylabel("median decode tokens/s")
    ax.set_ylim(0, max((r["calm_median_decode_tokens_per_s"] or 0 for r in rows), default=1) * 1.35 or 1)
    ax.legend(fontsize=8)
    s, m = results["settings"], results["machine"]
    ax.set_title(f"one CPU-bound process on a core: {s['prompts']} prompts x {s['rounds']} rounds, max "
                 f"{s['max_tokens']} tokens, greedy\n{m['cpu_model']} ({m['cpus']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Setup = tuple[str, Callable[[int], list[str]], str, str | None, dict | None]


def setups(args, python: str | None, gguf: Path) -> list[Setup]:
    """(label, argv for a port, readiness path, decoding field, extra request fields) per server."""
    info = ["--log-level", "info"]  # the governor's changes go to the log at INFO
    out = [("llama.cpp", lambda port: llamacpp_argv(python, gguf, port, args.llama_threads), "/v1/models", None,
            LLAMA_REQUEST)] if args.llama else []
    out += [("edgespec", lambda port: edgespec_argv("default", port, info), "/health", "naive", None),
           ("edgespec --threads 1", lambda port: edgespec_argv("default", port, ["--threads", "1", *info]),
            "/health", "naive", None)]
    if args.workers:
        out.append(("edgespec --local-workers 1",
                    lambda port: edgespec_argv("default", port, ["--local-workers", "1", *info]), "/health",
                    "naive", None))
    return out


def run(args) -> dict:
    from edgespec.model.source import default_gguf

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(args.prompts), args.limit)
    gguf = default_gguf()
    python = llama_python(args.llama_python) if args.llama else None
    hog_cpu = max(os.sched_getaffinity(0))
    results: dict = {
        "settings": {"prompts_file": str(args.prompts), "prompts": len(prompts), "max_tokens": args.max_tokens,
                     "rounds": args.rounds, "temperature": 0, "decoding": "naive", "gguf": str(gguf),
                     "hog_cpu": hog_cpu, "llama_cpp": {"python": python, "version": llamacpp_version(python),
                                                       "n_threads": args.llama_threads} if args.llama else None},
        "machine": machine_info(), "servers": {}, "phases": [],
    }
    records: list[dict] = []
    live: list[tuple] = []  # (label, process, decoding field, extra request fields) of the servers started
    with contextlib.ExitStack() as stack:
        for label, argv, ready, decoding, fields in setups(args, python, gguf):
            port = free_port()
            info = results["servers"][label] = {"argv": argv(port)}
            proc = ServerProcess(label, info["argv"], port, out / "logs" / (label.replace(" ", "_") + ".log"),
                                 ready, cwd=REPO)
            stack.callback(proc.stop)
            live.append((label, proc, decoding, fields))
        clients = []
        for label, proc, decoding, fields in live:
            proc.wait_ready(args.ready_timeout_s)
            client = stack.enter_context(httpx.Client(base_url=proc.url, timeout=900))
            model = client.get("/v1/models").json()["data"][0]["id"]
            stream_chat(client, model, WARMUP_PROMPT, WARMUP_TOKENS, decoding, fields)
            clients.append((label, proc, client, model, decoding, fields))
            print(f"{label}: ready", flush=True)
        servers = [proc for _, proc, *_ in live]
        for rnd in range(args.rounds):
            for phase in PHASES:
                hog = None if phase == "calm" else Hog(hog_cpu, 19 if phase == "nice" else 0)
                try:
                    if hog:
                        time.sleep(SETTLE_S)
                    logs = {label: log_size(proc.log) for label, proc, *_ in clients}
                    t0, busy0, ours0 = time.monotonic(), machine_busy_seconds(), cpu_seconds(our_pids(servers, hog))
                    hog0 = cpu_seconds([hog.proc.pid]) if hog else 0.0
                    for i, prompt in enumerate(prompts):
                        for label, _proc, client, model, decoding, fields in clients:
                            r = stream_chat(client, model, prompt, args.max_tokens, decoding, fields)
                            records.append({"round": rnd, "phase": phase, "server": label, "prompt": i, **r})
                            print(f"round {rnd} {phase:4s} prompt {i} {label}: {r['decode_tokens_per_s'] or 0:.1f} "
                                  f"tok/s", flush=True)
                    seconds = time.monotonic() - t0
                    ours = cpu_seconds(our_pids(servers, hog)) - ours0
                    results["phases"].append({
                        "round": rnd, "phase": phase, "seconds": round(seconds, 1),
                        "hog_cpu_share": round((cpu_seconds([hog.proc.pid]) - hog0) / seconds, 3) if hog else None,
                        "others_cores": round(max(machine_busy_seconds() - busy0 - ours, 0.0) / seconds, 3),
                        "load_average_1min": round(os.getloadavg()[0], 2),
                        "governor_changes": {label: governor_changes(proc.log, logs[label])
                                             for label, proc, *_ in clients if label.startswith("edgespec")},
                    })
                finally:
                    if hog:
                        hog.stop()
    results["configurations"] = summarise(records, [label for label, *_ in live])
    results["notes"] = NOTES
    (out / "results.json").write_text(json.dumps(results, indent=2))
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    plot(results, out / "busy.png")
    for row in results["configurations"]:
        print(f"{row['server']:28s} calm {row['calm_median_decode_tokens_per_s']} hog "
              f"{row['hog_median_decode_tokens_per_s']} ({row['ratio_hog_to_calm']}x) nice "
              f"{row['nice_median_decode_tokens_per_s']} ({row['ratio_nice_to_calm']}x)")
    print(f"wrote {out / 'results.json'}, {out / 'requests.jsonl'} and {out / 'busy.png'}")
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m edgespec.bench.busy", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/issue20-busy")
    p.add_argument("--prompts", default=str(REPO / "bench" / "prompts" / "extraction20.jsonl"))
    p.add_argument("--limit", type=int, default=6, help="prompts from the file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="calm, hog, nice: this many times, interleaved")
    p.add_argument("--no-workers", dest="workers", action="store_false",
                   help="leave out `edgespec serve --local-workers 1`")
    p.add_argument("--no-llama", dest="llama", action="store_false", help="leave out llama.cpp (a quick look)")
    p.add_argument("--llama-python", help="llama-cpp-python's interpreter (default: bench/llamacpp.py's)")
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--ready-timeout-s", type=float, default=900)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    # SIGTERM (a killed job) ends like Ctrl-C: through the `finally`s that stop the hog and the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args)


if __name__ == "__main__":
    main()
