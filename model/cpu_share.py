"""How many torch threads to run while other processes take cores: the ThreadGovernor.

Every parallel op ends at a barrier, so N torch threads go at the pace of the slowest core. When another
process takes one of the two cores, each barrier waits for that process's time slice. Measured here
(SmolLM2-135M Q4, naive decoding): 2 threads 98-106 tokens/s calm and 1-7 beside a CPU-bound process on the
other core; 1 thread 84 calm and 75 beside it (bench/results/issue20-busy). So the thread that does the
tensor work asks `tick()` between jobs, and every `interval_s` the governor reads /proc (about 0.3 ms) and
picks the count:

- down when our runnable threads (the event loop's main thread left out) spent a share of their time waiting for
  a core (/proc/self/task/*/schedstat): contention itself, which the mere load of a worker of our own cluster,
  computing while we wait for it, is not;
- back up when the load of other processes (/proc/stat busy time minus ours, on the cores we may use; the
  `nice` column left out) fell by half a core since the drop (the process left), or else by trying one
  more thread after some seconds of work: kept when it does not wait, else undone and tried again after
  twice as long (a nice-19 process shows no load, yet made 2 threads wait up to 42% of the time here).

Windows hold work only: after an idle gap (the other servers of a benchmark, or anything else, ran
meanwhile) the first window is short, so a request that starts beside a new hog loses about 0.15 s.

The served format's kernels split work over outputs only, so a change of count changes no result (checked:
`auto` and float32 logits bitwise equal at 1 and 2 threads). Without /proc (not Linux) `tick()` does nothing.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuReading:
    """Cumulative counters at one moment: `busy` CPU seconds of every process on the cores we may use
    (user, system, irq, softirq, steal; not nice, idle or iowait), `own` CPU seconds of this process and
    whether it counts as busy there (a niced process's time is in the nice column), and our threads'
    on-CPU and runnable-but-waiting seconds (None without schedstat)."""

    wall: float
    busy: float
    own: float
    own_in_busy: bool
    run: float | None
    wait: float | None


@dataclass(frozen=True)
class Window:
    """What happened between two readings: `others` cores' worth of CPU taken by other processes, `active`
    our threads' runnable time in cores (on CPU or waiting), `waiting` the share of it spent waiting for a
    core (None without schedstat)."""

    seconds: float
    others: float
    active: float | None
    waiting: float | None

    @classmethod
    def between(cls, a: CpuReading, b: CpuReading) -> Window:
        seconds = max(b.wall - a.wall, 1e-9)
        others = (b.busy - a.busy) - ((b.own - a.own) if b.own_in_busy else 0.0)
        active = waiting = None
        if a.run is not None and b.run is not None and a.wait is not None and b.wait is not None:
            # threads that ended since `a` take their counts with them: clamp at 0
            run, wait = max(b.run - a.run, 0.0), max(b.wait - a.wait, 0.0)
            active = (run + wait) / seconds
            waiting = wait / (run + wait) if run + wait > 0 else 0.0
        return cls(seconds, max(others, 0.0) / seconds, active, waiting)


class ProcReader:
    """Reads the counters of a CpuReading from /proc (Linux); `read()` gives None where they are missing."""

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def available(self) -> bool:
        return (self.proc / "stat").exists() and (self.proc / "self" / "stat").exists()

    def read(self) -> CpuReading | None:
        try:
            cpus = os.sched_getaffinity(0)
            busy = 0
            for line in (self.proc / "stat").read_text().splitlines():
                # "cpuN user nice system idle iowait irq softirq steal guest guest_nice" (ticks); only the
                # cores we may run on (a worker pinned to one core does not see its neighbour's load)
                if line.startswith("cpu") and line[3:4].isdigit():
                    name, *fields = line.split()
                    if int(name[3:]) in cpus:
                        user, _nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                        busy += user + system + irq + softirq + steal
            stat = (self.proc / "self" / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 is fields[0]
            own = int(fields[11]) + int(fields[12])  # utime, stime
            niceness = int(fields[16])
        except (OSError, ValueError, IndexError):
            return None
        run, wait = self._schedstat()
        return CpuReading(time.monotonic(), busy * self.tick_s, own * self.tick_s, niceness <= 0, run, wait)

    def _schedstat(self) -> tuple[float | None, float | None]:
        """Our threads' on-CPU and waiting nanoseconds, summed, in seconds; the main thread's left out. It runs
        the event loop, which waits for a core whenever our kernel threads hold both: with 16 streams "our
        threads waited 80% of the time" while other processes took 0.08 cores, and the governor halved the
        threads of the passes the streams were waiting for (bench/results/issue39-concurrency)."""
        run = wait = 0
        try:
            tids = os.listdir(self.proc / "self" / "task")
        except OSError:
            return None, None
        main = str(os.getpid())
        for tid in tids:
            if tid == main:
                continue
            try:
                on_cpu, waited, _ = (self.proc / "self" / "task" / tid / "schedstat").read_text().split()
            except (OSError, ValueError):
                continue  # the thread ended meanwhile, or no schedstat
            run += int(on_cpu)
            wait += int(waited)
        if run == 0:
            return None, None
        return run / 1e9, wait / 1e9


@dataclass(frozen=True)
class Tuning:
    """The governor's knobs (defaults measured on the 2-core machine, see the module docstring)."""

    interval_s: float = 0.5  # window while working: /proc is read this often
    short_s: float = 0.15  # window after an idle gap and while trying one more thread: a quick verdict
    gap_s: float = 1.0  # no tick for this long: idle, and the open window is dropped (it holds others' work)
    # drop a thread when our runnable threads waited this share of the time; measured here per request, 2 threads:
    # calm 0.03-0.11 (our own threads and the event loop's), a nice-19 process on a core 0.18 (57 tokens/s, no
    # harm) to 0.42 (12 tokens/s), a nice-0 one 0.49-0.77 (1-6 tokens/s)
    wait_down: float = 0.25
    active: float = 0.2  # a window tells about contention when our threads were runnable this many cores' worth
    up_slack: float = 0.25  # by the load: a core is free when others take under this share of it...
    down_slack: float = 0.5  # ...and taken when they take more than this share (without schedstat)
    load_fall: float = 0.5  # back up by the load when it fell this much (cores) below its peak since the drop
    probe_s: float = 2.0  # seconds of work at the lower count before trying one more thread; doubles after a failure
    probe_max_s: float = 32.0


class ThreadGovernor:
    """Picks the torch thread count of the thread that calls `tick()` (the one that does the tensor work):
    `configured` when the cores are free, fewer while other processes take them. `apply(n)` sets it
    (torch.set_num_threads, which holds per thread: call tick on the tensor thread, and set the configured
    count there at start)."""

    def __init__(self, configured: int, apply: Callable[[int], None], reader: ProcReader | None = None,
                 tuning: Tuning = Tuning(), clock: Callable[[], float] = time.monotonic):
        self.configured = max(1, configured)
        self.threads = self._applied = self.configured  # the owner sets the configured count at start
        self.apply, self.tuning, self.clock = apply, tuning, clock
        self.reader = reader if reader is not None else ProcReader()
        self.enabled = self.configured > 1 and self.reader.available()
        self.others: float | None = None  # the last window's load of other processes, in cores
        self.waiting: float | None = None
        self._last: CpuReading | None = None  # where the open window starts
        self._seen = -math.inf  # the last tick
        self._due = 0.0
        self._probing = False
        self._backoff = tuning.probe_s
        self._worked = 0.0  # seconds of work at the lower count since the drop or the last try
        self._load_peak = math.inf  # others' highest load since the count last dropped

    def tick(self) -> int:
        """Cheap unless a window is due: then read /proc and decide. Applies a changed count (on the calling
        thread) and returns it."""
        if self.enabled:
            t, now = self.tuning, self.clock()
            if now - self._seen > t.gap_s:  # we were idle: others' work since then says little about ours
                self._last, self._due = None, now
            self._seen = now
            if now >= self._due:
                reading = self.reader.read()
                if reading is not None and self._last is not None:
                    self.observe(Window.between(self._last, reading))
                self._due = now + (t.short_s if self._last is None or self._probing else t.interval_s)
                self._last = reading
        if self.threads != self._applied:
            self.apply(self.threads)
            self._applied = self.threads
        return self.threads

    def observe(self, w: Window) -> int:
        """Decide on one window of work (tests feed windows here); the next tick applies the count."""
        self.others, self.waiting = w.others, w.waiting
        target = self._decide(w)
        if target != self.threads:
            log.info("other processes took %.2f cores, our threads waited %s of the time: torch threads %d -> %d%s",
                     w.others, "?" if w.waiting is None else f"{w.waiting:.0%}", self.threads, target,
                     " (trying)" if self._probing else "")
            self.threads = target
        return self.threads

    def _by_load(self, others: float, slack: float) -> int:
        """Threads left when other processes take `others` cores and a core counts above `slack` of one."""
        taken = max(0, math.ceil(others - slack))
        return max(1, min(self.configured, self.configured - taken))

    def _decide(self, w: Window) -> int:
        t, n = self.tuning, self.threads
        # no schedstat (both None then): the load alone, with hysteresis between the two slacks
        if w.waiting is None or w.active is None:
            down, up = self._by_load(w.others, t.down_slack), self._by_load(w.others, t.up_slack)
            return down if down < n else up if up > n else n
        if w.active < t.active:  # too little work to tell
            return n
        if w.waiting >= t.wait_down:
            if n == 1:  # as few as can be; and one more thread would only wait more
                return n
            self._backoff = min(2 * self._backoff, t.probe_max_s) if self._probing else t.probe_s
            self._probing, self._worked, self._load_peak = False, 0.0, w.others
            return min(n - 1, self._by_load(w.others, t.down_slack))
        if self._probing:  # one more thread did not wait: keep it
            self._probing, self._backoff = False, t.probe_s
        if n == self.configured:
            return n
        # Back up by the load when it fell since the drop (a process left). Not otherwise: a nice-19 process
        # shows no load, yet made 2 threads wait 18-42% of the time here. Else try one more thread now and then.
        self._load_peak = max(self._load_peak, w.others)
        self._worked += w.seconds
        if self._by_load(w.others, t.up_slack) > n and w.others <= self._load_peak - t.load_fall:
            return self._by_load(w.others, t.up_slack)
        if self._worked >= self._backoff:
            self._probing, self._worked = True, 0.0
            return n + 1
        return n
