"""The served eagle drafter replayed on the target's greedy answers to vicuna80's prompts 40-79 (the benchmark
measures on 0-39): a chain of up to 4 drafts a step, as verification would keep it; at each depth reached, how
often the target's token was the drafter's best, second, ... candidate, and the first candidate's rate of being
kept by the drafter's own probability of it (its calibration).

    python bench/results/issue39-draft-tree/replay.py > bench/results/issue39-draft-tree/replay.txt
"""

import json
from pathlib import Path

import torch

from edgespec.decoding.eagle import FeatureDrafter, FeatureDraftModel
from edgespec.decoding.training.distill_data import final_hidden, generate_answers
from edgespec.decoding.training.train_drafter import Example
from edgespec.decoding.types import SamplingParams
from edgespec.model.config import ModelConfig
from edgespec.model.source import resolve_model
from edgespec.model.stack import TokenEnds
from edgespec.model.weights import open_source

REPO = Path(__file__).parents[3]
K, W = 4, 8


@torch.inference_mode()
def ranked(d: FeatureDrafter, tokens: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    # the drafter's chain of k, each depth's W best ids and probabilities (its own steps, as propose runs them)
    n = d.known
    d._normed(n)
    d.cache.truncate(d.fed)
    a = d.first + 1 + d.fed
    g = d._step(d.g[a - 1:n], tokens[a:n + 1], a, d.first)
    d.fed = n - d.first
    out = []
    for i in range(k):
        p, rows = torch.softmax(d.model.head(g)[0, 0].float(), -1).topk(W)
        out.append(([d.model.ids[r] for r in rows.tolist()], p.tolist()))
        if i + 1 < k:
            g = d._step(g[0], [out[-1][0][0]], n + 1 + i, d.first)
    return out


def main() -> None:
    files = resolve_model(None)
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files.folder)
    prompts = [json.loads(line)["turns"][0]
               for line in (REPO / "../shared/data/prompts/vicuna80.jsonl").read_text().splitlines()][40:80]
    rows = generate_answers(files, prompts, Path("/tmp/draft_tree_answers.jsonl"), 128, 8)
    test = [Example(r["prompt"] + r["answer"], f, len(r["prompt"])) for r, f in zip(rows, final_hidden(files, rows),
                                                                                     strict=True)]
    model = FeatureDraftModel.load("eagle", REPO / "decoding/trained/smollm2-135m-instruct-eagle.safetensors",
                                   TokenEnds.load(src, cfg, torch.bfloat16))
    reached, hits, calibration = [0] * K, [[0] * W for _ in range(K)], [[0, 0] for _ in range(10)]
    for e in test:
        ids = e.ids.tolist()
        d = FeatureDrafter(model, SamplingParams(temperature=0.0), len(ids) + K + 2)
        pos = e.answer_start
        d.observe(0, e.f[:pos])
        pos += 1
        while pos < len(ids):
            kept = 0
            for i, (cands, probs) in enumerate(ranked(d, ids[:pos], min(K, len(ids) - pos))):
                reached[i] += 1
                truth = ids[pos + i]
                if truth in cands:
                    hits[i][cands.index(truth)] += 1
                if i == 0:
                    bucket = calibration[min(9, int(probs[0] * 10))]
                    bucket[0] += 1
                    bucket[1] += cands[0] == truth
                if cands[0] != truth:
                    break
                kept += 1
            d.observe(pos - 1, e.f[pos - 1:pos + kept])
            pos += kept + 1
    for i in range(K):
        print(f"depth {i + 1}: reached {reached[i]}, the target's token at rank 1..{W}:",
              [round(h / max(1, reached[i]), 4) for h in hits[i]])
    for b, (n, k) in enumerate(calibration):
        print(f"depth 1, the drafter's probability of its first in [{b / 10:.1f}, {(b + 1) / 10:.1f}): {n} steps, "
              f"kept {k / max(1, n):.3f}")


if __name__ == "__main__":
    main()
