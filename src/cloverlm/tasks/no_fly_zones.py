"""Drone no-fly zones hidden among air-traffic messages.

The prompt holds numbered NOTAM-like and free-text notices; the answer lists the active drone (UAS) zones
as JSON. Every answer value is copied verbatim from its message, so the task is reading and extraction,
not unit or number-format conversion. Distractors reuse the same vocabulary (ids, coordinates, radii,
altitudes, even lifted, cancelled, proposed or helicopter-only restrictions) so that matching on shape
alone is not enough.

Real notices vary in wording, abbreviations and field order, so the messages are written in many
phrasings, split into two disjoint families (`no_fly_phrasings`): no_fly_zones, the training task, writes
only the SEEN family; no_fly_zones_unseen writes only the UNSEEN one and is never trained on, so
evaluating both tells reading the notices apart from remembering the generator's templates. For a given
(seed, n_messages) both tasks draw the same ids, zone slots and values (a template is picked with one
`rng.random()` whatever the family's size), so their scores compare like for like.
"""

import copy
import math
import random
from typing import Any

from cloverlm.errors import CloverError
from cloverlm.tasks.base import Example, dumps, mean, same, spans_of
from cloverlm.tasks.no_fly_phrasings import SEEN, Family
from cloverlm.tokenizer import parse_json

FIELDS = ("id", "lat", "lon", "radius", "unit", "lower", "upper", "start", "end")
_NUMERIC = ("lat", "lon", "radius")

# (FIR, aerodrome) pairs keep NOTAM headers plausible.
_PLACES = (
    ("LSAS", "LSZH"),
    ("EDGG", "EDDF"),
    ("LFFF", "LFPG"),
    ("EGTT", "EGLL"),
    ("LIMM", "LIMC"),
    ("LOVV", "LOWW"),
    ("EHAA", "EHAM"),
    ("EBBU", "EBBR"),
    ("LECM", "LEMD"),
    ("EPWW", "EPWA"),
)
_LOWER = ("SFC", "SFC", "100FT", "200FT")
_UPPER = ("400FT", "500FT", "1000FT", "1200FT", "2000FT", "3000FT")

# The answer's JSON schema (issue 21): the keys in FIELDS order (the instruction's), all required and
# nothing else, so a decoder under it writes every key, quote, comma and bracket without the model.
# Patterns force what `compose` and `_fields` fix: a letter, four digits and "/26"; minutes of 2026;
# SFC or whole feet (_LOWER, _UPPER). Numbers stay JSON numbers, bounded by the globe only: no
# multipleOf for the four decimals, since jsonschema's float test rejects 47.1234 as a multiple of 0.0001.
# Every value but the unit is copied from its message: those fields are grounded (issue 29,
# decoding/grounding.py), so under the grounded schema they take only values written in the prompt.
_FEET = "[1-9][0-9]{2,3}FT"
_GROUNDED = {"x-grounded": True}
_TIME = {"type": "string", "pattern": "^2026-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}Z$"} | _GROUNDED
_VALUE_SCHEMAS = {
    "id": {"type": "string", "pattern": "^[A-Z][0-9]{4}/26$"} | _GROUNDED,
    "lat": {"type": "number", "minimum": -90, "maximum": 90} | _GROUNDED,
    "lon": {"type": "number", "minimum": -180, "maximum": 180} | _GROUNDED,
    "radius": {"type": "number", "minimum": 0} | _GROUNDED,
    "unit": {"enum": ["NM", "KM"]},
    "lower": {"type": "string", "pattern": f"^(SFC|{_FEET})$"} | _GROUNDED,
    "upper": {"type": "string", "pattern": f"^{_FEET}$"} | _GROUNDED,
    "start": _TIME,
    "end": _TIME,
}
# A zone is one message: grounded as a record, its values all come from one line of the prompt.
ZONE_SCHEMA = {
    "type": "object",
    "properties": {key: _VALUE_SCHEMAS[key] for key in FIELDS},
    "required": list(FIELDS),
    "additionalProperties": False,
    "x-grounded": "line",
}

INSTRUCTION = (
    "List the active drone no-fly zones in the messages above as a JSON list, in message order, "
    "each with keys id, lat, lon, radius, unit, lower, upper, start, end."
)


def _decimal(rng: random.Random, lo: int, hi: int, places: int) -> str:
    """A decimal in [lo, hi) whose last digit is nonzero, so that the JSON number in the answer prints
    exactly as in the message (8.5410 would come back as 8.541)."""
    frac = rng.randrange(10 ** (places - 1)) * 10 + rng.randint(1, 9)
    return f"{rng.randrange(lo, hi)}.{frac:0{places}d}"


def _time(day: str, hour: int, rng: random.Random) -> str:
    return f"{day}T{hour:02d}:{rng.choice(('00', '30'))}Z"


def _fields(rng: random.Random, msg_id: str, old_id: str) -> dict[str, str]:
    """Every value any template may use; a zone message uses a subset and the answer copies from it."""
    day = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    start = rng.randint(0, 16)
    fir, ad = rng.choice(_PLACES)
    rwy = rng.randint(1, 18)
    return {
        "id": msg_id,
        "old": old_id,
        "fir": fir,
        "ad": ad,
        "lat": _decimal(rng, 36, 70, 4),
        "lon": _decimal(rng, 1, 30, 4),
        "radius": _decimal(rng, 0, 10, 1),
        "unit": rng.choice(("NM", "KM")),
        "lower": rng.choice(_LOWER),
        "upper": rng.choice(_UPPER),
        "start": _time(day, start, rng),
        "end": _time(day, rng.randint(start + 2, 23), rng),
        "rwy": f"{rwy:02d}/{rwy + 18:02d}",
        "rwy_end": f"{rwy:02d}",
        "freq": f"1{rng.randint(18, 35)}.{rng.randrange(0, 1000, 5):03d}",
        "freq2": f"1{rng.randint(18, 35)}.{rng.randrange(0, 1000, 5):03d}",
        "twy": rng.choice("ABCDEFGHKLMN"),
    }


def _zone(fields: dict[str, str]) -> dict[str, Any]:
    return {k: float(fields[k]) if k in _NUMERIC else fields[k] for k in FIELDS}


def _template_weights(pool, by_text: dict[str, float] | None) -> list[float] | None:
    if not by_text:
        return None
    unknown = [text for text in by_text if not any(text in template for template in pool)]
    if unknown:
        raise CloverError(f"distractor_weights {unknown} match no distractor template")
    return [math.prod(w for text, w in by_text.items() if text in template) for template in pool]


def _pick(pool, u: float, weights: list[float] | None):
    """The template a uniform draw u in [0, 1) picks: equal shares, or shares by weight."""
    if weights is None:
        return pool[int(u * len(pool))]
    target, cumulative = u * sum(weights), 0.0
    for template, weight in zip(pool, weights):
        cumulative += weight
        if target < cumulative:
            return template
    return pool[-1]


class NoFlyZones:
    """The task over one family of phrasings: SEEN for training (the default), UNSEEN held out."""

    def __init__(self, name: str = "no_fly_zones", family: Family = SEEN):
        self.name = name
        self.family = family

    def compose(self, seed: int, n_messages: int = 20, distractor_weights: dict[str, float] | None = None
                ) -> list[tuple[str, dict[str, str], bool]]:
        """(template, fields, is_zone) of each message, in prompt order: what `generate` writes.

        distractor_weights ({text in a template: weight}, others 1) draws those distractors more often, for
        training on the ones a model lists as zones; without it every template is equally likely. Either
        way one uniform draw picks a template, so the rest of the prompt is the same."""
        rng = random.Random(seed)
        weights = {True: None, False: _template_weights(self.family.distractors, distractor_weights)}
        # One spare id is the target of NOTAMC cancellations: it never names a message in the prompt.
        ids = [f"{rng.choice('ABCDJMW')}{n}/26" for n in rng.sample(range(1000, 10000), n_messages + 1)]
        zone_slots = set(rng.sample(range(n_messages), rng.randint(1, min(5, n_messages))))
        out = []
        for i in range(n_messages):
            fields = _fields(rng, ids[i], ids[-1])
            pool = self.family.zones if i in zone_slots else self.family.distractors
            out.append((_pick(pool, rng.random(), weights[i in zone_slots]), fields, i in zone_slots))
        return out

    def generate(self, seed: int, n_messages: int = 20, distractor_weights: dict[str, float] | None = None) -> Example:
        messages, zones, copied = [], [], []
        for template, fields, is_zone in self.compose(seed, n_messages, distractor_weights):
            if is_zone:
                zones.append(_zone(fields))
                copied += [fields[k] for k in FIELDS]
            messages.append(template.format_map(fields))
        answer = dumps(zones)
        return Example(
            task=self.name,
            seed=seed,
            prompt=format_prompt(messages),
            answer=answer,
            truth=zones,
            value_spans=spans_of(answer, copied),
        )

    def answer_schema(self, example: Example) -> dict:
        """A JSON list of zones (ZONE_SCHEMA), at most one per message: a bound that also stops a list
        running on. The same for both families: the phrasing changes, the answer does not. Only
        `example.prompt` is read, so any prompt `format_prompt` writes (the demo's own messages) has one."""
        return zones_schema(len(prompt_messages(example.prompt)))

    def check(self, example: Example, output: str) -> dict[str, float]:
        truth = example.truth
        parsed = parse_json(output, "[")
        pred = parse_zones(output)
        matched = [next((p for p in pred if same(p.get("id"), t["id"])), {}) for t in truth]
        scores = {"parsed": float(parsed is not None)}
        if truth:
            scores |= {f"field/{f}": mean(same(m.get(f), t[f]) for m, t in zip(matched, truth)) for f in FIELDS}
            scores["zone_exact_match"] = sum(same(m, t) for m, t in zip(matched, truth)) / max(len(truth), len(pred))
        else:  # no zone to find: right exactly when the answer is the empty list
            right = float(parsed == [])
            scores |= {f"field/{f}": right for f in FIELDS} | {"zone_exact_match": right}
        scores["count"] = float(len(pred) == len(truth))
        scores["exact"] = float(same(parsed, truth))
        return scores


def zones_schema(n_messages: int) -> dict:
    """The answer's schema for a prompt of `n_messages` messages: a list of at most that many zones."""
    return {"type": "array", "items": copy.deepcopy(ZONE_SCHEMA), "maxItems": n_messages}


def format_prompt(messages: list[str]) -> str:
    """The task's prompt for `messages` (one line each): numbered from 1, then the instruction."""
    return "\n".join([*(f"{number}. {message}" for number, message in enumerate(messages, 1)), INSTRUCTION])


def prompt_messages(prompt: str) -> list[str]:
    """The messages of a prompt made by `format_prompt`, without their numbers."""
    return [line.partition(". ")[2] for line in prompt.split("\n")[:-1]]


def parse_zones(text: str) -> list[dict]:
    """The zone objects of the first JSON list in `text`; [] if there is none."""
    parsed = parse_json(text, "[")
    return [z for z in parsed if isinstance(z, dict)] if isinstance(parsed, list) else []
