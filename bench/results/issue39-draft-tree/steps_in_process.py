"""In process (the served model on two threads, no HTTP), vicuna80 prompts FIRST..FIRST+COUNT, 128 tokens, greedy:
naive, the default policy with chains (width 1) and with trees of up to 4 candidates a depth (width 4), alternated
prompt by prompt; per policy its tokens per second, steps, passes by rows and their median milliseconds, and the
eagle drafter's calls, depths and seconds. Runs on the tree of draft_tree.diff (applied to 1b90198), not kept.

    git apply bench/results/issue39-draft-tree/draft_tree.diff
    python bench/results/issue39-draft-tree/steps_in_process.py 0 20 > .../steps_in_process.txt
"""

import asyncio
import collections
import json
import statistics
import sys
import time
from pathlib import Path

from edgespec.decoding.eagle import FeatureDraftModel
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.speculative import SpeculativePolicy
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.engine.engine import Engine
from edgespec.model.load import load_local
from edgespec.model.source import resolve_model
from edgespec.model.thread import ModelThread

REPO = Path(__file__).parents[3]


def recorded(policy: SpeculativePolicy, record: dict) -> None:
    """Record each pass's rows and seconds and each eagle proposal's depths and seconds as the policy sees them."""
    passes, drafts = policy.passes.observe, policy.draft_costs.observe

    def on_pass(rows, seconds, number=None):
        record["rows"].append(rows)
        record["pass_s"].append(seconds)
        passes(rows, seconds, number)

    def on_draft(name, k, seconds):
        if name == "eagle":
            record["draft_s"].append(seconds)
            record["draft_k"].append(k)
        drafts(name, k, seconds)

    policy.passes.observe, policy.draft_costs.observe = on_pass, on_draft


def main() -> None:
    first, count = int(sys.argv[1]), int(sys.argv[2])
    model = load_local(resolve_model(None), "auto", 1.0, ModelThread(2))
    path = sorted((REPO / "decoding/trained").glob("*-eagle.safetensors"))[0]
    drafters = {"eagle": model.executor.thread.run_sync(FeatureDraftModel.load, "eagle", path, model.executor.ends)}
    lines = (REPO / "../shared/data/prompts/vicuna80.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["turns"][0] for line in lines][first:first + count]
    policies = {"naive": NaivePolicy(), "w1": SpeculativePolicy(drafters, width=1),
                "w4": SpeculativePolicy(drafters, width=4)}
    records = {name: collections.defaultdict(list) for name in policies}
    for name in ("w1", "w4"):
        recorded(policies[name], records[name])
    tokenizer = model.tokenizer

    async def generate(policy, prompt):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        request = GenerationRequest(ids, 128, SamplingParams(temperature=0.0), (), frozenset(), policy.name, {})
        t = time.perf_counter()
        events = [e async for e in policy.generate(request, Engine(model.executor), tokenizer)]
        return time.perf_counter() - t, sum(len(e.token_ids) for e in events), events[-1].stats

    results: dict[str, list] = {name: [] for name in policies}
    names = list(policies)
    for i, prompt in enumerate(prompts):
        for name in names[i % 3:] + names[:i % 3]:
            results[name].append(asyncio.run(generate(policies[name], prompt)))
    for name in names:
        seconds, tokens = sum(r[0] for r in results[name]), sum(r[1] for r in results[name])
        line = f"{name}: {tokens / seconds:.1f} tok/s, tokens {tokens}, time {seconds:.2f}s, steps " \
               f"{sum(r[2].get('steps', 0) for r in results[name])}"
        rec = records[name]
        if rec["rows"]:
            line += f", passes {len(rec['rows'])}, mean rows {statistics.mean(rec['rows']):.2f}, pass s " \
                    f"{sum(rec['pass_s']):.2f}, draft s {sum(rec['draft_s']):.2f}, draft calls " \
                    f"{len(rec['draft_s'])}, depths {sum(rec['draft_k'])}"
            by_rows = collections.defaultdict(list)
            for n, s in zip(rec["rows"], rec["pass_s"], strict=True):
                by_rows[n].append(s)
            line += "\n   pass ms by rows: " + ", ".join(f"{n}:{statistics.median(v) * 1000:.2f}({len(v)})"
                                                     for n, v in sorted(by_rows.items()))
        print(line)
    model.executor.close()


if __name__ == "__main__":
    main()
