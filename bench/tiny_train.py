"""A brief, deterministic training of a tiny random model (bench/gguf_writer.py's `tiny_model`) in its folder, so
that its next-token distributions have a trained model's margins: a random model's are nearly flat, so every
rounding of a quantized file flips its top-1 token and a top-1 agreement measures the flatness, not the
arithmetic. AdamW in float32 on the instructions and outputs of a prompt set (alpaca_seed_tasks.jsonl, not the
held-out text the agreement is measured on) in the tokenizer's chat template, packed into one stream and cut into
short windows at seeded offsets; the folder is saved back by transformers' own class, so it stays what
`write_gguf` reads and transformers loads.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TrainSettings:
    """How a tiny model is trained: `steps` AdamW steps of `batch` windows of `seq` tokens each."""

    steps: int = 150
    batch: int = 4
    seq: int = 64
    lr: float = 3e-3
    warmup: int = 10
    seed: int = 0


def chat_stream(tokenizer, data: Path) -> torch.Tensor:
    """Every task of an alpaca-style prompt set (`instruction`, `instances` of `input` and `output`) as a user turn
    and an assistant turn in the tokenizer's chat template, one after another: token ids [N]."""
    ids: list[int] = []
    for line in data.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        for inst in row["instances"]:
            user = row["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
            text = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                  {"role": "assistant", "content": inst["output"]}], tokenize=False)
            ids += tokenizer.encode(text, add_special_tokens=False)
    return torch.tensor(ids)


def mean_loss(model, ids: list[int]) -> float:
    """The model's mean next-token cross-entropy (nats) over `ids`, teacher-forced in one pass."""
    with torch.no_grad():
        x = torch.tensor([ids])
        return float(model(x, labels=x).loss)


def train_tiny(folder: Path, data: Path, held_out: list[int], settings: TrainSettings = TrainSettings()) -> dict:
    """Trains the model saved in `folder` on `data` (see chat_stream) and saves it back there. Returns the
    settings, the held-out loss (on the token ids `held_out`) before and after, the first and last steps' training
    losses and the seconds it took."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    torch.manual_seed(settings.seed)
    stream = chat_stream(AutoTokenizer.from_pretrained(folder), data)  # [N]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()  # no dropout: the tiny configs have none, and a step is then a function of the seed alone
    before = mean_loss(model, held_out)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    # linear warmup, then cosine decay to a tenth
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / settings.warmup) * (
        0.55 + 0.45 * torch.cos(torch.tensor(torch.pi * s / max(1, settings.steps))).item()))
    gen = torch.Generator().manual_seed(settings.seed)
    losses = []
    for _ in range(settings.steps):
        starts = torch.randint(0, len(stream) - settings.seq, (settings.batch,), generator=gen)
        x = torch.stack([stream[s:s + settings.seq] for s in starts.tolist()])  # [B, seq]
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    after = mean_loss(model, held_out)
    model.save_pretrained(folder)
    return {**asdict(settings), "data": str(data), "tokens": len(stream), "held_out_tokens": len(held_out),
            "held_out_loss_before": before, "held_out_loss_after": after,
            "train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
            "seconds": time.perf_counter() - start}
