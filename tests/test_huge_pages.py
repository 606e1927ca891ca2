"""A stage's kernel weights held in one huge-page mapping (model/huge_pages.py): the same weights, the same bits,
and the mapping advised so that the kernel may back it with huge pages."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch
from model_fixtures import make_tiny_model

from edgespec.model.config import ModelConfig
from edgespec.model.huge_pages import ALIGN, HUGE_PAGE, HugePages, hold_in_huge_pages
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import Kernel, Q4Linear, weight_format
from edgespec.model.quant import quantize_q4
from edgespec.model.stack import LayerStack, TokenEnds
from edgespec.model.weights import open_source

needs_linux = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE (not Linux)")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def advised(address: int) -> bool:
    """Whether the mapping holding `address` is advised MADV_HUGEPAGE (`hg` in its /proc/self/smaps VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_linux
def test_copies_sit_in_one_advised_mapping_from_a_huge_page_boundary():
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int32), torch.randn(0), torch.randn(100, 3).half()]
    pages = HugePages(sum(HugePages.footprint(t) for t in tensors))
    copies = [pages.copy(t) for t in tensors]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(copies, tensors, strict=True))
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    assert all(c.data_ptr() % ALIGN == 0 for c in copies)
    assert copies[1].data_ptr() - copies[0].data_ptr() == HugePages.footprint(tensors[0])
    assert advised(copies[0].data_ptr())
    with pytest.raises(ValueError, match="does not fit"):
        pages.copy(torch.zeros(1))


@needs_linux
def test_a_kernel_moved_computes_the_same_bits_from_the_new_tensors():
    torch.manual_seed(0)
    linear = Q4Linear(quantize_q4(torch.randn(48, 64)), torch.randn(48))
    x = torch.randn(5, 64)
    before, old = linear(x), linear.weight_tensors()
    hold_in_huge_pages([linear])
    moved = linear.weight_tensors()
    assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in zip(moved, old, strict=True))
    assert torch.equal(linear(x), before)
    assert advised(moved[0].data_ptr())


@needs_linux
def test_a_loaded_stack_and_head_hold_their_kernels_in_huge_pages(tiny_folder):
    cfg, src = ModelConfig.from_folder(tiny_folder), open_source(tiny_folder)
    stack = LayerStack.load(src, cfg, 0, cfg.n_layers, weight_format("q4_1"), kv_format("float32"))
    ends = TokenEnds.load(src, cfg, weight_format("q4_1"))
    kernels = [m for m in stack.modules() if isinstance(m, Kernel)]
    first = kernels[0].weight_tensors()[0]
    assert first.data_ptr() % HUGE_PAGE == 0
    # one mapping: every weight tensor shares the first one's storage
    assert all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for k in kernels for t in k.weight_tensors())
    head = ends.lm_head
    assert isinstance(head, Kernel) and head.weight_tensors()[0].data_ptr() % HUGE_PAGE == 0
