"""In-process against N local workers, in one run: decode speed, time to first token and wire figures.

    python -m edgespec.bench.distributed --workers 2,4 --prompts ../shared/data/prompts/vicuna80.jsonl --out DIR

Starts every server side by side (in-process, and one over N local workers for each N) and alternates them
prompt by prompt, so drift in the machine's load hits all alike. Writes DIR/distributed.json (with each
setup's ratio to in-process) and DIR/distributed.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

from edgespec.bench.plot import bar_chart
from edgespec.bench.prompts import load_prompts
from edgespec.bench.run import stream_one, summarise
from edgespec.workers.cluster import free_port


def start(args: list[str], log: Path, cpus: set[int] | None = None,
          timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`edgespec serve` with these arguments (pinned to `cpus` if given), once healthy; stopped again if it is not
    healthy within `timeout_s`."""
    port = free_port()
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.server.cli", "serve", "--port", str(port), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {args} exited; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    proc.wait(30)
    raise TimeoutError(f"server {args} not healthy; see {log}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="4", help="worker counts, comma-separated")
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="weight format (default: the served one)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(args.prompts), args.limit)
    common = ["--dtype", args.dtype, "--log-level", "warning"]
    counts = [int(n) for n in args.workers.split(",")]
    setups = {"in_process": common} | {f"{n}_workers": [*common, "--local-workers", str(n)] for n in counts}
    procs, urls = {}, {}
    try:
        for name, extra in setups.items():
            procs[name], urls[name] = start(extra, out / f"{name}.log")
        runs: dict[str, list] = {name: [] for name in setups}
        clients = {name: httpx.Client(base_url=url, timeout=600) for name, url in urls.items()}
        model = clients["in_process"].get("/v1/models").json()["data"][0]["id"]
        for client in clients.values():
            stream_one(client, model, prompts[0], "naive", 8)  # warm-up
        with Progress(console=Console()) as progress:
            task = progress.add_task("in-process vs workers", total=len(prompts) * len(setups))
            for prompt in prompts:
                for name, client in clients.items():
                    runs[name].append(stream_one(client, model, prompt, "naive", args.max_tokens))
                    progress.advance(task)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    result = {"settings": {"model": model, "prompts": len(prompts), "max_tokens": args.max_tokens,
                           "dtype": args.dtype, "workers": counts}}
    for name in setups:
        result[name] = summarise(runs[name])
        links = [r["server"]["wire_links"] for r in runs[name] if r["server"] and r["server"]["wire_links"]]
        if links:
            result[name]["decode_bytes_per_token_per_link"] = {
                link: sorted(x[link]["decode_bytes_per_token"] for x in links)[len(links) // 2] for link in links[0]}
    local = result["in_process"]["median_decode_tokens_per_s"]
    result["ratio_to_in_process"] = {
        f"{n}_workers": round(result[f"{n}_workers"]["median_decode_tokens_per_s"] / local, 4) for n in counts}
    (out / "distributed.json").write_text(json.dumps(result, indent=2))
    plot(result, setups, out / "distributed.png")
    print(json.dumps(result, indent=2))


def plot(result: dict, setups: dict, path: Path) -> None:
    names = list(setups)
    s = result["settings"]
    ratios = ", ".join(f"{k} {v}x" for k, v in result["ratio_to_in_process"].items())
    title = f"{s['model']} {s['dtype']}, {s['prompts']} prompts: {ratios} of in-process"
    bar_chart(path, title, [
        ("median decode tokens/s (streaming API)", names, [result[n]["median_decode_tokens_per_s"] for n in names]),
        ("median time to first token (ms)", names, [result[n]["median_ttft_ms"] for n in names]),
    ])


if __name__ == "__main__":
    main()
