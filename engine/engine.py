"""The engine: the one place where a sequence's tokens are produced, in steps shared by every running sequence.

A policy writes each request as a program (engine/program.py): a generator, run on the model thread, that
yields the rows it feeds next (`Rows`: its plan), receives the pass's output (`Out`) and decides what to keep
of it (its accept: the tokens, and a KV operation such as a `Truncate` or a tree's `Commit`), and yields the
events to stream. Each step the engine takes every running program's rows, runs them as one forward pass
through the stages (a ragged batch: each sequence's rows at its own slots and positions, with its own mask), and hands
every program its part; the programs then sample with their own parameters and plan the next step, still
on the model thread, so the next step needs nothing from the event loop. A program that needs a proposer's
work between two steps (Medusa's heads on its last hidden state) yields a `Propose`: the engine answers every
sequence's proposals of one proposer in one batched call before the next step. Steps follow one another while no
other job waits for the model thread (an arriving request's admission, a release), and the event loop only
streams the events the programs yielded.

A long prompt that arrives while other sequences run goes in chunks that fill each step up to a multiple of
STEP_ROWS rows, so it delays them by a chunk per step, not by its whole prefill; alone it goes in one pass (over
workers, in pipelined segments). Each row's result is bitwise what its sequence alone would get (the kernels are
row-invariant and each query row attends over exactly its slots: tests/test_exact_format.py), so sharing
steps changes no answer.

The engine owns the requests' sessions (engine/sessions.py): it opens a job's session (admission, a start from
cached blocks), builds its program with a read-only view of it, applies the KV operations the program yields
(a truncation, a tree commit) and, however the sequence ends, keeps its blocks for prefix reuse and releases
it. Its passes go through the executor (engine/executor.py), one way: programs never reach the stages.

Jobs run on a lane: an executor and the sessions held on it (engine/sessions.py). The layer pipeline is the
engine's first lane; HeadSplit's blocks are another (`headsplit`), built at its first job: each step runs every
lane's sequences, one pass per lane, on the one model thread.

A step that a stage failure voids (a lost worker) is run again: the event loop has the lane's stages
re-placed (its `recover`, the cluster's), every session is rebuilt from its tokens on the new placement, and the
same bits come out, so a stream goes on with the tokens it would have had.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import torch

from edgespec.engine.admission import Admission
from edgespec.engine.executor import Executor, Work
from edgespec.engine.prefix import PrefixCache
from edgespec.engine.program import Commit, Job, Out, Program, Propose, Rows, SequenceView, Speculate, Truncate
from edgespec.engine.session import Session
from edgespec.engine.sessions import Recover, Sessions
from edgespec.model.stage import ClusterFault, StageFailure

_END = object()
Passed = tuple[torch.Tensor, torch.Tensor | None]  # a sequence's part of a pass: logits, hidden with features
LAYERS = "layers"  # the engine's first lane: the layer pipeline


@dataclass
class _Sequence:
    job: Job
    lane: Sessions
    session: Session
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int = 0  # its place in the group it was started with (Engine.run_group)
    program: Program | None = None  # built at its first step, on the model thread
    rows: Rows | None = None  # the rows planned for the next step
    asking: Propose | None = None  # a proposal it waits for before it plans them
    done: int = 0  # of a long prompt's rows: how many earlier steps have fed
    earlier: list[torch.Tensor] = field(default_factory=list)  # their hidden states [1, chunk, H], with features
    cancelled: bool = False  # the consumer went away (a client that disconnected)
    finished: bool = False
    faults: int = 0  # steps of its that a stage failure voided since its last good one

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))

    def close(self) -> None:
        if self.program is not None:
            self.program.close()


def _deliver(items: list[tuple[asyncio.Queue, tuple[int, object]]]) -> None:
    # on the event loop: a step's events, each into its sequence's queue
    for queue, item in items:
        queue.put_nowait(item)


class Engine:
    """Runs every request's program in shared steps; owns their sessions. Its first lane is `executor` (the
    layer pipeline) with `prefix` (its prefix cache; None: every prompt computed), `admission` (the queue of
    requests waiting for its KV room) and `recover` (the cluster's re-placement after a stage failure; None:
    stage failures are final); `lanes`: other lanes by name, each built (blocking) at its first job."""

    # Rows per step while a prompt goes in beside other sequences: the prompt's chunk is what the others'
    # rows leave of STEP_ROWS, and at least MIN_CHUNK. On a 2-core AVX2 EPYC a prompt row costs about 2.5 ms
    # in a step (4 streams' steps took 19 ms alone and 50-70 ms with a 16-token chunk at up to 504 slots):
    # chunks of 64 had stretched 4 streams' gap between tokens from 24 to 290 ms; a steady number of rows per
    # step bounds the gap, and the prompt's first token stays within about 2x its idle time
    # (bench/concurrency.py). Fewer rows trade the one for the other. Where the others' rows leave less than
    # MIN_CHUNK, the step is filled up to the next multiple of STEP_ROWS: on the AMX path a pass of 17-32 rows
    # pays a second tile whatever it carries (a 2-core Xeon with AMX, one served run's medians: 16 rows 11.18
    # ms, 17 rows 15.01, 20 rows 17.39, 32 rows 20.78), and beside 16 streams a prompt went in 4-row chunks, in
    # steps 1.56x a plain one. Filled (16-row chunks there), 16 streams' steady use made 1.018x the tokens a
    # second and the first token's median took 235 ms against 301 (bench/results/issue39-program-python).
    STEP_ROWS = 16
    MIN_CHUNK = 4

    def __init__(self, executor: Executor, prefix: PrefixCache | None = None, admission: Admission | None = None,
                 recover: Recover | None = None, lanes: dict[str, Callable[[], Sessions]] | None = None):
        self.executor = executor
        self.thread = executor.thread
        self.sessions = Sessions(executor, prefix, admission, recover)
        self.lanes: dict[str, Sessions] = {LAYERS: self.sessions}
        self._builders = dict(lanes or {})
        self._building: asyncio.Lock | None = None
        self.live: list[_Sequence] = []  # running sequences (pruned on the event loop)
        self.task: asyncio.Task | None = None
        self.shared_steps = self.shared_calls = 0  # steps that carried several sequences, and the sequences
        self.passes = 0  # passes run (each one's number in its Out)
        # the model thread's CPU seconds in the programs after each pass (sampling, drafting, verifying, text):
        # work that runs while the kernels' other threads wait, so its share of a step is lost to every stream
        self.program_seconds = 0.0
        self._outbox: list[tuple[_Sequence, object]] = []  # events yielded on the model thread, not yet sent

    @property
    def cfg(self):
        """The served model's configuration (model.config.ModelConfig)."""
        return self.executor.cfg

    @property
    def prefix(self) -> PrefixCache | None:
        return self.sessions.prefix

    @property
    def admission(self) -> Admission:
        return self.sessions.admission

    def has_lane(self, name: str) -> bool:
        """Whether jobs may run on lane `name` (built or not yet)."""
        return name in self.lanes or name in self._builders

    def built(self, name: str) -> Sessions | None:
        """Lane `name` if it has been built (its first job came), else None."""
        return self.lanes.get(name)

    async def lane(self, name: str) -> Sessions:
        """Lane `name`, built now (on a thread) if this is its first job."""
        if name not in self.lanes:
            if name not in self._builders:
                raise ValueError(f"this engine has no lane {name!r}")
            self._building = self._building or asyncio.Lock()
            async with self._building:
                if name not in self.lanes:
                    self.lanes[name] = await asyncio.to_thread(self._builders[name])
        return self.lanes[name]

    def running(self, besides: Session | None = None) -> int:
        """How many sequences are running now (other than the one of session `besides`)."""
        return sum(1 for s in self.live if not s.finished and s.session is not besides)

    async def run(self, job: Job) -> AsyncGenerator[object, None]:
        """Run `job`: yields what its program yields besides its rows and KV operations. Raises what the open,
        the program or its passes raised. Leaving early (a cancelled request) stops the program at the next
        step, on the model thread; its session is kept for prefix reuse and released however it ends."""
        async for _, item in self.run_group([job]):
            yield item

    async def run_group(self, jobs: list[Job]) -> AsyncGenerator[tuple[int, object], None]:
        """Run several jobs together (outline's points, a decision's scores): yields (index, item) for what
        each program yields, in the order they were yielded, until every program has ended. Every session is
        opened first (none waits for what another of the group will compute), then every program starts in the
        same step, so what the group makes does not depend on when its opens ran. The first error raised by any
        of them is raised here, and leaving stops them all."""
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        seqs: list[_Sequence] = []
        try:
            for index, job in enumerate(jobs):
                lane = await self.lane(job.lane)
                session = await lane.open(job.capacity, job.prompt, besides={s.session.id for s in seqs})
                seqs.append(_Sequence(job, lane, session, queue, loop, index))
            self.live += seqs
            self._wake()
            left = len(seqs)
            while left:
                index, item = await queue.get()
                if item is _END:
                    left -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield index, item
        finally:
            for seq in seqs:
                seq.cancelled = True  # stopped on the model thread before the releases below run there
            for lane in {id(seq.lane): seq.lane for seq in seqs}.values():
                await lane.release_all([seq.session for seq in seqs if seq.lane is lane])

    def _view(self, seq: _Sequence) -> SequenceView:
        # what a program may read of its session
        executor, session = seq.lane.executor, seq.session

        def wire() -> dict[str, tuple[int, int]]:
            return executor.wire(session) if session.wire is None else session.wire

        return SequenceView(session, wire, lambda: self.running(besides=session), lambda: executor.figures(session))

    def _wake(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        try:
            while True:
                self.live = [s for s in self.live if not s.finished]
                if not self.live:
                    return
                fault = await self.thread.run(self._steps)
                if fault is not None:  # a stage failed (a lost worker): re-place the stages, then step again
                    lane, batch, error, generation = fault
                    try:
                        await lane.recover(error, generation)
                    except Exception as exc:
                        await self.thread.run(self._fail, batch, exc)
        except BaseException as exc:  # the model thread is gone (shutdown): fail whoever still waits
            for seq in self.live:
                if not seq.finished:
                    seq.finished = True
                    seq.emit(exc if isinstance(exc, Exception) else RuntimeError("the engine stopped"))
            raise

    # on the model thread

    def _steps(self) -> tuple[Sessions, list[_Sequence], Exception, int] | None:
        # Steps back to back while every running sequence has rows and no other job waits for the thread; a
        # step is a pass per lane. A pass that a stage failure voided ends them: (its lane, its sequences, the
        # error, the placement generation it ran under), for the event loop to re-place the lane's stages; its
        # sequences keep their rows for the next step.
        try:
            return self._run_steps()
        finally:
            self._send()

    def _send(self) -> None:
        # The events held since the last pass, in one wake of each event loop. Sent as each pass starts (the
        # kernels release the GIL for the pass): sent as each program yielded them, the event loop woke
        # between the programs of one step and took the GIL from the model thread at its next torch op (an
        # argmax took 129 us there against 28 alone), and the step's Python after a 12-16 stream pass took
        # 2.3-2.9 ms; held, 0.38.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple[int, object]]]] = {}
        for seq, item in self._outbox:
            by_loop.setdefault(seq.loop, []).append((seq.queue, (seq.index, item)))
        self._outbox = []
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _run_steps(self) -> tuple[Sessions, list[_Sequence], Exception, int] | None:
        while True:
            for seq in self.live:
                self._ready(seq)
            self._answer()
            batch = [(s, rows) for s in self.live if not s.finished and (rows := s.rows) is not None]
            if not batch:
                return None
            for lane in {id(seq.lane): seq.lane for seq, _ in batch}.values():
                part = [(seq, rows) for seq, rows in batch if seq.lane is lane]
                generation = lane.executor.generation
                error = self._step(lane, part)
                if lane.prefix is not None:
                    lane.prefix.progress()
                if error is not None:
                    return lane, [seq for seq, _ in part], error, generation
            if self.thread.pending():
                return None

    def _fail(self, batch: list[_Sequence], error: Exception) -> None:
        # the stages could not be re-placed: the step's sequences end with the error (model thread)
        for seq in batch:
            if not seq.finished:
                self._finish(seq, error)
                seq.close()
        self._send()

    def _ready(self, seq: _Sequence) -> None:
        # a new or cancelled sequence: build its program and run it to its first rows, or end it
        if seq.finished:
            return
        if seq.cancelled:
            self._finish(seq, _END)
            seq.close()
        elif seq.program is None:
            try:
                seq.program = seq.job.start(self._view(seq))
            except Exception as exc:
                self._finish(seq, exc)
                return
            self._advance(seq, None)
        elif seq.rows is None and seq.asking is None:
            self._advance(seq, None)

    def _answer(self) -> None:
        # Every proposal asked since the last step, one batched call per proposer; the answers run the programs
        # on to their rows (or to more proposals, answered in turn).
        while asking := [(s, p) for s in self.live if (p := s.asking) is not None and not s.finished]:
            by_proposer: dict[int, list[tuple[_Sequence, Propose]]] = {}
            for seq, propose in asking:
                by_proposer.setdefault(id(propose.proposer), []).append((seq, propose))
            for group in by_proposer.values():
                proposer = group[0][1].proposer
                try:
                    answers = proposer.propose_batch([propose.request for _, propose in group])
                except Exception as exc:
                    for seq, _ in group:
                        self._finish(seq, exc)
                    continue
                for (seq, _), answer in zip(group, answers, strict=True):
                    seq.asking = None
                    self._advance(seq, answer)

    def _advance(self, seq: _Sequence, value) -> None:
        # Send the program its output (or a proposal's answer) and run it to its next Rows or Propose, applying
        # the KV operations and emitting the events it yields on the way.
        program = seq.program
        if program is None:  # (built before its first advance: _ready)
            raise RuntimeError("a sequence advanced before its program was built")
        try:
            item = program.send(value)
            while not isinstance(item, Rows | Propose):
                if isinstance(item, Truncate):
                    seq.lane.executor.truncate(seq.session, item.length)
                elif isinstance(item, Commit):
                    seq.lane.executor.commit(seq.session, item.kept, item.dest, item.tokens)
                elif isinstance(item, Speculate):
                    seq.lane.executor.speculate(seq.session, item.epsilon)
                else:
                    self._outbox.append((seq, item))
                item = program.send(None)
            if isinstance(item, Propose):
                seq.asking = item
                return
            if not item.ids:
                raise ValueError("a sequence planned no rows")
            seq.rows = item
        except StopIteration:
            self._finish(seq, _END)
        except Exception as exc:
            self._finish(seq, exc)

    def _finish(self, seq: _Sequence, last) -> None:
        seq.finished, seq.rows, seq.asking = True, None, None
        self._outbox.append((seq, last))

    def _chunk(self, others: int, prompts: int) -> int:
        """Rows for each of `prompts` prompts going in beside `others` other rows: what those leave of the step
        filled up to a multiple of STEP_ROWS, and at least MIN_CHUNK each."""
        step = -(-(others + self.MIN_CHUNK * prompts) // self.STEP_ROWS) * self.STEP_ROWS  # rounded up
        return max(self.MIN_CHUNK, (step - others) // max(1, prompts))

    def _step(self, lane: Sessions, batch: list[tuple[_Sequence, Rows]]) -> StageFailure | None:
        # One pass of the lane's sequences (each with its planned rows). Beside others, a prompt (a plain run
        # wanting the last row's logits) longer than a chunk gets what the other rows leave of the step.
        crowded = self.running() > 1
        long = [crowded and rows.plain and rows.last_only and len(rows.ids) - s.done > self.MIN_CHUNK
                for s, rows in batch]
        others = sum(len(rows.ids) - s.done for (s, rows), cut in zip(batch, long, strict=True) if not cut)
        chunk = self._chunk(others, sum(long))
        works = [self._work(seq, rows, chunk if cut else None) for (seq, rows), cut in zip(batch, long, strict=True)]
        self._send()
        began = time.perf_counter()
        results = self._pass(lane, works)
        if isinstance(results, StageFailure):
            return self._fault([seq for seq, _ in batch], results)
        seconds = time.perf_counter() - began
        step_rows = sum(len(w.ids) for w in works)
        head_rows = sum(1 if w.last_only else len(w.ids) for w in works)
        self.passes += 1
        cpu = time.thread_time()
        for (seq, rows), work, result in zip(batch, works, results, strict=True):
            session = seq.session
            if isinstance(result, Exception):
                self._finish(seq, result)
                continue
            session.length = work.start + len(work.ids)
            session.passes += 1
            session.shared_with += len(batch) - 1
            logits, hidden = result
            if len(work.ids) < len(rows.ids) - seq.done:  # a chunk of a long prompt: more to feed
                seq.done += len(work.ids)
                if hidden is not None:  # with features: every chunk's hidden states are kept
                    seq.earlier.append(hidden)
                continue
            if seq.earlier and hidden is not None:
                hidden = torch.cat([*seq.earlier, hidden], dim=1)
            seq.rows, seq.done, seq.earlier, seq.faults = None, 0, [], 0
            self._advance(seq, Out(logits, hidden, seconds, len(batch), step_rows, head_rows, self.passes))
        self.program_seconds += time.thread_time() - cpu
        if len(batch) > 1:
            self.shared_steps += 1
            self.shared_calls += len(batch)
        return None

    def _fault(self, batch: list[_Sequence], error: StageFailure) -> StageFailure | None:
        # The step is void (its slots are rewritten when it runs again: every session is rebuilt from its tokens
        # on the new placement first); a sequence whose steps keep failing ends with the error instead.
        tries = Sessions.RECOVERIES
        for seq in batch:
            seq.faults += 1
            if seq.faults > tries:
                self._finish(seq, ClusterFault(f"{error} (still failing after {tries} re-placements)"))
                seq.close()
        return error if any(not seq.finished for seq in batch) else None

    @staticmethod
    def _work(seq: _Sequence, rows: Rows, chunk: int | None) -> Work:
        # the sequence's rows for this step: all of them, or the next `chunk` of a plain run
        session = seq.session
        # a later chunk goes on from where the earlier ones ended
        start = rows.start if seq.done == 0 and rows.start is not None else session.length
        ids = rows.ids[seq.done:]
        if chunk is not None and len(ids) > chunk:
            # a chunk: the hidden states of every chunk are kept when the program wants features
            return Work(session, ids[:chunk], start, None, None, True, rows.features)
        return Work(session, ids, start, rows.positions, rows.mask, rows.last_only, rows.features)

    @staticmethod
    def _pass(lane: Sessions, works: list[Work]) -> list[Passed | Exception] | StageFailure:
        # Every work's (logits, hidden) or exception: one pass over all of them; when that fails, each alone,
        # so that one sequence's error (its KV budget, say) fails no other. A stage failure fails the step (the
        # stages are re-placed and it runs again) where the cluster can recover, else the works it hit.
        executor = lane.executor
        if len(works) > 1:
            try:
                return list(executor.forward_rows(works))
            except StageFailure as exc:
                if lane.recovers:
                    return exc
            except Exception:
                pass
        results: list[Passed | Exception] = []
        for work in works:
            try:
                results.append(executor.forward_work(work))
            except StageFailure as exc:
                if lane.recovers:
                    return exc
                results.append(exc)
            except Exception as exc:
                results.append(exc)
        return results

    def close(self) -> None:
        """Close every lane: the other lanes' pipelines, then the first lane's executor (and the model thread)."""
        for name, lane in self.lanes.items():
            if name != LAYERS:
                lane.executor.pipeline.close()
        self.executor.close()
