"""How the choices of a request are answered: OpenAI's completion and chat formats, collected whole or
streamed as server-sent events. A client that goes away cancels its job at once: its rows leave the
batch before the next forward.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cloverlm.decoding.params import Completion
from cloverlm.serving.planning import Plan, Server
from cloverlm.serving.schemas import APIError
from cloverlm.serving.text import ChoiceText
from cloverlm.serving.worker import BlockEvent, DoneEvent, Job


class _Format:
    """How the choices of one request are presented: whole, or as server-sent chunks."""

    kind: str
    chunk_kind: str
    prefix = "cmpl"

    def __init__(self, server: Server, plan: Plan):
        self.server, self.plan = server, plan
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [ChoiceText(server.tokenizer, plan.stops, plan.tools) for _ in range(len(plan.prompts) * plan.n)]

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

    def finish_reason(self, completion: Completion, calls: list[dict], invalid: list[dict]) -> str:
        # cut off by max_tokens stays "length" (and the time limit "time_limit"), also with calls parsed before
        if completion.finish_reason != "stop":
            return completion.finish_reason
        return "tool_calls" if calls else "tool_call_error" if invalid else "stop"


class CompletionFormat(_Format):
    kind, chunk_kind = "text_completion", "text_completion"

    def delta_choice(self, index, text):
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None} if text else None

    def final_choice(self, index, completion):
        _, rest, _, _ = self.texts[index].finish()
        return {"index": index, "text": rest, "logprobs": None, "finish_reason": completion.finish_reason}

    def whole_choice(self, index, completion):
        self.texts[index].tokens = completion.tokens
        content, _, _, _ = self.texts[index].finish()
        return {"index": index, "text": content, "logprobs": None, "finish_reason": completion.finish_reason}


class ChatFormat(_Format):
    kind, chunk_kind, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def start_chunks(self):
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.texts))]

    def delta_choice(self, index, text):
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None} if text else None

    def final_choice(self, index, completion):
        _, rest, calls, invalid = self.texts[index].finish()
        delta: dict[str, Any] = {"content": rest} if rest else {}
        if calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        if invalid:
            delta["invalid_tool_calls"] = invalid
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": self.finish_reason(completion, calls, invalid)}

    def whole_choice(self, index, completion):
        self.texts[index].tokens = completion.tokens
        content, _, calls, invalid = self.texts[index].finish()
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        if invalid:
            message["invalid_tool_calls"] = invalid
        return {"index": index, "message": message, "logprobs": None,
                "finish_reason": self.finish_reason(completion, calls, invalid)}


async def respond(server: Server, plan: Plan, http_request: HTTPRequest, endpoint: str, fmt: _Format):
    started = time.perf_counter()
    job = server.start(plan)
    if plan.stream:
        return StreamingResponse(_stream(server, job, fmt, endpoint, started), media_type="text/event-stream")
    ordered = await collect(server, job, http_request, endpoint, started)
    if ordered is None:  # the client left: nothing to answer
        return Response(status_code=499)
    choices = [fmt.whole_choice(i, c) for i, c in enumerate(ordered)]
    return JSONResponse(fmt.envelope(fmt.kind, choices, usage=fmt.usage(ordered)))


async def _wait_disconnect(http_request: HTTPRequest) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


async def collect(server: Server, job: Job, http_request: HTTPRequest, endpoint: str, started: float) -> list[Completion] | None:
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
            if isinstance(event, DoneEvent):
                completions[event.index] = event.completion
        finished = True
    finally:
        gone.cancel()
        server.finish(job, endpoint, started, gone=not finished)
    return [completions[i] for i in sorted(completions)]


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(server: Server, job: Job, fmt: _Format, endpoint: str, started: float) -> AsyncIterator[str]:
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
                if isinstance(event, BlockEvent):
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
