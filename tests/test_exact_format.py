"""Exact in the served format: a position's logits are bitwise the same whatever pass computes them.

Alone (one token per pass), inside a verification pass of up to 16 tokens, in the whole sequence at once,
in a batch of rows, after a prefix taken from another session's cache, and in a pass shared with other
sequences at other lengths (a batch step). `torch.equal`, not a tolerance:
any rounding that depends on the pass's shape (a kernel that blocks its reduction by the number of rows,
an attention call over a masked, longer row, a rotary form chosen by pass size) fails these tests.
The fast cases run the tiny model quantized at load (Q4 and Q8 blocks, the kernels of the default format);
the slow one runs the real default model in its default format, `auto` (Q4_1 layers, Q8_0 head).
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import make_tiny_model, smollm2_folder

from edgespec.model.blocks import CompiledLayers, SeqRows, window_mask
from edgespec.model.config import ModelConfig
from edgespec.model.kv_cache import KVCache
from edgespec.model.kv_format import KV_FORMATS, kv_format
from edgespec.model.linear import DenseLinear, linear_bytes, weight_format
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source


def load(folder, fmt: str, kv: str = "float32"):
    cfg = ModelConfig.from_folder(folder)
    src = open_source(folder)
    return (cfg, LayerStack.load(src, cfg, 0, cfg.n_layers, weight_format(fmt), kv_format(kv)),
            TokenEnds.load(src, cfg, weight_format(fmt)))


def logits(stack, ends, cache, ids: list[list[int]], start: int) -> torch.Tensor:
    # ids [B, T] at slots start.. -> logits [B, T, V]
    x = ends.embed_tokens(torch.tensor(ids))
    positions = torch.arange(start, start + len(ids[0])).expand(len(ids), -1)
    return ends.logits(stack(x, positions, cache, start))


def check_every_shape(stack, ends, seq: list[int], prompt: int) -> None:
    n = len(seq)
    cache = stack.new_cache(n + 1)
    alone = [logits(stack, ends, cache, [seq[:prompt]], 0)[0, -1]]
    for p in range(prompt, n - 1):  # one token per pass, as naive decoding computes them
        alone.append(logits(stack, ends, cache, [[seq[p]]], p)[0, 0])
    alone = torch.stack(alone)  # [n - prompt, V]: the logits after positions prompt-1 .. n-2

    whole = logits(stack, ends, stack.new_cache(n), [seq[:-1]], 0)[0, prompt - 1:]
    assert torch.equal(whole, alone), "the whole sequence in one pass differs from one token per pass"

    for k in (2, 5, 16):  # verification passes: the prompt, then passes of k tokens
        cache = stack.new_cache(n + 1)
        got = [logits(stack, ends, cache, [seq[:prompt]], 0)[0, -1:]]
        for a in range(prompt, n - 1, k):
            got.append(logits(stack, ends, cache, [seq[a:min(a + k, n - 1)]], a)[0])
        assert torch.equal(torch.cat(got), alone), f"passes of {k} tokens differ from one token per pass"

    pool = stack.new_pool(2**24)  # sessions of one pool, as a stage holds them
    cold = KVCache(pool, n + 1)
    logits(stack, ends, cold, [seq[:prompt + 3]], 0)
    for _ in range(2):  # a prefix read in place from another session's blocks (prefix reuse, outline's points)
        warm = cold.fork(prompt + 3, n + 1)
        after = logits(stack, ends, warm, [seq[prompt + 3:-1]], prompt + 3)[0]
        assert torch.equal(after, alone[4:]), "logits after a shared prefix differ from a cold run's"

    # one pass over three sequences at different lengths (a batch step): one decodes a token, one verifies
    # four drafts, one prefills its prompt; alone[i] holds the logits after position prompt - 1 + i
    caches = [stack.new_cache(n + 1) for _ in range(3)]
    logits(stack, ends, caches[0], [seq[:prompt + 2]], 0)
    logits(stack, ends, caches[1], [seq[:prompt]], 0)
    feeds = [(caches[0], prompt + 2, seq[prompt + 2:prompt + 3]), (caches[1], prompt, seq[prompt:prompt + 4]),
             (caches[2], 0, seq[:prompt])]
    ids = torch.tensor([[t for _, _, f in feeds for t in f]])
    positions = torch.cat([torch.arange(start, start + len(f)) for _, start, f in feeds])
    hidden = stack.forward_rows(ends.embed_tokens(ids)[0], positions, [SeqRows(c, a, len(f)) for c, a, f in feeds])
    out = ends.logits(hidden[None])[0]  # [M, V]
    assert torch.equal(out[0], alone[3]), "a decode row of a batch step differs from the sequence alone"
    assert torch.equal(out[1:5], alone[1:5]), "a verification in a batch step differs from the sequence alone"
    assert torch.equal(out[4 + prompt], alone[0]), "a prefill in a batch step differs from the sequence alone"
    assert [c.length for c in caches] == [prompt + 3, prompt + 4, prompt]


def test_a_layer_in_one_call_gives_the_bits_of_its_blocks(tiny_folder):
    """A HeadSplit device runs a layer as blocks (attention of some KV groups, then the FFN elsewhere): the
    whole-layer call must compute what the blocks compute, bit for bit."""
    cfg, stack, _ = load(tiny_folder, "q4_1")
    def normed(norm, out):  # the architecture's norm of a block's output (Gemma 3), where it has one; times the
        out = out if norm is None else norm(out)  # residual multiplier where it has one (Granite)
        return out if layer.residual == 1.0 else out * layer.residual

    rope = stack.rotary(torch.arange(5)[None])
    for i, layer in enumerate(stack.layers):  # every kind of layer: sliding (Gemma 3), NoPE (SmolLM3)
        x = torch.randn(1, 5, cfg.hidden_size)
        whole = layer(x, rope, stack.new_cache(8), i, 0, None)
        cache = stack.new_cache(8)
        own = rope.for_layer(layer.window is not None, layer.rotates)  # a sliding layer's rotary base, or none
        mask = None if layer.window is None else window_mask(None, own.positions, 0, 5, layer.window)
        z = x + normed(layer.attn_out_norm, layer.attn(layer.input_norm(x), own, cache, i, 0, mask))
        assert torch.equal(whole, z + normed(layer.ffn_out_norm, layer.ffn(layer.post_norm(z)))), i


def test_a_stack_in_one_call_gives_the_bits_of_its_layers_one_by_one(tiny_folder):
    """Where every layer is compiled, a LayerStack runs them in one call (layer.cpp's decoder_stack): a prompt, a
    verification pass with a tree's mask and a batch step of two sequences give the per-layer calls' bits."""
    cfg, stack, ends = load(tiny_folder, "q4_1")
    fused = stack.runs
    one = len(fused) == 1 and isinstance(fused[0], CompiledLayers)
    assert one == all(layer.compiled for layer in stack.layers)
    if {"llama", "smollm3"} & set(cfg.arch.hf_types):  # SmolLM3's NoPE layers too (their own tables)
        assert one
    if not one:
        return
    ids = torch.tensor([[(i * 13) % cfg.vocab_size for i in range(12)]])
    mask = torch.tril(torch.ones(4, 12, dtype=torch.bool), diagonal=8)
    mask[3, 10] = False  # a branch: row 3 does not see row 2
    out = {}
    for one_call in (True, False):
        stack.runs = fused if one_call else list(range(len(stack.layers)))
        cache, other = stack.new_cache(16), stack.new_cache(16)
        prompt = stack(ends.embed_tokens(ids[:, :8]), torch.arange(8)[None], cache, 0)
        tree = stack(ends.embed_tokens(ids[:, 8:]), torch.tensor([[8, 9, 9, 10]]), cache, 8, mask[None])
        stack(ends.embed_tokens(ids[:, :5]), torch.arange(5)[None], other, 0)
        third = stack.new_cache(16)  # the tree again, beside the others in a batch step
        stack(ends.embed_tokens(ids[:, :8]), torch.arange(8)[None], third, 0)
        rows = stack.forward_rows(ends.embed_tokens(torch.cat([ids[:, 5:8], ids[:, 8:]], 1))[0],
                                  torch.tensor([12, 5, 6, 8, 9, 9, 10]),
                                  [SeqRows(cache, 12, 1), SeqRows(other, 5, 2), SeqRows(third, 8, 4, mask)])
        assert torch.equal(rows[3:], tree[0]), "a tree's rows in a batch step differ from its pass alone"
        out[one_call] = (prompt, tree, rows)
    for a, b in zip(out[True], out[False], strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3", "granite", "ministral"])
def tiny_folder(request, tmp_path_factory):
    # dims in whole 32-element blocks, so the layers really run as Q4 / Q8 blocks and heads of 32 hold a q8_0
    # cache's block; every architecture whose layer differs (Qwen2's q/k/v biases, Qwen3's q/k norms: its blocks
    # run the kernels one by one; Gemma 3's output norms, GELU FFN and sliding windows shorter than the sequences;
    # Phi-3's fused projections, longrope and partial rotary, whose unrotated dims pass through the rotary tables;
    # SmolLM3's NoPE layer, whose tables turn nothing; Granite's multipliers, its layers as blocks; Ministral's
    # sliding layers beside full ones)
    return make_tiny_model(tmp_path_factory.mktemp(f"tiny-q-{request.param}"), arch=request.param, hidden_size=128,
                           intermediate_size=128, vocab_size=320)


@pytest.mark.parametrize("kv", list(KV_FORMATS))
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "float32"])
def test_tiny_logits_are_bitwise_the_same_in_every_pass_shape(tiny_folder, fmt, kv):
    cfg, stack, ends = load(tiny_folder, fmt, kv)
    assert fmt == "float32" or type(stack.layers[0].ffn.gate_up).__name__ == {"q4_1": "Q4Linear",
                                                                               "q8_0": "Q8Linear"}[fmt]
    seq = [(i * 37) % cfg.vocab_size for i in range(40)]
    check_every_shape(stack, ends, seq, prompt=7)


def test_a_tree_pass_gives_each_node_its_path_logits(tiny_folder):
    """A Medusa-style tree (two branches after the prompt, in scratch slots) gives each node the logits that
    decoding its own path gives, bitwise."""
    cfg, stack, ends = load(tiny_folder, "q4_1")
    prompt = [(i * 11) % cfg.vocab_size for i in range(9)]
    a, b, a2 = 5, 17, 29  # nodes: a (depth 1), b (depth 1), a2 (child of a, depth 2)
    cache = stack.new_cache(16)
    logits(stack, ends, cache, [prompt], 0)
    n = len(prompt)
    mask = torch.zeros(1, 3, n + 3, dtype=torch.bool)
    mask[:, :, :n] = True
    mask[0, 0, n], mask[0, 1, n + 1], mask[0, 2, n], mask[0, 2, n + 2] = True, True, True, True
    x = ends.embed_tokens(torch.tensor([[a, b, a2]]))
    tree = ends.logits(stack(x, torch.tensor([[n, n, n + 1]]), cache, n, mask))[0]
    for path, got in (([a], tree[0]), ([b], tree[1]), ([a, a2], tree[2])):
        alone = stack.new_cache(16)
        logits(stack, ends, alone, [prompt], 0)
        for i, t in enumerate(path):
            want = logits(stack, ends, alone, [[t]], n + i)[0, 0]
        assert torch.equal(got, want), f"tree node {path} differs from decoding its path"


@pytest.mark.slow
def test_default_model_logits_are_bitwise_the_same_in_every_pass_shape():
    folder = smollm2_folder()
    _, stack, ends = load(folder, "auto")
    assert type(stack.layers[0].attn.qkv).__name__ == "Q4Linear" and type(ends.lm_head).__name__ == "Q8Linear"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                     add_generation_prompt=True, return_dict=False)
    seq = list(prompt) + [(i * 101) % 20000 + 300 for i in range(24)]
    check_every_shape(stack, ends, seq, prompt=len(prompt))


def test_weight_bytes_count_packed_bf16_weights():
    """A bf16 weight is counted at 2 bytes an element whether oneDNN packed it (an opaque tensor, where the CPU
    has AVX-512 bf16) or not: a HeadSplit worker's KV budget is what its weights leave."""
    w = torch.randn(64, 32)
    module = DenseLinear(w, torch.zeros(64), torch.bfloat16)
    assert linear_bytes(module) == 64 * 32 * 2 + 64 * 2
