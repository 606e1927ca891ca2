"""The served model's layers (no head) over R sequences decoding a token each, each after its own 100-token
float16 cache (LayerStack.forward_rows: what a batch step runs), called for SECONDS; prints the median step.
Run under `perf record` for timeline.py.

    python bench/results/issue39-step-threads/step_loop.py R SECONDS
"""

import gc
import statistics
import sys
import time

import torch

from edgespec.bench.pass_cost import decoding_seqs
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source

CONTEXT = 100


def main() -> None:
    rows, seconds = int(sys.argv[1]), float(sys.argv[2])
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format("float16"))
    with torch.inference_mode():
        seqs = decoding_seqs(stack, TokenEnds.load(src, cfg, fmt), CONTEXT, rows)
        h, pos = torch.randn(rows, cfg.hidden_size), torch.full((rows,), CONTEXT)
        gc.collect()
        gc.freeze()  # as serve does after loading
        for _ in range(5):
            stack.forward_rows(h, pos, seqs)
        times, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            stack.forward_rows(h, pos, seqs)
            times.append(time.perf_counter() - t)
    print(f"rows {rows}: median step {statistics.median(times) * 1000:.3f} ms over {len(times)} steps")


if __name__ == "__main__":
    main()
