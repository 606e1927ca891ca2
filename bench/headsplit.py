"""Layer-based partitioning, head-level partitioning and HeadSplit on the same prompt over real local workers
(issue 9's comparison mode, preliminary: the controller still gathers each layer's partial outputs).

    python -m bench.headsplit --out DIR [--tokens 128] [--workers 2] [--epsilon 0.05 0.3]

Workers are pinned one per core. Layer-based runs through `edgespec serve --local-workers N` (the layer
pipeline), the head modes through workers/head_client.py on N workers of their own; all decode the same prompt
greedily for --tokens tokens (bf16). Head modes: head-level (no layer speculates); HeadSplit as the planner
places it at each epsilon (layers speculate where the profile's alpha clears 0.7); and HeadSplit with every
layer after the first speculating, to show what the overlap does when speculation is kept. Writes
DIR/headsplit.json (per mode: median ms per token, payload bytes and calls per token, speculations kept and
discarded, speedup over layer-based) and DIR/headsplit.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import torch

from bench.distributed import start
from bench.plot import bar_chart
from decoding.headsplit_profile import PROFILES
from decoding.outline import chat_ids
from model.config import ModelConfig
from model.source import resolve_model
from model.stack import TokenEnds
from model.timing import model_card
from model.weights import TensorSource
from planning.headsplit import HeadDevice, LayerPlace, head_card, place
from workers.cluster import launch_local_workers, wait_healthy
from workers.head_client import remote_headsplit

PROMPT = "What are some tips for staying healthy while working from home?"


def layer_based(workers: int, tokens: int, log: Path) -> float:
    """Median ms per decoded token of the layer pipeline, from the server's own decode rate."""
    cpus = ";".join(str(i) for i in range(workers))
    proc, url = start(["--local-workers", str(workers), "--worker-cpus", cpus, "--worker-threads", "1",
                       "--log-level", "warning", "--policy", "naive"], log)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "temperature": 0, "max_tokens": tokens, "decoding": "naive",
                "messages": [{"role": "user", "content": PROMPT}]}
        rates = [httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()["decoding"][
            "decode_tokens_per_s"] for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(30)
    return 1000 / statistics.median(rates)


def placement(cfg: ModelConfig, names: list[str], ms: dict[str, float], alphas: list[float], every: bool
              ) -> list[LayerPlace]:
    """The planner's placement on identical devices with block times `ms` (from the profile); `every`: all
    layers after the first speculate."""
    devices = [HeadDevice(n, ms["group_ms"], ms["proj_ms"], ms["ffn_ms"], 2**33) for n in names]
    card = head_card(model_card(cfg, "served", torch.bfloat16))
    # links: about half a millisecond per loopback HTTP message on this machine
    layers = place(devices, card, [1.0] * cfg.n_layers if every else alphas, lambda a, b: 0.0 if a == b else 0.5,
                   context=512)
    if every:
        for i, lp in enumerate(layers):
            lp.speculate = i > 0
    return layers


def head_mode(urls: dict[str, str], token: str, cfg: ModelConfig, layers: list[LayerPlace], epsilon: float,
              ends: TokenEnds, prompt: list[int], tokens: int) -> dict:
    pipe = remote_headsplit(urls, token, layers, cfg, dtype="bfloat16", epsilon=epsilon)
    pipe.open("bench", len(prompt) + tokens + 1)
    times = []
    with torch.inference_mode():
        hidden = pipe.forward("bench", ends.embed_tokens(torch.tensor([prompt])), torch.arange(len(prompt))[None], 0)
        token_id = int(ends.logits(hidden[:, -1:])[0, -1].argmax())
        before = [(*d.payload, d.calls) for d in pipe.devices.values()]
        for p in range(len(prompt), len(prompt) + tokens - 1):
            t0 = time.perf_counter()
            hidden = pipe.forward("bench", ends.embed_tokens(torch.tensor([[token_id]])), torch.tensor([[p]]), p)
            token_id = int(ends.logits(hidden)[0, -1].argmax())
            times.append(time.perf_counter() - t0)
    stats = pipe.stats["bench"]
    steps = len(times)
    sent = sum(d.payload[0] + d.payload[1] - b[0] - b[1] for d, b in zip(pipe.devices.values(), before, strict=True))
    calls = sum(d.calls - b[2] for d, b in zip(pipe.devices.values(), before, strict=True))
    pipe.release("bench")
    pipe.close()
    return {"median_ms_per_token": round(1000 * statistics.median(times), 3),
            "payload_bytes_per_token": round(sent / steps, 1), "calls_per_token": round(calls / steps, 2),
            "speculating_layers": sum(lp.speculate for lp in layers),
            "speculations_kept": sum(stats.kept), "speculations_discarded": sum(stats.discarded)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epsilon", type=float, nargs="+", default=[0.05, 0.3])
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    files = resolve_model(None)
    cfg = ModelConfig.from_folder(files.folder)
    ends = TokenEnds.load(TensorSource(files.folder), cfg, torch.bfloat16)
    from transformers import AutoTokenizer

    prompt = chat_ids(AutoTokenizer.from_pretrained(files.folder), [{"role": "user", "content": PROMPT}])
    record = json.loads((PROFILES / f"{files.name.lower()}-headsplit.json").read_text())
    ms = record["block_ms"]["by_context"]["0"]
    results = {"layer": {"median_ms_per_token": round(layer_based(args.workers, args.tokens,
                                                                  args.out / "layer_server.log"), 3)}}
    config = launch_local_workers(args.workers, None, 1, ";".join(str(i) for i in range(args.workers)))
    try:
        asyncio.run(wait_healthy(config, 120))
        urls = {w.name: w.url for w in config.workers}

        def mode(alphas: list[float], every: bool, epsilon: float) -> dict:
            layers = placement(cfg, list(urls), ms, alphas, every)
            return head_mode(urls, config.token, cfg, layers, epsilon, ends, prompt, args.tokens)

        results["head"] = mode([0.0] * cfg.n_layers, False, 0.0)
        for eps in args.epsilon:
            alphas = record["alpha"].get(str(eps), [0.0] * cfg.n_layers)
            results[f"headsplit eps {eps}"] = mode(alphas, False, eps)
            results[f"headsplit eps {eps}, every layer"] = mode(alphas, True, eps)
    finally:
        config.stop()
    layer = results["layer"]["median_ms_per_token"]
    for r in results.values():
        r["speedup_over_layer"] = round(layer / r["median_ms_per_token"], 3)
    summary = {"settings": {"model": files.name, "workers": args.workers, "tokens": args.tokens, "dtype": "bfloat16",
                            "prompt": PROMPT, "gather": "at the controller (preliminary)"}, "modes": results}
    (args.out / "headsplit.json").write_text(json.dumps(summary, indent=2) + "\n")
    bar_chart(args.out / "headsplit.png", f"{files.name}, {args.workers} pinned local workers, greedy",
              [("median ms per token", list(results), [r["median_ms_per_token"] for r in results.values()])])
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
