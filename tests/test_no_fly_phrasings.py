"""no_fly_zones in many phrasings: the SEEN family (training task) and the held-out UNSEEN family
(no_fly_zones_unseen) write exact, verbatim answers and never each other's templates."""

import json
import random
import re
from string import Formatter

import pytest

from cloverlm.cli import build_parser
from cloverlm.errors import CloverError
from cloverlm.tasks import HELD_OUT, SUITE, TASKS, generate, get_task, parse_zones
from cloverlm.tasks.no_fly_phrasings import SEEN, UNSEEN, template_fields, template_pattern
from cloverlm.tasks.no_fly_zones import FIELDS, INSTRUCTION, prompt_messages
from cloverlm.tokenizer import parse_json

FAMILIES = {"no_fly_zones": SEEN, "no_fly_zones_unseen": UNSEEN}
OTHER = {"no_fly_zones": UNSEEN, "no_fly_zones_unseen": SEEN}
# every message count 1..20 fifteen times, plus the full 20-message prompt of each seed
CASES = [(seed, n) for seed in range(300) for n in sorted({1 + seed % 20, 20})]
KNOWN_FIELDS = {"id", "old", "fir", "ad", "lat", "lon", "radius", "unit", "lower", "upper", "start", "end",
                "rwy", "rwy_end", "freq", "freq2", "twy"}  # fmt: skip

ORIGINAL_ZONES = (
    "{id} NOTAMN Q) {fir}/QRTCA A) {ad} B) {start} C) {end} E) UAS PROHIBITED WI {radius}{unit} OF "
    "{lat}N {lon}E F) {lower} G) {upper}",
    "{id} NOTAMN Q) {fir}/QRTCA A) {ad} B) {start} C) {end} E) NO DRONE FLT {radius}{unit} RADIUS "
    "{lat}N {lon}E F) {lower} G) {upper}",
    "Notice {id}: drones are not allowed within {radius} {unit} of {lat}N {lon}E, from {lower} to {upper}, "
    "{start} to {end}.",
    "{id}: no UAS flights in a radius of {radius} {unit} around {lat}N {lon}E between {lower} and {upper}, "
    "valid {start} until {end}.",
    "Drone ban {id} - {radius}{unit} around {lat}N {lon}E, {lower} to {upper}, from {start} to {end}.",
)
ORIGINAL_DISTRACTORS = (
    "{id} NOTAMN Q) {fir}/QMRLC A) {ad} B) {start} C) {end} E) RWY {rwy} CLSD DUE WIP",
    "{id} NOTAMN Q) {fir}/QOBCE A) {ad} B) {start} C) {end} E) CRANE ERECTED AT {lat}N {lon}E "
    "HGT {upper} AGL, LGTD",
    "{id} NOTAMN Q) {fir}/QCAXX A) {ad} B) {start} C) {end} E) TWR FREQ {freq} WITHDRAWN, USE {freq2}",
    "{id} NOTAMN Q) {fir}/QWPLW A) {ad} B) {start} C) {end} E) PJE WI {radius}{unit} OF {lat}N {lon}E "
    "F) {lower} G) {upper}",
    "{id} NOTAMC {old} Q) {fir}/QRTXX A) {ad} B) {start} E) UAS RESTRICTION WI {radius}{unit} OF "
    "{lat}N {lon}E CANCELLED",
    "{id} NOTAMN Q) {fir}/QICAS A) {ad} B) {start} C) {end} E) ILS RWY {rwy_end} U/S",
    "Notice {id}: increased bird activity near {lat}N {lon}E from {lower} to {upper}, {start} to {end}.",
    "Notice {id}: taxiway {twy} closed for works, {start} to {end}.",
    "Notice {id}: the drone restriction within {radius} {unit} of {lat}N {lon}E has been lifted as of "
    "{start}.",
    "{id}: glider activity within {radius} {unit} of {lat}N {lon}E, {lower} to {upper}, {start} until {end}.",
)


def templates(family) -> tuple[str, ...]:
    return family.zones + family.distractors


def words(template: str) -> set[str]:
    """The words of a template's literal text (no field values)."""
    return {
        w.lower() for text, _, _, _ in Formatter().parse(template) for w in re.findall(r"[A-Za-z]+", text)
    }


@pytest.fixture(scope="module")
def composed():
    """(example, composition) of every case, by task."""
    return {
        name: [(generate(name, s, n_messages=n), get_task(name).compose(s, n)) for s, n in CASES]
        for name in FAMILIES
    }


def test_registry_holds_the_unseen_family_out_of_training():
    unseen = get_task("no_fly_zones_unseen")
    assert unseen.name == "no_fly_zones_unseen" and unseen.family is UNSEEN
    assert get_task("no_fly_zones").family is SEEN
    assert "no_fly_zones_unseen" not in SUITE  # the bench and calibration cover the user's tasks
    eval_tasks = build_parser().parse_args(["eval"]).tasks  # clover eval reports both families
    assert eval_tasks[:2] == ["no_fly_zones", "tool_call"] and "no_fly_zones_unseen" in eval_tasks
    # not a training source: mixtures and the default tokenizer's sample text draw from TASKS only
    assert "no_fly_zones_unseen" not in TASKS and "no_fly_zones_unseen" in HELD_OUT
    with pytest.raises(ValueError, match="no_fly_zones_unseen"):
        get_task("nope")
    assert type(unseen).check is type(get_task("no_fly_zones")).check


def test_families_are_disjoint_and_keep_the_original_templates():
    assert set(ORIGINAL_ZONES) <= set(SEEN.zones)
    assert set(ORIGINAL_DISTRACTORS) <= set(SEEN.distractors)
    assert not set(templates(SEEN)) & set(templates(UNSEEN))
    for family in (SEEN, UNSEEN):
        assert len(set(family.zones)) == len(family.zones) and len(set(family.distractors)) == len(
            family.distractors
        )
        for template in templates(family):
            assert template_fields(template) <= KNOWN_FIELDS, template
            assert "\n" not in template
        for template in family.zones:
            # every answer field, besides at most the NOTAM header's FIR and aerodrome
            assert set(FIELDS) <= template_fields(template) <= {*FIELDS, "fir", "ad"}, template
        # look-alikes: distractors with a radius around coordinates, like a zone
        assert sum({"radius", "lat", "lon"} <= template_fields(t) for t in family.distractors) >= 6
    assert len(SEEN.zones) >= 20 and len(UNSEEN.zones) >= 8


def test_widest_message_fits_a_numbered_line():
    """With every field at its widest, a message stays within 166 characters ("20. " + 166 = 170)."""
    widest = dict(id="A1234/26", old="A1234/26", fir="LSAS", ad="LSZH", lat="69.1234", lon="29.1234", radius="9.9",
                  unit="NM", lower="200FT", upper="3000FT", start="2026-12-28T23:30Z", end="2026-12-28T23:30Z",
                  rwy="18/36", rwy_end="18", freq="135.995", freq2="135.995", twy="A")  # fmt: skip
    for template in templates(SEEN) + templates(UNSEEN):
        assert len(template.format_map(widest)) <= 166, template


def test_unseen_zones_are_worded_differently():
    """Each unseen zone template has words no seen template uses (not just other punctuation), and no
    literal skeleton (the text between fields) is shared across families."""
    seen_words = set().union(*map(words, templates(SEEN)))
    for template in UNSEEN.zones:
        assert len(words(template) - seen_words) >= 2, (template, words(template) - seen_words)
    skeleton = lambda t: tuple(re.sub(r"\W+", " ", text).strip().lower() for text, *_ in Formatter().parse(t))  # noqa: E731
    assert not {skeleton(t) for t in SEEN.zones} & {skeleton(t) for t in UNSEEN.zones}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_reference_answer_is_exact_and_copied_verbatim(name, composed):
    task = get_task(name)
    for example, _ in composed[name]:
        assert example.task == name
        assert parse_json(example.answer, "[") == example.truth == parse_zones(example.answer)
        scores = task.check(example, example.answer)
        assert scores["zone_exact_match"] == scores["exact"] == scores["parsed"] == 1.0, (
            example.seed,
            scores,
        )
        assert all(v == 1.0 for v in scores.values()), (example.seed, scores)
        assert len(example.value_spans) == len(FIELDS) * len(example.truth)
        texts = [example.answer[a:b] for a, b in example.value_spans]
        want = [
            v if isinstance(v, str) else json.dumps(v)
            for zone in example.truth
            for v in (zone[f] for f in FIELDS)
        ]
        assert texts == want, example.seed
        messages = prompt_messages(example.prompt)
        assert example.prompt.split("\n")[-1] == INSTRUCTION
        assert all(len(line) <= 170 for line in example.prompt.split("\n")[:-1])
        for zone in example.truth:
            own = next(m for m in messages if re.search(r"[A-Z]\d{4}/26", m).group() == zone["id"])
            assert zone["unit"] in ("NM", "KM")
            for field in FIELDS:
                value = zone[field] if isinstance(zone[field], str) else json.dumps(zone[field])
                assert value in own, (example.seed, field, value, own)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_task_writes_only_its_own_family(name, composed):
    family, other = FAMILIES[name], OTHER[name]
    own_patterns = {t: template_pattern(t) for t in templates(family)}
    other_patterns = [template_pattern(t) for t in templates(other)]
    used_zones, used_distractors = set(), set()
    for example, composition in composed[name]:
        messages = prompt_messages(example.prompt)
        assert len(messages) == len(composition)
        assert [fields["id"] for _, fields, is_zone in composition if is_zone] == [
            z["id"] for z in example.truth
        ]
        for message, (template, _, is_zone) in zip(messages, composition):
            assert template in (family.zones if is_zone else family.distractors)
            (used_zones if is_zone else used_distractors).add(template)
            # the text itself: written by its template and by no other, of either family
            assert [t for t, p in own_patterns.items() if p.fullmatch(message)] == [template], message
            assert not any(p.fullmatch(message) for p in other_patterns), message
    assert used_zones == set(family.zones) and used_distractors == set(family.distractors)
    assert len(used_zones) >= (20 if family is SEEN else 8)


def test_pure_and_paired_across_families():
    for seed, n in [(0, 20), (7, 3), (123, 1), (10**9 + 5, 20)]:
        random.seed(1)
        seen = generate("no_fly_zones", seed, n_messages=n)
        random.seed(2)
        assert seen == generate("no_fly_zones", seed, n_messages=n)
        unseen = generate("no_fly_zones_unseen", seed, n_messages=n)
        assert unseen == generate("no_fly_zones_unseen", seed, n_messages=n)
        # same ids, zones and values in both families; only the wording differs
        assert (
            unseen.truth == seen.truth
            and unseen.answer == seen.answer
            and unseen.value_spans == seen.value_spans
        )
        assert unseen.prompt != seen.prompt


def test_unseen_prompts_vary_and_keep_their_look_alikes(composed):
    examples = [e for e, _ in composed["no_fly_zones_unseen"] if e.prompt.count("\n") == 20]
    assert len({e.prompt for e in examples}) == len(examples)
    assert {len(e.truth) for e in examples} == {1, 2, 3, 4, 5}
    look_alike = re.compile(r"WITHDRAWN|rescinded|proposed|under consultation|exempt|TEST AREA")
    assert sum(bool(look_alike.search(e.prompt)) for e in examples) > 0.9 * len(examples)


def test_distractor_weights_change_only_which_distractors_are_drawn():
    """Training's emphasis on the look-alikes the model lists as zones: the same zones, ids and values
    (one uniform draw picks a template either way), more of the weighted templates, and equal weights
    are the plain generator."""
    task = get_task("no_fly_zones")
    even = {text: 1.0 for text in ("UAS EXEMPT", "NO DRONE FLT")}
    heavy = {"UAS EXEMPT": 8.0, "NO DRONE FLT": 8.0}
    count_plain = count_heavy = 0
    for seed in range(40):
        plain = task.compose(seed, 20)
        assert task.compose(seed, 20, even) == plain
        weighted = task.compose(seed, 20, heavy)
        assert [(f, z) for _, f, z in weighted] == [(f, z) for _, f, z in plain]
        assert task.generate(seed, 20, heavy).answer == task.generate(seed, 20).answer
        count_plain += sum(any(t in m for t in heavy) for m, _, z in plain if not z)
        count_heavy += sum(any(t in m for t in heavy) for m, _, z in weighted if not z)
    assert count_heavy > 3 * count_plain > 0
    with pytest.raises(CloverError, match=r"\['NOT A TEMPLATE'\] match no distractor template"):
        task.compose(0, 20, {"NOT A TEMPLATE": 2.0})
