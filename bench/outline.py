"""Outline decoding against naive: end-to-end latency per answer, in-process and over N local workers.

    python -m bench.outline --out bench/results/DIR [--limit N] [--max-tokens 256] [--setups in_process,2_workers]

Takes the vicuna80 prompts the router (decoding/router.py) sends to outline and runs on each in turn (greedy,
streamed) naive, outline, and outline composed with each verification policy. Writes DIR/outline.json (per
setup and policy: median latency, the median of per-prompt latency ratios naive / policy, the answers' median
lengths, fallbacks, and of the outline answers' points how many end mid-sentence), DIR/outline.png (those
ratios), DIR/SETUP_runs.json (every answer) and DIR/side_by_side.md with the first ten naive and outline
answers, for a reader to judge their quality.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from edgespec.bench.compare import SHARED_PROMPTS
from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.bench.prompts import prompt_text
from edgespec.decoding.outline_points import ends_sentence
from edgespec.decoding.router import route
from edgespec.model.source import resolve_model

POLICIES = {"naive": "naive", "outline": "outline",
            "outline+speculative": {"policy": "outline", "verify": "speculative"},
            "outline+medusa": {"policy": "outline", "verify": "medusa"}}


def answer(client: httpx.Client, model: str, prompt: str, policy, max_tokens: int) -> dict:
    """One streamed greedy chat completion: its text, its latency to the last byte and its statistics."""
    body = {"model": model, "temperature": 0, "stream": True,
            "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}], "decoding": policy}
    start, parts, stats = time.perf_counter(), [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                parts += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
                stats = chunk.get("decoding") or stats
    return {"text": "".join(parts), "latency_s": time.perf_counter() - start, "decoding": stats}


def cut_points(run: dict) -> tuple[int, int]:
    """(points that end mid-sentence, points) of an outline answer ((0, 0) for a fallback's prose)."""
    if "fallback" in (run["decoding"] or {}).get("outline", {"fallback": "not outline"}):
        return 0, 0
    points = [line for line in run["text"].split("\n") if line.strip()]
    return sum(1 for line in points if not ends_sentence(line)), len(points)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--setups", default="in_process,2_workers")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (SHARED_PROMPTS / "vicuna80.jsonl").read_text().splitlines() if line]
    prompts = [prompt_text(r) for r in rows if route(prompt_text(r))[0]][:args.limit]
    setups = {"in_process": [], f"{args.workers}_workers": ["--local-workers", str(args.workers)]}
    tok = AutoTokenizer.from_pretrained(resolve_model(None).folder)  # to count the answers' tokens
    summary: dict = {"settings": {"prompts": len(prompts), "max_tokens": args.max_tokens}}
    for setup in args.setups.split(","):
        proc, url = start(["--log-level", "warning", *setups[setup]], out / f"{setup}.log")
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                runs = [{"prompt": prompt, **{name: answer(client, model, prompt, policy, args.max_tokens)
                                              for name, policy in POLICIES.items()}} for prompt in prompts]
        finally:
            proc.terminate()
            proc.wait(30)
        for r in runs:
            for name in POLICIES:
                r[name]["answer_tokens"] = len(tok.encode(r[name]["text"], add_special_tokens=False))
        summary[setup] = {name: {
            "median_latency_s": round(statistics.median(r[name]["latency_s"] for r in runs), 3),
            "median_latency_ratio_naive_over_this": round(statistics.median(
                r["naive"]["latency_s"] / r[name]["latency_s"] for r in runs), 3),
            "median_answer_tokens": statistics.median(r[name]["answer_tokens"] for r in runs),
            "fallbacks": sum(1 for r in runs if "fallback" in (r[name]["decoding"] or {}).get("outline", {})),
            "points_cut_mid_sentence": [sum(cut_points(r[name])[i] for r in runs) for i in (0, 1)],
            "median_tokens_per_step": round(statistics.median(
                r[name]["decoding"]["tokens_per_step"] or 0 for r in runs), 4),
        } for name in POLICIES}
        (out / f"{setup}_runs.json").write_text(json.dumps(runs, indent=1) + "\n")
        if setup == args.setups.split(",")[0]:
            pairs = [f"## {r['prompt']}\n\n**naive** ({r['naive']['answer_tokens']} tokens, "
                     f"{r['naive']['latency_s']:.2f} s)\n\n{r['naive']['text']}\n\n**outline** "
                     f"({r['outline']['answer_tokens']} tokens, {r['outline']['latency_s']:.2f} s)\n\n"
                     f"{r['outline']['text']}\n" for r in runs[:10]]
            (out / "side_by_side.md").write_text("# naive against outline, SmolLM2-135M-Instruct, greedy\n\n"
                                                 + "\n".join(pairs))
    (out / "outline.json").write_text(json.dumps(summary, indent=2) + "\n")
    names = [n for n in POLICIES if n != "naive"]
    bar_chart(out / "outline.png", f"SmolLM2-135M-Instruct, {len(prompts)} vicuna80 prompts the router accepts, "
              f"greedy, max {args.max_tokens} tokens", [
                  (f"{setup}: median latency ratio naive / policy", names,
                   [summary[setup][n]["median_latency_ratio_naive_over_this"] for n in names])
                  for setup in args.setups.split(",")])
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
