"""What a 16-stream step's pass costs alone: the served model's layers (no head) over R rows, as one sequence's
R rows after a 100-token cache (`fwd`) and as R sequences decoding a token each, each with its own cache
(`batch`, LayerStack.forward_rows: what a batch step runs), R = 1, 8, 16, all interleaved in one process,
medians of 40.

    python bench/results/issue39-amx-pipeline/isolation/batch_parts.py OUT.json
"""

import json
import statistics
import sys
import time

import torch

from edgespec.bench.pass_cost import decoding_seqs
from edgespec.bench.versus import machine_info
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source

CONTEXT = 100


def main() -> None:
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format("float16"))
    ends = TokenEnds.load(src, cfg, fmt)
    prompt = ends.embed_tokens(torch.zeros(1, CONTEXT, dtype=torch.long))

    def filled():
        cache = stack.new_cache(CONTEXT + 32)
        stack(prompt, torch.arange(CONTEXT)[None], cache, 0)
        return cache

    passes = {}
    with torch.inference_mode():
        for r in (1, 8, 16):
            h, cache = torch.randn(1, r, cfg.hidden_size), filled()
            mask = torch.arange(CONTEXT + r)[None] <= (CONTEXT + torch.arange(r))[:, None]  # causal over the rows

            def fwd(h=h, cache=cache, r=r, mask=mask):
                cache.length = CONTEXT
                stack(h, torch.arange(CONTEXT, CONTEXT + r)[None], cache, CONTEXT, None if r == 1 else mask)

            seqs = decoding_seqs(stack, ends, CONTEXT, r)

            def batch(h=h, seqs=seqs, r=r):
                stack.forward_rows(h[0], torch.full((r,), CONTEXT), seqs)

            passes[f"fwd_{r}"], passes[f"batch_{r}"] = fwd, batch
        times: dict = {name: [] for name in passes}
        for fn in [*passes.values()] * 2:  # warm
            fn()
        for _ in range(40):
            for name, fn in passes.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    ms = {name: round(statistics.median(v) * 1000, 3) for name, v in times.items()}
    ms["batch_16_speedup_over_batch_1"] = round(16 * ms["batch_1"] / ms["batch_16"], 3)
    print(ms)
    with open(sys.argv[1], "w") as f:
        json.dump({"machine": machine_info() | {"threads": torch.get_num_threads()}, "context": CONTEXT,
                   "layers_ms": ms}, f, indent=1)


if __name__ == "__main__":
    main()
