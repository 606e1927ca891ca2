"""How often a mixture's router chooses each expert: the routing frequency expert placement weighs
(planning/experts.py), measured over calibration text (calibration.txt: home-assistant requests, chat, code,
arithmetic, translation).

The model runs one layer at a time, each loaded alone and freed before the next, so the measurement needs one
layer's memory, not the model's: it runs on the controller before the placement of a model no device holds.
"""

from __future__ import annotations

from importlib import resources

import torch

from edgespec.model.blocks import SeqRows
from edgespec.model.config import ModelConfig
from edgespec.model.ffn import Experts
from edgespec.model.linear import WeightFormat, as_format
from edgespec.model.load import load_tokenizer
from edgespec.model.source import ModelFiles
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def calibration_text() -> str:
    return resources.files("edgespec.model").joinpath("calibration.txt").read_text()


@torch.inference_mode()
def expert_use(files: ModelFiles, fmt: WeightFormat | torch.dtype | str, ids: list[int] | None = None
               ) -> tuple[tuple[float, ...], ...]:
    """Each layer's share of tokens whose top-k holds each expert ([n_layers][n_experts]; a dense layer's row
    is empty) over the token ids `ids` (default: calibration.txt's)."""
    fmt = as_format(fmt)
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files)
    if ids is None:
        ids = load_tokenizer(files).encode(calibration_text())[: cfg.max_position_embeddings]
    t = len(ids)
    x = TokenEnds.load(src, cfg, fmt).embed_tokens(torch.tensor([ids]))[0]  # [T, H]
    positions = torch.arange(t)
    use: list[tuple[float, ...]] = []
    for i in range(cfg.n_layers):
        stack = LayerStack.load(src, cfg, i, i + 1, fmt)
        layer, cache = stack.layers[0], stack.new_cache(t)
        if not isinstance(layer.ffn, Experts):
            x = stack.forward_rows(x, positions, [SeqRows(cache, 0, t, None)])
            use.append(())
            continue
        cache.ensure(0, t)
        z = layer.post_attention_rows(x, stack.rotary(positions[None]), [SeqRows(cache, 0, t, None)], 0)
        chosen, _ = layer.ffn.route(layer.post_norm(z))  # [T, k]
        use.append(tuple((torch.bincount(chosen.flatten(), minlength=cfg.n_experts) / t).tolist()))
        x = z + layer.feed_forward(z[None])[0]
    return tuple(use)
