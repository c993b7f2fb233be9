"""Joint decisions: slot layouts in the engine (fixed tokens kept, answers within their options, distinct
answers), the drone_slots task (unique solutions, checker), `decide` and its bench entry."""

import itertools
import json
import random

import pytest

from cloverlm import CloverError
from cloverlm.bench.decisions import bench_decisions
from cloverlm.decoding.decisions import decide, decision_requests
from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import DecodeParams, Request, Slots, distinct_choices
from cloverlm.tasks.drone_slots import DroneSlots, consistent
from conftest import tiny_model


@pytest.mark.parametrize("strategy", ["threshold", "low_confidence"])
def test_slots_keep_the_layout_and_answer_within_the_options(strategy):
    model = tiny_model()
    layout = [40, None, 41, None, None, 42]
    options = [[50, 51], [60, 61, 62], [50, 51, 52]]
    steps = []
    request = Request([7, 8, 9, 10, 11], DecodeParams(block_size=4, threshold=0.01, strategy=strategy),
                      slots=Slots(layout, options), on_step=lambda _, block: steps.append(block))
    [completion] = Engine(model).generate([request])
    assert completion.finish_reason == "stop" and completion.blocks == 1 and len(completion.tokens) == len(layout)
    assert [t for t, fixed in zip(completion.tokens, layout) if fixed is not None] == [40, 41, 42]
    answers = [completion.tokens[i] for i in (1, 3, 4)]
    assert all(answer in allowed for answer, allowed in zip(answers, options))
    assert all(block[0] == 40 and block[5] == 42 for block in steps)


def test_distinct_slots_never_repeat_an_answer():
    model = tiny_model()
    for seed in range(4):
        layout = [None] * 6
        request = Request([5, 6, 7], DecodeParams(threshold=0.01, temperature=1.0, seed=seed),
                          slots=Slots(layout, [list(range(20, 26))] * 6, distinct=True))
        [completion] = Engine(model).generate([request])
        assert sorted(completion.tokens) == list(range(20, 26))


def test_bad_slots_get_a_clear_error():
    engine = Engine(tiny_model())
    for slots, message in (
        (Slots([None, None], [[5]]), "one non-empty list of options per None"),
        (Slots([None], [[2]]), "no mask or stop ids"),
        (Slots([None] * 500, [[5]] * 500), "one block"),
    ):
        with pytest.raises(CloverError, match=message):
            engine.submit(Request([5, 6], slots=slots))


def _run_bounded(engine: Engine, forwards: int):
    """Step until done, but fail (instead of hanging) past `forwards` forwards."""
    done = []
    for _ in range(forwards):
        done += engine.step()
        if not engine.has_work():
            return done
    raise AssertionError(f"still decoding after {forwards} forwards")


def test_distinct_slots_always_end_within_one_forward_per_slot():
    """Issue 22: slot 1 may take 50, 51 or 52, slots 2 and 3 only 50 or 51. Slot 1 taking 50 or 51 first
    used to leave slots 2 and 3 one option for two, so one stayed masked and the request never ended
    (seed 3 here); now every open slot is kept to options some complete assignment gives it, and each
    step unmasks at least one slot."""
    model = tiny_model()
    for seed in range(12):
        engine = Engine(model)
        engine.submit(Request([5, 6, 7], DecodeParams(threshold=0.99, temperature=1.0, seed=seed),
                              slots=Slots([None, 30, None, 31, None], [[50, 51, 52], [50, 51], [50, 51]], distinct=True)))
        [completion] = _run_bounded(engine, forwards=3)
        assert completion.forwards <= 3 and completion.finish_reason == "stop"
        assert completion.tokens[0] == 52 and {completion.tokens[2], completion.tokens[4]} == {50, 51}


def test_impossible_distinct_answers_are_refused_before_decoding(tokenizer):
    engine = Engine(tiny_model())
    with pytest.raises(CloverError, match="distinct slots 1, 2, 3 have fewer options between them than slots"):
        engine.submit(Request([5, 6], slots=Slots([None] * 3, [[50, 51]] * 3, distinct=True)))
    assert not engine.has_work()
    questions = [(f"q{i}", ["yes", "no"]) for i in (1, 2, 3)]
    with pytest.raises(CloverError, match=r"questions 1, 2, 3 have only 2 different options between them \(no, yes\)"):
        decision_requests(tokenizer, questions, "", True, DecodeParams(), distinct=True)
    # Hall's condition, not a count: 2 and 3 share one option, though there are four in all
    questions = [("q1", ["a", "b", "c"]), ("q2", ["yes"]), ("q3", ["yes"])]
    with pytest.raises(CloverError, match="questions 2, 3 have only 1 different option between them \\(yes\\)"):
        decision_requests(tokenizer, questions, "", True, DecodeParams(), distinct=True)
    assert decision_requests(tokenizer, questions, "", False, DecodeParams())  # one at a time: nothing to share


def test_distinct_choices_are_the_options_of_some_complete_assignment():
    rng = random.Random(0)
    for _ in range(400):
        options = [rng.sample(range(6), rng.randint(1, 4)) for _ in range(rng.randint(1, 5))]
        choices, crowded = distinct_choices(options)
        assignments = [a for a in itertools.product(*options) if len(set(a)) == len(a)]
        if assignments:
            assert crowded == [] and choices == [{a[i] for a in assignments} for i in range(len(options))]
        else:  # a group of slots with fewer options than slots, for the error message
            assert choices == [] and len({t for i in crowded for t in options[i]}) < len(crowded)


def test_drone_slots_have_exactly_one_solution():
    task = DroneSlots()
    for seed in range(20):
        example = task.generate(seed, drones=5 + seed % 4)
        allowed = example.truth["allowed"]
        solutions = [p for p in itertools.permutations(range(1, len(allowed) + 1))
                     if all(zone in allowed[d] for d, zone in enumerate(p))]
        assert len(solutions) == 1
        assert task.check(example, example.answer) == {"parsed": 1.0, "consistent": 1.0, "drones": 1.0, "exact": 1.0}
        assert consistent(example.truth["zones"], allowed)
    example = task.generate(0, drones=4)
    swapped = dict(example.truth["zones"], **{"1": example.truth["zones"]["2"]})
    assert task.check(example, "not json")["parsed"] == 0.0
    assert task.check(example, json.dumps(swapped))["consistent"] == 0.0
    with pytest.raises(ValueError):
        task.generate(0, drones=9)


def test_decide_joint_and_one_at_a_time(random_model, tokenizer):
    model = random_model
    task = DroneSlots()
    example = task.generate(1, drones=5)
    questions = task.questions(example)
    joint = decide(model, tokenizer, questions, example.prompt)
    alone = decide(model, tokenizer, questions, example.prompt, joint=False)
    distinct = decide(model, tokenizer, questions, example.prompt, distinct=True)
    for decision in (joint, alone, distinct):
        assert len(decision.answers) == 5 and all(a in {"1", "2", "3", "4", "5"} for a in decision.answers)
    assert len(set(distinct.answers)) == 5
    assert joint.forwards <= 5 and alone.forwards == 5  # one generation of one block, against five
    [request] = decision_requests(tokenizer, questions, "", True, DecodeParams())
    assert tokenizer.decode([t for t in request.slots.layout if t is not None]) == '{"1":"","2":"","3":"","4":"","5":""}'
    with pytest.raises(CloverError, match="exactly one token"):
        decide(model, tokenizer, [("Pick one", ["alpha beta", "b"])])
    with pytest.raises(CloverError, match="1..8 questions"):
        decide(model, tokenizer, [("q", ["1"])] * 9)


def test_bench_decisions_reports_each_mode(random_model, tokenizer):
    model = random_model
    report = bench_decisions(model, tokenizer, prompts=2, drones=4)
    assert set(report) == {"one_at_a_time", "joint", "joint_distinct", "prompts", "drones", "threshold"}
    for mode in ("one_at_a_time", "joint", "joint_distinct"):
        entry = report[mode]
        assert set(entry) == {"no_overlap", "consistent", "exact", "drone_accuracy", "wall_s_median", "forwards_median"}
        assert 0 <= entry["consistent"] <= entry["no_overlap"] <= 1 and entry["wall_s_median"] > 0
    assert report["joint_distinct"]["no_overlap"] == 1.0
