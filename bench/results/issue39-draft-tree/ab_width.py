"""One server, one stream: naive and the default policy at several draft-tree widths, alternated prompt by prompt
(the order rotating), greedy, streamed. Per setup the median decode tok/s (bench/run.py's: tokens after the first
over the time from the first to the last), its median ratio to naive on the same prompt, tokens per step and
whether each text equals naive's.

    python bench/results/issue39-draft-tree/ab_width.py URL PROMPTS FIRST COUNT MAX_TOKENS WIDTH[,WIDTH...] OUT.json
"""

import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from edgespec.bench.prompts import load_prompts


def stream(client: httpx.Client, model: str, prompt: str, decoding, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "decoding": decoding}
    first = last = None
    parts, usage, stats = [], None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                last = time.perf_counter()
                parts.append(chunk["choices"][0]["delta"]["content"])
            usage = chunk.get("usage") or usage
            stats = chunk.get("decoding") or stats
    tokens = usage["completion_tokens"]
    return {"tokens": tokens, "tok_s": (tokens - 1) / (last - first) if last and last > first else None,
            "text": "".join(parts), "tokens_per_step": (stats or {}).get("tokens_per_step")}


def main() -> None:
    url, prompts_file, first, count, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    widths, out = [int(w) for w in sys.argv[6].split(",")], Path(sys.argv[7])
    prompts = load_prompts(Path(prompts_file), first + count)[first:]
    setups = {"naive": "naive"} | {f"width {w}": {"policy": "speculative", "width": w} for w in widths}
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    with httpx.Client(base_url=url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        names = list(setups)
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                runs[name].append(stream(client, model, prompt, setups[name], max_tokens))
    summary = {}
    for name, rs in runs.items():
        ratios = [r["tok_s"] / n["tok_s"] for r, n in zip(rs, runs["naive"], strict=True) if r["tok_s"] and n["tok_s"]]
        summary[name] = {
            "median_tok_s": round(statistics.median(r["tok_s"] for r in rs if r["tok_s"]), 2),
            "median_ratio_to_naive": round(statistics.median(ratios), 3),
            "median_tokens_per_step": statistics.median(r["tokens_per_step"] or 1.0 for r in rs),
            "text_equals_naive": sum(r["text"] == n["text"] for r, n in zip(rs, runs["naive"], strict=True)),
            "prompts": len(rs)}
        print(name, json.dumps(summary[name]))
    out.write_text(json.dumps({"settings": sys.argv[1:], "summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
