"""The Ollama API (ollama/ollama's docs/api.md) on the same service, engine and policies as the OpenAI routes: chat
and generate go through CompletionService.chat_request / generation_request and stream its deltas as NDJSON;
embeddings through CompletionService.embeddings. Errors are Ollama's {"error": "..."} (server/errors.py answers
every error under /api/ so). No tensor code here.

Bodies are read as JSON whatever their Content-Type, as Ollama's server reads them (`curl -d` sends a form type).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from edgespec.decoding.types import GenerationRequest
from edgespec.server.chat_input import ChatInput
from edgespec.server.errors import APIError, validation_error
from edgespec.server.ollama_model import ServedModel
from edgespec.server.ollama_protocol import (
    InferenceFields,
    ModelRequest,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    response_format,
)
from edgespec.server.ollama_render import NDJSON, OllamaRenderer, Timings, clock, load_answer, ndjson
from edgespec.server.protocol import EmbeddingRequest
from edgespec.server.reasoning import ThinkBlock
from edgespec.server.service import CompletionService
from edgespec.server.streaming import collect, dumps, started
from edgespec.server.tool_output import AnswerReader

# The Ollama release whose API these routes answer (think, tool_name, format schemas, ...), for clients that ask
OLLAMA_VERSION = "0.9.6"
RUNNING = "Ollama is running"  # what Ollama answers at /, which clients probe
BODY = TypeVar("BODY", bound=BaseModel)
INFERENCE = TypeVar("INFERENCE", bound=InferenceFields)
Rendered = tuple[list[int], ThinkBlock | None]


async def parse(request: Request, model: type[BODY]) -> BODY:
    """The body as `model`, read as JSON whatever the Content-Type; a 400 for no body, bad JSON or a bad field."""
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "missing request body")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error([dict(e) for e in exc.errors()]) from None


def unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def ollama_router(service: CompletionService, require_key: Callable[[Request], Awaitable[None]]) -> APIRouter:
    """Ollama's routes for `service`: /, /api/version without a key (they tell nothing but that this is an Ollama
    API), everything else behind the OpenAI routes' keys (README, Security). Not in the OpenAPI schema, whose
    error objects are OpenAI's."""
    loaded = service.loaded
    served = ServedModel.of(service.model_id, loaded.files, loaded.cfg, service.settings.dtype,
                            service.template.thinks, getattr(service.tokenizer, "chat_template", None) or "")
    router = APIRouter(include_in_schema=False)
    api = APIRouter(dependencies=[Depends(require_key)])
    # `serve --ollama-options`: a request's unset options take these (checked here, at start) before Ollama's
    defaults = OllamaOptions.model_validate(service.settings.ollama_options).model_dump(exclude_none=True)

    def with_defaults(req: INFERENCE) -> INFERENCE:
        given = req.options.model_dump(exclude_none=True)
        return req.model_copy(update={"options": OllamaOptions.model_validate({**defaults, **given})})

    def check(name: str) -> None:
        if not name:
            raise APIError(400, "model is required")
        if not served.accepts(name):
            raise APIError(404, f"model '{name}' not found; this server serves '{served.listed}'", "model",
                           "model_not_found")

    def thinking(req: InferenceFields) -> tuple[bool, dict[str, Any]]:
        """(whether the answer's thinking is shown, the template's arguments). Ollama's rules: a model that thinks
        does by default; `think` on a model that does not is a 400 naming it; `think: false` switches it off
        (Qwen3's enable_thinking). A level ("low" ...) is taken as true: there is no level to set here."""
        if req.think is None:
            return service.template.thinks, {}
        wanted = req.think is not False
        if wanted and not service.template.thinks:
            raise APIError(400, f"{json.dumps(req.model)} does not support thinking", "think")
        if not service.template.thinks:
            return False, {}
        return wanted, {} if wanted else {"enable_thinking": False}

    def fit(chat: ChatInput, window: int, truncate: bool) -> tuple[ChatInput, Rendered]:
        """The chat and its prompt within `window` tokens, leaving room for one token at least. Ollama's rule
        (server/prompt.go): drop the oldest messages but the system ones, always keeping the last; with
        `truncate: false`, or when the last message alone does not fit, a 400. The dropping is a binary search
        over where the kept messages start: a few renders, however long the history."""
        def from_(start: int) -> tuple[ChatInput, Rendered]:
            kept = tuple(m for m in chat.messages[:start] if m.role == "system") + chat.messages[start:]
            cut = replace(chat, messages=kept)
            return cut, service.chat_prompt(cut)

        best = from_(0)
        if len(best[1][0]) < window:
            return best
        tokens = len(best[1][0])
        lo, hi = 1, len(chat.messages) - 1  # the last message is always kept
        found = None
        while truncate and lo <= hi:
            mid = (lo + hi) // 2
            candidate = from_(mid)
            if len(candidate[1][0]) < window:
                found, hi = candidate, mid - 1
            else:
                lo = mid + 1
        if found is not None:
            return found
        raise APIError(400, f"the prompt takes {tokens} tokens: it leaves no room for an answer in the context "
                            f"window of {window} tokens (options.num_ctx, at most the model's {service.context})"
                       + ("" if truncate else "; truncate: false keeps every message"), "messages",
                       "context_length_exceeded")

    def budget(req: InferenceFields, window: int, prompt_tokens: int) -> int:
        room = window - prompt_tokens
        if room <= 0:
            raise APIError(400, f"the prompt takes {prompt_tokens} tokens: it leaves no room for an answer in the "
                                f"context window of {window} tokens", "prompt", "context_length_exceeded")
        wanted = req.options.max_tokens()
        return room if wanted is None else min(wanted, room)

    def embedding_request(texts: list[str]) -> EmbeddingRequest:
        return EmbeddingRequest.model_validate({"model": service.model_id, "input": texts})

    async def answer(gen: GenerationRequest, reader: AnswerReader, renderer: OllamaRenderer, stream: bool,
                     request: Request) -> Response:
        renderer.timings.submitted = clock()
        deltas = await started(service.deltas(gen, reader))  # a request that cannot start gets its status code
        renderer.timings.first = clock()
        if stream:
            return StreamingResponse(ndjson(deltas, renderer), media_type=NDJSON)
        collected = await collect(deltas, request)
        if collected is None:
            return Response(status_code=499)  # nobody is listening: the generation stopped
        return JSONResponse(renderer.whole(collected))

    @router.api_route("/", methods=["GET", "HEAD"])
    async def running():
        return PlainTextResponse(RUNNING)

    @router.api_route("/api/version", methods=["GET", "HEAD"])
    async def version():
        return {"version": OLLAMA_VERSION}

    @api.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags():
        return {"models": [served.tag()]}

    @api.get("/api/ps")
    async def ps():
        return {"models": [served.running(service.engine.executor.kv_bytes())]}

    @api.post("/api/show")
    async def show(request: Request):
        req = await parse(request, ModelRequest)
        check(req.named)
        return served.show()

    @api.post("/api/pull")
    async def pull(request: Request):
        """Nothing is downloaded: the served model answers success, in Ollama's statuses; any other name a 404
        naming what is served."""
        req = await parse(request, ModelRequest)
        if not req.named:
            raise APIError(400, "model is required")
        if not served.accepts(req.named):
            raise APIError(404, f"pull model manifest: file does not exist: this server downloads no models; it "
                                f"serves '{served.listed}' only", "model", "model_not_found")
        if not req.stream:
            return {"status": "success"}

        def statuses() -> Iterator[str]:
            yield from (dumps({"status": s}) + "\n" for s in ("pulling manifest", "success"))

        return StreamingResponse(statuses(), media_type=NDJSON)

    def refuse(verb: str) -> Callable[[], Awaitable[None]]:
        async def refused() -> None:
            # 403: the request is understood and well formed, and this server will not do it, whatever the body
            raise APIError(403, f"edgespec serves one model, chosen when it starts ('{served.listed}'); it does not "
                                f"{verb}", None, "unsupported")
        return refused

    api.add_api_route("/api/create", refuse("create models"), methods=["POST"])
    api.add_api_route("/api/copy", refuse("copy models"), methods=["POST"])
    api.add_api_route("/api/delete", refuse("delete models"), methods=["DELETE"])
    api.add_api_route("/api/push", refuse("push models"), methods=["POST"])
    api.add_api_route("/api/blobs/{digest}", refuse("store model blobs"), methods=["POST", "HEAD"])

    @api.post("/api/chat")
    async def chat(request: Request):
        timings = Timings()
        req = with_defaults(await parse(request, OllamaChatRequest))
        check(req.model)
        if not req.messages:
            return load_answer("chat", req.model)
        show_thinking, template_kwargs = thinking(req)
        window = req.options.window(service.context)
        chat, rendered = fit(req.chat_input(template_kwargs), window, req.truncate)
        gen, reader = await service.chat_request(req.sampling(), chat, budget(req, window, len(rendered[0])),
                                                 rendered=rendered)
        renderer = OllamaRenderer("chat", req.model, len(gen.prompt_ids), timings, show_thinking)
        return await answer(gen, reader, renderer, req.stream, request)

    @api.post("/api/generate")
    async def generate(request: Request):
        timings = Timings()
        req = with_defaults(await parse(request, OllamaGenerateRequest))
        check(req.model)
        if not req.prompt:
            return load_answer("generate", req.model)
        window = req.options.window(service.context)
        if req.raw:  # the prompt as sent, the answer read as plain text; no context returned (Ollama's raw)
            prompt = service.text_prompt(req.prompt)
            fmt = response_format(req.format)
            grammar = (await service.structure(ChatInput((), response_format=fmt)))[0] if fmt else None
            gen = service.generation_request(req.sampling(), prompt, budget(req, window, len(prompt)), False, 0,
                                             "prompt", grammar)
            renderer = OllamaRenderer("generate", req.model, len(prompt), timings)
            return await answer(gen, service.reader(), renderer, req.stream, request)
        show_thinking, template_kwargs = thinking(req)
        chat = req.chat_input(template_kwargs)
        ids, think_block = service.chat_prompt(chat)
        if req.context:  # an earlier answer's context goes before the prompt, as Ollama puts its text there
            vocab = loaded.cfg.vocab_size
            if any(not 0 <= t < vocab for t in req.context):
                raise APIError(400, f"context token ids must be in [0, {vocab})", "context")
            ids = list(req.context) + ids
        gen, reader = await service.chat_request(req.sampling(), chat, budget(req, window, len(ids)),
                                                 rendered=(ids, think_block))
        renderer = OllamaRenderer("generate", req.model, len(ids), timings, show_thinking, prompt_ids=ids,
                                  encode=lambda text: service.tokenizer.encode(text, add_special_tokens=False))
        return await answer(gen, reader, renderer, req.stream, request)

    @api.post("/api/embed")
    async def embed(request: Request):
        timings = Timings()
        req = await parse(request, OllamaEmbedRequest)
        check(req.model)
        texts = req.inputs()
        if not texts:
            return {"model": req.model, "embeddings": []}
        hidden = loaded.cfg.hidden_size
        if req.dimensions and req.dimensions > hidden:
            raise APIError(400, f"this model's embeddings have {hidden} dimensions, fewer than {req.dimensions}",
                           "dimensions")
        timings.submitted = clock()
        vectors, tokens = await service.embeddings(embedding_request(texts), req.options.window(service.context),
                                                   req.truncate)
        if req.dimensions and req.dimensions < hidden:  # Ollama's: the first dimensions, back to unit length
            vectors = [unit(v[:req.dimensions]) for v in vectors]
        durations = timings.durations()
        return {"model": req.model, "embeddings": vectors, "total_duration": durations["total_duration"],
                "load_duration": durations["load_duration"], "prompt_eval_count": tokens}

    @api.post("/api/embeddings")
    async def embeddings(request: Request):
        req = await parse(request, OllamaEmbeddingsRequest)
        check(req.model)
        if not req.prompt:
            return {"embedding": []}
        vectors, _ = await service.embeddings(embedding_request([req.prompt]), req.options.window(service.context),
                                              truncate=True)
        return {"embedding": vectors[0]}

    router.include_router(api)
    return router
