"""The profiler and the plan command on real processes (tiny model): `edgespec profile` measures every device
and link, `edgespec plan` places from the file, and `edgespec serve` caches the profile it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from processes import REPO, greedy, start_server

from edgespec.planning.profile import ClusterProfile


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec.server.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_profile_then_plan(tiny, tmp_path):
    out = tmp_path / "profile.json"
    run = cli("profile", "--local-workers", "2", "--model", tiny, "--dtype", "float32", "--tokens", "1,4,16",
              "--contexts", "0,64", "--reps", "2", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    profile = ClusterProfile.load(out)
    assert [w.name for w in profile.workers] == ["worker0", "worker1"]
    for d in [profile.controller, *profile.workers]:
        assert d.layer_ms.tokens == (1, 4, 16) and d.layer_ms.contexts == (0, 64)
        assert all(v > 0 for row in d.layer_ms.ms for v in row)
        assert d.memory_capacity_bytes > 0 and d.memory_used_bytes > 0
    assert profile.controller.head_ms(1) > 0 and profile.controller.embed_ms(1) > 0
    assert profile.workers[0].memory_capacity_bytes == 4 * 2**30  # the workers' default budget
    measured = {(lk.src, lk.dst) for lk in profile.links}
    assert measured == {("controller", "worker0"), ("controller", "worker1"), ("worker0", "worker1"),
                        ("worker1", "worker0")}
    assert all(lk.rtt_ms > 0 and lk.bandwidth_bytes_per_s > 0 for lk in profile.links)
    assert profile.model.n_layers == 4 and profile.dtype == "float32"

    plan = cli("plan", "--profile", str(out), "--json", "--png", str(tmp_path / "plan.png"))
    assert plan.returncode == 0, plan.stderr
    placed = json.loads(plan.stdout)
    stages = placed["stages"]
    assert stages[0]["first"] == 0 and stages[-1]["last"] == 4
    assert (tmp_path / "plan.png").stat().st_size > 1000
    table = cli("plan", "--profile", str(out))
    assert table.returncode == 0 and "worker" in table.stdout and "ms/token" in table.stdout


def test_plan_of_an_infeasible_profile_is_an_error_with_numbers():
    run = cli("plan", "--profile", str(REPO / "config/profiles/jupiter-b-llama-2-13b.json"))
    assert run.returncode == 2
    assert "GiB" in run.stderr and "offer" in run.stderr


def test_serve_measures_once_then_reuses_the_cached_profile(tiny, tmp_path):
    # one worker: the cache is the same for any cluster (test_profile_then_plan measures two and their links)
    env = {"HOME": str(tmp_path / "home")}
    cache = Path(env["HOME"]) / ".cache" / "edgespec" / "profiles"
    server, url = start_server(tmp_path, "first", "--model", tiny, "--local-workers", "1", env=env)
    try:
        files = list(cache.glob("*.json"))
        assert len(files) == 1
        first = greedy(url, "Hello there", 8)
    finally:
        server.stop()
    stamp = files[0].stat().st_mtime_ns
    server, url = start_server(tmp_path, "second", "--model", tiny, "--local-workers", "1", env=env)
    try:
        assert files[0].stat().st_mtime_ns == stamp  # read, not measured again
        assert greedy(url, "Hello there", 8) == first
    finally:
        server.stop()
