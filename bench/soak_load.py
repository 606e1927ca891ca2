"""The soak's traffic (bench/soak.py): a random mix of OpenAI requests, each sent and classified.

Every request drawn by `Mix.draw` is one of the API's shapes a real client sends: plain chat, chat with Home
Assistant's tools, structured output (json_schema), /v1/completions, /v1/responses (with tools or not), a long
prompt (1-2k tokens), embeddings; each with a random decoding policy (among those that accept it), streamed or
not, greedy or sampled, and, streamed, sometimes abandoned after a few chunks (the client closes the
connection). `send` returns one record per request: its HTTP status, the error code the server gave (in the
body or in a streamed error event), and how it ended, so that the soak can count what a client saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from edgespec.bench.prompts import load_prompts
from edgespec.bench.tools import load_data

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
PROMPT_FILES = ("vicuna80.jsonl", "wizardlm_testset.jsonl", "alpaca_seed_tasks.jsonl")

# The mix: (kind, weight). Chat dominates as it does in use; embeddings are occasional.
KINDS = (("chat", 0.28), ("tools", 0.16), ("json", 0.10), ("completions", 0.14), ("responses", 0.14),
         ("long", 0.12), ("embeddings", 0.06))
# Outline writes its own skeleton and refuses a grammar (a documented 400), so requests with tools or a
# response format draw among the others.
GRAMMAR_POLICIES = ("naive", "speculative", "medusa", "auto")
DOCUMENTED_503 = ("server_busy", "kv_cache_full")
ROUTES = {"chat": "/v1/chat/completions", "tools": "/v1/chat/completions", "json": "/v1/chat/completions",
          "long": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
          "embeddings": "/v1/embeddings"}


@dataclass
class Request:
    """One request to send: its route and body, and when (if streamed) the client walks away."""

    kind: str
    route: str
    body: dict
    policy: str | None = None
    disconnect_after: int | None = None  # close the stream after this many chunks (None: read to the end)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Mix:
    """What requests are drawn from: the shared prompt sets, Home Assistant's shapes, and the settings."""

    model: str
    policies: tuple[str, ...]
    max_tokens: tuple[int, int] = (16, 96)
    disconnect_p: float = 0.2
    long_tokens: tuple[int, int] = (1000, 2000)
    chars_per_token: float = 4.0  # measured by the soak's warm-up (the usage of one long prompt)
    prompts: list[str] = field(default_factory=list)
    corpus: str = ""
    ha: dict = field(default_factory=dict)

    @classmethod
    def load(cls, model: str, policies: tuple[str, ...], **settings) -> Mix:
        prompts = [p for name in PROMPT_FILES for p in load_prompts(DATA / name)]
        return cls(model, policies, prompts=prompts, corpus="\n\n".join(prompts), ha=load_data(), **settings)

    def long_text(self, rng: random.Random, tokens: int, doc: int | None = None) -> str:
        """About `tokens` tokens of the shared prompts, from a random place; doc 0..2 names one of three fixed
        documents instead, so that some long prompts share their prefix (the prefix cache is exercised)."""
        chars = int(tokens * self.chars_per_token)
        room = max(1, len(self.corpus) - chars)
        start = doc * room // 3 if doc is not None else rng.randrange(room)
        return self.corpus[start:start + chars]

    def draw(self, rng: random.Random) -> Request:
        kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
        return self.build(kind, rng)

    def build(self, kind: str, rng: random.Random, stream: bool | None = None) -> Request:
        """A request of `kind` with random settings (`stream` forces streaming on or off)."""
        stream = rng.random() < 0.5 if stream is None else stream
        grammar = kind in ("tools", "json") or (kind == "responses" and rng.random() < 0.4)
        choices = [p for p in self.policies if p in GRAMMAR_POLICIES] if grammar else list(self.policies)
        policy = rng.choice(choices)
        sampling: dict = {"temperature": 0} if rng.random() < 0.5 else {"temperature": round(rng.uniform(0.5, 1.2), 2)}
        if sampling["temperature"] and rng.random() < 0.3:
            sampling["seed"] = rng.randrange(2**31)
        limit = rng.randint(*self.max_tokens)
        ha = self.ha
        body: dict = {"model": self.model, "decoding": policy, **sampling}
        if kind == "embeddings":
            texts = [rng.choice(self.prompts)[:600] for _ in range(rng.randint(1, 4))]
            return Request(kind, ROUTES[kind], {"model": self.model, "input": texts if len(texts) > 1 else texts[0],
                                                "encoding_format": rng.choice(["float", "base64"])})
        if kind == "completions":
            body |= {"prompt": rng.choice(self.prompts), "max_tokens": limit}
        elif kind == "responses":
            text = rng.choice([c["prompt"] for c in ha["commands"]] if grammar else self.prompts)
            body |= {"input": text, "max_output_tokens": limit}
            if grammar:  # Home Assistant's tools in the Responses API's flat shape
                body |= {"instructions": ha["system"], "tools": [{"type": "function", **t["function"]}
                                                                 for t in ha["tools"]]}
        else:
            messages = [{"role": "user", "content": rng.choice(self.prompts)}]
            if kind == "tools":
                prompt = rng.choice([c["prompt"] for c in ha["commands"]] + ha["chitchat"])
                messages = [{"role": "system", "content": ha["system"]}, {"role": "user", "content": prompt}]
                body |= {"tools": ha["tools"], "tool_choice": rng.choice(["auto", "auto", "required"])}
            elif kind == "json":
                messages = [{"role": "user", "content": rng.choice(ha["structured"]["prompts"])}]
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "answer", "strict": True, "schema": ha["structured"]["schema"]}}
            elif kind == "long":
                doc = rng.choice([0, 1, 2, None, None])
                text = self.long_text(rng, rng.randint(*self.long_tokens), doc)
                question = rng.choice(["Summarize the text above in one sentence.",
                                       "List three topics the text above mentions.", "What is the text above about?"])
                messages = [{"role": "user", "content": f"{text}\n\n{question}"}]
            body |= {"messages": messages, "max_tokens": limit}
        if stream:
            body["stream"] = True
            if kind != "responses":
                body["stream_options"] = {"include_usage": True}
        disconnect = rng.randint(1, 8) if stream and rng.random() < self.disconnect_p else None
        return Request(kind, ROUTES[kind], body, policy, disconnect)


def new_record(req: Request, t0: float) -> dict:
    return {"kind": req.kind, "route": req.route, "policy": req.policy, "stream": req.stream,
            "t_start": round(time.monotonic() - t0, 3), "t_end": None, "status": None, "code": None,
            "outcome": None, "detail": None, "finish_reason": None, "chunks": 0, "prompt_tokens": None,
            "completion_tokens": None, "retry_after": None, "disconnect_after": req.disconnect_after}


async def send(client: httpx.AsyncClient, req: Request, t0: float) -> dict:
    """Send `req` and classify what came back. outcome: ok (a whole answer), disconnected (the client left on
    purpose), busy (a documented 503 with its code), or error (anything else: another status, a streamed error
    event, a stream cut short, a malformed body, a timeout, a broken connection)."""
    rec = new_record(req, t0)
    try:
        if req.stream:
            async with client.stream("POST", req.route, json=req.body) as r:
                rec["status"] = r.status_code
                if r.status_code == 200:
                    await _read_stream(r, req, rec)
                else:
                    await r.aread()
                    _refused(r, rec)
        else:
            r = await client.post(req.route, json=req.body)
            rec["status"] = r.status_code
            if r.status_code == 200:
                _read_body(r.json(), req, rec)
            else:
                _refused(r, rec)
    except httpx.TimeoutException as exc:
        _fail(rec, "client_timeout", f"{type(exc).__name__} after {time.monotonic() - t0 - rec['t_start']:.0f} s")
    except httpx.HTTPError as exc:
        _fail(rec, "connection_error", f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # a body or event that is not what the API says
        _fail(rec, "malformed_response", f"{type(exc).__name__}: {exc}")
    rec["t_end"] = round(time.monotonic() - t0, 3)
    return rec


def _fail(rec: dict, code: str, detail: str) -> None:
    rec.update(outcome="error", code=code, detail=detail[:300])


def _refused(r: httpx.Response, rec: dict) -> None:
    try:
        error = r.json()["error"]
        code, message = error.get("code") or error.get("type"), error.get("message", "")
    except (ValueError, KeyError, TypeError):
        code, message = "not_an_error_object", r.text
    rec["retry_after"] = r.headers.get("retry-after")
    # a documented 503: server_busy with its Retry-After (README), or kv_cache_full
    documented = r.status_code == 503 and code in DOCUMENTED_503 and (code != "server_busy" or rec["retry_after"])
    rec.update(outcome="busy" if documented else "error", code=code, detail=str(message)[:300])


def _usage(rec: dict, usage: dict | None) -> None:
    if usage:
        rec["prompt_tokens"] = usage.get("prompt_tokens", usage.get("input_tokens"))
        rec["completion_tokens"] = usage.get("completion_tokens", usage.get("output_tokens"))


def _read_body(body: dict, req: Request, rec: dict) -> None:
    """A whole (non-streamed) answer: its shape checked, its finish and usage recorded."""
    if req.kind == "embeddings":
        inputs = req.body["input"]
        if len(body["data"]) != (len(inputs) if isinstance(inputs, list) else 1):
            raise ValueError(f"{len(body['data'])} embeddings for {inputs!r}")
    elif req.kind == "responses":
        if body["status"] not in ("completed", "incomplete"):
            raise ValueError(f"response status {body['status']!r}")
        rec["finish_reason"] = body["status"]
    else:
        rec["finish_reason"] = body["choices"][0]["finish_reason"]
    _usage(rec, body.get("usage"))
    rec["outcome"] = "ok"


async def _read_stream(r: httpx.Response, req: Request, rec: dict) -> None:
    """An SSE answer read to its end (or to the chunk where the client walks away)."""
    ended = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue  # `event:` lines (the data repeats the type), pings, blank separators
        data = line[6:]
        if data == "[DONE]":
            ended = True
            break
        event = json.loads(data)
        rec["chunks"] += 1
        if ended:  # the Responses stream goes on after its last event
            _fail(rec, "event_after_the_end", f"{event.get('type')} after the stream's final event")
            return
        if req.kind == "responses":
            kind = event["type"]
            if kind in ("response.failed", "error"):
                error = (event.get("response") or {}).get("error") or event.get("error") or event
                _fail(rec, error.get("code") or kind, f"streamed {kind}: {error.get('message', '')}")
                return
            if kind in ("response.completed", "response.incomplete"):
                rec["finish_reason"] = event["response"]["status"]
                _usage(rec, event["response"].get("usage"))
                ended = True  # and read on to the end of the body, as the OpenAI SDK does
                continue
        else:
            if "error" in event:
                error = event["error"]
                _fail(rec, error.get("code") or error.get("type") or "stream_error",
                      f"streamed error: {error.get('message', '')}")
                return
            for choice in event.get("choices") or []:
                rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
            _usage(rec, event.get("usage"))
        if req.disconnect_after is not None and rec["chunks"] >= req.disconnect_after:
            rec["outcome"] = "disconnected"  # leaving the `async with` closes the connection mid-stream
            return
    if not ended:
        _fail(rec, "stream_cut_short", f"the stream ended after {rec['chunks']} events without its last one")
        return
    if req.kind != "responses" and rec["finish_reason"] is None:
        _fail(rec, "no_finish_reason", "the stream ended [DONE] without a finish_reason")
        return
    rec["outcome"] = "ok"


async def stream_loop(url: str, mix: Mix, rng: random.Random, stop_at: float, t0: float, timeout_s: float,
                      records: list[dict]) -> None:
    """One client: request after request until `stop_at` (time.monotonic), each record appended as it ends.
    After a documented 503 it waits as Retry-After asks (at most 5 s), as a polite client would."""
    await asyncio.sleep(rng.uniform(0, 2))  # not all at the same instant
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s, connect=30)) as client:
        while time.monotonic() < stop_at:
            rec = await send(client, mix.draw(rng), t0)
            records.append(rec)
            if rec["outcome"] == "busy":
                try:
                    wait = float(rec["retry_after"] or 1)
                except ValueError:
                    wait = 1.0
                await asyncio.sleep(min(5.0, wait))
            elif rec["code"] == "connection_error":
                await asyncio.sleep(1.0)  # a server that went away is not hammered
