"""The installed distribution exposes one import name, `edgespec`: from outside the repository its modules
import as edgespec.*, and no top-level `model`, `server` or `workers` shadows a user's own."""

from __future__ import annotations

import subprocess
import sys


def test_the_distribution_has_one_import_name(tmp_path):
    code = ("import importlib.util as u, edgespec.server.cli, edgespec.engine.engine; "
            "print(*(u.find_spec(n) is None for n in ('model', 'server', 'workers', 'decoding', 'planning')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"] * 5
