"""Scale models (model/synth.py, `edgespec synth-model`) on a tiny card: seeded bytes, loading through the normal
path, the write-once cache, distributed serving equal to in-process, and the command line."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from processes import REPO, greedy, start_server

from edgespec.model.load import load_local
from edgespec.model.source import GGUF_POINTER, resolve_model
from edgespec.model.synth import GGUF_FILE, load_shape, shape_names, synthesize, weight_files
from edgespec.model.thread import ModelThread
from edgespec.model.weights import open_source

VOCAB = 512
PROMPTS = ["Name three rivers.", "Write a haiku about the sea, please, with care."]
BUDGET_GIB = 0.05  # the tiny model's weights are a few hundred KB: this holds them and the caches


def card(name: str, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int, inter: int) -> dict:
    """A shape card as config/models has them (layer_params / ends_params are what the planner reads)."""
    head_dim = hidden // n_heads
    layer = hidden * (n_heads + 2 * n_kv_heads) * head_dim + hidden * n_heads * head_dim + 3 * hidden * inter
    return {"name": name, "n_layers": n_layers, "hidden_size": hidden, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
            "head_dim": head_dim, "layer_params": layer + 2 * hidden, "ends_params": 2 * VOCAB * hidden + hidden,
            "context": 256, "weight_bytes_per_param": 2.0, "kv_bytes_per_value": 2, "activation_bytes_per_value": 2,
            "hf": {"intermediate_size": inter, "vocab_size": VOCAB, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
                   "max_position_embeddings": 256, "tie_word_embeddings": False}}


@pytest.fixture(scope="module")
def shape(tmp_path_factory) -> str:
    """Path of a tiny card: 2 layers, hidden 64, 4 query heads over 2 KV heads of 16, FFN 128, vocabulary 512."""
    path = tmp_path_factory.mktemp("card") / "tiny-scale.json"
    path.write_text(json.dumps(card("Tiny-Scale", 2, 64, 4, 2, 128)))
    return str(path)


@pytest.fixture(scope="module")
def folders(shape, tmp_path_factory) -> dict[str, Path]:
    """Scale models of the tiny card: two writes of the same seed, and another seed, per format."""
    root = tmp_path_factory.mktemp("synth")
    runs = {"q4_1-a": ("q4_1", 0), "q4_1-b": ("q4_1", 0), "q4_1-s1": ("q4_1", 1), "float32-a": ("float32", 0),
            "float32-b": ("float32", 0), "float32-s1": ("float32", 1), "bfloat16": ("bfloat16", 0)}
    return {key: synthesize(shape, root / key, weights, seed, progress=False)
            for key, (weights, seed) in runs.items()}


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# -- 1. the same seed gives the same bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["q4_1", "float32"])
def test_the_same_seed_writes_the_same_bytes(folders, weights):
    a, b, other = folders[f"{weights}-a"], folders[f"{weights}-b"], folders[f"{weights}-s1"]
    names = [p.name for p in weight_files(a)]
    assert names == ([GGUF_FILE] if weights == "q4_1" else ["model.safetensors"])
    assert files_of(a) == files_of(b)  # weights, config, tokenizer, pointer and record, byte for byte
    for name in names:
        assert (a / name).read_bytes() != (other / name).read_bytes()
        assert (a / name).stat().st_size == (other / name).stat().st_size
    for name in ("config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (other / name).read_bytes()
    assert json.loads((other / "synth.json").read_text())["seed"] == 1


def test_formats_hold_the_same_values(folders):
    """bfloat16 is float32 rounded; the GGUF's blocks dequantize to the float32 values (q and k rows come back in
    Hugging Face order: with a wrong rotary permutation their cosine is about 0.1-0.2, not 0.997)."""
    f32, bf16, q41 = (open_source(resolve_model(str(folders[k]))) for k in ("float32-a", "bfloat16", "q4_1-a"))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{part}.weight" for i in range(2)
        for part in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    for name in names:
        ref = f32.get(name, torch.float32)
        assert torch.equal(bf16.get(name, torch.bfloat16), ref.to(torch.bfloat16)), name
        got = q41.get(name, torch.float32)
        assert got.shape == ref.shape, name
        if ref.dim() == 1:
            assert torch.equal(got, ref), name  # norms are F32 ones
            continue
        err = (got - ref).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        assert err < 0.15 * ref.abs().max().item() and cos > 0.99, (name, err, cos)
    # the matrices: N(0, 0.02^2), the output projections scaled by 1/sqrt(2 layers)
    assert f32.get("model.layers.0.self_attn.q_proj.weight", torch.float32).std().item() == pytest.approx(0.02, 0.1)
    assert f32.get("model.layers.1.mlp.down_proj.weight", torch.float32).std().item() == pytest.approx(0.01, 0.1)


# -- 2. the folder loads through the normal path --------------------------------------------------------------------


def forward_with_layers(folder: Path, weights: str, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of one pass over `ids` through load_local's model, and every decoder layer's output."""
    model = load_local(resolve_model(str(folder)), weights, 0.01, ModelThread(1))
    try:
        outputs = []
        for stage in model.executor.pipeline.stages:
            # the layers one by one, so that each one's hook sees its output (a stack's one call gives the same
            # bits: tests/test_exact_format.py)
            stage.stack.one_by_one()
        hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
                 for stage in model.executor.pipeline.stages for layer in stage.stack.layers]

        async def run() -> torch.Tensor:
            session = await model.executor.open_own(len(ids))
            try:
                return await model.executor.forward(session, torch.tensor([ids]))
            finally:
                await model.executor.release_own(session)

        logits = asyncio.run(run())
        for h in hooks:
            h.remove()
        assert model.cfg.vocab_size == VOCAB
        return logits, outputs
    finally:
        model.executor.close()


@pytest.mark.parametrize(("key", "weights"), [("q4_1-a", "auto"), ("q4_1-a", "q8_0"), ("float32-a", "float32"),
                                              ("bfloat16", "bfloat16")])
def test_the_folder_loads_and_runs(folders, key, weights):
    folder = folders[key]
    files = resolve_model(str(folder))
    if key.startswith("q4_1"):
        assert files.gguf == folder / GGUF_FILE and (folder / GGUF_POINTER).read_text().strip() == GGUF_FILE
    else:
        assert files.gguf is None
    ids = [1, 17, 100, 255, 300, 450, VOCAB - 1]
    logits, layers = forward_with_layers(folder, weights, ids)
    assert logits.shape == (1, len(ids), VOCAB)
    assert logits.isfinite().all() and logits.std() > 0
    assert len(layers) == 2
    for out in layers:
        assert out.shape == (1, len(ids), 64)
        assert out.float().isfinite().all()


def test_a_gguf_folder_can_move(folders, tmp_path):
    """The pointer is relative: a copied folder reads its own weights file."""
    moved = Path(shutil.copytree(folders["q4_1-a"], tmp_path / "moved"))
    assert resolve_model(str(moved)).gguf == moved / GGUF_FILE
    logits, _ = forward_with_layers(moved, "auto", [1, 2, 3])
    ref, _ = forward_with_layers(folders["q4_1-a"], "auto", [1, 2, 3])
    assert torch.equal(logits, ref)


def test_hidden_states_stay_finite_in_a_deeper_float16_model(tmp_path):
    """12 layers in float16: the residual stream grows (the outputs' 1/sqrt(2 layers)) but stays finite and small."""
    path = tmp_path / "deeper.json"
    path.write_text(json.dumps(card("Deeper-Scale", 12, 128, 4, 2, 256)))
    folder = synthesize(str(path), tmp_path / "deeper", "float16", 5, progress=False)
    logits, layers = forward_with_layers(folder, "float16", list(range(1, 40)))
    assert logits.isfinite().all()
    assert len(layers) == 12
    for out in layers:
        assert out.dtype == torch.float16 and out.isfinite().all() and out.abs().max() < 100


def test_the_tokenizer_stays_below_the_vocabulary(folders):
    from transformers import AutoTokenizer

    folder = folders["q4_1-a"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) <= VOCAB
    assert max(tok.get_vocab().values()) < VOCAB
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["num_hidden_layers"] == 2 and config["head_dim"] == 16
    assert tok.convert_tokens_to_ids("<|im_start|>") == config["bos_token_id"]
    # the embedded GGUF's end ids by llama.cpp's rule, its eos first
    assert tok.convert_ids_to_tokens(config["eos_token_id"]) == ["<|im_end|>", "<|endoftext|>", "<reponame>"]
    messages = [{"role": "user", "content": "Héllo! Write f(x) = x**2 in Python, with 日本語 comments 🙂"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids and max(ids) < VOCAB and min(ids) >= 0
    assert ids.count(config["bos_token_id"]) >= 2  # the template's <|im_start|>s are single tokens still
    assert tok.decode(ids) == text  # byte-level BPE: every byte is still in the cut vocabulary


# -- 3. written once -------------------------------------------------------------------------------------------------


def test_a_scale_model_is_written_once(shape, tmp_path):
    out = tmp_path / "once"
    assert synthesize(shape, out, "q4_1", 7, progress=False) == out
    weights = out / GGUF_FILE
    before = weights.stat().st_mtime_ns, weights.stat().st_ino, weights.read_bytes()
    (out / "marker").write_text("kept")  # a rewrite replaces the whole folder
    assert synthesize(shape, out, "q4_1", 7, progress=False) == out
    assert (out / "marker").exists()
    assert (weights.stat().st_mtime_ns, weights.stat().st_ino, weights.read_bytes()) == before

    synthesize(shape, out, "q4_1", 8, progress=False)  # another seed: written again
    assert not (out / "marker").exists()
    assert weights.read_bytes() != before[2]
    assert json.loads((out / "synth.json").read_text())["seed"] == 8

    synthesize(shape, out, "float16", 8, progress=False)  # another format: the GGUF is gone
    assert [p.name for p in weight_files(out)] == ["model.safetensors"]
    assert not (out / GGUF_POINTER).exists() and resolve_model(str(out)).gguf is None
    assert not list(tmp_path.glob("once.tmp*"))


# -- 4. distributed equals in-process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(folders, tmp_path_factory):
    """The q4_1 scale model served in-process and over 2 local workers with a memory budget each (profiles go to a
    cache of the module's own)."""
    tmp = tmp_path_factory.mktemp("serve")
    env = {"EDGESPEC_CACHE": str(tmp / "cache")}
    model = str(folders["q4_1-a"])
    inproc, url = start_server(tmp, "inproc", "--model", model, env=env)
    try:
        reference = {p: greedy(url, p, 24) for p in PROMPTS}
    finally:
        inproc.stop()
    proc, url = start_server(tmp, "workers2", "--model", model, "--local-workers", "2", "--worker-threads", "1",
                             "--placement", "even", "--worker-memory-budget-gib", str(BUDGET_GIB),
                             "--plan-concurrency", "1", env=env)
    try:
        yield reference, url
    finally:
        proc.stop()


def test_local_workers_match_in_process(served):
    reference, url = served
    assert all(reference.values())
    for prompt, expected in reference.items():
        assert greedy(url, prompt, 24) == expected


def test_the_worker_memory_budget_reaches_the_workers(served):
    _, url = served
    devices = httpx.get(url + "/dashboard/state", timeout=30).json()["devices"]
    workers = [d for d in devices if d["role"] == "worker"]
    assert len(workers) == 2 and all(w["up"] for w in workers)
    assert [w["memory_budget_bytes"] for w in workers] == [int(BUDGET_GIB * 2**30)] * 2
    assert sorted((r["first"], r["last"]) for w in workers for r in w["layers"]) == [(0, 1), (1, 2)]


# -- 5. the command line --------------------------------------------------------------------------------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec.server.cli", "synth-model", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_command_line_writes_a_model(shape, tmp_path):
    out = tmp_path / "cli-f16"
    r = cli("--shape", shape, "--out", str(out), "--weights", "float16", "--seed", "3", cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(out)
    assert json.loads((out / "synth.json").read_text())["seed"] == 3
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118 (not a dict)
    same = synthesize(shape, tmp_path / "api-f16", "float16", 3, progress=False)
    assert files_of(out) == files_of(same)  # the command line writes what synthesize() writes


def test_the_command_line_names_the_known_shapes(tmp_path):
    r = cli("--shape", "no-such-model", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown shape 'no-such-model'" in r.stderr
    for name in shape_names():
        assert name in r.stderr
    assert "tinyllama-1.1b" in shape_names()
    assert not (tmp_path / "x").exists()
    assert load_shape("TinyLlama-1.1B")["name"] == "TinyLlama-1.1B"  # a card's name, case-insensitive
