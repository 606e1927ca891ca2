"""Fuzzing a worker's protocol in-process on the tiny model: its JSON routes with arbitrary and near-valid bodies,
its HeadSplit reshape body, and the frames of its links (workers/frames.py: arbitrary bytes, near-valid headers
of the layer ops and HeadSplit's, safetensors bodies with arbitrary names, dtypes, shapes, metadata and bytes).
Whatever arrives, the worker answers 2xx or a 4xx OpenAI-style error object (on a link: an ack, a result, or an
error frame below 500), never a 5xx, and the session it was serving before still computes.

Link frames go straight to the worker's Relay on the app's own event loop, through a stand-in for the
WebSocket; routes name no next stage (no network). Examples are bounded and derandomized, as in
tests/test_fuzz_api.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from inprocess import LoopClient, assert_error_object, on_link
from safetensors.torch import save as st_save

from edgespec.workers.app import create_worker_app
from edgespec.workers.frames import pack
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.wire import BatchMessage, decode, encode, encode_batch

TOKEN = "fuzz-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HIDDEN = 64  # the tiny model's hidden size
HEADS = {"groups": {"0": [0, 1], "1": [0]}, "ffns": [0, 1], "dtype": "float32"}  # blocks of the tiny model
# every block of the tiny model's 4 layers, and a placement that gathers them all here (a run with no peers)
PLACED = {"groups": {str(i): [0, 1] for i in range(4)}, "ffns": [0, 1, 2, 3], "dtype": "float32", "name": "solo",
          "placement": [{"groups": {"solo": [0, 1]}, "proj": "solo", "ffn": "solo", "speculate": i > 0}
                        for i in range(4)]}
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def worker(tiny):
    # a call whose earlier steps never come waits downstream_timeout_s for them: keep that short here
    settings = WorkerSettings(port=0, token=TOKEN, model=tiny, memory_budget_gib=0.25, downstream_timeout_s=0.05)
    client = LoopClient(create_worker_app(settings), headers=AUTH)
    assert client.post("/assign", json={"first": 0, "last": 2, "dtype": "float32"}).status_code == 200
    yield client, tiny
    client.close()


def check(r: httpx.Response, where) -> None:
    event(f"status {r.status_code}")
    assert r.status_code < 500, (where, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert_error_object(r, repr(where)[:300])


def check_frames(sent: list[tuple[dict, bytes]], where) -> None:
    for header, _ in sent:
        event(f"{header['op']} {header.get('status', '')}")
        if header["op"] == "error" or (header["op"] == "ack" and not header.get("ok")):
            assert 400 <= header["status"] < 500 and header["message"] and header["code"], (where, header)
        else:
            assert header["op"] in ("ack", "result", "pong", "kv"), (where, header)  # kv: after a release


def still_serves(client: LoopClient) -> None:
    """A session opened now computes: nothing a fuzz case sent broke the worker."""
    sent = on_link(client, pack({"op": "release", "session": "canary"}),
                   pack({"op": "open", "id": 1, "session": "canary", "step": 1, "capacity": 8}),
                   pack({"op": "forward", "session": "canary", "step": 2, "start": 0, "reply": "fuzz"},
                        encode({"hidden": torch.randn(1, 2, HIDDEN)})))
    assert [h["op"] for h, _ in sent] == ["kv", "ack", "result"] and sent[1][0]["ok"], sent  # kv: the release's


json_value = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)
small = st.one_of(st.integers(-2, 40), st.sampled_from([2**31, 2**62, 2**63, 2**64]), json_value)
sid = st.one_of(st.sampled_from(["s1", "s2", "canary", "x" * 129, "../info", "\u00e9"]),
                st.text(min_size=1, max_size=8))
ROUTES = {  # route -> near-valid bodies (arbitrary JSON as well)
    ("POST", "/assign"): st.fixed_dictionaries({}, optional={"first": small, "last": small, "dtype": st.sampled_from(
        ["float32", "q8_0", "nope", ""]), "model": st.sampled_from(["/nonexistent", "a\u0000b", ""]),
        "away": st.dictionaries(st.integers(-1, 5).map(str), st.dictionaries(st.text(max_size=8),
                                                                             st.lists(small, max_size=3))),
        "hosted": st.dictionaries(st.integers(-1, 5).map(str), st.lists(small, max_size=3), max_size=2)}),
    ("POST", "/heads/assign"): st.fixed_dictionaries({}, optional={
        "groups": st.dictionaries(st.integers(-1, 5).map(str), st.lists(small, max_size=3), max_size=2),
        "ffns": st.lists(small, max_size=2), "dtype": st.just("float32"), "name": st.text(max_size=4),
        "placement": st.lists(json_value, max_size=2),
        "peers": st.dictionaries(st.text(max_size=3), st.text(max_size=8))}),
    ("POST", "/heads/export"): st.fixed_dictionaries({}, optional={"groups": json_value}),
    ("POST", "/heads/placement"): st.lists(json_value, max_size=2),
    ("POST", "/probe/link"): st.fixed_dictionaries({"target": st.sampled_from(  # none reachable: no network
        ["http://[", "ftp://x", "", "no-scheme", "http://", "http://a b"])}, optional={"reps": small}),
    ("GET", "/info"): st.none(),
    ("GET", "/heads/memory"): st.none(),
}


@given(route=st.sampled_from(sorted(ROUTES)), data=st.data(), raw=st.booleans(), ready=st.booleans())
@FUZZ
def test_json_routes_answer_4xx_error_objects(worker, route, data, raw, ready):
    client, _ = worker
    method, path = route
    if ready:  # the blocks a /heads call acts on, else whatever earlier examples left
        assert client.post("/heads/assign", json=HEADS).status_code == 200
    body = data.draw(json_value if raw else ROUTES[route])
    content = json.dumps(body, allow_nan=True) if method == "POST" else None  # NaN and Infinity too
    r = client.request(method, path, content=content, headers={"content-type": "application/json"})
    check(r, (method, path, body))


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.int8, torch.float64]
dims = st.tuples(st.lists(st.integers(0, 4), max_size=3), st.booleans()).map(  # the last may be the hidden size
    lambda t: [*t[0], HIDDEN] if t[1] else t[0])
tensor = st.tuples(st.sampled_from(DTYPES), dims).map(lambda t: torch.zeros(t[1], dtype=t[0]))
tensors = st.dictionaries(st.sampled_from(["hidden", "positions", "mask", "x", "z", "mask.0", "junk"]), tensor,
                          max_size=3)
metadata = st.one_of(st.none(), st.dictionaries(st.sampled_from(["entries", "x"]), st.one_of(
    st.text(max_size=20), json_value.map(lambda v: json.dumps(v))), max_size=2))


def valid_tensors(op: str, rows: int) -> dict[str, torch.Tensor]:
    """A well-formed message for `op` of `rows` rows at positions 0.. (its header may still not fit it)."""
    if op == "ffn":
        return {"z": torch.randn(1, rows, HIDDEN)}
    return {"hidden": torch.randn(1, rows, HIDDEN)}


@st.composite
def binary_body(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["tensors", "valid", "valid", "bytes", "truncated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    rows = draw(st.integers(1, 3))
    if path in ("batch", "attend", "run") and kind != "tensors":  # a batch message: a step's sessions' rows
        entries = draw(st.one_of(st.just([["s1", 0, rows, 2]]), st.lists(st.tuples(
            st.sampled_from(["s1", "s2", "canary", ""]), small, small, small).map(list), max_size=3)))
        return st_save({"hidden": torch.randn(rows, HIDDEN), "positions": torch.arange(rows)},
                       metadata={"entries": json.dumps(entries)})
    chosen = valid_tensors(path, rows) if kind == "valid" else draw(tensors)
    body = st_save({k: v.contiguous() for k, v in chosen.items()}, metadata=draw(metadata))
    return body[:draw(st.integers(0, len(body)))] if kind == "truncated" else body


@given(data=st.data(), blocks=st.one_of(st.none(), json_value.map(lambda v: json.dumps(v))), ready=st.booleans())
@FUZZ
def test_reshape_bodies_answer_4xx_error_objects(worker, data, blocks, ready):
    client, _ = worker
    body = data.draw(binary_body("reshape"))
    if ready:  # the blocks the call acts on, else whatever earlier examples left
        assert client.post("/heads/assign", json=HEADS).status_code == 200
    headers = {"content-type": "application/octet-stream"}
    if blocks is not None:
        headers["x-blocks"] = blocks
    r = client.post("/heads/reshape", content=body, headers=headers)
    check(r, (headers, body[:80]))


OPS = ["forward", "batch", "open", "commit", "fork", "release", "ping", "hello", "result", "ack", "kv", "nope",
       "head_open", "head_fork", "head_commit", "head_release", "attend", "ffn", "run", "experts"]
field = st.one_of(small, sid)
route = st.lists(st.sampled_from(["http://[", "ftp://x", "", "no-scheme", "http://", 5]), max_size=2)


@given(op=st.sampled_from(OPS), data=st.data(), session=st.sampled_from(["s1", "s2", "canary"]), raw=st.booleans(),
       ready=st.booleans())
@FUZZ
def test_link_frames_answer_4xx_error_frames(worker, op, data, session, raw, ready):
    client, _ = worker
    frames = [pack({"op": "release", "session": session}),
              pack({"op": "open", "id": 0, "session": session, "step": 1, "capacity": 16})] if ready else []
    if raw:  # anything at all as a frame: a header that is not one, bytes after it
        frame = data.draw(st.one_of(st.binary(max_size=64), st.builds(
            lambda head, tail: len(head).to_bytes(4, "little") + head + tail,
            json_value.map(lambda v: json.dumps(v).encode()), st.binary(max_size=16))))
    else:  # a header of the right op with near-valid or arbitrary fields, a body for the op
        header = data.draw(st.fixed_dictionaries({"op": st.just(op)}, optional={
            "session": st.one_of(st.just(session), sid, small), "step": field, "start": field, "id": field,
            "capacity": field, "kept": st.lists(field, max_size=3), "dest": field, "child": field,
            "prefix_len": field, "layers": st.lists(field, max_size=3), "route": route, "hops": json_value,
            "controller": field, "reply": st.sampled_from(["fuzz", "nobody"])}) | st.just(
            {"op": op, "id": 2, "session": session, "step": 2, "start": 0, "reply": "fuzz"}))  # near-valid
        frame = pack(header, data.draw(binary_body(op)))
    sent = on_link(client, *frames, frame)
    check_frames(sent, frame[:200])


HEAD_OPS = ["head_open", "head_fork", "head_commit", "head_release", "attend", "ffn", "run"]
number = st.one_of(small, st.floats(allow_nan=True), st.sampled_from([0.0, 0.1, 1e9]))


@given(op=st.sampled_from(HEAD_OPS), data=st.data(), session=st.sampled_from(["s1", "s2", "canary"]),
       ready=st.sampled_from([None, "blocks", "placed"]))
@FUZZ
def test_head_frames_answer_4xx_error_frames(worker, op, data, session, ready):
    """HeadSplit's link calls with near-valid fields and bodies: an ack, ok or a 4xx refusal, whatever arrives;
    with every block here and a placement that gathers them, a run computes (it calls no peer)."""
    client, _ = worker
    frames = []
    if ready is not None:  # the blocks and the session the call acts on, else whatever earlier examples left
        assert client.post("/heads/assign", json=PLACED if ready == "placed" else HEADS).status_code == 200
        frames.append(pack({"op": "head_open", "id": 0, "session": session, "capacity": 16}))
    header = data.draw(st.fixed_dictionaries({"op": st.just(op), "id": st.integers(1, 9)}, optional={
        "session": st.one_of(st.just(session), sid, small), "step": field, "start": field, "layer": field,
        "capacity": field, "epsilons": st.one_of(st.lists(number, max_size=3), number), "child": field,
        "prefix_len": field, "kept": st.lists(field, max_size=3), "dest": field}) | st.just(
        {"op": op, "id": 1, "session": session, "step": 1, "start": 0, "layer": 0, "epsilons": [0.1],
         "child": "c", "prefix_len": 0, "capacity": 8, "kept": [0], "dest": 0}))  # near-valid
    frame = pack(header, data.draw(binary_body(op)))
    sent = on_link(client, *frames, frame)
    check_frames(sent, frame[:200])
    # answered on the link it came on, by id (a release by its KV figures)
    assert all(h["op"] == ("kv" if op == "head_release" else "ack") for h, _ in sent[len(frames):]), sent


def test_a_run_gathered_here_computes(worker):
    """The fuzz cases' valid run: every layer here, so it answers with the last layer's output and counts."""
    client, _ = worker
    assert client.post("/heads/assign", json=PLACED).status_code == 200
    body = encode_batch(BatchMessage([("r", 0, 1, 1)], torch.randn(1, HIDDEN), torch.tensor([0]), [None]))
    run = {"op": "run", "id": 2, "layer": 0, "epsilons": [0.0]}
    sent = on_link(client, pack({"op": "head_open", "id": 1, "session": "r", "capacity": 8}), pack(run, body))
    (opened, _), (ran, out) = sent
    assert opened["ok"] and ran["ok"] and ran["id"] == 2 and ran["next"] == 4 and ran["wire"] == [0, 0], ran
    assert len(ran["kept"]) == len(ran["discarded"]) == 1 and len(ran["kept"][0]) == 4
    assert decode(out, ("x",))["x"].shape == (1, HIDDEN)


def test_capacities_past_the_context_are_refused(worker):
    """Found by fuzzing: a HeadSplit session of 2**31 slots was a 500 (its cache's size overflowed)."""
    client, _ = worker
    assert client.post("/heads/assign", json=HEADS).status_code == 200
    for capacity in (513, 2**31, 2**62 - 1):
        (ack, _), = on_link(client, pack({"op": "head_open", "id": 1, "session": "big", "capacity": capacity}))
        assert ack["status"] == 400 and "context" in ack["message"], ack
        (ack, _), = on_link(client, pack({"op": "open", "id": 1, "session": "big", "step": 1, "capacity": capacity}))
        assert ack["status"] == 400 and "context" in ack["message"], ack


def test_fuzzed_worker_still_serves(worker):
    """After the fuzz cases above (whatever they did to the sessions and the assignment), a re-assigned worker
    computes a new session."""
    client, _ = worker
    assert client.post("/assign", json={"first": 0, "last": 2, "dtype": "float32"}).status_code == 200
    still_serves(client)
