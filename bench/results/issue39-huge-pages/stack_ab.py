"""The served model's layers with their kernel weights in huge pages (as LayerStack.load holds them) and the same
stack's weights copied back into torch's own allocations (4 KiB pages), in one process: the layer matmuls alone
(every Kernel at R rows), and a batch step's 30 layers over R sequences decoding a token each after their own
100-slot caches; the two alternated, each first in turn, medians in ms and their ratio. Each result is checked
equal first.

    python bench/results/issue39-huge-pages/stack_ab.py 1,4,8,16 REPEATS
"""

import statistics
import sys
import time

import torch

from edgespec.bench.pass_cost import decoding_seqs
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import Kernel, weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return int(f.read().split("AnonHugePages:")[1].split()[0])


def load(src, cfg, huge: bool) -> LayerStack:
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, weight_format("auto"), kv_format("float16"))
    if not huge:
        for k in (m for m in stack.modules() if isinstance(m, Kernel)):
            k.use([t.clone() for t in k.weight_tensors()])
        stack.runs = stack._runs()  # the compiled runs gather the kernels' handles again
    return stack


def compare(name: str, fn, repeats: int) -> None:
    """fn(key) for both stacks: checked equal, then timed alternately."""
    a, b = fn("4k"), fn("2m")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    times: dict[str, list[float]] = {"4k": [], "2m": []}
    for i in range(repeats):
        for key in (("4k", "2m") if i % 2 else ("2m", "4k")):
            fn(key)  # untimed: each timing starts from its own previous pass, as serving does
            t = time.perf_counter()
            fn(key)
            times[key].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{name:24s} 4k {med['4k']:.3f} ms  2m {med['2m']:.3f} ms  2m/4k {med['2m'] / med['4k']:.3f}")


def measure(stacks: dict[str, LayerStack], ends: TokenEnds, r: int, repeats: int) -> None:
    kernels = {k: [m for m in s.modules() if isinstance(m, Kernel)] for k, s in stacks.items()}
    xs = [torch.randn(r, m.in_features) for m in kernels["4k"]]
    seqs = {k: decoding_seqs(s, ends, 100, r) for k, s in stacks.items()}
    h = torch.randn(r, ends.cfg.hidden_size)

    def matmuls(key: str) -> list[torch.Tensor]:
        return [m(x) for m, x in zip(kernels[key], xs, strict=True)]

    def step(key: str) -> list[torch.Tensor]:
        for s in seqs[key]:
            s.cache.length = 100
        return [stacks[key].forward_rows(h, torch.full((r,), 100), seqs[key])]

    compare(f"{r} rows, layer matmuls", matmuls, repeats)
    compare(f"{r} sequences, a step", step, repeats)


def main() -> None:
    rows, repeats = [int(r) for r in sys.argv[1].split(",")], int(sys.argv[2])
    files = resolve_model(None)
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files)
    ends = TokenEnds.load(src, cfg, weight_format("auto"))
    before = anon_huge_kib()
    stacks = {"4k": load(src, cfg, False), "2m": load(src, cfg, True)}
    print(f"AnonHugePages: {before} KiB before the two stacks, {anon_huge_kib()} after")
    with torch.inference_mode():
        for r in rows:
            measure(stacks, ends, r, repeats)


if __name__ == "__main__":
    main()
