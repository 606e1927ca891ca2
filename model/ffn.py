"""A decoder layer's feed-forward: the gated FFN, and a mixture of experts in its place (Qwen3-MoE's sparse
block), whose experts may be placed on several devices (model/expert_split.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.model.config import ModelConfig
from edgespec.model.linear import Kernel, compiled, kernels_take
from edgespec.model.module_list import ModuleList


class FFN(nn.Module):
    """Gated feed-forward block, act(gate) * up, with the gate and up projections fused into one matrix: SiLU
    (SwiGLU, the compiled kernels' only activation) or the tanh form of GELU (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, size: int | None = None):
        super().__init__()
        self.act = cfg.hidden_act
        self.inter = cfg.intermediate_size if size is None else size  # an expert's: cfg.expert_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias, dtype=dtype)
        self.down = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.requires_grad_(False)

    @property
    def compiled(self) -> bool:
        # ffn.cpp's Ffn is SwiGLU only: another activation runs the projections' kernels one by one
        return isinstance(self.gate_up, Kernel) and isinstance(self.down, Kernel) and self.act == "silu"

    def weights(self):
        """The block's weights as ffn.cpp's Ffn (`compiled` must hold)."""
        return compiled().Ffn(self.gate_up.kernel, self.down.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, H] -> [B, T, H]
        if self.compiled:
            return self.weights()(x.float())
        gate_up = self.gate_up(x)  # [B, T, 2I]
        if self.act == "silu" and gate_up.dtype == torch.float32 and kernels_take(gate_up):
            return self.down(compiled().silu_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        if self.act == "gelu_pytorch_tanh":  # elementwise: each row's bits whatever the pass
            return self.down(F.gelu(gate, approximate="tanh") * up)
        return self.down(F.silu(gate) * up)


class Experts(nn.Module):
    """A mixture of experts in place of the FFN (Qwen3-MoE's sparse block): the router's logits over the experts,
    their softmax in float32, each row's top experts_per_token (renormalised to sum 1 where norm_topk_prob), and
    each chosen expert, an FFN of its own, run over just the rows that chose it. A row's output is its experts'
    weighted outputs added in ascending expert order (transformers' index_add_ order). On the compiled kernels
    that is one call (ffn.cpp's Ffn, built once: `weights()`), whose bits do not depend on the rows beside a row
    in the pass; otherwise (bfloat16, training) torch's ops run it expert by expert.

    It holds the experts `held` (every one by default): where the planner placed some of a layer's experts on
    other devices, the layer's device holds the router and the rest, and runs the three steps apart (`route`,
    `partials` here and on each other device, `combine`: model/expert_split.py); an expert host holds some
    experts of a layer without its router (`router=False`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, held: Sequence[int] | None = None, router: bool = True):
        super().__init__()
        self.top_k, self.renorm, self.n_experts = cfg.experts_per_token, cfg.norm_topk_prob, cfg.n_experts
        self.held = tuple(range(cfg.n_experts)) if held is None else tuple(sorted(held))
        if not self.held or self.held[0] < 0 or self.held[-1] >= cfg.n_experts or len(set(self.held)) < len(self.held):
            raise ValueError(f"held experts {list(self.held)} are not distinct ids of the {cfg.n_experts}")
        self.router = nn.Linear(cfg.hidden_size, cfg.n_experts, bias=False, dtype=dtype) if router else None
        self.experts: ModuleList[FFN] = ModuleList(FFN(cfg, dtype, cfg.expert_size) for _ in self.held)
        self._weights = None  # weights(), once loaded
        self.requires_grad_(False)

    @property
    def whole(self) -> bool:
        """Whether every expert and the router are here (the layer runs in one call)."""
        return self.router is not None and len(self.held) == self.n_experts

    @property
    def compiled(self) -> bool:
        """Whether the mixture runs on ffn.cpp's Ffn: the router (where held) and every held expert compiled."""
        if self._weights is not None:  # built: asked of a few hundred experts on every pass, it cost 30 us a call
            return True
        return (self.router is None or isinstance(self.router, Kernel)) and all(e.compiled for e in self.experts)

    def weights(self):
        """The mixture's weights as ffn.cpp's Ffn (`compiled` must hold), built on first use: the weights do not
        change once loaded, and a mixture's handles are a few hundred."""
        if self._weights is None:
            self._weights = compiled().Ffn(None if self.router is None else self.router.kernel, list(self.held),
                                           [e.gate_up.kernel for e in self.experts],
                                           [e.down.kernel for e in self.experts], self.n_experts, self.top_k,
                                           self.renorm)
        return self._weights

    def route(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [M, H] (normed) -> each row's experts int64 [M, k] and their weights float32 [M, k]."""
        if self.router is None:
            raise ValueError("an expert host's experts have no router")
        if self.compiled:
            return self.weights().route(rows.float())
        probs = torch.softmax(self.router(rows).float(), dim=-1)  # [M, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def partials(self, rows: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [M, H] (normed), each row's experts and weights [M, k] -> each slot's weighted output [M, k, H]
        for the slots whose expert is held here, zeros elsewhere."""
        if self.compiled:
            return self.weights().experts(rows.float(), chosen, weights)
        out = rows.new_zeros((*chosen.shape, rows.shape[-1]))
        for i, e in enumerate(self.held):
            at, slot = (chosen == e).nonzero(as_tuple=True)  # the rows that chose e, and where in their top-k
            if len(at):
                out[at, slot] = self.experts[i](rows[at][None])[0] * weights[at, slot, None].to(rows.dtype)
        return out

    def combine(self, chosen: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        """chosen [M, k], every slot's weighted output [M, k, H] -> [M, H]: each row's slots added from zero in
        ascending expert order, wherever they were computed."""
        if self.compiled:
            return self.weights().combine(chosen, parts)
        ordered = parts.gather(1, chosen.argsort(dim=1)[..., None].expand_as(parts))  # [M, k, H], ascending experts
        out = torch.zeros_like(parts[:, 0])
        for j in range(ordered.shape[1]):
            out = out + ordered[:, j]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [B, T, H] -> [B, T, H]
        if not self.whole:
            raise ValueError("a mixture placed on several devices runs in steps (model/expert_split.py)")
        if self.compiled:
            return self.weights()(x.float())
        rows = x.reshape(-1, x.shape[-1])  # [M, H]
        chosen, weights = self.route(rows)
        return self.combine(chosen, self.partials(rows, chosen, weights)).view_as(x)
