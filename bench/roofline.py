"""The roofline of decoding one token: every weight is read once per pass, so a machine that reads B bytes/s
can decode at most B / (bytes of the weights) tokens/s at one row. `edgespec bench-peer` reports each
configuration's weight bytes per token, this machine's read bandwidth measured in the same run, and the
fraction of that limit its decode speed reaches (a policy that accepts several tokens per pass can pass 1).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

READ_MIB = 1024  # far beyond any cache: the bandwidth of memory, not of L3
READ_REPEATS = 7


def read_bandwidth(threads: int | None = None) -> dict:
    """Bytes per second a reduction over a 1 GiB float32 tensor reads, on `threads` threads (torch's count by
    default, as a server's); the median of READ_REPEATS after one warm-up pass, and the best."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        data = torch.ones(READ_MIB * 2**20 // 4)
        data.sum()  # warm-up: pages touched, threads started
        seconds = []
        for _ in range(READ_REPEATS):
            t0 = time.perf_counter()
            data.sum()
            seconds.append(time.perf_counter() - t0)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    nbytes = data.numel() * 4
    return {"median_gb_per_s": round(nbytes / statistics.median(seconds) / 1e9, 2),
            "best_gb_per_s": round(nbytes / min(seconds) / 1e9, 2), "threads": used,
            "method": f"torch.sum over {READ_MIB} MiB of float32, median of {READ_REPEATS} after a warm-up"}


def gguf_bytes_per_token(gguf: Path) -> int:
    """What llama.cpp reads per token of a GGUF: every tensor as stored, but of the token embedding only one row
    unless it is also the output head (a tied embedding: no `output.weight`), and of a mixture's stacked experts
    (`ffn_*_exps`) the share a token chooses, experts_per_token of n_experts."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = reader.fields["general.architecture"].contents()
    count, used = (reader.fields.get(f"{arch}.expert_{key}") for key in ("count", "used_count"))
    share = used.contents() / count.contents() if count is not None and used is not None else 1.0
    tensors = {t.name: int(t.n_bytes) * (share if "_exps." in t.name else 1) for t in reader.tensors}
    embed = tensors.pop("token_embd.weight", 0)
    return round(sum(tensors.values()) + (0 if "output.weight" in tensors else embed))


@torch.inference_mode()
def edgespec_bytes_per_token(fmt: str, model: str | None = None) -> int:
    """What edgespec reads per token of `model` (None: the default) in weight format `fmt` (`default`: the
    server's default, auto): the decoder layers' and the ends' weights as held (the tied head's table once), of a
    mixture's experts the share a token chooses."""
    from edgespec.model.config import ModelConfig
    from edgespec.model.ffn import Experts
    from edgespec.model.kv_format import kv_format
    from edgespec.model.linear import linear_bytes, weight_format
    from edgespec.model.source import resolve_model
    from edgespec.model.stack import LayerStack, TokenEnds
    from edgespec.model.weights import open_source

    files = resolve_model(model)
    cfg = ModelConfig.from_folder(files.folder)
    src = open_source(files)
    wf = weight_format("auto" if fmt == "default" else fmt)
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, wf, kv_format("float16"))
    experts = sum(linear_bytes(m.experts) for m in stack.modules() if isinstance(m, Experts))
    unread = experts * (1 - cfg.experts_per_token / cfg.n_experts) if cfg.n_experts else 0
    return round(linear_bytes(stack) - unread + linear_bytes(TokenEnds.load(src, cfg, wf)))


def add_roofline(rows: list[dict], bandwidth: float, bytes_per_token: dict[str, int]) -> None:
    """Per configuration row (keyed by its format, or the peer's by its server): weight MiB per token, the
    limit they set at `bandwidth` bytes/s, and the fraction of it the row's median decode speed reaches."""
    for row in rows:
        nbytes = bytes_per_token.get(row["server"] if row["server"] == row["policy"] else row["format"])
        rate = row["median_decode_tokens_per_s"]
        limit = bandwidth / nbytes if nbytes else None
        row["weight_mib_per_token"] = round(nbytes / 2**20, 1) if nbytes else None
        row["roofline_tokens_per_s"] = round(limit, 1) if limit else None
        row["fraction_of_roofline"] = round(rate / limit, 3) if limit and rate else None
