"""Admission by KV budget (model/admission.py): a request whose cache does not fit waits for another to release
its cache and then decodes exactly as alone; a full queue or a wait that runs out is refused with
QueueFullError (the API's 503 with Retry-After), and a request that could never fit is refused at once."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from test_prefill import stages

from edgespec.model.admission import Admission, QueueFullError
from edgespec.model.config import ModelConfig
from edgespec.model.kv_pool import CapacityError


@pytest.fixture
def one_cache(tiny_loaded):
    """The tiny runner over stages with room for one 280-slot cache, no prefix cache, a fresh queue."""
    runner = tiny_loaded.runner
    saved = runner.pipeline, runner.prefix, runner.admission
    slot = ModelConfig.from_folder(tiny_loaded.files.folder).kv_bytes_per_token()
    runner.pipeline = stages(tiny_loaded.files.folder, [], budget=400 * slot)
    runner.prefix = None
    try:
        yield runner
    finally:
        runner.pipeline, runner.prefix, runner.admission = saved


PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 3, 7]]


async def greedy(runner, prompt: list[int], n: int) -> list[int]:
    session = await runner.open(280)  # reserves 5 blocks of 64 slots of the 6: one such cache fits, two do not
    try:
        logits = await runner.forward(session, torch.tensor([prompt]), last_only=True)
        out = [int(logits[0, -1].argmax())]
        for _ in range(n - 1):
            logits = await runner.forward(session, torch.tensor([[out[-1]]]))
            out.append(int(logits[0, -1].argmax()))
        return out
    finally:
        await runner.release(session)


def test_a_request_that_does_not_fit_waits_for_room_then_decodes_as_alone(one_cache):
    runner = one_cache
    runner.admission = Admission(max_waiting=4, timeout_s=60)
    alone = [asyncio.run(greedy(runner, p, 6)) for p in PROMPTS]

    async def both():
        return await asyncio.gather(*(greedy(runner, p, 6) for p in PROMPTS))

    together = asyncio.run(both())
    assert together == alone
    assert (runner.admission.admitted, runner.admission.waiting, runner.admission.refused) == (1, 0, 0)
    assert runner.admission.waited_s > 0 and not runner.held


def test_a_full_queue_and_a_wait_that_runs_out_are_refused(one_cache):
    runner = one_cache

    async def second_while_first_holds(admission: Admission):
        runner.admission = admission
        first = await runner.open(280)
        try:
            with pytest.raises(QueueFullError) as info:
                await runner.open(280)
            return str(info.value)
        finally:
            await runner.release(first)

    assert "already wait" in asyncio.run(second_while_first_holds(Admission(max_waiting=0)))
    assert "within 0.05 s" in asyncio.run(second_while_first_holds(Admission(max_waiting=4, timeout_s=0.05)))
    assert (runner.admission.waiting, runner.admission.refused, runner.admission.admitted) == (0, 1, 0)
    assert not runner.held and runner.pipeline.kv_bytes() == 0  # nothing left behind


def test_a_request_that_could_never_fit_is_refused_at_once(one_cache, tiny_loaded):
    runner = one_cache
    runner.admission = Admission(max_waiting=4, timeout_s=60)
    slot = ModelConfig.from_folder(tiny_loaded.files.folder).kv_bytes_per_token()
    runner.pipeline = stages(tiny_loaded.files.folder, [], budget=100 * slot)
    with pytest.raises(CapacityError) as info:
        asyncio.run(runner.open(10_000))  # its blocks are over the budget with nothing else open
    assert not isinstance(info.value, QueueFullError) and runner.admission.waiting == 0


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

    runner = tiny_loaded.runner

    async def main() -> set[str]:
        sessions = [await runner.open(16) for _ in range(4)]
        with anyio.CancelScope() as scope:
            scope.cancel()
            await runner.release_all(sessions)
        for _ in range(200):  # the release runs on to its end in its own task
            if not {s.id for s in sessions} & runner.held:
                break
            await asyncio.sleep(0.01)
        return {s.id for s in sessions} & runner.held

    assert anyio.run(main) == set()
