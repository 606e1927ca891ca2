"""The locks the two set-up commands install from (requirements.txt, requirements-test.txt, and an aarch64
board's requirements-aarch64.txt; `make lock`) agree with pyproject's ranges and with each other, and the
environment running the tests is the test lock's."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\$")


def pins(lock: str) -> dict[str, Version]:
    """name -> version of every package a lock file pins; each pin carries at least one hash."""
    lines = (ROOT / lock).read_text().splitlines()
    out = {}
    for i, line in enumerate(lines):
        if m := PIN.match(line):
            assert lines[i + 1].strip().startswith("--hash=sha256:"), f"{lock}: {m.group(1)} has no hash"
            out[canonicalize_name(m.group(1))] = Version(m.group(2))
    assert out, f"{lock} pins nothing"
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.mark.parametrize(("lock", "groups"), [("requirements.txt", ["runtime"]),
                                              ("requirements-test.txt", ["runtime", "test"]),
                                              ("requirements-aarch64.txt", ["runtime"])])
def test_every_requirement_is_pinned_within_its_range(lock, groups):
    locked = pins(lock)
    reqs = [Requirement(r) for g in groups
            for r in (project()["dependencies"] if g == "runtime" else project()["optional-dependencies"][g])]
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not in {lock}: run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"{lock} pins {req.name}=={locked[name]} outside {req.specifier}: run `make lock`"


def test_the_runtime_lock_is_the_test_locks_subset():
    runtime, test = pins("requirements.txt"), pins("requirements-test.txt")
    assert {n: v for n, v in test.items() if n in runtime} == runtime


def test_an_aarch64_board_gets_the_runtime_locks_versions():
    # the same releases (torch's without x86's +cpu); on top, what torch's aarch64 wheel from PyPI depends on
    runtime, board = pins("requirements.txt"), pins("requirements-aarch64.txt")
    assert {n: Version(v.public) for n, v in runtime.items()} == {n: v for n, v in board.items() if n in runtime}


def test_the_running_environment_is_the_test_lock():
    # the tests run in .venv as `make test` builds it: every locked package at its locked version
    wrong = {}
    for name, version in pins("requirements-test.txt").items():
        try:
            have = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            have = None
        if have != version:
            wrong[name] = (str(version), have and str(have))
    assert not wrong, f"installed versions differ from the lock (locked, installed): {wrong}"
