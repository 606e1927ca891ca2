"""The `headsplit` policy: one token per step, as `naive`, through the HeadSplit schedule (model/headsplit.py)
instead of the layer pipeline: every device works on every layer's attention, and a layer the placement lets
speculate starts on the previous layer's Z and keeps it when ||Z - X|| / ||X|| < epsilon. A prompt's rows never
speculate, however they go in (alone, after a cached prefix, in chunks beside other requests): the same bits.

Request options: `epsilon` (default: the server's `headsplit_epsilon`; 0 is exactly naive). The placement,
and so which layers speculate, is fixed when the blocks are first loaded (at the first request), from the
configured epsilon's profiled acceptance; a request's epsilon changes only the test.
"""

from __future__ import annotations

import math

from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.sequence import Prepared
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest
from edgespec.engine.program import Rows, SequenceView, Speculate
from edgespec.model.config import ModelConfig

HEADSPLIT = "headsplit"  # the engine's lane of HeadSplit's blocks (server/boot.py builds it)


class HeadSplitPolicy(NaivePolicy):
    name = "headsplit"
    options = frozenset({"epsilon"})
    lane = HEADSPLIT

    def __init__(self, available: bool, epsilon: float = 0.05):
        """available: whether the server has the HeadSplit lane; epsilon: the tolerance requests default to."""
        self.available, self.epsilon = available, epsilon

    def check(self, options: dict) -> None:
        if not self.available:
            raise ValueError("this server was started without HeadSplit (--no-headsplit)")
        eps = options.get("epsilon", self.epsilon)
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"epsilon must be a finite number >= 0, got {eps!r}")

    def prepare(self, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView, text: TextStream
                ) -> Prepared:
        naive = super().prepare(request, cfg, seq, text)
        epsilon = float(request.policy_options.get("epsilon", self.epsilon))

        def program():
            # naive's program, its prompt's rows not speculating (alone they go in one pass of several rows, which
            # never speculates; after a cached prefix, or in chunks beside other requests, the last may go alone)
            # and every decoding row at the request's tolerance
            inner, prompt = naive.program, True
            try:
                yield Speculate(None)
                item = next(inner)
                while True:
                    value = yield item
                    if prompt and isinstance(item, Rows):
                        prompt = False
                        yield Speculate(epsilon)
                    item = inner.send(value)
            except StopIteration:
                return
            finally:
                inner.close()

        return Prepared(program(), naive.stats)
