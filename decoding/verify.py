"""Speculative sampling's acceptance rule (Leviathan et al. 2023; Chen et al. 2023), exact for any drafter.

Drafted tokens x_1..x_K were proposed from distributions q_1..q_K (one-hot for a drafter without
probabilities). The target's distributions p_1..p_K+1 come from one verification pass, each through the
request's Sampler, so temperature, top_k, top_p, min_p, logit_bias and penalties shape p exactly as they
would for naive decoding (penalties see the tokens accepted before each position). Then, in order:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
    on the first rejection, emit a token from normalize(max(0, p_i - q_i)) and stop;
    when all K are accepted, emit one bonus token from p_K+1.

Each emitted token is distributed as the target's next-token distribution given the tokens before it. At
temperature 0, p_i is one-hot on the target's argmax: the rule keeps drafts while they equal it, then
emits the argmax, which is greedy decoding exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.decoding.sampling import Sampler


@dataclass
class Verdict:
    tokens: list[int]  # the accepted drafts, then the replacement or the bonus token
    accepted: int  # how many drafts were kept


def _uniform(sampler: Sampler) -> float:
    return float(torch.rand((), generator=sampler.generator, dtype=torch.float64))


def verify(sampler: Sampler, target_logits: torch.Tensor, drafts: list[int],
           draft_probs: torch.Tensor | None = None) -> Verdict:
    """target_logits [K+1, V] float32 at the positions that predict each draft and the token after them;
    drafts: K token ids; draft_probs [K, V] the drafter's distributions, or None for point masses.
    Records every emitted token in the sampler (for penalties)."""
    if sampler.params.greedy:
        return _verify_greedy(sampler, target_logits, drafts)
    out: list[int] = []
    for i, x in enumerate(drafts):
        p = sampler.probs(target_logits[i]).double()  # [V]
        q = None if draft_probs is None else draft_probs[i].double()
        qx = 1.0 if q is None else float(q[x])
        if qx > 0 and _uniform(sampler) < min(1.0, float(p[x]) / qx):
            sampler.observe(x)
            out.append(x)
            continue
        if q is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        # the residual is empty only when p == q, where every draft is accepted; guard against rounding
        token = sampler.sample(residual / total if total > 0 else p)
        sampler.observe(token)
        out.append(token)
        return Verdict(out, i)
    bonus = sampler.sample(sampler.probs(target_logits[len(drafts)]))
    sampler.observe(bonus)
    return Verdict([*out, bonus], len(drafts))


def _verify_greedy(sampler: Sampler, target_logits: torch.Tensor, drafts: list[int]) -> Verdict:
    # The rule at temperature 0, whatever q: p_i is one-hot on the argmax a_i, so x_i is kept iff x_i = a_i, and the
    # replacement, from max(0, p_i - q_i), is a_i. Each a_i is what Sampler.choose picks (penalties and grammar
    # applied, the token recorded), without the rule's vocabulary-wide vectors (one-hot p, q, the residual): over
    # SmolLM2's 49k ids, 33 us against 65 with no draft, 116 against 165 for two drafts with the second rejected.
    out: list[int] = []
    for i, x in enumerate(drafts):
        out.append(sampler.choose(target_logits[i]))
        if out[-1] != x:
            return Verdict(out, i)
    out.append(sampler.choose(target_logits[len(drafts)]))
    return Verdict(out, len(drafts))
