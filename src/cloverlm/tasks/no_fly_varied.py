"""A third family of no_fly phrasings, composed from parts rather than written: VARIED, which the training
task no_fly_zones_varied writes.

Trained on SEEN's 22 zone sentences alone, both shipped models learnt those sentences and read none of the
held-out UNSEEN family (zone exact 0.0 and 0.01 at step 535: models/README.md). VARIED writes each message
from parts: a lead or tail naming the id, a statement of what may not fly, the area with its centre in one
of several coordinate notations, the altitudes and the times, in any order, in prose or in capitals. What
stays the same over its hundreds of templates is the reading, not the sentence. Its look-alikes are made
of the same parts plus what makes them no zone (lifted, proposed, expired, rotorcraft only, drones
welcome), so an unfamiliar phrasing is no cue that a message is a zone.

It keeps clear of what makes UNSEEN unseen (no_fly_phrasings.py): none of its marker words (RPAS,
unmanned, remotely piloted, exclusion, ATIS, bulletin, advisory, ...) and none of its coordinate
notations (N47.1234 E8.1234, 47.1234N/8.1234E, lat 47.1234 lon 8.1234); tests/test_no_fly_varied.py
checks both, so no_fly_zones_unseen still measures reading a phrasing never trained on.
"""

import random
from string import Formatter

from cloverlm.tasks.no_fly_phrasings import Family

WIDEST = 166  # characters of a message at its widest fields: "20. " + 166 fits a numbered line of 170

_COORDS = (
    "{lat}N {lon}E", "{lat}N, {lon}E", "{lat} N {lon} E", "{lat}°N {lon}°E", "({lat}, {lon})",
    "latitude {lat} longitude {lon}", "{lat}N-{lon}E", "position {lat}N {lon}E",
)  # fmt: skip
_RADII = ("{radius} {unit}", "{radius}{unit}")
# what may not fly there (a zone), in prose; capitals come from `_capitals`
_BANS = (
    "drones are prohibited", "drone flights are banned", "no UAS flights", "UAV operations are not permitted",
    "quadcopters must not fly", "multicopter flights are forbidden", "no drone is to be flown",
    "small drones are not allowed", "drone operators must not fly", "flying UAS is prohibited",
    "no UAV is to operate", "camera drones are banned",
)  # fmt: skip
_AREAS = (
    "within {R} of {C}", "in a radius of {R} around {C}", "inside {R} of {C}", "{R} around {C}",
    "in the circle of {R} centred on {C}", "up to {R} from {C}", "radius {R} centred {C}",
)  # fmt: skip
_LEVELS = (
    "{lower} to {upper}", "from {lower} up to {upper}", "between {lower} and {upper}", "{lower}-{upper}",
    "altitudes {lower} to {upper}", "heights {lower}-{upper}", "height band {lower} to {upper}",
)  # fmt: skip
_TIMES = (
    "{start} to {end}", "from {start} until {end}", "active {start} to {end}", "in force {start} to {end}",
    "between {start} and {end}", "WEF {start} UNTIL {end}", "valid from {start} to {end}",
    "starting {start}, finishing {end}",
)  # fmt: skip
_LEADS = ("{id}: ", "Notice {id}: ", "[{id}] ", "Message {id} - ", "Circular {id}: ", "Drone notice {id}: ")
_TAILS = (" [{id}]", " (notice {id})", " - message {id}", " Id {id}.")
_JOINS = (", ", "; ", " - ")

# Look-alikes: the parts of a zone and what makes it none. An inactive status closes the message; a ban
# on other aircraft exempts drones; an area for drones invites them.
_INACTIVE = (
    "lifted", "cancelled", "revoked", "no longer in force", "expired", "proposed, not yet in force",
    "planned, not yet active", "suspended until further notice",
)  # fmt: skip
_OTHERS = (
    "rotorcraft flights are prohibited", "light aircraft are not permitted", "paragliding is banned",
    "gliders are not permitted", "hot air balloons must not fly",
)  # fmt: skip
_EXEMPT = ("drones exempt", "UAS are exempt", "drone flights not affected", "UAV operations unaffected")
_WELCOME = (
    "drones can fly", "drone flying is permitted", "UAS training is allowed", "quadcopter racing is open",
    "drone pilots are welcome",
)  # fmt: skip
# plain distractors: notices that share the vocabulary of place, height and time but restrict nothing
_PLAIN = (
    "crane erected at {C}, {upper} AGL", "bird activity near {C}, {lower} to {upper}",
    "fireworks display {R} around {C}", "hot air balloon launch site at {C}", "survey flight above {C}, {lower}-{upper}",
    "runway {rwy} closed for works", "taxiway {twy} closed", "tower frequency {freq} closed, use {freq2}",
    "apron works at {ad}, expect delays", "chimney lights at {C} failed",
)  # fmt: skip


def _capitals(template: str) -> str:
    """The template's literal text in capitals, its fields as they are."""
    return "".join(text.upper() + (f"{{{name}}}" if name else "") for text, name, _, _ in Formatter().parse(template))


def _sentence(rng: random.Random, clauses: list[str], status: str = "") -> str:
    """The clauses in a random order, joined, then the status, with the id as a lead or a tail, in prose
    or capitals."""
    rng.shuffle(clauses)
    body = rng.choice(_JOINS).join(clauses) + (f" - {status}" if status else "")
    body = body[0].upper() + body[1:] if body[0] != "{" else body
    if rng.random() < 0.7:
        text = rng.choice(_LEADS) + body + "."
    else:
        text = body + rng.choice(_TAILS)
    return _capitals(text) if rng.random() < 0.3 else text


def _area(rng: random.Random) -> str:
    return rng.choice(_AREAS).replace("{R}", rng.choice(_RADII)).replace("{C}", rng.choice(_COORDS))


def _zone(rng: random.Random) -> str:
    return _sentence(rng, [f"{rng.choice(_BANS)} {_area(rng)}", rng.choice(_LEVELS), rng.choice(_TIMES)])


def _look_alike(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # a drone ban that does not hold now
        clauses = [f"{rng.choice(_BANS)} {_area(rng)}", rng.choice(_LEVELS), rng.choice(_TIMES)]
        return _sentence(rng, clauses, rng.choice(_INACTIVE))
    if kind == 1:  # a ban on other aircraft, drones exempt
        return _sentence(rng, [f"{rng.choice(_OTHERS)} {_area(rng)}", rng.choice(_LEVELS), rng.choice(_TIMES),
                               rng.choice(_EXEMPT)])
    return _sentence(rng, [f"{rng.choice(_WELCOME)} {_area(rng)}", rng.choice(_LEVELS), rng.choice(_TIMES)])


def _plain(rng: random.Random) -> str:
    what = rng.choice(_PLAIN).replace("{R}", rng.choice(_RADII)).replace("{C}", rng.choice(_COORDS))
    return _sentence(rng, [what, rng.choice(_TIMES)])


_WIDEST_FIELDS = dict(id="A1234/26", ad="LSZH", lat="69.1234", lon="29.1234", radius="9.9", unit="NM", lower="200FT",
                      upper="3000FT", start="2026-12-28T23:30Z", end="2026-12-28T23:30Z", rwy="18/36",
                      freq="135.995", freq2="135.995", twy="A")  # fmt: skip


def _compose(make, count: int, seed: str) -> tuple[str, ...]:
    """`count` distinct templates from `make`, each fitting a numbered line, the same on every machine."""
    rng, out = random.Random(seed), {}
    while len(out) < count:
        template = make(rng)
        if len(template.format_map(_WIDEST_FIELDS)) <= WIDEST:
            out.setdefault(template, None)
    return tuple(out)


# A distractor pool of three look-alikes to one plain notice: SEEN's share is about half look-alikes, but
# here every look-alike is worded anew, and reading what makes it none is the skill to learn.
VARIED = Family(
    zones=_compose(_zone, 600, "varied zones"),
    distractors=_compose(_look_alike, 450, "varied look-alikes") + _compose(_plain, 150, "varied plain"),
)
