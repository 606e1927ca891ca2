"""The compiled kernels (model/kernels): against plain torch math, row-invariant, and the portable build equal to
the SIMD one bit for bit (what makes a worker on an aarch64 board compute what an x86 controller computes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from edgespec.model.kernels import (
    STALE_LOCK_S,
    build_folder,
    build_key,
    chosen,
    compile_flags,
    full_width_512,
    isas,
    load,
)
from edgespec.model.kv_format import KV_FORMATS
from edgespec.model.quant import Q8, Interleaved, quantize_q4, quantize_q8, widened

N, K = 100, 256  # N not a multiple of 8: the last weight group is partial


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(33, K, generator=g)  # 33 rows: two tiles of 16 (AMX's, groups_amx.h), one row past them
    q8 = quantize_q8(w)
    # a scale per half block, as Q6_K and Q3_K hold them: each half's own
    halves = Q8(q8.qs, q8.d.repeat_interleave(2, dim=1) * (1 + torch.rand(N, K // 16, generator=g)))
    # with offsets, per block (Q5_1, Q5_K) and per half block (Q2_K)
    affine = Q8(q8.qs, q8.d, torch.randn(N, K // 32, generator=g) * 0.1)
    affine_halves = Q8(halves.qs, halves.d, torch.randn(N, K // 16, generator=g) * 0.1)
    return w, x, quantize_q4(w), {"q8": q8, "q8-halves": halves, "q8-affine": affine, "q8-affine-halves": affine_halves}


def matmuls(mod, w, x, q4, q8s) -> dict[str, torch.Tensor]:
    a = Interleaved.of(q4)
    out = {"q4": mod.q4_matmul(x, a.words, a.d, a.m, a.n), "f32": mod.f32_matmul(x, w)}
    for name, q in q8s.items():
        b = Interleaved.of(q)
        out[name] = mod.q8_matmul(x, b.words, b.d, b.m, b.n)
    return out


def test_matmuls_match_the_dequantized_weights():
    w, x, q4, q8s = inputs()
    got = matmuls(load(), w, x, q4, q8s)
    for name, dense in [("q4", q4.dequantize()), ("f32", w), *((k, q.dequantize()) for k, q in q8s.items())]:
        ref = x @ dense.T
        # 8-bit activations cost about 0.5% (llama.cpp's Q8_1 scheme); float32 only rounding
        assert ((got[name] - ref).norm() / ref.norm()).item() < (1e-6 if name == "f32" else 1e-2), name


def test_every_output_is_independent_of_the_rows_beside_it():
    w, x, *ws = inputs(1)
    mod = load()
    full = matmuls(mod, w, x, *ws)
    for r in range(x.shape[0]):
        one = matmuls(mod, w, x[r:r + 1].contiguous(), *ws)
        assert all(torch.equal(one[k][0], full[k][r]) for k in full)


def test_the_interleaved_layout_moves_bytes_without_changing_them():
    _, _, q4, q8s = inputs(4)
    for w in (q4, *q8s.values()):
        back = Interleaved.of(w).plain()
        pairs = zip(vars(back).values(), vars(w).values(), strict=True)
        assert all(a is b is None or torch.equal(a, b) for a, b in pairs)
    ids = torch.tensor([[0, 7, 8, N - 1]])
    for w in q8s.values():
        assert torch.equal(Interleaved.of(w).dequantize_rows(ids), w.dequantize_rows(ids))


def test_a_q4_widened_to_affine_q8_gives_the_q4_kernels_bits():
    # the same float operations in the same order (q4's: the dot, then the offset times the activations' sum)
    w, x, q4, _ = inputs(5)
    wide = widened(q4)
    assert torch.equal(wide.dequantize(), q4.dequantize())
    got = matmuls(load(), w, x, q4, {"wide": wide})
    assert torch.equal(got["wide"], got["q4"])


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # torch's note that it widens the weight, unfused
def test_a_bf16_norm_takes_float32_rows():
    # the kernel takes a float32 weight only: float32 rows against a bf16 one once raised from inside it
    from edgespec.model.blocks import RMSNorm

    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    norm.weight.data = torch.randn(64, generator=torch.Generator().manual_seed(5)).bfloat16()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(norm(x), torch.rms_norm(x, (64,), norm.weight.float(), 1e-5), atol=0, rtol=0)


def test_attention_and_norm_match_torch():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 5, 64, generator=g), torch.randn(2, 2, 12, 64, generator=g), torch.randn(
        2, 2, 12, 64, generator=g)
    start = 7  # 5 queries at slots 7..11
    mod = load()
    causal = torch.arange(12)[None] <= (start + torch.arange(5))[:, None]  # [T, S]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    torch.testing.assert_close(mod.attention(q, k, v, start, None), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mod.attention(q, k, v, start, causal[None, None]), ref, atol=1e-5, rtol=1e-5)
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    torch.testing.assert_close(mod.rms_norm(x, w, 1e-5), torch.rms_norm(x, (64,), w, 1e-5), atol=1e-5, rtol=1e-5)
    gate_up = silu_inputs()
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(mod.silu_mul(gate_up), (torch.nn.functional.silu(gate) * up).float(), atol=1e-30,
                               rtol=1e-6)


def silu_inputs() -> torch.Tensor:
    # gate_up [3, 2 * 20]: the 8-lane form and a tail of 4, random gates up to +-40, the signs of zero and
    # values past exp's range (silu(-100) is -100 e^-100 ~ 0, silu(100) is 100)
    gate_up = torch.randn(3, 40, generator=torch.Generator().manual_seed(4)) * 10
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0])
    return gate_up


@pytest.mark.slow
@pytest.mark.parametrize("isa", isas()[1:] or ["none"])
def test_the_portable_build_gives_the_same_bits(isa):
    # every SIMD path this CPU runs (AVX2, and VNNI where present: what load() builds), against the portable one
    if isa == "none":
        pytest.skip("this CPU has no AVX2: the default build is the portable one")
    simd, portable = load(isa), load(simd=False)
    assert simd.simd() and simd.isa() == isa
    assert not portable.simd() and portable.isa() == "portable"
    w, x, *ws = inputs(3)
    a, b = matmuls(simd, w, x, *ws), matmuls(portable, w, x, *ws)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # each pass size a kernel compiles for (rows 1..8 at once, or a tile of 16 and what is left), and pairs of groups
    for m in range(1, x.shape[0] + 1):
        part = matmuls(simd, w, x[:m].contiguous(), *ws)
        assert all(torch.equal(part[k], b[k][:m]) for k in a), m
    # attention in each KV format over 45 slots (runs of 16 and a tail; 4 at a time and a tail), at head sizes
    # that take the 512-bit values' passes of 64 and 16 and the 8-lane tail
    for fmt in KV_FORMATS.values():
        for hd in (64, 72, 96) if fmt.name != "q8_0" else (64, 96):
            q, keys, values = torch.randn(2, 6, 3, hd), torch.randn(2, 2, 45, hd), torch.randn(2, 2, 45, hd)
            ks, vs = fmt.encode(keys), fmt.encode(values)
            assert torch.equal(simd.attention(q, ks, vs, 42, None), portable.attention(q, ks, vs, 42, None)), fmt
    assert torch.equal(simd.rms_norm(x, w[0], 1e-5), portable.rms_norm(x, w[0], 1e-5))
    assert torch.equal(simd.silu_mul(silu_inputs()), portable.silu_mul(silu_inputs()))


def test_the_build_is_chosen_by_the_cpus_features():
    avx2 = {"avx2", "fma", "f16c"}
    avx512_vnni = avx2 | {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"}
    assert isas(avx2 | {"avx512f"}, "x86_64") == ["portable", "avx2"]
    assert isas(avx512_vnni, "x86_64", wide=False) == ["portable", "avx2", "avx512-vnni"]
    # where 512-bit vectors run at full width, two weight groups in one 512-bit kernel is the widest path
    assert isas(avx512_vnni, "x86_64", wide=True) == ["portable", "avx2", "avx512-vnni", "avx512-vnni-zmm"]
    # AMX tiles (Intel's Sapphire Rapids and later), on top of the VNNI kernels (passes of fewer rows)
    amx = avx512_vnni | {"amx_tile", "amx_int8", "amx_bf16"}
    assert isas(amx, "x86_64", wide=False) == ["portable", "avx2", "avx512-vnni", "avx512-amx"]
    assert isas(amx - {"amx_int8"}, "x86_64", wide=False) == ["portable", "avx2", "avx512-vnni"]
    assert isas(avx2 | {"avx_vnni"}, "x86_64", wide=True) == ["portable", "avx2", "avx-vnni"]
    assert isas(avx2 | {"avx_vnni"}, "x86_64") == ["portable", "avx2", "avx-vnni"]
    assert isas(avx512_vnni - {"avx512vl"}, "x86_64") == ["portable", "avx2"]  # VNNI on zmm only: not used
    # aarch64: NEON on every core; sdot where /proc/cpuinfo lists asimddp (a Pi 5's A76, not a Pi 4's A72)
    assert isas({"fp", "asimd", "asimddp"}, "aarch64") == ["portable", "neon", "neon-dotprod"]
    assert isas({"fp", "asimd", "crc32"}, "aarch64") == ["portable", "neon"]
    assert isas(avx512_vnni, "riscv64") == ["portable"]
    # each path compiles with flags of its own, so each has a build (and a cache key) of its own
    paths = ("portable", "avx2", "avx512-vnni", "avx512-vnni-zmm", "avx512-amx", "avx-vnni", "neon", "neon-dotprod")
    flags = {isa: tuple(compile_flags(isa)) for isa in paths}
    assert len(set(flags.values())) == len(paths)
    assert "-mavx512vnni" in flags["avx512-vnni"] and "-mavxvnni" in flags["avx-vnni"]
    assert "-DES_ZMM" in flags["avx512-vnni-zmm"] and "-DES_ZMM" not in flags["avx512-vnni"]
    assert "-mamx-int8" in flags["avx512-amx"] and "-mavx512vnni" in flags["avx512-amx"]
    assert compile_flags(False) == list(flags["portable"])


def test_full_width_512_bit_vectors_are_told_by_the_cpus_family():
    # Zen 5 (family 1Ah) runs 512-bit ops at full width; Zen 4 (19h) in two halves; Intel: the same work per cycle
    assert full_width_512({"vendor_id": "AuthenticAMD", "cpu family": "26"})
    assert not full_width_512({"vendor_id": "AuthenticAMD", "cpu family": "25"})
    assert not full_width_512({"vendor_id": "GenuineIntel", "cpu family": "6"})
    assert not full_width_512({})


def test_a_killed_compiles_lock_does_not_hang_the_next_load(tmp_path):
    # torch's build lock, left by a compile that was killed long ago: the next process removes it and loads. In a
    # copy of the build (its files' times kept, so nothing recompiles): in the shared folder, a process of a test
    # running beside this one could remove the lock first.
    load()  # built
    private = tmp_path / "build"
    shutil.copytree(build_folder(build_key(chosen())), private)
    lock = private / "lock"
    lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    code = ("from pathlib import Path; from edgespec.model import kernels; "
            f"kernels.build_folder = lambda key: Path({str(private)!r}); print(kernels.load().isa())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == chosen(), done.stderr
    assert not lock.exists() and "left by a compile that was stopped" in done.stderr
