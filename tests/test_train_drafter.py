"""`edgespec train-drafter` end to end on a tiny model (it had stopped training once the float32 blocks took
compiled kernels, which have no backward, and no test ran it), and the blocks' gradients through those paths."""

from __future__ import annotations

import json
import math

import torch
from model_fixtures import smollm2_folder
from processes import tiny_chat_model

from edgespec.decoding.eagle import FeatureDraftModel
from edgespec.model.blocks import RMSNorm, Rotary
from edgespec.model.config import ModelConfig
from edgespec.model.stack import TokenEnds
from edgespec.model.weights import open_source
from edgespec.server.cli import main


def test_train_drafter_learns_and_writes_a_loadable_drafter(tmp_path):
    folder = tiny_chat_model(tmp_path / "target", smollm2_folder())
    data = tmp_path / "data" / "prompts"  # the two prompt files in their own formats, a few lines each
    data.mkdir(parents=True)
    tasks = [{"instruction": f"Name {n} colours.", "instances": [{"input": "", "output": ""}]} for n in range(2, 10)]
    (data / "alpaca_seed_tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (data / "wizardlm_testset.jsonl").write_text("".join(json.dumps({"Instruction": f"What is {n} + {n}?"}) + "\n"
                                                         for n in range(4)))
    out = tmp_path / "eagle.safetensors"
    main(["train-drafter", "--model", str(folder), "--data", str(data.parent), "--work", str(tmp_path / "work"),
          "--max-new-tokens", "12", "--samples", "1", "--epochs", "4", "--vocab", "256", "--holdout", "0.2",
          "--gen-batch", "8", "--out", str(out)])
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["sequences"] == 24 and record["device"] == "cpu"
    losses = [row["train_loss"] for row in record["history"]]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it learns: the same answers, seen four times
    assert set(record["heldout_greedy"]) == {"k=1", "k=2", "k=4"}
    cfg = ModelConfig.from_folder(folder)
    FeatureDraftModel.load("eagle", out, TokenEnds.load(open_source(folder), cfg, torch.float32))


def test_float32_blocks_pass_gradients(tmp_path):
    cfg = ModelConfig.from_folder(tiny_chat_model(tmp_path / "target", smollm2_folder()))
    x = torch.randn(2, 5, cfg.hidden_size, requires_grad=True)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
    norm.weight.requires_grad_(True)
    norm(x).square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    q = torch.randn(2, cfg.n_heads, 5, cfg.head_dim, requires_grad=True)
    Rotary(cfg, torch.float32)(torch.arange(5).expand(2, -1))(q).sum().backward()
    assert q.grad is not None
    with torch.no_grad():  # and without a gradient wanted the kernels still run: the same values as torch's
        y = torch.randn(3, cfg.hidden_size)
        assert torch.allclose(norm(y), torch.rms_norm(y, (cfg.hidden_size,), norm.weight, norm.eps))
