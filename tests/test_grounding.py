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


def _records(schema: dict) -> list[dict]:
    """Per grounded record (an alternative of the zone list's items): each field's enum."""
    items = schema["items"]
    return [{name: sub["enum"] for name, sub in record["properties"].items()} for record in items.get("anyOf", [items])]


@pytest.mark.parametrize("task", ["no_fly_zones", "no_fly_zones_unseen"])
def test_every_no_fly_truth_zone_is_a_record_of_its_own_line_and_every_candidate_is_written(task):
    for seed in range(12):
        example = tasks.generate(task, 7000 + seed, n_messages=20)
        records = _records(ground(tasks.get_task(task).answer_schema(example), example.prompt))
        lines = example.prompt.splitlines()
        assert len(records) <= len(lines)
        for record in records:
            assert record["unit"] == ["NM", "KM"]  # not grounded: an enum already
            # every candidate of a record is written in one line of the prompt
            written = [(v if isinstance(v, str) else json.dumps(v)) for field in FIELDS if field != "unit" for v in record[field]]
            assert any(all(text in line for text in written) for line in lines), record
        for zone in example.truth:
            assert any(all(zone[field] in record[field] for field in FIELDS) for record in records), (seed, zone)


def test_a_record_takes_every_value_from_one_line(tokenizer):
    grammars = Grammars(tokenizer, len(tokenizer), stop_token_ids(tokenizer))
    record = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z][0-9]$", "x-grounded": True},
                                               "lat": NUMBER, "unit": {"enum": ["NM", "KM"]}},
              "required": ["id", "lat", "unit"], "additionalProperties": False, "x-grounded": "line"}
    prompt = "K7 at 61.8719\nno value here\nQ2 at 5.5 or 6.25\nno id, only 7.5"
    grammar = grammars.json_schema({"type": "array", "items": record}, prompt)

    def accepts(text: str) -> bool:
        constraint = grammars.constraint(grammar)
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            if not constraint.allows(token):
                return False
            constraint.advance(token)
        return constraint.finished()

    assert accepts('[{"id":"K7","lat":61.8719,"unit":"NM"},{"id":"Q2","lat":6.25,"unit":"KM"}]')
    assert not accepts('[{"id":"K7","lat":5.5,"unit":"NM"}]')  # each value is in the prompt, not in one line
    assert not accepts('[{"id":"Q2","lat":7.5,"unit":"NM"}]')  # the last line has no id: no record
    assert len(ground(record, prompt)["anyOf"]) == 2 and ground(record, "K7 at 1.5") == {
        "type": "object", "properties": {"id": {"enum": ["K7"]}, "lat": {"enum": [7, 1.5]}, "unit": {"enum": ["NM", "KM"]}},
        "required": ["id", "lat", "unit"], "additionalProperties": False}  # one line: no anyOf
    assert not is_grounded(without_grounding(record)) and is_grounded(record)
    with pytest.raises(GrammarError, match="no line in the prompt"):
        # the id's 7 is no latitude above 10: the id and the latitude stand on different lines
        above_10 = record | {"properties": record["properties"] | {"lat": NUMBER | {"minimum": 10}}}
        grammars.json_schema(above_10, "K7 on one line\nand 61.8719 on the next")
    with pytest.raises(GroundingError, match="at most 1024 lines"):
        ground(record, "\n".join(f"K{i % 10} at {i}.5" for i in range(1025)))
    with pytest.raises(GroundingError, match="needs an object"):
        ground({"type": "number", "x-grounded": "line"}, "1")
    with pytest.raises(GroundingError, match="takes true"):
        ground({"type": "number", "x-grounded": "yes"}, "1")


def test_numbers_as_written_and_strings_by_pattern_or_words():
    prompt = "1. Zone K7 at 61.8719N 024.5E r=5.30KM ver 1.2.3, -7 m, 2026-07-09T05:00Z\nnew line here"
    values = "12. A1234/26 from 2026-07-09T14:30Z at 10:45, 200FT-400FT, 5-7 or 3 NM\n  4) x 12.5\nstep 2. 8"
    schema = {"type": "object", "properties": {
        "lat": NUMBER, "n": {"type": "integer", "x-grounded": True},
        "id": {"type": "string", "pattern": "^[A-Z][0-9]$", "x-grounded": True},
        "words": {"type": "string", "maxLength": 9, "x-grounded": True, "description": "kept"}}}
    grounded = ground(schema, prompt)["properties"]
    # 024.5 (a leading zero) and 1.2.3 (no number) are not JSON numbers as written; 5.30 is 5.3 written shorter
    assert grounded["lat"]["enum"] == [7, 61.8719, 5.3, -7]
    assert grounded["n"]["enum"] == [7, -7]
    # a date's, a time's or a reference's digits, a list's number and a range's hyphen are no values
    assert ground(schema, values)["properties"]["n"]["enum"] == [200, 400, 3, 2, 8]
    assert ground(schema, values)["properties"]["lat"]["enum"] == [200, 400, 3, 12.5, 2, 8]
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
