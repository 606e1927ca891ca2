"""Kernel builds side by side in one process: the served model's layer matmuls (every Kernel linear of its 30
layers) at R rows through each build's `Linear`, checked bitwise equal to the first build's, then timed with the
builds interleaved repeat by repeat, each build first in turn and called once untimed before its timing (the
order alone had moved one-row figures by 5-9%). One row takes the VNNI kernels in every build: its ratio is the
noise floor of the others.

    python bench/results/issue39-amx-pipeline/kernel_ab.py KEY,KEY,... 1,8,16 REPEATS OUT.json

KEY: a build folder's name under model/kernels/build/ (`edgespec.model.kernels.build_key` of a checkout's
sources: build it there with `python -m edgespec.model.kernels`). Medians in milliseconds and their ratio to the
first build's.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from edgespec.bench.kernel_paths import build_of, handles
from edgespec.bench.versus import machine_info
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import Kernel, weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack
from edgespec.model.weights import open_source


def main() -> None:
    keys, rows = sys.argv[1].split(","), [int(r) for r in sys.argv[2].split(",")]
    repeats, out = int(sys.argv[3]), Path(sys.argv[4])
    files = resolve_model(None)
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files)
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, weight_format("auto"), kv_format("float16"))
    kernels = [m for layer in stack.layers for part in (layer.attn, layer.ffn) for m in part.modules()
               if isinstance(m, Kernel)]

    calls = {key: handles(build_of(key), kernels) for key in keys}
    xs = {r: [torch.randn(r, m.in_features) for m in kernels] for r in rows}
    times: dict = {(k, r): [] for k in keys for r in rows}
    with torch.inference_mode():
        for r in rows:
            first = [f(x) for f, x in zip(calls[keys[0]], xs[r], strict=True)]
            for k in keys[1:]:
                assert all(torch.equal(f(x), y) for f, x, y in zip(calls[k], xs[r], first, strict=True)), (k, r)
        for i in range(repeats):
            for r in rows:
                for k in keys[i % len(keys):] + keys[:i % len(keys)]:
                    for f, x in zip(calls[k], xs[r], strict=True):
                        f(x)
                    t = time.perf_counter()
                    for f, x in zip(calls[k], xs[r], strict=True):
                        f(x)
                    times[(k, r)].append(time.perf_counter() - t)
    result = {"machine": machine_info() | {"threads": torch.get_num_threads()}, "builds": keys,
              "repeats": repeats, "rows": []}
    for r in rows:
        base = statistics.median(times[(keys[0], r)])
        row = {"rows": r} | {k: {"layer_matmuls_ms": round(statistics.median(times[(k, r)]) * 1000, 3),
                                 "vs_first": round(statistics.median(times[(k, r)]) / base, 3)} for k in keys}
        result["rows"].append(row)
        print(row)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
