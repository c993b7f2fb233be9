"""Grounded values: a schema keyword that lets a string or number take only values written in the prompt.

`"x-grounded": true` on a subschema of type string, number or integer (issue 29). The name follows the
`x-` convention for extensions: llguidance compiles a schema with it unchanged (it ignores `x-` keys),
and JSON Schema validators ignore unknown keywords, so a grounded schema stays a valid schema whose
meaning without grounding is the plain one. `ground` turns every such subschema into an `enum` of the
candidates found in the prompt that the subschema accepts (its type, pattern, bounds), so the grammar
stays llguidance's and the answer can only copy.

`"x-grounded": "line"` on an object subschema grounds the object as a record: all of its grounded
values come from one line of the prompt (a zone's id, coordinates and times from one message). It
becomes an `anyOf` of the object grounded in each line that holds a candidate for every required
grounded field (MAX_RECORD_LINES at most), so once the answer has copied the id, the rest can only come from
the id's line.

Candidates:
* numbers: the decimal literals of the prompt (`44.7802N` and `N44.7802` give 44.7802; no exponents,
  no leading zeros). Not a candidate: a number inside a date, a time, a version or a reference, where a
  separator joins it to more digits (`2026-07-09T14:30Z` gives neither 2026 nor 14 nor 30, `A1234/26`
  neither 1234 nor 26), and a list's number at the start of a line (`13. A1234/26 ...` numbers the
  message; it is not in it). A minus is a sign only where no word touches it (`200FT-400FT` is a
  range: 400). A JSON number is written in its shortest form, so a literal with trailing zeros
  (`12.50`) comes back as the same value written shorter (`12.5`);
* strings: with a pattern, its matches standing alone (not inside a longer word); without, the prompt's
  words and runs of up to MAX_WORDS words of one line, stripped of surrounding punctuation.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from jsonschema import Draft202012Validator

from cloverlm.errors import CloverError

KEYWORD = "x-grounded"
RECORD = "line"  # the keyword's value that grounds an object in one line
MAX_WORDS = 4
MAX_CANDIDATES = 4096  # per field, the first found: an enum beyond that costs the grammar more than it forces
MAX_RECORD_LINES = 1024  # lines a record may come from: one grammar alternative each
# a JSON number standing alone in digits (letters may touch it: N53.9969, 5.3KM), not inside a longer
# run of digits and dots (a date's 07, a version's 1.2.3)
_NUMBER = re.compile(r"(?<![\d.])(?:(?<![A-Za-z0-9])-)?(?:0|[1-9]\d*)(?:\.\d+)?(?!\d)(?!\.\d)")
_JOINED = "-:/T"  # separators that join digits into one value: dates, times, references
_LIST_NUMBER = re.compile(r"^[ \t]*(\d+)[.)][ \t]", re.MULTILINE)
_WORD = re.compile(r"\S+")
_PUNCTUATION = ".,;:!?()[]{}\"'"
_KEEP = ("title", "description")  # annotations a grounded subschema keeps beside its enum


# How a task's answer is decoded: without its schema, under it with the grounding keyword dropped (the
# plain schema), or under it as written (grounded fields copy from the prompt). Evaluation, the demo and
# the benchmark all take one of these; grounded is the default wherever a schema has grounded fields.
ANSWER_MODES = ("free", "schema", "grounded")
DEFAULT_ANSWERS = "grounded"


def schema_for(schema: dict | None, answers: str) -> dict | None:
    """The schema an answer is decoded under in mode `answers` (one of ANSWER_MODES)."""
    if answers not in ANSWER_MODES:
        raise CloverError(f"answers must be one of {', '.join(ANSWER_MODES)}, got {answers!r}")
    if schema is None or answers == "free":
        return None
    return schema if answers == "grounded" else without_grounding(schema)


class GroundingError(CloverError):
    """A grounded field that cannot be served (the caller's input: a 400 naming the field)."""


class NoCandidate(GroundingError):
    """No value written in the prompt fits a grounded field."""


def is_grounded(schema: Any) -> bool:
    """Whether any subschema of `schema` carries the keyword."""
    if isinstance(schema, dict):
        return schema.get(KEYWORD) in (True, RECORD) or any(is_grounded(value) for value in schema.values())
    if isinstance(schema, list):
        return any(is_grounded(value) for value in schema)
    return False


def without_keys(node: Any, drop) -> Any:
    """A copy of the schema `node` without the (key, value) pairs of its objects where `drop(key, value)`."""
    if isinstance(node, dict):
        return {key: without_keys(value, drop) for key, value in node.items() if not drop(key, value)}
    if isinstance(node, list):
        return [without_keys(value, drop) for value in node]
    return node


def without_grounding(schema: Any) -> Any:
    """A copy of `schema` without the keyword: the plain schema, for comparison."""
    return without_keys(schema, lambda key, _: key == KEYWORD)


def ground(schema: dict, prompt: str) -> dict:
    """A copy of `schema` where each grounded subschema is an enum of the prompt's values it accepts.
    GroundingError names the field where that is empty; an optional property is dropped instead, and
    an array whose items could hold none is left empty (where minItems allows)."""
    return _ground(copy.deepcopy(schema), prompt, "")


def _ground(node: Any, prompt: str, path: str) -> Any:
    if isinstance(node, list):
        return [_ground(value, prompt, f"{path}/{index}") for index, value in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if KEYWORD in node:
        if node[KEYWORD] is True:
            return _as_enum(node, prompt, path)
        if node[KEYWORD] == RECORD:
            return _as_record(node, prompt, path)
        raise GroundingError(f"{KEYWORD} at {path or '/'} takes true (a value) or {RECORD!r} (an object), got {node[KEYWORD]!r}")
    out = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            required = set(node.get("required", []))
            properties = {}
            for name, sub in value.items():
                try:
                    properties[name] = _ground(sub, prompt, f"{path}/properties/{name}")
                except NoCandidate:
                    if name in required:
                        raise
            out[key] = properties
        elif key == "items" and isinstance(value, dict):
            try:
                out[key] = _ground(value, prompt, f"{path}/items")
            except NoCandidate:
                if node.get("minItems", 0) > 0:
                    raise
                out[key] = False  # no item could be written: the list is empty
        else:
            out[key] = _ground(value, prompt, f"{path}/{key}")
    return out


def _as_record(node: dict, prompt: str, path: str) -> dict:
    plain = {key: value for key, value in node.items() if key != KEYWORD}
    if plain.get("type") != "object" or not is_grounded(plain.get("properties")):
        raise GroundingError(f"{KEYWORD}: {RECORD!r} at {path or '/'} needs an object with x-grounded properties")
    lines = [line for line in prompt.splitlines() if line.strip()]
    if len(lines) > MAX_RECORD_LINES:
        raise GroundingError(f"{KEYWORD}: {RECORD!r} at {path or '/'} reads at most {MAX_RECORD_LINES} lines; the prompt has "
                             f"{len(lines)} (ground the fields alone instead)")
    alternatives, seen = [], set()
    for line in lines:
        try:
            alternative = _ground(plain, line, path)  # builds new nodes: `plain` stays as it is
        except NoCandidate:
            continue  # a line without a value for some required field holds no record
        text = json.dumps(alternative, sort_keys=True)
        if text not in seen:
            seen.add(text)
            alternatives.append(alternative)
    if not alternatives:
        raise NoCandidate(f"the grounded record {path or '/'} has no line in the prompt with a value for each of its required fields")
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _as_enum(node: dict, prompt: str, path: str) -> dict:
    plain = {key: value for key, value in node.items() if key != KEYWORD}
    types = plain.get("type", [])
    types = {types} if isinstance(types, str) else set(types)
    if not types or not types <= {"string", "number", "integer"}:
        raise GroundingError(f"{KEYWORD} at {path or '/'} needs a type of string, number or integer (got {sorted(types) or 'none'})")
    validator = Draft202012Validator(plain)
    values, seen = [], set()
    for value in _candidates(plain, types, prompt):
        text = json.dumps(value)
        if text not in seen and validator.is_valid(value):
            seen.add(text)
            values.append(value)
            if len(values) == MAX_CANDIDATES:
                break
    if not values:
        raise NoCandidate(f"the grounded field {path or '/'} has no value written in the prompt that fits its schema")
    return {key: plain[key] for key in _KEEP if key in plain} | {"enum": values}


def _candidates(schema: dict, types: set[str], prompt: str):
    if types & {"number", "integer"}:
        for text in _numbers(prompt):
            if "." not in text:
                yield int(text)
            elif "number" in types:
                yield float(text)
    if "string" in types:
        pattern = schema.get("pattern")
        if pattern:
            core = pattern.removeprefix("^").removesuffix("$")
            try:
                alone = re.compile(rf"(?<![A-Za-z0-9])(?:{core})(?![A-Za-z0-9])")
            except re.error:
                alone = None
            if alone is not None:
                yield from (match.group() for match in alone.finditer(prompt))
                return
        for line in prompt.splitlines():
            words = [(m.start(), m.end()) for m in _WORD.finditer(line)]
            for first in range(len(words)):
                for last in range(first, min(first + MAX_WORDS, len(words))):
                    text = line[words[first][0]: words[last][1]].strip(_PUNCTUATION)
                    if text:
                        yield text


def _numbers(prompt: str):
    """The number literals of `prompt` that are values of their own (the module doc's rule), in order."""
    list_numbers = {match.end(1) for match in _LIST_NUMBER.finditer(prompt)}  # where each list number ends
    for match in _NUMBER.finditer(prompt):
        start, end = match.span()
        joined_before = start >= 2 and prompt[start - 1] in _JOINED and prompt[start - 2].isdigit()
        joined_after = end + 1 < len(prompt) and prompt[end] in _JOINED and prompt[end + 1].isdigit()
        if not (joined_before or joined_after or end in list_numbers):
            yield match.group()
