"""The served model's 30 layers over R sequences decoding a token each, each after its own cache of C slots, for
several C alternated in one process (LayerStack.forward_rows, as a batch step runs them): medians in ms.

    python bench/results/issue39-attention-prefetch/stack_contexts.py R REPEATS KV_FORMAT C,C,...
"""

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


def main() -> None:
    r, repeats, kvf = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    contexts = [int(c) for c in sys.argv[4].split(",")]
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format(kvf))
    ends = TokenEnds.load(src, cfg, fmt)
    times: dict[int, list[float]] = {c: [] for c in contexts}
    with torch.inference_mode():
        sets = {c: decoding_seqs(stack, ends, c, r) for c in contexts}
        h = torch.randn(r, cfg.hidden_size)
        for _ in range(repeats):
            for c in contexts:
                for s in sets[c]:
                    s.cache.length = c
                t = time.perf_counter()
                stack.forward_rows(h, torch.full((r,), c), sets[c])
                times[c].append(time.perf_counter() - t)
    print(r, kvf, {c: round(statistics.median(v) * 1e3, 3) for c, v in times.items()})


if __name__ == "__main__":
    main()
