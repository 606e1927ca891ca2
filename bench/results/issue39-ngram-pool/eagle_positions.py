"""The served eagle drafter's first draft and its probability at every position of the served greedy answers to
vicuna80 (served_answers.py's), teacher forced: at position p it has the target's features up to p - 1 (from
transformers' float32 forward, as train_drafter's evaluation) and the tokens up to p. Written to WORK/eagle.pkl
for pool_replay.py.

    python bench/results/issue39-ngram-pool/eagle_positions.py
"""

import json
import pickle
from pathlib import Path

import torch
from served_answers import WORK

from edgespec.decoding.eagle import FeatureDrafter, FeatureDraftModel
from edgespec.decoding.training.distill_data import final_hidden
from edgespec.decoding.types import SamplingParams
from edgespec.model.config import ModelConfig
from edgespec.model.source import resolve_model
from edgespec.model.stack import TokenEnds
from edgespec.model.weights import open_source

REPO = Path(__file__).parents[3]


@torch.inference_mode()
def main() -> None:
    files = resolve_model(None)
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files.folder)
    rows = [json.loads(line) for line in (WORK / "vicuna128.jsonl").read_text().splitlines()]
    model = FeatureDraftModel.load("eagle", REPO / "decoding/trained/smollm2-135m-instruct-eagle.safetensors",
                                   TokenEnds.load(src, cfg, torch.bfloat16))
    out = []
    for r, f in zip(rows, final_hidden(files, rows), strict=True):
        ids, start = r["prompt"] + r["answer"], len(r["prompt"])
        drafts = []
        for pos in range(start, len(ids)):
            d = FeatureDrafter(model, SamplingParams(temperature=0.0), len(ids) + 4)
            d.observe(0, f[:pos])
            d._normed(pos)
            g = d._step(d.g[0:pos - 1], ids[1:pos], 1, 0)  # its steps over the pairs (g_{i-1}, x_i), i = 1..pos-1
            p = torch.softmax(model.head(g)[0, 0].float(), -1)
            top = int(p.argmax())
            drafts.append((model.ids[top], float(p[top])))
        out.append({"ids": ids, "start": start, "eagle": drafts})
    (WORK / "eagle.pkl").write_bytes(pickle.dumps(out))


if __name__ == "__main__":
    main()
