"""HeadSplit's per-step calls on a worker's links (workers/relay.py): the ops a controller or a projection worker
sends, and the projection worker's own calls to its peers over the links it keeps to them.

    head_open    {id, session, capacity}                                        -> ack {kv}
    head_fork    {id, session, child, prefix_len, capacity, step}               -> ack {kv}
    head_commit  {id, session, kept, dest, step}                                -> ack {kv}
    head_release {session}                                                      -> a frame {op: kv, kv}
    attend       {id, layer}                  a batch message (workers/wire.py) -> ack {out [n_groups, M, H]}
    ffn          {id, layer}                  safetensors {z [1, M, H]}         -> ack {x}
    run          {id, layer, epsilons}        a batch message        -> ack {next, kept, discarded, wire} {x [M, H]}:
                 layers L.. while this worker is their projection device, calling its peers (named in the HTTP
                 assignment) for their groups and FFNs; kept and discarded per session and layer
    experts      {id, layer}   safetensors {rows [m, H], chosen, weights [m, k]}  -> ack {out [n, H]}: a mixture's
                 experts this worker holds of another's layer (StageHost.shelf), the weighted outputs of the slots
                 that chose them (model/expert_split.py); a layer pipeline's stage calls it mid-pass

A batch message carries the rows of every session the step runs, each session's (session, start, length, step)
and mask, so that sessions sharing a step share each call; `epsilons` is each session's tolerance. The session
operations' acks, and a release's frame, carry this worker's KV figures (workers/kv_report.py).

Every call is answered on the link it came on by an ack with its id: ok and the answer's fields with its
tensors as the body, or the refusal's status, code and message (workers/errors.py; a peer's refusal keeps its
status, so a full budget anywhere is a 507). Exactly-once is the step numbers', as over HTTP before: an attend
older than the last step a device saw is refused (409, HeadBlocks.attend_rows), so a late call cannot overwrite
slots written since; a call of the same step again recomputes the same bits, ffn is stateless, and a fork or
commit of the step last applied is a retry, answered without applying it again, so any call may be sent again
after a reconnection. A peer link that closes fails the calls waiting on it at once (502), as
a controller's does (workers/uplink.py).

attend and ffn compute inline on the event loop's thread, as the layer ops do; a run waits on its peers, so it
runs on a thread of its own and the loop stays free to answer them and to carry its calls to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import torch
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection

from edgespec.model.head_blocks import StepRows
from edgespec.workers.frames import pack
from edgespec.workers.head_client import LinkHeads
from edgespec.workers.head_routes import HeadHost
from edgespec.workers.host import StageHost
from edgespec.workers.relay import Relay, count, nonneg, session_id, ws_url
from edgespec.workers.settings import WorkerSettings
from edgespec.workers.wire import BatchMessage, WireError, decode, decode_batch, encode

HEAD_OPS = {"head_open", "head_fork", "head_commit", "head_release", "attend", "ffn", "run"}
EXPERTS = "experts"


class PeerRefusal(Exception):
    """A peer's refused call: its status and code, passed on to whoever called this worker."""

    def __init__(self, url: str, ack: dict):
        super().__init__(f"{url}: {str(ack.get('message', 'refused'))[:500]}")
        status = ack.get("status")
        self.status = status if isinstance(status, int) and 400 <= status < 600 else 502
        self.code = str(ack.get("code") or "next_stage_failed")[:64]


def hidden(t: torch.Tensor, name: str, hidden_size: int) -> torch.Tensor:
    if t.dim() != 3 or t.shape[-1] != hidden_size or not t.is_floating_point():
        raise WireError(f"{name} must be float [B, T, {hidden_size}], got {t.dtype} {list(t.shape)}")
    return t


class HeadRelay(Relay):
    """A worker's links with HeadSplit's ops as well as the layer pipeline's; `heads` is the worker's HeadHost,
    its peers reached over this relay's links."""

    def __init__(self, host: StageHost, settings: WorkerSettings):
        super().__init__(host, settings)
        self.heads = HeadHost(settings.model, self.peer, int(settings.memory_budget_gib * 2**30))
        self.ids = itertools.count(1)
        self.calls: dict[int, list] = {}  # id -> [the peer link it went on (None while sending), its future]

    # inbound

    async def handle(self, ws: WebSocket, peer: str, header: dict, body: bytes) -> None:
        op = header["op"]
        if op == EXPERTS:  # computed inline: it waits on nothing
            ack = {"op": "ack", "id": header.get("id")}
            try:
                out = self.host.expert_partials(count(header, "layer"), body)
            except Exception as exc:
                await self._send(ws, peer, pack(ack | self._error(exc)))
                return
            await self._send(ws, peer, pack(ack | {"ok": True}, out))
            return
        if op not in HEAD_OPS:
            await super().handle(ws, peer, header, body)
            return
        if op == "head_release":  # no ack: the caches' figures after it, for the controller's /metrics
            if self.heads.blocks is not None:
                with contextlib.suppress(ValueError):  # no answer to refuse with: the session is not there
                    self.heads.blocks.release(session_id(header.get("session")))
            await self._send(ws, peer, pack({"op": "kv", **self.heads.kv_report().fields()}))
            return
        ack = {"op": "ack", "id": header.get("id")}
        try:
            fields, out = await self.call(op, header, body)
        except Exception as exc:
            await self._send(ws, peer, pack(ack | self._error(exc)))
            return
        await self._send(ws, peer, pack(ack | {"ok": True} | fields, out))

    async def call(self, op: str, h: dict, body: bytes) -> tuple[dict, bytes]:
        """Apply one HeadSplit call -> (the ack's fields, its body)."""
        held = self.heads.held()
        if op in ("head_open", "head_fork"):
            capacity = count(h, "capacity")
            if not 1 <= capacity <= held.cfg.max_position_embeddings:  # a cache past the context could only overflow
                raise ValueError(f"capacity {capacity} must be from 1 to the model's context of "
                                 f"{held.cfg.max_position_embeddings}")
            if op == "head_open":
                held.open(session_id(h.get("session")), capacity)
            else:
                held.fork(session_id(h.get("session")), session_id(h.get("child")), count(h, "prefix_len"), capacity,
                          count(h, "step"))
            return self.heads.kv_report().fields(), b""
        if op == "head_commit":
            kept = h.get("kept")
            if not isinstance(kept, list) or len(kept) > 2**16:
                raise ValueError("kept must be a list of slots")
            held.commit(session_id(h.get("session")), [nonneg(k, "a kept slot") for k in kept], count(h, "dest"),
                        count(h, "step"))
            return self.heads.kv_report().fields(), b""
        if op == "ffn":
            z = hidden(decode(body, ("z",))["z"], "z", held.cfg.hidden_size)
            return {}, encode({"x": held.feed_forward(count(h, "layer"), z)})
        layer = count(h, "layer")
        message = self.batch_input(body)
        rows = [StepRows(s, start, length, mask, step)
                for (s, start, length, step), mask in zip(message.entries, message.masks, strict=True)]
        if op == "attend":
            return {}, encode({"out": held.attend_rows(layer, message.hidden, message.positions, rows)})
        if layer >= held.cfg.n_layers:
            raise ValueError(f"layer {layer} is outside the model's {held.cfg.n_layers} layers")
        epsilons = h.get("epsilons")
        if not isinstance(epsilons, list) or len(epsilons) != len(rows) or not all(
                e is None or (isinstance(e, int | float) and not isinstance(e, bool) and e >= 0) for e in epsilons):
            raise ValueError("epsilons must be a number >= 0 (or null: no speculation) for each session of the batch")
        out, fields = await asyncio.to_thread(self.heads.run, rows, [None if e is None else float(e) for e in epsilons],
                                              layer, message.hidden, message.positions)
        return fields, encode({"x": out})

    def batch_input(self, body: bytes) -> BatchMessage:
        """The batch message of an attend or run call, checked: rows [M, H] of the model's width, positions in
        its context, each session's mask (workers/wire.py's decode_batch)."""
        cfg = self.heads.held().cfg
        message = decode_batch(body)
        if message.hidden.shape[1] != cfg.hidden_size:
            raise WireError(f"the rows must be [M, {cfg.hidden_size}], got {list(message.hidden.shape)}")
        positions = message.positions
        if not 0 <= int(positions.min()) <= int(positions.max()) < cfg.max_position_embeddings:
            raise WireError("positions are outside the model's context")
        return message

    def _error(self, exc: Exception) -> dict:
        if isinstance(exc, PeerRefusal):
            return {"status": exc.status, "code": exc.code, "message": f"stage {self.host.name}: {exc}"}
        return super()._error(exc)

    # outbound: this worker's calls to its peers, while it runs the schedule

    def peer(self, name: str, url: str) -> LinkHeads:
        """A device proxy of the peer `name` at `url`, for the schedule's thread (HeadHost.run): each call goes
        out on this relay's link to the peer, from the event loop this is made on."""
        loop = asyncio.get_running_loop()
        return LinkHeads(name, lambda header, body: asyncio.run_coroutine_threadsafe(
            self.call_peer(url, header, body), loop))

    def expert_links(self) -> PeerExperts:
        """The workers holding experts of this worker's layers, for its passes (on a thread of their own: Relay
        forward), each call sent on this relay's link to the worker, from the event loop this is made on."""
        loop = asyncio.get_running_loop()
        return PeerExperts(lambda url, header, body: asyncio.run_coroutine_threadsafe(
            self.call_peer(url, header, body), loop))

    async def call_peer(self, base_url: str, header: dict, body: bytes) -> tuple[dict, bytes]:
        """Send a call to a peer and wait for its ack -> (header, body); PeerRefusal for its refusal,
        ConnectionError when the link closes first or no answer comes within the downstream timeout."""
        mid = next(self.ids)
        waiting = self.calls[mid] = [None, asyncio.get_running_loop().create_future()]
        try:
            link = await self.send_peer(base_url, pack({**header, "id": mid}, body))
            waiting[0] = link
            if self.peers.get(ws_url(base_url)) is not link and not waiting[1].done():
                raise ConnectionError(f"the link to {base_url} closed")  # before its reader could fail the call
            try:
                answer, out = await asyncio.wait_for(waiting[1], self.settings.downstream_timeout_s)
            except TimeoutError:
                raise ConnectionError(f"{base_url} did not answer a {header['op']} call within "
                                      f"{self.settings.downstream_timeout_s:.0f} s") from None
        finally:
            del self.calls[mid]
        if not answer.get("ok"):
            raise PeerRefusal(base_url, answer)
        return answer, out

    def on_peer_frame(self, url: str, header: dict, body: bytes) -> None:
        mid = header.get("id")
        waiting = self.calls.get(mid) if header["op"] == "ack" and isinstance(mid, int) else None
        if waiting is None:
            super().on_peer_frame(url, header, body)
        elif not waiting[1].done():
            waiting[1].set_result((header, body))

    def on_peer_closed(self, url: str, link: ClientConnection) -> None:
        for sent_on, future in self.calls.values():
            if sent_on is link and not future.done():
                future.set_exception(ConnectionError(f"the link to {url} closed"))


class ExpertAnswer:
    """A started `experts` call (model/expert_split.py's ExpertCall)."""

    def __init__(self, pending):
        self.pending = pending

    def result(self) -> torch.Tensor:
        _, body = self.pending.result()
        return decode(body, ("out",))["out"]


class PeerExperts:
    """ExpertLinks over a worker's links: `send(url, header, body)` sends a call to the worker at `url` and returns
    what waits for its ack."""

    def __init__(self, send):
        self.send = send

    def start(self, device: str, layer: int, rows: torch.Tensor, chosen: torch.Tensor,
              weights: torch.Tensor) -> ExpertAnswer:
        body = encode({"rows": rows.float().contiguous(), "chosen": chosen.contiguous(),
                       "weights": weights.contiguous()})
        return ExpertAnswer(self.send(device, {"op": EXPERTS, "layer": layer}, body))
