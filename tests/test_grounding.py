"""Grounded values (issue 29): a schema's `x-grounded` fields become enums of what the prompt writes, the
truth of every no_fly answer stays among them, and a field with nothing to copy is named in the error."""

import json

import pytest

from cloverlm import tasks
from cloverlm.decoding.grammar import GrammarError, Grammars
from cloverlm.decoding.grounding import GroundingError, ground, is_grounded, schema_for, without_grounding
from cloverlm.tasks.no_fly_zones import FIELDS
from cloverlm.tokenizer import stop_token_ids

NUMBER = {"type": "number", "x-grounded": True}


def _enums(schema: dict) -> dict:
    return {name: sub["enum"] for name, sub in schema["items"]["properties"].items()}


@pytest.mark.parametrize("task", ["no_fly_zones", "no_fly_zones_unseen"])
def test_every_no_fly_truth_value_is_a_candidate_and_every_candidate_is_written(task):
    for seed in range(12):
        example = tasks.generate(task, 7000 + seed, n_messages=20)
        enums = _enums(ground(tasks.get_task(task).answer_schema(example), example.prompt))
        assert enums["unit"] == ["NM", "KM"]  # not grounded: an enum already
        for zone in example.truth:
            for field in FIELDS:
                assert zone[field] in enums[field], (seed, field, zone[field])
        for field in FIELDS:
            if field != "unit":
                assert all((v if isinstance(v, str) else json.dumps(v)) in example.prompt for v in enums[field]), field


def test_numbers_as_written_and_strings_by_pattern_or_words():
    prompt = "1. Zone K7 at 61.8719N 024.5E r=5.30KM ver 1.2.3, -7 m, 2026-07-09T05:00Z\nnew line here"
    schema = {"type": "object", "properties": {
        "lat": NUMBER, "n": {"type": "integer", "x-grounded": True},
        "id": {"type": "string", "pattern": "^[A-Z][0-9]$", "x-grounded": True},
        "words": {"type": "string", "maxLength": 9, "x-grounded": True, "description": "kept"}}}
    grounded = ground(schema, prompt)["properties"]
    # 024.5 (a leading zero) and 1.2.3 (no number) are not JSON numbers as written; 5.30 is 5.3 written shorter
    assert grounded["lat"]["enum"] == [1, 7, 61.8719, 5.3, -7, 2026]
    assert grounded["n"]["enum"] == [1, 7, -7, 2026]
    assert grounded["id"]["enum"] == ["K7"]
    # words and runs of words of one line, ends stripped of punctuation, at most maxLength long
    assert grounded["words"] == {"description": "kept", "enum": [
        "1", "1. Zone", "Zone", "Zone K7", "K7", "K7 at", "at", "61.8719N", "024.5E", "r=5.30KM", "ver", "ver 1.2.3", "1.2.3",
        "1.2.3, -7", "-7", "-7 m", "m", "new", "new line", "line", "line here", "here"]}
    assert without_grounding(schema)["properties"]["lat"] == {"type": "number"} and not is_grounded(without_grounding(schema))
    assert schema_for(schema, "grounded") is schema and schema_for(schema, "free") is None
    assert schema_for(schema, "schema") == without_grounding(schema)


def test_a_field_with_nothing_to_copy(tokenizer):
    grammars = Grammars(tokenizer, len(tokenizer), stop_token_ids(tokenizer))
    schema = {"type": "object", "properties": {"lat": NUMBER, "note": {"type": "string", "pattern": "^Q[0-9]$", "x-grounded": True}},
              "required": ["lat"], "additionalProperties": False}
    with pytest.raises(GrammarError, match="/properties/lat"):
        grammars.json_schema(schema, "no numbers at all")
    # an optional field without candidates is dropped: the answer cannot write it
    assert "note" not in ground(schema, "at 5.5 and Q10")["properties"]
    # a list whose items cannot be grounded is empty, unless it must hold some
    listed = {"type": "array", "items": schema}
    assert ground(listed, "nothing")["items"] is False
    with pytest.raises(GrammarError, match="/items/properties/lat"):
        grammars.json_schema(listed | {"minItems": 1}, "nothing")
    with pytest.raises(GrammarError, match="needs the prompt"):
        grammars.json_schema(schema)
    with pytest.raises(GroundingError, match="string, number or integer"):
        ground({"type": "object", "properties": {"a": {"type": "array", "x-grounded": True}}}, "1 2 3")
