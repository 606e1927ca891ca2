"""Measured timings of model parts for the planner's profiles (tensor code; the HTTP side is in workers/).

Times are medians over repeated passes on random hidden states: what a pass costs depends on shapes, not
values. Each point is one pass of `tokens` new tokens after `context` cached ones.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from edgespec.model.config import ModelConfig
from edgespec.model.expert_split import ExpertShelf, LocalExperts
from edgespec.model.kv_format import FLOAT32, KVFormat
from edgespec.model.linear import WeightFormat, as_format, bytes_per_param
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.planning.profile import Curve, ModelCard

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXTS = (0, 2048)  # attention's cost is linear in the context: two points suffice
PROFILE_LAYERS = 4  # timed together and divided: fewer calls' overhead per layer than one at a time


def model_card(cfg: ModelConfig, name: str, fmt: WeightFormat | torch.dtype | str,
               from_gguf: bool = False, kv: KVFormat = FLOAT32) -> ModelCard:
    """The planner's view of a model in a weight format: real bytes per parameter of its layers (Q4 blocks are
    0.75 bytes, not a float's size), activations at the format's activation dtype, the KV cache in `kv`."""
    fmt = as_format(fmt)
    act = torch.finfo(fmt.act).bits // 8
    ends = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    tables = 2 if cfg.rope_local_theta is not None else 1  # Rotary's cos and sin [positions, hd], the local ones
    return ModelCard(name, cfg.n_layers, cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                     cfg.layer_param_count(), ends, cfg.max_position_embeddings,
                     bytes_per_param(fmt, from_gguf), kv.bytes_per_value(), act, n_experts=cfg.n_experts,
                     experts_per_token=cfg.experts_per_token, expert_params=cfg.expert_params,
                     stage_bytes=tables * 2 * cfg.max_position_embeddings * cfg.head_dim * act)


def grid(cfg: ModelConfig, tokens: Sequence[int], contexts: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token and context points that fit the model's context; a context past it is replaced by the longest
    that fits (a 2048-token model profiled only at context 0 was predicted no cost of attention at all)."""
    limit = cfg.max_position_embeddings
    toks = tuple(n for n in tokens if n <= limit) or (1,)
    ctxs = {c for c in contexts if c + toks[-1] <= limit}
    if any(c + toks[-1] > limit for c in contexts) and limit - toks[-1] > 0:
        ctxs.add(limit - toks[-1])
    return toks, tuple(sorted(ctxs)) or (0,)


def median_ms(fn: Callable[[], object], reps: int, min_total_s: float = 0.05, max_reps: int = 50) -> float:
    # At least `reps` runs and at least min_total_s of them (short passes need many runs for a stable median
    # on a shared machine, where one descheduled OpenMP thread costs a whole scheduler tick).
    fn()  # warm-up: first calls allocate and pick kernels
    times: list[float] = []
    while len(times) < reps or (sum(times) < min_total_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def time_layers(stack: LayerStack, tokens: Sequence[int], contexts: Sequence[int], reps: int = 3,
                step: Callable[[], None] | None = None) -> Curve:
    """Milliseconds per decoder layer at each (context, tokens) point; `step` is called after each point."""
    cfg, n_layers = stack.cfg, len(stack.layers)
    toks, ctxs = grid(cfg, tokens, contexts)
    rows = []
    for c in ctxs:
        cache = stack.new_cache(c + toks[-1])
        if c:  # fill the context once; each timed pass is then truncated back to it
            stack(torch.randn(1, c, cfg.hidden_size), torch.arange(c).unsqueeze(0), cache, 0)
        row = []
        for n in toks:
            hidden, positions = torch.randn(1, n, cfg.hidden_size), torch.arange(c, c + n).unsqueeze(0)

            def one(hidden=hidden, positions=positions, c=c, cache=cache):
                stack(hidden, positions, cache, c)
                cache.truncate(c)

            row.append(median_ms(one, reps) / n_layers)
            if step:
                step()
        rows.append(tuple(row))
    return Curve(toks, ctxs, tuple(rows))


@torch.inference_mode()
def time_split(src, cfg: ModelConfig, fmt: WeightFormat | torch.dtype | str, reps: int = 5) -> float:
    """Milliseconds a sparse layer's one-row pass costs more when run in steps, half its experts (the odd ids)
    held by another device, than held whole: its steps from Python and the experts' second call, the other
    device in this process (its link's round trip is the profile's). 0 for a dense model."""
    fmt = as_format(fmt)
    layer = next((i for i in range(cfg.n_layers) if cfg.sparse(i)), None)
    if layer is None:
        return 0.0
    odd = list(range(1, cfg.n_experts, 2))
    links = LocalExperts({"other": ExpertShelf(src, cfg, fmt, {layer: odd})})
    stacks = [LayerStack.load(src, cfg, layer, layer + 1, fmt),
              LayerStack.load(src, cfg, layer, layer + 1, fmt, away={layer: {"other": odd}}, links=links)]
    x, positions = torch.randn(1, 1, cfg.hidden_size), torch.zeros(1, 1, dtype=torch.long)

    def ms(stack: LayerStack) -> float:
        cache = stack.new_cache(1)

        def one() -> None:
            stack(x, positions, cache, 0)
            cache.truncate(0)

        return median_ms(one, reps)

    whole, split = ms(stacks[0]), ms(stacks[1])
    return max(0.0, split - whole)


@torch.inference_mode()
def time_ends(ends: TokenEnds, tokens: Sequence[int], reps: int = 3) -> tuple[Curve, Curve]:
    """Embedding and head (final norm + LM head over every position) milliseconds by tokens in the pass."""
    cfg = ends.cfg
    toks, _ = grid(cfg, tokens, (0,))
    embed, head = [], []
    for n in toks:
        ids = torch.randint(0, cfg.vocab_size, (1, n))
        hidden = torch.randn(1, n, cfg.hidden_size)
        embed.append(median_ms(functools.partial(ends.embed_tokens, ids), reps))
        head.append(median_ms(functools.partial(ends.logits, hidden), reps))
    return Curve(toks, (0,), (tuple(embed),)), Curve(toks, (0,), (tuple(head),))


def profile_points(cfg: ModelConfig, tokens: Sequence[int], contexts: Sequence[int]) -> int:
    """How many timed points time_layers will measure (for progress bars)."""
    toks, ctxs = grid(cfg, tokens, contexts)
    return len(toks) * len(ctxs)
