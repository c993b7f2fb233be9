"""no_fly_zones_varied: the composed training family (tasks/no_fly_varied.py) writes exact, verbatim
answers, the same zones as the other families for a seed, and nothing that makes UNSEEN unseen."""

import hashlib
import random
import re
from string import Formatter

import pytest

from cloverlm.tasks import SUITE, TASKS, TRAIN_ONLY, generate, get_task
from cloverlm.tasks.no_fly_phrasings import SEEN, UNSEEN, template_fields, template_pattern
from cloverlm.tasks.no_fly_varied import VARIED, WIDEST
from cloverlm.tasks.no_fly_zones import FIELDS, prompt_messages
from cloverlm.training.conversion.data import TASK_SOURCES, sample_task_example


def words(template: str) -> set[str]:
    return {w.lower() for text, *_ in Formatter().parse(template) for w in re.findall(r"[A-Za-z]+", text)}


def family_words(family) -> set[str]:
    return set().union(*map(words, family.zones + family.distractors))


def test_a_training_source_outside_the_tokenizer_text_and_the_suite():
    task = get_task("no_fly_zones_varied")
    assert task.family is VARIED and TRAIN_ONLY == {"no_fly_zones_varied": task}
    assert "no_fly_zones_varied" not in TASKS and "no_fly_zones_varied" not in SUITE
    assert "no_fly_zones_varied" in TASK_SOURCES


def test_templates_name_every_answer_field_and_fit_a_line():
    assert len(set(VARIED.zones)) == len(VARIED.zones) >= 500
    assert len(set(VARIED.distractors)) == len(VARIED.distractors) >= 500
    widest = dict(id="A1234/26", ad="LSZH", lat="69.1234", lon="29.1234", radius="9.9", unit="NM", lower="200FT",
                  upper="3000FT", start="2026-12-28T23:30Z", end="2026-12-28T23:30Z", rwy="18/36", freq="135.995",
                  freq2="135.995", twy="A")  # fmt: skip
    for template in VARIED.zones:
        assert template_fields(template) == set(FIELDS), template
    for template in VARIED.zones + VARIED.distractors:
        assert template_fields(template) <= set(widest) and len(template.format_map(widest)) <= WIDEST, template
    # look-alikes: most distractors carry a radius around coordinates, like a zone
    assert sum({"radius", "lat", "lon"} <= template_fields(t) for t in VARIED.distractors) >= 400


def test_the_same_templates_on_every_machine():
    """A resumed run must see the batches it would have seen: a change to the parts changes this digest,
    and must come with a new run (or the mixture's deliberate change, trainer.RESUME_MAY_CHANGE)."""
    digest = hashlib.sha256("\n".join(VARIED.zones + VARIED.distractors).encode()).hexdigest()[:16]
    assert digest == "c68c305756134690"


def test_keeps_clear_of_what_makes_unseen_unseen():
    """No word of UNSEEN that no SEEN template uses, no UNSEEN coordinate notation, and no message that
    an UNSEEN template could have written (nor the other way round)."""
    unseen_only = family_words(UNSEEN) - family_words(SEEN)
    assert not family_words(VARIED) & unseen_only, sorted(family_words(VARIED) & unseen_only)
    for template in VARIED.zones + VARIED.distractors:
        assert not re.search(r"N\{lat\}|\{lat\}N/|\blat \{lat\}", template, re.IGNORECASE), template
    # each unseen zone still has words that no training template (SEEN or VARIED) uses
    trained = family_words(SEEN) | family_words(VARIED)
    assert all(len(words(t) - trained) >= 4 for t in UNSEEN.zones)
    varied = [template_pattern(t) for t in VARIED.zones + VARIED.distractors]
    unseen = [template_pattern(t) for t in UNSEEN.zones + UNSEEN.distractors]
    for seed in range(30):
        for name, others in (("no_fly_zones_unseen", varied), ("no_fly_zones_varied", unseen)):
            for message in prompt_messages(generate(name, seed).prompt):
                assert not any(p.fullmatch(message) for p in others), (name, message)


@pytest.mark.parametrize("seed,n", [(seed, 1 + seed % 20) for seed in range(60)] + [(seed, 20) for seed in range(60)])
def test_answers_are_the_seen_family_s_and_copied_verbatim(seed, n):
    """Same ids, zones and values as no_fly_zones for a seed (one uniform draw picks a template whatever
    the family's size), each value written in its own message."""
    task = get_task("no_fly_zones_varied")
    example = task.generate(seed, n)
    seen = generate("no_fly_zones", seed, n_messages=n)
    assert (example.truth, example.answer, example.value_spans) == (seen.truth, seen.answer, seen.value_spans)
    assert example.prompt != seen.prompt and task.check(example, example.answer)["exact"] == 1.0
    messages = prompt_messages(example.prompt)
    for (template, fields, is_zone), message in zip(task.compose(seed, n), messages):
        assert template in (VARIED.zones if is_zone else VARIED.distractors)
        if is_zone:
            for field in FIELDS:  # a number not inside a longer one (61.8719 in 161.87195)
                alone = rf"(?<![\d.]){re.escape(fields[field])}(?!\d|\.\d)" if field in ("lat", "lon", "radius") else None
                assert re.search(alone, message) if alone else fields[field] in message, (field, message)


def test_training_draws_it_at_both_sizes_without_the_seen_weights():
    rng = random.Random(0)
    sizes = {len(prompt_messages(sample_task_example("no_fly_zones_varied", rng, 0.5, {"UAS EXEMPT": 2.0}).prompt))
             for _ in range(40)}  # fmt: skip
    assert 20 in sizes and len(sizes) > 5
