"""`edgespec train-drafter`: distil a feature drafter (decoding/eagle.py) from the served model's own answers.

1. The target answers the training prompts (decoding/training/distill_data.py; cached under --work, resumable).
2. Its final hidden states along prompt + answer, teacher forced.
3. The drafter's vocabulary: the ids the target emits most often in those answers.
4. Training: at each answer position, regress the next normed feature (smooth L1) and match the target's next
   token distribution over the vocabulary (cross-entropy), with noise on the input features (EAGLE's recipe)
   and a second pass that reads the drafter's own predicted features, as when it drafts several tokens ahead.
5. Evaluation on held-out prompts by simulating greedy speculative decoding with the inference drafter:
   acceptance rate and tokens per step at the given draft length, as the server would see them.
The weights and a JSON record of data, steps, losses and accuracies are written next to each other.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import track

from edgespec.decoding.eagle import FeatureDrafter, FeatureDraftModel, FeatureNet
from edgespec.decoding.target_fit import SHIPPED
from edgespec.decoding.training.distill_data import final_hidden, generate_answers, training_prompts
from edgespec.decoding.types import SamplingParams
from edgespec.model.blocks import RMSNorm
from edgespec.model.config import ModelConfig
from edgespec.model.source import ModelFiles, resolve_model
from edgespec.model.stack import TokenEnds
from edgespec.model.weights import TensorSource, open_source


class Example:
    """One sequence: ids [T], the target's last-layer outputs f [T, H], and where its answer starts."""

    def __init__(self, ids: list[int], f: torch.Tensor, answer_start: int):
        self.ids, self.f, self.answer_start = torch.tensor(ids), f, answer_start


def cached_hidden(files: ModelFiles, rows: list[dict], path: Path, device: str) -> list[torch.Tensor]:
    """final_hidden(files, rows), kept in `path` for the next run on the same rows."""
    key = [len(r["prompt"]) + len(r["answer"]) for r in rows]
    if path.exists():
        saved = torch.load(path)
        if saved["key"] == key:
            return saved["hidden"]
    hidden = final_hidden(files, rows, device=device)
    torch.save({"key": key, "hidden": hidden}, path)
    return hidden


def choose_vocab(rows: list[dict], size: int, eos: int) -> torch.Tensor:
    """The `size` most frequent answer ids, eos always in; where the answers have fewer distinct ids, the
    lowest other ids fill the rest (a BPE vocabulary numbers its merges roughly by frequency)."""
    counts = Counter(t for r in rows for t in r["answer"])
    ids = {t for t, _ in counts.most_common(size - 1)} | {eos}
    ids |= set(itertools.islice((t for t in itertools.count() if t not in ids), max(0, size - len(ids))))
    return torch.tensor(sorted(ids))


def coverage(rows: list[dict], vocab: torch.Tensor) -> float:
    """Share of the answers' tokens the vocabulary holds."""
    held = set(vocab.tolist())
    tokens = [t for r in rows for t in r["answer"]]
    return sum(t in held for t in tokens) / max(1, len(tokens))


def batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[Example]]:
    """Length-sorted groups of about batch_tokens padded tokens, in random order."""
    order = sorted(examples, key=lambda e: len(e.ids))
    out: list[list[Example]] = []
    cur: list[Example] = []
    for e in order:
        if cur and (len(cur) + 1) * len(e.ids) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(e)
    out += [cur] if cur else []
    rng.shuffle(out)
    return out


@dataclass
class TrainEnds:
    """What training reads of the target's token ends, as plain tensors on the training device: the final norm
    and the embedding rows as the model reads them (the served TokenEnds hold compiled CPU kernels)."""

    norm: RMSNorm
    table: torch.Tensor  # [V, H] float32, scaled as the model's embedding scales

    @classmethod
    def of(cls, ends: TokenEnds, device: str) -> TrainEnds:
        table = ends.embed.dense().float()
        table = table if ends.embed.scale is None else table * ends.embed.scale
        return cls(copy.deepcopy(ends.norm).to(device), table.to(device))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, T] -> [B, T, H]
        return F.embedding(ids, self.table)


def loss_on(net: FeatureNet, ends: TrainEnds, head: torch.Tensor, group: list[Example], noise: float,
            cls_weight: float, unroll: int = 1) -> tuple[torch.Tensor, float, float]:
    """Feature + token loss of one batch; also the token loss alone and top-1 agreement (answer positions).

    With unroll > 1 the pass is repeated on the drafter's own predictions as input features (each index reads
    the g its previous index predicted), as when it drafts several tokens ahead; the losses add up."""
    width, device = max(len(e.ids) for e in group) - 1, head.device
    g_prev = torch.zeros(len(group), width, head.shape[1], device=device)  # normed features g, what the head reads
    g_next = torch.zeros_like(g_prev)
    ids = torch.zeros(len(group), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(group), width, dtype=torch.bool, device=device)
    for r, e in enumerate(group):
        t = len(e.ids) - 1
        g = ends.norm(e.f.to(device))
        g_prev[r, :t], g_next[r, :t], ids[r, :t] = g[:-1], g[1:], e.ids[1:]
        mask[r, e.answer_start - 1:t] = True  # index i predicts x_(i+1): answer tokens only
    # draft index i = position of token x_i; inputs (g_(i-1), x_i) -> g_i
    if noise:
        scale = g_prev.pow(2).mean().sqrt()
        g_prev = g_prev + (torch.rand_like(g_prev) - 0.5) * 2 * noise * scale
    positions = torch.arange(1, width + 1, device=device).expand(len(group), -1)
    emb = ends.embed(ids)
    target = g_next[mask]  # [M, H]
    with torch.no_grad():
        want = (target @ head.T).softmax(-1)  # the target's next-token distribution over the vocabulary [M, N]
    total: torch.Tensor | None = None
    cls_first, agree = 0.0, 0.0
    for step in range(unroll):
        out = ends.norm(net.block(g_prev, emb, positions))  # [B, W, H]
        pred = out[mask]
        logits = pred @ head.T  # [M, N]
        cls = -(want * logits.log_softmax(-1)).sum(-1).mean()
        loss = F.smooth_l1_loss(pred, target) + cls_weight * cls
        total = loss if total is None else total + loss
        if step == 0:
            cls_first = cls.item()
            agree = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
        g_prev = torch.cat([g_prev[:, :1], out[:, :-1].detach()], dim=1)
    assert total is not None, "unroll is at least 1"
    return total, cls_first, agree


@torch.no_grad()
def simulate(model: FeatureDraftModel, examples: list[Example], k: int) -> dict:
    """Greedy speculative decoding replayed on held-out answers: the drafter proposes k tokens, the answer (the
    target's greedy output) decides how many are accepted, as verification would."""
    proposed = accepted = steps = emitted = 0
    by_depth = [0] * k
    params = SamplingParams(temperature=0.0)
    for e in examples:
        ids = e.ids.tolist()
        drafter = FeatureDrafter(model, params, len(ids) + k + 2)
        pos = e.answer_start  # the target's first answer token comes from the prompt's last feature
        drafter.observe(0, e.f[:pos])
        pos += 1  # ids[pos-1] is emitted by the prefill
        while pos < len(ids):
            drafts, _ = drafter.propose(ids[:pos], min(k, len(ids) - pos))
            a = 0
            while a < len(drafts) and drafts[a] == ids[pos + a]:
                by_depth[a] += 1
                a += 1
            proposed, accepted, steps = proposed + len(drafts), accepted + a, steps + 1
            emitted += min(a + 1, len(ids) - pos)
            drafter.observe(pos - 1, e.f[pos - 1:pos + a])
            pos += a + 1
    return {"acceptance": round(accepted / max(1, proposed), 4), "tokens_per_step": round(emitted / max(1, steps), 3),
            "accepted_at_depth": [round(n / max(1, steps), 4) for n in by_depth]}


@dataclass
class DistillSet:
    """The target's own answers to the training prompts with its features, split by prompt, and a vocabulary."""

    name: str
    cfg: ModelConfig
    src: TensorSource
    ends: TokenEnds  # float32
    prompts: list[str]
    rows: list[dict]
    held: set[int]  # held-out prompt indices
    train_set: list[Example]
    test_set: list[Example]  # the held-out prompts' greedy answers
    vocab: torch.Tensor
    covered: float  # the vocabulary's share of the held-out answers' tokens

    def record(self, args: argparse.Namespace) -> dict:
        """What the data was, for a training record."""
        return {"target": self.name, "data": ["alpaca_seed_tasks.jsonl", "wizardlm_testset.jsonl"],
                "prompts": len(self.prompts), "heldout_prompts": len(self.held), "sequences": len(self.rows),
                "answer_tokens": sum(len(r["answer"]) for r in self.rows), "max_new_tokens": args.max_new_tokens,
                "samples_per_prompt": args.samples, "sample_temperature": args.temperature,
                "vocab": len(self.vocab), "heldout_vocab_coverage": round(self.covered, 4)}


def distill_set(args: argparse.Namespace, rng: random.Random, console: Console) -> DistillSet:
    """Generate (or reuse from --work) the target's answers and features; split off --holdout of the prompts."""
    files = resolve_model(args.model)
    cfg = ModelConfig.from_folder(files.folder)
    src = open_source(files.folder)
    ends = TokenEnds.load(src, cfg, torch.float32)
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(args.data)
    rows = generate_answers(files, prompts, args.work / "answers.jsonl", args.max_new_tokens,
                            args.gen_batch, args.samples, args.temperature, args.seed, args.device)
    held = set(rng.sample(range(len(prompts)), max(1, int(args.holdout * len(prompts)))))
    examples = [Example(r["prompt"] + r["answer"], f, len(r["prompt"]))
                for r, f in zip(rows, cached_hidden(files, rows, args.work / "hidden.pt", args.device), strict=True)]
    split = [r["index"] in held for r in rows]
    train_set = [e for e, h in zip(examples, split, strict=True) if not h]
    test_set = [e for e, h, r in zip(examples, split, rows, strict=True) if h and r["draw"] == 0]
    vocab = choose_vocab([r for r, h in zip(rows, split, strict=True) if not h], min(args.vocab, cfg.vocab_size),
                         cfg.eos_token_ids[0])
    covered = coverage([r for r, h in zip(rows, split, strict=True) if h], vocab)
    console.print(f"{len(train_set)} training and {len(test_set)} held-out sequences; vocabulary of {len(vocab)} "
                  f"holds {covered:.1%} of the held-out answers' tokens")
    return DistillSet(files.name, cfg, src, ends, prompts, rows, held, train_set, test_set, vocab, covered)


def cosine_schedule(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """50 steps of warm-up, then cosine decay to 0 at `total` steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))


def train(args: argparse.Namespace) -> dict:
    console = Console()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data = distill_set(args, rng, console)
    cfg, vocab, train_set, test_set = data.cfg, data.vocab, data.train_set, data.test_set
    # training runs on --device: the token ends copied there, the training features moved there once
    ends = TrainEnds.of(data.ends, args.device)
    for e in train_set:
        e.f = e.f.to(args.device)
    net = FeatureNet(cfg, vocab).to(args.device)  # random start: measured better than from the target's last layer
    net.requires_grad_(True)
    head = data.ends.lm_head.dense().detach()[vocab].to(args.device)  # [N, H]
    groups = batches(train_set, args.batch_tokens, rng)
    total = args.epochs * len(groups)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    sched = cosine_schedule(opt, total)
    history, t0 = [], time.time()
    for epoch in range(args.epochs):
        sums = [0.0, 0.0, 0.0]
        for group in track(batches(train_set, args.batch_tokens, rng), description=f"epoch {epoch + 1}",
                           console=console):
            loss, cls, agree = loss_on(net, ends, head, group, args.noise, args.cls_weight, args.unroll)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            sums = [sums[0] + loss.item(), sums[1] + cls, sums[2] + agree]
        with torch.no_grad():
            held_loss = [loss_on(net, ends, head, g, 0.0, args.cls_weight) for g in batches(test_set, 4096, rng)]
        row = {"epoch": epoch + 1, "train_loss": round(sums[0] / len(groups), 4),
               "train_token_loss": round(sums[1] / len(groups), 4), "train_top1": round(sums[2] / len(groups), 4),
               "heldout_token_loss": round(sum(h[1] for h in held_loss) / len(held_loss), 4),
               "heldout_top1": round(sum(h[2] for h in held_loss) / len(held_loss), 4)}
        history.append(row)
        console.print(row)
    net.requires_grad_(False).cpu()
    record = {
        **data.record(args),
        "epochs": args.epochs, "steps": total, "lr": args.lr, "cls_weight": args.cls_weight, "noise": args.noise,
        "unroll": args.unroll, "weight_decay": args.weight_decay, "batch_tokens": args.batch_tokens, "seed": args.seed,
        "history": history, "train_seconds": round(time.time() - t0), "device": args.device,
    }
    args.out = args.out or SHIPPED / "smollm2-135m-instruct-eagle.safetensors"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    net.save(args.out, data.ends, record)
    served = FeatureDraftModel.load("eagle", args.out, TokenEnds.load(data.src, cfg, torch.bfloat16))
    record["heldout_greedy"] = {f"k={k}": simulate(served, test_set, k) for k in sorted({1, 2, args.k})}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    console.print(record["heldout_greedy"])
    return record
