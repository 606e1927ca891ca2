"""What trained add-ons (feature drafter, Medusa heads) share about the served model they were trained for:
a fingerprint checked at load, and the model's own head restricted to a vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from edgespec.model.stack import TokenEnds

SHIPPED = Path(__file__).parent / "trained"  # add-ons trained for the embedded model, in the repository


def fingerprint(ends: TokenEnds) -> list[float]:
    """A few numbers that tell the target apart: sums of embedding rows spread over the vocabulary."""
    rows = torch.linspace(0, ends.cfg.vocab_size - 1, 16).long()
    return [round(float(v), 3) for v in ends.embed(rows).float().sum(dim=1)]


def target_metadata(ends: TokenEnds) -> dict[str, str]:
    """safetensors metadata naming the target (read back by check_target)."""
    return {"hidden_size": str(ends.cfg.hidden_size), "vocab_size": str(ends.cfg.vocab_size),
            "fingerprint": json.dumps(fingerprint(ends))}


def check_target(what: str, path: Path, ends: TokenEnds) -> dict[str, str]:
    """The file's metadata; a ValueError that says so when it was trained for another model than `ends`'."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    cfg = ends.cfg
    if (meta.get("hidden_size"), meta.get("vocab_size")) != (str(cfg.hidden_size), str(cfg.vocab_size)):
        raise ValueError(f"{what} ({path}) was trained for a model of hidden size {meta.get('hidden_size')} and "
                         f"vocabulary {meta.get('vocab_size')}, not this one's {cfg.hidden_size} and {cfg.vocab_size}")
    want, got = torch.tensor(json.loads(meta.get("fingerprint", "[]"))), torch.tensor(fingerprint(ends))
    if want.shape != got.shape or not torch.allclose(want, got, rtol=0.02, atol=0.05):
        raise ValueError(f"{what} ({path}) was trained for another model: its embedding fingerprint differs from "
                         f"the served model's")
    return meta


def restricted_head(ends: TokenEnds, vocab: torch.Tensor) -> nn.Module:
    """The served model's head restricted to the ids `vocab` [N]: hidden [..., H] -> logits [..., N], in the
    head's own format (8-bit blocks for the default model): only those rows are taken, not a dequantized copy
    of the whole head (113 MB of float32 for SmolLM2 at start-up, twice: the feature drafter and Medusa)."""
    return ends.lm_head.rows(vocab)
