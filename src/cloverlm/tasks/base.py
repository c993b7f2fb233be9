"""Shared pieces of the task generators: the Example record, the Task protocol and checker helpers."""

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    task: str
    seed: int
    prompt: str  # the user message; tool schemas travel separately in `tools`
    answer: str  # exact target completion
    truth: Any  # JSON-able ground truth the checker scores against
    # [start, end) spans of `answer` whose text is copied verbatim from `prompt` (for a copy probe)
    value_spans: tuple[tuple[int, int], ...]
    tools: tuple[dict, ...] = ()  # OpenAI-style tool schemas, only used by tool_call


class Task(Protocol):
    name: str

    def generate(self, seed: int, **size) -> Example: ...

    def check(self, example: Example, output: str) -> dict[str, float]: ...

    def answer_schema(self, example: Example) -> dict | None:
        """The JSON schema every right answer to `example` satisfies, to decode under it
        (`decoding.grammar.Grammars.json_schema`); None where the task publishes none: an answer that is
        not one JSON value (tool_call: its grammar comes from `example.tools`) or no schema worth forcing."""
        ...


def dumps(obj: Any) -> str:
    """Compact JSON, the format of every answer."""
    return json.dumps(obj, separators=(",", ":"))


def same(a: Any, b: Any) -> bool:
    """JSON equality that is strict about types (1 != 1.0 != true, "5" != 5) but ignores key order."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def mean(flags: Iterable[bool]) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else 0.0


def spans_of(answer: str, values: Iterable[str]) -> tuple[tuple[int, int], ...]:
    """Spans of `values` (given in answer order) in `answer`. Each is searched after the previous one so
    that a short value like "2" lands on its own occurrence rather than inside an earlier value."""
    spans, cursor = [], 0
    for value in values:
        start = answer.index(value, cursor)
        cursor = start + len(value)
        spans.append((start, cursor))
    return tuple(spans)
