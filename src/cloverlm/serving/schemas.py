"""What `clover serve` accepts: its configuration, its error shape, and the request bodies.

Unknown body fields are kept (OpenAI clients send some we ignore); those OpenAI accepts and Clover does
not are refused unless set to their neutral value (UNSUPPORTED).

Text must be valid Unicode: a lone UTF-16 surrogate anywhere in a body ("\ud800" in JSON, in any string
or key, known field or not) answers 400 naming where it is (param "messages.0.content"). It is refused,
not replaced: the tokenizer cannot encode it, and what it stood for is unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from cloverlm.decoding.params import MAX_BATCH_SIZE, DecodeParams


@dataclass
class ServerConfig:
    model_name: str = "clover"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer KEY"
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = DecodeParams.max_new_tokens  # a request that does not set max_tokens
    max_body_bytes: int = 1 << 20
    max_n: int = 8
    max_stop: int = 4
    max_pending: int = 256  # generations queued or running; beyond that a request gets 429
    # A request still running this long after it arrived ends: finish_reason "time_limit" with what it
    # has produced, or 429 if it never got a batch slot. With the per-request bounds on forwards
    # (max_tokens, max_steps) no client can hold a slot for longer.
    request_timeout_s: float = 600.0
    max_batch_size: int = MAX_BATCH_SIZE
    block_size: int | str = DecodeParams.block_size
    threshold: float = DecodeParams.threshold


# -- errors --


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# -- request bodies --


class Body(BaseModel):
    # Unknown fields are kept (OpenAI clients send some we ignore) and checked against UNSUPPORTED.
    model_config = ConfigDict(extra="allow")


_SURROGATE = re.compile("[\ud800-\udfff]")  # in a Python str only a lone one can be here (JSON pairs decode to one character)


def lone_surrogate(value: Any, path: tuple = ()) -> tuple | None:
    """The path of the first string (or key) in parsed JSON that holds a lone surrogate, else None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and _SURROGATE.search(key):
                return (*path, key.encode("utf-8", "backslashreplace").decode())
            if (found := lone_surrogate(item, (*path, key))) is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            if (found := lone_surrogate(item, (*path, index))) is not None:
                return found
    return None


class RequestBody(Body):
    """A whole request body: checked for lone surrogates before anything reads it (one walk over the raw JSON)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            field = ".".join(str(part) for part in where) or "body"
            raise PydanticCustomError("lone_surrogate", "{field} holds a lone UTF-16 surrogate; text must be valid Unicode",
                                      {"field": field})
        return data


def json_path_at(document: str, offset: int) -> str | None:
    """The field a JSON syntax error at `offset` falls in ("messages.0.content"), read from the text
    before it; None at the top level."""
    frames: list[list] = []  # per open container: [kind, key or index (None: a key comes next)]
    i = 0
    while i < min(offset, len(document)):
        char = document[i]
        if char == '"':
            end = i + 1
            while end < len(document) and document[end] != '"':
                end += 2 if document[end] == "\\" else 1
            if frames and frames[-1][0] == "{" and frames[-1][1] is None and end < offset:
                frames[-1][1] = document[i + 1 : end]
            i = end
        elif char in "{[":
            frames.append([char, None if char == "{" else 0])
        elif char in "}]" and frames:
            frames.pop()
        elif char == "," and frames:
            frames[-1][1] = frames[-1][1] + 1 if frames[-1][0] == "[" else None
        i += 1
    return ".".join(str(key) for _, key in frames if key is not None) or None


class StreamOptions(Body):
    include_usage: bool = False


class JSONSchemaFormat(Body):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class SamplingBody(RequestBody):
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


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # with tool_choice "required": several calls, or exactly one


class DecisionQuestion(Body):
    question: str
    options: list[str] = Field(min_length=1, max_length=64, description="each exactly one token")


class DecisionBody(RequestBody):
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
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None,),
                "best_of": (None, 1), "logit_bias": (None, {}), "frequency_penalty": (None, 0), "presence_penalty": (None, 0)}
