"""Model drafters: a small model in the controller proposes the drafts, from its own distributions.

The draft model is a separate checkpoint that shares the target's tokenizer, or the target itself with some
of its layers skipped (a self-draft, as in Draft & Verify, Zhang et al. 2023). Its weights are loaded once
per server (DraftModel); each request gets a ModelDrafter with its own KV cache, kept in step with the
sequence: after a verification it rolls back to what was accepted and feeds what it has not seen.
Tensor code: propose runs on the model thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgespec.decoding.sampling import Sampler
from edgespec.decoding.types import SamplingParams
from edgespec.engine.prefix import common_prefix
from edgespec.model.config import ModelConfig
from edgespec.model.kv_cache import KVCache
from edgespec.model.linear import weight_format
from edgespec.model.load import load_tokenizer
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def runs(layers: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 7, 8] -> [(0, 3), (7, 9)]: contiguous ranges of the layers kept."""
    out: list[tuple[int, int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def check_tokenizer(name: str, draft_tokenizer, target_tokenizer) -> None:
    """A draft model must map text to the same ids as the target, or its drafts mean other tokens."""
    draft, target = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft != target:
        differ = sorted(set(draft.items()) ^ set(target.items()))[:3]
        raise ValueError(f"draft model {name!r} does not share the served model's tokenizer ({len(draft)} and "
                         f"{len(target)} tokens; for example {differ})")


@dataclass
class DraftModel:
    """Weights of a drafter, shared by every request."""

    name: str
    cfg: ModelConfig
    ends: TokenEnds
    stacks: list[LayerStack]

    @classmethod
    def load(cls, name: str, model: str, dtype: str, target_tokenizer=None, layers: list[int] | None = None
             ) -> DraftModel:
        """`model`'s layers (all, or only `layers`) and token ends; checks the tokenizer against the target's."""
        files = resolve_model(model)
        cfg = ModelConfig.from_folder(files.folder)
        if target_tokenizer is not None:
            check_tokenizer(name, load_tokenizer(files), target_tokenizer)
        src, torch_dtype = open_source(files), weight_format(dtype)
        keep = list(range(cfg.n_layers)) if layers is None else layers
        if not keep or min(keep) < 0 or max(keep) >= cfg.n_layers:
            raise ValueError(f"draft {name!r}: layers {keep} are not within the model's {cfg.n_layers}")
        stacks = [LayerStack.load(src, cfg, a, b, torch_dtype) for a, b in runs(keep)]
        return cls(name, cfg, TokenEnds.load(src, cfg, torch_dtype), stacks)

    def drafter(self, params: SamplingParams, capacity: int) -> ModelDrafter:
        """One request's drafter over these weights."""
        return ModelDrafter(self, params, capacity)


def draft_sampler(params: SamplingParams, vocab_size: int) -> Sampler:
    """q: the request's temperature and truncation applied to a drafter's logits (any q keeps the rule exact;
    a q close to the target's p is accepted more often). Penalties and biases stay the target's."""
    return Sampler(SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  min_p=params.min_p, seed=params.seed), vocab_size)


class ModelDrafter:
    """One request's drafter over a DraftModel."""

    on_model_thread = True
    reads_features = False

    def __init__(self, model: DraftModel, params: SamplingParams, capacity: int):
        self.model, self.name = model, model.name
        self.greedy = params.greedy
        self.sampler = draft_sampler(params, model.cfg.vocab_size)
        self.caches: list[KVCache] = [s.new_cache(capacity) for s in model.stacks]
        self.cached: list[int] = []  # the ids in the caches' slots

    def _feed(self, ids: list[int]) -> torch.Tensor:
        # ids at the end of the cached ones -> the last position's logits [V]
        start = len(self.cached)
        x = self.model.ends.embed_tokens(torch.tensor([ids]))  # [1, T, H]
        positions = torch.arange(start, start + len(ids)).unsqueeze(0)
        for stack, cache in zip(self.model.stacks, self.caches, strict=True):
            x = stack(x, positions, cache, start)
        self.cached += ids
        return self.model.ends.logits(x[:, -1:])[0, -1]

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        keep = min(common_prefix(self.cached, tokens), len(tokens) - 1)  # rejected drafts out, >= 1 to feed
        for cache in self.caches:
            cache.truncate(keep)
        del self.cached[keep:]
        logits = self._feed(tokens[keep:])
        drafts, qs = [], []
        for i in range(k):
            q = self.sampler.probs(logits)
            drafts.append(self.sampler.sample(q))
            qs.append(q)
            if i + 1 < k:
                logits = self._feed(drafts[-1:])
        # greedy drafts are point masses: the rule needs no distributions
        return drafts, None if self.greedy or not qs else torch.stack(qs)

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """Reads no features: the draft model computes its own."""
