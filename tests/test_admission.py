"""Admission by KV budget (engine/admission.py): a request whose cache does not fit waits for another to release
its cache and then decodes exactly as alone; a full queue or a wait that runs out is refused with
QueueFullError (the API's 503 with Retry-After), and a request that could never fit is refused at once."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import httpx
import pytest
from test_prefill import stages

from edgespec.engine.admission import Admission, QueueFullError
from edgespec.engine.engine import Engine
from edgespec.engine.program import Job, Rows
from edgespec.model.config import ModelConfig
from edgespec.model.kv_pool import CapacityError


@pytest.fixture
def one_cache(tiny_loaded):
    """engine(admission): an engine over the tiny executor on stages with room for one 280-slot cache, no
    prefix cache, that queue."""
    executor = tiny_loaded.executor
    original, cuts = executor.pipeline, executor.cuts
    slot = ModelConfig.from_folder(tiny_loaded.files.folder).kv_bytes_per_token()
    executor.replace(stages(tiny_loaded.files.folder, [], budget=400 * slot), cuts)
    try:
        yield lambda admission: Engine(executor, admission=admission)
    finally:
        executor.replace(original, cuts)


PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 3, 7]]
# reserves 5 blocks of 64 slots of the 6: one such cache fits, two do not
CAPACITY = 280


async def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    out = []

    def program(seq):
        o = yield Rows(prompt, last_only=True)
        out.append(int(o.logits[0, -1].argmax()))
        while len(out) < n:
            o = yield Rows([out[-1]])
            out.append(int(o.logits[0, -1].argmax()))

    async for _ in engine.run(Job(CAPACITY, program)):
        pass
    return out


def holding(seq):
    """A program that holds its open session until its consumer leaves."""
    yield "open"


def test_a_request_that_does_not_fit_waits_for_room_then_decodes_as_alone(one_cache):
    engine = one_cache(Admission(max_waiting=4, timeout_s=60))
    alone = [asyncio.run(greedy(engine, p, 6)) for p in PROMPTS]

    async def both():
        return await asyncio.gather(*(greedy(engine, p, 6) for p in PROMPTS))

    together = asyncio.run(both())
    assert together == alone
    assert (engine.admission.admitted, engine.admission.waiting, engine.admission.refused) == (1, 0, 0)
    assert engine.admission.waited_s > 0 and not engine.sessions.held


def test_a_full_queue_and_a_wait_that_runs_out_are_refused(one_cache, tiny_loaded):
    async def second_while_first_holds(engine: Engine):
        async with aclosing(engine.run(Job(CAPACITY, holding))) as first:
            assert await anext(first) == "open"  # the first holds its cache
            with pytest.raises(QueueFullError) as info:
                async for _ in engine.run(Job(CAPACITY, holding)):
                    pass
            return str(info.value)

    engine = one_cache(Admission(max_waiting=0))
    assert "already wait" in asyncio.run(second_while_first_holds(engine))
    engine = one_cache(Admission(max_waiting=4, timeout_s=0.05))
    assert "within 0.05 s" in asyncio.run(second_while_first_holds(engine))
    assert (engine.admission.waiting, engine.admission.refused, engine.admission.admitted) == (0, 1, 0)
    assert not engine.sessions.held and tiny_loaded.executor.kv_bytes() == 0  # nothing left behind


def test_a_request_that_could_never_fit_is_refused_at_once(one_cache, tiny_loaded):
    engine = one_cache(Admission(max_waiting=4, timeout_s=60))
    executor = tiny_loaded.executor
    slot = ModelConfig.from_folder(tiny_loaded.files.folder).kv_bytes_per_token()
    executor.replace(stages(tiny_loaded.files.folder, [], budget=100 * slot), executor.cuts)  # the fixture's
    # teardown puts the original back

    async def run():
        async for _ in engine.run(Job(10_000, holding)):  # its blocks are over the budget with nothing else open
            pass

    with pytest.raises(CapacityError) as info:
        asyncio.run(run())
    assert not isinstance(info.value, QueueFullError) and engine.admission.waiting == 0


def test_the_api_answers_a_full_queue_with_503_and_retry_after(tiny, tmp_path):
    from processes import model_id, start_server

    slot = ModelConfig.from_folder(tiny).kv_bytes_per_token()
    proc, url = start_server(tmp_path, "busy", "--model", tiny, "--kv-cache-gib", str(300 * slot / 2**30),
                             "--kv-format", "float32", "--max-waiting", "0", "--prefix-cache-mib", "0")
    try:
        body = {"model": model_id(url), "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                "max_tokens": 200, "min_tokens": 200}  # over 150 slots reserved: one such cache fits, two do not
        with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=120) as first:
            lines = first.iter_lines()
            assert first.status_code == 200 and next(lines).startswith("data: ")  # the first holds its cache
            busy = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "5"
            assert busy.json()["error"]["code"] == "server_busy"
            assert [x for x in lines if x][-1] == "data: [DONE]"
        later = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert later.status_code == 200 and later.json()["usage"]["completion_tokens"] == 200
        metrics = httpx.get(url + "/metrics").text
        assert "edgespec_queue_refused 1.0" in metrics and "edgespec_sequences_waiting 0.0" in metrics
    finally:
        proc.stop()


def test_release_all_frees_every_session_even_under_a_cancelled_scope(tiny_loaded):
    """A streamed response whose client left is cancelled by an anyio cancel scope, which cancels every await
    of a `finally` again: outline's points released one await after another kept all but the first (a leak
    the soak found). release_all frees them all in one task."""
    import anyio

    engine = Engine(tiny_loaded.executor)
    held = engine.sessions.held

    async def main() -> set[str]:
        sessions = [await engine.sessions.open(16, None) for _ in range(4)]
        with anyio.CancelScope() as scope:
            scope.cancel()
            await engine.sessions.release_all(sessions)
        for _ in range(200):  # the release runs on to its end in its own task
            if not {s.id for s in sessions} & held:
                break
            await asyncio.sleep(0.01)
        return {s.id for s in sessions} & held

    assert anyio.run(main) == set()
