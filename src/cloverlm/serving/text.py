"""A choice's text as it streams (cut at stop strings, held back where a marker may be starting), and
the OpenAI tool_calls parsed out of the finished text.

A `<tool_call>` that does not parse (not a JSON object with a "name", or naming no offered tool; under
tool_choice "auto" nothing enforces the format) is not passed off as content: the message's content is
the text before the first `<tool_call>`, the call goes to `invalid_tool_calls` ([{"text", "error"}], an
extension field), and a choice with no valid call ends with finish_reason "tool_call_error".
"""

from __future__ import annotations

import json
import re
import uuid

from cloverlm.tokenizer import TOOL_CALL_END, TOOL_CALL_START, StopStrings, parse_tool_call


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


def split_tool_calls(text: str, names: frozenset[str] | None = None) -> tuple[str | None, list[dict], list[dict]]:
    """Model output as content (the text before the first `<tool_call>`; None if blank), OpenAI tool_calls,
    and the calls that do not parse or name none of `names` (when given): [{"text", "error"}]."""
    calls, invalid = [], []
    for match in _TOOL_CALL.finditer(text):
        call = parse_tool_call(match.group(1))
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            error = 'not a JSON object with a "name"' if call is None or isinstance(call, dict) else "not a JSON object"
            invalid.append({"text": match.group(1).strip(), "error": f"the tool call is {error}"})
        elif names and call["name"] not in names:
            invalid.append({"text": match.group(1).strip(), "error": f"no tool is named {call['name']!r}"})
        else:
            calls.append({
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))},
            })
    if TOOL_CALL_START not in text:
        return text, [], []
    content = text[: text.index(TOOL_CALL_START)]
    return (content if content.strip() else None), calls, invalid


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Content and OpenAI tool_calls (the bench's view): the whole text as content when no call parses."""
    content, calls, _ = split_tool_calls(text)
    return (content, calls) if calls else (text, [])


class ChoiceText:
    """One choice's text as it streams: cut at stop strings, held back where a stop string or a tool call
    may be starting or a UTF-8 character is incomplete; split into content and tool calls at the end."""

    def __init__(self, tokenizer, stops: StopStrings | None, tools: frozenset[str]):
        self.tokenizer, self.stops, self.tools = tokenizer, stops, tools  # tools: the offered names (none: plain text)
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

    def finish(self) -> tuple[str | None, str, list[dict], list[dict]]:
        """(content, the content not streamed yet, tool_calls, invalid tool calls)."""
        content, calls, invalid = split_tool_calls(self.text(), self.tools) if self.tools else (self.text(), [], [])
        rest = (content or "")[self.sent :]
        return content, rest, calls, invalid
