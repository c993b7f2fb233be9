"""The answer schema is part of the task (issue 21): every reference answer validates against it (jsonschema)
and is accepted, token by token, by the llguidance constraint the engine decodes under (decoding/grammar.py,
the base's tokenizer); wrong answers are rejected by both."""

import json

import pytest
from jsonschema import Draft202012Validator

from cloverlm.convert.load import load_folder_tokenizer
from cloverlm.decoding.grammar import Grammars
from cloverlm.decoding.grounding import without_grounding
from cloverlm.tasks import SUITE, get_task
from cloverlm.tasks.no_fly_zones import FIELDS
from cloverlm.tokenizer import stop_token_ids

SEEDS = range(200)


@pytest.fixture(scope="module")
def base():
    """The base's tokenizer (what `clover demo` decodes with) and its grammars."""
    tokenizer = load_folder_tokenizer("models/smollm2-clover")
    return tokenizer, Grammars(tokenizer, len(tokenizer), stop_token_ids(tokenizer))


def accepts(base, constraint, text: str, every_mask: bool = False) -> bool:
    """Whether `constraint` takes the tokens of `text` and then allows only an end token (the answer is
    complete). every_mask also checks each token against the mask the engine applies (slow: a mask is a
    vocabulary-wide bitmap)."""
    tokenizer, grammars = base
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if every_mask and not constraint.allowed()[token]:
            return False
        constraint.advance(token)
        if constraint.matcher.is_error():
            return False
    allowed = constraint.allowed()
    return bool(allowed[grammars.end_ids].all()) and int(allowed.sum()) == len(grammars.end_ids)


def no_fly_examples(name: str):
    """(example, schema) over SEEDS, message counts cycling through 1..20."""
    task = get_task(name)
    for seed in SEEDS:
        example = task.generate(seed, n_messages=seed % 20 + 1)
        yield example, task.answer_schema(example)


@pytest.mark.parametrize("name", ["no_fly_zones", "no_fly_zones_unseen"])
def test_every_no_fly_reference_answer_validates_and_the_grammar_accepts_it(base, name):
    """Under the plain schema and under the grounded one (compiled per prompt: its enums are the prompt's
    values), the reference answer stays writable: grounding never excludes the truth."""
    _, grammars = base
    fresh = {}  # one compiled plain constraint per schema (it depends on the message count only), copied per answer
    for example, schema in no_fly_examples(name):
        assert list(schema["items"]["properties"]) == list(FIELDS) == schema["items"]["required"]
        Draft202012Validator(schema).validate(json.loads(example.answer))
        plain = without_grounding(schema)
        key = json.dumps(plain)
        if key not in fresh:
            fresh[key] = grammars.constraint(grammars.json_schema(plain))
        assert accepts(base, fresh[key].copy(), example.answer, every_mask=example.seed < 3), example.seed
        if example.seed < 40:
            grounded = grammars.constraint(grammars.json_schema(schema, example.prompt))
            assert accepts(base, grounded, example.answer, every_mask=example.seed < 3), example.seed


def test_both_no_fly_families_publish_the_same_schema():
    seen, unseen = get_task("no_fly_zones"), get_task("no_fly_zones_unseen")
    for seed in range(5):
        assert seen.answer_schema(seen.generate(seed)) == unseen.answer_schema(unseen.generate(seed))


def test_every_kv_reference_answer_validates_and_the_grammar_accepts_it(base):
    _, grammars = base
    task = get_task("kv_retrieval")
    for seed in SEEDS:
        example = task.generate(seed, n_pairs=seed % 60 + 3)
        schema = task.answer_schema(example)
        assert schema["required"] == list(example.truth)  # the question's keys, in its order
        Draft202012Validator(schema).validate(json.loads(example.answer))
        assert accepts(base, grammars.constraint(grammars.json_schema(schema)), example.answer, seed < 3), seed


def test_tool_call_answers_are_accepted_by_the_grammar_of_the_offered_tools(base):
    """tool_call publishes no schema: its grammar is the server's for the example's tools."""
    _, grammars = base
    task = get_task("tool_call")
    for seed in range(60):
        example = task.generate(seed)
        assert task.answer_schema(example) is None
        functions = [tool["function"] for tool in example.tools]
        grammar = grammars.tool_calls([(f["name"], f["parameters"]) for f in functions], single=True)
        assert accepts(base, grammars.constraint(grammar), example.answer, every_mask=seed < 2), seed
        [called] = [f for f in functions if f["name"] == example.truth["name"]]
        Draft202012Validator(called["parameters"]).validate(example.truth["arguments"])
        if seed < 5:  # a tool the request was not offered
            wrong = example.answer.replace(example.truth["name"], "launch_rocket")
            assert not accepts(base, grammars.constraint(grammar), wrong)


def test_the_other_suite_tasks_publish_none():
    for name in SUITE:
        if name not in ("no_fly_zones", "kv_retrieval", "tool_call"):
            task = get_task(name)
            assert task.answer_schema(task.generate(0)) is None


def _zone_answers(seed: int):
    task = get_task("no_fly_zones")
    example = task.generate(seed, n_messages=10)
    return example, task.answer_schema(example), json.loads(example.answer)


def _wrong_answers(zones: list[dict]) -> dict[str, list]:
    first = zones[0]
    return {
        "unit MI": [{**first, "unit": "MI"}, *zones[1:]],
        "missing key": [{k: v for k, v in first.items() if k != "lower"}, *zones[1:]],
        "extra key": [{**first, "note": "x"}, *zones[1:]],
        "number as a string": [{**first, "lat": str(first["lat"])}, *zones[1:]],
        "id of another year": [{**first, "id": first["id"].replace("/26", "/25")}, *zones[1:]],
        "time without Z": [{**first, "start": first["start"][:-1]}, *zones[1:]],
        "altitude in metres": [{**first, "upper": "300M"}, *zones[1:]],
        "more zones than messages": zones * 11,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wrong_no_fly_answers_are_rejected_by_the_schema_and_the_grammar(base, seed):
    _, grammars = base
    example, schema, zones = _zone_answers(seed)
    validator = Draft202012Validator(schema)
    fresh = grammars.constraint(grammars.json_schema(schema, example.prompt))
    plain = grammars.constraint(grammars.json_schema(without_grounding(schema)))
    # a value the messages do not write: schema-valid, so the plain grammar takes it; the grounded one does not
    invented = json.dumps([{**zones[0], "lat": round(zones[0]["lat"] + 0.0001, 4)}, *zones[1:]], separators=(",", ":"))
    assert validator.is_valid(json.loads(invented)) and accepts(base, plain.copy(), invented)
    assert not accepts(base, fresh.copy(), invented)
    for what, wrong in _wrong_answers(zones).items():
        text = json.dumps(wrong, separators=(",", ":"))
        assert not validator.is_valid(wrong), what
        assert not accepts(base, fresh.copy(), text), what
    # Key order is the instruction's: JSON schema cannot say it, the grammar does
    swapped = [{"lat": zones[0]["lat"], **{k: v for k, v in zones[0].items() if k != "lat"}}, *zones[1:]]
    assert not accepts(base, fresh.copy(), json.dumps(swapped, separators=(",", ":")))
    assert accepts(base, fresh.copy(), example.answer)


def test_wrong_kv_answers_are_rejected(base):
    _, grammars = base
    task = get_task("kv_retrieval")
    example = task.generate(7, n_queries=2)
    schema = task.answer_schema(example)
    first, second = example.truth
    wrong = {
        "missing key": {first: example.truth[first]},
        "extra key": {**example.truth, "k-000000": "amber"},
        "value as a number": {first: 123456, second: example.truth[second]},
        "two words": {first: "amber basil", second: example.truth[second]},
    }
    for what, answer in wrong.items():
        assert not Draft202012Validator(schema).is_valid(answer), what
        text = json.dumps(answer, separators=(",", ":"))
        assert not accepts(base, grammars.constraint(grammars.json_schema(schema)), text), what
