"""Medusa decoding: the heads' top candidates form a tree that the target verifies in one forward pass.

Each step feeds the root (the token chosen last, not cached yet) and the tree's candidate nodes in one pass
with a tree attention mask (decoding/medusa_tree.py), keeps the path the acceptance rule chooses
(decoding/medusa_verify.py), and compacts that path's KV entries into place on every stage. The hidden state
at the path's end feeds the heads for the next tree. Over workers the pass goes through the pipeline like
any other forward pass, and the commit reaches every stage.
"""

from __future__ import annotations

from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.medusa_tree import Tree
from edgespec.decoding.medusa_verify import descend, typical
from edgespec.decoding.sampling import Sampler
from edgespec.decoding.sequence import Prepared, run_alone, start
from edgespec.decoding.stats import StepStats, push_run
from edgespec.decoding.text import TextStream
from edgespec.decoding.types import GenerationRequest
from edgespec.engine.engine import Engine
from edgespec.engine.program import Commit, Propose, Rows, SequenceView
from edgespec.model.config import ModelConfig


class MedusaPolicy:
    name = "medusa"
    options = frozenset({"tree", "acceptance", "posterior_threshold", "posterior_alpha", "step_tokens"})
    lane = "layers"  # the engine's lane its jobs run on

    def __init__(self, heads: MedusaModel | None):
        """heads: trained Medusa heads for the served model (decoding/medusa_heads.py), or None (the policy then
        refuses requests with a message saying how to load them)."""
        self.heads = heads

    def check(self, options: dict) -> None:
        """Raise ValueError for option values this policy cannot use."""
        if self.heads is None:
            raise ValueError("no Medusa heads are loaded for this model; start the server with --medusa FILE "
                             "(trained by `edgespec train-medusa`)")
        if "tree" in options:
            tree = Tree(options["tree"])
            if tree.depth > self.heads.n_heads:
                raise ValueError(f"the tree is {tree.depth} deep but the model has {self.heads.n_heads} Medusa heads")
        if options.get("acceptance", "exact") not in ("exact", "typical"):
            raise ValueError("acceptance must be 'exact' (the target's own tokens) or 'typical' (Medusa's typical "
                             "acceptance, not exact)")
        for key, hi in (("posterior_threshold", 1.0), ("posterior_alpha", 10.0)):
            value = options.get(key, 0.1)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= hi:
                raise ValueError(f"{key} must be a number in (0, {hi}], got {value!r}")
        step_tokens = options.get("step_tokens", 1)
        if not isinstance(step_tokens, int) or isinstance(step_tokens, bool) or not 1 <= step_tokens <= 1024:
            raise ValueError(f"step_tokens must be an integer from 1 to 1024, got {step_tokens!r}")

    def _heads(self) -> MedusaModel:
        assert self.heads is not None, "check() refuses requests when no heads are loaded"
        return self.heads

    def _tree(self, request: GenerationRequest) -> Tree:
        options = request.policy_options
        return Tree(options["tree"]) if "tree" in options else self._heads().tree

    def capacity(self, request: GenerationRequest, cfg: ModelConfig) -> int:
        return min(len(request.prompt_ids) + request.max_tokens + len(self._tree(request)),
                   cfg.max_position_embeddings)

    def generate(self, request: GenerationRequest, engine: Engine, tokenizer):
        return run_alone(self, request, engine, tokenizer)

    def prepare(self, request: GenerationRequest, cfg: ModelConfig, seq: SequenceView, text: TextStream
                ) -> Prepared:
        options = request.policy_options
        heads, tree = self._heads(), self._tree(request)
        # typical acceptance weighs every node by the target's distribution at the sequence's current place,
        # which a grammar's mask would get wrong below the root: under a grammar, the exact descent
        if options.get("acceptance") == "typical" and not request.sampling.greedy and request.grammar is None:
            threshold, alpha = options.get("posterior_threshold", 0.09), options.get("posterior_alpha", 0.3)

            def rule(sampler, tree, node_tokens, logits):
                return typical(sampler, tree, node_tokens, logits, threshold, alpha)
        else:
            rule = descend
        sampler, stats = start(self.name, request, cfg, seq)
        stats.exact = rule is descend
        stats.accepted_lengths = {}
        root_only = Tree([])
        # With step_tokens, a step's tree is the first step_tokens / (sequences in the last step) nodes of the
        # tree (by depth, then rank: a tree too): on a CPU a pass costs about linearly in its rows, so
        # sequences that share steps (outline's points) share the candidates, and a sequence left alone gets
        # the whole tree again.
        step_tokens = options.get("step_tokens")
        trees = [Tree(tree.paths[:m]) for m in range(len(tree))] if step_tokens else []  # trees[m]: m + 1 nodes

        def inputs(root: int, hidden, start: int, sequences: int):
            # the next pass's tree ids [1, T], positions [1, T] and mask [1, T, start + T] (on the model thread),
            # the heads' candidates asked of the engine (batched with the other sequences'); near the end of the
            # cache, the root alone
            step_tree = trees[max(1, min(step_tokens // sequences, len(tree))) - 1] if step_tokens else tree
            step_tree = step_tree if start + len(step_tree) <= seq.capacity else root_only
            candidates = (yield Propose(heads, (hidden, step_tree.top))) if step_tree.top else None
            node_tokens = step_tree.tokens(root, candidates)
            return step_tree, node_tokens, step_tree.positions(start), step_tree.mask(start)

        program = self.program(request, seq, heads, inputs, rule, sampler, text, stats)
        return Prepared(program, stats)

    def program(self, request: GenerationRequest, seq: SequenceView, heads: MedusaModel, inputs, rule,
                sampler: Sampler, text: TextStream, stats: StepStats):
        """The engine's program: the prompt, then per step the tree of the heads' candidates (its plan, with
        the tree's positions and mask), the accepted path committed into place (its accept)."""
        prompt, want_logprobs = request.prompt_ids, request.sampling.logprobs
        lengths = stats.accepted_lengths
        assert lengths is not None, "prepare() starts the counts"
        out = yield Rows(prompt[seq.length:], last_only=True, features=True)
        token, lp = sampler.choose_with_logprob(out.logits[0, -1])  # [1, 1, V]
        step, nxt = [(token, lp)], (yield from inputs(token, out.hidden[0, -1], len(prompt), out.sequences))
        tokens = list(prompt)
        while True:
            tokens += [t for t, _ in step]
            event = push_run(text, step, stats, seq.wire())
            yield event
            if event.finish_reason:
                return
            step_tree, node_tokens, positions, mask = nxt
            start = seq.length
            out = yield Rows(node_tokens, start, positions, mask, features=True)
            # logits [1, T, V] and hidden [1, T, H] at the tree's nodes. The head runs on every node in one
            # product: it reads its 49k rows once, where a row at a time would read them once per node the rule
            # visits (measured: 1.5 ms more per step at 5 nodes).
            verdict = rule(sampler, step_tree, node_tokens, out.logits[0])
            # each token came from the logits of the path's node before it
            lps = [sampler.logprob(out.logits[0, n], t) if want_logprobs else None
                   for n, t in zip(verdict.path, verdict.tokens, strict=True)]
            nxt = yield from inputs(verdict.tokens[-1], out.hidden[0, verdict.path[-1]], start + len(verdict.path),
                                    out.sequences)
            kept = [start + n for n in verdict.path]
            # the cached tokens are a plain run again: the root and the accepted candidates
            yield Commit(kept, start, tokens[:start] + [node_tokens[n] for n in verdict.path])
            stats.proposed += step_tree.depth
            stats.accepted += verdict.accepted
            lengths[verdict.accepted] = lengths.get(verdict.accepted, 0) + 1
            step = list(zip(verdict.tokens, lps, strict=True))
