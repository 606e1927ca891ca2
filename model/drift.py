"""What HeadSplit's inter-layer speculation needs to know about a model (tensor code; issue 9's profiling).

Layer l+1's attention may start on Z_l = x + attn(norm(x)), layer l's post-attention state, while layer l's FFN
still computes its output X_l = Z_l + ffn(norm(Z_l)). The speculation is kept for a token when
||Z_l - X_l|| / ||X_l|| < epsilon. `drift` measures that ratio at every layer and position of exact forward
passes over calibration text; `acceptance` turns it into alpha, the per-layer acceptance probability the
planner decides with; `time_blocks` measures what one decoding token costs in each block of a layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgespec.model.blocks import AttentionBlock, causal_mask
from edgespec.model.ffn import FFN
from edgespec.model.kv_cache import KVCache
from edgespec.model.linear import pack_linears
from edgespec.model.stack import LayerStack
from edgespec.model.timing import median_ms


def relative_drift(z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """||Z - X|| / ||X|| per position: z, x [..., H] -> [...] float32."""
    return (z - x).float().norm(dim=-1) / x.float().norm(dim=-1)


@torch.inference_mode()
def drift(stack: LayerStack, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [1, T, H] (embedded tokens) -> [L, T] float32: ||Z_l - X_l|| / ||X_l|| per layer and position."""
    t = hidden.shape[1]
    cache = stack.new_cache(t)
    rope, mask = stack.rotary(torch.arange(t).unsqueeze(0)), causal_mask(0, t)
    x, out = hidden.to(stack.dtype), []
    for i, layer in enumerate(stack.layers):
        z, x = layer.parts(x, rope, cache, i, 0, mask)
        out.append(relative_drift(z, x)[0])  # [T]
    return torch.stack(out)


def acceptance(drifts: Sequence[torch.Tensor], epsilon: float) -> list[float]:
    """alpha per layer from drift() results [L, T_i]: the share of tokens whose previous layer's drift is below
    epsilon, i.e. where starting layer l on Z_(l-1) would be kept. Layer 0 has no previous layer: 0."""
    below = torch.cat(list(drifts), dim=1) < epsilon  # [L, sum T]
    return [0.0] + [round(float(v), 4) for v in below[:-1].float().mean(dim=1)]


@torch.inference_mode()
def time_blocks(stack: LayerStack, context: int, reps: int = 5) -> dict[str, float]:
    """Milliseconds of one decoding token (after `context` cached ones) in each block of a layer: one KV group's
    attention with its share of the output projection, gathering the groups (sum and residual), and the FFN
    with its norms and residual. Random weights of the real shapes: the cost depends on shapes only."""
    cfg, dtype = stack.cfg, stack.dtype
    group = pack_linears(AttentionBlock(cfg, [0], dtype, with_o_bias=cfg.o_bias))
    ffn = pack_linears(FFN(cfg, dtype))
    layer = stack.layers[0]
    norm = layer.post_norm
    # the gathered sum and the FFN's output normed where the architecture norms them
    attn_out = layer.attn_out_norm if layer.attn_out_norm is not None else torch.nn.Identity()
    ffn_out = layer.ffn_out_norm if layer.ffn_out_norm is not None else torch.nn.Identity()
    cache = KVCache.alone(1, 1, cfg.head_dim, context + 1, stack.kv)
    if context:
        cache.write(0, 0, torch.randn(1, 1, context, cfg.head_dim, dtype=dtype),
                    torch.randn(1, 1, context, cfg.head_dim, dtype=dtype))
    x = torch.randn(1, 1, cfg.hidden_size, dtype=dtype)
    rope = stack.rotary(torch.tensor([[context]]))
    partials = [torch.randn(1, 1, cfg.hidden_size, dtype=dtype) for _ in range(cfg.n_kv_heads)]
    return {
        "group_ms": median_ms(lambda: group(x, rope, cache, 0, context, None), reps),
        "proj_ms": median_ms(lambda: x + attn_out(torch.stack(partials).sum(dim=0)), reps),
        "ffn_ms": median_ms(lambda: x + ffn_out(ffn(norm(x))), reps),
    }


@torch.inference_mode()
def speculating_forward(stack: LayerStack, hidden: torch.Tensor, epsilon: float, speculate: Sequence[bool]
                        ) -> tuple[torch.Tensor, list[int]]:
    """A whole-sequence pass with HeadSplit's inter-layer speculation: hidden [1, T, H] -> output [1, T, H], and
    per layer the tokens whose speculation was kept. At a speculating layer l, a token's attention reads
    Z_(l-1) instead of X_(l-1) (its queries, keys and values: the KV entry written is the speculative one)
    when ||Z - X|| / ||X|| < epsilon for that token; the residual is always the exact X_(l-1). Each position
    decides alone and attends to earlier positions' cached entries, so this equals decoding token by token
    with the same decisions. epsilon 0 keeps nothing: the exact model."""
    t = hidden.shape[1]
    cache = stack.new_cache(t)
    rope, mask = stack.rotary(torch.arange(t).unsqueeze(0)), causal_mask(0, t)
    x, z, kept = hidden.to(stack.dtype), None, []
    for i, layer in enumerate(stack.layers):
        attend = x
        if z is not None and speculate[stack.first + i]:
            keep = relative_drift(z, x) < epsilon  # [1, T]
            attend = torch.where(keep.unsqueeze(-1), z, x)
            kept.append(int(keep.sum()))
        else:
            kept.append(0)
        z = x + layer.attention(attend, rope, cache, i, 0, mask)  # its window and output norm where it has them
        x = z + layer.feed_forward(z)
    return x, kept
