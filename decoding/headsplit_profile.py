"""`edgespec profile-headsplit`: HeadSplit's offline profile of the served model on this machine.

Per layer, the acceptance probability alpha of inter-layer speculation at each epsilon asked for, from exact
forward passes over calibration text (the shared training prompts and the model's own greedy answers, cached
with train-drafter's), and the time of one decoding token in each block of a layer (model/drift.py). Writes
one JSON file and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track

from decoding.distill_data import generate_answers, training_prompts
from model.config import ModelConfig
from model.drift import acceptance, drift, time_blocks
from model.source import resolve_model
from model.stack import LayerStack, TokenEnds
from model.weights import TensorSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROFILES = Path(__file__).resolve().parents[1] / "config" / "profiles"


def profile(args: argparse.Namespace) -> dict:
    console = Console()
    files = resolve_model(args.model)
    cfg = ModelConfig.from_folder(files.folder)
    src = TensorSource(files.folder)
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.data)[:args.prompts]
    rows = generate_answers(files.folder, prompts, args.work / "answers.jsonl", args.max_new_tokens, args.gen_batch)
    # alpha from float32 passes: the reference numbers, not one dtype's roundings
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.float32)
    ends = TokenEnds.load(src, cfg, torch.float32)
    drifts = [drift(stack, ends.embed_tokens(torch.tensor([r["prompt"] + r["answer"]])))
              for r in track(rows, description="exact passes")]
    tokens = sum(d.shape[1] for d in drifts)
    every = torch.cat(drifts, dim=1)  # [L, tokens]
    timed = LayerStack.load(src, cfg, 0, 1, DTYPES[args.dtype])
    blocks = {str(c): time_blocks(timed, c) for c in args.contexts}
    record = {
        "model": files.name, "calibration": {"prompts": len(rows), "tokens": tokens,
                                             "data": "alpaca_seed_tasks.jsonl, wizardlm_testset.jsonl (first "
                                                     f"{args.prompts}), greedy answers"},
        "median_drift": [round(float(v), 4) for v in every.median(dim=1).values],
        "alpha": {str(eps): acceptance(drifts, eps) for eps in args.epsilon},
        "block_ms": {"dtype": args.dtype, "by_context": blocks},
    }
    out = args.out or PROFILES / f"{files.name.lower()}-headsplit.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    console.print(f"{len(rows)} sequences, {tokens} tokens; median drift over layers "
                  f"{statistics.median(record['median_drift']):.4f}")
    for eps, alphas in record["alpha"].items():
        console.print(f"epsilon {eps}: median alpha over layers {statistics.median(alphas[1:]):.4f}, layers with "
                      f"alpha >= 0.7: {sum(a >= 0.7 for a in alphas)} of {len(alphas)}")
    console.print(f"block times ({args.dtype}, ms per decoding token): {blocks}")
    console.print(f"wrote {out}")
    return record
