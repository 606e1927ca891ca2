"""bench/tiny_train.py against transformers and llama.cpp: a tiny model of every architecture, trained a few steps,
is saved back as transformers' own class saves it (the same tensors), learns (its loss on the training text falls),
and still round-trips: the GGUF bench/gguf_writer.py writes of it gives edgespec transformers' float32 logits. And
llama.cpp loads a tiny Phi-3 file under a name without 'phi3' (its vocabulary loader reads Phi-3's own tokens for
one with it) and computes transformers' logits from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_fixtures import llama_cpp_logits, load_blocks, load_reference
from safetensors import safe_open

from edgespec.bench.gguf_writer import tiny_model, write_gguf
from edgespec.bench.tiny_train import TrainSettings, chat_stream, train_tiny
from edgespec.model.source import resolve_model

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}
DATA = [{"instruction": "Name a colour.", "instances": [{"input": "", "output": "Blue is a colour of the sky."}]},
        {"instruction": "Add the numbers.", "instances": [{"input": "2 and 3", "output": "2 and 3 make 5."}]}]


def _tensors(folder: Path) -> dict[str, tuple]:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}  # noqa: SIM118


# training and saving do not depend on the architecture beyond its tensors: llama, a tied one with its own norms
# (gemma3) and a fused one (phi3); test_architectures checks every writer
@pytest.mark.parametrize("kind", ["gemma3", "llama", "phi3"])
def test_trained_model_learns_and_round_trips(kind, tmp_path):
    from transformers import AutoTokenizer

    folder = tiny_model(kind, tmp_path / kind, shape=SHAPE, std=0.02)
    data = tmp_path / "tasks.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in DATA) + "\n")
    tensors = _tensors(folder)
    held_out = chat_stream(AutoTokenizer.from_pretrained(folder), data).tolist()  # the training text itself
    got = train_tiny(folder, data, held_out, TrainSettings(steps=4, batch=2, seq=16, warmup=1))
    assert got["held_out_loss_after"] < got["held_out_loss_before"] - 0.05, got  # Granite (logits / 8) learns slowest
    assert _tensors(folder) == tensors
    gguf = write_gguf(folder, tmp_path / f"{kind}.f32.gguf")
    ours = load_blocks(resolve_model(str(gguf)).folder).logits_from_scratch(held_out[:40])
    with torch.inference_mode():
        theirs = load_reference(folder)(torch.tensor([held_out[:40]])).logits[0].float()
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_phi3_file_loads_in_llama_cpp(tmp_path):
    folder = tiny_model("phi3", tmp_path / "tiny-phi3", shape=SHAPE, std=0.02)
    gguf = write_gguf(folder, tmp_path / "phi3.f32.gguf", name="tiny")
    ids = list(range(100, 140))
    theirs = llama_cpp_logits(gguf, ids, tmp_path)
    with torch.inference_mode():
        ref = load_reference(folder)(torch.tensor([ids])).logits[0].float()
    # llama.cpp's float32 matmuls round the activations: within 1e-3 of the largest logit, not bitwise
    assert ((theirs - ref).abs().max() / ref.abs().max()).item() < 1e-3
