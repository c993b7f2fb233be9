"""A choice's text as it streams (cut at stop strings, held back where a marker may be starting), and
the OpenAI tool_calls parsed out of the finished text."""

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


class ChoiceText:
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
