"""`clover serve`: an OpenAI-compatible HTTP server over one decoding engine (FastAPI + uvicorn).

HTTP handlers run on the asyncio loop: they check and tokenize a request and compile its grammar off the
loop (`cloverlm.serving.planning`), hand the engine requests to the worker thread
(`cloverlm.serving.worker`), and answer whole or streamed (`cloverlm.serving.responses`).

`/v1/decisions` (an extension) answers up to 8 related questions in one generation (`cloverlm.decoding.decisions`).

Diffusion settings ride as extra body fields: block_size (an integer or "auto"), threshold, max_steps.
Structured output (response_format json_object / json_schema) and forced tool calls (tool_choice
required / named) are grammars (`cloverlm.decoding.grammar`) the engine enforces position by position.
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from cloverlm.decoding.decisions import slot_answers
from cloverlm.serving.planning import Plan, Server
from cloverlm.serving.responses import ChatFormat, CompletionFormat, collect, respond
from cloverlm.serving.schemas import (
    APIError,
    ChatBody,
    CompletionBody,
    DecisionBody,
    ServerConfig,
    json_path_at,
)
from cloverlm.serving.worker import Metrics

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/decisions", "/health", "/metrics")


def create_app(model, tokenizer, config: ServerConfig | None = None, calibration=None) -> FastAPI:
    """The FastAPI app serving `model` (a CloverForBlockDiffusion) with its tokenizer. The engine worker
    starts and stops with the app's lifespan."""
    config = config or ServerConfig()
    server = Server(model, tokenizer, config, calibration)

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
        if first.get("type") == "json_invalid":  # loc holds the character offset: name the field it falls in
            offset = first["loc"][-1] if isinstance(first["loc"][-1], int) else 0
            field = json_path_at(error.body, offset) if isinstance(error.body, str) else None
            detail = first.get("ctx", {}).get("error", "syntax error")
            return APIError(400, f"the body is not valid JSON: {detail} at character {offset}"
                            + (f", in {field}" if field else ""), field, "invalid_json").response()
        if first.get("type") == "lone_surrogate":  # raised on the whole body: the field is in ctx
            return APIError(400, first["msg"], first["ctx"]["field"], "invalid_unicode").response()
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
        return await respond(server, plan, http_request, "/v1/completions", CompletionFormat(server, plan))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatBody, http_request: HTTPRequest):
        plan = await _plan(server.plan_chat, body)
        return await respond(server, plan, http_request, "/v1/chat/completions", ChatFormat(server, plan))

    @app.post("/v1/decisions", dependencies=[Depends(authorize)])
    async def decisions(body: DecisionBody, http_request: HTTPRequest):
        started = time.perf_counter()
        requests = await _plan(server.plan_decisions, body)
        job = server.job()
        groups = [request.request_id for request in requests]  # the questions each request answers
        for index, request in enumerate(requests):
            request.request_id = (job, index)
        job.requests = requests
        completions = await collect(server, server.launch(job), http_request, "/v1/decisions", started)
        if completions is None:
            return Response(status_code=499)
        if any(c.finish_reason == "time_limit" for c in completions):  # slots left open: no answer to give
            raise APIError(408, f"the decision ran past the server's time limit of {config.request_timeout_s:g} s",
                           code="request_timeout")
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


async def _plan(prepare: Callable[[Any], Plan], body) -> Plan:
    try:
        return await run_in_threadpool(prepare, body)
    except RecursionError:
        raise APIError(400, "the request is nested too deeply") from None


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

    def __init__(self, app, metrics: Metrics):
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
