"""What a tree pass costs on this machine: the inputs of the default tree's choice (decoding/training/train_medusa.py).

Measured in a process of its own (`python -m edgespec.decoding.training.medusa_cost MODEL HEADS N...`) with all
tensor work on its model thread, as the server runs it: a trainer's own threads would compete with it for the
cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from edgespec.decoding.medusa_heads import MedusaModel
from edgespec.decoding.medusa_tree import Tree
from edgespec.model.load import load_local
from edgespec.model.source import resolve_model
from edgespec.model.thread import ModelThread


def measure_verify_cost(model: str | None, heads: Path, sizes) -> dict[int, float]:
    """Median seconds of one decoding step that verifies n tokens, for n in `sizes`, served in-process in the
    weights and KV cache `edgespec serve` loads by default: a forward pass of n tokens after 300 cached ones
    with a tree mask, the LM head on all of them, an argmax on two (the root and one accepted node) and the
    Medusa heads on one. n = 1 is a plain naive step. Runs in a subprocess."""
    out = subprocess.run([sys.executable, "-m", "edgespec.decoding.training.medusa_cost", model or "", str(heads),
                          *map(str, sorted(set(sizes)))], check=True, capture_output=True, text=True)
    return {int(n): s for n, s in json.loads(out.stdout.splitlines()[-1]).items()}


def _measure(model: str | None, heads_path: Path, sizes: list[int], context: int = 300, reps: int = 15):
    # serve's defaults (--weights auto, --kv-format float16): the shipped tree was sized by bfloat16 passes (26.6
    # ms a step where the served Q4_1 takes about 6 here), whose cost grows otherwise with the tree's rows
    loaded = load_local(resolve_model(model), "auto", 1.0, ModelThread(os.cpu_count() or 1), kv="float16")
    executor = loaded.executor
    heads = executor.thread.run_sync(MedusaModel.load, heads_path, executor.ends)
    ids = executor.thread.run_sync(lambda: torch.randint(100, 20000, (1, context + max(sizes))))

    def tree_step(logits, hidden):  # the policy's work after a tree pass: two nodes' argmax, the Medusa heads
        for node in range(2):
            int(logits[0, node].argmax())
        return heads.propose_batch([(hidden[0, 1], 4)])[0]

    async def measure() -> dict[int, float]:
        session = await executor.open_own(context + max(sizes) + 1)
        try:
            await executor.forward(session, ids[:, :context], last_only=True)
            chains = {n: Tree([[0] * d for d in range(1, n)]) for n in sizes}  # n nodes: the root and a chain
            inputs = {n: await executor.call(lambda c=c: (c.positions(context), c.mask(context)))
                      for n, c in chains.items()}
            times: dict[int, list[float]] = {n: [] for n in sizes}
            for _ in range(reps):
                for n in sizes:  # interleaved, so that noise on the shared machine spreads over every size
                    positions, mask = inputs[n]
                    t0 = time.perf_counter()
                    if n == 1:
                        await executor.forward(session, ids[:, context:context + n], context, last_only=True,
                                             then=lambda logits: int(logits[0, -1].argmax()))
                    else:
                        await executor.forward(session, ids[:, context:context + n], context, positions, mask,
                                             then=tree_step, features=True)
                    times[n].append(time.perf_counter() - t0)
                    executor.truncate(session, context)
            return {n: statistics.median(v) for n, v in times.items()}
        finally:
            await executor.release_own(session)

    try:
        return asyncio.run(measure())
    finally:
        executor.close()


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1] or None, Path(sys.argv[2]), [int(n) for n in sys.argv[3:]])))
