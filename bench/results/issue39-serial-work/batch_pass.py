"""One decode step of R sequences in process (LayerStack.forward_rows and the head), each sequence after its own
float16 cache of C tokens, for every R given, the sizes alternated ten steps at a time for S seconds; prints each
size's median, its ratio to the first size's and R over that ratio (what batching R streams can gain at most).

    python bench/results/issue39-serial-work/batch_pass.py 200 12 1,4,8,16
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


def main() -> None:
    context, seconds = int(sys.argv[1]), float(sys.argv[2])
    sizes = [int(x) for x in sys.argv[3].split(",")]
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format("float16"))
    ends = TokenEnds.load(src, cfg, fmt)
    with torch.inference_mode():
        setups = {r: (torch.randn(r, cfg.hidden_size), torch.full((r,), context),
                      decoding_seqs(stack, ends, context, r)) for r in sizes}
        gc.collect()
        gc.freeze()
        times: dict[int, list[float]] = {r: [] for r in sizes}
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            r = sizes[(i // 10) % len(sizes)]
            i += 1
            h, positions, seqs = setups[r]
            start = time.perf_counter()
            ends.logits(stack.forward_rows(h, positions, seqs)[None])
            times[r].append(time.perf_counter() - start)
    one = statistics.median(times[sizes[0]])
    for r in sizes:
        m = statistics.median(times[r])
        print(f"{r} rows over {context} slots: median {m * 1000:.3f} ms, {m / one:.3f}x {sizes[0]} row(s), "
              f"speedup {r * one / m:.3f}")


if __name__ == "__main__":
    main()
