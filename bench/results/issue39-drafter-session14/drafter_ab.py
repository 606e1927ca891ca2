"""The eagle drafter's cost per proposal, two versions of decoding/eagle.py in one process, interleaved: each
proposal of k drafts is timed right after a pass of the served model (as in serving, where the pass has just
streamed the model's weights through the caches) and again at once ("hot"). Same drafts asserted.

    git show fb0a65d:decoding/eagle.py > /tmp/eagle_before.py   # any two versions
    python bench/results/issue39-drafter-session14/drafter_ab.py /tmp/eagle_before.py decoding/eagle.py OUT.json
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import time

import torch

from edgespec.bench.versus import machine_info
from edgespec.decoding.target_fit import SHIPPED
from edgespec.decoding.types import SamplingParams
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    before, after, out = sys.argv[1:4]
    versions = {"before": module(before, "eagle_before"), "after": module(after, "eagle_after")}
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format("float16"))
    ends = TokenEnds.load(src, cfg, fmt)
    torch.manual_seed(0)
    features = torch.randn(300, cfg.hidden_size) * 3  # stand-in last-layer outputs of a 300-token text
    tokens = torch.randint(0, 30000, (301,)).tolist()
    drafters = {}
    for name, mod in versions.items():
        model = mod.FeatureDraftModel.load("eagle", SHIPPED / "smollm2-135m-instruct-eagle.safetensors", ends)
        drafters[name] = mod.FeatureDrafter(model, SamplingParams(temperature=0.0), 4096)
        drafters[name].observe(0, features)
    drafts = {name: d.propose(tokens, 4)[0] for name, d in drafters.items()}
    assert drafts["before"] == drafts["after"], drafts
    context, ks, repeats = 100, (1, 2, 4), 200
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        cache = stack.new_cache(context + 32)
        stack(ends.embed_tokens(torch.zeros(1, context, dtype=torch.long)), torch.arange(context)[None], cache, 0)
        for _ in range(repeats):
            for name in random.sample(list(drafters), len(drafters)):
                for k in ks:
                    cache.length = context
                    ends.logits(stack(ends.embed_tokens(torch.tensor([tokens[:1 + k]])),
                                      torch.arange(context, context + 1 + k)[None], cache, context, None))
                    for when in ("after a pass", "hot"):
                        drafters[name].fed = 298  # the newest position is fed again, as after a verification
                        t = time.perf_counter()
                        drafters[name].propose(tokens, k)
                        times.setdefault(f"{name} k={k} {when}", []).append(time.perf_counter() - t)
    result = {"machine": machine_info() | {"threads": torch.get_num_threads()}, "repeats": repeats,
              "ms": {key: round(statistics.median(v) * 1000, 3) for key, v in sorted(times.items())}}
    with open(out, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    for key, ms in result["ms"].items():
        print(key, ms)


if __name__ == "__main__":
    main()
