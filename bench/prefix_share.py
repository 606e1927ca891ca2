"""Prefix reuse where requests end early or arrive together (issue 37's bars), on the default `edgespec serve`.

    python -m bench.prefix_share --out DIR [--reps 5] [--model M]

Each repetition makes a new Home-Assistant-like system prompt (its system message, its intent tools and their
schemas as text, about 1,200 tokens; a repetition number first, so nothing is cached from an earlier one), then:
- early close: a streamed request reads its first token and closes the stream; the next request sharing the
  system prompt is sent at once. Its time to first token against the first one's (computed cold).
- together: two requests with another new system prompt are sent at the same moment (threads). The second to
  reach its first token: its cached prompt tokens, and its time to first token against the first one's.
Times are the client's, from sending to the first streamed text. Writes DIR/prefix_share.json and
DIR/prefix_share.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console

from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.bench.sse import events

HA = json.loads((Path(__file__).parent / "prompts" / "home_assistant.json").read_text())
QUESTIONS = ["Turn on the kitchen lights.", "Is the front door locked?", "What is the temperature upstairs?",
             "Set the bedroom light to 40% brightness.", "Tell me a joke."]


def system_prompt(rep: int, tag: str) -> str:
    """A new system prompt of about 1,100 tokens: the Home Assistant system message and its tools as text."""
    tools = "\n".join(json.dumps(t, sort_keys=True) for t in HA["tools"])
    examples = "\n".join(f"- {c['prompt']} ({c['tool']})" for c in HA["commands"])
    return (f"Conversation {tag}-{rep}.\n{HA['system']}\n\nYou can call these tools:\n{tools}\n\nRequests you "
            f"will see, with the tool each calls:\n{examples}\n\n{HA['system']}")


def first_token(client: httpx.Client, system: str, question: str, close_early: bool) -> dict:
    """One streamed chat request: the client's time to its first text; with close_early the stream is closed
    right there, else read to its end (2 tokens) for the usage's cached tokens."""
    body = {"model": "default", "stream": True, "max_tokens": 2 if not close_early else 64, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    began = time.perf_counter()
    first, usage = None, None
    with events(client, "/v1/chat/completions", body) as chunks:
        for chunk in chunks:
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
                if close_early:
                    break
            usage = chunk.get("usage") or usage
    return {"ttft_ms": round(((first or time.perf_counter()) - began) * 1000, 1),
            "prompt_tokens": usage["prompt_tokens"] if usage else None,
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"] if usage else None}


def early_close(url: str, rep: int) -> dict:
    system = system_prompt(rep, "early")
    with httpx.Client(base_url=url, timeout=300) as client:
        cold = first_token(client, system, QUESTIONS[0], close_early=True)
    with httpx.Client(base_url=url, timeout=300) as client:  # at once, on a new connection
        warm = first_token(client, system, QUESTIONS[1], close_early=False)
    return {"cold": cold, "next": warm, "speedup": round(cold["ttft_ms"] / warm["ttft_ms"], 3)}


def together(url: str, rep: int) -> dict:
    system = system_prompt(rep, "together")
    out: list[dict | None] = [None, None]
    go = threading.Barrier(2)

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            go.wait()
            out[i] = first_token(client, system, QUESTIONS[2 + i], close_early=False)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first, second = sorted(out, key=lambda r: r["ttft_ms"])
    return {"first": first, "second": second, "ratio": round(second["ttft_ms"] / first["ttft_ms"], 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--model", help="the served model (default: edgespec serve's)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    extra = ["--model", args.model] if args.model else []
    proc, url = start([*extra, "--served-model-name", "default"], args.out / "server.log")
    try:
        first_token_warmup = system_prompt(0, "warmup")
        with httpx.Client(base_url=url, timeout=300) as client:
            first_token(client, first_token_warmup, QUESTIONS[4], close_early=False)
        early, both = [], []
        for rep in range(1, args.reps + 1):
            early.append(early_close(url, rep))
            both.append(together(url, rep))
            console.print(f"rep {rep}: early close {early[-1]['cold']['ttft_ms']} -> {early[-1]['next']['ttft_ms']} ms "
                          f"(x{early[-1]['speedup']}, cached {early[-1]['next']['cached_tokens']}); together "
                          f"{both[-1]['first']['ttft_ms']} / {both[-1]['second']['ttft_ms']} ms "
                          f"(x{both[-1]['ratio']}, second cached {both[-1]['second']['cached_tokens']})")
    finally:
        proc.terminate()
        proc.wait(30)
    summary = {
        "prompt_tokens": early[0]["next"]["prompt_tokens"],
        "early_close_speedup_median": statistics.median(r["speedup"] for r in early),
        "early_close_next_cached_median": statistics.median(r["next"]["cached_tokens"] for r in early),
        "together_ratio_median": statistics.median(r["ratio"] for r in both),
        "together_second_cached_min": min(r["second"]["cached_tokens"] for r in both),
        "together_first_cached_max": max(r["first"]["cached_tokens"] for r in both),
    }
    result = {"summary": summary, "early_close": early, "together": both}
    (args.out / "prefix_share.json").write_text(json.dumps(result, indent=1))
    def ttft(runs: list[dict], key: str) -> float:
        return statistics.median(r[key]["ttft_ms"] for r in runs)

    bar_chart(args.out / "prefix_share.png", "prefix reuse: an early close, and two requests together", [
        ("time to first token, ms (median)", ["cold", "next after a close"],
         [ttft(early, "cold"), ttft(early, "next")]),
        ("time to first token, ms (median)", ["first together", "second together"],
         [ttft(both, "first"), ttft(both, "second")]),
    ])
    console.print(summary)


if __name__ == "__main__":
    main()
