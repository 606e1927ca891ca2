"""The DecodingPolicy seam and the registry of policies by name."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from edgespec.decoding.types import GenerationRequest, TokenEvent
from edgespec.engine.engine import Engine


class UnknownPolicyError(ValueError):
    """A request named a policy the server does not have."""

    def __init__(self, name: str, available: list[str]):
        super().__init__(f"unknown decoding policy {name!r}; available: {', '.join(available)}")
        self.available = available


class DecodingPolicy(Protocol):
    """Turns a GenerationRequest into a stream of TokenEvents using the model."""

    name: str
    options: frozenset[str]  # the policy options a request may set in its `decoding` object

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use (the names are checked against `options`
        before)."""

    def generate(self, request: GenerationRequest, engine: Engine, tokenizer) -> AsyncGenerator[TokenEvent, None]:
        """Async generator of events; the last one has a finish_reason and the statistics (the caller closes it:
        contextlib.aclosing)."""


def build_policies(draft_models: dict | None = None, default_drafter: str | None = None,
                   draft_k: tuple[int, int, int] = (4, 1, 8), medusa=None,
                   default: str = "naive", headsplit: bool = False, headsplit_epsilon: float = 0.05
                   ) -> dict[str, DecodingPolicy]:
    """Every policy this build has, by name; draft_models: drafter weights by name (decoding.draft_model,
    decoding.eagle); draft_k: the draft length to start from and its bounds; medusa: Medusa heads
    (decoding.medusa_heads), without which `medusa` refuses requests and says why; default: the server's
    default policy, which `outline` falls back to; headsplit: whether the engine has HeadSplit's lane
    (server/boot.py), without which `headsplit` refuses requests."""
    from edgespec.decoding.auto import AutoPolicy
    from edgespec.decoding.headsplit import HeadSplitPolicy
    from edgespec.decoding.medusa import MedusaPolicy
    from edgespec.decoding.naive import NaivePolicy
    from edgespec.decoding.outline import OutlinePolicy
    from edgespec.decoding.speculative import SpeculativePolicy

    policies: list[DecodingPolicy] = [NaivePolicy(), SpeculativePolicy(draft_models, default_drafter, *draft_k),
                                      MedusaPolicy(medusa), HeadSplitPolicy(headsplit, headsplit_epsilon)]
    by_name = {p.name: p for p in policies}
    by_name["outline"] = OutlinePolicy(by_name.get(default), verifiers={
        name: by_name[name] for name in ("speculative", "medusa")})
    by_name["auto"] = AutoPolicy(by_name["outline"], by_name.get(default, by_name["naive"]))
    return by_name


def select_policy(policies: dict[str, DecodingPolicy], name: str) -> DecodingPolicy:
    if name not in policies:
        raise UnknownPolicyError(name, sorted(policies))
    return policies[name]
