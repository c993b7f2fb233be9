"""The shortest strings a pattern accepts, which budget-aware closing writes to end a string
(decoding/patterns.py): each tail matches the rest of its pattern, and a written prefix plus a tail
matches the whole."""

import json
import re

import pytest

from cloverlm.decoding.patterns import pattern_tails, schema_patterns, string_tails


@pytest.mark.parametrize("pattern, tails", [
    (r"^.*\.md$", ["", "d", "md", ".md"]),
    (r"\d{3}-[A-Z]{2}", ["", "AA", "-AA", "000-AA"]),
    (r"^[0-9]+x[0-9]+$", ["", "0", "x0", "0x0"]),
    (r"^[^a-c\d]{2}$", ["", "AA"]),
    (r"^(?:foo|ba)r$", ["", "r", "bar"]),
    (r"^(?:ab|c)$", ["", "b", "c", "ab"]),  # one alternation: the suffixes of each branch
])
def test_tails_are_the_shortest_matches_of_each_suffix(pattern, tails):
    assert pattern_tails(pattern) == tails
    assert re.search(pattern, tails[-1])  # the longest: a match of the whole pattern


def test_a_prefix_and_a_tail_match_the_pattern():
    for prefix, pattern in (("notes/readme", r"^.*\.md$"), ("632x", r"^[0-9]+x[0-9]+$"), ("USPrice_", r"\d{3}-[A-Z]{2}")):
        assert any(re.search(pattern, prefix + tail) for tail in pattern_tails(pattern))


def test_patterns_without_a_sample_give_no_tails():
    assert pattern_tails(r"(a)\1") == []  # a back reference
    assert pattern_tails(r"^\p{L}+$") == []  # ECMA-262 syntax Python's parser does not read
    assert pattern_tails("(") == []


def test_the_schema_grammar_gives_its_patterns_tails_with_the_quote():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x\\.md$"},
                                               "b": {"type": "array", "items": {"pattern": "^x\\.md$"}}}}
    assert schema_patterns(schema) == ["^x\\.md$"]
    grammar = json.dumps({"grammars": [{"name": "json_schema", "json_schema": schema}]})
    assert string_tails(grammar, lambda text: list(text)) == [['"'], ['d', '"'], ['m', 'd', '"'], ['.', 'm', 'd', '"'],
                                                             ['x', '.', 'm', 'd', '"']]
    assert string_tails('start: "a"', list) == []  # a lark grammar
