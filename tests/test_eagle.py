"""The feature drafter (decoding/eagle.py): drafting with its incremental cache equals the training-time
forward over the whole sequence; weights trained for another model are refused; the shipped drafter gives
SmolLM2's greedy tokens and is accepted often enough to be worth using."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
from model_fixtures import make_feature_drafter, smollm2_folder
from processes import REPO, tiny_chat_model

from edgespec.decoding.eagle import FeatureDrafter, FeatureDraftModel
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.speculative import SpeculativePolicy
from edgespec.decoding.target_fit import SHIPPED
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.engine.engine import Engine
from edgespec.model.config import ModelConfig
from edgespec.model.load import load_local
from edgespec.model.source import resolve_model
from edgespec.model.stack import TokenEnds
from edgespec.model.thread import ModelThread
from edgespec.model.weights import open_source


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle")
    folder = tiny_chat_model(base / "target", smollm2_folder())
    return folder, make_feature_drafter(folder, base / "eagle.safetensors", every=3)


def ends_of(folder, dtype=torch.float32) -> TokenEnds:
    cfg = ModelConfig.from_folder(folder)
    return TokenEnds.load(open_source(folder), cfg, dtype)


def reference_drafts(model: FeatureDraftModel, f: torch.Tensor, tokens: list[int], first: int, k: int) -> list[int]:
    """Greedy drafts recomputed from scratch with the training forward: pairs (g_(i-1), x_i) for i > first."""
    net, ends = model.net, model.ends
    g = list(ends.norm(f[first:].to(ends.dtype)))  # true features of positions first..n-1
    ids = list(tokens[first + 1:])  # x_(first+1)..x_n
    drafts = []
    for _ in range(k):
        t = len(ids)
        positions = torch.arange(first + 1, first + 1 + t).unsqueeze(0)
        out = ends.norm(net.block(torch.stack(g).unsqueeze(0), ends.embed(torch.tensor([ids])), positions))
        token = int(net.vocab[(out[0, -1] @ ends.lm_head.dense()[net.vocab].T).argmax()])
        drafts.append(token)
        g.append(out[0, -1])
        ids.append(token)
    return drafts


@pytest.mark.parametrize(("first", "dtype"), [(0, torch.float32), (7, torch.float32), (7, torch.bfloat16)])
def test_incremental_drafting_equals_the_training_forward(target, first, dtype):
    """float32: the drafter's layer runs as one compiled call; bfloat16: as its modules."""
    folder, path = target
    model = FeatureDraftModel.load("eagle", path, ends_of(folder, dtype))
    assert (model.layer is None) == (dtype == torch.bfloat16)
    torch.manual_seed(1)
    n, k = 40, 4
    f = torch.randn(n + 2 * k + 16, model.cfg.hidden_size) * 3  # stand-in last-layer outputs
    tokens = torch.randint(0, model.cfg.vocab_size, (len(f) + 1,)).tolist()
    drafter = FeatureDrafter(model, SamplingParams(temperature=0.0), len(f) + k + 1)
    drafter.observe(first, f[first:n])  # a prefill from `first` on (earlier slots came from a cached prefix)
    pos = n
    # verification outcomes: how many drafts the target kept; None a step the drafter was not asked in (beside
    # other streams): its features are normed only when a proposal reads them, several steps' at once
    for accepted in [0, 3, None, None, 1, None, 4, None, 2]:
        if accepted is None:
            drafter.observe(pos, f[pos:pos + 1])
            pos += 1
            continue
        drafts, q = drafter.propose(tokens[:pos + 1], k)
        assert q is None and drafts == reference_drafts(model, f[:pos], tokens[:pos + 1], first, k)
        tokens[pos + 1:pos + 1 + accepted] = drafts[:accepted]
        drafter.observe(pos, f[pos:pos + 1 + accepted])
        pos += 1 + accepted


def test_weights_for_another_model_are_refused(target, tmp_path):
    folder, path = target
    other = tiny_chat_model(tmp_path / "other", smollm2_folder())  # same shapes, other weights
    from model_fixtures import make_tiny_model

    make_tiny_model(other, seed=5, vocab_size=49152, max_position_embeddings=512, num_hidden_layers=4,
                    bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match="trained for another model"):
        FeatureDraftModel.load("eagle", path, ends_of(other))
    shipped = sorted(SHIPPED.glob("*-eagle.safetensors"))
    assert shipped, "the trained drafter for SmolLM2 ships with the package"
    with pytest.raises(ValueError, match="hidden size 576"):
        FeatureDraftModel.load("eagle", shipped[0], ends_of(folder))
    run = subprocess.run([sys.executable, "-m", "edgespec.server.cli", "serve", "--model", str(other), "--port", "0",
                          "--eagle", str(path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "trained for another model" in run.stderr


@pytest.fixture(scope="module")
def smollm2():
    model = load_local(resolve_model(None), "auto", 1.0, ModelThread(1))  # the default format, as served
    yield model
    model.executor.close()


@pytest.mark.slow
def test_shipped_drafter_gives_smollm2_greedy_tokens(smollm2):
    ends = smollm2.executor.ends
    models = {"eagle": smollm2.executor.thread.run_sync(FeatureDraftModel.load, "eagle",
                                                         sorted(SHIPPED.glob("*-eagle.safetensors"))[0], ends)}
    tokenizer = smollm2.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "How can I improve my time management skills?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)

    def generate(policy, options):
        request = GenerationRequest(list(prompt), 48, SamplingParams(temperature=0.0), (), frozenset(), policy.name,
                                    options)

        async def collect():
            return [e async for e in policy.generate(request, Engine(smollm2.executor), smollm2.tokenizer)]

        events = asyncio.run(collect())
        return [t for e in events for t in e.token_ids], events[-1].stats

    want, _ = generate(NaivePolicy(), {})
    got, stats = generate(SpeculativePolicy(models), {"drafter": "eagle", "k": 4})
    assert got == want
    assert stats["drafter"] == "eagle"
    # k = 4 fixed: measured 0.18 here; a random drafter is almost never right on a 49k vocabulary
    assert stats["acceptance_rate"] > 0.1
