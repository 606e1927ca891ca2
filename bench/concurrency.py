"""Concurrent streams against one running server: N clients stream at once (N = --streams), each its own
prompt, greedy. Reports the aggregate decode speed (completion tokens of all streams over the wall time from
the first first-token to the last token) against one stream's, and whether every stream's text under load
equals its text alone (in every one of --repeats bursts; the median burst's speed is reported). The counts go
round by round (each round one burst of every count, every policy's back to back), and the ratio to one stream
(and, for each policy after the first, to the first policy's burst of the same count) is the median over the
rounds of each round's own: this machine's speed drifts by up to 2x within a minute, and with all the one-stream
bursts first, the ratios of one run moved with whatever the one stream happened to get. With --sustained, each
round also runs every count as steady use (`sustained`: each client sends its next request as soon as its last
one ended), where a burst's tail has fewer streams running than its count.

    python -m bench.concurrency --url http://127.0.0.1:8000 --prompts ../shared/data/prompts/vicuna80.jsonl \\
        --streams 1,2,4,8,16 --max-tokens 96 --out bench/results/issue18-concurrency

Writes DIR/concurrency.json and DIR/concurrency.png. Measure alone: other processes change the figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from edgespec.bench.plot import bar_chart
from edgespec.bench.prompts import load_prompts
from edgespec.bench.run import stream_one


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


def sustained(url: str, model: str, prompts: list[str], streams: int, policy: str, max_tokens: int,
              seconds: float, warmup: float = 2.0) -> dict:
    """`streams` clients, each sending the next prompt (round the list) as soon as its last answer ended, for
    `warmup` + `seconds`: completion tokens per second over the window after the warmup, each request's tokens
    shared out by its text chunks' characters by when they arrived. A burst's streams start together and each
    stream's speed-up ends it sooner, so that fewer run in its tail (4 default-policy streams: one stream 1.02
    tokens a step ended 0.08-0.24 s after the other three, naive's four together); here each ended stream is
    followed at once, as under steady use, and the prompts' passes are counted as the work they are."""
    order, lock = itertools.cycle(prompts), threading.Lock()
    began = time.perf_counter()
    window = (began + warmup, began + warmup + seconds)

    def client() -> list[dict]:
        runs = []
        with httpx.Client(base_url=url, timeout=600) as c:
            while time.perf_counter() < window[1]:
                with lock:
                    prompt = next(order)
                runs.append(stream_one(c, model, prompt, policy, max_tokens))
        return runs

    with ThreadPoolExecutor(streams) as pool:
        runs = [r for f in [pool.submit(client) for _ in range(streams)] for r in f.result()]
    return {"tokens_per_s": round(window_tokens(runs, window) / seconds, 3), "requests": len(runs),
            "median_ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 1)}


def window_tokens(runs: list[dict], window: tuple[float, float]) -> float:
    """The completion tokens of `runs` (stream_one's) that arrived within window [start, end): each run's tokens
    shared out by its text chunks' characters (a chunk of the default policy can carry several tokens)."""
    tokens = 0.0
    for r in runs:
        inside = sum(n for t, n in zip(r["chunk_times"], r["chunk_chars"], strict=True) if window[0] <= t < window[1])
        tokens += r["tokens"] * inside / max(1, sum(r["chunk_chars"]))
    return tokens


def long_prompt_under_load(url: str, model: str, prompts: list[str], streams: int, tokens: int) -> dict:
    """A prompt of about `tokens` tokens sent while `streams` streams decode: its time to first token against
    the same prompt's on an idle server, and the streams' longest gap between chunks while it is prefilled
    against their median gap. Each long prompt starts with its own tag, so no prefix of it is cached."""
    text = " ".join(prompts)
    with httpx.Client(base_url=url, timeout=600) as client:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        per = client.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
        long_text = " ".join([text] * max(1, round(tokens / per)))
        tag = time.time_ns()  # unique per call, so no earlier run's cache holds a prefix of these prompts
        idle = [stream_one(client, model, f"Request {tag}-{i}. {long_text}", "naive", 8) for i in range(3)]
        pool = ThreadPoolExecutor(streams)
        running = [pool.submit(stream_one, httpx.Client(base_url=url, timeout=600), model, p, "naive", 256)
                   for p in prompts[:streams]]
        time.sleep(1.0)
        loaded = stream_one(client, model, f"Request {tag}-loaded. {long_text}", "naive", 8)
        runs = [f.result() for f in running]
        pool.shutdown()
    window = (loaded["started_at"], loaded["started_at"] + loaded["ttft_ms"] / 1000)
    steady, during = [], []
    for r in runs:
        for a, b in itertools.pairwise(r["chunk_times"]):
            steady.append(b - a)
            if b > window[0] and a < window[1]:  # a gap that overlaps the long prompt's prefill
                during.append(b - a)
    idle_ttft = statistics.median(r["ttft_ms"] for r in idle)
    steady_gap = statistics.median(steady) * 1000
    worst = max(during, default=0) * 1000
    return {"prompt_tokens": loaded["prompt_tokens"], "streams": streams,
            "idle_ttft_ms": round(idle_ttft, 1), "loaded_ttft_ms": round(loaded["ttft_ms"], 1),
            "ttft_vs_idle": round(loaded["ttft_ms"] / idle_ttft, 3), "steady_gap_ms": round(steady_gap, 2),
            "max_gap_during_prefill_ms": round(worst, 2), "gap_vs_steady": round(worst / steady_gap, 3),
            "gaps_during_prefill_ms": sorted(round(g * 1000, 1) for g in during)[-8:]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--streams", default="1,2,4,8,12,16",
                    help="stream counts, 1 first (12: no whole tile of rows, bench/results/issue39-tile-padding)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--policies", default="naive")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, each a burst of every count (medians are reported)")
    ap.add_argument("--long-prompt-tokens", type=int, default=512,
                    help="also send a prompt of about this many tokens while 4 streams decode (0: do not)")
    ap.add_argument("--sustained", type=float, default=0.0,
                    help="also, each round, every count's clients sending request after request for this many "
                         "seconds after a 2 s warmup, round the whole prompt file (0: do not)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]
    if counts[0] != 1:
        raise SystemExit("--streams must start with 1: the other counts are compared with it")
    prompts = load_prompts(args.prompts, max(counts))
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
    results = {"settings": vars(args) | {"prompts": str(args.prompts), "out": str(args.out)}, "policies": {}}
    policies = args.policies.split(",")
    alone = {}
    with httpx.Client(base_url=args.url, timeout=600) as client:
        for policy in policies:
            alone[policy] = [stream_one(client, model, p, policy, args.max_tokens) for p in prompts]
    # rounds[i][n][policy]: each round a burst of every count, every policy's one after the other
    rounds = [{n: {policy: burst(args.url, model, prompts[:n], policy, args.max_tokens) for policy in policies}
               for n in counts} for _ in range(args.repeats)]
    for policy in policies:
        rows = []
        for n in counts:
            bursts = [r[n][policy] for r in rounds]
            same = min(sum(r["text"] == a["text"] for r, a in zip(b["runs"], alone[policy], strict=False))
                       for b in bursts)
            speed = [b["aggregate_decode_tokens_per_s"] for b in bursts]
            ratios = [b["aggregate_decode_tokens_per_s"] / r[1][policy]["aggregate_decode_tokens_per_s"]
                      for b, r in zip(bursts, rounds, strict=True)]
            row = {"streams": n, "aggregate_decode_tokens_per_s": statistics.median(speed),
                   "vs_one_stream": round(statistics.median(ratios), 3),
                   "vs_one_stream_each_round": [round(x, 3) for x in ratios]}
            if policy != policies[0]:  # against the first policy's burst of the same count in the same round
                first = [b["aggregate_decode_tokens_per_s"] / r[n][policies[0]]["aggregate_decode_tokens_per_s"]
                         for b, r in zip(bursts, rounds, strict=True)]
                row |= {f"vs_{policies[0]}": round(statistics.median(first), 3),
                        f"vs_{policies[0]}_each_round": [round(x, 3) for x in first]}
            rows.append(row | {"same_text_as_alone": same, "wall_s": statistics.median(b["wall_s"] for b in bursts),
                               "max_ttft_ms": round(max(r["ttft_ms"] for b in bursts for r in b["runs"]), 1)})
            print(policy, rows[-1])
        results["policies"][policy] = {"one_stream_decode_tokens_per_s": rows[0]["aggregate_decode_tokens_per_s"],
                                       "bursts": rows}
    if args.sustained:
        every = load_prompts(args.prompts)  # the whole file: steady use goes round it
        steady = [{n: {policy: sustained(args.url, model, every, n, policy, args.max_tokens, args.sustained)
                       for policy in policies} for n in counts} for _ in range(args.repeats)]
        for policy in policies:
            results["policies"][policy]["sustained"] = rows = []
            for n in counts:
                speed = [r[n][policy]["tokens_per_s"] for r in steady]
                row = {"streams": n, "tokens_per_s": statistics.median(speed)}
                bases = [("vs_one_stream", 1, policy)] + ([(f"vs_{policies[0]}", n, policies[0])]
                                                            if policy != policies[0] else [])
                for key, count, base in bases:
                    each = [r[n][policy]["tokens_per_s"] / r[count][base]["tokens_per_s"] for r in steady]
                    row |= {key: round(statistics.median(each), 3), f"{key}_each_round": [round(x, 3) for x in each]}
                rows.append(row | {"requests": [r[n][policy]["requests"] for r in steady]})
                print(policy, "sustained", rows[-1])
    if args.long_prompt_tokens:
        results["long_prompt"] = long_prompt_under_load(args.url, model, prompts, 4, args.long_prompt_tokens)
        print("long prompt", results["long_prompt"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.json").write_text(json.dumps(results, indent=1) + "\n")
    panels = [(f"{p}: aggregate tok/s over one stream's", [str(r["streams"]) for r in v["bursts"]],
               [r["vs_one_stream"] for r in v["bursts"]]) for p, v in results["policies"].items()]
    panels += [(f"{p} over {policies[0]}, same streams", [str(r["streams"]) for r in v["bursts"]],
                [r[f"vs_{policies[0]}"] for r in v["bursts"]]) for p, v in results["policies"].items()
               if p != policies[0]]
    if args.sustained:
        panels += [(f"{p}, sustained: tok/s over one stream's", [str(r["streams"]) for r in v["sustained"]],
                    [r["vs_one_stream"] for r in v["sustained"]]) for p, v in results["policies"].items()]
        panels += [(f"{p} over {policies[0]}, sustained", [str(r["streams"]) for r in v["sustained"]],
                    [r[f"vs_{policies[0]}"] for r in v["sustained"]]) for p, v in results["policies"].items()
                   if p != policies[0]]
    bar_chart(args.out / "concurrency.png", f"concurrent streams, {args.max_tokens} new tokens, greedy", panels)
    print(f"wrote {args.out / 'concurrency.json'} and concurrency.png")


if __name__ == "__main__":
    main()
