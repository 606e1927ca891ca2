"""Time to first token: pipelined against unpipelined prefill over the same two workers, and prefix reuse.

    python -m bench.prefill --out DIR [--lengths 512,1024,1800] [--reps 5]

Two servers side by side, each with 2 local workers pinned one per core (they share a cached profile, so
they get the same plan): one cuts long prompts into the plan's segments, the other sends each prompt in one
pass. Prompts of exactly N tokens (windows of the shared prompt sets, each starting elsewhere, so no prefix
is reused) go through the streaming completions API, alternating servers. Then, on the pipelined server,
requests that share a ~1000-token system prompt: the first is cold, the second reuses its prefix. Writes
DIR/prefill.json and DIR/prefill.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.bench.prompts import load_prompts
from edgespec.bench.sse import events

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
QUESTIONS = ["Turn on the kitchen lights.", "Is the front door locked?", "What is the temperature upstairs?"]


def corpus_tokens(tokenizer) -> list[int]:
    text = "\n\n".join(p for f in sorted(DATA.glob("*.jsonl")) for p in load_prompts(f))
    return tokenizer.encode(text, add_special_tokens=False)


def stream(client: httpx.Client, path: str, body: dict) -> dict:
    """One streamed request with max_tokens 2: client-side time to the first text, and the server's stats."""
    start = time.perf_counter()
    first = stats = usage = None
    with events(client, path, {**body, "stream": True, "max_tokens": 2, "temperature": 0,
                               "stream_options": {"include_usage": True}}) as chunks:
        for chunk in chunks:
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            first = first or (time.perf_counter() if chunk["choices"] else None)
            stats, usage = chunk.get("decoding") or stats, chunk.get("usage") or usage
    return {"ttft_ms": round(((first or time.perf_counter()) - start) * 1000, 3),
            "server_ttft_ms": stats["ttft_ms"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,1800")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    common = ["--dtype", args.dtype, "--log-level", "warning", "--local-workers", "2", "--worker-cpus", "0;1",
              "--worker-threads", "1"]
    setups = {"pipelined": common, "unpipelined": [*common, "--no-pipelined-prefill"]}
    procs, clients = {}, {}
    try:
        for name, extra in setups.items():  # one after the other: the second reuses the profile the first measured
            procs[name], url = start([*extra, "--reprofile"] if not procs else extra, out / f"{name}.log")
            clients[name] = httpx.Client(base_url=url, timeout=600)
        from edgespec.model.load import load_tokenizer
        from edgespec.model.source import resolve_model

        tokenizer = load_tokenizer(resolve_model(None))
        tokens = corpus_tokens(tokenizer)
        model = clients["pipelined"].get("/v1/models").json()["data"][0]["id"]
        runs = {name: {n: [] for n in lengths} for name in setups}
        reuse = {"cold": [], "warm": []}
        offset = 0
        with Progress(console=Console()) as progress:
            task = progress.add_task("time to first token", total=len(lengths) * args.reps * 2 + 2 * len(QUESTIONS))
            for n in lengths:
                for rep in range(args.reps):
                    prompt = tokens[offset:offset + n]
                    offset += 97  # every prompt starts elsewhere: no shared prefix
                    for name in (setups if rep % 2 == 0 else reversed(setups)):
                        runs[name][n].append(stream(clients[name], "/v1/completions",
                                                    {"model": model, "prompt": prompt}))
                        progress.advance(task)
            for i, question in enumerate(QUESTIONS):
                start_at = offset + 5000 * (i + 1)
                system = tokenizer.decode(tokens[start_at:start_at + args.system_tokens])
                for kind, q in (("cold", question), ("warm", QUESTIONS[(i + 1) % len(QUESTIONS)])):
                    body = {"model": model, "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": q}]}
                    reuse[kind].append(stream(clients["pipelined"], "/v1/chat/completions", body))
                    progress.advance(task)
        plan = clients["pipelined"].get("/health").json()["workers"]
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    result = {"settings": {"model": model, "dtype": args.dtype, "reps": args.reps, "workers": plan}}
    for n in lengths:
        row = {name: {"median_ttft_ms": median(runs[name][n], "ttft_ms"),
                      "median_server_ttft_ms": median(runs[name][n], "server_ttft_ms")} for name in setups}
        row["speedup"] = round(row["unpipelined"]["median_ttft_ms"] / row["pipelined"]["median_ttft_ms"], 4)
        result[f"prompt_{n}"] = row
    result["prefix_reuse"] = {kind: {"median_ttft_ms": median(reuse[kind], "ttft_ms"),
                                     "median_cached_tokens": median(reuse[kind], "cached_tokens")}
                              for kind in reuse}
    result["prefix_reuse"]["speedup"] = round(result["prefix_reuse"]["cold"]["median_ttft_ms"]
                                              / result["prefix_reuse"]["warm"]["median_ttft_ms"], 4)
    (out / "prefill.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "prefill.png")
    print(json.dumps(result, indent=2))


def plot(result: dict, path: Path) -> None:
    lengths = [int(k.split("_")[1]) for k in result if k.startswith("prompt_")]
    labels = [str(n) for n in lengths]
    s = result["settings"]
    bar_chart(path, f"{s['model']} {s['dtype']}, 2 workers: median time to first token (ms)", [
        *((title, labels, [result[f"prompt_{n}"][name]["median_ttft_ms"] for n in lengths])
          for title, name in (("pipelined, by prompt tokens", "pipelined"),
                              ("one pass, by prompt tokens", "unpipelined"))),
        ("shared system prompt", ["cold", "reused"],
         [result["prefix_reuse"]["cold"]["median_ttft_ms"], result["prefix_reuse"]["warm"]["median_ttft_ms"]]),
    ])


if __name__ == "__main__":
    main()
