"""Replay (train_drafter.simulate) of a drafter file on the held-out prompts' greedy answers, as train-drafter's
own split (seed 0, holdout 0.1) makes it; only those rows' features are computed."""
import json
import random
import sys
from pathlib import Path

import torch

from edgespec.decoding.eagle import FeatureDraftModel
from edgespec.decoding.training.distill_data import final_hidden, training_prompts
from edgespec.decoding.training.train_drafter import Example, simulate
from edgespec.model.config import ModelConfig
from edgespec.model.source import resolve_model
from edgespec.model.stack import TokenEnds
from edgespec.model.weights import open_source

path, answers = Path(sys.argv[1]), Path(sys.argv[2])
files = resolve_model(None)
cfg = ModelConfig.from_folder(files.folder)
src = open_source(files.folder)
prompts = training_prompts(Path("/work/shared/data"))
rng = random.Random(0)
held = set(rng.sample(range(len(prompts)), max(1, int(0.1 * len(prompts)))))
rows = [r for r in map(json.loads, answers.read_text().splitlines()) if r["index"] in held and r["draw"] == 0]
rows.sort(key=lambda r: r["index"])
feats = final_hidden(files, rows)
test = [Example(r["prompt"] + r["answer"], f, len(r["prompt"])) for r, f in zip(rows, feats, strict=True)]
served = FeatureDraftModel.load("eagle", path, TokenEnds.load(src, cfg, torch.bfloat16))
out = {f"k={k}": simulate(served, test, k) for k in (1, 2, 4)}
print(len(test), json.dumps(out))
if len(sys.argv) > 3:
    Path(sys.argv[3]).write_text(json.dumps({"heldout_sequences": len(test), "heldout_greedy": out}, indent=1) + "\n")
