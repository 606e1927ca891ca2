"""Builds the controller's model from a model folder: the one place that wires the parts together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

from edgespec.engine.executor import Cuts, Executor
from edgespec.model.config import ModelConfig
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import weight_format
from edgespec.model.source import ModelFiles
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.stage import LocalStage, Pipeline
from edgespec.model.thread import ModelThread
from edgespec.model.weights import open_source


class Tokenizer(Protocol):
    """What the service asks of the model's tokenizer (a transformers tokenizer; the tests' own stand-ins). The
    chat template, grammars and reasoning markers read more of it (server/tool_prompt.py, decoding/grammar.py)."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass
class LoadedModel:
    """Everything the controller needs to serve one model."""

    files: ModelFiles
    cfg: ModelConfig
    tokenizer: Tokenizer
    executor: Executor  # the token ends around the stages; the engine (engine/engine.py) runs requests on it


def load_tokenizer(files: ModelFiles) -> Tokenizer:
    from transformers import AutoTokenizer

    # cast: transformers types decode() as `str | list[str]` for every input; a list of ids decodes to one str
    return cast(Tokenizer, AutoTokenizer.from_pretrained(files.folder))


def load_with_pipeline(files: ModelFiles, weights: str, pipeline, thread: ModelThread, src=None,
                       cuts: Cuts | None = None, kv: str = "float32") -> LoadedModel:
    """The controller's model around a given stage pipeline (the controller loads only the token ends);
    `src`: the model's tensor source when the caller has opened it already."""
    cfg = ModelConfig.from_folder(files.folder)
    ends = thread.run_sync(TokenEnds.load, src or open_source(files), cfg, weight_format(weights))
    return LoadedModel(files, cfg, load_tokenizer(files), Executor(cfg, ends, pipeline, thread, cuts, kv_format(kv)))


def local_pipeline(files: ModelFiles, weights: str, kv_budget_gib: float, src=None,
                   prefault: bool = False, kv: str = "float32") -> Pipeline:
    """Every layer in this process, as one LocalStage with a KV pool of kv_budget_gib in KV format `kv` (run on
    the model thread; prefault: see model/kv_pool.py)."""
    cfg = ModelConfig.from_folder(files.folder)
    stack = LayerStack.load(src or open_source(files), cfg, 0, cfg.n_layers, weight_format(weights), kv_format(kv))
    return Pipeline([LocalStage(stack, int(kv_budget_gib * 2**30), prefault)])


def load_local(files: ModelFiles, weights: str, kv_budget_gib: float, thread: ModelThread,
               cuts: Cuts | None = None, prefault: bool = False, kv: str = "float32") -> LoadedModel:
    """All layers in-process: one LocalStage."""
    src = open_source(files)  # one read of a GGUF's tensor index for the layers and the token ends
    pipeline = thread.run_sync(local_pipeline, files, weights, kv_budget_gib, src, prefault, kv)
    return load_with_pipeline(files, weights, pipeline, thread, src, cuts, kv)
