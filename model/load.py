"""Builds the controller's model from a model folder: the one place that wires the parts together."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.runner import ModelRunner
from model.source import ModelFiles
from model.stack import LayerStack, TokenEnds
from model.stage import LocalStage, Pipeline
from model.thread import ModelThread
from model.weights import TensorSource

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """Everything the controller needs to serve one model."""

    files: ModelFiles
    cfg: ModelConfig
    tokenizer: object
    runner: ModelRunner


def load_tokenizer(files: ModelFiles):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.folder)


def load_with_pipeline(files: ModelFiles, dtype: str, pipeline, thread: ModelThread) -> LoadedModel:
    """The controller's model around a given stage pipeline (the controller loads only the token ends)."""
    cfg = ModelConfig.from_folder(files.folder)
    ends = thread.run_sync(TokenEnds.load, TensorSource(files.folder), cfg, DTYPES[dtype])
    return LoadedModel(files, cfg, load_tokenizer(files), ModelRunner(cfg, ends, pipeline, thread))


def load_local(files: ModelFiles, dtype: str, kv_budget_gib: float, thread: ModelThread) -> LoadedModel:
    """All layers in-process: one LocalStage."""
    cfg = ModelConfig.from_folder(files.folder)
    stack = thread.run_sync(LayerStack.load, TensorSource(files.folder), cfg, 0, cfg.n_layers, DTYPES[dtype])
    stage = LocalStage(stack, int(kv_budget_gib * 2**30))
    return load_with_pipeline(files, dtype, Pipeline([stage]), thread)
