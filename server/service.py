"""The completion service: OpenAI requests in, TokenEvents or ChatDeltas (and embeddings) out. No tensor code:
token ids, text and grammars."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from contextlib import aclosing, asynccontextmanager

from edgespec.decoding.decide import Route, Trigger
from edgespec.decoding.embedding import embed
from edgespec.decoding.grammar import Grammar, GrammarError, Grammars
from edgespec.decoding.policy import DecodingPolicy, UnknownPolicyError, select_policy
from edgespec.decoding.types import GenerationRequest, SamplingParams, TokenEvent
from edgespec.engine.admission import QueueFullError
from edgespec.engine.engine import Engine
from edgespec.engine.executor import SessionLostError
from edgespec.model.kv_pool import CapacityError
from edgespec.model.load import LoadedModel
from edgespec.model.stage import StageFailure
from edgespec.server import structured
from edgespec.server.chat_input import ChatDelta, ChatInput
from edgespec.server.errors import APIError
from edgespec.server.home_context import grounded, listed_entities, mention
from edgespec.server.metrics import Metrics
from edgespec.server.protocol import CompletionRequest, EmbeddingRequest, SamplingFields
from edgespec.server.reasoning import ThinkBlock, ThinkSplitter, think_block
from edgespec.server.replanner import ClusterManager
from edgespec.server.settings import ServeSettings
from edgespec.server.tool_output import AnswerReader, call_extractor
from edgespec.server.tool_prompt import ChatTemplate
from edgespec.server.tool_route import ToolRouter

RETRY_AFTER_S = 5  # what a 503 of a full admission queue suggests: about one answer's time here
MIN_TEMPERATURE = 1e-5  # vLLM's bound too: below it a temperature is greedy in all but exact ties
MIN_TOP_P = 1e-6


class CompletionService:
    """Validates requests against the served model and runs them through a decoding policy."""

    def __init__(self, loaded: LoadedModel, engine: Engine, policies: dict[str, DecodingPolicy],
                 settings: ServeSettings, metrics: Metrics, cluster: ClusterManager | None = None):
        self.loaded, self.engine = loaded, engine
        self.cluster = cluster  # when the layers live on workers
        self.tokenizer = loaded.tokenizer
        self.policies = policies
        self.settings = settings
        self.metrics = metrics
        self.model_id = settings.served_model_name or loaded.files.name
        self.context = loaded.cfg.max_position_embeddings
        eos = set(loaded.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stop_token_ids = frozenset(eos)
        self.template = ChatTemplate(self.tokenizer)  # probed once: the model's own tool format, or the polyfill
        self.router = ToolRouter()
        self.grammars = Grammars(self.tokenizer, loaded.cfg.vocab_size)
        if settings.policy not in policies:
            raise UnknownPolicyError(settings.policy, sorted(policies))

    def check_model(self, name: str) -> None:
        if name != self.model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           "model", "model_not_found")

    def chat_prompt(self, chat: ChatInput) -> tuple[list[int], ThinkBlock | None]:
        """The prompt's token ids, and the answer's thinking block when the model thinks (server/reasoning.py)."""
        try:
            text = self.template.render(chat)
        except Exception as exc:  # a template may reject an order of roles
            raise APIError(400, f"the messages do not fit the model's chat template: {exc}", "messages") from exc
        thinking = think_block(self.tokenizer, text) if self.template.thinks else None
        return self.tokenizer.encode(text, add_special_tokens=False), thinking

    async def structure(self, chat: ChatInput, thinking: ThinkBlock | None = None
                        ) -> tuple[Grammar | None, Trigger | None, Route | None]:
        """The grammar the answer must match (tools, response format; after the thinking block, if any); for
        tool_choice auto, the trigger whose score decides whether the answer is a call; with several tools, the
        route that decides which tool a call opens with (decoding/decide.py). APIError 400 naming the parameter
        at fault."""
        # the parameters as the request named them: the legacy fields are functions and function_call
        names = {"tools": "functions", "tool_choice": "function_call"} if chat.legacy_functions else {}
        # the home the system prompt lists and what the last user message names in it (server/home_context.py):
        # the grammar holds the tools grounded in it, and the route reads it
        request = next((m.content for m in reversed(chat.messages) if m.role == "user" and m.content), None)
        home = listed_entities([m.content for m in chat.messages if m.role == "system" and m.content]
                               ) if chat.calls_allowed else ()
        named = mention(request or "", home)
        try:
            plan = structured.plan(dataclasses.replace(chat, tools=tuple(grounded(t, home, named) for t in chat.tools)),
                                   self.template.syntax, thinking)
        except structured.GrammarError as exc:
            raise APIError(400, str(exc), names.get(exc.param, exc.param), "invalid_value") from exc
        if plan is None:
            return None, None, None
        param = names.get("tools", "tools") if chat.calls_allowed else "response_format"
        def compiled(lark: str | None) -> Grammar | None:
            return self.grammars.compile(lark) if lark else None

        route_plan = self.router.plan(chat, request, named) if plan.routes and request else None
        routes = [plan.routes[i] for i in route_plan.candidates] if route_plan else []
        # on a thread: the first grammar builds the vocabulary's byte strings (1.5 s for SmolLM2); a route's
        # grammar is never empty (structured.py)
        try:
            grammar, forced, routed = await asyncio.to_thread(lambda: (
                compiled(plan.grammar), compiled(plan.forced), [self.grammars.compile(g) for _, g in routes]))
        except GrammarError as exc:
            raise APIError(400, f"the {param} schema cannot be used for generation: {exc}", param,
                           "invalid_value") from exc
        trigger = None
        if forced is not None and plan.trigger is not None:  # structured.py plans the two together
            trigger = Trigger(self._encode(plan.trigger), self.settings.tool_call_threshold, forced)
        route = None
        if route_plan is not None:  # the candidates among the tools, in the tools' order
            chosen = route_plan.candidates
            contexts = self.template.channel_contexts(tuple(chat.tools[i] for i in chosen),
                                                      tuple(route_plan.notes[i] for i in chosen))
            route = Route(tuple(n for n, _ in routes), tuple(self._encode(c) for c in contexts),
                          self._encode(self.template.channel_baseline()), self._encode(route_plan.request),
                          route_plan.overlap, tuple(routed), route_plan.figures)
        return grammar, trigger, route

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def reader(self, chat: ChatInput | None = None, thinking: ThinkBlock | None = None) -> AnswerReader:
        """What turns an answer's text into thinking, content and calls (a text completion: content only)."""
        enabled = chat is not None and chat.calls_allowed
        calls = call_extractor(self.template.syntax, enabled, legacy=chat is not None and chat.legacy_functions)
        return AnswerReader(calls, ThinkSplitter(thinking.opened) if thinking else None)

    def text_prompt(self, text: str) -> list[int]:
        """A text completion's prompt as the model reads it (with the tokenizer's own BOS, where it adds one)."""
        return self.tokenizer.encode(text)

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt_given()
        if isinstance(prompt, str):
            return self.text_prompt(prompt)
        vocab = self.loaded.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[0]}", "prompt")
        return prompt

    def completion_echo(self, req: CompletionRequest) -> str:
        """What `echo` puts before the completion: the prompt as sent, or its token ids' text."""
        prompt = req.prompt_given()
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    async def chat_request(self, req: SamplingFields, chat: ChatInput, max_tokens: int | None, logprobs: bool = False,
                           top_logprobs: int = 0, max_param: str = "max_tokens",
                           rendered: tuple[list[int], ThinkBlock | None] | None = None
                           ) -> tuple[GenerationRequest, AnswerReader]:
        """A chat request (chat completions, the Responses API, Ollama's chat) as the internal request: its prompt
        rendered with its tools, and the grammar its tools and response format need; and the reader of its answer.
        rendered: chat_prompt(chat), when the caller has it already (it measured the prompt)."""
        prompt, thinking = rendered if rendered is not None else self.chat_prompt(chat)
        grammar, trigger, route = await self.structure(chat, thinking)
        question = next((m.content for m in reversed(chat.messages) if m.role == "user"), None)
        gen = self.generation_request(req, prompt, max_tokens, logprobs, top_logprobs, "messages", grammar, trigger,
                                      route, question, max_param)
        if stops := self.template.answer_stops(chat):
            gen = dataclasses.replace(gen, stop=gen.stop + stops)
        return gen, self.reader(chat, thinking)

    def generation_request(self, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None, logprobs: bool,
                           top_logprobs: int, prompt_param: str, grammar: Grammar | None = None,
                           trigger: Trigger | None = None, route: Route | None = None, question: str | None = None,
                           max_param: str = "max_tokens") -> GenerationRequest:
        """Check limits and build the internal request (raises APIError with the parameter's name); question:
        a chat's last user message, for the policies that prompt around it."""
        n_prompt = len(prompt_ids)
        if not n_prompt:  # a model without a BOS token reads "" as no tokens at all: nothing to continue from
            raise APIError(400, f"{prompt_param} holds no tokens: send some text", prompt_param, "invalid_value")
        if max_tokens is None:
            max_tokens = self.context - n_prompt
        if n_prompt + max_tokens > self.context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.context} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion).",
                prompt_param if max_tokens <= 0 else max_param, "context_length_exceeded")
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        vocab = self.loaded.cfg.vocab_size
        if any(not 0 <= k < vocab for k in bias):
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        name, options = req.policy_choice()
        try:
            chosen = select_policy(self.policies, name or self.settings.policy)
        except UnknownPolicyError as exc:
            raise APIError(400, str(exc), "decoding", "unknown_policy") from exc
        if not isinstance(options.get("question", ""), str):  # every policy that takes it prompts with it
            raise APIError(400, "decoding.question must be a string", "decoding", "invalid_policy_option")
        unknown = sorted(set(options) - chosen.options)
        if unknown:
            accepted = ", ".join(sorted(chosen.options)) or "none"
            raise APIError(400, f"unknown option(s) {', '.join(unknown)} for decoding policy {chosen.name!r} "
                                f"(accepted: {accepted})", "decoding", "invalid_policy_option")
        try:
            chosen.check(options)
        except ValueError as exc:
            raise APIError(400, f"decoding policy {chosen.name!r}: {exc}", "decoding", "invalid_policy_option") from exc
        if chosen.name == "outline" and grammar is not None:
            raise APIError(400, "outline writes its own skeleton and cannot keep to tools or a response format; "
                                "use another policy (auto picks one)", "decoding", "invalid_policy_option")
        policy = chosen.name
        # Below MIN_TEMPERATURE, sampling is greedy: logits / 1e-40 overflow float32 to inf, whose softmax is NaN.
        # A top_p below MIN_TOP_P keeps the same token (the likeliest has at least 1/vocab), and one that float32
        # rounds to 0 would keep none.
        temperature = req.temperature if req.temperature >= MIN_TEMPERATURE else 0.0
        sampling = SamplingParams(
            temperature=temperature, top_p=max(req.top_p, MIN_TOP_P), top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=bias,
            logprobs=logprobs, top_logprobs=top_logprobs)
        if "question" in chosen.options and "question" not in options and question:
            options = {**options, "question": question}  # outline and auto's router prompt around it
        return GenerationRequest(prompt_ids, max_tokens, sampling, req.stop_list(), self.stop_token_ids,
                                 policy, options, grammar, trigger, route)

    async def generate(self, gen: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """The policy's events, with metrics; model-side failures become APIErrors."""
        policy = self.policies[gen.policy]
        self.metrics.in_flight.inc()
        self.metrics.prompt_tokens.inc(len(gen.prompt_ids))
        tokens = 0
        try:
            async with model_errors(), aclosing(policy.generate(gen, self.engine, self.tokenizer)) as events:
                async for event in events:
                    tokens += len(event.token_ids)
                    if event.stats is not None:
                        self.metrics.observe_generation(event.stats, tokens)
                    yield event
        finally:
            self.metrics.in_flight.dec()
            self.metrics.kv_bytes.set(self.engine.executor.kv_bytes())

    async def deltas(self, gen: GenerationRequest, reader: AnswerReader) -> AsyncGenerator[ChatDelta, None]:
        """generate()'s events as the answer's thinking, content and calls."""
        async with aclosing(self.generate(gen)) as events:
            async for event in events:
                delta = reader.push(event.text, event.finish_reason)
                delta.tokens, delta.logprobs, delta.stats = len(event.token_ids), event.logprobs, event.stats
                yield delta

    async def embeddings(self, req: EmbeddingRequest, window: int | None = None,
                         truncate: bool = False) -> tuple[list[list[float]], int]:
        """One unit vector per input (model/embedding.py: the final-normed last layer, mean-pooled), and the
        input tokens counted. An input longer than `window` tokens (default and at most: the context) is refused,
        or with `truncate` (Ollama's) cut to its first `window` tokens."""
        window = self.context if window is None else min(window, self.context)
        hidden = self.loaded.cfg.hidden_size
        if req.dimensions is not None and req.dimensions != hidden:
            raise APIError(400, f"this model's embeddings have {hidden} dimensions, not {req.dimensions}",
                           "dimensions")
        items = req.inputs()
        if not items:
            raise APIError(400, "input must not be empty", "input")
        vocab, ids = self.loaded.cfg.vocab_size, []
        for item in items:
            tokens = self.tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else item
            if not tokens:
                raise APIError(400, "input must not contain an empty string or token list", "input")
            if any(not 0 <= t < vocab for t in tokens):
                raise APIError(400, f"input token ids must be in [0, {vocab})", "input")
            if truncate:
                tokens = tokens[:window]
            if len(tokens) > window:
                where = "this model's context" if window == self.context else "the context window"
                raise APIError(400, f"an input of {len(tokens)} tokens exceeds {where} of {window}", "input",
                               "context_length_exceeded")
            ids.append(tokens)
        total = sum(map(len, ids))
        self.metrics.prompt_tokens.inc(total)
        async with model_errors():
            return await embed(self.engine, ids), total


@asynccontextmanager
async def model_errors():
    """Model-side failures as the API's errors: a lost worker, a full queue, no KV room, a re-plan."""
    try:
        yield
    except StageFailure as exc:
        raise APIError(exc.status, f"a worker failed during generation: {exc}", None, "worker_failed") from exc
    except QueueFullError as exc:  # a CapacityError: first
        raise APIError(503, str(exc), None, "server_busy", {"retry-after": str(RETRY_AFTER_S)}) from exc
    except CapacityError as exc:
        raise APIError(503, str(exc), None, "kv_cache_full") from exc
    except SessionLostError as exc:
        raise APIError(503, str(exc), None, "replanned") from exc
