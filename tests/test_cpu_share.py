"""The thread governor's decisions on fake /proc readings and windows (no timing), that the model thread
applies the count it picks, and that the CLI bounds libgomp's spinning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgespec.model.cpu_share import CpuReading, ProcReader, ThreadGovernor, Tuning, Window
from edgespec.model.thread import ModelThread
from edgespec.server.cli import GOMP_SPINCOUNT, _overrides, build_parser
from edgespec.workers.cluster import worker_command
from edgespec.workers.host import StageHost
from edgespec.workers.settings import WorkerSettings


class FakeReader:
    """Readings handed out one per read()."""

    def __init__(self, readings: list[CpuReading]):
        self.readings = list(readings)

    def available(self) -> bool:
        return True

    def read(self) -> CpuReading | None:
        return self.readings.pop(0)


def governor(configured: int = 2, tuning: Tuning | None = None) -> tuple[ThreadGovernor, list[int]]:
    """A governor whose own ticks read nothing (observe gets the windows), and the counts it applied."""
    applied: list[int] = []
    return ThreadGovernor(configured, applied.append, FakeReader([None] * 100), tuning or Tuning()), applied


def window(others: float, waiting: float | None = None, active: float | None = None) -> Window:
    if waiting is not None and active is None:
        active = 1.5
    return Window(0.5, others, active, waiting)


def test_window_from_readings_leaves_out_our_own_time_and_nice():
    a = CpuReading(wall=10.0, busy=100.0, own=40.0, own_in_busy=True, run=30.0, wait=1.0)
    b = CpuReading(wall=10.5, busy=101.0, own=40.5, own_in_busy=True, run=30.3, wait=1.1)
    w = Window.between(a, b)
    assert abs(w.others - 1.0) < 1e-9  # (1.0 busy - 0.5 ours) / 0.5 s
    assert abs(w.active - 0.8) < 1e-9 and abs(w.waiting - 0.25) < 1e-9
    niced = Window.between(a, CpuReading(10.5, 101.0, 40.5, False, None, None))  # our time is in the nice column
    assert abs(niced.others - 2.0) < 1e-9 and niced.waiting is None


def test_proc_reader_parses_proc_files(tmp_path: Path):
    (tmp_path / "self" / "task" / "7").mkdir(parents=True)
    (tmp_path / "self" / "task" / "8").mkdir()
    cpus = "".join(f"cpu{i} 100 5000 50 999 0 1 2 3 0 0\n" for i in range(64))  # nice (5000) is not busy
    (tmp_path / "stat").write_text("cpu 1 2 3 4 5 6 7 8 9 10\n" + cpus + "intr 1 2\n")
    (tmp_path / "self" / "stat").write_text("42 (a (b) c) R 1 1 1 0 -1 0 0 0 0 0 300 20 0 0 20 0 3 0\n")
    (tmp_path / "self" / "task" / "7" / "schedstat").write_text("2000000000 500000000 10\n")
    (tmp_path / "self" / "task" / "8" / "schedstat").write_text("1000000000 0 3\n")
    main = tmp_path / "self" / "task" / str(os.getpid())  # the event loop's thread: its waits are left out
    main.mkdir()
    (main / "schedstat").write_text("5000000000 9000000000 40\n")
    reader = ProcReader(tmp_path)
    r = reader.read()
    mine = len([c for c in os.sched_getaffinity(0) if c < 64])
    assert abs(r.busy - mine * 156 * reader.tick_s) < 1e-9
    assert abs(r.own - 320 * reader.tick_s) < 1e-9 and r.own_in_busy
    assert (r.run, r.wait) == (3.0, 0.5)


def test_a_contended_window_drops_a_thread_and_a_fall_of_the_load_brings_it_back():
    g, applied = governor()
    assert g.observe(window(0.05, waiting=0.02)) == 2  # calm
    assert g.observe(window(0.9, waiting=0.45)) == 1  # a hog on the other core: barriers wait
    # on one thread the hog still shows as load (~1 core), and we do not wait: stay
    assert g.observe(window(1.0, waiting=0.01)) == 1
    assert g.tick() == 1 and applied == [1]  # applied by the next tick, on the thread that ticks
    assert g.observe(window(0.05, waiting=0.01)) == 2  # the hog stopped
    assert g.tick() == 2 and applied == [1, 2]


def test_load_alone_decides_without_schedstat_with_hysteresis():
    g, _ = governor()
    assert g.observe(window(0.4)) == 2  # under down_slack: a core is not taken yet
    assert g.observe(window(0.8)) == 1
    assert g.observe(window(0.4)) == 1  # between the slacks: stay
    assert g.observe(window(0.1)) == 2


def test_an_idle_gap_is_not_a_window_and_the_next_one_is_short():
    r = [CpuReading(0.0, 0.0, 0.0, True, 0.0, 0.0),
         CpuReading(0.15, 0.3, 0.3, True, 0.3, 0.0),  # calm work
         CpuReading(5.0, 10.0, 0.3, True, 0.3, 0.0),  # idle while others took 2 cores: no verdict
         CpuReading(5.15, 10.3, 0.45, True, 0.45, 0.1)]  # work beside a hog: waited 0.1 s of 0.25
    clock = iter([0.0, 0.1, 0.15, 5.0, 5.15])
    g = ThreadGovernor(2, lambda n: None, FakeReader(r), Tuning(interval_s=0.5, short_s=0.15, gap_s=1.0),
                       clock=lambda: next(clock))
    assert [g.tick() for _ in range(5)] == [2, 2, 2, 2, 1]


def test_a_nice_process_is_no_load_but_its_waiting_counts():
    g, _ = governor(tuning=Tuning(probe_s=2.0))
    assert g.observe(window(0.0, waiting=0.1)) == 2  # no load, little waiting: harmless
    assert g.observe(window(0.05, waiting=0.4)) == 1  # the barriers wait for it
    # the cores look free (its time is in the nice column), but the load did not fall since the drop: no
    # return by the load, only a try after probe_s seconds of work
    assert [g.observe(window(0.05, waiting=0.0)) for _ in range(4)] == [1, 1, 1, 2]


def test_tries_one_more_thread_after_work_and_backs_off_when_it_waits():
    # the load of our own cluster's processes is not contention: a worker beside a busy controller
    g, _ = governor(tuning=Tuning(probe_s=1.0, probe_max_s=4.0))  # windows of 0.5 s
    assert g.observe(window(0.8, waiting=0.4)) == 1  # contention: down; a try after 1 s of work
    assert g.observe(window(1.5, waiting=0.5)) == 1  # more than a core taken: one thread waits, no try
    assert [g.observe(window(0.8, waiting=0.0)) for _ in range(2)] == [1, 2]  # ambiguous load: a try
    assert g.observe(window(0.8, waiting=0.4)) == 1  # it waited: next after 2 s
    assert [g.observe(window(0.8, waiting=0.0)) for _ in range(4)] == [1, 1, 1, 2]
    assert g.observe(window(0.8, waiting=0.4)) == 1  # next after 4 s (the cap)
    assert [g.observe(window(0.8, waiting=0.0)) for _ in range(8)] == [1] * 7 + [2]
    assert g.observe(window(0.1, waiting=0.0, active=0.01)) == 2  # too little work: not judged yet
    assert g.observe(window(0.8, waiting=0.05)) == 2  # judged: kept
    assert g.observe(window(0.8, waiting=0.4)) == 1  # contention again: the wait starts over at 1 s
    assert [g.observe(window(0.8, waiting=0.0)) for _ in range(2)] == [1, 2]


def test_many_cores_drop_by_the_load_taken():
    g, _ = governor(configured=4)
    assert g.observe(window(1.9, waiting=0.3)) == 2  # two hogs
    assert g.observe(window(3.5, waiting=0.3)) == 1  # never below one
    one = ThreadGovernor(1, lambda n: None, FakeReader([]))
    assert not one.enabled and one.tick() == 1


def test_model_thread_applies_the_governors_count():
    thread = ModelThread(2)
    thread.governor.reader = FakeReader([None] * 100)  # decisions come from the test, not this machine's load
    try:
        assert thread.run_sync(torch.get_num_threads) == 2
        thread.governor.observe(window(1.0, waiting=0.5))
        assert thread.run_sync(torch.get_num_threads) == 1  # set on the model thread, where the work runs
        thread.governor.observe(window(0.0, waiting=0.0))
        assert thread.run_sync(torch.get_num_threads) == 2
    finally:
        thread.shutdown()
    fixed = ModelThread(2, adaptive=False)
    assert fixed.governor is None
    fixed.shutdown()


def test_worker_governs_its_threads_unless_told_not_to():
    assert StageHost(WorkerSettings(port=0, token="t", threads=2)).governor.configured == 2
    assert StageHost(WorkerSettings(port=0, token="t", adapt_threads=False)).governor is None


def test_local_workers_govern_threads_only_alone():
    """Several local workers share the cores by design (one's wait for another is not contention); one alone
    keeps its governor for other people's processes."""
    args = build_parser().parse_args(worker_command(1, "t", "w", None, 2, adapt=False)[3:])
    assert WorkerSettings(**_overrides(args)).adapt_threads is False
    args = build_parser().parse_args(worker_command(1, "t", "w", None, 2)[3:])
    assert WorkerSettings(**_overrides(args)).adapt_threads is True


@pytest.mark.parametrize(("given", "seen"), [(None, GOMP_SPINCOUNT), ("5", "5")])
def test_the_cli_bounds_libgomps_spin_before_torch_loads_unless_the_user_set_it(given, seen):
    """server/cli.py's GOMP_SPINCOUNT says why; libgomp reads it once, when torch is first imported."""
    code = ("import os, sys\nfrom edgespec.server import cli\n"
            "cli.synth_model = lambda args: print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
            "cli.main(['synth-model', '--shape', 'any'])\n")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | ({"GOMP_SPINCOUNT": given} if given else {})
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [seen, "False"]
