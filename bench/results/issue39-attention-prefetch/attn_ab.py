"""Attention alone, kernel builds side by side in one process: S sequences x L layers, each (sequence, layer) its
own cache of `ctx` slots (SmolLM2-135M's shapes: 3 KV heads of 64 values, 9 query heads), one decoding row each
through the build's `attention`; each build's outputs checked equal to the first's, then the builds timed in
turn (each first in turn), a 256 MiB buffer read before each timing (the layers' weights evict the caches between
two passes). Medians in milliseconds and their ratio to the first build's.

    python bench/results/issue39-attention-prefetch/attn_ab.py KEY,KEY S L CTX REPEATS [float16|float32]

KEY: a build folder's name under model/kernels/build/ (`python -m edgespec.model.kernels` builds a checkout's
sources there).
"""

import statistics
import sys
import time

import torch

from edgespec.bench.kernel_paths import build_of


def main() -> None:
    keys = sys.argv[1].split(",")
    seqs, layers, ctx, repeats = map(int, sys.argv[2:6])
    dtype = getattr(torch, sys.argv[6]) if len(sys.argv) > 6 else torch.float16
    mods = [build_of(k) for k in keys]
    n = seqs * layers
    torch.manual_seed(0)
    kv = [(torch.randn(1, 3, ctx, 64).to(dtype), torch.randn(1, 3, ctx, 64).to(dtype)) for _ in range(n)]
    qs = [torch.randn(1, 9, 1, 64) for _ in range(n)]
    evict = torch.ones(64 * 2**20)  # 256 MiB, read only, as the weights are (written lines would cost write-backs)
    times: dict[str, list[float]] = {k: [] for k in keys}
    with torch.inference_mode():
        first = [mods[0].attention(qs[i], *kv[i], ctx - 1, None) for i in range(n)]
        for m in mods[1:]:
            assert all(torch.equal(m.attention(qs[i], *kv[i], ctx - 1, None), first[i]) for i in range(n))
        for r in range(repeats):
            for j in range(len(mods)):
                key, m = keys[(r + j) % len(keys)], mods[(r + j) % len(keys)]
                evict.sum()
                t = time.perf_counter()
                for i in range(n):
                    m.attention(qs[i], *kv[i], ctx - 1, None)
                times[key].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{seqs} sequences x {layers} layers over {ctx} slots, {sys.argv[6] if len(sys.argv) > 6 else 'float16'}:",
          {k: round(v, 3) for k, v in med.items()}, "ratio", [round(med[k] / med[keys[0]], 3) for k in keys])


if __name__ == "__main__":
    main()
