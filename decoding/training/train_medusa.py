"""`edgespec train-medusa`: Medusa-1 heads for the served model, trained on its own answers with the base frozen.

1. The target answers the training prompts, greedy and sampled (decoding/training/distill_data.py, shared with
   train-drafter and cached under --work), and its final hidden states are computed teacher-forced.
2. Head k at answer position i learns the target's own distribution at position i + k (soft labels over the
   heads' vocabulary: self-distillation), with loss weight decay**k.
3. Held-out prompts' greedy answers give each head's top-1 and top-5 accuracy, and the joint rank statistics
   from which Medusa's greedy tree construction estimates any path's acceptance.
4. The verification cost of T tokens is measured on this machine, and the default tree is the grown tree that
   maximises the estimated tokens per second: (1 + expected accepted length) / cost(1 + nodes).
The heads file (with its default tree) and a JSON record of data, steps, losses and accuracies are written.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from safetensors.torch import load_file

from edgespec.decoding.medusa_heads import DEFAULT_TREE, MedusaNet
from edgespec.decoding.target_fit import SHIPPED
from edgespec.decoding.training.medusa_cost import measure_verify_cost
from edgespec.decoding.training.train_drafter import DistillSet, Example, batches, cosine_schedule, distill_set

RANKS = 16  # ranks beyond this count as misses in the tree statistics


def head_inputs(ends, group: list[Example], k_max: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed features g [B, W, H], next ids [B, W] (ids[b, i] = x_(i+1)) and the answer mask [B, W] of a batch;
    a position is in the mask when it predicts an answer token and all k_max heads have a label."""
    width = max(len(e.ids) for e in group)
    g = torch.zeros(len(group), width, ends.cfg.hidden_size)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.bool)
    with torch.no_grad():
        for r, e in enumerate(group):
            t = len(e.ids)
            g[r, :t] = ends.norm(e.f)
            ids[r, :t - 1] = e.ids[1:]
            mask[r, e.answer_start - 1:t - 1 - k_max] = True
    return g, ids, mask


def loss_on(net: MedusaNet, head: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, weights: list[float]):
    """Weighted sum over heads of the cross-entropy to the target's own distribution k positions on.
    g [B, W, H], mask [B, W]; head [N, H]. Returns (loss, per-head losses)."""
    with torch.no_grad():
        want = (g @ head.T).softmax(-1)  # [B, W, N] the target's next-token distribution at every position
    feats = net(g[mask])  # [M, K, H]
    logits = feats @ head.T  # [M, K, N]
    rows, cols = mask.nonzero(as_tuple=True)
    per_head = [-(want[rows, cols + k + 1] * logits[:, k].log_softmax(-1)).sum(-1).mean() for k in range(len(weights))]
    return sum(w * h for w, h in zip(weights, per_head, strict=True)), [h.item() for h in per_head]


@torch.no_grad()
def heldout_ranks(net: MedusaNet, head: torch.Tensor, ends, examples: list[Example]) -> torch.Tensor:
    """For every held-out answer position, the rank of each head's true token x_(i+1+k) among the head's
    vocabulary logits: [M, K] (RANKS where it is further down, or outside the vocabulary)."""
    k_max = len(net.blocks)
    out = []
    for e in examples:
        g, ids, mask = head_inputs(ends, [e], k_max)
        logits = net(g[mask]) @ head.T  # [M, K, N]
        _, cols = mask.nonzero(as_tuple=True)
        top = net.vocab[logits.topk(RANKS, dim=-1).indices]  # [M, K, RANKS] ids
        truth = torch.stack([ids[0, cols + k + 1] for k in range(k_max)], dim=1)  # [M, K]
        hit = top == truth.unsqueeze(-1)  # [M, K, RANKS]
        out.append(torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(truth, RANKS)))
    return torch.cat(out)


def accuracies(ranks: torch.Tensor) -> list[dict]:
    """Per head: top-1 and top-5 accuracy from ranks [M, K]."""
    return [{"head": k + 1, "top1": round(float((ranks[:, k] < 1).float().mean()), 4),
             "top5": round(float((ranks[:, k] < 5).float().mean()), 4)} for k in range(ranks.shape[1])]


def grow_tree(path_freq, size: int) -> list[tuple[list[int], float]]:
    """Medusa's greedy tree construction: from the root, repeatedly add the child of a node already in the tree
    whose path has the highest estimated acceptance, `size` times. path_freq(path) -> the share of positions
    at which the target's tokens follow `path` (all its ranks right at once). Returns the paths in the order
    added, each with its share; the sum of the shares of a tree's nodes is its expected accepted length."""
    chosen: list[tuple[list[int], float]] = []
    frontier: dict[tuple[int, ...], float] = {(0,): path_freq([0])}
    while frontier and len(chosen) < size:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        share = frontier.pop(best)
        if share <= 0:
            break
        chosen.append((list(best), share))
        frontier[(*best, 0)] = path_freq([*best, 0])  # its first child
        frontier[(*best[:-1], best[-1] + 1)] = path_freq([*best[:-1], best[-1] + 1])  # its next sibling
    return chosen


def choose_tree(ranks: torch.Tensor, cost: dict[int, float], max_nodes: int) -> tuple[list[list[int]], list[dict]]:
    """The grown tree (grow_tree above) of the size with the best estimated speed over naive,
    (1 + expected accepted length) * cost[1] / cost[1 + nodes]; cost[n]: seconds to verify n tokens (and run
    the heads). Returns the tree and the estimate per size."""

    def share(path: list[int]) -> float:
        if len(path) > ranks.shape[1] or max(path) >= RANKS:  # RANKS in `ranks` marks a miss
            return 0.0
        return float((ranks[:, :len(path)] == torch.tensor(path)).all(-1).float().mean())

    grown = grow_tree(share, max_nodes)
    table, best = [], (0.0, 0)
    for size in range(1, len(grown) + 1):
        if 1 + size not in cost:
            continue
        tokens = 1 + sum(s for _, s in grown[:size])
        speed = tokens * cost[1] / cost[1 + size]
        table.append({"nodes": size, "tokens_per_step": round(tokens, 4),
                      "cost_ratio": round(cost[1 + size] / cost[1], 4), "speedup": round(speed, 4)})
        best = max(best, (speed, size))
    return [p for p, _ in grown[:best[1]]], table


def fit(args: argparse.Namespace, data: DistillSet, head: torch.Tensor, rng: random.Random,
        console: Console) -> tuple[MedusaNet, dict]:
    """Train the heads on the training split; returns them and the training part of the record."""
    net = MedusaNet(data.cfg, args.heads, data.vocab)
    net.requires_grad_(True)
    weights = [args.decay ** (k + 1) for k in range(args.heads)]
    n_groups = len(batches(data.train_set, args.batch_tokens, rng))
    total = args.epochs * n_groups
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = cosine_schedule(opt, total)
    history, t0 = [], time.time()
    for epoch in range(args.epochs):
        sums = [0.0] * args.heads
        for group in track(batches(data.train_set, args.batch_tokens, rng), description=f"epoch {epoch + 1}",
                           console=console):
            g, _, mask = head_inputs(data.ends, group, args.heads)
            loss, per_head = loss_on(net, head, g, mask, weights)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            sums = [a + b for a, b in zip(sums, per_head, strict=True)]
        row = {"epoch": epoch + 1, "train_loss_per_head": [round(s / n_groups, 4) for s in sums],
               "heldout": accuracies(heldout_ranks(net, head, data.ends, data.test_set))}
        history.append(row)
        console.print(row)
    net.requires_grad_(False)
    return net, {**data.record(args), "heads": args.heads, "loss_weights": [round(w, 4) for w in weights],
                 "epochs": args.epochs, "steps": total, "lr": args.lr, "weight_decay": args.weight_decay,
                 "batch_tokens": args.batch_tokens, "seed": args.seed, "history": history,
                 "train_seconds": round(time.time() - t0)}


def load_net(path: Path, cfg) -> MedusaNet:
    """Trained heads from their file, in float32."""
    state = load_file(str(path))
    net = MedusaNet(cfg, sum(1 for k in state if k.endswith(".weight")), state["vocab"])
    net.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return net.requires_grad_(False)


def train(args: argparse.Namespace) -> dict:
    """Train (or with --retree, load) the heads, then choose the default tree on this machine and save both."""
    console = Console()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data: DistillSet = distill_set(args, rng, console)
    args.out = args.out or SHIPPED / "smollm2-135m-instruct-medusa.safetensors"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    head = data.ends.lm_head.dense().detach()[data.vocab]  # [N, H], frozen
    if args.retree:
        net, record = load_net(args.out, data.cfg), json.loads(args.out.with_suffix(".json").read_text())
    else:
        net, record = fit(args, data, head, rng, console)
        net.save(args.out, data.ends, record, DEFAULT_TREE)  # kept should the measurement below fail
    ranks = heldout_ranks(net, head, data.ends, data.test_set)
    cost = measure_verify_cost(args.model, args.out, range(1, args.max_nodes + 2))
    tree, estimates = choose_tree(ranks, cost, args.max_nodes)
    record.update({"heldout_accuracy": accuracies(ranks), "heldout_positions": len(ranks),
                   "verify_cost_ms": {n: round(s * 1000, 3) for n, s in cost.items()},
                   "tree_estimates": estimates, "tree": tree})
    net.save(args.out, data.ends, record, tree)
    console.print({"heldout_accuracy": record["heldout_accuracy"], "tree": tree,
                   "estimate": next((e for e in estimates if e["nodes"] == len(tree)), None)})
    return record
