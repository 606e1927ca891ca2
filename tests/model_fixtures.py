"""Shared model helpers for the tests (a plain module: test files import what they need from here).

`make_tiny_model` writes a tiny random Llama checkpoint (safetensors) that loads in well under a second;
`smollm2_folder` is the converted SmolLM2-135M-Instruct cache that the server serves by default.
The rest runs our block model (TokenEnds around a LayerStack) the way a decoding policy does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from edgespec.bench.gguf_writer import ARCH_CLASSES, tiny_config
from edgespec.model.config import ModelConfig
from edgespec.model.kv_cache import KVCache
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source

TINY_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: two query heads per KV head
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def make_tiny_model(folder: Path | str, seed: int = 0, arch: str = "llama", **overrides) -> Path:
    """Write a tiny random model of architecture `arch` (config.json + model.safetensors) into `folder`, made
    with transformers' own class; returns it.

    `overrides` are extra config arguments (attention_bias=True, rope_scaling=LLAMA3_ROPE, ...).
    Biases and norm weights, which transformers initialises to constants, are randomised too so that
    loading them into the wrong place cannot go unnoticed.
    """
    import transformers

    folder = Path(folder)
    torch.manual_seed(seed)
    config = tiny_config(arch, TINY_CONFIG, overrides)
    model = getattr(transformers, ARCH_CLASSES[arch][1])(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_mixture_gguf(tmp: Path) -> Path:
    """A tiny Qwen3-MoE as a GGUF under `tmp`: 4 layers of width 256, 8 experts of 256, 2 a row (about 1.3 MB a
    layer in Q4_1, 1.4 with its KV for 256 tokens), for serving over workers whose budgets hold a layer or two."""
    from edgespec.bench.gguf_writer import tiny_model, write_gguf

    shape = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}
    folder = tiny_model("qwen3_moe", tmp / "folder", 0, shape, moe_intermediate_size=256)
    return write_gguf(folder, tmp / "moe.gguf", name="tiny-moe")


def smollm2_folder() -> Path:
    """The SmolLM2-135M-Instruct cache folder (config and tokenizer of the packaged GGUF, which holds its weights)."""
    from edgespec.model.source import resolve_model

    return resolve_model(None).folder


def load_reference(folder: Path | str):
    """transformers' model for `folder` in float32, in eval mode (a GGUF's cache folder: from its GGUF file)."""
    from transformers import AutoModelForCausalLM

    from edgespec.model.source import resolve_model

    gguf = resolve_model(str(folder)).gguf
    if gguf is not None:
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@dataclass
class Blocks:
    """Our model: the token ends and a stack of all decoder layers."""

    cfg: ModelConfig
    ends: TokenEnds
    stack: LayerStack

    def new_cache(self, capacity: int) -> KVCache:
        return self.stack.new_cache(capacity)

    def forward(
        self,
        ids: list[int] | torch.Tensor,
        cache: KVCache,
        start: int | None = None,
        positions: torch.Tensor | list | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens ids [B, T] (or a flat list: one row) written at slots start.. -> float32 logits [B, T, V]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        start = cache.length if start is None else start
        if positions is None:
            positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
        positions = torch.as_tensor(positions, dtype=torch.long)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        hidden = self.stack(self.ends.embed_tokens(ids), positions, cache, start, mask)
        return self.ends.logits(hidden)

    def logits_from_scratch(self, ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of one sequence run through a fresh cache in one pass."""
        return self.forward(ids, self.new_cache(len(ids)))[0]

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """n greedy tokens after `prompt` using the KV cache (prefill, then one token per step).

        Returns the tokens and the prompt's logits [T, V].
        """
        cache = self.new_cache(len(prompt) + n)
        prompt_logits = self.forward(prompt, cache, 0)[0]
        out = [int(prompt_logits[-1].argmax())]
        while len(out) < n:
            logits = self.forward([out[-1]], cache, cache.length)[0, -1]
            out.append(int(logits.argmax()))
        return out, prompt_logits


def load_blocks(folder: Path | str, dtype: torch.dtype = torch.float32) -> Blocks:
    """Our block model for `folder`, loaded through open_source and ModelConfig."""
    cfg = ModelConfig.from_folder(Path(folder))
    src = open_source(Path(folder))
    return Blocks(cfg, TokenEnds.load(src, cfg, dtype), LayerStack.load(src, cfg, 0, cfg.n_layers, dtype))


def make_feature_drafter(folder: Path | str, out: Path, seed: int = 0, every: int = 2) -> Path:
    """A random feature drafter (decoding/eagle.py) for the model in `folder`, proposing every `every`-th id."""
    from edgespec.decoding.eagle import FeatureNet

    cfg = ModelConfig.from_folder(Path(folder))
    ends = TokenEnds.load(open_source(Path(folder)), cfg, torch.float32)
    torch.manual_seed(seed)
    net = FeatureNet(cfg, torch.arange(0, cfg.vocab_size, every))
    net.save(out, ends, {"random": True, "seed": seed})
    return out


def make_medusa_heads(folder: Path | str, out: Path, vocab: list[int], tree: list[list[int]], n_heads: int = 3,
                      seed: int = 0) -> Path:
    """Random Medusa heads (decoding/medusa_heads.py) for the model in `folder`, proposing only `vocab`: a small
    vocabulary that holds the tokens a test generates makes the trees hit often."""
    from edgespec.decoding.medusa_heads import MedusaNet

    cfg = ModelConfig.from_folder(Path(folder))
    ends = TokenEnds.load(open_source(Path(folder)), cfg, torch.float32)
    torch.manual_seed(seed)
    net = MedusaNet(cfg, n_heads, torch.tensor(sorted(vocab)))
    with torch.no_grad():
        for block in net.blocks:
            block.weight.normal_(0.0, 0.3)
    net.save(out, ends, {"random": True, "seed": seed}, tree)
    return out


def continuation_table(executor, prompt: list[int], sampling: dict, length: int) -> dict[tuple[int, ...], float]:
    """The target's exact distribution over its `length`-token continuations of `prompt` under the sampling
    settings `sampling` (keep the support small: top_k), enumerated with one forward pass per prefix."""
    import asyncio

    from edgespec.decoding.sampling import Sampler
    from edgespec.decoding.types import SamplingParams

    async def build() -> dict:
        session = await executor.open_own(len(prompt) + length + 1)
        sampler = Sampler(SamplingParams(**sampling), executor.cfg.vocab_size)
        table = {}

        async def expand(prefix: list[int], prob: float) -> None:
            p = sampler.probs((await executor.forward(session, torch.tensor([prompt + prefix]), start=0))[0, -1])
            for t in torch.nonzero(p).flatten().tolist():
                if len(prefix) + 1 == length:
                    table[(*prefix, t)] = prob * float(p[t])
                else:
                    await expand([*prefix, t], prob * float(p[t]))

        try:
            await expand([], 1.0)
            return table
        finally:
            await executor.release_own(session)

    return asyncio.run(build())


def chi_square_pvalue(counts: dict, table: dict) -> float:
    """p-value of observed outcome counts against the exact probabilities `table` (same keys)."""
    import numpy as np
    from scipy import stats

    keys = sorted(table)
    expected = np.array([table[k] for k in keys])
    n = sum(counts.values())
    return float(stats.chisquare([counts[k] for k in keys], expected / expected.sum() * n).pvalue)


LLAMA_SCORE = ("import sys, numpy as np, llama_cpp\n"
               "llm = llama_cpp.Llama(model_path=sys.argv[1], logits_all=True, n_ctx=64, n_threads=2, verbose=False)\n"
               "ids = np.load(sys.argv[2]).tolist(); llm.eval(ids)\n"
               "np.save(sys.argv[3], np.asarray(llm.scores[:len(ids)], dtype=np.float32))\n")


def llama_cpp_logits(gguf: Path, ids: list[int], tmp: Path) -> torch.Tensor:
    """llama.cpp's float32 logits [T, V] at every position of `ids` on the file `gguf` (llama-cpp-python's
    interpreter, in its own process); the test is skipped where there is none (make peer-env)."""
    import subprocess

    import numpy as np
    import pytest

    from edgespec.bench.llamacpp import llama_python

    try:
        python = llama_python()
    except FileNotFoundError:
        pytest.skip("no llama-cpp-python (make peer-env)")
    np.save(tmp / "ids.npy", np.asarray(ids))
    run = subprocess.run([python, "-c", LLAMA_SCORE, str(gguf), str(tmp / "ids.npy"), str(tmp / "out.npy")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return torch.from_numpy(np.load(tmp / "out.npy"))
