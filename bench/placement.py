"""The planner's placement against an even split on two workers of different speed, in one run.

    python -m bench.placement --prompts ../shared/data/prompts/vicuna80.jsonl --limit 12 --out DIR

Worker 0 runs alone on CPU 0 (with both controllers); worker 1 shares CPU 1 with busy-looping processes,
which makes it the slow device. Both servers profile under that load at start-up, then one plans the split
with the DP and the other splits evenly; they are driven alternately, prompt by prompt, so drift in the
machine's load hits both alike. Writes DIR/placement.json and DIR/placement.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.bench.prompts import load_prompts
from edgespec.bench.run import stream_one, summarise

HOG = "while True: pass"


def hogs(n: int, cpu: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
            for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--hogs", type=int, default=1, help="busy-looping processes sharing worker 1's CPU")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(args.prompts), args.limit)
    common = ["--dtype", args.dtype, "--log-level", "warning", "--local-workers", "2", "--worker-cpus", "0;1",
              "--worker-threads", "1", "--threads", "1", "--reprofile", "--profile-tag", f"{args.hogs}-hogs"]
    setups = {"plan": [*common, "--placement", "plan"], "even": [*common, "--placement", "even"]}
    background = hogs(args.hogs, 1)
    procs, urls = {}, {}
    try:
        for name, extra in setups.items():
            procs[name], urls[name] = start(extra, out / f"{name}.log", cpus={0})
        clients = {name: httpx.Client(base_url=url, timeout=600) for name, url in urls.items()}
        placement = {name: {w["name"]: w["layers"] for w in c.get("/health").json()["workers"]}
                     for name, c in clients.items()}
        model = clients["plan"].get("/v1/models").json()["data"][0]["id"]
        for client in clients.values():
            stream_one(client, model, prompts[0], "naive", 8)  # warm-up
        runs: dict[str, list] = {name: [] for name in setups}
        with Progress(console=Console()) as progress:
            task = progress.add_task("planned vs even split", total=len(prompts) * len(setups))
            for i, prompt in enumerate(prompts):
                order = list(clients) if i % 2 == 0 else list(reversed(clients))
                for name in order:
                    runs[name].append(stream_one(clients[name], model, prompt, "naive", args.max_tokens))
                    progress.advance(task)
    finally:
        for proc in [*procs.values(), *background]:
            proc.terminate()
            proc.wait(30)
    result = {"settings": {"model": model, "prompts": len(prompts), "max_tokens": args.max_tokens,
                           "dtype": args.dtype, "hogs_on_worker1_cpu": args.hogs}}
    for name in setups:
        result[name] = {"layers": placement[name], **summarise(runs[name])}
    plan, even = (result[n]["median_decode_tokens_per_s"] for n in ("plan", "even"))
    result["ratio_plan_to_even"] = round(plan / even, 4)
    (out / "placement.json").write_text(json.dumps(result, indent=2))
    title = (f"{model} {args.dtype}, 2 workers (worker1 shares its CPU with {args.hogs} busy loop(s)): "
             f"plan/even {result['ratio_plan_to_even']}")
    names = list(setups)
    bar_chart(out / "placement.png", title, [
        ("median decode tokens/s (streaming API)", names, [result[n]["median_decode_tokens_per_s"] for n in names]),
        ("median time to first token (ms)", names, [result[n]["median_ttft_ms"] for n in names]),
    ])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
