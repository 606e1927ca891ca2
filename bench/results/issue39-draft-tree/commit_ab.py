"""A tree's commit of moved slots in the served model's KV pool (30 layers, 3 KV heads of 64, float16): the
per-layer indexed copies the cache made before (a keys' and a values' copy per layer) against KVCache.commit's
one copy over the pool's single tensor; medians of 2000, the two alternated, results checked equal.

    python bench/results/issue39-draft-tree/commit_ab.py > bench/results/issue39-draft-tree/commit_ab.txt
"""

import statistics
import time

import torch

from edgespec.model.kv_cache import KVCache
from edgespec.model.kv_format import kv_format


def per_layer(cache: KVCache, kept: list[int], dest: int) -> None:
    # the copies as KVCache.commit made them before the pool was one tensor
    src_b, src_o = cache._where(torch.tensor(kept, dtype=torch.long))
    dst_b, dst_o = cache._where(torch.arange(dest, dest + len(kept)))
    for store in (*cache.pool.k, *cache.pool.v):
        store[dst_b, :, dst_o] = store[src_b, :, src_o]
    cache.length = dest + len(kept)


def main() -> None:
    cache = KVCache.alone(30, 3, 64, 400, kv_format("float16"))
    cache.pool.kv.normal_()
    for kept in ([150, 152], [150, 151, 154, 157]):
        times = {"per layer": [], "one copy": []}
        for _ in range(2000):
            for name, commit in (("per layer", per_layer), ("one copy", KVCache.commit)):
                cache.length = 160
                t = time.perf_counter()
                commit(cache, kept, 150)
                times[name].append(time.perf_counter() - t)
        before = cache.pool.kv.clone()
        cache.length = 160
        per_layer(cache, kept, 150)
        expected = cache.pool.kv.clone()
        cache.pool.kv.copy_(before)
        cache.length = 160
        cache.commit(kept, 150)
        assert torch.equal(cache.pool.kv, expected)
        print(f"kept {kept} at 150: " + ", ".join(f"{name} {statistics.median(ts) * 1e6:.1f} us"
                                                  for name, ts in times.items()))


if __name__ == "__main__":
    main()
