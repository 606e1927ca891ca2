"""Speculative decoding: a drafter proposes K tokens, one forward pass of the target verifies them all, the
acceptance rule (decoding/verify.py) keeps a prefix plus one token, and the rejected positions are rolled
back on every stage. Exact: the output is distributed as naive decoding's (greedy: the same tokens).
"""

from __future__ import annotations

import time

import torch

from decoding.drafters import LookupFirst, NgramDrafter
from decoding.sampling import Sampler
from decoding.stats import StepStats, push_run
from decoding.text import TextStream
from decoding.types import GenerationRequest
from decoding.verify import verify
from model.runner import ModelRunner


class AdaptiveK:
    """Draft length from the running acceptance: longer while drafts are kept, shorter while rejected."""

    def __init__(self, k: int, k_min: int, k_max: int, fixed: bool):
        self.k, self.k_min, self.k_max, self.fixed = k, k_min, k_max, fixed

    def update(self, proposed: int, accepted: int) -> None:
        if self.fixed or proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif accepted < proposed // 2:
            self.k = max(self.k - 1, self.k_min)


class SpeculativePolicy:
    name = "speculative"
    options = frozenset({"drafter", "k"})

    def __init__(self, models: dict | None = None, default: str | None = None, k: int = 4, k_min: int = 1,
                 k_max: int = 8):
        """models: DraftModels or FeatureDraftModels by drafter name (draft checkpoints, layer-skipping
        self-drafts, trained feature drafters); default: the drafter of the plain `speculative` policy (the
        first model's behind n-gram lookup, NAME+ngram: the best measured on open chat and on copying alike;
        without models, n-gram lookup)."""
        self.k, self.k_min, self.k_max = k, k_min, k_max
        self.drafters = {"ngram": lambda params, capacity: NgramDrafter()}
        for name, m in (models or {}).items():
            self.drafters[name] = m.drafter
            # the model's drafts, except where the output is copying from earlier text
            self.drafters[f"{name}+ngram"] = lambda params, capacity, m=m: LookupFirst(m.drafter(params, capacity))
        self.default = default or (f"{next(iter(models))}+ngram" if models else "ngram")
        if self.default not in self.drafters:
            raise ValueError(f"unknown default drafter {self.default!r}; available: {', '.join(self.drafters)}")

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use."""
        name = options.get("drafter", self.default)
        if name not in self.drafters:
            raise ValueError(f"unknown drafter {name!r}; available: {', '.join(sorted(self.drafters))}")
        k = options.get("k", self.k)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise ValueError(f"k must be an integer from 1 to 32, got {k!r}")

    async def generate(self, request: GenerationRequest, model: ModelRunner, tokenizer):
        options = request.policy_options
        capacity = min(len(request.prompt_ids) + request.max_tokens + max(self.k_max, options.get("k", 0)),
                       model.cfg.max_position_embeddings)
        # Built on the model thread: a drafter allocates tensors, and one parallel op on the event loop's thread
        # gives the process a second OpenMP team that then competes with the model thread's for the cores
        # (measured: naive decoding fell from 39 to 23 tokens/s for the rest of the process's life).
        drafter = await model.call(self.drafters[options.get("drafter", self.default)], request.sampling, capacity)
        on_thread = getattr(drafter, "on_model_thread", False)
        observe = getattr(drafter, "observe", None)  # a feature drafter reads the target's hidden states
        k = AdaptiveK(options.get("k", self.k), self.k_min, max(self.k_max, options.get("k", 0)), "k" in options)
        sampler = await model.call(Sampler, request.sampling, model.cfg.vocab_size)
        text = TextStream(tokenizer, request.stop, request.stop_token_ids, request.max_tokens)
        stats = StepStats(self.name)
        stats.drafter = drafter.name
        prompt = request.prompt_ids
        session = await model.open(capacity, prompt=prompt)
        stats.cached_prompt_tokens = session.length
        want_logprobs = request.sampling.logprobs
        try:
            cached = session.length

            def first(logits, hidden=None):  # [1, 1, V] and [1, T, H], on the model thread
                if observe:
                    observe(cached, hidden[0])
                return [sampler.choose_with_logprob(logits[0, -1])]

            step = await model.prefill(session, prompt, then=first, features=observe is not None)
            tokens = list(prompt)
            while True:
                emitted = [t for t, _ in step]
                tokens += emitted
                event = push_run(text, step, stats, model.wire(session))
                yield event
                if event.finish_reason:
                    return
                t0 = time.perf_counter()
                # the verification adds one token of its own, and its 1 + K slots must fit the cache
                budget = min(request.max_tokens - len(text.ids), session.capacity - session.length) - 1
                drafts, q = [], None
                if budget > 0 and on_thread:  # a model drafter's tensor work
                    drafts, q = await model.call(drafter.propose, tokens, min(k.k, budget))
                elif budget > 0:
                    drafts, q = drafter.propose(tokens, min(k.k, budget))
                stats.drafter_s += time.perf_counter() - t0

                start = session.length

                def check(logits, hidden=None, drafts=drafts, q=q, start=start):  # [1, 1 + K, V], model thread
                    verdict = verify(sampler, logits[0], drafts, q)
                    if observe:  # the accepted positions' hidden states [1 + accepted, H]
                        observe(start, hidden[0, :1 + verdict.accepted])
                    lps = [sampler.logprob(logits[0, j], t) if want_logprobs else None
                           for j, t in enumerate(verdict.tokens)]
                    return verdict, lps

                verdict, lps = await model.forward(session, torch.tensor([[emitted[-1], *drafts]]), then=check,
                                                   features=observe is not None)
                if verdict.accepted < len(drafts):  # roll back the rejected drafts on every stage
                    await model.truncate(session, start + 1 + verdict.accepted)
                stats.proposed += len(drafts)
                stats.accepted += verdict.accepted
                k.update(len(drafts), verdict.accepted)
                step = list(zip(verdict.tokens, lps, strict=True))
        finally:
            await model.release(session)
