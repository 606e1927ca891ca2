"""Security basics: API keys (a list, from flags, the environment and a file), the cluster token on workers and on
the controller's /internal routes (compared in constant time), a worker's /health without the token, and the
bounds on bodies and request heads. In-process on the tiny model, except the last case (the real server)."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from inprocess import LoopClient, assert_error_object, controller_app

from edgespec.server.cli import build_parser, serve_settings
from edgespec.server.http_limits import MAX_HEADERS, uvicorn_http_options
from edgespec.workers import auth
from edgespec.workers.app import create_worker_app
from edgespec.workers.auth import proof_ok
from edgespec.workers.settings import WorkerSettings

TOKEN = "cluster-secret"


@pytest.fixture
def compared(monkeypatch) -> list[tuple[bytes, bytes]]:
    """Every pair workers/auth.py compares (through hmac.compare_digest, which takes constant time)."""
    pairs = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        pairs.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    return pairs


def test_bearer_checks_compare_every_key_in_constant_time(compared):
    keys = ("k1", "a-much-longer-second-key")
    assert auth.any_bearer_ok("Bearer k1", keys) and auth.any_bearer_ok("bearer  a-much-longer-second-key ", keys)
    assert len(compared) == 4  # the second key is compared even after the first matched
    assert {len(a) for pair in compared for a in pair} == {32}  # digests: the time tells nothing of lengths
    for header in (None, "", "Bearer", "Bearer k2", "Basic k1", "k1", "Bearer k1x"):
        assert not auth.any_bearer_ok(header, keys), header
    assert not auth.any_bearer_ok("Bearer ", ()) and not auth.bearer_ok("Bearer \u00e9", TOKEN)


def test_api_keys_from_flags_environment_and_a_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\n\n  file-key-1  \nfile-key-2\n#old-key\n")
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b, c", "--api-key-file", str(keys)])
    assert serve_settings(args).api_keys() == ("a", "b", "c", "file-key-1", "file-key-2")
    monkeypatch.setenv("EDGESPEC_API_KEY", "env-1,env-2")
    assert serve_settings(build_parser().parse_args(["serve"])).api_keys() == ("env-1", "env-2")
    monkeypatch.delenv("EDGESPEC_API_KEY")
    assert serve_settings(build_parser().parse_args(["serve"])).api_keys() == ()  # no key: /v1 is open
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    for path in (tmp_path / "missing", empty):
        with pytest.raises(ValueError, match=r"API key file|holds no API key"):
            serve_settings(build_parser().parse_args(["serve", "--api-key-file", str(path)]))


@pytest.fixture(scope="module")
def controller(tiny, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text("from-file\n")
    app, service = controller_app(tiny, api_key=["first,second"], api_key_file=str(keys), served_model_name="tiny",
                                  max_request_bytes=2**16)
    client = LoopClient(app)
    yield client, service
    client.close()
    service.engine.close()


def test_every_api_key_opens_the_v1_routes_and_nothing_else_does(controller, compared):
    client, _ = controller
    for key in ("first", "second", "from-file"):
        assert client.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200, key
    assert len(compared) == 9  # three keys, each compared on each request
    for headers in ({}, {"authorization": "Bearer third"}, {"authorization": "first"}):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []}, headers=headers)
        assert r.status_code == 401 and assert_error_object(r)["code"] == "invalid_api_key"
    assert client.get("/health").status_code == 200  # for load balancers: no key needed


def test_internal_routes_need_the_cluster_token(controller, compared, monkeypatch):
    client, service = controller
    assert client.get("/internal/cluster/plan", headers={"authorization": "Bearer anything"}).status_code == 401
    joined = []
    cluster = SimpleNamespace(config=SimpleNamespace(token=TOKEN), plan=SimpleNamespace(to_dict=lambda: {"n": 1}),
                              request_join=lambda url, name: joined.append((url, name)))
    monkeypatch.setattr(service, "cluster", cluster)
    good = {"authorization": f"Bearer {TOKEN}"}
    compared.clear()
    assert client.get("/internal/cluster/plan", headers=good).json() == {"n": 1}
    assert compared  # in constant time
    for headers in ({}, {"authorization": "Bearer first"}, {"authorization": f"Bearer {TOKEN}x"}):
        r = client.post("/internal/cluster/join", json={"url": "http://w", "name": "w"}, headers=headers)
        assert r.status_code == 401 and assert_error_object(r)["code"] == "invalid_cluster_token"
    assert client.post("/internal/cluster/join", json={"url": "http://w", "name": "w"}, headers=good).status_code == 202
    assert joined == [("http://w", "w")]
    # a join body is bounded like any other
    big = json.dumps({"url": "http://w", "name": "x" * 2**17})
    r = client.post("/internal/cluster/join", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and assert_error_object(r)["code"] == "body_too_large"


@pytest.fixture(scope="module")
def worker(tiny):
    app = create_worker_app(WorkerSettings(port=0, token=TOKEN, model=tiny, name="w-solo", max_body_bytes=2**16))
    client = LoopClient(app)
    yield client
    client.close()


def test_worker_health_says_only_ok_without_the_token(worker):
    r = worker.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    details = worker.get("/health", headers={"authorization": f"Bearer {TOKEN}"}).json()
    info = worker.get("/info", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert details == {"status": "ok", "name": "w-solo", "instance": info["instance"], "assigned": False}
    r = worker.get("/health", headers={"authorization": "Bearer wrong"})  # a misconfigured controller learns it
    assert r.status_code == 401 and assert_error_object(r)["code"] == "invalid_cluster_token"


def test_worker_refuses_before_reading_bodies(worker):
    oversized = b"{" + b" " * 2**17 + b"}"
    for path in ("/assign", "/heads/assign", "/probe/link", "/heads/reshape", "/nope"):
        r = worker.post(path, content=oversized, headers={"content-type": "application/json"})
        assert r.status_code == 401, (path, r.text)  # the token first: no body is parsed for a stranger
        r = worker.post(path, content=oversized, headers={"content-type": "application/json",
                                                          "authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 413 and assert_error_object(r)["code"] == "body_too_large", (path, r.text)


def test_worker_counts_a_body_without_content_length(worker):
    async def chunks():  # no Content-Length: the size is only known as the body arrives (3 x 32 KiB, over 64 KiB)
        for _ in range(3):
            yield b" " * 2**15

    r = worker.post("/assign", content=chunks(), headers={"content-type": "application/json",
                                                          "authorization": f"Bearer {TOKEN}"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and assert_error_object(r)["code"] == "body_too_large", r.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bounded_server(tiny):
    """A worker app (no layers loaded) behind uvicorn with heads bounded to 4 KiB, as `edgespec worker` runs."""
    port = _free_port()
    app = create_worker_app(WorkerSettings(port=port, token=TOKEN, model=tiny))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           **uvicorn_http_options(4096)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


def raw_exchange(port: int, *parts: bytes) -> bytes:
    """Send parts (each its own write) on one connection; everything answered until it closes or goes idle."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for part in parts:
            try:
                s.sendall(part)
            except OSError:  # the server answered and closed before reading the rest
                break
            time.sleep(0.01)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), raw[:300]
    return int(head.split()[1]), json.loads(body)["error"]


def test_request_heads_are_bounded(bounded_server):
    port = bounded_server
    ok = raw_exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b'{"status":"ok"}')
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    long_one = b"x-big: " + b"a" * 5000 + b"\r\n"
    for head in (many, long_one):
        status, err = error_of(raw_exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n" + head + b"\r\n"))
        assert status == 431 and err["code"] == "headers_too_large"
    # a head trickling in across many reads is counted as it arrives
    pieces = [b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: "] + [b"a" * 1000] * 6 + [b"\r\n\r\n"]
    status, _ = error_of(raw_exchange(port, *pieces))
    assert status == 431
    status, err = error_of(raw_exchange(port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and err["code"] == "invalid_http"


def test_large_bodies_on_one_connection_are_not_mistaken_for_heads(bounded_server):
    body = json.dumps({"first": 0, "last": 1, "dtype": "nope", "model": "x" * 60000}).encode()

    def request(last: bool) -> bytes:
        return (b"POST /assign HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: Bearer "
                + TOKEN.encode() + (b"\r\nconnection: close" if last else b"")
                + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    raw = raw_exchange(bounded_server, request(False), request(True))
    assert raw.count(b"HTTP/1.1 400") == 2 and b"431" not in raw  # both answered by the app (a bad dtype)


@pytest.mark.slow
def test_the_real_server_refuses_oversized_heads(server_url):
    r = httpx.get(server_url + "/v1/models", headers={"authorization": "Bearer test-key", "x-big": "a" * 2**16})
    assert r.status_code == 431 and assert_error_object(r)["code"] == "headers_too_large"
    r = httpx.get(server_url + "/v1/models", headers={"authorization": "Bearer test-key", "x-fine": "a" * 2**12})
    assert r.status_code == 200


def test_a_worker_proves_the_token_to_a_challenge_without_sending_it(worker):
    challenge = "c" * 32
    body = worker.get("/health", params={"challenge": challenge}).json()
    assert proof_ok(TOKEN, challenge, body["proof"]) and not proof_ok("another", challenge, body["proof"])
    assert TOKEN not in json.dumps(body)
    short = worker.get("/health", params={"challenge": "c"}).json()  # too short to be a challenge: liveness only
    assert short == {"status": "ok"}
