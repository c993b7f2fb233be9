import json
import random
import re
import statistics

import pytest

from cloverlm.tasks import TASKS, Example, generate, get_task, parse_zones
from cloverlm.tasks.no_fly_zones import FIELDS
from cloverlm.tokenizer import parse_tool_call

SEEDS = range(200)
GARBAGE = [
    "",
    "   ",
    "[",
    '[{"id": 5}]',
    "{}",
    "null",
    "the zones are 47.1N and 8.2E",
    '{"a": [1, 2',
    "[[[[[[[",
]


@pytest.fixture(scope="module")
def examples() -> dict[str, list[Example]]:
    return {name: [generate(name, s) for s in SEEDS] for name in TASKS}


def test_registry():
    assert set(TASKS) == {"no_fly_zones", "tool_call", "kv_retrieval", "arithmetic", "repeat"}
    assert get_task("kv_retrieval").name == "kv_retrieval"
    with pytest.raises(ValueError, match="unknown task 'x'; choose from: no_fly_zones"):
        get_task("x")


@pytest.mark.parametrize("name", list(TASKS))
def test_deterministic_and_seed_dependent(name, examples):
    random.seed(1)
    first = generate(name, 7)
    random.seed(2)
    assert first == generate(name, 7) == examples[name][7]
    assert len({ex.prompt for ex in examples[name]}) >= 190


@pytest.mark.parametrize("name", list(TASKS))
def test_answer_is_exact_and_json_safe(name, examples):
    for ex in examples[name]:
        assert ex.task == name
        scores = get_task(name).check(ex, ex.answer)
        assert all(v == 1.0 for v in scores.values()), (ex.seed, scores)
        json.dumps(ex.truth)
        json.dumps(ex.tools)


@pytest.mark.parametrize("name", list(TASKS))
def test_value_spans_are_copied_from_prompt(name, examples):
    for ex in examples[name]:
        for start, end in ex.value_spans:
            assert 0 <= start < end <= len(ex.answer)
            assert ex.answer[start:end] in ex.prompt, (ex.seed, ex.answer[start:end])
    if name != "arithmetic":
        assert all(ex.value_spans for ex in examples[name])


@pytest.mark.parametrize("name", list(TASKS))
def test_garbage_scores_zero(name, examples):
    for ex in examples[name][:20]:
        for output in [*GARBAGE, ex.answer[: len(ex.answer) // 2]]:
            scores = get_task(name).check(ex, output)
            assert scores["exact"] == 0.0
            assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in scores.values())
            assert {k: v for k, v in scores.items() if k.startswith("field/")} == {
                k: 0.0 for k in scores if k.startswith("field/")
            }


@pytest.mark.parametrize("name", list(TASKS))
def test_length_bound(name, examples):
    assert max(len(ex.prompt) + len(ex.answer) for ex in examples[name]) < 4200


# --- no_fly_zones


def test_no_fly_prompt_layout(examples):
    for ex in examples["no_fly_zones"]:
        *messages, instruction = ex.prompt.split("\n")
        assert [m.split(". ", 1)[0] for m in messages] == [str(i) for i in range(1, 21)]
        assert all(len(m) <= 170 for m in messages)
        assert "JSON" in instruction
        assert 1 <= len(ex.truth) <= 5
        ids = [re.search(r"[A-Z]\d{4}/26", m).group() for m in messages]
        assert len(set(ids)) == 20
        # Each zone's values all come from its own message (the one whose first id is the zone's).
        for zone in ex.truth:
            own = messages[ids.index(zone["id"])]
            for field in FIELDS[1:]:
                text = str(zone[field])
                assert text in own, (ex.seed, field, text, own)
    # Distractors that look like zones (coordinates, drone wording) appear in every prompt.
    coords = re.compile(r"\d+\.\d{4}N \d+\.\d{4}E")
    for ex in examples["no_fly_zones"]:
        with_coords = [m for m in ex.prompt.split("\n") if coords.search(m)]
        assert len(with_coords) > len(ex.truth)
    drone_words = sum("lifted" in ex.prompt or "CANCELLED" in ex.prompt for ex in examples["no_fly_zones"])
    assert drone_words > 100


def test_no_fly_zone_count_varies(examples):
    counts = {len(ex.truth) for ex in examples["no_fly_zones"]}
    assert counts == {1, 2, 3, 4, 5}
    assert generate("no_fly_zones", 3, n_messages=8).prompt.count("\n") == 8


def _zones_example(n: int) -> Example:
    return next(ex for ex in (generate("no_fly_zones", s) for s in range(100)) if len(ex.truth) == n)


def test_no_fly_partial_wrong_radius():
    ex = _zones_example(2)
    zones = json.loads(ex.answer)
    zones[0]["radius"] += 1
    scores = get_task("no_fly_zones").check(ex, json.dumps(zones))
    assert scores["parsed"] == 1.0
    assert scores["field/radius"] == 0.5
    assert scores["field/lat"] == 1.0
    assert scores["zone_exact_match"] == 0.5
    assert scores["count"] == 1.0
    assert scores["exact"] == 0.0


def test_no_fly_missing_extra_and_reordered():
    ex = _zones_example(4)
    zones = json.loads(ex.answer)
    check = get_task("no_fly_zones").check
    missing = check(ex, json.dumps(zones[:3]))
    assert (missing["field/id"], missing["zone_exact_match"], missing["count"]) == (0.75, 0.75, 0.0)
    extra = check(ex, json.dumps([*zones, {**zones[0], "id": "Z0000/26"}]))
    assert (extra["field/end"], extra["zone_exact_match"], extra["count"], extra["exact"]) == (
        1.0,
        0.8,
        0.0,
        0.0,
    )
    # Matching is by id, so order only matters for "exact".
    swapped = check(ex, json.dumps(zones[::-1]))
    assert (swapped["zone_exact_match"], swapped["exact"]) == (1.0, 0.0)
    # Numbers written as strings are the wrong type.
    as_text = check(ex, json.dumps([{**z, "lat": str(z["lat"])} for z in zones]))
    assert (as_text["field/lat"], as_text["field/lon"]) == (0.0, 1.0)


def test_parse_zones_is_lenient():
    assert parse_zones('Sure: [{"id": "A1/26"}, 3] trailing') == [{"id": "A1/26"}]
    assert parse_zones('[{"id": "A1/26"') == []
    assert parse_zones("no list here") == []


# --- tool_call


def test_tool_call_schemas(examples):
    for ex in examples["tool_call"]:
        names = [t["function"]["name"] for t in ex.tools]
        assert 2 <= len(names) <= 4 and len(set(names)) == len(names)
        assert ex.truth["name"] in names
        assert ex.answer.startswith("<tool_call>\n{") and ex.answer.endswith("}\n</tool_call>")
        (tool,) = [t for t in ex.tools if t["function"]["name"] == ex.truth["name"]]
        assert list(ex.truth["arguments"]) == tool["function"]["parameters"]["required"]
        assert ex.tools[0]["type"] == "function"
    ex = examples["tool_call"][0]
    ex.tools[0]["function"]["name"] = "mutated"
    assert generate("tool_call", 0).tools[0]["function"]["name"] != "mutated"


def test_tool_call_partial():
    ex = next(e for e in (generate("tool_call", s) for s in range(100)) if len(e.truth["arguments"]) == 5)
    check = get_task("tool_call").check
    call = parse_tool_call(ex.answer)
    wrong_arg = {**call, "arguments": {**call["arguments"], "date": "1999-01-01"}}
    scores = check(ex, f"<tool_call>\n{json.dumps(wrong_arg)}\n</tool_call>")
    assert scores == {"parsed": 1.0, "name": 1.0, "arguments": 0.8, "exact": 0.0}
    assert check(ex, json.dumps(call)) == {"parsed": 1.0, "name": 1.0, "arguments": 1.0, "exact": 0.0}
    wrong_name = {**call, "name": "get_weather"}
    assert check(ex, f"<tool_call>{json.dumps(wrong_name)}</tool_call>")["name"] == 0.0
    assert check(ex, '<tool_call>{"name": "x", "arguments": [1]}</tool_call>')["arguments"] == 0.0


# --- kv_retrieval


def test_kv_layout_and_partial(examples):
    ex = generate("kv_retrieval", 5, n_pairs=30, n_queries=2)
    assert ex.prompt.count("\n") == 30 and len(ex.truth) == 2
    (k1, v1), (k2, _) = ex.truth.items()
    assert f"\n{k1}: {v1}\n" in f"\n{ex.prompt}"
    check = get_task("kv_retrieval").check
    assert check(ex, json.dumps({k1: v1, k2: "nope"})) == {"parsed": 1.0, "value": 0.5, "exact": 0.0}
    assert {len(e.truth) for e in examples["kv_retrieval"]} == {1, 2, 3}
    assert all(e.prompt.count("\n") == 60 for e in examples["kv_retrieval"])


# --- arithmetic


def test_arithmetic_kinds_and_values(examples):
    exs = examples["arithmetic"]
    assert any(isinstance(e.truth, list) for e in exs) and any(isinstance(e.truth, int) for e in exs)
    ex = next(e for e in exs if e.prompt.startswith("List:") and "ascending" in e.prompt)
    xs = json.loads(ex.prompt.split("\n")[0].removeprefix("List: "))
    assert ex.truth == sorted(xs)
    ex = next(e for e in exs if e.prompt.endswith("?") and not e.prompt.startswith("List:"))
    check = get_task("arithmetic").check
    assert check(ex, f" {ex.answer} ") == {"parsed": 1.0, "exact": 1.0}
    assert check(ex, str(ex.truth + 1)) == {"parsed": 1.0, "exact": 0.0}
    assert check(ex, f"{ex.truth}.0") == {"parsed": 1.0, "exact": 0.0}


def test_arithmetic_chain_value():
    ex = next(e for e in (generate("arithmetic", s) for s in range(50)) if not e.prompt.startswith("List:"))
    env = {}
    *lines, question = ex.prompt.split("\n")
    for line in lines:
        name, expr = line.split(" = ")
        env[name] = eval(expr, {}, dict(env))
    assert env[question.removeprefix("What is ").removesuffix("?")] == ex.truth


def test_length_distribution_is_reasonable(examples):
    no_fly = [len(ex.prompt) + len(ex.answer) for ex in examples["no_fly_zones"]]
    assert 2000 < statistics.median(no_fly) < 3800
