"""What `serve` and a worker import never reaches the benchmarks (bench/) or the offline training tools
(decoding/training/).

The import graph is read statically: every `import` and `from ... import` of a module's source, those inside
functions too (they run when the function does), resolved to the repository's files. The walk starts from the
runtime entry points, server/app.py, server/boot.py and workers/app.py, and from server/cli.py, the console
script, less the bodies of its dev-tool commands (DEV_TOOLS): those are the one place allowed to import bench/
or decoding/training/, lazily, inside the command's function. A command added to the CLI is walked unless it is
named there.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the package `edgespec`
ENTRIES = ["server/app.py", "server/boot.py", "workers/app.py"]
CLI = "server/cli.py"
# the CLI's functions that import bench/ or decoding/training/ (lazily) for a tool run from a checkout
DEV_TOOLS = {"bench", "bench_peer", "eval_formats", "compare_headsplit", "train_drafter", "train_medusa",
             "profile_headsplit"}
APART = ("bench/", "decoding/training/")  # what no runtime module may reach


def module_file(name: str) -> Path | None:
    """The file of an `edgespec.*` module in this repository (a package's __init__.py), or None."""
    parts = name.split(".")
    if parts[0] != "edgespec":
        return None
    base = ROOT.joinpath(*parts[1:])
    for path in (base.with_suffix(".py") if parts[1:] else None, base / "__init__.py"):
        if path is not None and path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(["edgespec", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def imported(path: Path, skip_functions: frozenset[str] = frozenset()) -> list[tuple[Path, ast.AST]]:
    """The repository files `path` imports anywhere in its source (with the packages' __init__.py that the
    import runs), each with the node importing it; the bodies of top-level functions named in
    `skip_functions` are left out."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    skipped = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in skip_functions
               for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import x`: x is a submodule, or a name of pkg
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                if (found := module_file(".".join(parts[:i]))) is not None:
                    out.append((found, node))
    return out


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def runtime_modules() -> dict[str, str]:
    """Every repository module the runtime entry points reach: its path -> the module that imports it first."""
    cli = ROOT / CLI
    reached = {rel(ROOT / e): "(entry point)" for e in ENTRIES} | {CLI: "(entry point)"}
    todo = [ROOT / e for e in ENTRIES] + [cli]
    while todo:
        path = todo.pop()
        for found, _ in imported(path, frozenset(DEV_TOOLS) if path == cli else frozenset()):
            if rel(found) not in reached:
                reached[rel(found)] = rel(path)
                todo.append(found)
    return reached


def test_no_runtime_module_reaches_bench_or_training():
    reached = runtime_modules()
    # the walk is not vacuous: it reaches the engine, the policies, the planner, the workers and the CLI's parsers
    for expected in ["engine/engine.py", "engine/executor.py", "engine/prefix.py", "decoding/policy.py",
                     "decoding/speculative.py", "decoding/medusa.py", "decoding/headsplit_profile.py",
                     "planning/plan.py", "workers/host.py", "server/service.py", "planning/cli.py"]:
        assert expected in reached, f"the walk does not reach {expected}"
    wrong = {p: by for p, by in reached.items() if p.startswith(APART)}
    assert not wrong, f"runtime modules reach bench/ or decoding/training/ (module: imported by): {wrong}"


def test_reached_modules_import_only_by_statements():
    # a string import (importlib.import_module, __import__) would escape the static walk
    calls = {}
    for path in runtime_modules():
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__"):
                calls.setdefault(path, []).append(node.lineno)
    assert not calls, f"string imports in runtime modules: {calls}"


def test_only_the_clis_dev_tools_import_bench_or_training():
    cli = ast.parse((ROOT / CLI).read_text())
    functions = {f.name for f in cli.body if isinstance(f, ast.FunctionDef)}
    assert not DEV_TOOLS - functions, f"DEV_TOOLS names no function of {CLI}: {DEV_TOOLS - functions}"
    package = [ROOT / "__init__.py", *(p for d in sorted(ROOT.iterdir()) if (d / "__init__.py").is_file()
                                       for p in sorted(d.rglob("*.py")))]
    wrong = set()
    for path in package:
        if rel(path).startswith(APART):
            continue
        for found, node in imported(path, frozenset(DEV_TOOLS) if rel(path) == CLI else frozenset()):
            if rel(found).startswith(APART):
                wrong.add(f"{rel(path)}:{node.lineno} imports {rel(found)}")
    assert not wrong, sorted(wrong)


def test_importing_the_server_loads_no_bench_training_or_psutil():
    # the same rule at run time; psutil is a test-environment package, for bench/ only
    code = ("import sys, edgespec.server.boot, edgespec.server.app, edgespec.server.cli, edgespec.workers.app; "
            "print(*sorted(m for m in sys.modules if m == 'psutil' or "
            "m.startswith(('edgespec.bench', 'edgespec.decoding.training'))))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == []
