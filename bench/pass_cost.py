"""What a forward pass of R rows costs on this machine, for R = 1, 2, 4, 8, 12, 16: the served model's layer
matmuls (the kernels called straight, without Python; a mixture of experts' feed-forward as its one call, which
routes the rows and runs each chosen expert once over the rows that chose it), its head, and the whole pass
(layers and head over a 100-token cache). The ratio to one row is what a verification pass of R-1 drafts pays
against a plain step. `batch_ms` is one pass over R sequences decoding a token each (each with its own 100-token
cache, LayerStack.forward_rows): R over its ratio to one row is what batching R streams can gain at most. The
caches are in --kv-format, serve's float16 by default.

    python -m bench.pass_cost --out bench/results/pass-cost
    python -m bench.pass_cost --model ~/.cache/edgespec/synth/qwen3-moe-7b-a1b-q4_1-s0 --out DIR

The rows are random: a mixture routes them to more distinct experts than text does (a pass of R rows of text
often shares experts), so its multi-row figures are the dearer case. Writes DIR/pass_cost.json (medians of
--repeats timings, milliseconds). Measure alone: other processes on the cores change the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from edgespec.bench.versus import machine_info
from edgespec.model.blocks import SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.ffn import Experts
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import Kernel, weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 3)


def layer_matmuls(stack, r: int) -> list:
    """Calls of every layer matmul over r random rows: each projection's kernel; a mixture's feed-forward as one
    call (ffn.cpp's Ffn: the router and the experts the rows chose)."""
    calls = []
    for layer in stack.layers:
        parts = [layer.attn] + ([] if isinstance(layer.ffn, Experts) else [layer.ffn])
        calls += [functools.partial(m.kernel, torch.randn(r, m.in_features))
                  for part in parts for m in part.modules() if isinstance(m, Kernel)]
        if isinstance(layer.ffn, Experts):
            calls.append(functools.partial(layer.ffn.weights(), torch.randn(r, stack.cfg.hidden_size)))
    return calls


def decoding_seqs(stack, ends, context: int, r: int) -> list[SeqRows]:
    """r sequences decoding a token each, each after its own cache of `context` tokens: a batch step's SeqRows
    for LayerStack.forward_rows, at positions `context`."""
    prompt = ends.embed_tokens(torch.zeros(1, context, dtype=torch.long))
    seqs = []
    for _ in range(r):
        cache = stack.new_cache(context + 32)
        stack(prompt, torch.arange(context)[None], cache, 0)
        seqs.append(SeqRows(cache, context, 1))
    return seqs


def costs(stack, ends, cache, context: int, r: int, repeats: int) -> dict:
    """Medians for a pass of r rows after `context` cached tokens."""
    matmuls = layer_matmuls(stack, r)
    h = torch.randn(1, r, stack.cfg.hidden_size)
    positions = torch.arange(context, context + r)[None]
    mask = torch.arange(context + r)[None] <= (context + torch.arange(r))[:, None]  # causal over the rows

    def forward():
        cache.length = context
        ends.logits(stack(h, positions, cache, context, None if r == 1 else mask))

    seqs = decoding_seqs(stack, ends, context, r)

    def batch():
        ends.logits(stack.forward_rows(h[0], torch.full((r,), context), seqs)[None])

    return {"rows": r, "batch_ms": median_ms(batch, repeats),
            "layer_matmuls_ms": median_ms(lambda: [call() for call in matmuls], repeats),
            "head_ms": median_ms(lambda: ends.logits(h), repeats), "forward_ms": median_ms(forward, repeats)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder or GGUF (default: the served default)")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--kv-format", default="float16", help="the caches' format (serve's default: float16)")
    ap.add_argument("--rows", default="1,2,4,8,12,16",
                    help="row counts, 1 first (12: a tile not full, bench/results/issue39-tile-padding)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    files = resolve_model(args.model)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format(args.weights)
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format(args.kv_format))
    ends = TokenEnds.load(src, cfg, fmt)
    context = 100
    with torch.inference_mode():
        cache = stack.new_cache(context + 32)
        stack(ends.embed_tokens(torch.zeros(1, context, dtype=torch.long)), torch.arange(context)[None], cache, 0)
        rows_out = [costs(stack, ends, cache, context, int(r), args.repeats) for r in args.rows.split(",")]
    one = rows_out[0]
    for row in rows_out:
        row["forward_vs_one_row"] = round(row["forward_ms"] / one["forward_ms"], 3)
        row["batch_speedup"] = round(row["rows"] * one["batch_ms"] / row["batch_ms"], 3)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info() | {"threads": torch.get_num_threads()}, "model": files.name,
              "weights": args.weights, "kv_format": args.kv_format,
              "context": context, "rows": rows_out}
    (args.out / "pass_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in rows_out:
        print(row)
    print(f"wrote {args.out / 'pass_cost.json'}")


if __name__ == "__main__":
    main()
