"""Medusa heads (Cai et al. 2024, Medusa-1): K extra heads on the target's final hidden state.

At a position whose own head predicts token t+1, head k (k = 1..K) predicts token t+1+k. Each head is one
residual block, g + SiLU(W g + b) with W and b zero-initialised (so an untrained head starts as the target's
own next-token head), read out through the target's own LM head, shared and frozen. g is what that head
reads: the final norm of the last layer's output. They run in the controller, on the hidden state the
verification pass returns anyway.

The readout is restricted to the `vocab` ids the target most often emits (the full 49k-row head would cost
K times what one of its layers costs per step); ids outside it are never proposed, which only makes a tree
miss where the heads might have hit. Trained by `edgespec train-medusa` (decoding/training/train_medusa.py); the file
holds the blocks, the vocabulary, the default candidate tree and a fingerprint of the target, checked at load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from edgespec.decoding.medusa_tree import Tree
from edgespec.decoding.target_fit import check_target, restricted_head, target_metadata
from edgespec.model.config import ModelConfig
from edgespec.model.linear import pack_linears
from edgespec.model.stack import TokenEnds

DEFAULT_TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]  # used when a file names none


class MedusaNet(nn.Module):
    """The K residual blocks (trainable, and the inference module) and the vocabulary they read out to."""

    vocab: torch.Tensor  # the buffer

    def __init__(self, cfg: ModelConfig, n_heads: int, vocab: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        blocks = [nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype) for _ in range(n_heads)]
        for block in blocks:  # zero start: each head begins as the target's own head
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.blocks = nn.ModuleList(blocks)  # nn.Linear until pack_linears makes them kernel linears
        self.register_buffer("vocab", vocab.long())  # [N] target ids the heads may propose

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        """g [..., H] (normed final hidden states) -> each head's feature [..., K, H], read by the LM head."""
        return torch.stack([g + F.silu(block(g)) for block in self.blocks], dim=-2)

    def save(self, path: Path, ends: TokenEnds, record: dict, tree: list[list[int]]) -> None:
        """Weights (bf16: serving runs bf16), the target's metadata and the default tree; the record beside it."""
        tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={**target_metadata(ends), "tree": json.dumps(tree)})
        path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


class MedusaModel:
    """Trained heads bound to the served model's token ends; shared by every request (use on the model thread)."""

    def __init__(self, net: MedusaNet, ends: TokenEnds, tree: Tree):
        self.net, self.ends, self.tree = net, ends, tree
        self.n_heads = len(net.blocks)
        self.head = restricted_head(ends, net.vocab)  # [..., H] -> [..., N]

    @classmethod
    def load(cls, path: Path, ends: TokenEnds) -> MedusaModel:
        """Heads from `path`; a clear ValueError when they were trained for another model."""
        meta = check_target("Medusa heads", path, ends)
        state = load_file(str(path))
        n_heads = sum(1 for k in state if k.endswith(".weight"))
        net = MedusaNet(ends.cfg, n_heads, state["vocab"], ends.dtype)
        net.load_state_dict({k: v.to(ends.dtype) if v.is_floating_point() else v for k, v in state.items()},
                            strict=True)
        net.requires_grad_(False)
        tree = Tree(json.loads(meta.get("tree", json.dumps(DEFAULT_TREE))))
        if tree.depth > n_heads:
            raise ValueError(f"Medusa heads ({path}): the tree is {tree.depth} deep but there are {n_heads} heads")
        return cls(pack_linears(net.eval()), ends, tree)

    @torch.inference_mode()
    def propose_batch(self, requests: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """(hidden [H], top) per sequence (a last-layer output, before the final norm) -> each head's `top`
        best ids [K, top] per sequence: the engine's batched proposer (engine/program.py's Propose). The heads
        and the restricted LM head run once over every sequence's row: their kernels are row-invariant, so each
        sequence gets the bits it gets alone, and the head's rows are read once per step, not once per
        sequence."""
        g = self.ends.norm(torch.stack([h for h, _ in requests]).to(self.ends.dtype))  # [n, H]
        logits = self.head(self.net(g))  # [n, K, N]
        return [self.net.vocab[lg.topk(min(top, lg.shape[-1]), dim=-1).indices]  # [K, top]
                for lg, (_, top) in zip(logits, requests, strict=True)]
