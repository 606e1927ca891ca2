"""One message on a link: a small JSON header and the tensors' bytes, in one WebSocket binary frame.

    [u32 little-endian: header length][header: UTF-8 JSON object][body: a wire.py tensor message, or nothing]

The header says what the message is (`op`) and everything a stage needs besides tensors: the session or the
batch's entries, the step, the start slot, the rest of the route, the controller to answer, and the per-stage
figures gathered on the way. The body is the same safetensors message an HTTP forward call carried, so the
tensor checks of workers/wire.py apply unchanged.

Ops, by direction:
    controller -> worker:  hello, open, commit, fork, release, forward, batch, ping;
                           HeadSplit: head_open, head_fork, head_commit, head_release, attend, ffn, run
    worker -> worker:      forward, batch (relayed along `route`), ping; HeadSplit: attend, ffn (a projection
                           worker's calls to its peers)
    worker -> controller:  ack (answers open, commit, fork), result (the last stage's output), error, pong,
                           kv (the worker's KV figures after a release or head_release: workers/kv_report.py)
    answers on the link a call came on: ack (answers head_open, head_fork, head_commit, attend, ffn, run, with
                           their tensors as body)

A HeadSplit call carries an `id`, and its ack the same id: ok and the answer's fields, or the refusal's status,
code and message (workers/head_relay.py).
"""

from __future__ import annotations

import json
import struct

MAX_HEADER = 64 * 2**10  # a batch header lists its entries: 1024 of them fit well within this
OPS = {"hello", "open", "commit", "fork", "release", "forward", "batch", "result", "error", "ack", "ping", "pong",
       "kv", "head_open", "head_fork", "head_commit", "head_release", "attend", "ffn", "run", "experts"}


class FrameError(ValueError):
    """A message that is not a well-formed frame; the text says what is wrong."""


def pack(header: dict, body: bytes = b"") -> bytes:
    """A frame of this header and body."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<I", len(head)) + head + body


def unpack(data: bytes | bytearray | memoryview | str) -> tuple[dict, bytes]:
    """(header, body) of a frame, checked: a JSON object with a known `op`, within MAX_HEADER bytes (a websocket's
    text message is refused like any malformed frame)."""
    if not isinstance(data, bytes | bytearray | memoryview) or len(data) < 4:
        raise FrameError("a frame is a binary message of at least 4 bytes")
    (n,) = struct.unpack_from("<I", data)
    if n > MAX_HEADER or 4 + n > len(data):
        raise FrameError(f"a frame's header length {n} exceeds {min(MAX_HEADER, len(data) - 4)} bytes")
    try:
        header = json.loads(bytes(data[4:4 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"a frame's header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("op") not in OPS:
        raise FrameError(f"a frame's header must be an object with an op among {sorted(OPS)}")
    return header, bytes(data[4 + n:])
