"""`edgespec profile-headsplit`: HeadSplit's offline profile of the served model on this machine.

Per layer, the acceptance probability alpha of inter-layer speculation at each epsilon asked for, from exact
forward passes over calibration text (the shared training prompts and the model's own greedy answers, cached
with train-drafter's); the perplexity of held-out answers (the next prompts') with every layer after the first
speculating at each epsilon, against exact; and the time of one decoding token in each block of a layer
(model/drift.py). Writes one JSON file (read at serve time by decoding/headsplit_profile.py) and prints a
summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict

import torch
from rich.console import Console
from rich.progress import track

from edgespec.decoding.headsplit_profile import PROFILES
from edgespec.decoding.training.distill_data import generate_answers, training_prompts
from edgespec.model.config import ModelConfig
from edgespec.model.drift import acceptance, drift, speculating_forward, time_blocks
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.timing import model_card
from edgespec.model.weights import open_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.inference_mode()
def held_out_perplexity(stack: LayerStack, ends: TokenEnds, rows: list[dict], epsilon: float,
                        speculate: list[bool] | None = None) -> dict:
    """Perplexity of the rows' answer tokens (teacher forced) with the layers in `speculate` (default: every
    layer after the first) speculating at `epsilon` (0: exact), and the share of speculating token-layers whose
    speculation was kept."""
    speculate = speculate or [i > 0 for i in range(stack.cfg.n_layers)]
    nll, count, kept, slots = 0.0, 0, 0, 0
    for r in rows:
        ids = torch.tensor([r["prompt"] + r["answer"]])  # [1, T]
        out, k = speculating_forward(stack, ends.embed_tokens(ids), epsilon, speculate)
        logits = ends.logits(out)[0, len(r["prompt"]) - 1:-1]  # [A, V]: the positions predicting the answer
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, len(r["prompt"]):], reduction="sum"))
        count += len(r["answer"])
        kept, slots = kept + sum(k), slots + ids.shape[1] * sum(speculate)
    return {"perplexity": round(math.exp(nll / count), 4), "kept_share": round(kept / slots, 4) if slots else None}


def profile(args: argparse.Namespace) -> dict:
    console = Console()
    files = resolve_model(args.model)
    cfg = ModelConfig.from_folder(files.folder)
    src = open_source(files.folder)
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.data)[:args.prompts + args.heldout]
    both = generate_answers(files, prompts, args.work / "answers.jsonl", args.max_new_tokens, args.gen_batch)
    rows, held = [r for r in both if r["index"] < args.prompts], [r for r in both if r["index"] >= args.prompts]
    # alpha from float32 passes: the reference numbers, not one dtype's roundings
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.float32)
    ends = TokenEnds.load(src, cfg, torch.float32)
    drifts = [drift(stack, ends.embed_tokens(torch.tensor([r["prompt"] + r["answer"]])))
              for r in track(rows, description="exact passes")]
    tokens = sum(d.shape[1] for d in drifts)
    every = torch.cat(drifts, dim=1)  # [L, tokens]
    perplexity = {str(eps): held_out_perplexity(stack, ends, held, eps) for eps in [0.0, *args.epsilon]}
    timed = LayerStack.load(src, cfg, 0, 1, DTYPES[args.dtype])
    blocks = {str(c): time_blocks(timed, c) for c in args.contexts}
    median_drift = [round(float(v), 4) for v in every.median(dim=1).values]
    alpha = {str(eps): acceptance(drifts, eps) for eps in args.epsilon}
    record = {
        "model": files.name,
        "card": asdict(model_card(cfg, files.name, DTYPES[args.dtype])),  # the shapes the block times are for
        "calibration": {"prompts": len(rows), "tokens": tokens, "data": "alpaca_seed_tasks.jsonl, "
                        f"wizardlm_testset.jsonl (first {args.prompts}), greedy answers"},
        "median_drift": median_drift,
        "alpha": alpha,
        "held_out": {"prompts": len(held), "answer_tokens": sum(len(r["answer"]) for r in held),
                     "by_epsilon": perplexity},
        "block_ms": {"dtype": args.dtype, "by_context": blocks},
    }
    out = args.out or PROFILES / f"{files.name.lower()}-headsplit.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    console.print(f"{len(rows)} sequences, {tokens} tokens; median drift over layers "
                  f"{statistics.median(median_drift):.4f}")
    for eps, alphas in alpha.items():
        console.print(f"epsilon {eps}: median alpha over layers {statistics.median(alphas[1:]):.4f}, layers with "
                      f"alpha >= 0.7: {sum(a >= 0.7 for a in alphas)} of {len(alphas)}")
    exact = perplexity["0.0"]["perplexity"]
    for eps, p in perplexity.items():
        console.print(f"held-out perplexity at epsilon {eps}: {p['perplexity']} ({p['perplexity'] / exact - 1:+.4%} "
                      f"against exact), speculation kept for {p['kept_share']:.4f} of token-layers")
    console.print(f"block times ({args.dtype}, ms per decoding token): {blocks}")
    console.print(f"wrote {out}")
    return record
