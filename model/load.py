"""Builds the controller's model from a model folder: the one place that wires the parts together."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.runner import ModelRunner
from model.source import ModelFiles
from model.stack import LayerStack, TokenEnds
from model.stage import LocalStage, Pipeline
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


def load_local(files: ModelFiles, dtype: str, kv_budget_gib: float, threads: int) -> LoadedModel:
    """All layers in-process: one LocalStage."""
    cfg = ModelConfig.from_folder(files.folder)
    torch_dtype = DTYPES[dtype]
    src = TensorSource(files.folder)
    ends = TokenEnds.load(src, cfg, torch_dtype)
    stage = LocalStage(LayerStack.load(src, cfg, 0, cfg.n_layers, torch_dtype), int(kv_budget_gib * 2**30))
    runner = ModelRunner(cfg, ends, Pipeline([stage]), threads)
    return LoadedModel(files, cfg, load_tokenizer(files), runner)
