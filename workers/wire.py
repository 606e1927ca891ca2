"""What crosses the network between stages: tensors as safetensors bytes, never JSON lists.

A forward call's body holds `hidden` [B, T, H] and, only when they differ from the defaults, `positions`
[B, T] (default: the slots) and `mask` [B, T, S] (default: causal). Everything else (session, slot, step,
route) travels in the query string and headers, so a decoding step's body is the hidden state plus about
80 bytes of safetensors header.
"""

from __future__ import annotations

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
