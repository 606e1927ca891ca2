"""Attention alone over float16 KV held in torch's allocation (4 KiB pages) and in one mapping advised as huge
pages (mmap + MADV_HUGEPAGE), alternated in one process: S sequences x L layers, each (sequence, layer) its own
cache of CTX slots in SmolLM2-135M's shapes, one decoding row each; a 256 MiB buffer read before each timing.

    python bench/results/issue39-huge-pages/kv_ab.py S L CTX REPEATS
"""

import mmap
import statistics
import sys
import time

import torch

import edgespec.model.kernels as kernels


def caches(n: int, ctx: int, huge: bool) -> tuple[list, torch.Tensor]:
    """n (keys, values) pairs [1, 3, ctx, 64] float16, side by side in one buffer."""
    per = 3 * ctx * 64
    if huge:
        region = mmap.mmap(-1, 2 * n * per * 2 + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        buf = torch.frombuffer(region, dtype=torch.float16)
    else:
        buf = torch.empty(2 * n * per + (1 << 20), dtype=torch.float16)
    buf[:2 * n * per] = torch.randn(2 * n * per).half()
    pairs = [(buf[2 * i * per:(2 * i + 1) * per].view(1, 3, ctx, 64),
              buf[(2 * i + 1) * per:(2 * i + 2) * per].view(1, 3, ctx, 64)) for i in range(n)]
    return pairs, buf


def main() -> None:
    seqs, layers, ctx, repeats = map(int, sys.argv[1:5])
    m, n = kernels.load(), seqs * layers
    torch.manual_seed(0)
    sets = {"4k": caches(n, ctx, False)[0], "2m": caches(n, ctx, True)[0]}
    qs = [torch.randn(1, 9, 1, 64) for _ in range(n)]
    evict = torch.ones(64 * 2**20)
    times: dict[str, list[float]] = {k: [] for k in sets}
    with torch.inference_mode():
        for r in range(repeats):
            for key in (("4k", "2m") if r % 2 else ("2m", "4k")):
                kv = sets[key]
                evict.sum()
                t = time.perf_counter()
                for i in range(n):
                    m.attention(qs[i], *kv[i], ctx - 1, None)
                times[key].append(time.perf_counter() - t)
    with open("/proc/self/smaps_rollup") as f:
        huge = f.read().split("AnonHugePages:")[1].split()[0]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{seqs} x {layers} over {ctx} slots:", {k: round(v, 3) for k, v in med.items()}, "2m/4k",
          round(med["2m"] / med["4k"], 3), f"(AnonHugePages {huge} KiB)")


if __name__ == "__main__":
    main()
