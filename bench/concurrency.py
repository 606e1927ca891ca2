"""Concurrent streams against one running server: N clients stream at once (N = --streams), each its own
prompt, greedy. Reports the aggregate decode speed (completion tokens of all streams over the wall time from
the first first-token to the last token) against one stream's, and whether every stream's text under load
equals its text alone (in every one of --repeats bursts; the median burst's speed is reported).

    python -m bench.concurrency --url http://127.0.0.1:8000 --prompts ../shared/data/prompts/vicuna80.jsonl \\
        --streams 1,2,4,8,16 --max-tokens 96 --out bench/results/issue18-concurrency

Writes DIR/concurrency.json and DIR/concurrency.png. Measure alone: other processes change the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.plot import bar_chart
from bench.prompts import load_prompts
from bench.run import stream_one


def burst(url: str, model: str, prompts: list[str], policy: str, max_tokens: int) -> dict:
    """All prompts streamed at once, one client each."""
    clients = [httpx.Client(base_url=url, timeout=600) for _ in prompts]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda cp: stream_one(cp[0], model, cp[1], policy, max_tokens), zip(clients, prompts,
                                                                                                  strict=True)))
    wall = time.perf_counter() - start
    for c in clients:
        c.close()
    first = max(r["ttft_ms"] for r in runs) / 1000  # every stream is decoding from here on
    tokens = sum(r["tokens"] for r in runs)
    return {"runs": runs, "wall_s": round(wall, 3), "aggregate_tokens_per_s": round(tokens / wall, 3),
            "aggregate_decode_tokens_per_s": round(sum(r["tokens"] - 1 for r in runs) / (wall - first), 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--policies", default="naive")
    ap.add_argument("--repeats", type=int, default=3, help="bursts per stream count (the median is reported)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]
    if counts[0] != 1:
        raise SystemExit("--streams must start with 1: the other counts are compared with it")
    prompts = load_prompts(args.prompts, max(counts))
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    results = {"settings": vars(args) | {"prompts": str(args.prompts), "out": str(args.out)}, "policies": {}}
    for policy in args.policies.split(","):
        with httpx.Client(base_url=args.url, timeout=600) as client:
            alone = [stream_one(client, model, p, policy, args.max_tokens) for p in prompts]
        rows = []
        for n in counts:
            bursts = [burst(args.url, model, prompts[:n], policy, args.max_tokens) for _ in range(args.repeats)]
            same = min(sum(r["text"] == a["text"] for r, a in zip(b["runs"], alone, strict=False)) for b in bursts)
            rows.append({"streams": n, "aggregate_decode_tokens_per_s": statistics.median(
                             b["aggregate_decode_tokens_per_s"] for b in bursts),
                         "same_text_as_alone": same, "wall_s": statistics.median(b["wall_s"] for b in bursts),
                         "max_ttft_ms": round(max(r["ttft_ms"] for b in bursts for r in b["runs"]), 1)})
            print(policy, rows[-1])
        one = rows[0]["aggregate_decode_tokens_per_s"]  # the 1-stream burst of the same loop
        for row in rows:
            row["vs_one_stream"] = round(row["aggregate_decode_tokens_per_s"] / one, 3)
        results["policies"][policy] = {"one_stream_decode_tokens_per_s": one, "bursts": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.json").write_text(json.dumps(results, indent=1) + "\n")
    panels = [(f"{p}: aggregate tok/s over one stream's", [str(r["streams"]) for r in v["bursts"]],
               [r["vs_one_stream"] for r in v["bursts"]]) for p, v in results["policies"].items()]
    bar_chart(args.out / "concurrency.png", f"concurrent streams, {args.max_tokens} new tokens, greedy", panels)
    print(f"wrote {args.out / 'concurrency.json'} and concurrency.png")


if __name__ == "__main__":
    main()
