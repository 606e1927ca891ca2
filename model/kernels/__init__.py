"""The CPU kernels, compiled once per machine and CPU feature set, then cached: `quant.cpp` (quantized and
dense matmuls), `ops.cpp` (norm, rotary, attention, SwiGLU), `layer.cpp` (an attention block, a decoder layer,
a stack of them in one call each), `ffn.cpp` (a feed-forward, dense or a mixture of experts, in one call), `kv.h`
(the KV cache's storage formats), `bind.cpp` (the Python module).

`load()` builds the extension with the flags this CPU supports (on x86: the VNNI path where the CPU has
AVX512_VNNI with AVX512_VL, with AMX-INT8 tiles for passes of 5 rows or more where it has them (Sapphire Rapids and
later Xeons), or 512-bit kernels taking two weight groups at once where 512-bit vectors run at full width (Zen 5);
or AVX-VNNI; else AVX2 + FMA; on aarch64: NEON, with sdot where the CPU has the dot
product extension; the portable C++ loops elsewhere) into `model/kernels/build/`, and returns the module.
`groups.h` holds the quantized matmuls' kernels without torch, and `check.cpp` compares them with the portable
ones on their own (tests/test_kernels_aarch64.py runs it for aarch64 under qemu-user).
`load("avx2")` or `load(False)` build a narrower path on the same CPU: every path gives the same bits, and the
tests compare all the ones this CPU can run.
`python -m edgespec.model.kernels` builds it ahead of time (the README's install commands run it), so a server's
first start does not pay the 20-40 s of compiling.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [HERE / "quant.cpp", HERE / "ops.cpp", HERE / "layer.cpp", HERE / "ffn.cpp", HERE / "pool.cpp",
           HERE / "bind.cpp"]
HEADERS = [HERE / name for name in ("common.h", "kv.h", "simd.h", "groups.h", "groups_x86.h", "groups_amx.h",
                                    "groups_neon.h")]
NAME = "edgespec_kernels"
# torch's build lock older than this is a killed compile's (a compile takes 20-90 s): left in place, every later
# load waited on it forever, a server start included, with nothing in its log
STALE_LOCK_S = 600


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo (empty where it does not exist); read once: load() runs per token
    (a tied embedding's lookup), and reading the file each time took 2% of a decode step."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (x86's "flags", aarch64's "Features")."""
    info = cpu_info()
    return frozenset(info.get("flags", info.get("Features", "")).split())


def full_width_512(info: dict[str, str] | None = None) -> bool:
    """Whether the CPU's 512-bit vpdpbusd does twice a 256-bit one's work per cycle: AMD's Zen 5 (family 1Ah and
    later). Zen 4 (19h) runs a 512-bit op as two 256-bit halves, and Intel's cores issue 512-bit integer
    multiplies on one port where 256-bit ones take two, so the same work per cycle (simd.h has the figures).
    Measured on a Zen 5 EPYC only; AMD's mobile Zen 5 parts are said to split 512-bit ops as Zen 4 does, where
    these kernels would cost about 1.2x at 8 rows (Zen 4's figure) and nothing below 5 rows (groups.h)."""
    info = cpu_info() if info is None else info
    try:
        return info.get("vendor_id") == "AuthenticAMD" and int(info.get("cpu family", "0")) >= 0x1A
    except ValueError:
        return False


Isa = Literal["portable", "avx2", "avx512-vnni", "avx512-vnni-zmm", "avx512-amx", "avx-vnni", "neon", "neon-dotprod"]
AVX2 = {"avx2", "fma", "f16c"}
AVX512_VNNI = AVX2 | {"avx512f", "avx512vl", "avx512bw", "avx512_vnni"}
AMX_INT8 = AVX512_VNNI | {"amx_tile", "amx_int8"}
AVX_VNNI = AVX2 | {"avx_vnni"}


def isas(have: set[str] | frozenset[str] | None = None, machine: str | None = None, wide: bool | None = None
         ) -> list[Isa]:
    """The kernel paths a CPU with flags `have` (this one's by default) can run, narrowest first; `wide`: its
    512-bit vectors run at full width (`full_width_512()`, this one's by default), where two weight groups in one
    512-bit kernel is the widest path; AMX tiles are where the CPU has them (only Intel's do; none also runs
    512-bit vectors at full width)."""
    have = cpu_flags() if have is None else have
    wide = full_width_512() if wide is None else wide
    machine = machine or platform.machine()
    out: list[Isa] = ["portable"]
    if machine in ("aarch64", "arm64"):  # NEON is part of every ARMv8-A core; sdot is ARMv8.2-A's "asimddp"
        return [*out, "neon", "neon-dotprod"] if "asimddp" in have else [*out, "neon"]
    if machine not in ("x86_64", "AMD64") or not have >= AVX2:
        return out
    out.append("avx2")
    if have >= AVX512_VNNI:
        out.append("avx512-vnni")
        if have >= AMX_INT8:
            out.append("avx512-amx")
        elif wide:
            out.append("avx512-vnni-zmm")
    elif have >= AVX_VNNI:
        out.append("avx-vnni")
    return out


def chosen(simd: bool | Isa = True) -> Isa:
    """The path `simd` names: True the widest this CPU runs, False the portable build, or a path by name
    (`isas()` lists this CPU's)."""
    return isas()[-1] if simd is True else "portable" if simd is False else simd


def compile_flags(simd: bool | Isa = True) -> list[str]:
    """The compiler flags for a kernel path (`chosen(simd)`); they are part of the build's key, so a CPU with
    other features gets a build of its own."""
    isa = chosen(simd)
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math"]  # threads: pool.cpp, not OpenMP
    if isa == "portable":
        flags += ["-DES_NO_SIMD"]  # an aarch64 compiler targets NEON by default
    elif isa == "neon-dotprod":
        flags += ["-march=armv8.2-a+dotprod"]
    elif isa != "neon":
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if isa in ("avx512-vnni", "avx512-vnni-zmm", "avx512-amx"):
        # 256-bit vpdpbusd (VL), and 512-bit with ES_ZMM; 256-bit vectors preferred for what the compiler
        # vectorizes on its own, as the AVX2 build does (the hand-written kernels choose their widths)
        flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-mprefer-vector-width=256"]
    if isa == "avx512-vnni-zmm":
        flags += ["-DES_ZMM"]
    if isa == "avx512-amx":
        flags += ["-mamx-tile", "-mamx-int8"]
    if isa == "avx-vnni":
        flags += ["-mavxvnni"]
    return flags


def build_key(isa: Isa) -> str:
    """The build's name for path `isa`: a hash of the sources, the flags and torch's version."""
    import torch

    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(code + " ".join([*compile_flags(isa), NAME, torch.__version__]).encode()).hexdigest()[:12]


def build_folder(key: str) -> Path:
    """Where the build for `key` lives: beside the sources, like an extension built at install (so a process
    with another HOME or EDGESPEC_CACHE, a test's or a worker's, finds it), else the user cache when the
    package folder is read-only."""
    folder = HERE / "build" / key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError:
        from edgespec.model.source import cache_root

        folder = cache_root() / "kernels" / key
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def load(simd: bool | Isa = True):
    """The compiled kernel module (built on first use, then loaded from the cache): the widest path this CPU
    runs; simd=False the portable build, or a path by name (`isas()`); all give the same results bit for bit
    (tests compare them). Its `isa()` names the path it was built with."""
    return load_isa(chosen(simd))


@functools.cache
def load_isa(isa: Isa):
    """`load` of one path by name (cached per path: load() and load(its name) are one module)."""
    from torch.utils.cpp_extension import load as build

    flags = compile_flags(isa)
    key = build_key(isa)
    folder = build_folder(key)
    lock = folder / "lock"
    with contextlib.suppress(FileNotFoundError):  # torch's FileBaton: a compile under way, or a killed one's
        if (age := time.time() - lock.stat().st_mtime) > STALE_LOCK_S:
            log.warning("removing %s, left by a compile that was stopped %.0f s ago", lock, age)
            lock.unlink()
    if not any(folder.glob("*.so")):
        log.warning("compiling the CPU kernels once (%s) into %s; this takes 20-90 s", " ".join(flags), folder)
    os.environ.setdefault("MAX_JOBS", "2")
    # the `ninja` package's binary sits beside this interpreter, which need not be on PATH (a venv not activated)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return build(name=f"{NAME}_{key}", sources=[str(p) for p in SOURCES], extra_cflags=flags,
                 build_directory=str(folder), verbose=False)
