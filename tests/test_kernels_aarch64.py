"""The group kernels of the quantized matmuls on aarch64, proved on this x86 machine: model/kernels/check.cpp
(the kernels without torch, every path against the portable loops on the same inputs, bit for bit) built with
Debian's cross compiler for NEON without and with sdot, run under qemu-user as a Raspberry Pi 4 (Cortex-A72,
no dot product extension) and a Pi 5 (Cortex-A76) would run them; and built natively for every path this CPU
runs. `make install-test` installs the cross compiler and qemu-user (Debian's g++-aarch64-linux-gnu and
qemu-user)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from edgespec.model.kernels import HERE, Isa, compile_flags, isas

CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
FORMS = ["q4", "q8", "q8-halves", "q8-affine", "q8-affine-halves"]


def build(compiler: str, isa: Isa, out: Path) -> Path:
    static = ["-static"] if compiler == CROSS else []
    subprocess.run([compiler, "-std=c++17", "-Wall", "-Wextra", "-Werror", *compile_flags(isa), *static,
                    str(HERE / "check.cpp"), "-o", str(out)], check=True)
    return out


def same_bits(run: list[str], isa: Isa) -> None:
    got = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    # three seeds: the quantizer, then each form at 1-32 rows, one weight group at a time and two at once
    assert got.stdout.splitlines() == ([f"same bits: {isa}, quantize_row"] +
                                       [f"same bits: {isa}, {form}, 1-32 rows, 1-2 groups" for form in FORMS]) * 3


@pytest.fixture(scope="module")
def cross() -> None:
    missing = [tool for tool in (CROSS, QEMU) if shutil.which(tool) is None]
    assert not missing, f"{missing} not installed: `make install-test` installs them (Debian packages)"


@pytest.mark.parametrize(("isa", "cpu"), [("neon", "cortex-a72"), ("neon", "cortex-a76"),
                                          ("neon-dotprod", "cortex-a76")])
def test_the_aarch64_kernels_give_the_portable_bits(cross, tmp_path, isa: Isa, cpu: str):
    same_bits([QEMU, "-cpu", cpu, str(build(CROSS, isa, tmp_path / isa))], isa)


def test_the_dot_product_build_uses_sdot(cross, tmp_path):
    """A Pi 4's core has no sdot: the dot-product build dies there (SIGILL), so the check above ran sdot."""
    got = subprocess.run([QEMU, "-cpu", "cortex-a72", str(build(CROSS, "neon-dotprod", tmp_path / "dp"))],
                         capture_output=True, timeout=120)
    assert got.returncode != 0 and b"Illegal instruction" in got.stderr


DOT = "        acc[r][h] = vfmaq_f32(acc[r][h], vcvtq_f32_s32(s[r][h].sum()), vmulq_n_f32(d, dx[b * ROWS + r]));\n"
OFFSET = "        acc[r][h] = vfmaq_f32(acc[r][h], m, vdupq_n_f32(sx[b * ROWS + r]));\n"
ROUND = "q[i] = vcvtnq_s32_f32(vmulq_n_f32(v[i], id));"


@pytest.mark.parametrize(("wrong", "right", "seen"), [
    (OFFSET + DOT, DOT + OFFSET, "DIFFERENT q4: 1 rows"),  # q4's offset step before the block's dot product
    (ROUND.replace("vcvtnq", "vcvtq"), ROUND, "DIFFERENT quantize_row: neon"),  # rounding toward zero
], ids=["q4-order", "quantize-rounding"])
def test_the_check_fails_on_a_wrong_neon_kernel(cross, tmp_path, wrong: str, right: str, seen: str):
    """check.cpp would see a wrong rule in the NEON kernels."""
    for name in ("simd.h", "groups.h", "groups_x86.h", "groups_amx.h", "check.cpp"):
        shutil.copy(HERE / name, tmp_path / name)
    neon = (HERE / "groups_neon.h").read_text()
    assert right in neon
    (tmp_path / "groups_neon.h").write_text(neon.replace(right, wrong))
    out = tmp_path / "wrong"
    subprocess.run([CROSS, "-std=c++17", "-O3", "-ffp-contract=off", "-static", str(tmp_path / "check.cpp"), "-o",
                    str(out)], check=True)
    got = subprocess.run([QEMU, "-cpu", "cortex-a72", str(out)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 1 and seen in got.stdout.splitlines()[-1]


@pytest.mark.skipif("avx512-amx" not in isas(), reason="this CPU has no AMX tiles")
def test_the_check_fails_on_a_wrong_amx_kernel(tmp_path):
    """check.cpp would see the AMX kernels read a block's dots where the next block's are stored (each block's dots
    are read one block late, out of a buffer per block parity)."""
    for name in ("simd.h", "groups.h", "groups_x86.h", "groups_neon.h", "check.cpp"):
        shutil.copy(HERE / name, tmp_path / name)
    amx, right = (HERE / "groups_amx.h").read_text(), "V::words(dots[b & 1][h][r], 8)"
    assert right in amx
    (tmp_path / "groups_amx.h").write_text(amx.replace(right, "V::words(dots[(b + 1) & 1][h][r], 8)"))
    out = tmp_path / "wrong"
    subprocess.run(["g++", "-std=c++17", *compile_flags("avx512-amx"), str(tmp_path / "check.cpp"), "-o", str(out)],
                   check=True)
    got = subprocess.run([str(out)], capture_output=True, text=True, timeout=120)
    # the first pass the tiles take: AMX_ROWS rows
    assert got.returncode == 1 and "DIFFERENT q4: 5 rows" in got.stdout.splitlines()[-1]


@pytest.mark.parametrize("isa", isas())
def test_this_cpus_kernels_give_the_portable_bits(tmp_path, isa: Isa):
    same_bits([str(build("g++", isa, tmp_path / isa))], isa)


def test_the_extensions_matmuls_compile_for_aarch64(cross):
    """quant.cpp, the extension's matmuls over the NEON kernels, against torch's headers (the same on aarch64):
    what `python -m edgespec.model.kernels` compiles on a Pi 5 (torch builds extensions as C++20), checked without
    linking (no aarch64 libtorch here)."""
    python = sysconfig.get_paths()["include"]
    flags = [*compile_flags("neon-dotprod"), *(f"-I{p}" for p in [*include_paths(), python])]
    subprocess.run([CROSS, "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=check", *flags,
                    str(HERE / "quant.cpp")], check=True)
