"""What a worker holds: its assigned layer range, the sessions' KV caches, and per-session step numbers.

No HTTP here: the worker's routes hand bodies in and out. Every session call carries a step number; a
call with the step just applied is a retry and is answered without being applied again, an older step is
refused, so a controller may retry any call safely.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from edgespec.model.config import ModelConfig
from edgespec.model.cpu_share import ThreadGovernor
from edgespec.model.expert_split import Away, ExpertLinks, ExpertShelf, check_experts
from edgespec.model.ffn import Experts
from edgespec.model.kv_format import kv_format
from edgespec.model.linear import bytes_per_param, linear_bytes, weight_format
from edgespec.model.source import resolve_model
from edgespec.model.stack import LayerStack
from edgespec.model.stage import BatchEntry, LocalStage, StepError
from edgespec.model.timing import PROFILE_LAYERS, time_layers, time_split
from edgespec.model.weights import open_source
from edgespec.planning.experts import n_away
from edgespec.workers.kv_report import KVReport
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.wire import BatchMessage, WireError, decode, encode, encode_batch


class NotAssignedError(RuntimeError):
    """The worker holds no layers yet."""


class AssignmentError(RuntimeError):
    """The caller expects other layers than this worker holds."""


@dataclass
class Assignment:
    model: str | None
    first: int
    last: int
    dtype: str


def total_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory_bytes() -> int:
    """What the kernel says new allocations can take without swapping (MemAvailable); the total elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return total_memory_bytes()


def hardware_id() -> str:
    """The cores this process computes on: host name and CPU set (equal for local workers that share cores)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"{socket.gethostname()}/cpus {','.join(map(str, cpus))}"


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StageHost:
    """The worker's model state; all tensor work of a worker goes through here (on one thread)."""

    def __init__(self, settings: WorkerSettings):
        self.settings = settings
        # fewer torch threads while other processes take cores (model/cpu_share.py); asked before each forward
        self.governor = ThreadGovernor(settings.threads or torch.get_num_threads(), torch.set_num_threads) \
            if settings.adapt_threads else None
        self.instance = uuid.uuid4().hex
        self.name = settings.name or f"{socket.gethostname()}:{settings.port}"
        self.assignment: Assignment | None = None
        self.cfg: ModelConfig | None = None
        self.stage: LocalStage | None = None
        self.shelf: ExpertShelf | None = None  # experts held for other workers' layers
        self.weight_bytes = 0
        self.steps: dict[str, int] = {}
        self.last_output: dict[str, tuple[int, bytes]] = {}
        self.last_batch: tuple[tuple[str, int], bytes] | None = None  # the last batch's key and output

    # assignment

    def assign(self, model: str | None, first: int, last: int, dtype: str, kv: str = "float32",
               away: Mapping[int, Away] | None = None, hosted: Mapping[int, Sequence[int]] | None = None,
               links: ExpertLinks | None = None) -> dict:
        """Load layers [first, last) of `model` (reading only their tensors), their caches in KV format `kv`;
        drops every session. A mixture's experts placed `away` (layer -> a worker's URL -> ids) are not loaded
        here: a pass calls that worker over `links` for them; `hosted` (layer -> ids) are other workers'
        layers' experts this one holds for them (model/expert_split.py)."""
        fmt, kv_fmt = weight_format(dtype), kv_format(kv)
        files = resolve_model(model if model is not None else self.settings.model)
        cfg = ModelConfig.from_folder(files.folder)
        if not 0 <= first < last <= cfg.n_layers:
            raise ValueError(f"layer range [{first}, {last}) is outside the model's {cfg.n_layers} layers")
        check_experts(cfg, first, last, away or {}, hosted or {})  # before the layers held now are let go
        moved = n_away(away or {}) - sum(map(len, (hosted or {}).values()))
        weight_bytes = int(((last - first) * cfg.layer_param_count() - moved * cfg.expert_params) *
                           bytes_per_param(fmt, files.gguf is not None))
        budget = int(self.settings.memory_budget_gib * 2**30)
        if weight_bytes >= budget:
            raise MemoryError(f"layers [{first}, {last}) need {weight_bytes / 2**30:.2f} GiB of weights but the "
                              f"worker's memory budget is {budget / 2**30:.2f} GiB")
        self.stage, self.shelf = None, None  # free the old layers before loading new ones
        self.steps.clear()
        self.last_output.clear()
        self.last_batch = None
        src = open_source(files)
        stack = LayerStack.load(src, cfg, first, last, fmt, kv_fmt, away, links)
        self.shelf = ExpertShelf(src, cfg, fmt, hosted or {})
        weight_bytes = linear_bytes(stack) + self.shelf.nbytes()  # what the tensors really hold
        self.stage = LocalStage(stack, budget - weight_bytes, self.settings.kv_prefault)
        self.cfg, self.weight_bytes = cfg, weight_bytes
        self.assignment = Assignment(model, first, last, dtype)
        return self.info()

    def profile(self, model: str | None, dtype: str, tokens: list[int], contexts: list[int], reps: int) -> dict:
        """Time per decoder layer on this device (a few layers loaded for the purpose, then freed), and memory."""
        fmt = weight_format(dtype)
        files = resolve_model(model if model is not None else self.settings.model)
        cfg = ModelConfig.from_folder(files.folder)
        src = open_source(files)
        stack = LayerStack.load(src, cfg, 0, min(PROFILE_LAYERS, cfg.n_layers), fmt)
        curve = time_layers(stack, tokens, contexts, reps)
        del stack
        return {"name": self.name, "layer_ms": asdict(curve), "memory": self.info()["memory"],
                "hardware": hardware_id(), "split_ms": time_split(src, cfg, fmt)}

    def info(self) -> dict:
        a = self.assignment
        used, free = self.stage.pool_blocks() if self.stage else (0, 0)
        budget = int(self.settings.memory_budget_gib * 2**30)
        return {
            "name": self.name,
            "instance": self.instance,
            "pid": os.getpid(),  # a local worker's launcher checks that its URL reaches the process it started
            "memory": {"total_bytes": total_memory_bytes(), "budget_bytes": budget,
                       "resident_bytes": resident_bytes(), "weight_bytes": self.weight_bytes,
                       "kv_bytes": self.stage.kv_bytes() if self.stage else 0,
                       "kv_blocks": {"used": used, "free": free}},
            "holds": None if a is None else {"model": a.model, "layers": [a.first, a.last], "dtype": a.dtype,
                                             "experts": self.experts_held()},
            "sessions": len(self.stage.caches) if self.stage else 0,
            "threads": torch.get_num_threads(),
        }

    def experts_held(self) -> dict[str, int]:
        """The mixture's experts this worker holds: of its own layers, and of other workers' layers."""
        own = 0 if self.stage is None else sum(len(layer.ffn.held) for layer in self.stage.stack.layers
                                               if isinstance(layer.ffn, Experts))
        hosted = 0 if self.shelf is None else sum(len(m.held) for m in self.shelf.experts.values())
        return {"own": own, "hosted": hosted}

    @property
    def splits(self) -> bool:
        """Whether a pass here calls other workers for experts (so it must not run on the event loop's thread)."""
        return self.stage is not None and bool(self.stage.stack.away)

    def expert_partials(self, layer: int, body: bytes) -> bytes:
        """An `experts` call of another worker's pass: its rows, experts and weights -> the weighted outputs of
        the slots whose expert is held here (ExpertShelf.partials)."""
        if self.shelf is None:
            raise NotAssignedError("this worker holds no experts: assign it first")
        if layer not in self.shelf.experts:  # the caller's placement is not this worker's
            raise AssignmentError(f"this worker holds no experts of layer {layer}")
        t = decode(body, ("rows", "chosen", "weights"))
        return encode({"out": self.shelf.partials(layer, t["rows"], t["chosen"], t["weights"])})

    def kv_report(self) -> KVReport:
        """The stage's KV pool as the worker reports it with its answers (workers/kv_report.py)."""
        if self.stage is None:
            return KVReport()
        used, free = self.stage.pool_blocks()
        return KVReport(used, free, self.stage.kv_bytes())

    # sessions

    def _stage(self) -> LocalStage:
        return self._held()[0]

    def _held(self) -> tuple[LocalStage, ModelConfig, Assignment]:
        """The stage with its model's config and its assignment (assign() sets the three together);
        NotAssignedError while no layers are held."""
        if self.stage is None or self.cfg is None or self.assignment is None:
            raise NotAssignedError("this worker holds no layers: assign it first")
        return self.stage, self.cfg, self.assignment

    def ready(self, session: str, step: int) -> bool:
        """Whether a forward with this step may run now: every earlier step of its session has been applied
        (an unknown session, a retry or a stale step is let through, to be answered by forward)."""
        last = self.steps.get(session)
        return last is None or step <= last + 1

    def _is_retry(self, session: str, step: int) -> bool:
        """True for a retry of the last applied step; StepError for an older one."""
        last = self.steps.get(session)
        if last is not None and step < last:
            raise StepError(f"step {step} of session {session!r} is older than the last applied step {last}")
        return last == step

    def _apply(self, session: str, step: int, fn, *args) -> None:
        """Apply a KV operation once: a retried step is answered without applying it again. A failed
        operation does not count as applied."""
        if not self._is_retry(session, step):
            fn(*args)
            self.steps[session] = step

    def _check_capacity(self, capacity: int) -> None:
        cfg = self._held()[1]
        if capacity > cfg.max_position_embeddings:
            raise ValueError(f"capacity {capacity} exceeds the model's context of {cfg.max_position_embeddings}")

    def open(self, session: str, step: int, capacity: int, layers: list[int] | None = None) -> None:
        """Open a session's cache; `layers`, when given, must be what this worker holds (a controller whose
        placement failed to apply must not route through layers it does not expect)."""
        stage, _, a = self._held()
        if layers is not None and list(layers) != [a.first, a.last]:
            raise AssignmentError(f"this worker holds layers [{a.first}, {a.last}), not {layers}")
        self._check_capacity(capacity)
        self._apply(session, step, stage.open, session, capacity)

    def forward(self, session: str, step: int, start: int, body: bytes, onward: bool = False) -> tuple[bytes, float]:
        """Run one forward call; returns the output body and the compute time (0 for a retry). With `onward`
        the output goes to the next stage, so it carries the call's positions and mask too (a tree pass
        needs them on every stage); the controller gets the hidden state alone."""
        stage = self._stage()
        if self._is_retry(session, step):
            cached_step, out = self.last_output.get(session, (None, b""))
            if cached_step == step:
                return out, 0.0
            raise StepError(f"step {step} of session {session!r} was applied but its output is gone")
        self._govern()
        t0 = time.perf_counter()
        tensors = decode(body, ("hidden",), ("positions", "mask"))
        hidden = tensors["hidden"]
        positions = tensors.get("positions")
        mask = tensors.get("mask")
        self._validate(hidden, positions, mask, start)
        if positions is None:
            positions = torch.arange(start, start + hidden.shape[1]).expand(hidden.shape[0], -1)
        result = {"hidden": stage.forward(session, hidden, positions, start, mask)}
        out = encode({**result, "positions": tensors.get("positions"), "mask": mask} if onward else result)
        self.steps[session] = step
        self.last_output[session] = (step, out)
        return out, time.perf_counter() - t0

    def forward_batch(self, message: BatchMessage, onward: bool = False) -> tuple[bytes, float]:
        """Run a step shared by several sessions (each entry's rows as its session alone would get them);
        returns the output body (the message with this stage's hidden, onward; the hidden alone for the
        controller) and the compute time. A retry of the whole batch is answered from its kept output; a
        batch in which only some sessions' steps were applied is refused."""
        stage, cfg, _ = self._held()
        retries = [self._is_retry(session, step) for session, _, _, step in message.entries]
        if any(retries):
            if all(retries) and self.last_batch is not None and self.last_batch[0] == message.key:
                return self.last_batch[1], 0.0
            raise StepError(f"batch {message.key} repeats steps already applied")
        self._govern()
        t0 = time.perf_counter()
        if message.hidden.shape[1] != cfg.hidden_size:
            raise WireError(f"hidden must be [M, {cfg.hidden_size}], got {list(message.hidden.shape)}")
        if message.positions.min() < 0 or message.positions.max() >= cfg.max_position_embeddings:
            raise WireError(f"positions must lie in [0, {cfg.max_position_embeddings})")
        entries = [BatchEntry(session, start, length, mask)
                   for (session, start, length, _), mask in zip(message.entries, message.masks, strict=True)]
        hidden = stage.forward_batch(entries, message.hidden, message.positions)
        out = encode_batch(BatchMessage(message.entries, hidden, message.positions, message.masks)) if onward \
            else encode({"hidden": hidden})
        for session, _, _, step in message.entries:
            self.steps[session] = step
            self.last_output.pop(session, None)  # a single-session retry of these steps has no output to give
        self.last_batch = (message.key, out)
        return out, time.perf_counter() - t0

    def _govern(self) -> None:
        if self.governor is not None:
            self.governor.tick()

    def _validate(self, hidden, positions, mask, start: int) -> None:
        cfg = self._held()[1]
        if hidden.dim() != 3 or hidden.shape[2] != cfg.hidden_size or hidden.shape[1] < 1:
            raise WireError(f"hidden must be [B, T, {cfg.hidden_size}] with T >= 1, got {list(hidden.shape)}")
        if not hidden.is_floating_point():
            raise WireError(f"hidden must be floating point, got {hidden.dtype}")
        b, t = hidden.shape[:2]
        if positions is not None:
            if positions.dtype != torch.int64 or list(positions.shape) != [b, t]:
                raise WireError(f"positions must be int64 [{b}, {t}], got {positions.dtype} {list(positions.shape)}")
            if positions.min() < 0 or positions.max() >= cfg.max_position_embeddings:
                raise WireError(f"positions must lie in [0, {cfg.max_position_embeddings})")
        elif start + t > cfg.max_position_embeddings:
            raise WireError(f"slots up to {start + t} exceed the model's context of {cfg.max_position_embeddings}")
        if mask is not None and (mask.dtype != torch.bool or list(mask.shape[-2:]) != [t, start + t]):
            raise WireError(f"mask must be bool [..., {t}, {start + t}], got {mask.dtype} {list(mask.shape)}")
        if start < 0:
            raise WireError("start must be >= 0")

    def commit(self, session: str, step: int, kept: list[int], dest: int) -> None:
        self._apply(session, step, self._stage().commit, session, kept, dest)

    def fork(self, session: str, step: int, child: str, prefix_len: int, capacity: int) -> None:
        self._check_capacity(capacity)
        self._apply(session, step, self._stage().fork, session, child, prefix_len, capacity)
        self.steps.setdefault(child, 0)  # the child's own steps start at 1, and in order (see ready)

    def release(self, session: str) -> None:
        if self.stage is not None:
            self.stage.release(session)
        self.steps.pop(session, None)
        self.last_output.pop(session, None)
        if self.last_batch is not None and self.last_batch[0][0] == session:
            self.last_batch = None
