"""The served model as Ollama's model routes show it (/api/tags, /api/show, /api/ps): its names, details, size
and digest, read once at start from the model's files and config. No tensors: file sizes and metadata."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from edgespec.model.config import ModelConfig
from edgespec.model.source import ModelFiles

LATEST = "latest"  # Ollama's tag for a name without one
# Ollama's expires_at for a model kept loaded for ever (keep_alive < 0): now plus the longest Go duration
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


def rfc3339(t: datetime) -> str:
    """A UTC time as Ollama (Go's time.Time) writes it: 2023-08-04T19:22:45.499127Z."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def now() -> str:
    return rfc3339(datetime.now(UTC))


def human_count(n: int) -> str:
    """A parameter count as Ollama's parameter_size writes it: 134.52M, 1.7B."""
    for scale, unit in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{round(n / scale, 2):g}{unit}"
    return str(n)


def parameter_count(cfg: ModelConfig) -> int:
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.n_layers * cfg.layer_param_count() + embeddings + cfg.hidden_size  # + the final norm


def weight_files(files: ModelFiles) -> list[Path]:
    return [files.gguf] if files.gguf is not None else sorted(files.folder.glob("*.safetensors"))


def quantization_level(files: ModelFiles, dtype: str) -> str:
    """The weights' format as Ollama names it (Q4_1, Q8_0, F16, BF16, F32): the `--weights` format, or with
    `auto` the GGUF's own file type, or the checkpoint's dtype."""
    if dtype != "auto":
        return {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype, dtype.upper())
    if files.gguf is not None:
        from gguf import LlamaFileType

        from edgespec.model.gguf_source import read_index

        kind = read_index(files.gguf).meta.get("general.file_type")
        return LlamaFileType(kind).name.removeprefix("MOSTLY_") if isinstance(kind, int) else "unknown"
    config = json.loads((files.folder / "config.json").read_text())
    dtypes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    return dtypes.get(str(config.get("torch_dtype") or config.get("dtype")), "unknown")


@dataclass(frozen=True)
class ServedModel:
    """The one model this server serves, in the shapes of Ollama's model routes.

    `listed` is the name /api/tags gives (the served name with Ollama's `:latest` tag unless it carries a tag); a
    request may name the model by the served name or the listed one, in any case (Ollama's names are
    case-insensitive). `digest` identifies what is served (the sha256 of the served name and the weight files'
    names and sizes), not a registry manifest: nothing here is pulled."""

    name: str
    listed: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    size: int
    digest: str
    modified_at: str
    context: int
    capabilities: tuple[str, ...]
    template: str

    @classmethod
    def of(cls, name: str, files: ModelFiles, cfg: ModelConfig, dtype: str, thinks: bool,
           template: str) -> ServedModel:
        weights = weight_files(files)
        stats = [w.stat() for w in weights]
        identity = json.dumps([name, [(w.name, s.st_size) for w, s in zip(weights, stats, strict=True)]])
        family = cfg.arch.gguf
        count = parameter_count(cfg)
        details = {"parent_model": "", "format": "gguf" if files.gguf is not None else "safetensors",
                   "family": family, "families": [family], "parameter_size": human_count(count),
                   "quantization_level": quantization_level(files, dtype)}
        info = {"general.architecture": family, "general.parameter_count": count,
                f"{family}.context_length": cfg.max_position_embeddings, f"{family}.embedding_length": cfg.hidden_size,
                f"{family}.block_count": cfg.n_layers, f"{family}.feed_forward_length": cfg.intermediate_size,
                f"{family}.attention.head_count": cfg.n_heads, f"{family}.attention.head_count_kv": cfg.n_kv_heads,
                f"{family}.vocab_size": cfg.vocab_size}
        modified = max((s.st_mtime for s in stats), default=0.0)
        # Ollama's capabilities: tools for every model here (a template without a tool format gets the
        # polyfill, server/tool_prompt.py), thinking where the template thinks (server/reasoning.py)
        capabilities = ("completion", "tools", *(("thinking",) if thinks else ()))
        return cls(name, name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{LATEST}", details, info,
                   sum(s.st_size for s in stats), hashlib.sha256(identity.encode()).hexdigest(),
                   rfc3339(datetime.fromtimestamp(modified, UTC)), cfg.max_position_embeddings, capabilities,
                   template)

    def accepts(self, name: str) -> bool:
        return name.lower() in (self.name.lower(), self.listed.lower())

    def tag(self) -> dict[str, Any]:
        """Its entry in /api/tags."""
        return {"name": self.listed, "model": self.listed, "modified_at": self.modified_at, "size": self.size,
                "digest": self.digest, "details": self.details}

    def running(self, kv_bytes: int) -> dict[str, Any]:
        """Its entry in /api/ps: loaded for good (keep_alive has no effect), its size the weight files and the KV
        cache held now; no GPU memory."""
        return {"name": self.listed, "model": self.listed, "size": self.size + kv_bytes, "digest": self.digest,
                "details": self.details, "expires_at": rfc3339(datetime.now(UTC) + FOREVER), "size_vram": 0,
                "context_length": self.context}

    def show(self) -> dict[str, Any]:
        """/api/show. The template is the model's own chat template (Jinja, not Ollama's Go template)."""
        return {"modelfile": f"# the model edgespec serves\nFROM {self.listed}\n", "parameters": "",
                "template": self.template, "details": self.details, "model_info": self.model_info,
                "capabilities": list(self.capabilities), "modified_at": self.modified_at}
