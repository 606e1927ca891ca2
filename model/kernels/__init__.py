"""The CPU kernels, compiled once per machine and CPU feature set, then cached: `quant.cpp` (quantized and
dense matmuls), `ops.cpp` (norm, rotary, attention, SwiGLU), `layer.cpp` (an attention block, an FFN, a decoder layer in
one call each), `kv.h` (the KV cache's storage formats), `bind.cpp` (the Python module).

`load()` builds the extension with the flags this CPU supports (AVX2 + FMA on x86 where present, the
portable C++ loops elsewhere, aarch64 included) into `model/kernels/build/`, and returns the module.
`python -m edgespec.model.kernels` builds it ahead of time (the README's install commands run it), so a server's
first start does not pay the 20-40 s of compiling.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = [HERE / "quant.cpp", HERE / "ops.cpp", HERE / "layer.cpp", HERE / "pool.cpp", HERE / "bind.cpp"]
HEADERS = [HERE / "common.h", HERE / "kv.h"]
NAME = "edgespec_kernels"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it does not exist)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags(simd: bool = True) -> list[str]:
    """The compiler flags for this CPU; simd=False gives the portable build (what an aarch64 board runs)."""
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math"]  # threads: pool.cpp, not OpenMP
    have = cpu_flags()
    if simd and platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= have:
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


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


@functools.cache
def load(simd: bool = True):
    """The compiled kernel module (built on first use, then loaded from the cache). simd=False: the portable
    build, which gives the same results bit for bit (tests compare them)."""
    from torch.utils.cpp_extension import load as build

    flags = compile_flags(simd)
    import torch

    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(code + " ".join([*flags, NAME, torch.__version__]).encode()).hexdigest()[:12]
    folder = build_folder(key)
    if not any(folder.glob("*.so")):
        log.warning("compiling the CPU kernels once (%s) into %s; this takes 20-90 s", " ".join(flags), folder)
    os.environ.setdefault("MAX_JOBS", "2")
    # the `ninja` package's binary sits beside this interpreter, which need not be on PATH (a venv not activated)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return build(name=f"{NAME}_{key}", sources=[str(p) for p in SOURCES], extra_cflags=flags,
                 build_directory=str(folder), verbose=False)
