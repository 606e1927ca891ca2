"""Latency where Home Assistant feels it: from a spoken command to its tool call, with Home Assistant's own
request (issue 38, deliverable 5).

    python -m bench.ha_latency --out DIR [--runs 3] [--sizes 20,40] [--model M]

The requests are Home Assistant's own: bench/prompts/ha_request_<n>.json holds the first request of two Assist
turns ("Turn on the kitchen light", then "Turn off the office light") exactly as HA 2025.4.4's
openai_conversation sent them for a home of n exposed devices (tests/ha/record_requests.py records them in the
HA venv): its system prompt with the device overview, its Assist tools, streamed, temperature 0. HA renders
the time, to the second, at the top of that prompt on every turn. Each run starts a fresh `edgespec serve` per
size and sends, one after another:
- first: the first turn, on the fresh server (its first request: nothing cached, the grammar tables not built);
- next turn: the second turn as HA sent it (another command, the system prompt rendered with a later time);
- next turn, same head: the second turn with the first turn's time line, so that its system prompt is the one
  the server has just seen (what prefix reuse gives when the prompt's head does not change).
Each is timed by the client from sending to the tool call's `response.function_call_arguments.done` event
(or, for an answer in text, to `response.completed`). Writes DIR/ha_latency.json and DIR/ha_latency.png.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Console

from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.bench.sse import events
from edgespec.bench.versus import machine_info

PROMPTS = Path(__file__).parent / "prompts"
KINDS = ("first", "next turn", "next turn, same head")
_TIME = re.compile(r"^Current time is \d\d:\d\d:\d\d\.")  # Home Assistant's BASE_PROMPT (helpers/llm.py)


def head_time(body: dict) -> str:
    """The time line a recorded request's system prompt (its first input message) opens with."""
    match = _TIME.match(body["input"][0]["content"])
    if match is None:
        raise ValueError("the request's first message does not open with Home Assistant's time line")
    return match.group(0)


def with_time(body: dict, line: str) -> dict:
    """`body` with its system prompt's time line replaced by `line`, as HA renders it for another moment."""
    first = body["input"][0]
    return {**body, "input": [{**first, "content": _TIME.sub(line, first["content"], count=1)}, *body["input"][1:]]}


def to_call(client: httpx.Client, body: dict) -> dict:
    """One streamed Responses request: ms from sending to the first call's arguments.done (or, answered in
    text, to response.completed), the call, the usage's prompt and cached tokens, and the server's `decoding`
    statistics (its own time to first token, the tool choice's scores)."""
    began = time.perf_counter()
    called, done, call, usage, stats = None, None, None, None, None
    with events(client, "/v1/responses", body) as stream:
        for event in stream:
            if event["type"] == "response.function_call_arguments.done" and called is None:
                called, call = time.perf_counter(), {"name": event["name"], "arguments": event["arguments"]}
            elif event["type"] in ("response.completed", "response.incomplete"):
                done = time.perf_counter()
                usage = event["response"]["usage"]
                stats = event["response"].get("decoding")
    end = called or done or time.perf_counter()
    return {"ms": round((end - began) * 1000, 1), "call": call, "prompt_tokens": usage and usage["input_tokens"],
            "cached_tokens": usage and usage["input_tokens_details"]["cached_tokens"], "decoding": stats}


def one_run(record: dict, model_args: list[str], log: Path) -> dict:
    """A fresh server, then the three requests of KINDS in order."""
    first, second = (dict(t["body"], model="default") for t in record["turns"])
    proc, url = start([*model_args, "--served-model-name", "default"], log)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            return {KINDS[0]: to_call(client, first), KINDS[1]: to_call(client, second),
                    KINDS[2]: to_call(client, with_time(second, head_time(first)))}
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sizes", default="20,40", help="home sizes: bench/prompts/ha_request_<n>.json, comma-separated")
    p.add_argument("--model", help="the served model (default: edgespec serve's)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    model_args = ["--model", args.model] if args.model else []
    sizes = [int(n) for n in args.sizes.split(",")]
    results: dict[str, dict] = {}
    for n in sizes:
        record = json.loads((PROMPTS / f"ha_request_{n}.json").read_text())
        runs = []
        for i in range(args.runs):
            runs.append(one_run(record, model_args, args.out / f"server_{n}_{i}.log"))
            console.print(f"{n} devices, run {i + 1}: " + ", ".join(
                f"{k} {r['ms']} ms ({r['prompt_tokens']} tokens, {(r['call'] or {}).get('name', 'text')})"
                for k, r in runs[-1].items()))
        results[str(n)] = {
            "homeassistant": record["homeassistant"], "integration": record["integration"],
            "commands": [t["command"] for t in record["turns"]],
            "median_ms": {k: statistics.median(r[k]["ms"] for r in runs) for k in KINDS}, "runs": runs}
    out = {"settings": {"runs": args.runs, "model": args.model or "default (SmolLM2-135M-Instruct)",
                        "policy": "the server's default"},
           "machine": {**machine_info(), "note": "a shared machine: other work ran beside it"}, "sizes": results}
    (args.out / "ha_latency.json").write_text(json.dumps(out, indent=1) + "\n")
    bar_chart(args.out / "ha_latency.png", "Home Assistant's request: command to tool call, median ms", [
        (f"{n} exposed devices: ms to the tool call", ["first", "next turn", "next turn,\nsame head"],
         [results[str(n)]["median_ms"][k] for k in KINDS]) for n in sizes])
    console.print({n: r["median_ms"] for n, r in results.items()})


if __name__ == "__main__":
    main()
