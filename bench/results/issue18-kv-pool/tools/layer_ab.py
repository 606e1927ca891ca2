"""The served model's 30 decoder layers over 16 decoding sequences with 100 cached slots each: the compiled
kernel before the KV pool (each sequence's own contiguous storage; its build from a worktree of 314a932) and
after it (pool blocks of BS slots), alternated in one process on the same data, so the machine's noise hits
both alike. A one-off measurement tool, kept with its results:

    python bench/results/issue18-kv-pool/tools/layer_ab.py OLD_SO BS
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import statistics
import sys
import time

import torch

from edgespec.model import kernels
from edgespec.model.config import ModelConfig
from edgespec.model.linear import weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack
from edgespec.model.weights import open_source

R, C = 16, 100  # sequences, cached slots each


def load(path: str):
    name = path.split("/")[-1].split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
    loader.exec_module(module)
    return module


def main(old_so: str, bs: int) -> None:
    torch.set_num_threads(2)
    old, new = load(old_so), kernels.load()
    files = resolve_model(None)
    cfg = ModelConfig.from_folder(files.folder)
    layers = list(LayerStack.load(open_source(files), cfg, 0, cfg.n_layers, weight_format("auto")).layers)
    hd, n_q, n_kv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads

    def relink(lin):  # the same weights as the old build's Linear
        t = [getattr(lin, n) for n in lin.TENSORS]
        return old.Linear(lin.KIND, *t, *[t[0]] * (3 - len(t)), lin.bias, lin.out_features)

    olds = [[relink(m) for m in (x.attn.qkv, x.attn.o, x.ffn.gate_up, x.ffn.down)] for x in layers]
    x, cos, sin = torch.randn(R, cfg.hidden_size), torch.randn(R, hd), torch.randn(R, hd)
    own = [[(torch.randn(1, n_kv, C + 64, hd), torch.randn(1, n_kv, C + 64, hd)) for _ in range(R)] for _ in layers]
    nb = (C + 64) // bs
    pools = [(torch.randn(R * nb, n_kv, bs, hd), torch.randn(R * nb, n_kv, bs, hd)) for _ in layers]
    tables = [torch.arange(i * nb, (i + 1) * nb) for i in range(R)]

    def run_old():
        for layer, (q, o, gu, d), kv in zip(layers, olds, own, strict=True):
            seqs = [old.SeqKV(k, v, C, None, None, 0, C, 1, None) for k, v in kv]
            old.decoder_layer_rows(x, layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps, q, o,
                                   gu, d, n_q, n_kv, cos, sin, seqs)

    def run_new():
        for layer, (pk, pv) in zip(layers, pools, strict=True):
            a, f = layer.attn, layer.ffn
            seqs = [new.SeqKV(pk, pv, t, C, 1, None) for t in tables]
            new.decoder_layer_rows(x, layer.input_norm.weight, layer.post_norm.weight, layer.input_norm.eps,
                                   a.qkv.kernel, a.o.kernel, f.gate_up.kernel, f.down.kernel, n_q, n_kv, cos, sin,
                                   seqs)

    times = {"before": [], "after": []}
    for _ in range(25):
        for name, fn in (("before", run_old), ("after", run_new)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: {cfg.n_layers} layers, {R} sequences, blocks of {bs}: median ms",
              round(statistics.median(ts) * 1000, 2))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
