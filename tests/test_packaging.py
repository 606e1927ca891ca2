"""The installed distribution exposes one import name, `edgespec`: from outside the repository its modules
import as edgespec.*, and no top-level `model`, `server` or `workers` shadows a user's own. The benchmarks
(bench/) are not installed: their commands run from a checkout, and an installed wheel says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_COMMANDS = [["bench", "--url", "http://127.0.0.1:9", "--prompts", "p.jsonl", "--out", "o"],
                  ["bench-peer", "--prompts", "p.jsonl", "--out", "o"], ["eval-formats", "--out", "o"],
                  ["compare-headsplit", "--out", "o"]]


def test_the_distribution_has_one_import_name(tmp_path):
    code = ("import importlib.util as u, edgespec.server.cli, edgespec.engine.engine; "
            "print(*(u.find_spec(n) is None for n in ('model', 'server', 'workers', 'decoding', 'planning')))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"] * 5


def test_the_wheel_leaves_bench_out_and_its_commands_say_so(tmp_path):
    # built from a copy of the tree, so that no build/ folder of an earlier build adds stale files to it
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "__pycache__", "results",
                                                             "*.egg-info", "bench-out", ".*_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                            "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("edgespec-*.whl")))
    names = wheel.namelist()
    assert not [n for n in names if n.startswith("edgespec/bench/")]
    assert "edgespec/decoding/training/train_drafter.py" in names  # the training commands are installed
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: psutil>=5.9; extra == \"test\"" in metadata.splitlines()  # bench's, the test extra's only

    # the wheel's files first on the path, this environment's packages after them, without its .pth files (-S):
    # the editable install's finder, which maps edgespec to this checkout, stays out
    site = tmp_path / "site"
    wheel.extractall(site)
    code = ("import sys, edgespec\nfrom edgespec.server.cli import main\nprint(edgespec.__file__)\n"
            f"for argv in {BENCH_COMMANDS!r}:\n"
            "    try:\n        main(argv)\n    except SystemExit as exc:\n        print(argv[0], exc.code)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])}
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == str(site / "edgespec" / "__init__.py")
    assert lines[1:] == [f"{argv[0]} 2" for argv in BENCH_COMMANDS]
    said = run.stderr.splitlines()
    assert len(said) == len(BENCH_COMMANDS) and "Traceback" not in run.stderr
    for argv, line in zip(BENCH_COMMANDS, said, strict=True):
        assert line.startswith(f"edgespec {argv[0]}: the benchmarks (bench/) are not installed"), line
        assert "checkout" in line
