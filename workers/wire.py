"""What crosses the network between stages: tensors as safetensors bytes, never JSON lists.

A forward call's body holds `hidden` [B, T, H] and, only when they differ from the defaults, `positions`
[B, T] (default: the slots) and `mask` [B, T, S] (default: causal). Everything else (session, slot, step,
route) travels in the query string and headers, so a decoding step's body is the hidden state plus about
80 bytes of safetensors header. A shared step of several sessions is one BatchMessage, its entries in the
safetensors metadata, so a step costs one message per link however many streams it carries.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

ALLOWED_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool}


class WireError(ValueError):
    """A body that is not a valid tensor message; the message says what is wrong."""


def encode(tensors: dict[str, torch.Tensor | None]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items() if v is not None})


def decode(body: bytes, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Parse a safetensors body and check that it holds exactly the expected names with sane dtypes."""
    try:
        tensors = st_load(body)
    except Exception as exc:  # safetensors raises its own error types for truncated or garbled bodies
        raise WireError(f"body is not a safetensors message: {exc}") from exc
    missing = [n for n in required if n not in tensors]
    extra = [n for n in tensors if n not in required and n not in optional]
    if missing or extra:
        raise WireError(f"tensor names: missing {missing}, unexpected {extra}")
    for name, t in tensors.items():
        if t.dtype not in ALLOWED_DTYPES:
            raise WireError(f"{name} has dtype {t.dtype}, not one of the allowed dtypes")
    return tensors


@dataclass(frozen=True)
class BatchMessage:
    """A step's rows of several sessions in one forward call (one message per link per step, whatever the
    number of streams): hidden [M, H] holds each entry's rows in turn at RoPE positions [M]; entry i is
    (session, start, length, step) and masks[i] its bool [1, length, start+length] mask, or None (causal)."""

    entries: list[tuple[str, int, int, int]]
    hidden: torch.Tensor
    positions: torch.Tensor
    masks: list[torch.Tensor | None]

    @property
    def key(self) -> tuple[str, int]:
        """The (session, step) the result is posted under: unique, since each session's steps are."""
        return self.entries[0][0], self.entries[0][3]


def encode_batch(message: BatchMessage) -> bytes:
    """The entries travel as the safetensors header's metadata, the tensors as tensors."""
    tensors = {"hidden": message.hidden.contiguous(), "positions": message.positions.contiguous()}
    tensors |= {f"mask.{i}": m.contiguous() for i, m in enumerate(message.masks) if m is not None}
    return st_save(tensors, metadata={"entries": json.dumps(message.entries)})


def decode_batch(body: bytes, max_entries: int = 1024) -> BatchMessage:
    """Parse and check a batch message: the entries' rows add up to hidden's and positions' rows, masks fit."""
    try:
        (n,) = struct.unpack("<Q", body[:8])
        entries = json.loads(json.loads(body[8:8 + n])["__metadata__"]["entries"])
    except Exception as exc:
        raise WireError(f"a batch body needs its entries in the safetensors metadata: {exc}") from exc
    if (not isinstance(entries, list) or not 1 <= len(entries) <= max_entries or not all(
            isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and 0 < len(e[0]) <= 128
            and all(isinstance(v, int) and not isinstance(v, bool) for v in e[1:]) for e in entries)):
        raise WireError(f"entries must be 1 to {max_entries} lists [session, start, length, step]")
    if any(start < 0 or length < 1 or step < 0 for _, start, length, step in entries):
        raise WireError("an entry needs start >= 0, length >= 1 and step >= 0")
    if len({e[0] for e in entries}) != len(entries):
        raise WireError("a batch names each session once")
    names = tuple(f"mask.{i}" for i in range(len(entries)))
    tensors = decode(body, ("hidden", "positions"), names)
    hidden, positions = tensors["hidden"], tensors["positions"]
    rows = sum(e[2] for e in entries)
    if hidden.dim() != 2 or hidden.shape[0] != rows or not hidden.is_floating_point():
        raise WireError(f"hidden must be float [{rows}, H] for these entries, got {hidden.dtype} {list(hidden.shape)}")
    if positions.dtype != torch.int64 or list(positions.shape) != [rows]:
        raise WireError(f"positions must be int64 [{rows}], got {positions.dtype} {list(positions.shape)}")
    masks = [tensors.get(name) for name in names]
    for (_, start, length, _), mask in zip(entries, masks, strict=True):
        if mask is not None and (mask.dtype != torch.bool or list(mask.shape) != [1, length, start + length]):
            raise WireError(f"mask must be bool [1, {length}, {start + length}], got {mask.dtype} {list(mask.shape)}")
    return BatchMessage([tuple(e) for e in entries], hidden, positions, masks)


def encode_group_kv(kv: dict) -> bytes:
    """Moving KV groups' caches (session -> layer -> group -> (k, v)) as one message, named SESSION/LAYER/GROUP/k|v."""
    return encode({f"{s}/{layer}/{g}/{kind}": t for s, layers in kv.items() for layer, groups in layers.items()
                   for g, pair in groups.items() for kind, t in zip("kv", pair, strict=True)})


def decode_group_kv(body: bytes) -> dict:
    """The inverse of encode_group_kv, checked: names of that form, float tensors [1, 1, length, hd] in pairs."""
    try:
        tensors = st_load(body) if body else {}
    except Exception as exc:
        raise WireError(f"body is not a safetensors message: {exc}") from exc
    out: dict = {}
    for name, t in tensors.items():
        parts = name.split("/")
        if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit() or parts[3] not in ("k", "v"):
            raise WireError(f"{name!r} is not SESSION/LAYER/GROUP/k or v")
        if not t.is_floating_point() or t.dim() != 4 or t.shape[:2] != (1, 1):
            raise WireError(f"{name} must be float [1, 1, length, head_dim], got {t.dtype} {list(t.shape)}")
        out.setdefault(parts[0], {}).setdefault(int(parts[1]), {}).setdefault(int(parts[2]), {})[parts[3]] = t
    for s, layers in out.items():
        for layer, groups in layers.items():
            for g, pair in groups.items():
                if set(pair) != {"k", "v"} or pair["k"].shape != pair["v"].shape:
                    raise WireError(f"session {s} layer {layer} group {g}: keys and values must come in equal pairs")
                groups[g] = (pair["k"], pair["v"])
    return out
