"""Model drafters on tiny models (float32): a draft checkpoint, a layer-skipping self-draft and a feature drafter
give naive's greedy tokens; sampled continuations through the whole policy follow the target's exactly
enumerated distribution; a draft model with another tokenizer is refused."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from model_fixtures import chi_square_pvalue, continuation_table, make_feature_drafter, smollm2_folder
from processes import REPO, tiny_chat_model

from edgespec.decoding.draft_model import DraftModel, check_tokenizer, runs
from edgespec.decoding.eagle import FeatureDraftModel
from edgespec.decoding.naive import NaivePolicy
from edgespec.decoding.speculative import SpeculativePolicy
from edgespec.decoding.types import GenerationRequest, SamplingParams
from edgespec.engine.engine import Engine
from edgespec.model.load import load_local, load_tokenizer
from edgespec.model.source import resolve_model
from edgespec.model.thread import ModelThread

PROMPT = [(i % 7) + 100 for i in range(30)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("drafts")
    target = tiny_chat_model(base / "target", smollm2_folder())
    other = tiny_chat_model(base / "other", smollm2_folder())  # same shapes, other random weights...
    from model_fixtures import make_tiny_model

    make_tiny_model(other, seed=7, vocab_size=49152, max_position_embeddings=512, num_hidden_layers=2,
                    bos_token_id=1, eos_token_id=2)  # ...and only two layers
    return target, other


@pytest.fixture(scope="module")
def loaded(folders):
    model = load_local(resolve_model(str(folders[0])), "float32", 1.0, ModelThread(1))
    yield model
    model.executor.close()


@pytest.fixture(scope="module")
def drafts(folders, loaded):
    run = loaded.executor.thread.run_sync
    eagle = make_feature_drafter(folders[0], folders[0].parent / "eagle.safetensors")
    return {"eagle": run(FeatureDraftModel.load, "eagle", eagle, loaded.executor.ends),
            "self": run(DraftModel.load, "self", str(folders[0]), "float32", loaded.tokenizer),
            "other": run(DraftModel.load, "other", str(folders[1]), "float32", loaded.tokenizer),
            "layerskip": run(DraftModel.load, "layerskip", str(folders[0]), "float32", None, [0, 3])}


def generate(policy, loaded, max_tokens, options=None, **sampling):
    request = GenerationRequest(PROMPT, max_tokens, SamplingParams(**{"temperature": 0.0, **sampling}), (),
                                frozenset(), policy.name, options or {})

    async def collect():
        return [e async for e in policy.generate(request, Engine(loaded.executor), loaded.tokenizer)]

    events = asyncio.run(collect())
    return [t for e in events for t in e.token_ids], events[-1].stats


@pytest.mark.parametrize("drafter", ["self", "other", "layerskip", "eagle", "eagle+ngram"])
def test_model_drafters_give_naive_greedy_tokens(loaded, drafts, drafter):
    want, _ = generate(NaivePolicy(), loaded, 30)
    got, st = generate(SpeculativePolicy(drafts), loaded, 30, {"drafter": drafter, "k": 4})
    assert got == want
    assert st["drafter"] == drafter and st["acceptance_rate"] is not None
    if drafter == "self":
        assert st["acceptance_rate"] > 0.9  # the target drafting for itself is (nearly) always right


@pytest.mark.parametrize("drafter", ["other", "eagle", "eagle+ngram"])
def test_sampled_continuations_follow_the_target_distribution(loaded, drafts, drafter):
    # two-token continuations at temperature 0.8, top_k 3: nine outcomes, enumerated exactly from the target
    params = {"temperature": 0.8, "top_k": 3}
    table = continuation_table(loaded.executor, PROMPT, params, 2)
    policy = SpeculativePolicy(drafts)
    n = 1500
    counts = {key: 0 for key in table}
    for seed in range(n):
        ids, _ = generate(policy, loaded, 2, {"drafter": drafter, "k": 2}, seed=seed, **params)
        assert tuple(ids) in counts  # nothing outside the target's support
        counts[tuple(ids)] += 1
    assert chi_square_pvalue(counts, table) > 1e-3


def test_a_draft_model_with_another_tokenizer_is_refused(folders, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(folders[1], odd)
    spec = json.loads((odd / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, other ids
    (odd / "tokenizer.json").write_text(json.dumps(spec))
    target = load_tokenizer(resolve_model(str(folders[0])))
    with pytest.raises(ValueError, match="does not share the served model's tokenizer"):
        DraftModel.load("odd", str(odd), "float32", target)
    with pytest.raises(ValueError, match="tokenizer"):
        check_tokenizer("x", type("T", (), {"get_vocab": lambda self: {"a": 1}})(), target)
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "edgespec.server.cli", "serve", "--model", str(folders[0]),
                          "--port", "0", "--draft-model", f"odd={odd}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "does not share the served model's tokenizer" in run.stderr


def test_kept_layers_become_contiguous_stacks():
    assert runs([0, 1, 2, 7, 8, 29]) == [(0, 3), (7, 9), (29, 30)]
    assert runs([5]) == [(5, 6)]
