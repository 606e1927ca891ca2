"""`edgespec bench`: every named policy on every prompt, through a running server's streaming API, in one run.

Writes DIR/results.json (per policy: median decode tokens/s, time to first token, tokens per step,
acceptance rate, wire bytes and requests per token, ratio to naive) and DIR/decode_tokens_per_s.png.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from edgespec.bench.prompts import load_prompts


def decoding_field(policy: str) -> str | dict:
    """A bench policy name as the request's `decoding` field: 'naive', or 'speculative:ngram' for a policy
    with a drafter."""
    name, _, drafter = policy.partition(":")
    return {"policy": name, "drafter": drafter} if drafter else name


def stream_one(client: httpx.Client, model: str, prompt: str, policy: str, max_tokens: int) -> dict:
    """One streamed chat completion at temperature 0; client-side timings plus the server's statistics."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "decoding": decoding_field(policy)}
    start = time.perf_counter()
    first = last = None
    usage = stats = None
    parts, times = [], []  # the content chunks and when each arrived (perf_counter)
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{policy}: HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{policy}: {chunk['error']['message']}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                last = time.perf_counter()
                parts.append(chunk["choices"][0]["delta"]["content"])
                times.append(last)
            usage = chunk.get("usage") or usage
            stats = chunk.get("decoding") or stats
    tokens = usage["completion_tokens"]
    first = first or time.perf_counter()
    decode_s = (last or first) - first
    return {
        "tokens": tokens,
        "ttft_ms": (first - start) * 1000,
        # the first visible text arrives with the first token; the rest are decoding steps
        "decode_tokens_per_s": (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else None,
        "server": stats,
        "text": "".join(parts),
        "seconds": time.perf_counter() - start,
        "prompt_tokens": usage["prompt_tokens"],
        "started_at": start,
        "chunk_times": times,
        "chunk_chars": [len(p) for p in parts],
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def summarise(runs: list[dict]) -> dict:
    server = [r["server"] or {} for r in runs]
    return {
        "prompts": len(runs),
        "median_decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in runs),
        "median_ttft_ms": _median(r["ttft_ms"] for r in runs),
        "median_tokens": _median(r["tokens"] for r in runs),
        "median_tokens_per_step": _median(s.get("tokens_per_step") for s in server),
        "median_acceptance_rate": _median(s.get("acceptance_rate") for s in server),
        "median_wire_bytes_per_token": _median(s.get("wire_bytes_per_token") for s in server),
        "median_wire_requests_per_token": _median(s.get("wire_requests_per_token") for s in server),
        "median_server_decode_tokens_per_s": _median(s.get("decode_tokens_per_s") for s in server),
    }


def server_rss_bytes(client: httpx.Client) -> float | None:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1])
    return None


def run_bench(args) -> dict:
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(Path(args.prompts), args.limit)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: dict = {"settings": {"url": args.url, "prompts_file": str(args.prompts), "prompts": len(prompts),
                                  "max_tokens": args.max_tokens, "temperature": 0}, "policies": {}}
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        results["settings"]["model"] = model
        stream_one(client, model, prompts[0], policies[0], 8)  # warm-up
        runs: dict[str, list[dict]] = {p: [] for p in policies}
        with Progress(console=console) as progress:
            task = progress.add_task("bench", total=len(prompts) * len(policies))
            for prompt in prompts:  # policies alternate per prompt, so drift in machine load hits all alike
                for policy in policies:
                    runs[policy].append(stream_one(client, model, prompt, policy, args.max_tokens))
                    progress.advance(task)
        results["server_peak_rss_bytes"] = server_rss_bytes(client)
    for policy in policies:
        results["policies"][policy] = summarise(runs[policy])
    if args.transformers_baseline:
        from edgespec.bench.hf_baseline import run_transformers

        hf = run_transformers(args.model, args.dtype, prompts, args.max_tokens, console)
        results["transformers_generate"] = {
            "dtype": args.dtype,
            "median_decode_tokens_per_s": _median(r["decode_tokens_per_s"] for r in hf),
            "median_ttft_ms": _median(r["ttft_ms"] for r in hf),
            "median_tokens": _median(r["tokens"] for r in hf),
        }
    _add_ratios(results)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    from edgespec.bench.plot import plot_results

    plot_results(results, out / "decode_tokens_per_s.png")
    _print_table(console, results)
    console.print(f"wrote {out / 'results.json'} and {out / 'decode_tokens_per_s.png'}")
    return results


def _add_ratios(results: dict) -> None:
    naive = results["policies"].get("naive", {}).get("median_decode_tokens_per_s")
    for summary in results["policies"].values():
        rate = summary["median_decode_tokens_per_s"]
        summary["ratio_to_naive"] = round(rate / naive, 3) if naive and rate else None
    hf = results.get("transformers_generate", {}).get("median_decode_tokens_per_s")
    if hf:
        results["ratio_naive_to_transformers"] = round(naive / hf, 3) if naive else None


def _print_table(console: Console, results: dict) -> None:
    table = Table(title=f"{results['settings']['model']}, {results['settings']['prompts']} prompts, "
                        f"{results['settings']['max_tokens']} tokens")
    for col in ("policy", "decode tok/s", "ttft ms", "tokens/step", "accept", "ratio to naive"):
        table.add_column(col)
    for name, s in results["policies"].items():
        table.add_row(name, str(s["median_decode_tokens_per_s"]), str(s["median_ttft_ms"]),
                      str(s["median_tokens_per_step"]), str(s["median_acceptance_rate"]), str(s["ratio_to_naive"]))
    if "transformers_generate" in results:
        hf = results["transformers_generate"]
        table.add_row("transformers generate", str(hf["median_decode_tokens_per_s"]), str(hf["median_ttft_ms"]),
                      "1", "", "")
    console.print(table)
