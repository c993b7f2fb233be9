"""From a checked request body to engine requests: prompts (tokenized or chat-rendered), decode
params, stop strings, grammars for structured output and forced tool calls (`cloverlm.decoding.grammar`),
and the decision requests of /v1/decisions (`cloverlm.decoding.decisions`); then launching a plan on the
engine worker and reading its events back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import jinja2

from cloverlm.decoding.decisions import decision_requests
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.grammar import GrammarConstraint, Grammars
from cloverlm.decoding.params import AUTO, DecodeParams, Request
from cloverlm.errors import CloverError, check_token_ids
from cloverlm.serving.schemas import (
    UNSUPPORTED,
    APIError,
    Body,
    ChatBody,
    CompletionBody,
    DecisionBody,
    Message,
    NamedToolChoice,
    ResponseFormat,
    SamplingBody,
    ServerConfig,
    Tool,
)
from cloverlm.serving.worker import BlockEvent, DoneEvent, EngineWorker, FailedEvent, Job, Metrics
from cloverlm.tokenizer import MASK_TOKEN, PAD_TOKEN, StopStrings, stop_token_ids


@dataclass
class Plan:
    """A checked request: engine inputs plus how to present the output."""

    prompts: list[list[int]]
    params: DecodeParams
    n: int
    constraint: GrammarConstraint | None
    stops: StopStrings | None
    tools: frozenset[str]  # the offered tools' names: parse <tool_call> tags into tool_calls (none: plain text)
    stream: bool
    include_usage: bool


class Server:
    """The state behind the routes (tokenizer, grammars, metrics, the engine worker): checks requests, plans
    them, and runs plans."""

    def __init__(self, model, tokenizer, config: ServerConfig, calibration=None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.calibration = calibration
        self.vocab_size = model.config.vocab_size
        self.stop_ids = stop_token_ids(tokenizer)
        self.reserved = {tokenizer.convert_tokens_to_ids(t) for t in (MASK_TOKEN, PAD_TOKEN)}
        self.grammars = Grammars(tokenizer, self.vocab_size, self.stop_ids)
        self.metrics = Metrics()
        engine = Engine(model, max_batch_size=config.max_batch_size, calibration=calibration)
        self.worker = EngineWorker(engine, self.metrics)

    # -- checks shared by both endpoints --

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.config.model_name}'",
                           "model", "model_not_found")

    def check_unsupported(self, body: Body) -> None:
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
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
        try:
            check_token_ids(ids, self.vocab_size, "prompt token ids")
        except CloverError as error:
            raise APIError(400, str(error), param) from None
        if self.reserved & set(ids):
            raise APIError(400, "the prompt contains the [MASK] or pad token, which only the decoder may place", param)
        return ids

    def check_context(self, prompt_tokens: int, max_tokens: int, param: str) -> None:
        """Prompt + max_tokens within the model's context (OpenAI's check and error code)."""
        context = self.model.config.max_position_embeddings
        if prompt_tokens + max_tokens > context:
            raise APIError(400, f"this model's context is {context} tokens; the request needs {prompt_tokens + max_tokens} "
                           f"({prompt_tokens} in the {param}, {max_tokens} to generate): shorten the {param} or ask for fewer tokens",
                           param, "context_length_exceeded")

    def check_params(self, params: DecodeParams) -> DecodeParams:
        limit = self.model.config.max_block_size
        size = params.block_size
        if size != AUTO and (not isinstance(size, int) or not 1 <= size <= limit):
            raise APIError(400, f"block_size is {size!r}; this model's blocks hold 1..{limit} tokens", "block_size")
        try:
            params.validate(limit)
        except CloverError as error:
            raise APIError(400, str(error)) from None
        return params

    def decode_params(self, body: SamplingBody, max_tokens: int | None, stops: StopStrings | None,
                      prompt_tokens: int, param: str) -> DecodeParams:
        if max_tokens is None:  # the default, cut to the context the prompt leaves
            room = self.model.config.max_position_embeddings - prompt_tokens
            max_tokens = max(min(self.config.default_max_tokens, self.config.max_tokens, room), 1)
        if max_tokens > self.config.max_tokens:
            raise APIError(400, f"max_tokens is {max_tokens}; this server's limit is {self.config.max_tokens}", "max_tokens")
        self.check_context(prompt_tokens, max_tokens, param)
        if body.n > self.config.max_n:
            raise APIError(400, f"n is {body.n}; this server's limit is {self.config.max_n}", "n")
        params = DecodeParams(
            max_new_tokens=max_tokens,
            block_size=body.block_size if body.block_size is not None else self.config.block_size,
            threshold=body.threshold if body.threshold is not None else self.config.threshold,
            max_steps=body.max_steps,
            temperature=body.temperature or DecodeParams.temperature,  # greedy unless asked: the diffusion default
            top_k=max(body.top_k or 0, 0),
            top_p=body.top_p if body.top_p is not None else DecodeParams.top_p,
            seed=body.seed,
            stop_token_ids=self.stop_ids,
            stop=stops,
        )
        self.check_params(params)
        if params.block_size == "auto" and self.calibration is None:
            raise APIError(400, 'block_size "auto" needs a calibrated model (clover calibrate)', "block_size")
        return params

    def stop_strings(self, stop: str | list[str] | None) -> StopStrings | None:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > self.config.max_stop:
            raise APIError(400, f"at most {self.config.max_stop} stop strings", "stop")
        return StopStrings(self.tokenizer, strings) if any(strings) else None

    def response_grammar(self, response_format: ResponseFormat | None, source: str) -> str | None:
        """The grammar of a response format; `source` is the text a grounded field copies from (the
        messages' contents, or the prompts)."""
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            return self.grammars.json_object()
        if response_format.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema field", "response_format")
        return self.grammars.json_schema(response_format.json_schema.json_schema, source)

    def compile(self, grammar: str | None, param: str) -> GrammarConstraint | None:
        if grammar is None:
            return None
        try:
            return self.grammars.constraint(grammar)
        except CloverError as error:
            raise APIError(400, str(error), param, "invalid_schema") from None

    # -- preparing requests (run off the event loop: tokenizing and compiling can take a while) --

    def plan_completion(self, body: CompletionBody) -> Plan:
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
        params = self.decode_params(body, body.max_tokens, stops, max(len(p) for p in prompts), "prompt")
        try:
            source = "\n".join(self.tokenizer.decode(p) for p in prompts)
            grammar = self.response_grammar(body.response_format, source)
        except CloverError as error:
            raise APIError(400, str(error), "response_format", "invalid_schema") from None
        return Plan(prompts, params, body.n, self.compile(grammar, "response_format"), stops, frozenset(), body.stream,
                     bool(body.stream_options and body.stream_options.include_usage))

    def plan_chat(self, body: ChatBody) -> Plan:
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
        params = self.decode_params(body, body.max_completion_tokens or body.max_tokens, stops, len(prompt), "messages")
        forced_call = choice == "required" or isinstance(choice, NamedToolChoice)
        param = "tools" if forced_call else "response_format"  # a forced call takes the place of a response format
        if tools and not forced_call:  # auto: the tools pass the checks a forced call makes, though nothing is enforced
            try:
                self.compile(self.tool_grammar(tools, "required", body.parallel_tool_calls), "tools")
            except CloverError as error:
                raise APIError(400, str(error), "tools", "invalid_schema") from None
        try:
            grammar = (self.tool_grammar(tools, choice, body.parallel_tool_calls) if forced_call
                       else self.response_grammar(body.response_format, "\n".join(m["content"] or "" for m in messages)))
        except CloverError as error:
            raise APIError(400, str(error), param, "invalid_schema") from None
        names = frozenset(t.function.name for t in tools or ())
        return Plan([prompt], params, body.n, self.compile(grammar, param), stops, names, body.stream,
                     bool(body.stream_options and body.stream_options.include_usage))

    def plan_decisions(self, body: DecisionBody) -> list[Request]:
        self.check_model(body.model)
        if body.distinct and not body.joint:
            raise APIError(400, "distinct needs joint answering", "distinct")
        params = self.check_params(DecodeParams(
            block_size=body.block_size or self.config.block_size,
            threshold=body.threshold if body.threshold is not None else self.config.threshold,
            max_steps=body.max_steps, temperature=body.temperature or DecodeParams.temperature, seed=body.seed, stop_token_ids=self.stop_ids,
        ))
        try:
            questions = [(q.question, q.options) for q in body.questions]
            requests = decision_requests(self.tokenizer, questions, body.context, body.joint, params, body.distinct)
        except CloverError as error:
            raise APIError(400, str(error), "questions") from None
        self.check_prompt(requests[0].prompt_ids, "questions")
        layout = max(len(r.slots.layout) for r in requests)
        if layout > self.model.config.max_block_size:
            raise APIError(400, f"the answers' layout is {layout} tokens, over one block "
                           f"({self.model.config.max_block_size}): fewer questions", "questions")
        self.check_context(len(requests[0].prompt_ids), layout, "questions")
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

    def job(self) -> Job:
        return Job(asyncio.get_running_loop(), self.config.request_timeout_s)

    def start(self, plan: Plan) -> Job:
        job = self.job()
        for p, prompt in enumerate(plan.prompts):
            for k in range(plan.n):
                index = p * plan.n + k
                seed = None if plan.params.seed is None else (plan.params.seed + k) % 2**63
                constraint = None if plan.constraint is None else plan.constraint.copy()
                job.requests.append(Request(
                    prompt, replace(plan.params, seed=seed), request_id=(job, index), constraint=constraint,
                    on_block=lambda request, tokens, index=index: job.post(BlockEvent(index, list(tokens))),
                ))
        return self.launch(job)

    def launch(self, job: Job) -> Job:
        """Hand a job to the worker, or answer 429 when its generations would pass max_pending."""
        if not self.worker.reserve(len(job.requests), self.config.max_pending):
            raise APIError(429, "the server is busy; retry later", code="server_busy")
        self.worker.submit(job)
        return job

    def finish(self, job: Job, endpoint: str, started: float, gone: bool) -> None:
        if gone:
            self.worker.cancel(job)
        else:
            self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)

    async def events(self, job: Job) -> AsyncIterator[BlockEvent | DoneEvent]:
        """The job's events until every choice is done; a worker failure becomes an APIError."""
        open_choices = len(job.requests)
        while open_choices:
            event = await job.events.get()
            if isinstance(event, FailedEvent):
                raise APIError(event.status, event.message, code=event.code)
            open_choices -= isinstance(event, DoneEvent)
            yield event
