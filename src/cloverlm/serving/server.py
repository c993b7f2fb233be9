"""`clover serve`: an OpenAI-compatible HTTP server over one decoding engine.

One `Engine` is owned by one worker thread that steps it while there is work, so requests from all
clients share each batched forward (continuous batching). HTTP handlers run on the asyncio loop: they
check and tokenize a request, compile its grammar (off the loop), hand the engine requests to the worker
through a thread-safe queue, and get blocks and completions back on an asyncio queue. A client that goes
away is cancelled at once: its rows leave the batch before the next forward.

`/v1/decisions` (an extension) answers up to 8 related questions in one generation (`cloverlm.decoding.decisions`).

Diffusion settings ride as extra body fields: block_size (an integer or "auto"), threshold, max_steps.
Structured output (response_format json_object / json_schema) and forced tool calls (tool_choice
required / named) are grammars (`cloverlm.decoding.grammar`) the engine enforces position by position.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import jinja2
import uvicorn
from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloverlm.decoding.decisions import decision_requests, slot_answers
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import GrammarConstraint, Grammars
from cloverlm.decoding.params import Completion, DecodeParams, Request
from cloverlm.errors import CloverError
from cloverlm.tasks import parse_tool_call
from cloverlm.tokenizer import (
    MASK_TOKEN,
    PAD_TOKEN,
    TOOL_CALL_END,
    TOOL_CALL_START,
    StopStrings,
    stop_token_ids,
)

log = logging.getLogger("cloverlm.serving.server")

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/decisions", "/health", "/metrics")


@dataclass
class ServerConfig:
    model_name: str = "clover"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer KEY"
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_stop: int = 4
    max_pending: int = 256  # generations queued or running; beyond that a request gets 429
    max_batch_size: int = 16
    block_size: int | str = DecodeParams.block_size
    threshold: float = DecodeParams.threshold


# -- errors --


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# -- request bodies --


class _Body(BaseModel):
    # Unknown fields are kept (OpenAI clients send some we ignore) and checked against _UNSUPPORTED.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # diffusion settings (extensions)
    block_size: int | Literal["auto"] | None = Field(None, description='tokens per block, or "auto" (calibrated)')
    threshold: float | None = Field(None, gt=0, le=1, description="confidence to unmask in parallel")
    max_steps: int | None = Field(None, ge=1, description="denoising steps per block before the rest is filled")


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # with tool_choice "required": several calls, or exactly one


class DecisionQuestion(_Body):
    question: str
    options: list[str] = Field(min_length=1, max_length=64, description="each exactly one token")


class DecisionBody(_Body):
    """/v1/decisions (a Clover extension): related questions answered in one generation."""

    model: str
    context: str = ""
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=8)
    joint: bool = Field(True, description="all answers in one block (each sees the others), or each alone")
    distinct: bool = Field(False, description="joint only: no two answers alike")
    temperature: float | None = Field(None, ge=0, le=2)
    seed: int | None = Field(None, ge=0, lt=2**63)
    threshold: float | None = Field(None, gt=0, le=1)
    max_steps: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1, description="blocks the prompt is read in")


# Accepted by OpenAI, not by Clover: refused when set to anything but their neutral value.
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None,),
                "best_of": (None, 1), "logit_bias": (None, {}), "frequency_penalty": (None, 0), "presence_penalty": (None, 0)}


# -- what a request turns into --


@dataclass
class _Plan:
    """A checked request: engine inputs plus how to present the output."""

    prompts: list[list[int]]
    params: DecodeParams
    n: int
    constraint: GrammarConstraint | None
    stops: StopStrings | None
    tools: bool  # parse <tool_call> tags into tool_calls
    stream: bool
    include_usage: bool


@dataclass
class _Block:
    index: int
    tokens: list[int]


@dataclass
class _Done:
    index: int
    completion: Completion


@dataclass
class _Failed:
    status: int
    message: str


class _Job:
    """One HTTP request in flight: its engine requests (one per choice) and the queue their events reach."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.requests: list[Request] = []
        self.running: set[int] = set()  # worker side: choices not finished yet

    def post(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


# -- metrics --


class _Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("clover_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("clover_generated_tokens", "Tokens generated", registry=r)
        self.forwards = Counter("clover_forwards", "Batched decoding forwards", registry=r)
        self.cancelled = Counter("clover_cancelled", "Generations dropped before their end (client gone, or a decoding failure)", registry=r)
        self.latency = Histogram(
            "clover_request_latency_seconds", "Time from request to last token", ["endpoint"], registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.waiting = Gauge("clover_queue_size", "Generations waiting for a batch slot", registry=r)
        self.running = Gauge("clover_running", "Generations in the batch", registry=r)


# -- the engine worker --


_STOP = object()


class EngineWorker:
    """Owns the engine: one thread steps it while there is work; other threads only enqueue commands."""

    def __init__(self, engine: Engine, metrics: _Metrics):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: set[_Job] = set()
        # Generations reserved and not yet finished or cancelled. Counted here, where they end, so that a
        # stream the client dropped before it started still frees its share when it finishes.
        self._load = 0
        self._load_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="clover-engine", daemon=True)
        metrics.waiting.set_function(lambda: len(self.engine.waiting))
        metrics.running.set_function(lambda: len(self.engine.rows))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=30)

    def reserve(self, count: int, limit: int) -> bool:
        """Take `count` generations of the `limit` in flight; False (nothing taken) if they do not fit."""
        with self._load_lock:
            if self._load + count > limit:
                return False
            self._load += count
            return True

    def _release(self, count: int) -> None:
        with self._load_lock:
            self._load -= count

    def submit(self, job: _Job) -> None:
        """Queue a job whose generations were reserved."""
        self._commands.put(lambda: self._submit(job))

    def cancel(self, job: _Job) -> None:
        self._commands.put(lambda: self._cancel(job))

    def _run(self) -> None:
        while True:
            command = self._next(block=not self.engine.has_work())
            while command is not None:
                if command is _STOP:
                    return
                command()
                command = self._next(block=False)
            if self.engine.has_work():
                self._step()

    def _next(self, block: bool):
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _submit(self, job: _Job) -> None:
        for index, request in enumerate(job.requests):
            try:
                self.engine.submit(request)
            except CloverError as error:  # checked before, so this is a gap in those checks: still the input's
                self._release(len(job.requests) - len(job.running))
                self._cancel(job)
                job.post(_Failed(400, str(error)))
                return
            job.running.add(index)
            self._jobs.add(job)

    def _cancel(self, job: _Job) -> None:
        if job not in self._jobs:
            return
        for index in job.running:
            self.engine.cancel(job.requests[index])
        self.metrics.cancelled.inc(len(job.running))
        self._release(len(job.running))
        job.running.clear()
        self._jobs.discard(job)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception:  # a bug, not bad input: fail what is in flight, keep serving
            log.exception("decoding step failed; failing the requests in flight")
            for job in list(self._jobs):
                self._cancel(job)
                job.post(_Failed(500, "internal error while decoding"))
            return
        self.metrics.forwards.inc()
        for completion in finished:
            job, index = completion.request_id
            job.running.discard(index)
            self._release(1)
            if not job.running:
                self._jobs.discard(job)
            self.metrics.generated_tokens.inc(len(completion.tokens))
            self.metrics.prompt_tokens.inc(completion.prompt_tokens)
            job.post(_Done(index, completion))


# -- output text --


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of `text` that could be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split model output into content (the text before the first call; None if blank) and OpenAI tool_calls."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        call = parse_tool_call(match.group(1))
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", {})
            calls.append({
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments)},
            })
    if not calls:
        return text, []
    content = text[: text.index(TOOL_CALL_START)]
    return (content if content.strip() else None), calls


class _ChoiceText:
    """One choice's text as it streams: cut at stop strings, held back where a stop string or a tool call
    may be starting or a UTF-8 character is incomplete; split into content and tool calls at the end."""

    def __init__(self, tokenizer, stops: StopStrings | None, tools: bool):
        self.tokenizer, self.stops, self.tools = tokenizer, stops, tools
        self.markers = (stops.strings if stops else []) + ([TOOL_CALL_START] if tools else [])
        self.tokens: list[int] = []
        self.sent = 0  # characters of content already streamed

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens)
        return self.stops.cut(text) if self.stops else text

    def push(self, tokens: list[int]) -> str:
        """The content delta that is safe to stream after these tokens."""
        self.tokens += tokens
        text = self.text()
        if self.tools and TOOL_CALL_START in text:
            text = text[: text.index(TOOL_CALL_START)]
        end = len(text) - _partial_suffix(text, self.markers)
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def finish(self) -> tuple[str | None, str, list[dict]]:
        """(content, the content not streamed yet, tool_calls)."""
        content, calls = parse_tool_calls(self.text()) if self.tools else (self.text(), [])
        rest = (content or "")[self.sent :]
        return content, rest, calls


# -- the app --


class _Server:
    def __init__(self, model, tokenizer, config: ServerConfig, calibration=None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.calibration = calibration
        self.vocab_size = model.config.vocab_size
        self.stop_ids = stop_token_ids(tokenizer)
        self.reserved = {tokenizer.convert_tokens_to_ids(t) for t in (MASK_TOKEN, PAD_TOKEN)}
        self.grammars = Grammars(tokenizer, self.vocab_size, self.stop_ids)
        self.metrics = _Metrics()
        engine = Engine(model, max_batch_size=config.max_batch_size, calibration=calibration)
        self.worker = EngineWorker(engine, self.metrics)

    # -- checks shared by both endpoints --

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.config.model_name}'",
                           "model", "model_not_found")

    def check_unsupported(self, body: _Body) -> None:
        for name, value in (body.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise APIError(400, f"{name} is not supported by this server", name, "unsupported_parameter")

    def encode(self, text: str) -> list[int]:
        # The backend tokenizer directly: the transformers wrapper may reconfigure itself per call, which
        # is not safe from several threads.
        return self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        if len(ids) > self.config.max_prompt_tokens:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server's limit is {self.config.max_prompt_tokens}",
                           param, "context_length_exceeded")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise APIError(400, f"prompt token ids must be in 0..{self.vocab_size - 1}", param)
        if self.reserved & set(ids):
            raise APIError(400, "the prompt contains the [MASK] or pad token, which only the decoder may place", param)
        return ids

    def decode_params(self, body: _Sampling, max_tokens: int | None, stops: StopStrings | None) -> DecodeParams:
        max_tokens = max_tokens or min(self.config.default_max_tokens, self.config.max_tokens)
        if max_tokens > self.config.max_tokens:
            raise APIError(400, f"max_tokens is {max_tokens}; this server's limit is {self.config.max_tokens}", "max_tokens")
        if body.n > self.config.max_n:
            raise APIError(400, f"n is {body.n}; this server's limit is {self.config.max_n}", "n")
        params = DecodeParams(
            max_new_tokens=max_tokens,
            block_size=body.block_size if body.block_size is not None else self.config.block_size,
            threshold=body.threshold if body.threshold is not None else self.config.threshold,
            max_steps=body.max_steps,
            temperature=body.temperature or 0.0,  # greedy unless asked: the diffusion default
            top_k=max(body.top_k or 0, 0),
            top_p=body.top_p if body.top_p is not None else 1.0,
            seed=body.seed,
            stop_token_ids=self.stop_ids,
            stop=stops,
        )
        try:
            params.validate(self.model.config.max_block_size)
        except CloverError as error:
            raise APIError(400, str(error)) from None
        if params.block_size == "auto" and self.calibration is None:
            raise APIError(400, 'block_size "auto" needs a calibrated model (clover calibrate)', "block_size")
        return params

    def stop_strings(self, stop: str | list[str] | None) -> StopStrings | None:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > self.config.max_stop:
            raise APIError(400, f"at most {self.config.max_stop} stop strings", "stop")
        return StopStrings(self.tokenizer, strings) if any(strings) else None

    def response_grammar(self, response_format: ResponseFormat | None) -> str | None:
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            return self.grammars.json_object()
        if response_format.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema field", "response_format")
        return self.grammars.json_schema(response_format.json_schema.json_schema)

    def compile(self, grammar: str | None, param: str) -> GrammarConstraint | None:
        if grammar is None:
            return None
        try:
            return self.grammars.constraint(grammar)
        except CloverError as error:
            raise APIError(400, str(error), param, "invalid_schema") from None

    # -- preparing requests (run off the event loop: tokenizing and compiling can take a while) --

    def plan_completion(self, body: CompletionBody) -> _Plan:
        self.check_model(body.model)
        self.check_unsupported(body)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [self.encode(prompt)]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [self.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        if not prompts:
            raise APIError(400, "the prompt is empty", "prompt")
        if len(prompts) * body.n > self.config.max_n:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n} is above this server's limit of {self.config.max_n} choices", "prompt")
        prompts = [self.check_prompt(p, "prompt") for p in prompts]
        stops = self.stop_strings(body.stop)
        params = self.decode_params(body, body.max_tokens, stops)
        try:
            grammar = self.response_grammar(body.response_format)
        except CloverError as error:
            raise APIError(400, str(error), "response_format", "invalid_schema") from None
        return _Plan(prompts, params, body.n, self.compile(grammar, "response_format"), stops, False, body.stream,
                     bool(body.stream_options and body.stream_options.include_usage))

    def plan_chat(self, body: ChatBody) -> _Plan:
        self.check_model(body.model)
        self.check_unsupported(body)
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if choice != "none" and not body.tools:
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        tools = body.tools if choice != "none" else None
        messages = [self._message(m) for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                add_generation_prompt=True, tokenize=False,
            )
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as error:
            raise APIError(400, f"cannot render the messages: {error}", "messages") from None
        prompt = self.check_prompt(self.encode(text), "messages")
        stops = self.stop_strings(body.stop)
        params = self.decode_params(body, body.max_completion_tokens or body.max_tokens, stops)
        forced_call = choice == "required" or isinstance(choice, NamedToolChoice)
        param = "tools" if forced_call else "response_format"  # a forced call takes the place of a response format
        try:
            grammar = (self.tool_grammar(tools, choice, body.parallel_tool_calls) if forced_call
                       else self.response_grammar(body.response_format))
        except CloverError as error:
            raise APIError(400, str(error), param, "invalid_schema") from None
        return _Plan([prompt], params, body.n, self.compile(grammar, param), stops, tools is not None, body.stream,
                     bool(body.stream_options and body.stream_options.include_usage))

    def plan_decisions(self, body: DecisionBody) -> list[Request]:
        self.check_model(body.model)
        if body.distinct and not body.joint:
            raise APIError(400, "distinct needs joint answering", "distinct")
        params = DecodeParams(
            block_size=body.block_size or self.config.block_size,
            threshold=body.threshold if body.threshold is not None else self.config.threshold,
            max_steps=body.max_steps, temperature=body.temperature or 0.0, seed=body.seed, stop_token_ids=self.stop_ids,
        )
        try:
            params.validate(self.model.config.max_block_size)
            questions = [(q.question, q.options) for q in body.questions]
            requests = decision_requests(self.tokenizer, questions, body.context, body.joint, params, body.distinct)
        except CloverError as error:
            raise APIError(400, str(error), "questions") from None
        self.check_prompt(requests[0].prompt_ids, "questions")
        if len(requests[0].slots.layout) > self.model.config.max_block_size:
            raise APIError(400, f"the answers' layout is {len(requests[0].slots.layout)} tokens, over one block "
                           f"({self.model.config.max_block_size}): fewer questions", "questions")
        return requests

    @staticmethod
    def _message(message: Message) -> dict:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        rendered: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content}
        if message.tool_calls:
            rendered["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in message.tool_calls
            ]
        return rendered

    def tool_grammar(self, tools: list[Tool], choice: str | NamedToolChoice, parallel: bool) -> str:
        functions = [(t.function.name, t.function.parameters) for t in tools]
        if isinstance(choice, NamedToolChoice):
            functions = [f for f in functions if f[0] == choice.function.name]
            if not functions:
                raise APIError(400, f"tool_choice names '{choice.function.name}', which is not among the tools", "tool_choice")
        return self.grammars.tool_calls(functions, single=isinstance(choice, NamedToolChoice) or not parallel)

    # -- running a plan --

    def start(self, plan: _Plan) -> _Job:
        job = _Job(asyncio.get_running_loop())
        for p, prompt in enumerate(plan.prompts):
            for k in range(plan.n):
                index = p * plan.n + k
                seed = None if plan.params.seed is None else (plan.params.seed + k) % 2**63
                constraint = None if plan.constraint is None else plan.constraint.copy()
                job.requests.append(Request(
                    prompt, replace(plan.params, seed=seed), request_id=(job, index), constraint=constraint,
                    on_block=lambda request, tokens, index=index: job.post(_Block(index, list(tokens))),
                ))
        return self.launch(job)

    def launch(self, job: _Job) -> _Job:
        """Hand a job to the worker, or answer 429 when its generations would pass max_pending."""
        if not self.worker.reserve(len(job.requests), self.config.max_pending):
            raise APIError(429, "the server is busy; retry later", code="server_busy")
        self.worker.submit(job)
        return job

    def finish(self, job: _Job, endpoint: str, started: float, gone: bool) -> None:
        if gone:
            self.worker.cancel(job)
        else:
            self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)

    async def events(self, job: _Job) -> AsyncIterator[_Block | _Done]:
        """The job's events until every choice is done; a worker failure becomes an APIError."""
        open_choices = len(job.requests)
        while open_choices:
            event = await job.events.get()
            if isinstance(event, _Failed):
                raise APIError(event.status, event.message, code="engine_error")
            open_choices -= isinstance(event, _Done)
            yield event


async def _wait_disconnect(http_request: HTTPRequest) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


def create_app(model, tokenizer, config: ServerConfig | None = None, calibration=None) -> FastAPI:
    """The FastAPI app serving `model` (a CloverForBlockDiffusion) with its tokenizer. The engine worker
    starts and stops with the app's lifespan."""
    config = config or ServerConfig()
    server = _Server(model, tokenizer, config, calibration)

    @asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="cloverlm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over a Clover block-diffusion model")
    app.state.server = server
    bearer = HTTPBearer(auto_error=False)

    def authorize(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if config.api_key is None:
            return
        given = credentials.credentials.encode() if credentials else b""
        if not hmac.compare_digest(given, config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = [str(part) for part in first.get("loc", ())[1:]]
        return APIError(400, f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid request')}", ".".join(where) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        return APIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404 else None).response()

    @app.exception_handler(RecursionError)
    async def too_deep(_, error: RecursionError):  # json nested past Python's recursion limit
        return APIError(400, "the request body is nested too deeply").response()

    @app.exception_handler(Exception)
    async def server_error(_, error: Exception):
        log.exception("unhandled error", exc_info=error)
        return APIError(500, "internal server error").response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        card = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "cloverlm"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionBody, http_request: HTTPRequest):
        plan = await _plan(server.plan_completion, body)
        return await _respond(server, plan, http_request, "/v1/completions", _CompletionFormat(server, plan))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatBody, http_request: HTTPRequest):
        plan = await _plan(server.plan_chat, body)
        return await _respond(server, plan, http_request, "/v1/chat/completions", _ChatFormat(server, plan))

    @app.post("/v1/decisions", dependencies=[Depends(authorize)])
    async def decisions(body: DecisionBody, http_request: HTTPRequest):
        started = time.perf_counter()
        requests = await _plan(server.plan_decisions, body)
        job = _Job(asyncio.get_running_loop())
        groups = [request.request_id for request in requests]  # the questions each request answers
        for index, request in enumerate(requests):
            request.request_id = (job, index)
        job.requests = requests
        completions = await _collect(server, server.launch(job), http_request, "/v1/decisions", started)
        if completions is None:
            return Response(status_code=499)
        answers: dict[int, str] = {}
        for group, request, completion in zip(groups, requests, completions):
            answers.update(zip(group, slot_answers(server.tokenizer, request, completion)))
        prompt = len(requests[0].prompt_ids)
        generated = sum(len(c.tokens) for c in completions)
        return {
            "id": f"dec-{uuid.uuid4().hex}", "object": "decision", "created": int(time.time()), "model": config.model_name,
            "answers": [{"index": i, "question": body.questions[i].question, "answer": answers[i]} for i in sorted(answers)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                      "forwards": sum(c.forwards for c in completions)},
        }

    app.add_middleware(_BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(_Observe, metrics=server.metrics)
    return app


@contextmanager
def background_server(app: FastAPI, host: str = "127.0.0.1"):
    """Serve `app` from a thread on a free port of `host` (tests, the load bench); yields the base URL."""
    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise CloverError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()


async def _plan(prepare: Callable[[Any], _Plan], body) -> _Plan:
    try:
        return await run_in_threadpool(prepare, body)
    except RecursionError:
        raise APIError(400, "the request is nested too deeply") from None


# -- response formats --


class _Format:
    """How the choices of one request are presented: whole, or as server-sent chunks."""

    kind: str
    chunk_kind: str
    prefix = "cmpl"

    def __init__(self, server: _Server, plan: _Plan):
        self.server, self.plan = server, plan
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [_ChoiceText(server.tokenizer, plan.stops, plan.tools) for _ in range(len(plan.prompts) * plan.n)]

    def usage(self, completions: list[Completion]) -> dict:
        """OpenAI's counts (each prompt once, however many choices) plus Clover's decoding forwards."""
        prompt = sum(len(p) for p in self.plan.prompts)
        generated = sum(len(c.tokens) for c in completions)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "forwards": sum(c.forwards for c in completions)}

    def envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.config.model_name,
                "choices": choices, **extra}

    def start_chunks(self) -> list[dict]:
        return []

    def delta_choice(self, index: int, text: str) -> dict | None: ...

    def final_choice(self, index: int, completion: Completion) -> dict: ...

    def whole_choice(self, index: int, completion: Completion) -> dict: ...

    def finish_reason(self, completion: Completion, calls: list[dict]) -> str:
        # cut off by max_tokens stays "length", also with calls parsed before the cut
        return "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason


class _CompletionFormat(_Format):
    kind, chunk_kind = "text_completion", "text_completion"

    def delta_choice(self, index, text):
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None} if text else None

    def final_choice(self, index, completion):
        _, rest, _ = self.texts[index].finish()
        return {"index": index, "text": rest, "logprobs": None, "finish_reason": completion.finish_reason}

    def whole_choice(self, index, completion):
        self.texts[index].tokens = completion.tokens
        content, _, _ = self.texts[index].finish()
        return {"index": index, "text": content, "logprobs": None, "finish_reason": completion.finish_reason}


class _ChatFormat(_Format):
    kind, chunk_kind, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def start_chunks(self):
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.texts))]

    def delta_choice(self, index, text):
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None} if text else None

    def final_choice(self, index, completion):
        _, rest, calls = self.texts[index].finish()
        delta: dict[str, Any] = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason(completion, calls)}

    def whole_choice(self, index, completion):
        self.texts[index].tokens = completion.tokens
        content, _, calls = self.texts[index].finish()
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": None, "finish_reason": self.finish_reason(completion, calls)}


async def _respond(server: _Server, plan: _Plan, http_request: HTTPRequest, endpoint: str, fmt: _Format):
    started = time.perf_counter()
    job = server.start(plan)
    if plan.stream:
        return StreamingResponse(_stream(server, job, fmt, endpoint, started), media_type="text/event-stream")
    ordered = await _collect(server, job, http_request, endpoint, started)
    if ordered is None:  # the client left: nothing to answer
        return Response(status_code=499)
    choices = [fmt.whole_choice(i, c) for i, c in enumerate(ordered)]
    return JSONResponse(fmt.envelope(fmt.kind, choices, usage=fmt.usage(ordered)))


async def _collect(server: _Server, job: _Job, http_request: HTTPRequest, endpoint: str, started: float) -> list[Completion] | None:
    """The job's completions in request order, or None (the job cancelled) if the client disconnects first."""
    gone = asyncio.ensure_future(_wait_disconnect(http_request))
    completions: dict[int, Completion] = {}
    finished = False
    try:
        events = server.events(job).__aiter__()
        while True:
            step = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                step.cancel()
                return None
            try:
                event = step.result()
            except StopAsyncIteration:
                break
            if isinstance(event, _Done):
                completions[event.index] = event.completion
        finished = True
    finally:
        gone.cancel()
        server.finish(job, endpoint, started, gone=not finished)
    return [completions[i] for i in sorted(completions)]


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(server: _Server, job: _Job, fmt: _Format, endpoint: str, started: float) -> AsyncIterator[str]:
    """Server-sent chunks: a block's text when the block is committed, each choice's finish, the usage
    chunk when asked, then [DONE]. A client that leaves cancels the generator, and with it the job."""
    usage_field = {"usage": None} if fmt.plan.include_usage else {}
    finished = False
    try:
        for choice in fmt.start_chunks():
            yield _sse(fmt.envelope(fmt.chunk_kind, [choice], **usage_field))
        completions = []
        try:
            async for event in server.events(job):
                if isinstance(event, _Block):
                    choice = fmt.delta_choice(event.index, fmt.texts[event.index].push(event.tokens))
                else:
                    completions.append(event.completion)
                    choice = fmt.final_choice(event.index, event.completion)
                if choice is not None:
                    yield _sse(fmt.envelope(fmt.chunk_kind, [choice], **usage_field))
        except APIError as error:
            yield _sse(json.loads(error.response().body))
        else:
            if fmt.plan.include_usage:
                yield _sse(fmt.envelope(fmt.chunk_kind, [], usage=fmt.usage(completions)))
        yield _sse("[DONE]")
        finished = True
    finally:
        server.finish(job, endpoint, started, gone=not finished)


# -- middleware --


class _BodyLimit:
    """Reads the request body up front and answers 413 past the limit (also without a Content-Length), then
    hands the body to the app; later receives (the disconnect) come from the connection itself."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is over {self.limit} bytes", code="request_too_large").response()
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class _Observe:
    """Counts requests by endpoint (known paths only, so clients cannot blow up the label set) and status."""

    def __init__(self, app, metrics: _Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def observed_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
