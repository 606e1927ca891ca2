"""One prompt's pass in process: the served model's layers over T random prompt tokens into an empty float16
cache, then the head on the last row, repeated for S seconds; prints the median. Run with the serve command's
GOMP_SPINCOUNT (server/cli.py) to time what a server's prefill does.

    GOMP_SPINCOUNT=20000 python bench/results/issue39-serial-work/prefill_pass.py 1000 3
"""

import gc
import statistics
import sys
import time

import torch

from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def main() -> None:
    tokens, seconds = int(sys.argv[1]), float(sys.argv[2])
    files = resolve_model(None)
    cfg, src, fmt = ModelConfig.from_folder(files.folder), open_source(files), weight_format("auto")
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, fmt, kv_format("float16"))
    ends = TokenEnds.load(src, cfg, fmt)
    with torch.inference_mode():
        prompt = ends.embed_tokens(torch.randint(0, 1000, (1, tokens)))  # [1, T, H]
        cache = stack.new_cache(tokens + 32)
        gc.collect()
        gc.freeze()
        times, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            cache.length = 0
            start = time.perf_counter()
            ends.logits(stack(prompt, torch.arange(tokens)[None], cache, 0)[:, -1:])
            times.append(time.perf_counter() - start)
    print(tokens, "prefill median", round(statistics.median(times) * 1000, 2), "ms", len(times))


if __name__ == "__main__":
    main()
