"""Every architecture of model/arch.py against transformers' own forward: a tiny random model made with
transformers' class (SmolLM2's tokenizer, so the vocabulary and chat template are real), loaded by edgespec from
its folder and from a GGUF written the way llama.cpp's converter writes it (bench/gguf_writer.py). Float32
logits agree to 1e-4 relative to the largest logit, greedy continuations are identical, and the GGUF serves a
chat completion through the HTTP API. A 4-bit token embedding (what llama.cpp's quantizer writes for Q4_0, Q4_1
and Q4_K_M files) is looked up exactly. Phi-3's rope as Phi-3-mini-4k (plain, a sliding window), Phi-3.5 and
Phi-4-mini (longrope, partial rotary) have it, its short and its long factors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from inprocess import serves_a_chat_completion
from model_fixtures import load_blocks, load_reference

from edgespec.bench.gguf_writer import ARCH_CLASSES, CONVERTER, tiny_model, write_gguf
from edgespec.model.arch import ARCHITECTURES
from edgespec.model.config import ModelConfig
from edgespec.model.source import resolve_model

REL_TOL = 1e-4
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_every_architecture_is_checked_here():
    assert sorted(ARCH_CLASSES) == sorted(a.name for a in ARCHITECTURES)


def make_model(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    return tiny_model(kind, folder, seed, SHAPE, **overrides)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> (the tiny model of that architecture: its folder, and the folder as a float32 GGUF beside it or
    None where llama.cpp's converter writes none (Ministral)), each made once for the module's tests: a GGUF's
    config and tokenizer are read into the cache at its first load, seconds for a 150k-token vocabulary."""
    made: dict[str, tuple[Path, Path | None]] = {}

    def get(kind: str) -> tuple[Path, Path | None]:
        if kind not in made:
            tmp = tmp_path_factory.mktemp(kind)
            folder = make_model(kind, tmp / "folder")
            converted = json.loads((folder / "config.json").read_text())["model_type"] in CONVERTER
            made[kind] = folder, write_gguf(folder, tmp / f"{kind}.f32.gguf") if converted else None
        return made[kind]

    return get


@pytest.fixture(scope="module", params=sorted(ARCH_CLASSES))
def model(request, files):
    """(kind, folder, GGUF file or None where llama.cpp's converter writes none (Ministral), transformers'
    reference)."""
    folder, gguf = files(request.param)
    return request.param, folder, gguf, load_reference(folder)


def _gguf_of(model) -> Path:
    if model[2] is None:
        pytest.skip(f"llama.cpp's converter writes no GGUF of {model[0]} (it refuses the folder)")
    return model[2]


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def _ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def _reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_logits_and_greedy_equal_transformers(model, source):
    kind, folder, gguf, ref = model
    gguf = _gguf_of(model) if source == "gguf" else gguf
    blocks = load_blocks(folder if source == "folder" else resolve_model(str(gguf)).folder)
    # a GGUF names the converter's architecture: Mistral's dense models are written as llama (the first of a GGUF
    # name); Gemma 3's model_type is gemma3_text
    arch = next(a for a in ARCHITECTURES if a.name == kind)
    expected = arch if source == "folder" else next(a for a in ARCHITECTURES if a.gguf == arch.gguf)
    assert blocks.cfg.arch == expected
    for text in PROMPTS:
        prompt = _ids(folder, text)
        ours = blocks.logits_from_scratch(prompt)
        with torch.inference_mode():
            theirs = ref(torch.tensor([prompt])).logits[0].float()
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < REL_TOL, (kind, source, text, rel)
        assert blocks.greedy(prompt, 16)[0] == _reference_greedy(ref, prompt, 16), (kind, source, text)


def test_the_gguf_config_has_the_folders_shapes(model):
    _, folder, _, _ = model
    gguf = _gguf_of(model)
    ours, theirs = ModelConfig.from_folder(resolve_model(str(gguf)).folder), ModelConfig.from_folder(folder)
    assert (ours.arch.gguf, ours.head_dim, ours.n_heads, ours.n_kv_heads, ours.attention_bias, ours.o_bias,
            ours.rotary_dim, ours.sliding_layers, ours.nope_layers) == \
        (theirs.arch.gguf, theirs.head_dim, theirs.n_heads, theirs.n_kv_heads, theirs.attention_bias, theirs.o_bias,
         theirs.rotary_dim, theirs.sliding_layers, theirs.nope_layers)
    # Granite's multipliers, float32 in the file
    multipliers = ("embed_scale", "attn_scale", "residual_multiplier", "logits_scaling")
    assert [getattr(ours, m) for m in multipliers] == pytest.approx([getattr(theirs, m) for m in multipliers])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_4bit_token_embedding_is_looked_up_exactly(kind, files, tmp_path):
    # llama.cpp's quantizer writes token_embd in the file's 4-bit type: every request failed on it (issue 36);
    # the lookup is the same in every architecture
    folder, _ = files("qwen3")
    ref = load_reference(folder)
    gguf = write_gguf(folder, tmp_path / f"qwen3.{kind}.gguf", kinds={"token_embd.weight": kind})
    blocks = load_blocks(resolve_model(str(gguf)).folder)
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    table = next(t for t in GGUFReader(gguf).tensors if t.name == "token_embd.weight")
    values = torch.from_numpy(dequantize(np.asarray(table.data), GGMLQuantizationType[kind]).astype(np.float32))
    ids = torch.tensor([_ids(folder, PROMPTS[0])])
    assert torch.equal(blocks.ends.embed_tokens(ids)[0], values[ids[0]])
    with torch.no_grad():
        ref.get_input_embeddings().weight.copy_(values)  # the reference on the file's own embedding values
        theirs = ref(ids).logits[0].float()
    ours = blocks.logits_from_scratch(ids[0].tolist())
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < REL_TOL


def test_the_gguf_serves_a_chat_completion(model):
    kind, folder, gguf, _ = model
    serves_a_chat_completion(str(gguf or folder), kind)  # Ministral's folder: there is no GGUF of it


@pytest.mark.parametrize("extra", [{"query_pre_attn_scalar": 16, "sliding_window_pattern": 2},
                                   {"query_pre_attn_scalar": 48, "sliding_window_pattern": 3, "sliding_window": 4}])
def test_gemma3_scale_and_window_from_a_folder(extra, tmp_path):
    # what a GGUF cannot hold (llama.cpp assumes query_pre_attn_scalar and the layer pattern): from folders, an
    # attention scale other than head_dim**-0.5 and sliding layers interleaved otherwise, windows shorter than
    # the prompts
    folder = make_model("gemma3", tmp_path / "gemma3", **extra)
    ref, blocks = load_reference(folder), load_blocks(folder)
    assert any(blocks.cfg.sliding_layers) and not all(blocks.cfg.sliding_layers)
    for text in PROMPTS:
        prompt = _ids(folder, text)
        with torch.inference_mode():
            theirs = ref(torch.tensor([prompt])).logits[0].float()
        rel = ((blocks.logits_from_scratch(prompt) - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < REL_TOL, (extra, text, rel)
        assert blocks.greedy(prompt, 16)[0] == _reference_greedy(ref, prompt, 16), (extra, text)


LONG_PROMPT = " ".join(PROMPTS * 8)  # 80 tokens of SmolLM2's tokenizer


# Phi-3's rope in its three forms: Phi-3-mini-4k's (no scaling, a sliding window: here shorter than the prompts),
# and longrope past its original context (Phi-3.5's and Phi-4-mini's as served at their whole context: the long
# factors and the attention factor, sqrt(1 + ln 4 / ln 64) here), with and without partial rotary; the fixture's
# phi3 has the short ones
PHI3_ROPES = {
    "window": {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}, "partial_rotary_factor": 1.0,
               "sliding_window": 8},
    "long": {"original_max_position_embeddings": 64},
    "long-full": {"original_max_position_embeddings": 64, "partial_rotary_factor": 1.0},
}


@pytest.mark.parametrize("rope", sorted(PHI3_ROPES))
def test_phi3_ropes_equal_transformers(rope, tmp_path):
    folder = make_model("phi3", tmp_path / "phi3", **PHI3_ROPES[rope])
    gguf = write_gguf(folder, tmp_path / "phi3.f32.gguf")
    ref = load_reference(folder)
    prompt = _ids(folder, LONG_PROMPT)
    assert len(prompt) > 64
    with torch.inference_mode():
        theirs = ref(torch.tensor([prompt])).logits[0].float()
    expected = ModelConfig.from_folder(folder)
    for source in (folder, resolve_model(str(gguf)).folder):
        blocks = load_blocks(source)
        assert blocks.cfg.rope_scaling == pytest.approx(expected.rope_scaling)
        assert (blocks.cfg.rotary_dim, blocks.cfg.sliding_layers) == (expected.rotary_dim, expected.sliding_layers)
        rel = ((blocks.logits_from_scratch(prompt) - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < REL_TOL, (rope, source, rel)
        assert blocks.greedy(prompt, 16)[0] == _reference_greedy(ref, prompt, 16), (rope, source)
    if rope != "window":
        assert expected.rope_scaling["attention_factor"] == pytest.approx((1 + np.log(4) / np.log(64)) ** 0.5)


# sliding windows shorter than the prompt: Mistral's on every layer (Mistral-7B-v0.1's 4096 of 32768), Ministral's
# on the layers its layer_types say
WINDOWS = {"mistral": {"sliding_window": 8},
           "ministral": {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}}


@pytest.mark.parametrize("kind", sorted(WINDOWS))
def test_mistral_windows_equal_transformers(kind, tmp_path):
    folder = make_model(kind, tmp_path / kind, **WINDOWS[kind])
    ref, blocks = load_reference(folder), load_blocks(folder)
    assert blocks.cfg.sliding_window == 8 and any(blocks.cfg.sliding_layers)
    assert all(blocks.cfg.sliding_layers) == (kind == "mistral")
    prompt = _ids(folder, LONG_PROMPT)
    with torch.inference_mode():
        theirs = ref(torch.tensor([prompt])).logits[0].float()
    rel = ((blocks.logits_from_scratch(prompt) - theirs).abs().max() / theirs.abs().max()).item()
    assert rel < REL_TOL, (kind, rel)
    assert blocks.greedy(prompt, 16)[0] == _reference_greedy(ref, prompt, 16), kind


def test_longrope_factors_follow_the_served_context_not_the_pass(tmp_path):
    # llama.cpp's rule: the long factors where the served context (the rotary tables' positions) exceeds the
    # original one; a pass of a few tokens at the start of such a context turns by them too (transformers would
    # switch to the short ones for it), so a position's rotation is the same in every pass
    from edgespec.model.config import rope_inv_freq

    folder = make_model("phi3", tmp_path / "phi3", original_max_position_embeddings=64)
    cfg = ModelConfig.from_folder(folder)
    r = cfg.rotary_dim
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    long = torch.tensor(cfg.rope_scaling["long_factor"], dtype=torch.float64)
    torch.testing.assert_close(rope_inv_freq(cfg), (plain / long).float())
    short = dataclasses.replace(cfg, max_position_embeddings=64)
    torch.testing.assert_close(rope_inv_freq(short), (plain / torch.tensor(cfg.rope_scaling["short_factor"],
                                                                            dtype=torch.float64)).float())


def test_partial_rotary_leaves_the_other_dims_as_they_are(tmp_path):
    # Phi-4-mini's heads: each head's q and k rows are held with the rotated halves at [0, r/2) and
    # [hd/2, hd/2 + r/2), and the tables leave the others exactly as they are
    from edgespec.model.blocks import Rotary

    cfg = ModelConfig.from_folder(make_model("phi3", tmp_path / "phi3"))
    hd, r = cfg.head_dim, cfg.rotary_dim
    assert (hd, r) == (16, 12)
    assert cfg.qk_head_order() == [(0, 6), (12, 14), (6, 12), (14, 16)]
    rope = Rotary(cfg, torch.float32)(torch.arange(40)[None])
    x = torch.randn(1, 2, 40, hd)
    out = rope(x)
    still = [6, 7, 14, 15]
    assert torch.equal(out[..., still], x[..., still]) and not torch.equal(out[..., :6], x[..., :6])


def test_a_span_of_positions_is_their_lookup(tmp_path):
    # Rotary.span (a feature drafter's steps) slices the tables where the lookup gathers them: the same rotation,
    # the sliding layers' own beside it
    from edgespec.model.blocks import Rotary

    cfg = ModelConfig.from_folder(make_model("gemma3", tmp_path / "gemma3"))
    assert cfg.rope_local_theta is not None
    rotary = Rotary(cfg, torch.float32)
    span, looked = rotary.span(5, 12), rotary(torch.arange(5, 12)[None])
    assert span.local is not None and looked.local is not None
    for a, b in ((span, looked), (span.local, looked.local)):
        assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin) and torch.equal(a.positions, b.positions)


def test_a_folders_generation_config_adds_its_end_ids(tmp_path):
    # Phi-3's and Phi-4-mini's end of turn, <|end|>, is named only by generation_config.json (config.json names
    # <|endoftext|>); transformers' generate stops on both
    folder = make_model("phi3", tmp_path / "phi3")
    gen = json.loads((folder / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7, eos]}))
    assert ModelConfig.from_folder(folder).eos_token_ids == (eos, 7)


# the GGUFs of the other paths are the module's (files): its folder beside it is transformers' reference


@pytest.fixture(scope="module")
def qwen3_gguf(files) -> Path:
    """A Qwen3 GGUF (per-head q/k norms, heads wider than hidden / heads), for the other paths."""
    return files("qwen3")[1]


@pytest.fixture(scope="module")
def phi3_gguf(files) -> Path:
    """A Phi-3 GGUF (fused projections, partial rotary, longrope), for the other paths."""
    return files("phi3")[1]


@pytest.fixture(scope="module")
def smollm3_gguf(files) -> Path:
    """A SmolLM3 GGUF (its fourth layer NoPE), for the other paths."""
    return files("smollm3")[1]


@pytest.fixture(scope="module")
def granite_gguf(files) -> Path:
    """A Granite GGUF (its multipliers of embeddings, attention logits, block outputs and logits), for the other
    paths."""
    return files("granite")[1]


@pytest.fixture(scope="module")
def qwen3_moe_gguf(files) -> Path:
    """A Qwen3-MoE GGUF (experts stacked in ffn_*_exps, every layer sparse), for the other paths."""
    return files("qwen3_moe")[1]


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "phi3", "smollm3", "granite", "ministral", "qwen3_moe"])
def split_model(request, tmp_path_factory, files) -> tuple[Path, Path]:
    """(what edgespec loads, the Hugging Face folder of transformers' reference) for HeadSplit: Qwen3's GGUF (per-head
    q/k norms); Phi-3's GGUF (each group's own rows of a fused qkv); SmolLM3's GGUF (a NoPE layer's groups turn
    nothing); Granite's GGUF (the residual multiplier on a layer's summed groups and on its FFN's device); Qwen3-MoE
    from a folder (a sparse layer's experts whole on its FFN's device); Ministral
    from a folder (a sliding layer, window 3); Gemma 3 from a folder (norms of the
    attention's and the FFN's outputs, (1 + w) norms folded at load, a query_pre_attn_scalar other than head_dim,
    every other layer sliding with a window of 3 that the prompt crosses in its prefill already)."""
    if request.param == "ministral":  # no GGUF of it: from its folder, sliding layers' groups within the window
        folder = make_model("ministral", tmp_path_factory.mktemp("ministral-split"), sliding_window=3)
        return folder, folder
    if request.param == "qwen3_moe":  # from its folder: a sparse layer's experts on its FFN device, a dense one's FFN
        return files("qwen3_moe")[0], files("qwen3_moe")[0]
    if request.param != "gemma3":
        gguf = request.getfixturevalue(f"{request.param}_gguf")
        return gguf, gguf.parent / "folder"
    folder = make_model("gemma3", tmp_path_factory.mktemp("gemma3-split"), num_hidden_layers=4, sliding_window=3,
                        sliding_window_pattern=2, query_pre_attn_scalar=48)
    return folder, folder


def _split_setup(split_model, speculate: bool):
    # the layer stack, the ends, and the HeadSplit blocks of the same files: each layer's two KV groups on two
    # devices, the FFN alternating between them, every layer after the first speculating where `speculate`
    from edgespec.model.headsplit import HeadSplitPipeline
    from edgespec.model.stack import LayerStack, TokenEnds
    from edgespec.model.weights import open_source
    from edgespec.planning.headsplit import LayerPlace

    files = resolve_model(str(split_model[0]))
    cfg, src = ModelConfig.from_folder(files.folder), open_source(files)
    stack, ends = LayerStack.load(src, cfg, 0, cfg.n_layers, torch.float32), TokenEnds.load(src, cfg, torch.float32)
    places = [LayerPlace({"a": [0], "b": [1]}, "a", "ab"[i % 2], speculate and i > 0) for i in range(cfg.n_layers)]
    return cfg, stack, ends, HeadSplitPipeline.local(src, cfg, torch.float32, places)


@pytest.mark.parametrize("speculate", [False, True])
def test_headsplit_blocks_equal_the_layer_stack(split_model, speculate):
    # each KV group's block carries its own copy of the per-head norms, so groups can be placed anywhere; the
    # sum of a layer's groups is normed where the architecture norms the attention's output, and a sliding
    # layer's groups attend within its window. Speculating at epsilon 0 is the plain forward: the greedy tokens
    # are transformers' own
    cfg, stack, ends, pipe = _split_setup(split_model, speculate)
    n = 8
    prompt = _ids(split_model[1], PROMPTS[2])
    ids, cache = list(prompt), stack.new_cache(len(prompt) + n)
    pipe.open("s", len(prompt) + n, epsilon=0.0)

    def step(a: int, p: int) -> torch.Tensor:  # tokens a..p through both -> HeadSplit's last-layer output
        x, pos = ends.embed_tokens(torch.tensor([ids[a:p]])), torch.arange(a, p)[None]
        got, want = pipe.forward("s", x, pos, a), stack(x, pos, cache, a)
        # the blocks add a layer's groups' partial outputs, one matmul adds them in another order: a few ulps of
        # the state's largest values (up to 27 here, 2.3e-5 apart), so the tolerance is scaled by them
        torch.testing.assert_close(got, want, atol=2e-6 * float(want.abs().max()), rtol=1e-5)
        return got

    with torch.inference_mode():  # the prompt: a prefill of 4, then a token at a time; then n greedy tokens
        for a, p in [(0, 4), *((p - 1, p) for p in range(5, len(prompt) + 1))]:
            out = step(a, p)
        for _ in range(n):
            ids.append(int(ends.logits(out[:, -1:])[0, -1].argmax()))
            out = step(len(ids) - 1, len(ids))
    assert ids[len(prompt):] == _reference_greedy(load_reference(split_model[1]), prompt, n)
    stats = pipe.stats["s"]
    assert sum(stats.kept) == 0 and sum(stats.discarded) == (len(prompt) - 4 + n) * (cfg.n_layers - 1) * speculate


def test_headsplit_kept_speculation_is_the_speculating_pass(split_model):
    # every speculation kept, a token at a time: what model/drift.py's whole-sequence pass computes (the drift
    # and acceptance figures the planner reads rest on it), windows and output norms included
    from edgespec.model.drift import speculating_forward

    cfg, stack, ends, pipe = _split_setup(split_model, True)
    ids = _ids(split_model[1], PROMPTS[2])
    pipe.open("s", len(ids), epsilon=float("inf"))
    with torch.inference_mode():
        got = torch.cat([pipe.forward("s", ends.embed_tokens(torch.tensor([[t]])), torch.tensor([[p]]), p)
                         for p, t in enumerate(ids)], dim=1)  # [1, T, H]
    want, kept = speculating_forward(stack, ends.embed_tokens(torch.tensor([ids])), float("inf"), [True] * cfg.n_layers)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pipe.stats["s"].kept == kept == [0] + [len(ids)] * (cfg.n_layers - 1)


def test_headsplit_shared_steps_give_each_session_its_bits_alone(split_model):
    # sessions sharing HeadSplit's steps (one device call over all their rows: attention per session, windows,
    # NoPE layers, per-head norms and output norms per row), one speculating where another discards: each gets
    # bitwise what it gets in steps of its own
    from edgespec.model.stage import BatchEntry

    cfg, _, ends, together = _split_setup(split_model, True)
    prompts = [_ids(split_model[1], text) for text in PROMPTS]
    epsilons, n = [0.0, float("inf"), 0.0], 4

    def feed(pipe, session: str, ids: list[int], start: int) -> torch.Tensor:
        x, pos = ends.embed_tokens(torch.tensor([ids])), torch.arange(start, start + len(ids))[None]
        return pipe.forward(session, x, pos, start)[0]

    with torch.inference_mode():
        alone = []
        for prompt, eps in zip(prompts, epsilons, strict=True):
            pipe = _split_setup(split_model, True)[3]
            pipe.open("x", len(prompt) + n, epsilon=eps)
            alone.append([feed(pipe, "x", prompt, 0)] + [feed(pipe, "x", [7 + i], len(prompt) + i) for i in range(n)])
        for s, (prompt, eps) in enumerate(zip(prompts, epsilons, strict=True)):
            together.open(f"s{s}", len(prompt) + n, epsilon=eps)
        steps = [[(s, p, 0) for s, p in enumerate(prompts)]]
        steps += [[(s, [7 + i], len(p) + i) for s, p in enumerate(prompts)] for i in range(n)]
        for i, step in enumerate(steps):
            entries = [BatchEntry(f"s{s}", start, len(ids)) for s, ids, start in step]
            ids = [t for _, rows, _ in step for t in rows]
            positions = torch.cat([torch.arange(start, start + len(rows)) for _, rows, start in step])
            out = together.forward_batch(entries, ends.embed_tokens(torch.tensor([ids]))[0], positions)
            for (s, _, _), got in zip(step, out.split([e.length for e in entries]), strict=True):
                assert torch.equal(got, alone[s][i]), (s, i)
    assert sum(together.stats["s1"].kept) == n * (cfg.n_layers - 1) and sum(together.stats["s0"].kept) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "phi3", "smollm3", "granite", "qwen3_moe"])
def test_layer_workers_serve_what_in_process_serves(kind, tmp_path, request):
    from processes import greedy, start_server

    gguf = request.getfixturevalue(f"{kind}_gguf")
    env = {"EDGESPEC_CACHE": str(tmp_path / "cache")}
    answers = []
    for name, extra in (("inproc", ()), ("workers2", ("--local-workers", "2", "--placement", "even"))):
        proc, url = start_server(tmp_path, name, "--model", str(gguf), *extra, env=env)
        try:
            answers.append([greedy(url, p, 12) for p in PROMPTS])
        finally:
            proc.stop()
    assert answers[0] == answers[1] and all(answers[0])


@pytest.mark.parametrize("key", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_softcapping_is_refused_by_name(key, tmp_path):
    # Gemma 2's caps: no block here computes them, so a config that sets one is refused rather than served wrong
    d = json.loads((make_model("gemma3", tmp_path / "g") / "config.json").read_text())
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf_dict({**d, key: 30.0})


@pytest.mark.parametrize("model_type", ["granitemoe", "smollm2", "mistral3"])
def test_an_unknown_model_type_is_refused_by_name(model_type, tmp_path):
    d = json.loads((make_model("llama", tmp_path / "l") / "config.json").read_text())
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported"):
        ModelConfig.from_hf_dict({**d, "model_type": model_type})
