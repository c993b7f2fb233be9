"""Short strings that end a string under a `pattern`: what budget-aware closing writes there (issue 29).

A grammar's shortest ending (decoding/grammar.py) closes a string by writing its quote. Under a pattern
the quote may not be allowed yet (`^.*\\.md$` needs `.md` first, `\\d{3}-[A-Z]{2}` a code somewhere), and
no token-by-token choice finds the way there: the walk found no ending, so such strings ran to the
limit (seen on real-world schemas: `pulumipulumi…` in a `.md` path). Here each pattern of a schema
gives the shortest strings matching each suffix of its top-level sequence (`^[0-9]+x[0-9]+$` gives
"0x0", "x0", "0", ""); the walk tries them, each followed by the quote, and takes the first the grammar
accepts after what is already written.

The pattern's structure comes from the standard library's own regex parser. Constructs without a
shortest sample (back references) give no tails; a pattern Python cannot parse gives none.
"""

from __future__ import annotations

import json
import re
from re import (
    _parser as sre,  # the stdlib's parser of `re` patterns (its node names are public constants there)
)
from typing import Any

# characters tried, in order, for a character class or a negated literal
_CHARS = "0aA1xzZ9_-. ,:/" + "".join(chr(c) for c in range(33, 127))
_CATEGORIES = {"CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s", "CATEGORY_NOT_SPACE": r"\S",
               "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W"}
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT}
_ZERO_WIDTH = {sre.AT, sre.ASSERT, sre.ASSERT_NOT}


def _in_class(items: list, char: str) -> bool:
    negate = bool(items) and items[0][0] is sre.NEGATE
    hit = False
    for op, arg in items:
        if op is sre.LITERAL:
            hit = hit or ord(char) == arg
        elif op is sre.RANGE:
            hit = hit or arg[0] <= ord(char) <= arg[1]
        elif op is sre.CATEGORY:
            hit = hit or re.fullmatch(_CATEGORIES[str(arg)], char) is not None
    return hit != negate


def _pick(test) -> str:
    char = next((c for c in _CHARS if test(c)), None)
    if char is None:
        raise ValueError("no printable character fits")
    return char


def _shortest(nodes) -> str:
    """The shortest string matching the node sequence (first choices for classes); ValueError if none
    can be written."""
    out = []
    for op, arg in nodes:
        if op is sre.LITERAL:
            out.append(chr(arg))
        elif op is sre.NOT_LITERAL:
            out.append(_pick(lambda c, arg=arg: ord(c) != arg))
        elif op is sre.ANY:
            out.append("a")
        elif op is sre.IN:
            out.append(_pick(lambda c, arg=arg: _in_class(arg, c)))
        elif op in _REPEATS:
            low, _, body = arg
            out.append(_shortest(body) * low)
        elif op is sre.SUBPATTERN:
            out.append(_shortest(arg[-1]))
        elif op is sre.ATOMIC_GROUP:
            out.append(_shortest(arg))
        elif op is sre.BRANCH:
            out.append(min((_shortest(branch) for branch in arg[1]), key=len))
        elif op not in _ZERO_WIDTH:
            raise ValueError(f"no sample for {op}")
    return "".join(out)


def pattern_tails(pattern: str) -> list[str]:
    """The shortest strings matching each suffix of `pattern`'s top-level sequence (of each branch, for
    a pattern that is one alternation), shortest first; [] where the pattern has none."""
    try:
        nodes = list(sre.parse(pattern))
        written = [node for node in nodes if node[0] not in _ZERO_WIDTH]
        if len(written) == 1 and written[0][0] is sre.BRANCH:
            sequences = [list(branch) for branch in written[0][1][1]]
        else:
            sequences = [nodes]
        tails = {_shortest(sequence[start:]) for sequence in sequences for start in range(len(sequence) + 1)}
    except (re.error, ValueError, KeyError, RecursionError):
        return []
    return sorted(tails, key=lambda tail: (len(tail), tail))


def schema_patterns(schema: Any) -> list[str]:
    """Every `pattern` string in a schema, in order of first appearance."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str) and value not in found:
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return found


def string_tails(grammar: str, encode) -> list[list[int]]:
    """For a JSON-schema grammar (`Grammars.json_schema`'s text): the tails of its patterns as token ids,
    each with the closing quote, shortest first. `encode` maps a str to token ids. Other grammars: []."""
    try:
        spec = json.loads(grammar)
    except json.JSONDecodeError:  # a lark grammar (tool calls)
        return []
    tails = {tail for pattern in schema_patterns(spec) for tail in pattern_tails(pattern)}
    ids = [encode(json.dumps(tail)[1:]) for tail in tails]  # the JSON-escaped text and its closing quote
    return sorted(ids, key=len)
