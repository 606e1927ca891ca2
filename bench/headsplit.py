"""HeadSplit's comparison mode (the paper's `--mode all`): layer-based partitioning, head-level partitioning
without speculation and HeadSplit on the same prompt over real local workers.

    edgespec compare-headsplit --out DIR [--tokens 128] [--workers 2] [--epsilon 0.05 0.3] [--mode all]

Workers are pinned one per core with one thread each. Layer-based runs through `edgespec serve --local-workers
N` (the planner's layer pipeline); the head modes run on N workers of their own through workers/head_client.py,
the projection worker gathering each layer and calling its peers over its links to them (the controller sees one
call per token on its link), and
all decode the same prompt greedily for --tokens tokens (bf16). Head modes:
- head-level: KV groups spread evenly over the workers, no speculation (also with the controller gathering
  every layer itself, to show what gathering at a worker saves);
- HeadSplit at each epsilon, placed by the planner from the shipped profile's acceptance and block times and
  the measured round trip of a call on a link plus 15%;
- HeadSplit with groups spread and every layer after the first speculating, to show what the overlap does when
  speculation runs (the planner may enable none on this machine).
Also the held-out perplexity of each HeadSplit mode's speculation against exact (the profile's held-out
answers, float32). Writes DIR/headsplit.json and DIR/headsplit.png and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from edgespec.bench.distributed import start
from edgespec.bench.plot import bar_chart
from edgespec.decoding.distill_data import generate_answers, training_prompts
from edgespec.decoding.headsplit_profile import held_out_perplexity, load_profile
from edgespec.decoding.outline import chat_ids
from edgespec.model.config import ModelConfig
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.timing import model_card
from edgespec.model.weights import open_source
from edgespec.planning.headsplit import LayerPlace, head_card, place, profiled_alphas, profiled_devices, spread
from edgespec.workers.cluster import launch_local_workers, wait_healthy
from edgespec.workers.head_client import call_ms, remote_headsplit

PROMPT = "What are some tips for staying healthy while working from home?"
DISTILL = Path.home() / ".cache" / "edgespec" / "distill"


def layer_based(workers: int, tokens: int, log: Path) -> dict:
    """The layer pipeline through the API: median ms per decoded token (from the server's decode rate) and
    wire bytes and requests per token."""
    cpus = ";".join(str(i) for i in range(workers))
    proc, url = start(["--local-workers", str(workers), "--worker-cpus", cpus, "--worker-threads", "1",
                       "--log-level", "warning", "--policy", "naive"], log)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "temperature": 0, "max_tokens": tokens, "decoding": "naive",
                "messages": [{"role": "user", "content": PROMPT}]}
        runs = [httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()["decoding"] for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(30)
    return {"median_ms_per_token": round(1000 / statistics.median(r["decode_tokens_per_s"] for r in runs), 3),
            "payload_bytes_per_token": round(statistics.median(r["wire_bytes_per_token"] for r in runs), 1),
            "calls_per_token": round(statistics.median(r["wire_requests_per_token"] for r in runs), 2)}


def head_mode(urls: dict[str, str], token: str, cfg: ModelConfig, layers: list[LayerPlace], epsilon: float,
              ends: TokenEnds, prompt: list[int], tokens: int, gathered: bool = True) -> dict:
    """Greedy decoding of the prompt through HeadSplit blocks on the workers: median ms per token, payload
    bytes and calls per token on every link (controller and worker to worker), speculations kept/discarded."""
    pipe = remote_headsplit(urls, token, layers, cfg, dtype="bfloat16", epsilon=epsilon, gathered=gathered)
    pipe.open("bench", len(prompt) + tokens + 1)
    times = []
    devices = list(pipe.devices.values())
    with torch.inference_mode():
        hidden = pipe.forward("bench", ends.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt))[None], 0)
        token_id = int(ends.logits(hidden[:, -1:])[0, -1].argmax())
        before = sum(d.payload[0] + d.payload[1] for d in devices), sum(d.calls for d in devices)
        wire_before = {link: list(v) for link, v in pipe.wire_stats["bench"].items()}
        for p in range(len(prompt), len(prompt) + tokens - 1):
            t0 = time.perf_counter()
            hidden = pipe.forward("bench", ends.embed_tokens(torch.tensor([[token_id]])), torch.tensor([[p]]), p)
            token_id = int(ends.logits(hidden)[0, -1].argmax())
            times.append(time.perf_counter() - t0)
    stats, steps = pipe.stats["bench"], len(times)
    sent = sum(d.payload[0] + d.payload[1] for d in devices) - before[0]
    calls = sum(d.calls for d in devices) - before[1]
    for link, (b, n) in pipe.wire_stats["bench"].items():  # the workers' calls to their peers
        if link.endswith("-peers"):
            sent, calls = sent + b - wire_before.get(link, [0, 0])[0], calls + n - wire_before.get(link, [0, 0])[1]
    pipe.release("bench")
    pipe.close()
    return {"median_ms_per_token": round(1000 * statistics.median(times), 3),
            "payload_bytes_per_token": round(sent / steps, 1), "calls_per_token": round(calls / steps, 2),
            "speculating_layers": sum(lp.speculate for lp in layers),
            "speculations_kept": sum(stats.kept), "speculations_discarded": sum(stats.discarded)}


def spread_placement(cfg: ModelConfig, names: list[str], speculate: bool) -> list[LayerPlace]:
    """Head-level: every layer's KV groups spread evenly over the devices (rotating), the projection and the FFN
    on the first device (where the planner puts them on links that cost more than an FFN); with `speculate`,
    every layer after the first speculates."""
    return [LayerPlace(spread(cfg.n_kv_heads, names[i % len(names):] + names[:i % len(names)]), names[0],
                       names[0], speculate and i > 0) for i in range(cfg.n_layers)]


def heldout_rows(files, record: dict, data: Path) -> list[dict]:
    """The profile's held-out prompts and their greedy answers (cached by profile-headsplit)."""
    cal, n = record["calibration"]["prompts"], record["held_out"]["prompts"]
    prompts = training_prompts(data)[:cal + n]
    rows = generate_answers(files.folder, prompts, DISTILL / "answers.jsonl", 256, 32)
    return [r for r in rows if r["index"] >= cal]


def run(args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    files = resolve_model(None)
    cfg = ModelConfig.from_folder(files.folder)
    ends = TokenEnds.load(open_source(files.folder), cfg, torch.bfloat16)
    from transformers import AutoTokenizer

    prompt = chat_ids(AutoTokenizer.from_pretrained(files.folder), [{"role": "user", "content": PROMPT}])
    record = load_profile(files.name)
    card = head_card(model_card(cfg, "served", torch.bfloat16))
    results, placements, rtt = {}, {}, None
    if args.mode in ("layer", "all"):
        results["layer"] = layer_based(args.workers, args.tokens, args.out / "layer_server.log")
    config = launch_local_workers(args.workers, None, 1, ";".join(str(i) for i in range(args.workers)))
    try:
        asyncio.run(wait_healthy(config, 120))
        urls = {w.name: w.url for w in config.workers}
        names = list(urls)
        # the cost of a call on a link besides the compute: a bf16 hidden state out, a small answer back
        rtt = call_ms(config.workers[0].url, config.token, cfg.hidden_size * 2)

        def mode(label: str, layers: list[LayerPlace], epsilon: float, gathered: bool = True) -> None:
            placements[label] = (layers, epsilon)
            results[label] = head_mode(urls, config.token, cfg, layers, epsilon, ends, prompt, args.tokens, gathered)

        if args.mode in ("head", "all"):
            mode("head (controller gathers)", spread_placement(cfg, names, False), 0.0, gathered=False)
            mode("head", spread_placement(cfg, names, False), 0.0)
        if args.mode in ("headsplit", "all"):
            devices = profiled_devices(record, dict.fromkeys(names, 2**33))
            for eps in args.epsilon:
                alphas = profiled_alphas(record, cfg.n_layers, eps)
                # one message: half the measured round trip, plus the 15% margin
                layers = place(devices, card, alphas, lambda a, b: 0.0 if a == b else 1.15 * rtt / 2, 512)
                mode(f"headsplit eps {eps}", layers, eps)
                mode(f"headsplit eps {eps}, every layer", spread_placement(cfg, names, True), eps)
    finally:
        config.stop()
    if args.perplexity and placements and record:
        src = open_source(files.folder)
        stack = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.float32)
        ends32, rows = TokenEnds.load(src, cfg, torch.float32), heldout_rows(files, record, args.data)
        exact = held_out_perplexity(stack, ends32, rows, 0.0)["perplexity"]
        for label, (layers, eps) in placements.items():
            if any(lp.speculate for lp in layers):
                ppl = held_out_perplexity(stack, ends32, rows, eps, [lp.speculate for lp in layers])["perplexity"]
            else:
                ppl = exact  # nothing speculates: the exact model
            results[label] |= {"heldout_perplexity": ppl, "perplexity_change": round(ppl / exact - 1, 6)}
    if "layer" in results:
        for r in results.values():
            r["speedup_over_layer"] = round(results["layer"]["median_ms_per_token"] / r["median_ms_per_token"], 3)
    summary = {"settings": {"model": files.name, "workers": args.workers, "tokens": args.tokens, "dtype": "bfloat16",
                            "prompt": PROMPT, "round_trip_ms": rtt and round(rtt, 3),
                            "gather": "at each layer's projection worker"},
               "placements": {label: [asdict(lp) for lp in layers] for label, (layers, _) in placements.items()},
               "modes": results}
    (args.out / "headsplit.json").write_text(json.dumps(summary, indent=2) + "\n")
    bar_chart(args.out / "headsplit.png", f"{files.name}, {args.workers} pinned local workers, greedy",
              [("median ms per token", list(results), [r["median_ms_per_token"] for r in results.values()])])
    print_table(results)
    return summary


def print_table(results: dict) -> None:
    table = Table("mode", "ms/token", "payload B/token", "calls/token", "kept", "discarded", "ppl change",
                  "speedup")
    for label, r in results.items():
        change = r.get("perplexity_change")
        table.add_row(label, f"{r['median_ms_per_token']:.3f}", f"{r['payload_bytes_per_token']:.0f}",
                      f"{r['calls_per_token']:.2f}", str(r.get("speculations_kept", "")),
                      str(r.get("speculations_discarded", "")), "" if change is None else f"{change:+.4%}",
                      str(r.get("speedup_over_layer", "")))
    Console(width=140).print(table)

